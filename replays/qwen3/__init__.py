"""Recipe for Qwen3 text models (transformers' ``Qwen3ForCausalLM``), the language half of
Qwen3-VL; used for Megatron-core captures of text-only models."""

from .recipe import Qwen3Recipe

__all__ = ["Qwen3Recipe"]
