"""The tolerance table keyed by the capture's precision, derived from the precision table.

A measured noise band (``oracle score --band``) always wins over this table. The table is the
fallback when no emulated run of the step exists, and supplies two constants the band needs:

    expected  -- relative L2 gradient error an honest run of that precision reaches (the reasoning
                 for each entry is in precision.py, next to the entry);
    floor     -- smallest band accepted per parameter (u/4, see ``Precision.floor``), with a measured
                 band or without one (then the band is max(expected, floor));
    margin    -- error / band_upper above which a parameter or layer is ``beyond_noise``. The band
                 upper is the max over K emulated members; an honest run lands within ~1.5x of it
                 (measured: real autocast vs emulated bf16 median ratio 0.9), so 3x leaves room
                 for an unlucky draw while a real bug (typically 10x-1000x) stands far out.

Callers override entries with ``overrides={"amp-bf16": {"expected": 0.03}}`` (CLI: ``--tol
amp-bf16:expected=0.03``, ``--margin 3``).
"""

from __future__ import annotations

import math

from ..errors import UsageError
from ..precision import TABLE, UNKNOWN

MARGIN = 3.0
# Members of the band ``oracle judge`` emulates per precision (1 round-to-nearest + 1 jittered). The band
# is the largest member's error; the members' errors sum many independent roundings, so they lie close
# and the second half of a 4-member band adds nothing at the step's scale: measured with
# ``python benchmarks/band_cost.py`` (Qwen3 text; band_2 / band_4 per layer, min over layers, and the
# band's cost over the float64 truth's, in one run each):
#     4 layers x 256, 512 tokens:    band_2 / band_4 = 1.00, one member 1.36x the truth (dispatch-bound)
#     2 layers x 1024, 2048 tokens:  band_2 / band_4 = 1.00, one member 0.69-0.86x the truth
#     4 layers x 256, amp-bf16:      band_2 / band_4 = 1.00;  fp32: 0.86 (median 0.92; fp32 members move
#                                    whole ulps, precision/mode.py, so they spread wider)
# so 2 members cost 1.4-1.7x the truth where GEMMs start to dominate (less at 8B, where a float32 GEMM
# runs ~2x a float64 one) against 2.8-3.4x for 4; a run exceeds the larger of 2 members with
# probability 1/3, which the margin (3x) is there for. ``--ensemble`` sets it.
BAND_MEMBERS = 2
FIELDS = ("expected", "floor")


def check_margin(margin: float) -> float:
    """A margin is a finite positive factor: an infinite one (or NaN, which compares false) would pass
    every fault, however large. The CLI asks >= 1 as well (below 1 an honest run at its band is beyond
    noise); a library caller may go below 1 on purpose, to make the referee stricter."""
    if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin > 0):
        raise UsageError(f"--margin {margin!r}: expected a finite factor >= 1 (the default is {MARGIN:g})")
    return float(margin)


def table(overrides: dict[str, dict[str, float]] | None = None) -> dict[str, dict[str, float]]:
    t = {p.name: {"expected": p.expected, "floor": p.floor} for p in (*TABLE.values(), UNKNOWN)}
    for key, vals in (overrides or {}).items():
        t.setdefault(key, dict(t[UNKNOWN.name])).update(vals)
    return t


def row(tol: dict[str, dict[str, float]], precision: str | None) -> dict[str, float]:
    """The entry for ``precision``; runs of unknown precision are held to the ``unknown`` entry."""
    return tol.get(precision or UNKNOWN.name, tol[UNKNOWN.name])


def parse_overrides(specs: list[str]) -> dict[str, dict[str, float]]:
    """``["amp-bf16:expected=0.03", ...]`` -> ``{"amp-bf16": {"expected": 0.03}}``."""
    out: dict[str, dict[str, float]] = {}
    for spec in specs:
        try:
            key, rest = spec.split(":", 1)
            field, value = rest.split("=", 1)
            if field not in FIELDS:
                raise ValueError
            number = float(value)
        except ValueError:
            raise UsageError(f"--tol {spec!r}: expected PRECISION:expected=VALUE or PRECISION:floor=VALUE") from None
        known = (*TABLE, UNKNOWN.name)
        if key not in known:
            raise UsageError(f"--tol {spec!r}: unknown precision {key!r}; choose one of {', '.join(known)}")
        if not (number > 0 and number < float("inf")):
            raise UsageError(f"--tol {spec!r}: a tolerance is a positive, finite relative error")
        out.setdefault(key, {})[field] = number
    return out
