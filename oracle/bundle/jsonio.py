"""JSON that is JSON: every document the tool writes goes through ``dumps``/``write_json``.

Python's ``json`` writes ``NaN``/``Infinity`` for non-finite floats, which is not JSON (strict
parsers reject it). Here a non-finite number is written as ``null`` and, in a top-level object, the
key ``nonfinite_as_null`` says how many were (absent when none), so a reader can tell "no value"
from "NaN/Inf". NaN/Inf themselves are reported where they matter (the ``nonfinite`` counts and
classes of a score), never silently cleaned from the data they describe.
"""

from __future__ import annotations

import json
import math
from typing import Any


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for reading: a key given twice is an error, not "the last one wins"."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _clean(obj: Any, count: list[int]) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        count[0] += 1
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v, count) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v, count) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)  # paths, dtypes: their text


def dumps(obj: Any, **kw) -> str:
    count = [0]
    clean = _clean(obj, count)
    if isinstance(clean, dict) and count[0]:
        clean["nonfinite_as_null"] = count[0]
    return json.dumps(clean, allow_nan=False, indent=1, **kw)

