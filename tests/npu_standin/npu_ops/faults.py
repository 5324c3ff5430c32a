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
- ``rotary_sin_sign``: npu_rotary_position_embedding's / npu_rotary_mul's backward adds the sin
  term of dx with the wrong sign (dx = g*cos - R^T(g*sin)).
- ``matmul_add_bf16``: npu_matmul_add_fp32 accumulates the weight gradient in bf16
  (main_grad <- fp32(bf16(main_grad) + bf16(dy^T x))) instead of fp32.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter

ENV = "TORCH_NPU_STANDIN_FAULTS"
FAULTS = {"attention_cross_boundary": "npu_fusion_attention", "rotary_sin_sign": "npu_rotary_position_embedding",
          "matmul_add_bf16": "npu_matmul_add_fp32"}  # fmt: skip

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
