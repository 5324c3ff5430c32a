"""One tolerance table keyed by the capture's precision, with the reasoning next to each entry.

A measured noise band (``oracle score --band``) always wins over this table. The table is the
fallback when no emulated run of the step exists, and supplies two constants the band needs.

    expected  -- relative L2 gradient error an honest run of that precision reaches on a small
                 transformer step. u is the unit roundoff (2^-8 bf16, 2^-11 fp16, 2^-24 fp32); an
                 end-to-end gradient goes through O(10) rounded ops per layer whose errors add
                 like a random walk, so a few u is typical: bf16 ~3u..10u = 1e-2..4e-2 (measured on
                 tiny Qwen3-VL: median 1.1e-2 for autocast bf16), fp32 ~10u..100u, well under the
                 1e-4 we require of an fp32 capture.
    floor     -- smallest band accepted per parameter (u/4): a parameter whose emulated error
                 happens to be ~0 would otherwise make any honest deviation look infinite.
    margin    -- error / band_upper above which a parameter or layer is ``beyond_noise``. The band
                 upper is the max over K emulated members; an honest run lands within ~1.5x of it
                 (measured: real autocast vs emulated bf16 median ratio 0.9), so 3x leaves room
                 for an unlucky draw while a real bug (typically 10x-1000x) stands far out.

Callers override entries with ``overrides={"amp-bf16": {"expected": 0.03}}`` (CLI: ``--tol
amp-bf16:expected=0.03``, ``--margin 3``).
"""

from __future__ import annotations

import copy

U = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 2.0**-24, "fp64": 2.0**-53}

TOLERANCES: dict[str, dict[str, float]] = {
    "fp64": {"expected": 1e-10, "floor": U["fp64"] / 4},
    "fp32": {"expected": 1e-5, "floor": U["fp32"] / 4},
    "bf16": {"expected": 4e-2, "floor": U["bf16"] / 4},
    "amp-bf16": {"expected": 3e-2, "floor": U["bf16"] / 4},
    "fp16": {"expected": 5e-3, "floor": U["fp16"] / 4},
    "amp-fp16": {"expected": 4e-3, "floor": U["fp16"] / 4},
    "unknown": {"expected": 4e-2, "floor": U["bf16"] / 4},
}
MARGIN = 3.0


def table(overrides: dict[str, dict[str, float]] | None = None) -> dict[str, dict[str, float]]:
    t = copy.deepcopy(TOLERANCES)
    for key, vals in (overrides or {}).items():
        t.setdefault(key, dict(t["unknown"])).update(vals)
    return t


def parse_override(spec: str) -> tuple[str, str, float]:
    """``amp-bf16:expected=0.03`` -> ("amp-bf16", "expected", 0.03)."""
    try:
        key, rest = spec.split(":", 1)
        field, value = rest.split("=", 1)
        if field not in ("expected", "floor"):
            raise ValueError
        return key, field, float(value)
    except ValueError:
        raise ValueError(f"--tol {spec!r}: expected PRECISION:expected=VALUE or PRECISION:floor=VALUE") from None
