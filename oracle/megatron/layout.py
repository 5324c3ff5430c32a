"""Megatron-core tensor-parallel layouts, both ways: TP shards -> one full tensor per HF name
(merge), and a full HF tensor -> the shard a TP rank holds (rank view). S_r is rank r's shard.

| kind  | mcore parameter                         | merge                                                     |
|-------|-----------------------------------------|-----------------------------------------------------------|
| qkv   | self_attention.linear_qkv.{weight,bias} | cat(S_r, 0).view(ng, (np/ng + 2) d, ...): per query group |
|       |                                         | its np/ng q heads, then its k head, then its v head       |
| fc1   | mlp.linear_fc1.weight (SwiGLU)          | stack(S_r).view(TP, 2, f/TP, h): [gate_r ; up_r] per rank |
|       |                                         | (not cat(S_r).chunk(2): that interleaves ranks wrongly)   |
| row   | linear_proj, linear_fc2 (dim 1)         | cat(S_r, 1)                                               |
| vocab | word_embeddings, output_layer (dim 0)   | cat(S_r, 0)[:V] (the vocab is padded to a multiple of TP) |
| norm  | *layernorm*, *layer_norm_weight         | one copy; gradients before finalize are partial sums      |
| split | anything else marked tensor_model_parallel | cat(S_r, partition_dim)                                |
| copy  | anything else                           | rank 0's copy                                             |
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

NORM_RX = re.compile(r"(layernorm|layer_norm_weight|_norm\.weight$|\.norm\d*\.)")
HEAD_NORM_RX = re.compile(r"(q_layernorm|k_layernorm)")


@dataclass(frozen=True)
class Heads:
    np: int  # query heads
    ng: int  # query groups (KV heads)
    d: int  # head dim

    @classmethod
    def from_config(cls, cfg: dict) -> Heads:
        np_ = int(cfg["num_attention_heads"])
        ng = int(cfg.get("num_query_groups") or np_)
        d = int(cfg.get("kv_channels") or cfg["hidden_size"] // np_)
        return cls(np_, ng, d)

    @classmethod
    def from_hf(cls, hf: dict) -> Heads:
        t = hf.get("text_config") or hf
        np_ = int(t["num_attention_heads"])
        return cls(np_, int(t.get("num_key_value_heads") or np_), int(t.get("head_dim") or t["hidden_size"] // np_))

    def as_config(self) -> dict:
        return {"num_attention_heads": self.np, "num_query_groups": self.ng, "kv_channels": self.d}


def kind_of(name: str, layout: dict) -> str:
    if name.endswith("linear_qkv.layer_norm_weight") or name.endswith("linear_fc1.layer_norm_weight"):
        return "norm"
    if re.search(r"linear_qkv\.(weight|bias)$", name):
        return "qkv"
    if name.endswith("linear_fc1.weight") and layout.get("gated", True):
        return "fc1"
    if re.search(r"(linear_proj|linear_fc2)\.weight$", name):
        return "row"
    if re.search(r"(word_embeddings|output_layer)\.weight$", name):
        return "vocab"
    if NORM_RX.search(name) and not layout.get("tensor_model_parallel"):
        return "norm"
    if layout.get("tensor_model_parallel"):
        return "split"
    return "copy"


# -- shards -> full ---------------------------------------------------------------------------
def merge_qkv(shards: list[torch.Tensor], heads: Heads) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    full = torch.cat(shards, 0)
    rest = full.shape[1:]
    per_group = heads.np // heads.ng
    qkv = full.reshape(heads.ng, (per_group + 2) * heads.d, *rest)  # (ng, (np/ng + 2) d, h)
    q = qkv[:, : per_group * heads.d].reshape(heads.np * heads.d, *rest)
    k = qkv[:, per_group * heads.d : (per_group + 1) * heads.d].reshape(heads.ng * heads.d, *rest)
    v = qkv[:, (per_group + 1) * heads.d :].reshape(heads.ng * heads.d, *rest)
    return q, k, v


def merge_fc1(shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    tp = len(shards)
    rows, h = shards[0].shape
    fc1 = torch.stack(shards).reshape(tp, 2, rows // 2, h)  # (TP, [gate, up], f/TP, h)
    return fc1[:, 0].reshape(-1, h), fc1[:, 1].reshape(-1, h)


def merge_tensor(kind: str, shards: list[torch.Tensor], *, heads: Heads, vocab: int | None, dim: int = 0):
    """-> a tuple of full tensors (three for qkv, two for fc1, else one)."""
    if kind == "qkv":
        return merge_qkv(shards, heads)
    if kind == "fc1":
        return merge_fc1(shards)
    if kind == "row":
        return (torch.cat(shards, 1),)
    if kind == "vocab":
        full = torch.cat(shards, 0)
        return (full[:vocab] if vocab else full,)
    if kind == "split":
        return (torch.cat(shards, dim),)
    return (shards[0],)


# -- full -> shard of rank r -------------------------------------------------------------------
def shard_of(kind: str, parts: list[torch.Tensor], *, tp: int, rank: int, heads: Heads, dim: int = 0) -> torch.Tensor:
    if kind == "qkv":
        q, k, v = parts
        rest = q.shape[1:]
        per_group = heads.np // heads.ng
        full = torch.cat([q.reshape(heads.ng, per_group * heads.d, *rest), k.reshape(heads.ng, heads.d, *rest),
                          v.reshape(heads.ng, heads.d, *rest)], 1).reshape(-1, *rest)  # fmt: skip
        return full.chunk(tp, 0)[rank]
    if kind == "fc1":
        gate, up = parts
        return torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]], 0)
    if kind == "row":
        return parts[0].chunk(tp, 1)[rank]
    if kind == "vocab":
        full = parts[0]
        pad = (-full.shape[0]) % tp
        if pad:  # rows Megatron adds to reach a multiple of TP: unknown to the oracle, NaN here
            full = torch.cat([full, full.new_full((pad, *full.shape[1:]), float("nan"))], 0)
        return full.chunk(tp, 0)[rank]
    if kind == "split":
        return parts[0].chunk(tp, dim)[rank]
    return parts[0]
