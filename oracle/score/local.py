"""Score a local replay (oracle/replay/local.py): per module, the error born there against the error an
honest run of the capture's precision makes in that module alone; the culprit module and whether
its forward or its backward is at fault.

Per module M (a row of the local bundle), for x in fwd (outputs), bwd (grad_inputs), param:
    expected_x = max(emulated expected_x, floor)      floor: the tolerance table's u/4 for the
                                                       capture's precision (``--tol P:floor=V``)
    ratio_x    = x / expected_x
    ratio      = max over x;  beyond = ratio > T, the threshold calibrated on the rows' members
                 (members_x, calibrate.py: a family of its own), or the --margin given

Non-finite values are findings, never NaN ratios that compare false: a module whose device outputs
hold NaN/Inf while its device inputs are finite is where they are born in the forward; one whose
grad_inputs or parameter gradients hold NaN/Inf while its grad_outputs (and outputs) are finite is
where they are born in the backward. Such a module is a culprit (class ``non_finite``, ratio inf).
Modules that only pass on inherited NaN/Inf are not judged (their ratios are None).

Direction: a module beyond T is at fault in its forward when its forward output's ratio alone exceeds
the direction threshold (``calibrate.direction_threshold``: one unit's honest quantile, no Bonferroni,
at least the end-to-end fidelity 2.0x), else in its backward: a backward fault leaves the recorded
forward output honest, so the choice between the two needs no family-wise correction. A pseudo-module
``M:key`` (an input made outside the recorded modules, replay/local.py) is always forward.

Branches: a block whose forward error the local replay split along its residual branches' outputs
(replay/local.py ``_branch_coefs``: err ~ sum_j a_j o_j, the members' a_j its null) gets per branch
    ratio_j = |a_j| / max(max_k |a_j,k|, COEF_FLOOR),   forward_j = ratio_j > calibrate.loss_threshold(K,
              DIRECTION_ALPHA / branches, LOCAL_FIDELITY)
(a_j is one scalar per unit, as the loss: its own null, not the pooled sigma). It is a direction, never a
finding: where a block is called (locally or end to end), a branch out of its honest range says the error
is in that branch's forward output (a branch's output scaled by 1 + s gives a_j = s; a backward fault,
a_j near 0). Measured on the packed step (910B path, layer 3's MLP output x1.03): a = 0.0302, 25x its
members' (honest layers <= 1.5x), where the layer's whole output sat at 1.11x its band.

Culprits: modules beyond the margin; a module containing a culprit submodule yields to it (the
error is born inside the child). Order: non-finite births first -- forward births in forward order,
then backward births in backward order (the first the backward reaches first) -- then the others
by their largest ratio. ``direction`` is ``forward`` when the forward is at fault, else ``backward``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..bundle.store import Bundle
from ..errors import BundleError, UsageError
from . import calibrate
from .tolerance import check_margin, row, table

KEYS = ("fwd", "bwd", "param")
COEF_FLOOR = 1e-6  # a branch coefficient's smallest band: a member whose a_j landed on 0 by chance
BEYOND, WITHIN, NONFINITE = "beyond_noise", "within_noise", "non_finite"


def input_row(module: str) -> tuple[str, str] | None:
    """(owner, key) when ``module`` names an input made outside the recorded modules (replay/local.py
    ``input_rows``: ``M:key``), else None: no op of it ran, so nothing to explain or to capture below it."""
    owner, sep, key = module.partition(":")
    return (owner, key) if sep else None


def born_nonfinite(r: dict[str, Any]) -> str | None:
    """``forward``/``backward`` if non-finite values are born in this module, else None."""
    nf = r.get("nonfinite") or {}
    if nf.get("out") and not nf.get("in"):
        return "forward"
    if (nf.get("gin") or nf.get("param")) and not nf.get("gout") and not nf.get("out") and not nf.get("in"):
        return "backward"
    return None


def score_local(
    bundle: Bundle | str | Path,
    *,
    margin: float | None = None,
    tol_overrides: dict[str, dict[str, float]] | None = None,
    band_paths: Sequence[str | Path] = (),
) -> dict[str, Any]:
    """Score local bundle ``bundle``; ``tol_overrides`` as for ``score`` (the floor applies here).

    A local replay measures its own band per module (``--members`` emulated runs of the module at
    replay time), so end-to-end ``--band`` bundles do not apply: given, they are a usage error."""
    margin = None if margin is None else check_margin(margin)
    bundle = bundle if isinstance(bundle, Bundle) else Bundle(bundle)
    if bundle.kind != "local":
        raise BundleError(f"{bundle.path} is a {bundle.kind} bundle; local scoring needs `oracle replay --local` output")
    if band_paths:
        raise UsageError(
            "--band applies to end-to-end scoring; a local replay carries its own per-module band "
            "(replay with more --members to widen it, --tol PRECISION:floor=V to change its floor)"
        )
    tol = row(table(tol_overrides), bundle.get("precision"))
    raw = bundle.get("local", [])
    thr = calibrate.threshold([(r.get(f"members_{k}") or [], tol["floor"]) for r in raw for k in KEYS if r.get(k) is not None],
                              margin=margin, fidelity=calibrate.LOCAL_FIDELITY)  # fmt: skip
    margin = thr["value"]
    thr["direction"] = calibrate.direction_threshold(thr)
    rows = [_score_row(dict(r), tol["floor"], margin, thr["direction"]) for r in raw]
    for r in rows:
        _score_branches(r)
        if r["beyond"] and r["direction"] == "backward" and r["forward_branch"]:  # a branch's forward output is off
            r["direction"], r["worst"], r["born_in"] = "forward", "fwd", r["forward_branch"]
    beyond = [r for r in rows if r["beyond"] and not r.get("entry")]  # the entry row is evidence (replay/local.py)
    names = {r["module"] for r in beyond}
    culprits = [r for r in beyond if not any(o != r["module"] and o.startswith(r["module"] + ".") for o in names)]
    culprits.sort(key=_culprit_key)
    return {
        "local": str(bundle.path), "precision": bundle.get("precision"), "emulated": bundle.get("emulated"),
        "margin": margin, "threshold": thr, "floor": tol["floor"], "modules": rows, "culprits": [r["module"] for r in culprits],
        "verdict": _verdict(rows, culprits, bundle.get("emulated")),
    }  # fmt: skip


def _score_row(r: dict[str, Any], floor: float, margin: float, direction_t: float | None = None) -> dict[str, Any]:
    direction_t = margin if direction_t is None else direction_t
    born = born_nonfinite(r)
    for k in KEYS:
        v = r.get(k)
        if v is None or not math.isfinite(v):
            r[f"ratio_{k}"] = None
            continue
        exp = max(r.get(f"expected_{k}") or 0.0, r.get("floor", floor))  # an input row's own: its format's rounding
        r[f"expected_{k}"] = exp
        r[f"ratio_{k}"] = v / exp
    ratios = [r[f"ratio_{k}"] for k in KEYS if r[f"ratio_{k}"] is not None]
    r["born_nonfinite"] = born
    if born:
        r["ratio"], r["beyond"], r["direction"], r["class"] = math.inf, True, born, NONFINITE
        return r
    r["ratio"] = max(ratios) if ratios else 0.0
    r["beyond"] = r["ratio"] > margin
    # once a module is beyond, its direction is a choice between two: a backward fault leaves the forward
    # output honest, so the forward is at fault when that one unit is out of the honest range (direction_t)
    fwd_beyond = r["beyond"] and (bool(r.get("input_of")) or (r["ratio_fwd"] or 0.0) > direction_t)
    if r.get("entry"):
        r["class"], r["direction"], r["worst"] = (BEYOND if r["beyond"] else WITHIN), ("forward" if r["beyond"] else None), "fwd"
        return r
    r["direction"] = ("forward" if fwd_beyond else "backward") if r["beyond"] else None
    # what the verdict quotes: the forward output's ratio where the error is born in the forward (the
    # gradients then inherit it), else the worse of the input gradients' and the parameter gradients'
    back = [k for k in ("bwd", "param") if r[f"ratio_{k}"] is not None]
    r["worst"] = "fwd" if fwd_beyond else max(back, key=lambda k: r[f"ratio_{k}"], default=None)
    r["class"] = BEYOND if r["beyond"] else WITHIN
    return r


def _score_branches(r: dict[str, Any]) -> None:
    """Each residual branch's coefficient against its members' (module docstring, Branches); ``r["forward_branch"]``:
    the branch furthest beyond its threshold, or None."""
    br = r.get("branches") or {}
    r["forward_branch"] = None
    if not br:
        return
    k = min(len(b["members"]) for b in br.values())
    if k < 1:
        return
    t = calibrate.loss_threshold(k, calibrate.DIRECTION_ALPHA / len(br), calibrate.LOCAL_FIDELITY)
    for b in br.values():
        b["ratio"] = abs(b["coef"]) / max(max(abs(x) for x in b["members"]), COEF_FLOOR)
        b["threshold"], b["forward"] = t, b["ratio"] > t
    fwd = [n for n, b in br.items() if b["forward"]]
    r["forward_branch"] = max(fwd, key=lambda n: br[n]["ratio"]) if fwd else None


def _culprit_key(r: dict[str, Any]) -> tuple:
    order = r.get("order")
    order = order if order is not None else math.inf
    if r["born_nonfinite"] == "forward":
        return (0, order)
    if r["born_nonfinite"] == "backward":
        return (1, -order)
    return (2, -r["ratio"])


def _verdict(rows: list[dict[str, Any]], culprits: list[dict[str, Any]], emulated: str | None) -> dict[str, Any]:
    if culprits:
        c = culprits[0]
        where = "forward output" if c["direction"] == "forward" else "backward"
        if c["born_nonfinite"]:
            text = (f"culprit: {c['module']} ({c['direction']}): non-finite values are born in its {where} "
                    f"from finite {'inputs' if c['direction'] == 'forward' else 'grad_outputs'}")  # fmt: skip
        elif c.get("input_of"):
            text = (f"culprit: {c['module']} (forward): the {c['key']} {c['input_of']} received are {c['ratio_fwd']:.1f}x "
                    f"the error an honest {emulated} run makes in them, against the float64 replay's from the step's own "
                    "inputs: made wrong before it, outside the recorded modules (what computes them from the positions)")  # fmt: skip
        elif c.get("born_in"):
            b = c["branches"][c["born_in"]]
            text = (f"culprit: {c['born_in']} (forward): {c['module']} is {c['ratio']:.1f}x the error an honest {emulated} "
                    f"run makes in it alone, and its forward error holds {b['coef']:+.4f} x {c['born_in']}'s own output "
                    f"({b['ratio']:.1f}x its members', forward above {b['threshold']:.1f}x)")  # fmt: skip
        else:
            what = {"fwd": "forward output", "bwd": "input gradients", "param": "parameter gradients"}.get(c.get("worst"), where)
            ratio = c.get(f"ratio_{c.get('worst')}") or c["ratio"]
            text = (f"culprit: {c['module']} ({c['direction']}): its {what} {'are' if what.endswith('s') else 'is'} "
                    f"{ratio:.1f}x the error an honest {emulated} run makes in this module alone")  # fmt: skip
        text += f" ({len(culprits)} module(s) beyond the band)"
    else:
        mods = [r for r in rows if not r.get("entry")]
        worst = max(mods, key=lambda r: r["ratio"]) if mods else None
        text = "no module beyond its expected local error" + (
            f"; largest {worst['module']} at {worst['ratio']:.2f}x" if worst else ""
        )
    # entry rows in forward order (replay/local.py entries_of: the first recorded module, and the first block of
    # another recorded stack); the verdict quotes the earliest beyond, else the first
    entries = sorted((r for r in rows if r.get("entry")), key=lambda r: (r.get("order") is None, r.get("order") or 0))
    entry = next((r for r in entries if r["beyond"]), entries[0] if entries else None)
    if entry and entry["beyond"]:
        first = "the first recorded module" if entry is entries[0] else "the first recorded block of its stack"
        text += (f"; the hidden states entering {entry['input_of']} ({first}) are {entry['ratio']:.1f}x "
                 "their band against the float64 replay's: a forward error made before it, outside the recorded modules")  # fmt: skip
    c = culprits[0] if culprits else None
    return {"entry": entry and {"module": entry["input_of"], "ratio": entry["ratio"], "beyond": entry["beyond"]},
            "culprit": c and (c.get("born_in") or c["module"]), "direction": c and c["direction"], "class": c and c["class"],
            "text": text}  # fmt: skip
