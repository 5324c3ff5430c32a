"""Model-family recipes, declared as ``oracle.replays`` entry points in pyproject.toml (see README.md)."""
