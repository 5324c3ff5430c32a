"""The one precision table: every name a capture, a replay or an import may carry, and what it means.

Each row says how the device held parameters and what autocast did (the capture policy), how an
honest run of it is emulated on CPU (precision/mode.py), its unit roundoff, and the tolerance used when no
measured noise band exists. The CLI choices, the emulations, the tolerance table (tolerance.py),
the importers' ``--precision`` and Megatron's dtype map all derive from ``TABLE``.

| name     | parameters | autocast | emulated as (compute / rounded to / ops) | u      | expected rel L2 |
|----------|------------|----------|------------------------------------------|--------|-----------------|
| fp64     | float64    | -        | float64 / - / -  (the oracle itself)     | 2^-53  | 1e-10           |
| fp32     | float32    | -        | float32 / float32 / all                  | 2^-24  | 1e-5            |
| bf16     | bfloat16   | -        | float32 / bfloat16 / all                 | 2^-8   | 4e-2            |
| fp16     | float16    | -        | float32 / float16 / all                  | 2^-11  | 5e-3            |
| amp-bf16 | float32    | bfloat16 | float32 / bfloat16 / amp                 | 2^-8   | 3e-2            |
| amp-fp16 | float32    | float16  | float32 / float16 / amp                  | 2^-11  | 4e-3            |

``expected``: the relative L2 gradient error an honest run of that precision reaches on a small
transformer step. An end-to-end gradient goes through O(10) rounded ops per layer whose errors add
like a random walk, so a few u is typical: bf16 ~3u..10u = 1e-2..4e-2 (measured on the tiny
Qwen3-VL: median 1.1e-2 for autocast bf16; pure bf16 rounds every op, so its entry is higher);
fp16 the same in its u; fp32 ~10u..100u, well under the 1e-4 we require of an fp32 capture.
Autocast runs the normalisations, softmax and loss in float32, so its entry sits below the pure
format's. A measured band (``oracle score --band``) always wins over these numbers.

torch is imported lazily (``torch_dtype``), so the CLI can list the choices without loading it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ..errors import UsageError

# What an emulated run computes, as a version: a judge's band stage made under another is redone.
# "ce-fp32": the loss's cross-entropy as the device's float32 kernel (replay/headloss.py ``device_ce``).
EMULATION = "ce-fp32"


@dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: str  #: how the device holds parameters (torch dtype name)
    autocast_dtype: str | None  #: torch.autocast's dtype, None without autocast
    compute: str  #: emulation: dtype the arithmetic runs in
    round_to: str | None  #: emulation: format operands and results are rounded to (None: the oracle)
    ops: str  #: emulation: "all" ops rounded, or "amp" (autocast's lists, precision/mode.py)
    unit_roundoff: float
    expected: float  #: tolerance without a band (reasoning in the module docstring)
    capturable: bool = True  #: a device step can run in it (fp64 is the oracle's, not a device's)

    @property
    def floor(self) -> float:
        """Smallest band accepted per parameter: u/4. A parameter whose emulated error happens to
        be ~0 would otherwise make any honest deviation look infinite."""
        return self.unit_roundoff / 4

    def autocast(self, device_type: str):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        import torch

        return torch.autocast(device_type=device_type, dtype=torch_dtype(self.autocast_dtype))


_U = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}

TABLE: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp64", "float64", None, "float64", None, "all", _U["float64"], 1e-10, capturable=False),
        Precision("fp32", "float32", None, "float32", "float32", "all", _U["float32"], 1e-5),
        Precision("bf16", "bfloat16", None, "float32", "bfloat16", "all", _U["bfloat16"], 4e-2),
        Precision("fp16", "float16", None, "float32", "float16", "all", _U["float16"], 5e-3),
        Precision("amp-bf16", "float32", "bfloat16", "float32", "bfloat16", "amp", _U["bfloat16"], 3e-2),
        Precision("amp-fp16", "float32", "float16", "float32", "float16", "amp", _U["float16"], 4e-3),
    )
}
#: what a run of unknown precision is held to (a log or dump that does not say): bf16's numbers
UNKNOWN = Precision("unknown", "bfloat16", None, "float32", "bfloat16", "all", _U["bfloat16"], 4e-2, capturable=False)

CAPTURE_NAMES = tuple(n for n, p in TABLE.items() if p.capturable)  #: ``oracle capture --precision``
REPLAY_NAMES = tuple(TABLE)  #: ``oracle replay --dtype``
IMPORT_NAMES = (*CAPTURE_NAMES, UNKNOWN.name)  #: ``--precision`` of logs and dumps


def get(name: str) -> Precision:
    if name == UNKNOWN.name:
        return UNKNOWN
    try:
        return TABLE[name]
    except KeyError:
        raise UsageError(f"unknown precision {name!r}; choose one of {', '.join(TABLE)}") from None


def capture_policy(name: str) -> Precision:
    p = get(name)
    if not p.capturable:
        raise UsageError(f"precision {name!r} is not a device precision; choose one of {', '.join(CAPTURE_NAMES)}")
    return p


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def name_of_param_dtype(dtype) -> str:
    """The precision name of a run whose parameters are held in ``dtype`` without autocast
    (Megatron's Float16Module: bf16/fp16; fp32 otherwise)."""
    s = str(dtype).removeprefix("torch.")
    for p in TABLE.values():
        if p.capturable and p.autocast_dtype is None and p.param_dtype == s:
            return p.name
    return s


def emulation(name: str):
    """``(compute, round_to, ops)`` as torch dtypes for replaying a run of ``name`` (precision/mode.py)."""
    p = get(name)
    return torch_dtype(p.compute), (torch_dtype(p.round_to) if p.round_to else None), p.ops


def member_seed(k: int) -> int | None:
    """The jitter seed of emulated member ``k`` of ``replay --ensemble`` (member 0 is not jittered): a
    member replayed again with it (judge's per-rank band, integrations/megatron/perrank.py) is that member."""
    return None if k == 0 else 1000 + k
