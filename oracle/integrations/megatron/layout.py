"""Megatron-core tensor-parallel layouts, both ways: TP shards -> one full tensor per HF name
(merge), and a full HF tensor -> the shard a TP rank holds (rank view). S_r is rank r's shard.

| kind  | mcore parameter                         | merge                                                     |
|-------|-----------------------------------------|-----------------------------------------------------------|
| qkv   | self_attention.linear_qkv.{weight,bias} | cat(S_r, 0).view(ng, (np/ng + 2) d, ...): per query group |
|       |                                         | its np/ng q heads, then its k head, then its v head       |
| fc1   | mlp.linear_fc1.weight (SwiGLU)          | stack(S_r).view(TP, 2, f/TP, h): [gate_r ; up_r] per rank |
|       |                                         | (not cat(S_r).chunk(2): that interleaves ranks wrongly)   |
| row   | linear_proj, linear_fc2 (dim 1)         | cat(S_r, 1)                                               |
| vocab | word_embeddings, output_layer (dim 0)   | cat(S_r, 0), all Vp rows kept (the padded vocabulary)     |
| norm  | *layernorm*, *layer_norm_weight         | one copy; gradients before finalize may be partial sums   |
| split | anything else marked tensor_model_parallel | cat(S_r, partition_dim)                                |
| replica | a transformers module the hook found replicated (by the model's structure, never by name) | rank 0's copy (gradients: replicas.py) |
| copy  | anything else                           | rank 0's copy                                             |

Padded vocabulary (megatron/training/tokenizer ``_vocab_size_with_padding``):
    Vp = ceil(V / (make_vocab_size_divisible_by * TP)) * make_vocab_size_divisible_by * TP
rank r holds rows [r Vp/TP, (r+1) Vp/TP). The Vp - V padded rows are real parameters: their
logits enter the vocab-parallel softmax and they receive gradients, so they are kept.

Partial sums before ``finalize_model_grads`` (``_allreduce_layernorm_grads``), the one rule
(``partial_sum``) that merge, rank view, norm logs and msprobe imports use: with TP > 1 a
replicated gradient is a per-rank partial sum when its name holds ``q_layernorm``/``k_layernorm``
(over the rank's heads) or when the parameter carries Megatron's ``sequence_parallel`` mark (over
the rank's sequence chunk). Where the mark is unknown (logs, dumps) it is inferred from the name:
under SP every decoder norm weight carries it; vision-tower norms do not.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ...errors import BundleError

NORM_RX = re.compile(r"(layernorm|layer_norm_weight|_norm\.weight$|\.norm\d*\.)")
HEAD_NORM_RX = re.compile(r"(q_layernorm|k_layernorm|\.q_norm\.|\.k_norm\.)")
VISION_RX = re.compile(r"(^|\.)visual\.")
VOCAB_DIVISIBLE_BY = 128  # Megatron's --make-vocab-size-divisible-by default


def padded_vocab(vocab: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Megatron's padded vocabulary size for ``vocab`` tokens at tensor-parallel size ``tp``."""
    m = divisible_by * tp
    return math.ceil(vocab / m) * m


def partial_sum(name: str, *, tp: int, sp: bool = False, marked: bool | None = None) -> str | None:
    """How a replicated gradient is split over TP ranks before finalize: ``"heads"`` (q/k
    layernorm: each rank's heads), ``"tokens"`` (parameters marked ``sequence_parallel``: each
    rank's sequence chunk; ``marked=None`` infers the mark from the name under ``sp``), or None
    (complete on every rank)."""
    if tp <= 1:
        return None
    if HEAD_NORM_RX.search(name):
        return "heads"
    if marked is None:
        marked = sp and bool(NORM_RX.search(name)) and not VISION_RX.search(name)
    return "tokens" if marked else None


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

    def check(self, tp: int) -> None:
        """Megatron's own constraints: query heads per group whole, query groups whole per TP rank."""
        if self.np % self.ng or self.ng % tp:
            raise BundleError(
                f"{self.np} query heads in {self.ng} query groups do not split over TP {tp} (each rank holds whole "
                "query groups); the recorded or given config is not this run's: check num_attention_heads, "
                "num_query_groups / num_key_value_heads"
            )


