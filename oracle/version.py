"""The package version, in one place (the face re-exports it; bundles and journals record it)."""

__version__ = "0.1.0"
