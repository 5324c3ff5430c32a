"""``oracle replay --dry-run``: what a replay will cost, before it runs.

Nothing is computed but a short float64 GEMM probe. The model is built on the meta device (no
weights), its units counted, and the step's sizes read from the capture's manifest.

FLOPs (float64 multiply-adds counted as 2):
    linear      per unit: 2 P n per pass, P its parameters, n the tokens it sees (text tokens for the
                language model, patches for the vision tower); a streamed replay runs 4 passes
                (forward, recomputation, backward = 2 passes), an in-memory one 3
    attention   per layer, per sample of length l, with d = query heads x head dim:
                causal text 2 l^2 d per pass, bidirectional vision (per image) 4 l^2 d per pass
    head+loss   only the loss tokens: 2 N_loss V H per pass, 4 passes (the chunked head recomputes)
Time = FLOPs / (probe rate x 0.7), the fraction of the GEMM rate a replay reaches on transformer
shapes (benchmarks/replay_flops.py measures it). Memory and disk: see streaming/driver.py for the split.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ... import precision as precisions
from ...bundle.store import Bundle
from ...capture.modules import select
from ...capture.packing import check_boundaries
from ...precision.mode import PrecisionMode
from .materialize import skeleton

EFFICIENCY = 0.7


def gemm_rate(n: int = 768, reps: int = 3) -> float:
    """This machine's float64 GEMM rate, FLOP/s (best of ``reps`` n x n x n products)."""
    a = torch.randn(n, n, dtype=torch.float64)
    b = torch.randn(n, n, dtype=torch.float64)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def _samples(cap: Bundle, total: int) -> list[int]:
    """Per-sample lengths of the (packed) text sequence: from ``cu_seqlens`` when recorded, else from
    the text positions (1-D/2-D ids, or the first of 4 mRoPE rows) restarting, as transformers
    detects packing; 3-row mRoPE positions carry no text row: one sample."""
    tensors = cap.manifest["tensors"].get("inputs", {})
    if "cu_seqlens" in tensors:  # validated as the replay would (capture/packing.check_boundaries, exit 4)
        cu = check_boundaries({n: cap.load("inputs", n) for n in ("cu_seqlens", "position_ids", "input_ids", "tokens")
                               if n in tensors}, str(cap.path))  # fmt: skip
        return [b - a for a, b in zip(cu, cu[1:])]
    if "position_ids" not in tensors:
        return [total]
    pos = cap.load("inputs", "position_ids")
    if pos.ndim == 3 and pos.shape[0] != 4:
        return [total]
    text = pos.reshape(-1, pos.shape[-1])[0]
    starts = [0] + (torch.nonzero(text[1:] - text[:-1] != 1).reshape(-1) + 1).tolist() + [text.numel()]
    return [b - a for a, b in zip(starts, starts[1:])]


