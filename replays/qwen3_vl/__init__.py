"""Recipe for Qwen3-VL: see recipe.py (what the engine calls) and flavors.py (the tiny models)."""

from .recipe import Qwen3VLRecipe

__all__ = ["Qwen3VLRecipe"]
