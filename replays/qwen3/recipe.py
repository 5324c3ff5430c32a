"""Qwen3 (text): build, load, order, and the Megatron-core name map."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from oracle.errors import RecipeError
from oracle.loss import causal_lm_loss, masked_token_loss
from oracle.recipe import ModelSource, Recipe
from oracle.weights import SafetensorsDir


def text_layer_key(name: str, prefix: str) -> tuple[tuple[int, int], str] | None:
    """Backward order of a Qwen3 decoder whose modules sit under ``prefix`` (``model.`` for Qwen3,
    ``model.language_model.`` for Qwen3-VL): lm_head, final norm, layers last to first, embeddings."""
    if name.startswith("lm_head."):
        return (0, 0), "lm_head"
    if name.startswith(prefix + "norm."):
        return (1, 0), "norm"
    if name.startswith(prefix + "layers."):
        i = int(name[len(prefix) + 7 :].split(".", 1)[0])
        return (2, -i), f"layers.{i}"
    if name.startswith(prefix + "embed_tokens."):
        return (3, 0), "embed_tokens"
    return None


# mcore name (without DDP "module." prefixes) -> HF name; {i} is the layer index.
MEGATRON_NAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
    "decoder.layers.{i}.self_attention.linear_qkv.weight": "model.layers.{i}.self_attn.{q,k,v}_proj.weight",
    "decoder.layers.{i}.self_attention.linear_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "decoder.layers.{i}.self_attention.q_layernorm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "decoder.layers.{i}.self_attention.k_layernorm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight": "model.layers.{i}.input_layernorm.weight",
    "decoder.layers.{i}.input_layernorm.weight": "model.layers.{i}.input_layernorm.weight",
    "decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight": "model.layers.{i}.post_attention_layernorm.weight",
    "decoder.layers.{i}.pre_mlp_layernorm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "decoder.layers.{i}.mlp.linear_fc1.weight": "model.layers.{i}.mlp.{gate,up}_proj.weight",
    "decoder.layers.{i}.mlp.linear_fc2.weight": "model.layers.{i}.mlp.down_proj.weight",
}


class Qwen3Recipe(Recipe):
    name = "qwen3"
    embedded = ()
    megatron_names = MEGATRON_NAMES

    def accepts(self, hf_config: dict[str, Any]) -> bool:
        return hf_config.get("model_type") == "qwen3"

    def build(self, config: dict[str, Any]) -> nn.Module:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(**{k: v for k, v in config.items() if k != "model_type"})
        cfg._attn_implementation = "sdpa"
        cfg.use_cache = False
        return Qwen3ForCausalLM(cfg)

    def load(self, spec: str) -> ModelSource:
        path = Path(spec)
        config = json.loads((path / "config.json").read_text())
        return ModelSource(self, config, SafetensorsDir(path), origin=str(path))

    def default_sample(self) -> dict[str, Any]:
        raise RecipeError("the qwen3 recipe has no embedded sample; it replays Megatron captures (oracle merge)")

    def forward_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor], reduction: str) -> tuple[torch.Tensor, int]:
        ids = inputs["tokens"] if "tokens" in inputs else inputs["input_ids"]
        logits = model(input_ids=ids, position_ids=inputs.get("position_ids")).logits  # (B, T, V)
        return self.loss_from_logits(logits, inputs, reduction)

    def loss_from_logits(self, logits, inputs, reduction):
        if "loss_mask" in inputs:  # Megatron batch: labels pre-shifted, float mask
            return masked_token_loss(logits, inputs["labels"], inputs["loss_mask"], reduction)
        return causal_lm_loss(logits, inputs["labels"], reduction)

    def boundaries(self) -> dict[str, str]:
        return {"layers": r"^model\.layers\.\d+$", "head": r"^lm_head$"}

    def layer_key(self, name: str) -> tuple[tuple[int, int], str] | None:
        return text_layer_key(name, "model.")
