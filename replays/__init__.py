"""Model-family recipes. Importing this package registers every recipe with ``oracle.recipe``."""

from . import qwen3, qwen3_vl  # noqa: F401
