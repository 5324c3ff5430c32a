"""Reading the peer's raw truth (``OUT/raw/rankN``) and merging TP shards, for the swift peer tests.

Merge rule (megatron-core 0.12.1, see the layout reference): a parameter marked
``tensor_model_parallel`` is concatenated along its ``partition_dim``, except the gated
``linear_fc1`` whose rank r holds [gate_r; up_r]: ``stack(S_r).view(TP, 2, f/TP, h)`` then
[gate; up]. Unmarked parameters are replicated: after finalize any rank; before finalize a
sequence-parallel norm holds a partial sum (add the ranks). mcore -> HF (TP 1 layout):
``linear_qkv`` rows are, per query group, its q heads then its k head then its v head.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

PREFIX = "module.module."


def load_rank(out_dir: str, rank: int) -> dict:
    d = os.path.join(out_dir, "raw", f"rank{rank}")
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    r = {k: load_file(os.path.join(d, f"{k}.safetensors")) for k in ("weights", "grads_pre", "grads_post", "batch")}
    r["meta"] = meta
    return r


def load_ranks(out_dir: str) -> list[dict]:
    ranks = []
    while os.path.exists(os.path.join(out_dir, "raw", f"rank{len(ranks)}", "meta.json")):
        ranks.append(load_rank(out_dir, len(ranks)))
    return ranks


def merge(ranks: list[dict], kind: str, partial_sum: bool = False) -> dict:
    """TP shards of ``kind`` (weights, grads_pre, grads_post) -> the TP 1 mcore layout. Replicated
    tensors: rank 0's copy, or the sum over ranks with ``partial_sum``."""
    out = {}
    layout = ranks[0]["meta"]["params"]
    tp = len(ranks)
    for name, lay in layout.items():
        shards = [r[kind][name].double() for r in ranks]
        if not lay["tensor_model_parallel"]:
            out[name] = sum(shards) if partial_sum else shards[0]
        elif name.endswith("mlp.linear_fc1.weight"):
            f_tp, h = shards[0].shape[0] // 2, shards[0].shape[1]
            fc1 = torch.stack(shards).view(tp, 2, f_tp, h)  # (TP, [gate, up], f/TP, h)
            out[name] = torch.cat([fc1[:, 0].reshape(-1, h), fc1[:, 1].reshape(-1, h)])
        else:
            out[name] = torch.cat(shards, dim=lay["partition_dim"])
    return out


def mcore_to_hf(t: dict, text: dict) -> dict:
    """TP 1 mcore tensors (names with ``module.module.``) -> transformers' Qwen3-VL names."""
    np_, ng, d = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    out = {}
    for name, v in t.items():
        n = name[len(PREFIX):]
        if n.startswith("visual.visual."):
            out["model.visual." + n[len("visual.visual."):]] = v
            continue
        n = n[len("language_model."):]
        lm = "model.language_model."
        if n == "embedding.word_embeddings.weight":
            out[lm + "embed_tokens.weight"] = v
        elif n == "output_layer.weight":
            out["lm_head.weight"] = v
        elif n == "decoder.final_layernorm.weight":
            out[lm + "norm.weight"] = v
        else:
            _, _, i, rest = n.split(".", 3)
            p = f"{lm}layers.{i}."
            if rest == "self_attention.linear_qkv.weight":
                h = v.shape[1]
                qkv = v.view(ng, (np_ // ng + 2) * d, h)  # (groups, [q heads, k, v] * d, h)
                out[p + "self_attn.q_proj.weight"] = qkv[:, : np_ // ng * d].reshape(np_ * d, h)
                out[p + "self_attn.k_proj.weight"] = qkv[:, np_ // ng * d : np_ // ng * d + d].reshape(ng * d, h)
                out[p + "self_attn.v_proj.weight"] = qkv[:, -d:].reshape(ng * d, h)
            elif rest == "mlp.linear_fc1.weight":
                gate, up = v.chunk(2)  # TP 1 layout: [gate; up]
                out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
            else:
                hf = {"input_layernorm.weight": "input_layernorm.weight",
                      "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
                      "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
                      "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
                      "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
                      "mlp.linear_fc2.weight": "mlp.down_proj.weight"}[rest]  # fmt: skip
                out[p + hf] = v
    return out


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a, b = a.double(), b.double()
    nb = b.norm().item()
    return (a - b).norm().item() / nb if nb else (a - b).norm().item()
