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
out of the end-to-end verdict and judged per rank by ``oracle rank-view`` (each rank against its
own partial truth). Either way the finding belongs to the framework, on every device alike.
"""

from __future__ import annotations

from typing import Any

from ..bundle.store import Bundle
from ..metrics import rel_l2


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


def finding(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
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
    if mixed:
        text += (f"; {len(mixed)} are neither one rank's copy nor the sum ({names(mixed)}): left out of this verdict, "
                 "judged per rank by oracle rank-view")  # fmt: skip
    return {"text": text, "params": rows, "adds_up": up, "excluded": mixed}
