"""Framework findings: gradients the training framework left unreduced, judged apart from the device.

A merged Megatron capture names in ``megatron.unreduced`` the replicated parameters whose TP
copies disagreed (integrations/megatron/replicas.py): ``grads/p`` holds S = sum_r g_r, and
``framework_grads/p|tpR`` holds g_R, what the framework left on rank R. Against the oracle's t:

    shortfall(p)  = max_R ||g_R - t|| / ||t||   what the missing reduction costs the worst rank
    sum_err(p)    = ||S - t|| / ||t||     the device's error, if the copies are partial sums
    adds_up(p)    = sum_err(p) <= margin x band(p)   (band: the capture's, as for every parameter)

Where the copies add up (disjoint parts: Qwen3-VL's deepstack mergers under ms-swift's SP), S is
what a correct reduction would hold and p is scored like any parameter: its error is the
device's. Where they do not (a full part plus a per-rank part: the ViT blocks feeding the
deepstack, patch and position embeddings), neither one copy nor the sum is the truth: p is left
out of the end-to-end comparison and judged per rank, each rank against its own partial truth and
its own band (the judge's ``rank-view`` stage, integrations/megatron/perrank.py), as an ordinary row:

    e_R(p)      = rel_l2(g_R, t_R)                         t_R: rank R's projection of the truth
    band_R(p)   = band_of(members_R(p))                     members_R: the band's members, projected alike
    excess(p)   = max_R e_R / band_R                        the worst rank R* names the row
    row(p)      = rank R*'s metrics and band members, with judged = "per rank", worst_rank = R*

A gradient that has no per-rank truth (no rank-view stage, a recipe that cannot project a rank's
part) stays out of the verdict and is listed in ``left_out`` with the reason. Either way the finding
belongs to the framework, on every device alike.
"""

from __future__ import annotations

from typing import Any

from ..bundle.store import Bundle
from ..metrics import rel_l2, tensor_metrics

KEY = "rank_view"  # a per-rank bundle's metadata key (integrations/megatron/perrank.py writes it)


def unreduced(capture: Bundle) -> list[dict[str, Any]]:
    return list((capture.get("megatron") or {}).get("unreduced") or [])


def framework_rows(oracle: Bundle, capture: Bundle, band_of, margin: float) -> list[dict[str, Any]]:
    """One row per unreduced parameter (see the module docstring); ``band_of(name)`` -> its band."""
    rows = []
    for u in unreduced(capture):
        p = u["hf"]
        if not (oracle.has("grads", p) and capture.has("grads", p)):
            continue
        t = oracle.load("grads", p).double()
        total = capture.load("grads", p).double()
        held = [rel_l2(capture.load("framework_grads", f"{p}|tp{r}").double(), t)
                for r in range(int(u.get("tp") or 0)) if capture.has("framework_grads", f"{p}|tp{r}")]  # fmt: skip
        sum_err = rel_l2(total, t)
        band = band_of(p)
        rows.append({"name": p, "mcore": u.get("mcore"), "tp": u.get("tp"), "spread": u.get("spread"),
                     "sum_rel_l2": sum_err, "per_rank_rel_l2": held, "shortfall": max(held) if held else None,
                     "band": band, "adds_up": sum_err <= margin * band})  # fmt: skip
    return rows


def finding(rows: list[dict[str, Any]], per_rank: set[str] = frozenset()) -> dict[str, Any] | None:
    """The finding in words, and which parameters leave the verdict (those that do not add up)."""
    if not rows:
        return None
    up = [r["name"] for r in rows if r["adds_up"]]
    mixed = [r["name"] for r in rows if not r["adds_up"]]
    worst = max((r["shortfall"] for r in rows if r["shortfall"] is not None), default=None)

    def names(ns: list[str]) -> str:
        return ", ".join(ns[:4]) + (f" and {len(ns) - 4} more" if len(ns) > 4 else "")

    text = (f"framework finding: {len(rows)} replicated gradient(s) were never reduced across TP ranks "
            f"(finalize_model_grads); a rank's copy is up to {worst:.3g} rel L2 from the full gradient" if worst is not None
            else f"framework finding: {len(rows)} replicated gradient(s) were never reduced across TP ranks")  # fmt: skip
    if up:
        text += f"; {len(up)} are partial sums that add up to it ({names(up)}): scored as their sum"
    judged, out = [n for n in mixed if n in per_rank], [n for n in mixed if n not in per_rank]
    if judged:
        text += (f"; {len(judged)} are neither one rank's copy nor the sum ({names(judged)}): each rank judged against "
                 "its own part of the truth and its own band (rank view)")  # fmt: skip
    if out:
        text += (f"; {len(out)} are neither one rank's copy nor the sum ({names(out)}): left out of this verdict "
                 "(no per-rank truth; oracle rank-view judges them by hand)")  # fmt: skip
    return {"text": text, "params": rows, "adds_up": up, "excluded": out, "per_rank": judged}


def _view_for(views: list[Bundle], tp: int, name: str) -> Bundle | None:
    for v in views:
        meta = (v.get("metadata") or {}).get(KEY) or {}
        if meta.get("tp") == tp and name in meta.get("names", []):
            return v
    return None


def judge_per_rank(views: list[Bundle], capture: Bundle, names: list[str], precision: str, band_of) -> tuple[dict, list]:
    """Each of ``names`` (unreduced, not adding up) against its per-rank truth (module docstring);
    ``band_of(member rows)`` -> a band (score's rule). -> ({name: {"row": metrics of the worst rank,
    "members": its band members' metrics, "info": {judged, worst_rank, tp, per_rank}}}, left_out
    [{name, reason}])."""
    tps = {u["hf"]: int(u.get("tp") or 0) for u in unreduced(capture)}
    judged, left_out = {}, []
    for p in names:
        tp = tps.get(p, 0)
        view = _view_for(views, tp, p)
        held = [r for r in range(tp) if capture.has("framework_grads", f"{p}|tp{r}")]
        if view is None or len(held) != tp:
            why = ("the capture lacks some rank's copy (framework_grads)" if view is not None else
                   "no per-rank truth: the judge's rank-view stage did not project it (the recipe cannot restrict "
                   "a rank's part, a layout without sequence parallel, or a step of several micro-batches); `oracle rank-view` compares by hand")  # fmt: skip
            left_out.append({"name": p, "reason": "left unreduced across TP ranks by the framework and not the sum of "
                             f"its copies; {why}"})  # fmt: skip
            continue
        meta = (view.get("metadata") or {}).get(KEY) or {}
        members = ((meta.get("band") or {}).get(precision) or {}).get(p) or [[] for _ in range(tp)]
        ranks = []
        for r in range(tp):
            m = tensor_metrics(capture.load("framework_grads", f"{p}|tp{r}"), view.load("grads", f"{p}|tp{r}"))
            band = band_of(members[r])
            ranks.append((m["rel_l2"] / band if band > 0 else float("inf"), r, m, band))
        excess, worst, m, band = max(ranks, key=lambda x: (x[0], -x[1]))
        info = {"judged": "per rank", "worst_rank": worst, "tp": tp,
                "per_rank": [{"rank": r, "rel_l2": mr["rel_l2"], "band": b} for _, r, mr, b in ranks]}  # fmt: skip
        judged[p] = {"row": m, "members": members[worst], "info": info}
    return judged, left_out
