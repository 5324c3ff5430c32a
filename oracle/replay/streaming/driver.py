"""``oracle replay --max-memory SIZE``: the streaming replay driven end to end (engine: stream.py).

The budget is split once, before the step: what the process holds anyway (its resident set after
the model skeleton and the resident parameters) and the largest need of one unit or of the head
(its weights, their gradients and its recomputation's working set: streaming/budget.py, the same
estimate ``--dry-run`` prints); the rest holds module-boundary activations in memory, the oldest
spilled to disk past it. A budget below the fixed part is refused with the size that would do (exit 2).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ... import precision as precisions
from ...bundle.atomic_file import write_file
from ...bundle.store import Bundle, BundleWriter
from ...errors import BundleError, RecipeError, UsageError
from ...parallel import distributed
from ...precision.mode import PrecisionMode, emulation_record
from .. import fused, token_split
from . import budget as budgets
from . import partials, workdir
from . import plan as plans
from .engine import MMAP_MB, StreamEngine, max_rss_bytes, roomy_mmap_mb, rss_bytes, tame_malloc, user_mmap_mb, work_dir
from .journal import JOURNAL as JOURNAL_NAME
from .journal import read_journal


def work_header(cap: Bundle, dtype: str, ensemble: int, out: Path, split: str = "tensor") -> dict[str, Any]:
    """What a work folder must have been made for to be resumed: this step, this command, this version."""
    from ...version import __version__

    fp = json.dumps(cap.fingerprint(), sort_keys=True)
    head = {"fingerprint": fp, "dtype": dtype, "ensemble": ensemble, "threads": torch.get_num_threads(), "oracle": __version__,
            "out": out.name}  # fmt: skip
    if distributed.world() > 1:  # which members a rank owns depends on the number of ranks
        head.update(rank=distributed.rank(), ranks=distributed.world())
    if split == "tokens":  # which rows a rank owns, too
        head["split"] = split
    return head


def replay_streamed(cap: Bundle, out: Path, *, dtype: str, ensemble: int, budget: int, overwrite: bool, progress: bool,
                    base: dict[str, Any], t0: float, activation_budget: int | None = None,
                    token_chunk: int | None = None, split: str = "tensor", replace_work: str = "this-step") -> Path:  # fmt: skip
    """``replace_work``: which work folder of ours beside ``out`` may be replaced (streaming/workdir.py, ``open_work``);
    ``activation_budget`` (bytes) overrides the activations' share of the budget (tests force spilling);
    ``token_chunk`` the rows per chunk of per-token submodules (tests force chunking; default tokens.CHUNK);
    ``split="tokens"`` with several ranks: the float64 step split by tokens (``_replay_tokens``)."""
    from ..setup import carry_inputs_and_weights, load_inputs, recipe_of, recorded_boundaries

    tame_malloc()
    recipe = recipe_of(cap)
    if not recipe.stream_units():
        raise RecipeError(f"recipe {recipe.name!r} declares no streaming units (stream_units); replay it without --max-memory")
    compute, round_to, ops = precisions.emulation(dtype)
    reduction = (cap.get("loss") or {}).get("reduction", "mean")
    ranks = distributed.world()
    by_tokens = ranks > 1 and split == "tokens"
    # one work directory per rank (.NAME.rankR.partial): its members' journals, resumed per rank
    inputs = load_inputs(cap, compute)  # validated (packed boundaries) before any work folder exists
    work, adopted = work_dir(
        out if ranks == 1 else out.with_name(f"{out.name}.rank{distributed.rank()}"),
        work_header(cap, dtype, ensemble, out, "tokens" if by_tokens else "tensor"),
        overwrite=overwrite,
        replace=replace_work,
    )
    if by_tokens:
        return _replay_tokens(cap, out, recipe, inputs, work, adopted, compute=compute, reduction=reduction, budget=budget,
                              overwrite=overwrite, progress=progress, base=base, t0=t0,
                              activation_budget=activation_budget, token_chunk=token_chunk)  # fmt: skip
    members = ["grads"] + [f"grads.{k}" for k in range(1, ensemble)]
    losses, orders, promotions, stats = [], [], 0, {}
    resumed, notes = False, []  # resumed: finished work was taken over (not merely a folder found)
    for k, member in enumerate(members):
        if not distributed.mine(k):
            continue
        rec = workdir.read_end(work, work / member) if adopted else None
        if rec is not None:  # a finished member of a resumed run, its journal and shards verified
            losses.append(rec["loss"])
            orders.append(rec["order"])
            promotions += rec["promotions"]
            resumed = True
            continue
        mode = PrecisionMode(compute, round_to, ops, jitter_seed=precisions.member_seed(k), device_type=cap.capture_device())
        build_mode = PrecisionMode(compute)
        engine = StreamEngine(cap, recipe, mode, build_mode, compute, work, budget=None, member=member,
                              progress=progress and distributed.is_main(),
                              **({} if token_chunk is None else {"token_chunk": token_chunk}))  # fmt: skip
        token_split.kill_hook(engine.journal, distributed.rank())  # fault injection for tests only (ORACLE_TEST_KILL)
        resumed = resumed or bool(engine.journal.units or engine.journal.calls)
        if engine.journal.note:
            notes.append(engine.journal.note)
        reserve = budgets.need(cap, engine.model, recipe, compute, token_chunk)
        fixed = rss_bytes() + reserve["bytes"]
        if budget < fixed:
            if not resumed:  # the folder this run made holds nothing: a rerun must not "resume" it
                shutil.rmtree(work, ignore_errors=True)
            raise UsageError(budgets.refusal(budget, fixed, reserve["by"]))
        engine.store.budget = budget - fixed if activation_budget is None else activation_budget
        mmap_mb = _malloc_for(cap, engine, compute, budget, fixed, activation_budget)
        torch.manual_seed(0)
        with recorded_boundaries(inputs):
            loss = engine.run(inputs, reduction)
        member_promotions = mode.promotions + build_mode.promotions
        promotions += member_promotions
        stats = {"activations_in_memory_peak": engine.store.peak_in_memory, "activations_spilled": engine.store.spilled_bytes,
                 "store_budget": engine.store.budget, "fixed_estimate": fixed, "malloc_mmap_mb": mmap_mb,
                 "disk_written": stats.get("disk_written", 0) + engine.store.written + engine.journal.written}  # fmt: skip
        workdir.write_end(work, work / member, {"loss": loss, "order": engine.order, "promotions": member_promotions})
        losses.append(loss)
        orders.append(engine.order)
        del engine
    if ranks > 1:
        if not distributed.is_main():  # send each own member's end record and gradient shards to rank 0
            for k, member in enumerate(members):
                if distributed.mine(k):
                    units = read_journal(work / member, "unit")
                    end = json.loads((work / member / "end.json").read_text())
                    distributed.send_parts(
                        member, {"end": end, "units": units, "resumed": resumed}, [work / member / u["file"] for u in units]
                    )
            distributed.finish()  # rank 0 has published the bundle: this rank's journals are no longer needed
            shutil.rmtree(work, ignore_errors=True)
            return out
        by_member = dict(zip([m for k, m in enumerate(members) if distributed.mine(k)], zip(losses, orders)))
        for k, member in enumerate(members):
            if not distributed.mine(k):
                (work / member).mkdir(exist_ok=True)
                part = distributed.recv_parts(member, distributed.owner(k), work / member)
                write_file(work / member / "journal.jsonl", "".join(json.dumps(u) + "\n" for u in part["units"]))
                by_member[member] = (part["end"]["loss"], part["end"]["order"])
                resumed = resumed or bool(part.get("resumed"))  # the run resumed if any rank took over finished work
        losses, orders = [by_member[m][0] for m in members], [by_member[m][1] for m in members]
    kind = "oracle" if dtype == "fp64" else "emulation"
    with BundleWriter(out, kind, overwrite=overwrite) as w:
        w.manifest.update(base)
        w.manifest["streaming"] = {"max_memory": budget, "peak_rss": max_rss_bytes(), "resumed": resumed, **stats}
        if notes:
            w.manifest["streaming"]["recomputed"] = notes
        if ranks > 1:
            w.manifest["ranks"] = ranks
        if kind == "oracle":
            w.manifest.update(loss={**(cap.get("loss") or {}), "value": losses[0]}, backward_order=orders[0], certificate=None,
                              numerics={"compute": "float64", "promotions": promotions, "fused": fused.state()})  # fmt: skip
            del w.manifest["fingerprint"]  # an oracle carries the inputs and weights themselves
            carry_inputs_and_weights(cap, w)
        else:
            w.manifest.update(
                loss={**(cap.get("loss") or {}), "value": losses[0], "members": losses}, members=ensemble,
                emulation=emulation_record(compute, round_to, ops),
            )
        for member in members:
            for rec in read_journal(work / member, "unit"):
                if not workdir.FILE_NAME.fullmatch(str(rec.get("file"))):  # never a path out of the folder
                    raise BundleError(f"{work / member / JOURNAL_NAME}: a record names {rec.get('file')!r}; "
                                      f"delete {work} and run again")  # fmt: skip
                # linked, not moved: killed before the bundle is published, a rerun still finds every shard
                w.adopt(member, work / member / rec["file"], rec["entries"], own=True,
                        fname=f"{member}-{rec['file'].split('-')[-1]}")  # fmt: skip
        w.manifest["seconds"] = round(time.perf_counter() - t0, 3)
    shutil.rmtree(work, ignore_errors=True)
    distributed.finish()
    return out


def _malloc_for(cap: Bundle, engine: StreamEngine, compute: torch.dtype, budget: int, fixed: int,
                activation_budget: int | None, rows: int | None = None) -> int:
    """The mmap threshold this replay runs at, set (``tame_malloc``) and returned for the manifest: a budget with
    room for the heap's retention above what the run holds at 1 MiB (``fixed`` + every boundary activation, at
    ``rows`` text rows: a token-parallel rank's largest share, else the whole step) runs the faster threshold
    (``roomy_mmap_mb``); tests that force the store's budget (``activation_budget``) keep the one set at start."""
    if activation_budget is not None:
        return user_mmap_mb() or MMAP_MB  # as tame_malloc set it at the start
    T, P = budgets.tensor_counts(cap.manifest["tensors"]["inputs"])
    acts = plans.boundaries(engine.model, engine.units, cap.manifest["recipe"]["config"], rows or T, P,
                            compute.itemsize)["activations"]  # fmt: skip
    mmap_mb = roomy_mmap_mb(budget, fixed + acts, compute)
    tame_malloc(mmap_mb)
    return mmap_mb


