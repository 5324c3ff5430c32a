"""Planted faults, switched per op, for tests that must find them (each one changes a backward
only; the forward is bitwise unchanged).

A fault is on when its name is in the environment variable ``TORCH_NPU_STANDIN_FAULTS``
(comma-separated, read at every call so that spawned ranks inherit it) or inside
``with planted(name):``. ``name@K`` limits it to the K-th call (0-based) of the op's backward in this
process: backward calls run last layer first, so with one microbatch and L layers ``@0`` is the last
layer and ``@L-1`` layer 0 (under full recompute too: the recomputed forward is no backward call).

- ``attention_cross_boundary``: npu_fusion_attention's backward lets the first query of every packed
  segment but the first also see the previous segment's last key (TND only: a packed boundary;
  calls in other layouts are not counted).
- ``attention_kv_offset``: npu_fusion_attention's TND backward starts each later packed segment's key
  window at the previous boundary (an index off by one into the cumulative ``actual_seq_kvlen``, the
  kind a leading 0 invites): EVERY query of every segment but the first also sees the whole previous
  segment (the loss-bearing queries too, so it acts at the last layer as well; TND only).
- ``attention_causal_leak``: the same kind for an unpacked batch (MindSpeed's SBH call, any layout
  but TND; TND calls are not counted): the backward runs without the causal mask, every query also
  sees the keys after it (as a backward kernel handed another sparse_mode than the forward's).
- ``rotary_sin_sign``: npu_rotary_position_embedding's / npu_rotary_mul's backward adds the sin
  term of dx with the wrong sign (dx = g*cos - R^T(g*sin)).
- ``matmul_add_bf16``: npu_matmul_add_fp32 accumulates the weight gradient in bf16
  (main_grad <- fp32(bf16(main_grad) + bf16(dy^T x))) instead of fp32.

Two more act on MindSpeed's own Python, not on an NPU op (test-only patches, installed by
``mindspeed_ops.install_faults()`` in the step scripts after MindSpeed's ``repatch``):

- ``rope_sin_sign``: the rotary that actually runs on the unpacked Qwen3-VL step (MindSpeed refuses
  its fused rotary with mRoPE, so its torch ``_apply_rotary_pos_emb_bshd``, which it puts in
  megatron-core's ``rope_utils``): its backward adds the sin term with the wrong sign; two backward
  calls per decoder layer (its query and its key: ``@0,@1`` is the last layer).
- ``sp_norm_unreduced``: the final norm's weight loses its ``sequence_parallel`` mark before DDP,
  so ``finalize_model_grads`` never sums its per-rank partial gradients across TP (Megatron-LM
  #1446); a framework fault, on no device's op.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter

ENV = "TORCH_NPU_STANDIN_FAULTS"
FAULTS = {"attention_cross_boundary": "npu_fusion_attention", "rotary_sin_sign": "npu_rotary_position_embedding",
          "matmul_add_bf16": "npu_matmul_add_fp32", "attention_causal_leak": "npu_fusion_attention",
          "attention_kv_offset": "npu_fusion_attention",
          "rope_sin_sign": "rope_utils._apply_rotary_pos_emb_bshd", "sp_norm_unreduced": "finalize_model_grads"}  # fmt: skip

_planted: list[str] = []
calls: Counter = Counter()  # backward calls per fault name, counted whether or not the fault is on


def _parse(spec: str) -> tuple[str, int | None]:
    name, _, k = spec.strip().partition("@")
    if name not in FAULTS:
        raise ValueError(f"{ENV}: unknown fault {name!r}; the stand-in plants {', '.join(FAULTS)} "
                         "(optionally name@K for the K-th backward call only)")  # fmt: skip
    if k and not k.isdigit():
        raise ValueError(f"{ENV}: {spec!r}: K in name@K must be a call index (0, 1, ...)")
    return name, (int(k) if k else None)


def _specs() -> list[tuple[str, int | None]]:
    raw = [s for s in os.environ.get(ENV, "").split(",") if s.strip()] + _planted
    return [_parse(s) for s in raw]


def validate() -> None:
    """Raise for a malformed ``TORCH_NPU_STANDIN_FAULTS`` (called at import by the stand-in)."""
    _specs()


def armed(name: str) -> bool:
    """Whether ``name`` is planted at all (any call), without counting a call."""
    return any(n == name for n, _ in _specs())


def hit(name: str) -> bool:
    """Count one backward call of ``name``'s op; True when the fault is planted for this call."""
    k = calls[name]
    calls[name] += 1
    return any(n == name and (at is None or at == k) for n, at in _specs())


def reset_counts() -> None:
    calls.clear()


@contextlib.contextmanager
def planted(spec: str):
    """``with planted("rotary_sin_sign"):`` turns a fault on in this process for the block."""
    _parse(spec)
    _planted.append(spec)
    try:
        yield
    finally:
        _planted.remove(spec)
