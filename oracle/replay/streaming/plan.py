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
Time = the weights' FLOPs / (probe rate x EFFICIENCY) + the attention's / (probe rate x ATTENTION_EFFICIENCY x
its diagonal share) for the float64 truth; an emulated member's FLOPs / (float32 probe x EMULATED_EFFICIENCY)
(benchmarks/user_step.py cut and benchmarks/streaming.py measure them). Memory and disk: see
streaming/driver.py for the split; the peak is the 1 MiB malloc threshold's model, x the heap's retention where the
budget has room for the faster threshold the run then picks (engine.roomy_mmap_mb, engine.heap_retention).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ... import precision as precisions
from ...bundle.shapes import entry_numel, itemsize
from ...bundle.store import Bundle
from ...capture.packing import check_boundaries
from ...parallel.token_parallel import Layout
from ...precision.mode import PrecisionMode
from ..attention import CHUNK
from . import engine
from .materialize import skeleton

# The float64 truth's time, per FLOP the plan counts, as fractions of the GEMM probe (fitted 2026-12-05, quiet, on
# Qwen3-VL-8B's 2-layer cut, `python benchmarks/user_step.py cut --tokens N --side 224`):
#   EFFICIENCY            the model's weights' GEMMs (linear layers, the head): 0.78 at 16384 tokens, where the cut ran at
#                         0.74x of the probe in all (1073 s); at 2048 tokens the whole cut reached 0.52x (238 s), the
#                         per-parameter work (weights materialised, 16 GiB of gradients written) then being a third of
#                         it; at the user's 65536 tokens that work is minutes of hours.
#   ATTENTION_EFFICIENCY  the exact attention per counted FLOP (causal 2 l^2 d per pass): the Python loop measured 0.45
#                         for one 4096-token sample at the 8B's heads (fwd + bwd: 77 % bmm at about 0.8x the probe, 5
#                         backward GEMMs against the 4 counted, the rest exp and the softmax's elementwise steps), priced
#                         0.5; a causal sample of n key chunks also computes its n diagonal blocks whole: x n / (n + 1).
#                         torch's flash kernel (attention_flash.py, since 2026-12-05) beside the loop in one run, in memory
#                         at the 8B's heads: 1.17x its speed at 4096 tokens, 1.14x at 8192, 1.11x at 16384 (the user's
#                         sample length; 0.48x of the probe there): 0.5 x 1.11.
EFFICIENCY = 0.78
ATTENTION_EFFICIENCY = 0.55
# An emulated run (a band member: bf16, amp-bf16, fp16, fp32) computes in float32 (precision/mode.py) and
# is priced on the float32 GEMM probe: it reaches 0.42 of it on the same 8B cut (bf16, 153 s at the 1 MiB
# malloc threshold members run at; 0.40 streamed at 2 layers x 2048 hidden, 4096 tokens; 0.38-0.50 in memory at
# hidden 1024-4096), less than the float64 truth's share of its own probe because the rounding points add
# float32 elementwise passes; 0.41 at 16384 tokens (971 s, priced at 1.01x of it). Against the truth by part a
# member is then 0.64x the truth at 2048 tokens and 0.90x at 16384 (measured 153 / 238 s and 971 / 1073 s).
# python benchmarks/band_cost.py prints both, side by side. Those were round-to-nearest members; a jittered one
# drew a fresh uniform per element and ran at 1.3x the truth by itself at 16384 tokens (the band of 2 priced at
# 0.68x of its time); since its factors come from a pool (precision/mode.py, _POOL) it costs about 1.1x the
# round-to-nearest one and the band of 2 is priced at 1.04x of its measured time
# (`python benchmarks/long_samples.py --kernels flash`: 2 x 2048 streamed, one 16384-token sample).
# Checked 2026-12-06 (sixth session's machine) on the 16384-token cut after the in-place rounding, one run after the
# other: the member 909 s at the 1 MiB threshold (what it takes where it fills its budget: the user's 8B/64k at 16G),
# 784 s at 32 MiB (where its budget has room, engine.roomy_mmap_mb); the truth 938 s. So a member is 0.97x / 0.84x the
# truth there (0.90x on the 2026-12-05 machine); at this cut's FLOP mix the planner prices it at about 0.75 x 157.7 /
# (290 x EMULATED_EFFICIENCY) = 1.02x the truth (the probes: float64 157.7, float32 290 GFLOP/s; 0.3 would give 1.36x).
# Re-fitted 2026-12-06 (ninth session's machine, after the one-pass rounding kernel and the in-place rounding), on the
# 16384-token cut, member / truth / member one after the other (`user_step.py cut --tokens 16384 --side 224 [--dtype
# bf16]`): the member 365 / 368 s (0.55x of its float32 probe), the truth 612 s (0.64x of its float64 probe, priced at
# 0.75x): a member is 0.60x the truth. At this cut's FLOP mix the planner prices a member at 0.75 x f64 / (f32 x E) of
# the truth, f64 / f32 the two probes (200.5 / 391.1 GFLOP/s here): 0.385 / E, so E = 0.64 prices it at 0.60x (0.4
# priced it at 0.96x). Fitted to the ratio, as the truth's EFFICIENCY is to its own probe: both run about 15 % slower
# than priced here. At 2048 tokens (member 123 s, truth 164 s: 0.75x) the per-parameter work (the gradients written
# and hashed: 8-16 GiB) is a third of either run and no constant of the GEMMs prices it; at the user's 8B/64k it is
# minutes of hours.
EMULATED_EFFICIENCY = 0.64
# The per-parameter work no FLOP count shows, per parameter, by the dtype the run computes in: each unit's weights
# materialised from the capture (read, upcast), its gradients written (float64 for the truth, float32 for a member)
# and hashed twice (store.entry_hashes), the head's and the embedding's by rows. Not scaled by cores: a dry run prices
# it as measured here, on a server and on each rank of a token split (every rank writes a whole partial set).
# Measured 2026-12-06 (eleventh session, quiet, 2 cores) on Qwen3-VL-8B's 2-layer cut (2.21 B parameters, `python
# benchmarks/user_step.py cut --tokens N --side 224 [--dtype bf16]`): the truth 148 s at 1024 tokens and 181 s at 2048
# against 86 and 125 s of GEMMs priced: 62 and 56 s left, 27 ns per parameter (17.7 GB of float64 gradients at 0.30
# GB/s); a bf16 member 95 s at 1024 tokens against 56 s priced: 39 s, 18 ns per parameter. At 16384 tokens it is 5 %
# of the truth (EFFICIENCY was fitted there with it inside); at the user's 8B (8.8 B parameters) 4 min for the truth
# and 2.6 per member, minutes a server's cores do not shorten. Mostly this machine's disk: its writes reach 0.36 GB/s
# with the fsync (256 MiB x 8; sha256 runs at 2.1 GB/s here), so 49 of the truth's 59 s; a server's NVMe drive writes
# several times faster, and there this price is conservative.
PARAMETER_SECONDS = {torch.float64: 27e-9, torch.float32: 18e-9}
# A token embedding's rows no token reads are not written (holes in a sparse file, embedding.write_dense), only
# hashed as zeros: two sha256 streams of 8 bytes per value (the float64 values; a float32 member's 4 stored bytes on
# the other thread) at 2.1 GB/s here, 3.8 ns per value, so 4 ns. Measured on the same cut at 2048 tokens, old and new
# code one after the other: the truth 185 / 187 s writing the zeros, 170 / 181 s leaving holes (0.62 B of the cut's
# 2.21 B values; the bundle 16 GiB on disk, was 21).
HOLE_SECONDS = 4e-9