def _replay_tokens(cap: Bundle, out: Path, recipe, inputs: dict[str, torch.Tensor], work: Path, adopted: bool, *,
                   compute: torch.dtype, reduction: str, budget: int, overwrite: bool, progress: bool,
                   base: dict[str, Any], t0: float, activation_budget: int | None, token_chunk: int | None) -> Path:  # fmt: skip
    """The streamed float64 step split by tokens over the ranks (oracle/replay/token_split.py). Every
    rank streams its rows: its own engine, work folder and journal, its units' weights materialised
    from its local copy of the capture per unit; its gradient shards are partial sums over its rows.
    Between forward and backward the ranks agree on the units they all finished (skipped on resume).
    At the end the partial shards are added onto rank 0 by a binomial tree (partials.schedule; gloo,
    distributed.send_parts), each received file added unit by unit as its bytes arrive; rank 0 writes the
    bundle with the single-process streamed layout (one shard per unit)."""
    from ...parallel import token_parallel
    from .. import token_split
    from ..setup import carry_inputs_and_weights

    ranks, me = distributed.world(), distributed.rank()
    member = "grads"
    _, round_to, ops = precisions.emulation("fp64")
    mode = PrecisionMode(compute, round_to, ops, jitter_seed=None, device_type=cap.capture_device())
    build_mode = PrecisionMode(compute)
    engine = StreamEngine(cap, recipe, mode, build_mode, compute, work, budget=None, member=member,
                          progress=progress and distributed.is_main(),
                          **({} if token_chunk is None else {"token_chunk": token_chunk}))  # fmt: skip
    resumed_here = bool(engine.journal.units or engine.journal.calls)
    reserve = budgets.need(cap, engine.model, recipe, compute, token_chunk, ranks=ranks)
    fixed = rss_bytes() + reserve["bytes"]
    if budget < fixed:  # every rank sees the same step and budget: all refuse alike (exit 2)
        if not resumed_here:
            shutil.rmtree(work, ignore_errors=True)
        raise UsageError(budgets.refusal(budget, fixed, reserve["by"]) + f" (per rank, {ranks} ranks)")
    engine.store.budget = budget - fixed if activation_budget is None else activation_budget
    mmap_mb = _malloc_for(cap, engine, compute, budget, fixed, activation_budget, rows=max(token_parallel.Layout(
        budgets.tensor_counts(cap.manifest["tensors"]["inputs"])[0], ranks, me).counts))  # fmt: skip
    engine.before_backward = token_split.agree
    token_split.kill_hook(engine.journal, me)
    torch.manual_seed(0)
    with distributed.collectives("the token-parallel streamed step"):
        local, within = token_split.splitter(ranks, me)(engine.model, inputs)
        with within:
            loss = engine.run(local, reduction)
        workdir.write_end(work, work / member, {"loss": loss, "order": engine.order,
                                                "promotions": mode.promotions + build_mode.promotions})  # fmt: skip
        total = token_parallel.sum_scalars(loss)
        order = token_split.merged_order(token_parallel.gather_lists(engine.order))
        peak = token_parallel.gather_ints(max_rss_bytes())
        held = token_parallel.gather_ints(engine.store.peak_in_memory + engine.store.spilled_bytes)  # boundary activations
        reserves = token_parallel.gather_ints(fixed)
        resumed = any(token_parallel.gather_ints(int(resumed_here)))
    units = read_journal(work / member, "unit")
    skipped = sorted(engine.agreed or ())
    stats = {"activations_in_memory_peak": engine.store.peak_in_memory, "activations_spilled": engine.store.spilled_bytes,
             "store_budget": engine.store.budget, "fixed_estimate": fixed, "malloc_mmap_mb": mmap_mb,
             "disk_written": engine.store.written + engine.journal.written}  # fmt: skip
    promotions = mode.promotions + build_mode.promotions
    del engine
    # the partial gradients summed onto rank 0 by a binomial tree (partials.schedule): added as they arrive
    sums = [(work / member / u["file"], u) for u in units]
    keep = {path for path, _ in sums}  # the journal's own files: read, never moved (resume)
    steps = partials.schedule(ranks, me)
    for i, (what, peer) in enumerate(steps):
        if what == "recv":
            sums = partials.add_into(sums, peer, lambda r, sink: distributed.recv_parts(f"tokens-{r}-{me}", r, sink=sink),
                                     work / "summed", keep, hashing=me == 0 and i == len(steps) - 1)  # fmt: skip
        else:
            distributed.send_parts(f"tokens-{me}-{peer}", {"units": [{**rec, "file": p.name} for p, rec in sums]},
                                   [p for p, _ in sums], dst=peer)  # fmt: skip
    if not distributed.is_main():
        distributed.finish()
        shutil.rmtree(work, ignore_errors=True)
        return out
    shards = partials.finish(sums, work / "summed", keep)
    T = int(inputs["tokens" if "tokens" in inputs else "input_ids"].shape[-1])
    with BundleWriter(out, "oracle", overwrite=overwrite) as w:
        w.manifest.update(base)
        w.manifest["streaming"] = {"max_memory": budget, "peak_rss": max(peak), "resumed": resumed, **stats}
        w.manifest["ranks"] = ranks
        w.manifest["token_parallel"] = {
            "ranks": ranks, "bound_rel": token_parallel.BOUND_REL, "tokens": T, "streamed": True,
            "rows": [[list(s) for s in token_parallel.spans_of(T, ranks, r)] for r in range(ranks)],
            "peak_rss": peak, "skipped_units": skipped,
            "activations": held, "fixed_estimate": reserves,  # per rank: boundary activations (held + spilled), process + largest need
            "replicated": sorted({n.split(".visual.")[0] + ".visual" for rec in units for n in rec["entries"] if ".visual." in n}),
        }  # fmt: skip
        w.manifest.update(loss={**(cap.get("loss") or {}), "value": total}, backward_order=order, certificate=None,
                          numerics={"compute": "float64", "promotions": promotions, "fused": fused.state()})  # fmt: skip
        del w.manifest["fingerprint"]  # an oracle carries the inputs and weights themselves
        carry_inputs_and_weights(cap, w)
        for path, entries in shards:  # named as the single-process streamed bundle names its shards
            dst = path.with_name(f"{member}-{path.name.split('-')[-1]}")
            path.rename(dst)
            w.adopt(member, dst, entries, move=True)
        w.manifest["seconds"] = round(time.perf_counter() - t0, 3)
    shutil.rmtree(work, ignore_errors=True)
    distributed.finish()
    return out