def plan(cap: Bundle, dtype: str = "fp64", *, streamed: bool = True, budget: int | None = None) -> dict[str, Any]:
    from ..setup import recipe_of
    from .driver import _largest_input_bytes, unit_reserve

    recipe = recipe_of(cap)
    compute = precisions.emulation(dtype)[0]
    size = torch.empty((), dtype=compute).element_size()
    model = skeleton(recipe, cap.manifest["recipe"]["config"], compute, PrecisionMode(compute))
    tensors = cap.manifest["tensors"].get("inputs", {})
    ids = next((e for n, e in tensors.items() if n in ("input_ids", "tokens")), None)
    T = int(torch.tensor(ids["shape"]).prod()) if ids else 0
    patches = int(tensors["pixel_values"]["shape"][0]) if "pixel_values" in tensors else 0
    lengths = _samples(cap, T)
    images = cap.load("inputs", "image_grid_thw").prod(-1).tolist() if "image_grid_thw" in tensors else []
    passes = 4 if streamed else 3
    rx = recipe.stream_units() or ""
    units = [u for u in select(model, rx)] if rx else []
    flops = {"linear": 0.0, "attention": 0.0, "head": 0.0}
    unit_bytes = 0
    for name, mod in model.named_modules():
        vision = "visual" in name
        if isinstance(mod, torch.nn.Linear) and not name.endswith("lm_head"):
            flops["linear"] += 2 * mod.weight.numel() * (patches if vision else T) * passes
        if name.endswith(("q_proj", "attn.qkv")):
            d = mod.weight.shape[0] // (3 if name.endswith("qkv") else 1)
            if vision:
                flops["attention"] += sum(4 * p * p * d for p in images) * passes
            else:
                flops["attention"] += sum(2 * length * length * d for length in lengths) * passes
    for u in units:
        unit_bytes = max(unit_bytes, sum(p.numel() for p in model.get_submodule(u).parameters()) * size)
    head = getattr(model, "lm_head", None)
    n_loss = 0
    if "labels" in tensors:
        labels = cap.load("inputs", "labels")
        n_loss = int((labels != -100).sum())
    if head is not None:
        flops["head"] = 2 * n_loss * head.weight.numel() * 4
        unit_bytes = max(unit_bytes, head.weight.numel() * size)
    n_params = sum(p.numel() for p in model.parameters())
    total = sum(flops.values())
    rate = gemm_rate()
    hidden = _largest_input_bytes(cap, compute) // max(T, 1) if T else 0
    n_units = len(units)
    activations = n_units * max(T, patches) * hidden  # boundary inputs kept for the backward (upper bound)
    fixed = unit_reserve(cap, compute, unit_bytes)
    store_budget = None if budget is None else max(budget - fixed, 0)
    spill = 0 if store_budget is None else max(activations - store_budget, 0)
    captured = sum(e["nbytes"] for e in _file_sizes(cap))
    return {
        "recipe": recipe.name, "dtype": dtype, "tokens": T, "samples": lengths, "patches": patches, "loss_tokens": n_loss,
        "parameters": n_params, "units": n_units, "flops": flops, "total_flops": total, "gemm_flops_per_s": rate,
        "estimated_seconds": total / (rate * EFFICIENCY),
        "memory": {"fixed_without_process": fixed, "activations": activations, "activations_in_memory": activations - spill,
                   "peak_estimate": fixed + (activations - spill) + _base_rss()},
        "disk": {"gradients": n_params * size, "spilled_activations": spill, "resume_journal": activations,
                 "inputs_and_weights": captured},
        "budget": budget,
    }  # fmt: skip


def _base_rss() -> int:
    from .engine import rss_bytes

    return rss_bytes()


def _file_sizes(cap: Bundle):
    seen = set()
    for group in ("inputs", "weights"):
        for e in cap.manifest["tensors"].get(group, {}).values():
            if e["file"] not in seen:
                seen.add(e["file"])
                yield {"nbytes": (cap.path / e["file"]).stat().st_size}


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.1f} k"


def render(p: dict[str, Any]) -> str:
    g = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    f = p["flops"]
    lines = [
        f"dry run: {p['recipe']} step, {p['tokens']} tokens in {len(p['samples'])} sample(s), {p['patches']} image patches, "
        f"{p['loss_tokens']} loss tokens, {_count(p['parameters'])} parameters, {p['units']} streamed units, {p['dtype']}",
        f"  FLOPs    {p['total_flops']:.3e}  (linear {f['linear']:.2e}, attention {f['attention']:.2e}, head+loss {f['head']:.2e})",
        f"  time     about {p['estimated_seconds'] / 60:.1f} min here (float64 GEMM probe {p['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s x {EFFICIENCY})",
        f"  memory   peak about {g(p['memory']['peak_estimate'])}" + (f" within --max-memory {g(p['budget'])}" if p["budget"] else "")
        + f"; boundary activations {g(p['memory']['activations'])}, {g(p['memory']['activations_in_memory'])} of them in memory",
        f"  disk     oracle gradients {g(p['disk']['gradients'])}; capture files hard-linked (else copied: "
        f"{g(p['disk']['inputs_and_weights'])}); while running: spilled activations {g(p['disk']['spilled_activations'])}, "
        f"resume journal up to {g(p['disk']['resume_journal'])}",
    ]  # fmt: skip
    return "\n".join(lines)