def gemm_rate(n: int = 768, reps: int = 3, dtype: torch.dtype = torch.float64) -> float:
    """This machine's GEMM rate in ``dtype``, FLOP/s (best of ``reps`` n x n x n products)."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def _interleaved(dtypes: tuple[torch.dtype, ...], n: int, rounds: int, clock) -> dict[torch.dtype, float]:
    """Best ``clock`` seconds of an n x n x n product per dtype, the dtypes in turn round after round (each
    warmed after the other's), as FLOP/s."""
    mats = {d: (torch.randn(n, n, dtype=d), torch.randn(n, n, dtype=d)) for d in dtypes}
    best = dict.fromkeys(dtypes, float("inf"))
    for r in range(rounds):
        for d in dtypes if r % 2 == 0 else dtypes[::-1]:
            a, b = mats[d]
            a @ b  # noqa: B018 -- warm this dtype's kernel after the other's
            t = clock()
            a @ b  # noqa: B018
            best[d] = min(best[d], clock() - t)
    return {d: 2 * n**3 / max(s, 1e-9) for d, s in best.items()}


def gemm_rates(dtypes: tuple[torch.dtype, ...], n: int = 768, rounds: int = 5) -> dict[torch.dtype, float]:
    """``gemm_rate`` of several dtypes measured in turn, round after round (best of ``rounds`` each): a
    load that comes and goes between two separate probes moves their ratio (the price of a float32 band
    member against the float64 truth) far more than it moves either best."""
    return _interleaved(dtypes, n, rounds, time.perf_counter)


def core_rates(dtypes: tuple[torch.dtype, ...], n: int = 512, rounds: int = 7) -> dict[torch.dtype, float]:
    """One core's GEMM rate per dtype, FLOP/s, from the CPU time the product takes (``time.thread_time``
    of this thread, torch on one thread for the probe): a core that other jobs share slows the wall clock
    of a product, not the CPU time it needs, so this rate is the machine's and not the moment's load.
    It prices other machines (judge.elsewhere: a server's cores); the wall-clock rate (``gemm_rates``)
    prices this one, now. Best of ``rounds`` per dtype, the dtypes in turn as gemm_rates does."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the product then runs in this thread, whose CPU clock thread_time reads
    try:
        return _interleaved(dtypes, n, rounds, time.thread_time)
    finally:
        torch.set_num_threads(threads)


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


def plan(cap: Bundle, dtype: str = "fp64", *, streamed: bool = True, budget: int | None = None,
         activation_budget: int | None = None, token_chunk: int | None = None, ranks: int = 1) -> dict[str, Any]:  # fmt: skip
    """The dry run's numbers; ``fits`` is False exactly when the run would refuse ``budget``
    (``activation_budget`` and ``token_chunk`` as the run's test overrides). ``ranks`` > 1: one rank
    of the token-parallel replay (--split tokens): memory and disk per rank (its rows' boundary
    activations and input gradients, budget.need's per-rank reserve), the time at ideal speed-up."""
    from ..inputs import check_inputs
    from ..setup import recipe_of
    from . import budget as budgets

    check_inputs(cap)  # what the run would refuse first (oracle/replay/inputs.py)
    recipe = recipe_of(cap)
    compute = precisions.emulation(dtype)[0]
    size = compute.itemsize
    model = skeleton(recipe, cap.manifest["recipe"]["config"], compute, PrecisionMode(compute))
    tensors = cap.manifest["tensors"].get("inputs", {})
    T, patches = budgets.tensor_counts(tensors)
    lengths = _samples(cap, T)
    images = cap.load("inputs", "image_grid_thw").prod(-1).tolist() if "image_grid_thw" in tensors else []
    passes = 4 if streamed else 3
    flops = {"linear": 0.0, "attention": 0.0, "head": 0.0}
    attention_at = 0.0  # the truth's attention FLOPs over their efficiency: each sample's diagonal blocks (ATTENTION_EFFICIENCY)
    calls = 0  # attention kernel calls per pass: one per sample (text) or image (ViT) and attention module
    for name, mod in model.named_modules():
        vision = "visual" in name
        if isinstance(mod, torch.nn.Linear) and not name.endswith("lm_head"):
            flops["linear"] += 2 * mod.weight.numel() * (patches if vision else T) * passes
        if name.endswith(("q_proj", "attn.qkv")):
            d = mod.weight.shape[0] // (3 if name.endswith("qkv") else 1)
            if vision:
                flops["attention"] += sum(4 * p * p * d for p in images) * passes
                attention_at += sum(4 * p * p * d for p in images) * passes / ATTENTION_EFFICIENCY
            else:
                flops["attention"] += sum(2 * length * length * d for length in lengths) * passes
                attention_at += sum(2 * length * length * d * passes / (ATTENTION_EFFICIENCY * _causal_share(length))
                                    for length in lengths)  # fmt: skip
            calls += len(images) if vision else len(lengths)
    head = getattr(model, "lm_head", None)
    n_loss = int((cap.load("inputs", "labels") != -100).sum()) if "labels" in tensors else 0
    if head is not None:
        flops["head"] = 2 * n_loss * head.weight.numel() * 4
    n_params = sum(p.numel() for p in model.parameters())
    holes = embedding_holes(cap, model) if streamed and ranks == 1 else 0  # rank 0 of a token split writes its sums whole
    total = sum(flops.values())
    rate = gemm_rate(dtype=compute)  # what the run's GEMMs run in: float64 for the truth, float32 emulated
    if compute == torch.float64:  # the weights' GEMMs and the attention at their own fractions of the probe
        seconds = (flops["linear"] + flops["head"]) / (rate * EFFICIENCY) + attention_at / rate
    else:
        seconds = total / (rate * EMULATED_EFFICIENCY)
    efficiency = total / (rate * seconds) if seconds > 0 else EFFICIENCY  # the fraction of the probe the whole run reaches
    need = budgets.need(cap, model, recipe, compute, token_chunk, ranks=ranks)
    units = need["units"]
    T_rank = T if ranks == 1 else max(Layout(T, ranks, 0).counts)  # the largest rank's rows
    bounds = boundaries(model, units, cap.manifest["recipe"]["config"], T_rank, patches, size)
    inputs_bytes = sum(entry_numel(e) * (size if e["dtype"].startswith(("float", "bfloat")) else itemsize(e["dtype"]))
                       for e in tensors.values())  # fmt: skip
    process = _base_rss() + need["resident"] + inputs_bytes  # the run measures this as its resident set
    fixed = process + need["bytes"]
    activations = bounds["activations"]
    if activation_budget is not None:
        store_budget = activation_budget
    else:
        store_budget = None if budget is None else max(budget - fixed, 0)
    overflow = 0 if store_budget is None else max(activations - store_budget, 0)  # memory: the store fills its budget
    spilled = spilled_per_unit(bounds["per_unit"], store_budget)  # disk: what the store writes, whole tensors
    spill = sum(spilled)
    captured = sum(e["nbytes"] for e in _file_sizes(cap))
    held = disk_held(model, units, bounds["per_unit"], spilled, size)
    fits = budget is None or budget >= fixed
    # the malloc threshold the run will pick (driver._malloc_for): at a faster one the heap keeps what it reuses
    if budget is None or activation_budget is not None or not streamed:
        mmap_mb = engine.user_mmap_mb() or engine.MMAP_MB
    else:
        mmap_mb = engine.roomy_mmap_mb(budget, fixed + activations, compute)
    retention = engine.heap_retention(compute) if mmap_mb > engine.MMAP_MB else 1.0
    return {
        "recipe": recipe.name, "dtype": dtype, "tokens": T, "samples": lengths, "patches": patches, "loss_tokens": n_loss,
        "parameters": n_params, "units": len(units), "attention_calls": calls, "flops": flops, "total_flops": total, "gemm_flops_per_s": rate,
        "estimated_seconds": seconds / ranks, "efficiency": efficiency, "ranks": ranks,
        "parameter_seconds": (n_params - holes) * PARAMETER_SECONDS.get(compute, PARAMETER_SECONDS[torch.float64])
        + holes * HOLE_SECONDS, "embedding_holes": holes,
        "memory": {"process": process, "reserve": need["bytes"], "reserve_by": need["by"], "fixed": fixed,
                   "activations": activations, "activations_in_memory": activations - overflow,
                   "peak_estimate": round((fixed + (activations - overflow)) * retention),
                   "malloc_mmap_mb": mmap_mb, "heap_retention": retention},
        "disk": {"gradients": n_params * size, "spilled_activations": spill, "resume_journal": bounds["input_grads"],
                 "written": n_params * size + spill + bounds["input_grads"], "held_peak": held, "inputs_and_weights": captured,
                 # a receiving rank of the tree (partials.py) writes one set of sums beside its own partials
                 "rank0_partials": (ranks > 1) * n_params * size},
        "budget": budget, "fits": fits,
        "refusal": None if fits else budgets.refusal(budget, fixed, need["by"]),
    }  # fmt: skip


def _causal_share(length: int) -> float:
    """The counted share of what the exact kernel computes for one causal sample of ``length`` tokens: n key chunks of
    CHUNK, n (n + 1) / 2 blocks computed (the diagonal ones whole) for the n^2 / 2 counted: n / (n + 1)."""
    n = max(1, -(-length // CHUNK))
    return n / (n + 1)


def boundaries(model: torch.nn.Module, units: list[str], config: dict[str, Any], T: int, P: int, size: int) -> dict[str, int]:
    """Bytes of the boundary tensors the streamed units receive, at their real widths, and of the
    gradients of those that require one (the resume journal's input gradients):
        decoder layer      T x text hidden (+ the rotary cos, sin: 2 x T x head_dim, stored once for all layers)
        ViT block, merger  P x vision hidden (+ rotary 2 x P x vision head dim, once); a deepstack merger
                           reads a block's output that the next block receives too: stored once
        patch embedding    the pixel rows, P x (channels x temporal x patch^2), no gradient
        token embedding    the token ids (int64), no gradient"""
    text = config.get("text_config", config)
    vision = config.get("vision_config") or {}
    ht = int(text.get("hidden_size", 0))
    hd = int(text.get("head_dim") or ht // max(int(text.get("num_attention_heads", 1)), 1))
    hv = int(vision.get("hidden_size", 0))
    hvd = hv // max(int(vision.get("num_heads", 1)), 1)
    per_unit = []  # (activation bytes, input-gradient bytes) per unit, in forward order
    rotary_text = rotary_vision = False
    for u in units:
        mod = model.get_submodule(u)
        a = g = 0
        if isinstance(mod, torch.nn.Embedding):
            a = T * 8
        elif "visual" in u and not any(isinstance(m, torch.nn.Linear) for m in mod.modules()):
            a = P * sum(p.numel() for p in mod.parameters() if p.ndim > 1) // max(hv, 1) * size  # pixel rows
        elif "visual" in u:
            a = 0 if "deepstack" in u else P * hv * size
            g = P * hv * size
            if "blocks" in u and not rotary_vision:
                a, rotary_vision = a + 2 * P * hvd * size, True
        else:
            a = g = T * ht * size
            if not rotary_text:
                a, rotary_text = a + 2 * T * hd * size, True
        per_unit.append((a, g))
    return {"activations": sum(a for a, _ in per_unit), "input_grads": sum(g for _, g in per_unit), "per_unit": per_unit}


def spilled_per_unit(per_unit: list[tuple[int, int]], budget: int | None) -> list[int]:
    """Bytes of each unit's boundary inputs the activation store writes to disk, in forward order,
    as spill.ActivationStore does: whenever a put takes the held bytes past the budget, whole
    tensors go, the oldest first (here a unit's inputs count as one tensor). At Qwen3-VL-8B and
    65536 tokens a decoder layer's input is 2 GiB: past the budget by a little, a whole one goes
    (the 65536-token cut spilled 2.79 GiB where the bytes over the budget were 1.3 GiB)."""
    out = [0] * len(per_unit)
    if budget is None:
        return out
    held, mem = [], 0
    for i, (a, _) in enumerate(per_unit):
        held.append(i)
        mem += a
        while mem > budget and held:
            j = held.pop(0)
            out[j] = per_unit[j][0]
            mem -= out[j]
    return out


def embedding_holes(cap: Bundle, model: torch.nn.Module) -> int:
    """The values of the token embedding's gradient in rows no input id reads: zeros the streamed replay
    leaves as holes (embedding.write_dense), neither written nor taking disk (the disk figures here count
    them all the same: an upper bound)."""
    from .embedding import by_rows

    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None or not by_rows(emb) or "input_ids" not in cap.manifest["tensors"].get("inputs", {}):
        return 0
    used = torch.unique(cap.load("inputs", "input_ids")).numel()
    return max(emb.num_embeddings - used, 0) * emb.embedding_dim


def disk_held(model: torch.nn.Module, units: list[str], per_unit: list[tuple[int, int]], spilled: list[int],
              size: int) -> int:  # fmt: skip
    """The most bytes the work directory holds at once. ``spilled``: each unit's spilled inputs
    (``spilled_per_unit``); the backward walks the units from the last: the head's gradient shard
    first, then per unit its shard and its input gradients appear and its spilled inputs go; input
    gradients are held until the unit feeding them is done (here: the last two), the resident
    parameters' shard comes last."""
    in_units = set()
    disk = sum(spilled)
    head = getattr(model, "lm_head", None)
    if head is not None:
        disk += head.weight.numel() * size
    peak, held = disk, []
    for u, (_, g), s in reversed(list(zip(units, per_unit, spilled))):
        params = list(model.get_submodule(u).parameters())
        in_units.update(id(p) for p in params)
        disk += sum(p.numel() for p in params) * size + g - s
        held.append(g)
        if len(held) > 2:
            disk -= held.pop(0)
        peak = max(peak, disk)
    rest = sum(p.numel() for p in model.parameters() if id(p) not in in_units and p is not getattr(head, "weight", None))
    return max(peak, disk + rest * size)


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


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def render(p: dict[str, Any]) -> str:
    g = _gib
    f = p["flops"]
    lines = [
        f"dry run: {p['recipe']} step, {p['tokens']} tokens in {len(p['samples'])} sample(s), {p['patches']} image patches, "
        f"{p['loss_tokens']} loss tokens, {_count(p['parameters'])} parameters, {p['units']} streamed units, {p['dtype']}",
        f"  FLOPs    {p['total_flops']:.3e}  (linear {f['linear']:.2e}, attention {f['attention']:.2e}, head+loss {f['head']:.2e})",
        f"  time     about {(p['estimated_seconds'] + p['parameter_seconds']) / 60:.1f} min here (GEMMs on the "
        f"{'float64' if p['dtype'] == 'fp64' else 'float32'} GEMM probe {p['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s x {p['efficiency']:.2f}, "
        f"+ {p['parameter_seconds'] / 60:.1f} min of per-parameter work: weights materialised, gradients written and hashed)",
        f"  memory   {'per rank of ' + str(p['ranks']) + ' (split by tokens): ' if p.get('ranks', 1) > 1 else ''}"
        f"peak about {g(p['memory']['peak_estimate'])}"
        + ((" within" if p["fits"] else " ABOVE") + f" --max-memory {g(p['budget'])}" if p["budget"] else "")
        + (f" (malloc's mmap threshold at {p['memory']['malloc_mmap_mb']} MiB, which the budget has room for: the heap "
           f"keeps what it reuses, x{p['memory']['heap_retention']})" if p["memory"]["heap_retention"] > 1 else "")
        + f": process {g(p['memory']['process'])}, largest need {g(p['memory']['reserve'])} ({p['memory']['reserve_by']}), "
        f"boundary activations {g(p['memory']['activations'])}, {g(p['memory']['activations_in_memory'])} of them in memory",
        f"  disk     oracle gradients {g(p['disk']['gradients'])}"
        + (f" ({g(p['embedding_holes'] * p['disk']['gradients'] / p['parameters'])} of them the token embedding's unused rows: "
           "holes, no disk)" if p["embedding_holes"] else "")
        + f"; capture files hard-linked (else copied: "
        f"{g(p['disk']['inputs_and_weights'])}); while running: spilled activations {g(p['disk']['spilled_activations'])}, "
        f"resume journal {g(p['disk']['resume_journal'])} written (the last finished units' held); "
        f"at most {g(p['disk']['held_peak'])} held at once, {g(p['disk']['written'])} written in all"
        + (f"; at the end the ranks' partial gradients are summed onto rank 0 (a tree), which writes the sums beside "
           f"its own ({g(p['disk']['rank0_partials'])})"
           if p.get("ranks", 1) > 1 else ""),
    ]  # fmt: skip
    if p.get("shared"):  # api/replay._dry_run: --nproc's ranks on this machine
        lines.insert(3, f"  ranks    {p['shared']} on this machine (--nproc): their GEMMs share its cores, so about one process's "
                        "time (their exchanges and rank 0's sums besides); over hosts under torchrun each runs its share")  # fmt: skip
    return "\n".join(lines)


# What --nproc's rank processes add to a band's wall time before their first unit (interpreter, torch, transformers'
# model module, oracle; each rank on its own core, at once). Within `oracle judge`, whose process has all of it
# imported already: the tiny Qwen3-VL's band of 2 took 4.8-6.0 s on `--nproc 2 --threads 1` against 0.6 s in the
# judge's process (PROCESS_START_SECONDS). As whole `oracle replay CAP --dtype amp-bf16 --ensemble 2` commands, whose
# launching process imports less itself: 4.5-5.1 s in one process, 5.5-7.1 s on 2 (REPLAY_START_SECONDS). Seconds of
# hours at the user's scale; most of the cost on a small model.
PROCESS_START_SECONDS = 5.0
REPLAY_START_SECONDS = 2.0


def band_wall(members: int, processes: int, gemm: float, fixed: float, start: float = PROCESS_START_SECONDS,
              slower: float | None = None) -> tuple[float, float]:  # fmt: skip
    """(wall seconds, GEMM seconds) of a band's ``members`` on ``processes`` processes sharing this machine's cores
    (``--nproc``; ``gemm``: one member's GEMMs with all of them, ``fixed``: its other work). Members are dealt whole
    to the processes, so the busiest runs ceil(members / processes) of them, each with 1/processes of the cores: its
    GEMMs take processes x ``gemm`` (``slower`` x where a process has fewer: --threads T below the cores / processes,
    the probe's threads / T); its other work (one thread, the disk) is not slowed; the processes ``start`` first.
    One process: members x (gemm + fixed)."""
    rounds = -(-members // processes)
    gemm_wall = rounds * max(processes, slower or 0) * gemm
    return gemm_wall + rounds * fixed + (start if processes > 1 else 0.0), gemm_wall


def render_band(p: dict[str, Any], members: int, processes: int, nproc: int = 1) -> str:
    """The dry run's line for a band of ``members`` (``render`` prices one). On ``processes`` at once the members
    share this machine's cores: their GEMMs do not overlap, their per-parameter work does (``band_wall``,
    measured on the 8B cut: 0.89-0.90x of one after the other on 2 processes of 1 thread, 2 cores)."""
    one = p["estimated_seconds"] + p["parameter_seconds"]
    wall, _ = band_wall(members, processes, p["estimated_seconds"], p["parameter_seconds"], REPLAY_START_SECONDS)
    return (f"  band     {members} members: about {_time(members * one)} here one after the other"
            + (f", about {_time(wall)} on {processes} processes at once{' (one per member, of --nproc ' + str(nproc) + ')' if nproc > processes else ''} (their GEMMs "
               f"share the cores; each process holds the peak above: {processes} x it at once)"
               if processes > 1 else "")
            + f"; their gradients {_gib(members * p['disk']['gradients'])} in the bundle")


def _time(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.1f} min"