def kind_of(name: str, layout: dict) -> str:
    if layout.get("replica"):  # a transformers module held whole on every TP rank (hook: runinfo.param_origins)
        return "replica"
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
    if full.shape[0] != heads.ng * (per_group + 2) * heads.d:
        raise BundleError(
            f"fused qkv of {full.shape[0]} rows does not hold {heads.np} query heads and {heads.ng} query groups of "
            f"{heads.d} ((np + 2 ng) d = {(heads.np + 2 * heads.ng) * heads.d} rows); the head config is not this run's"
        )
    qkv = full.reshape(heads.ng, (per_group + 2) * heads.d, *rest)  # (ng, (np/ng + 2) d, h)
    q = qkv[:, : per_group * heads.d].reshape(heads.np * heads.d, *rest)
    k = qkv[:, per_group * heads.d : (per_group + 1) * heads.d].reshape(heads.ng * heads.d, *rest)
    v = qkv[:, (per_group + 1) * heads.d :].reshape(heads.ng * heads.d, *rest)
    return q, k, v


def merge_fc1(shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    tp = len(shards)
    rows, h = shards[0].shape
    if rows % 2:
        raise BundleError(f"gated linear_fc1 shard of {rows} rows cannot hold [gate ; up] halves")
    fc1 = torch.stack(shards).reshape(tp, 2, rows // 2, h)  # (TP, [gate, up], f/TP, h)
    return fc1[:, 0].reshape(-1, h), fc1[:, 1].reshape(-1, h)


def merge_tensor(kind: str, shards: list[torch.Tensor], *, heads: Heads, dim: int = 0):
    """-> a tuple of full tensors (three for qkv, two for fc1, else one); vocab keeps every padded row."""
    if kind == "qkv":
        return merge_qkv(shards, heads)
    if kind == "fc1":
        return merge_fc1(shards)
    if kind == "row":
        return (torch.cat(shards, 1),)
    if kind == "vocab":
        return (torch.cat(shards, 0),)
    if kind == "split":
        return (torch.cat(shards, dim),)
    return (shards[0],)


# -- full -> shard of rank r -------------------------------------------------------------------
def shard_of(kind: str, parts: list[torch.Tensor], *, tp: int, rank: int, heads: Heads, dim: int = 0,
             vocab_rows: int | None = None) -> torch.Tensor:  # fmt: skip
    """Rank ``rank``'s shard at TP ``tp``. ``vocab_rows``: the padded vocabulary that run used (default:
    the truth's own rows, which must then split evenly); rows beyond the truth's are unknown (NaN)."""
    if kind == "qkv":
        q, k, v = parts
        rest = q.shape[1:]
        per_group = heads.np // heads.ng
        full = torch.cat([q.reshape(heads.ng, per_group * heads.d, *rest), k.reshape(heads.ng, heads.d, *rest),
                          v.reshape(heads.ng, heads.d, *rest)], 1).reshape(-1, *rest)  # fmt: skip
        return _even(full, tp, 0)[rank]
    if kind == "fc1":
        gate, up = parts
        return torch.cat([_even(gate, tp, 0)[rank], _even(up, tp, 0)[rank]], 0)
    if kind == "row":
        return _even(parts[0], tp, 1)[rank]
    if kind == "vocab":
        full = parts[0]
        rows = vocab_rows or full.shape[0]
        if rows % tp:
            raise BundleError(f"a vocabulary of {rows} rows does not split over TP {tp}; give the run's padded vocabulary")
        if rows > full.shape[0]:  # padded rows the truth does not hold: unknown, NaN here
            full = torch.cat([full, full.new_full((rows - full.shape[0], *full.shape[1:]), float("nan"))], 0)
        per = rows // tp
        return full[rank * per : (rank + 1) * per]
    if kind == "split":
        return _even(parts[0], tp, dim)[rank]
    return parts[0]


def _even(t: torch.Tensor, tp: int, dim: int) -> tuple[torch.Tensor, ...]:
    if t.shape[dim] % tp:
        raise BundleError(f"a tensor of shape {tuple(t.shape)} does not split evenly over TP {tp} along dim {dim}")
    return t.chunk(tp, dim)
