"""Qwen3 (text): build, load, order, and the Megatron-core name map."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from oracle.errors import RecipeError
from oracle.loss import causal_lm_loss, masked_token_loss
from oracle.recipe import ModelSource, Recipe, register
from oracle.weights import SafetensorsDir

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

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


@register
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

    def layers(self, names: list[str], config: dict[str, Any]) -> list[tuple[str, list[str]]]:
        def key(n: str):
            if n.startswith("lm_head."):
                return (0, 0), "lm_head"
            if n.startswith("model.norm."):
                return (1, 0), "norm"
            if m := _LAYER.match(n):
                return (2, -int(m[1])), f"layers.{m[1]}"
            if n.startswith("model.embed_tokens."):
                return (3, 0), "embed_tokens"
            return (4, 0), "other"

        groups: dict[str, tuple] = {}
        for n in names:
            k, lab = key(n)
            groups.setdefault(lab, (k, []))[1].append(n)
        return [(lab, ns) for lab, (k, ns) in sorted(groups.items(), key=lambda kv: kv[1][0])]
