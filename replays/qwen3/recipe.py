"""Qwen3 (text): build, load, order, and the Megatron-core name map."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from oracle.bundle.weights import SafetensorsDir
from oracle.capture.packing import pack
from oracle.capture.samples import read_sample
from oracle.errors import RecipeError
from oracle.recipe import ModelSource, Recipe
from oracle.replay.attention import keep_sdpa_fused
from oracle.replay.loss import causal_lm_loss, lm_head_loss, masked_token_loss

from . import flavors

SAMPLE = Path(__file__).with_name("sample.jsonl")


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


#: mcore sub-module of a decoder layer -> its HF module (oracle/integrations/megatron/boundaries.py ROLES)
SUBMODULES = {"": "", ".self_attention": ".self_attn", ".self_attention.q_layernorm": ".self_attn.q_norm",
              ".self_attention.k_layernorm": ".self_attn.k_norm", ".mlp": ".mlp", ".input_layernorm": ".input_layernorm",
              ".pre_mlp_layernorm": ".post_attention_layernorm"}  # fmt: skip


def megatron_modules(mcore_layer: str, hf_layer: str) -> dict[str, str]:
    """A decoder layer's module templates and its sub-modules' (boundaries a Megatron rank records)."""
    return {mcore_layer + mc: hf_layer + hf for mc, hf in SUBMODULES.items()}


class Qwen3Recipe(Recipe):
    name = "qwen3"
    embedded = tuple(flavors.FLAVORS)
    megatron_names = MEGATRON_NAMES
    megatron_modules = megatron_modules("decoder.layers.{i}", "model.layers.{i}")
    residual_branches = r"^(self_attn|mlp)$"  # a decoder layer: h + attn(norm(h)), then + mlp(norm(.))
    fusable = {"Qwen3RMSNorm": "rms_norm", "Qwen3MLP": "swiglu_mlp",  # oracle/replay/fused.py
               "transformers.models.qwen3.modeling_qwen3.apply_rotary_pos_emb": "rotary"}  # fmt: skip

    def accepts(self, hf_config: dict[str, Any]) -> bool:
        return hf_config.get("model_type") == "qwen3"

    def build(self, config: dict[str, Any]) -> nn.Module:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(**{k: v for k, v in config.items() if k != "model_type"})
        cfg._attn_implementation = "sdpa"
        keep_sdpa_fused()  # torch 2.8: grouped-query sdpa the one fused CPU op too (oracle/replay/attention.py)
        cfg.use_cache = False
        return Qwen3ForCausalLM(cfg)

    def load(self, spec: str) -> ModelSource:
        from .. import tiny

        if spec in flavors.FLAVORS:
            config = json.loads(json.dumps(flavors.FLAVORS[spec]))
            weights = tiny.tiny_weights(self.build, config)
            return ModelSource(self, config, weights, origin=f"embedded:{spec}",
                               extra={"tokenizer": tiny.tiny_tokenizer(), "special_ids": tiny.SPECIAL_IDS})  # fmt: skip
        path = Path(spec)
        config = json.loads((path / "config.json").read_text())
        extra: dict[str, Any] = {}
        if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            from transformers import AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            except (OSError, ValueError) as e:
                raise RecipeError(f"{path}: cannot load the tokenizer ({e})") from e
            extra = {"tokenizer": tok, "special_ids": {t: tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")}}
        return ModelSource(self, config, SafetensorsDir(path), origin=str(path), extra=extra)

    def default_sample(self) -> dict[str, Any]:
        return read_sample(str(SAMPLE))

    def prepare_inputs(self, source: ModelSource, model: nn.Module, sample: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Qwen's chat format, labels on the assistant turns (the same tokenisation as Qwen3-VL's, with
        no image): input_ids (1, T), labels (1, T), position_ids (1, T)."""
        from ..qwen3_vl.inputs import build_inputs

        if "tokenizer" not in source.extra:
            raise RecipeError(f"{source.origin} has no tokenizer files; a sample cannot be tokenised for it")
        if sample.get("images"):
            raise RecipeError("qwen3 is a text model but the sample has images; use a Qwen3-VL model")
        no_images = SimpleNamespace(merge_size=1)  # never called: the sample has no image
        out = build_inputs(sample, source.extra["tokenizer"], no_images, model, source.extra["special_ids"])
        out["position_ids"] = out["position_ids"][0].contiguous()  # text only: the three mRoPE rows are equal
        return out

    def pack_inputs(self, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Positions restart per sample (each part's are 0..l-1 already): (1, T) restarting ids."""
        return pack(parts, seq_keys=("input_ids", "labels", "position_ids"))

    def forward_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor], reduction: str) -> tuple[torch.Tensor, int]:
        ids = inputs["tokens"] if "tokens" in inputs else inputs["input_ids"]
        hidden = model.model(input_ids=ids, position_ids=inputs.get("position_ids")).last_hidden_state  # (B, T, H)
        return lm_head_loss(model.lm_head, hidden, inputs["labels"], reduction, inputs.get("loss_mask"))

    def megatron_layer_call(self, hidden_states, position_embeddings, inputs, attention_mask):
        """As ``Qwen3Model.forward`` calls each layer: the shared rotary tables, the mask (None:
        causal; packed: per sample) and the positions (0..T-1 by default)."""
        pos = inputs.get("position_ids")
        if pos is None:
            pos = torch.arange(hidden_states.shape[1]).unsqueeze(0)
        return (hidden_states,), {
            "attention_mask": attention_mask,
            "position_ids": pos,
            "position_embeddings": position_embeddings,
        }

    def loss_from_logits(self, logits, inputs, reduction):
        if "loss_mask" in inputs:  # Megatron batch: labels pre-shifted, float mask
            return masked_token_loss(logits, inputs["labels"], inputs["loss_mask"], reduction)
        return causal_lm_loss(logits, inputs["labels"], reduction)

    def boundaries(self) -> dict[str, str]:
        return {"layers": r"^model\.layers\.\d+$", "head": r"^lm_head$"}

    def stream_token_modules(self) -> str:
        return r"^model\.layers\.\d+\.mlp$"

    def stream_units(self) -> str:
        return r"^model\.(layers\.\d+|embed_tokens)$"

    def layer_key(self, name: str) -> tuple[tuple[int, int], str] | None:
        return text_layer_key(name, "model.")
