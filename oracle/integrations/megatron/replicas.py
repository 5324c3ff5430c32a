"""TP replicas whose gradients the framework never reduces: recognised from the run itself.

A replicated parameter (a transformers module held whole on every TP rank, runinfo.py, or any
copy without a partial-sum rule in layout.partial_sum) should hold the same gradient on every TP
rank. When the ranks' copies disagree, ``finalize_model_grads`` did not reduce them although each
rank's backward saw only part of the step: ms-swift 3.12.1 with sequence parallel slices
Qwen3-VL's deepstack features per TP rank, and megatron-core 0.12.1 has no TP reduction for
Hugging Face modules (0.13 added one). This is the framework's behaviour, on every device alike.

What merge writes for such a parameter (HF name p, rank r's copy g_r, all in float64):
    grads/p              sum_r g_r: what a correct reduction would hold where each g_r covers
                         a disjoint part of the step (the deepstack mergers: sum == the TP 1 gradient)
    framework_grads/p|tpR  g_R for every TP rank R: what the framework left on each rank (one
                         more copy of the replicated tensors per rank: the ViT's size x TP)
    megatron.unreduced   [{hf, mcore, spread = max_r ||g_r - g_0|| / ||g_0||, stage}]
Whether sum_r g_r is the full gradient (partial sums of disjoint parts) or not (a full part plus a
per-rank part, as for the ViT blocks feeding the deepstack mergers) is decided against the oracle
(score.framework), never assumed; rank-view projects each rank's own partial truth.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...metrics import norm, sum_sq

AGREEMENT = 1e-5  # relative L2: TP copies of one replicated gradient agree to this when reduced


def spread(per_rank: list[torch.Tensor]) -> float:
    """max_r ||g_r - g_0|| / ||g_0|| in float64 (0 for one rank)."""
    ref = per_rank[0]
    scale = max(norm(ref), 1e-30)
    return max((math.sqrt(sum_sq(g, ref)) / scale for g in per_rank[1:]), default=0.0)


def reduce_replicas(mname: str, hf: str, per_rank: list[torch.Tensor], stage: str) -> tuple[torch.Tensor, dict[str, Any] | None]:
    """-> (the gradient merge keeps, a finding or None). Agreeing copies: rank 0's copy; copies
    that disagree: their sum in float64, cast to the copies' dtype (see the module docstring)."""
    s = spread(per_rank)
    if s <= AGREEMENT:
        return per_rank[0], None
    total = torch.stack([g.double() for g in per_rank]).sum(0).to(per_rank[0].dtype)
    return total, {"hf": hf, "mcore": mname, "spread": s, "stage": stage, "tp": len(per_rank)}


def finding_text(unreduced: list[dict[str, Any]]) -> str:
    """One sentence naming the parameters (first 6, then a count)."""
    names = [u["hf"] for u in unreduced]
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return (f"framework finding: {len(names)} replicated gradient(s) differ between TP ranks and were never reduced "
            f"by finalize_model_grads ({shown}); the merged capture holds their sum over TP ranks, each rank's copy is "
            "kept as framework_grads")  # fmt: skip
