"""The memory-bounded streaming replay: a model too large for memory, replayed unit by unit.

Selected by ``oracle replay --max-memory SIZE``. The recipe's own transformers model runs its own
forward; nothing is cut into hand-written stages. What changes is what its *units* (the recipe's
``stream_units()``: decoder layers, ViT blocks, mergers, embeddings) do when they are called:

forward   each unit call is one autograd node (``_UnitCall``). Its float64 weights are materialised
          from the capture just before it runs (oracle/replay/streaming/materialize.py), it runs without recording
          a graph, its weights are evicted after. Only its inputs are kept (oracle/replay/streaming/spill.py: in
          memory up to the budget, the oldest spilled to disk past it). Everything between units
          (residual glue, deepstack additions, the final norm, rotary tables) is ordinary autograd.
head/loss the head and loss run by vocabulary chunks (oracle/replay/headloss.py): the head weight is
          read from the capture by chunks and its gradient written by chunks (head.py); a token
          embedding holds only the rows the step used (embedding.py); a decoder layer runs by row
          chunks against its whole sequence's keys and values (layers.py; float64 oracles), other
          per-token submodules (the recipe's MLPs) by token chunks inside a unit (tokens.py).
backward  autograd reaches a unit's node: its inputs are taken back, its weights materialised, the
          unit is run again from those inputs (the same ops in the same order as the forward, so
          the same values bitwise) with autograd on, and backpropagated from the gradient arriving
          at its outputs. Its parameters' gradients are final once all calls of the unit are done:
          they are written as one shard of the oracle bundle there and then, and the weights evicted.
Parameters outside every unit (final norm, vision position table) and parameters shared by two
units (tied embeddings) stay resident for the whole run and are written last.

Numerics are the in-memory replay's: the same PrecisionMode, the same chunked attention and
chunked head/loss. Streamed and in-memory oracles are bitwise equal on the recipes' models (tested);
what differs is only the order in which autograd accumulates a tensor's gradient where several
uses meet outside a unit, which could move a last bit: the bound stated and tested is 1e-12 relative.

Resume: everything lives in a work directory beside ``--out`` (``.NAME.partial``) with a journal.
After each unit's backward, its gradient shard and the gradients it sent to its inputs are written
and journalled. A replay killed at any point and started again with the same command and the same
thread count reruns the forward (deterministic) and, for every journalled unit, returns the stored
input gradients instead of recomputing it: it ends bitwise identical to an uninterrupted run. For
emulated members the stored input gradients carry whether amp held them in low precision (the sums
they meet round as before), and the jitter stream is reseeded after every unit call's backward
(``_reseed``), so what the glue between units draws does not depend on which units were skipped.
Split by tokens over ranks (oracle/replay/token_split.py), ``agreed`` replaces the journal's own
finished units by those every rank finished (set by ``before_backward``, after the forward), so
that all ranks recompute, and exchange K/V for, the same units.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from tqdm import tqdm

from ...bundle.store import Bundle
from ...capture.modules import select
from ...errors import UsageError
from ...precision.mode import PrecisionMode
from ..loss import chunked_head
from ..setup import use_fused, use_replay_attention
from . import workdir
from .embedding import UsedRows, by_rows, write_dense
from .head import CaptureHead
from .journal import DROPPED, Journal
from .layers import CHUNK as LAYER_CHUNK
from .layers import backward_only, chunk_layer, is_decoder_layer
from .materialize import META, Weights, evict, materialize, shared_parameters, skeleton
from .spill import ActivationStore
from .tokens import CHUNK as TOKEN_CHUNK
from .tokens import chunk_tokens

MMAP_MB = 1  # the default: freed tensors above 1 MiB leave the process, so the budget's estimate holds


FAST_MMAP_MB = 32  # glibc's own ceiling for its dynamic threshold: freed tensors below it are reused from the heap
# The heap's retention at 32 MiB, measured (peak over the 1 MiB run's): the float64 truth 1.22x on benchmark b streamed
# (1.00 vs 0.82 GiB), 1.11-1.17x on Qwen3-VL-8B's 2048-token cut (5.72 / 6.02 vs 5.14 GiB). So a float64 run whose
# budget is at least HEADROOM x what it holds at 1 MiB (its fixed need and every boundary activation in memory) takes
# the faster threshold; the dry run prices its peak x HEAP_RETENTION: 1.1 puts the 8B cut's estimates at 0.95x (2048
# tokens: 5.45 vs 5.72 GiB) and 1.04x (16384 tokens: 8.36 vs 8.01 GiB) of the measured peaks (1.2 gave 1.04x and 1.14x).
HEADROOM = 1.5
HEAP_RETENTION = 1.1
# An emulated band member (float32 tensors, more of them mid-sized: the rounding's and the row chunks') keeps more and
# saves more. On the 8B cut at 16384 tokens (`python benchmarks/user_step.py cut --tokens 16384 --side 224 --dtype bf16`,
# 2026-12-06, one after the other): 909 s at 1 MiB (106 M minor faults, 409 s of system time) vs 784 s at 32 MiB
# (0.86x; 259 s system), peak 4.19 vs 4.89 GiB, the 1 MiB model's estimate 4.00 GiB (so 1.22x of it); a band of 2 at
# Qwen3 hidden 1024 x 4 layers, 4096 tokens: 185 s vs 119 s, 0.86 vs 1.12 GiB (1.31x; 6.2 M vs 0.25 M faults). On the
# 2048-token cut before the in-place rounding (2026-12-05): 148 vs 153 s, 1.52x of that model (4.07 vs 2.67 GiB). So a
# member takes it where its budget has EMULATED_HEADROOM (above the 1.52x seen), priced x EMULATED_RETENTION (1.06x of
# the 16384-token peak). At the user's 8B/64k step a member fills a 16G budget, so it keeps 1 MiB there.
EMULATED_HEADROOM = 1.6
EMULATED_RETENTION = 1.3


def heap_retention(compute: torch.dtype) -> float:
    """What the dry run multiplies its 1 MiB peak by where the run picks FAST_MMAP_MB."""
    return HEAP_RETENTION if compute == torch.float64 else EMULATED_RETENTION


def roomy_mmap_mb(budget: int, holds: int, compute: torch.dtype = torch.float64) -> int:
    """The mmap threshold a streamed replay runs at (``tame_malloc``): ``ORACLE_MALLOC_MMAP_MB`` when the user
    set it; else ``FAST_MMAP_MB`` when ``budget`` >= HEADROOM x ``holds`` (bytes the run holds at 1 MiB: fixed need plus
    all boundary activations, so nothing spills either way; EMULATED_HEADROOM for a band member), where the heap's
    retention fits and the page faults of a fresh mmap per tensor are saved (benchmark b streamed: 0.71x the time, sys
    20 s -> 4 s; a member on the 8B cut at 16384 tokens 0.86x); else MMAP_MB, where the budget's estimate is a promise."""
    room = HEADROOM if compute == torch.float64 else EMULATED_HEADROOM
    return user_mmap_mb() or (FAST_MMAP_MB if budget >= room * holds else MMAP_MB)


def user_mmap_mb() -> int | None:
    """``ORACLE_MALLOC_MMAP_MB`` when set to a whole number of MiB >= 1; None when unset or malformed."""
    value = os.environ.get("ORACLE_MALLOC_MMAP_MB", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def tame_malloc(mb: int | None = None) -> None:
    """Pin glibc's mmap threshold (``ORACLE_MALLOC_MMAP_MB``, default 1 MiB) and its trim threshold
    (twice that), so that what the process holds is what the budget counts.

    Left alone, glibc raises its threshold after large frees (up to 32 MiB), so freed weights of
    that size stay in the heap and RSS only grows. Pinned at 1 MiB, every tensor above it is a fresh
    mmap, page-faulted and zeroed 4 KiB at a time and unmapped at its free: measured on benchmark b's
    shape (Qwen3 text hidden 512, 8 layers, 4096 tokens, 2 threads) 63.6 s against 42.6 s pinned at
    32 MiB (benchmarks/streaming_sys.py). But at 32 MiB the heap keeps the freed tensors below it:
    on Qwen3-VL-8B's shapes (benchmarks/user_step.py cut, 2048 tokens) the peak rose from 5.14 GiB
    (1 MiB; the budget's estimate 4.95 GiB = 0.96x) to 6.02 GiB (0.82x) for 0.86x the time, and
    a budget is a promise. So 1 MiB stays the default; 32 MiB is for a budget with room to spare, which the
    driver picks by itself (``roomy_mmap_mb``) when the user did not set the variable.
    ``_trim`` hands the heap's free pages back after every unit's backward either way."""
    mb = mb or user_mmap_mb() or MMAP_MB  # a malformed value: the default
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, mb << 20)  # M_MMAP_THRESHOLD (setting it also stops glibc's dynamic raise)
        libc.mallopt(-1, 2 * mb << 20)  # M_TRIM_THRESHOLD: the heap's top is not shrunk and regrown per op
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


class _Call:
    """One call of one unit: what its backward needs."""

    __slots__ = (
        "unit",
        "index",
        "handle",
        "leaves",
        "spec",
        "tensor_pos",
        "requires",
        "low",
        "out_spec",
        "out_pos",
        "gen",
        "producers",
        "keep",
    )

    def __init__(self, unit: str, index: int):
        self.unit, self.index = unit, index


class _UnitCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, engine: StreamEngine, call: _Call, anchor: torch.Tensor, *tensors: torch.Tensor):
        ctx.engine, ctx.call = engine, call
        outs = engine._forward_unit(call, list(tensors))
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        grads = ctx.engine._backward_unit(ctx.call, list(grad_outs))
        return (None, None, None, *grads)


def partition(model: torch.nn.Module, recipe) -> tuple[list[str], dict[str, list[str]], str | None, list[str]]:
    """(streamed units, each unit's parameter names, the streamed head or None, resident parameters)
    of a skeleton: the recipe's units, outermost only, less those holding a tied parameter."""
    names = [n for n, _ in model.named_modules()]
    rx = recipe.stream_units()
    units = [n for n in select(model, rx)] if rx else []
    units = [u for u in units if not any(u != o and u.startswith(o + ".") for o in units)]
    shared = shared_parameters(model, units)
    unit_params: dict[str, list[str]] = {}
    for u in units:
        mod = model.get_submodule(u)
        ps = [f"{u}.{n}" for n, _ in mod.named_parameters()]
        if any(p in shared for p in ps):
            continue  # a unit holding a tied parameter is not streamed: it stays resident
        unit_params[u] = ps
    units = [u for u in units if u in unit_params]
    in_units = {p for ps in unit_params.values() for p in ps}
    head = "lm_head" if "lm_head" in names and "lm_head.weight" not in shared else None
    resident = [n for n, _ in model.named_parameters() if n not in in_units and not (head and n == "lm_head.weight")]
    return units, unit_params, head, resident


def token_chunked(model: torch.nn.Module, recipe, units: list[str]) -> list[str]:
    """The recipe's per-token submodules inside streamed units (run by token chunks, tokens.py)."""
    trx = recipe.stream_token_modules()
    return [n for n in select(model, trx) if any(n.startswith(u + ".") for u in units)] if trx else []


class StreamEngine:
    """One streamed forward+backward of a captured step. ``run()`` returns the loss; gradients go
    to ``work`` as shards (journal lines) as they become final."""

    def __init__(self, cap: Bundle, recipe, mode: PrecisionMode, build_mode: PrecisionMode, compute: torch.dtype,
                 work: Path, *, budget: int | None, member: str = "grads", progress: bool = False,
                 token_chunk: int = TOKEN_CHUNK) -> None:  # fmt: skip
        self.cap, self.recipe, self.mode, self.compute = cap, recipe, mode, compute
        self.work, self.member, self.progress = work, member, progress
        self.model = skeleton(recipe, cap.manifest["recipe"]["config"], compute, build_mode)
        use_replay_attention(self.model, mode.round_to)
        self.fused = use_fused(self.model, recipe, mode.round_to)  # the oracle's fused kernels (replay/fused.py)
        self.weights = Weights(cap, compute)
        self.units, self.unit_params, self.head, self.resident = partition(self.model, recipe)
        for n in self.resident:  # small or shared: loaded once, ordinary autograd
            mod_name, _, pname = n.rpartition(".")
            m = self.model.get_submodule(mod_name) if mod_name else self.model
            t = self.weights.load(n)
            m._parameters[pname] = torch.nn.Parameter(t, requires_grad=True)
        self.store = ActivationStore(budget, work / f"{member}.spill")
        self.anchor = torch.zeros((), dtype=compute, requires_grad=True)  # makes every unit call differentiable
        self._seed = mode._gen.initial_seed() if mode._gen is not None else None  # the member's jitter seed
        self.calls: dict[str, int] = {}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.done_calls: dict[str, int] = {}
        self.journal = Journal(work, member)
        self.order: list[str] = []  # gradient completion order: the backward order
        # token-parallel hooks (oracle/replay/token_split.py): the units every rank finished, which alone
        # are skipped on resume (None: this journal's own), and a call made between forward and backward
        self.agreed: set[str] | None = None
        self.before_backward = None
        self.skippable: set[str] = set()  # the finished units this run skips (``_skippable``, set before the backward)
        self.consumers: dict[tuple[str, int], list[_Call]] = {}  # call -> the calls its outputs went to
        self._bars: dict[str, Any] = {}
        self.layer_chunk = min(token_chunk, LAYER_CHUNK)
        self.row_chunked = [u for u in self.units if is_decoder_layer(self.model.get_submodule(u))]
        for u in self.row_chunked:  # decoder layers run by row chunks (layers.py), under the unit's own wrapper
            chunk_layer(self.model.get_submodule(u), self.layer_chunk)
        for u in self.units:
            self._wrap(u)
        self.token_chunked = token_chunked(self.model, recipe, self.units)
        self.by_rows: dict[str, dict[int, UsedRows]] = {u: {} for u in self.units if by_rows(self.model.get_submodule(u))}
        for n in self.token_chunked:  # per-token submodules run by token chunks (tokens.py)
            chunk_tokens(self.model.get_submodule(n), mode, token_chunk)

    # -- wiring -------------------------------------------------------------------------------
    def _wrap(self, unit: str) -> None:
        module = self.model.get_submodule(unit)
        original = module.forward
        engine = self

        def forward(*args, **kwargs):
            index = engine.calls.get(unit, 0)
            engine.calls[unit] = index + 1
            call = _Call(unit, index)
            call.leaves, call.spec = tree_flatten((args, kwargs))
            call.tensor_pos = [i for i, x in enumerate(call.leaves) if isinstance(x, torch.Tensor)]
            tensors = [call.leaves[i] for i in call.tensor_pos]
            call.requires = [t.requires_grad and t.is_floating_point() for t in tensors]
            call.low = [engine.mode._is_low(t) for t in tensors]
            engine._trace(call, [t for t, r in zip(tensors, call.requires) if r])
            outs = _UnitCall.apply(engine, call, engine.anchor, *tensors)
            leaves = list(call.out_spec[0])
            for pos, o in zip(call.out_pos, outs):
                leaves[pos] = o
            return tree_unflatten(leaves, call.out_spec[1])

        module._oracle_forward = original
        module.forward = forward

    def _run(self, call: _Call, tensors: list[torch.Tensor]):
        leaves = list(call.leaves)
        for pos, t in zip(call.tensor_pos, tensors):
            leaves[pos] = t
        args, kwargs = tree_unflatten(leaves, call.spec)
        return self.model.get_submodule(call.unit)._oracle_forward(*args, **kwargs)

    # -- a unit's forward and backward --------------------------------------------------------------
    def _forward_unit(self, call: _Call, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        module = self.model.get_submodule(call.unit)
        call.handle = self.store.put(tensors)
        call.gen = self.mode._gen.get_state() if self.mode._gen is not None else None
        if call.unit in self.by_rows:  # a token embedding: only the used rows (embedding.py)
            rows = self.by_rows[call.unit][call.index] = UsedRows(self.cap, call.unit + ".weight", self.compute,
                                                                  tensors[0], module.padding_idx)  # fmt: skip
            out = rows.forward(rows.weight(requires_grad=False))
        else:
            materialize(module, call.unit + ".", self.weights, requires_grad=False)
            out = self._run(call, tensors)
            evict(module)
        leaves, spec = tree_flatten(out)
        call.out_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        call.out_spec = ([None if isinstance(x, torch.Tensor) else x for x in leaves], spec)
        call.leaves = [None if isinstance(x, torch.Tensor) else x for x in call.leaves]  # tensors live in the store
        self._tick("forward", call.unit)
        return [leaves[i] for i in call.out_pos]

    def _backward_unit(self, call: _Call, grad_outs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        saved = self.journal.grad_inputs(call.unit, call.index)
        if saved is DROPPED:  # no longer needed: the units that would receive it are finished
            saved = [None] * len(call.requires)
        elif saved is not None:  # amp emulation: what was held in low precision is again (the glue's
            saved = [self.mode.mark_low(g) if low else g for g, low in saved]  # sums round as they did)
        skip = call.unit in self.skippable if self.agreed is None else call.unit in self.agreed
        assert saved is not None or self.agreed is None or not skip, f"{call.unit} agreed finished, no input gradients"
        if saved is not None and skip:
            self.mode.promotions += self.journal.promoted.get((call.unit, call.index), 0)  # as if recomputed here
            self.store.take(call.handle)
            self.done_calls[call.unit] = self.done_calls.get(call.unit, 0) + 1
            if self.done_calls[call.unit] == self.calls[call.unit]:  # the order an uninterrupted run records
                self.order += list(self.journal.units[call.unit]["entries"])  # journalled in completion order
            self._reseed(call)
            self._tick("backward", call.unit)
            return saved
        if call.unit in self.by_rows:
            return self._backward_rows(call, grad_outs)
        module = self.model.get_submodule(call.unit)
        promoted = self.mode.promotions  # this call's promotions are journalled: a resumed run counts them too
        tensors = self.store.take(call.handle)
        inputs = []
        for t, req, low in zip(tensors, call.requires, call.low):
            x = t.detach().requires_grad_(True) if req else t
            if low:
                self.mode.mark_low(x)
            inputs.append(x)
        materialize(module, call.unit + ".", self.weights, requires_grad=True)
        # the order this backward completes the unit's parameters in (the first accumulation of each,
        # in the last call): the oracle's backward order inside a unit, as the in-memory replay records it
        seen: dict[str, None] = {}
        hooks = [p.register_post_accumulate_grad_hook(lambda _, n=f"{call.unit}.{n}": seen.setdefault(n))
                 for n, p in module.named_parameters()]  # fmt: skip
        if call.gen is not None:  # emulation: the recomputation draws the forward's jitter (then _reseed)
            self.mode._gen.set_state(call.gen)
        with torch.enable_grad(), backward_only():  # the recomputed outputs are only backpropagated
            out = self._run(call, inputs)
            outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
            pairs = [(o, g) for o, g in zip(outs, grad_outs) if g is not None and o.requires_grad]
            try:
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            finally:
                for h in hooks:
                    h.remove()
        self._reseed(call)
        grads = [x.grad if req else None for x, req in zip(inputs, call.requires)]
        acc = self.pending.setdefault(call.unit, {})
        for n, p in module.named_parameters():
            if p.grad is not None:
                full = f"{call.unit}.{n}"
                acc[full] = acc[full] + p.grad if full in acc else p.grad
        evict(module)
        del inputs, out, outs, pairs
        self.done_calls[call.unit] = self.done_calls.get(call.unit, 0) + 1
        last = self.done_calls[call.unit] == self.calls[call.unit]
        self.journal.record_call(call.unit, call.index, grads, [self.mode._is_low(g) for g in grads],
                                 promotions=self.mode.promotions - promoted)  # fmt: skip
        if last:
            acc = self.pending.pop(call.unit)
            done = [p for p in seen if p in acc] + [p for p in self.unit_params[call.unit] if p in acc and p not in seen]
            grads_of_unit = {p: acc[p] for p in done}  # journalled in that order: a resumed run reads it back
            self.order += done
            self.journal.write_unit(call.unit, grads_of_unit)
            self._drop_consumed(call.unit)
        _trim()
        self._tick("backward", call.unit)
        return grads

    def _backward_rows(self, call: _Call, grad_outs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """A token embedding's backward: the used rows' gradient, accumulated over its calls, written
        dense by chunks when the last call is done."""
        self.store.take(call.handle)
        rows = self.by_rows[call.unit].pop(call.index)
        w = rows.weight(requires_grad=True)
        with torch.enable_grad():
            out = rows.forward(w)
            if grad_outs[0] is not None:
                torch.autograd.backward([out], [grad_outs[0]])
        g = w.grad if w.grad is not None else torch.zeros_like(w)
        acc = self.pending.get(call.unit)
        if acc is not None:  # a second call of the same embedding: sum over the union of their rows
            used = torch.unique(torch.cat([acc[0], rows.used]), sorted=True)
            total = torch.zeros((used.numel(), g.shape[1]), dtype=g.dtype)
            total[torch.searchsorted(used, acc[0])] += acc[1]
            total[torch.searchsorted(used, rows.used)] += g
            self.pending[call.unit] = (used, total)
        else:
            self.pending[call.unit] = (rows.used, g)
        del w, out
        self.done_calls[call.unit] = self.done_calls.get(call.unit, 0) + 1
        grads = [None] * len(call.requires)
        self._reseed(call)
        self.journal.record_call(call.unit, call.index, grads)
        if self.done_calls[call.unit] == self.calls[call.unit] and self.journal.unit_done(call.unit):
            self.pending.pop(call.unit)  # recomputed for its exchanges' sake (token-parallel resume): written already
            self.order.append(call.unit + ".weight")
        elif self.done_calls[call.unit] == self.calls[call.unit]:
            used, g = self.pending.pop(call.unit)
            name = call.unit + ".weight"
            path = self.journal.new_shard()
            entry = write_dense(path.with_suffix(".tmp"), name, list(self.cap.entry("weights", name)["shape"]), used, g)
            os.replace(path.with_suffix(".tmp"), path)
            self.order.append(name)
            self.journal.commit_file(call.unit, path, {name: entry})
            self._drop_consumed(call.unit)
        self._tick("backward", call.unit)
        return grads

    def _reseed(self, call: _Call) -> None:
        """Emulation members: after a unit call's backward, skipped or recomputed, the jitter stream is
        seeded from (the member's seed, unit, call index). The glue between units then draws the same
        jitter in a resumed run as in an uninterrupted one: where a resumed run skips finished units,
        the glue behind them sees dropped (absent) gradients and draws nothing, so a stream merely
        continued would reach the first recomputed unit at another state (a kill in the vision
        backward moved blocks.0, patch_embed and pos_embed: 15 of 104 gradients of grads.1)."""
        if self.mode._gen is None:
            return
        key = hashlib.sha256(json.dumps([self._seed, call.unit, call.index]).encode()).digest()
        self.mode._gen.manual_seed(int.from_bytes(key[:8], "little") >> 1)

    # -- what resume needs, held once --------------------------------------------------------------
    # A finished call's input gradients are journalled so that a resumed run can hand them on without
    # recomputing the unit. They are needed only until every unit that produced those inputs has
    # finished too (a resumed run skips those, ignoring what they receive), and for ever where the
    # gradient also reaches a resident parameter through the glue between units (its gradient is
    # summed at the end of the backward). The forward records, per call, the unit calls its inputs
    # come from (a walk of the glue's autograd graph back to them); the journal drops the file then.
    def _trace(self, call: _Call, tensors: list[torch.Tensor]) -> None:
        # seen holds the nodes, not only their ids: torch 2.8 makes a Python object for a C++ autograd node
        # at each access and frees it when let go, so the id of a node popped and done with went to the next
        # one made, which read as seen and was never walked. The vision merger and the deepstack mergers
        # went missing from the decoder layers' producers, the position table from the first block's, and
        # the journal dropped input gradients those still needed: a resume handed them zeros. torch 2.13
        # keeps one object per node while the graph lives.
        producers, keep, seen = set(), False, {}
        stack = [t.grad_fn for t in tensors]
        keep = any(t.grad_fn is None and t.requires_grad for t in tensors)  # a leaf input: its gradient is a result
        while stack:
            fn = stack.pop()
            if fn is None or id(fn) in seen:
                continue
            seen[id(fn)] = fn
            other = getattr(fn, "call", None)
            if isinstance(other, _Call):
                producers.add((other.unit, other.index))
                continue
            if hasattr(fn, "variable"):  # AccumulateGrad: a leaf (a resident parameter, or the anchor)
                keep = keep or fn.variable is not self.anchor
                continue
            stack.extend(f for f, _ in fn.next_functions)
        call.producers, call.keep = producers, keep
        for p in producers:
            self.consumers.setdefault(p, []).append(call)

    def _skippable(self) -> set[str]:
        """The finished units a resumed run skips, handing on their journalled input gradients: those the
        journal finished with every call's input gradients recorded (kept or dropped), less, to a fixed
        point, those with a call whose input gradients were dropped while a unit producing its inputs is
        recomputed, which needs what that call sends it. A journal cut at a damaged record
        (workdir.valid_records) can hold a finished unit whose input gradients a later, cut-off drop
        removed: it is recomputed, and with it the finished units behind it back to kept gradients (a
        truncated input-gradient file of layers.1, layers.2's dropped after it: layers.2 recomputed from
        layers.3's dropped gradients, zeros, and 80 of 104 gradients zero). An uncut journal gives
        exactly its finished units: a drop follows its producers' shards, a call record its unit's."""
        calls = {(c.unit, c.index): c for cs in self.consumers.values() for c in cs}
        skip = {u for u in self.units if self.journal.unit_done(u)
                and all(self.journal.call_recorded(u, i) for i in range(self.calls.get(u, 0)))}  # fmt: skip
        changed = True
        while changed:
            changed = False
            for u, i in sorted(self.journal.dropped):
                c = calls.get((u, i))
                if u in skip and c is not None and any(p not in skip for p, _ in c.producers):
                    skip.discard(u)
                    changed = True
        return skip

    def _drop_consumed(self, unit: str) -> None:
        """``unit`` is finished (its shard journalled): the input gradients of the calls its calls fed are
        dropped where every unit producing their inputs is finished too. Finished, not merely called:
        a run killed between a unit's input gradients and its shard recomputes that unit on resume,
        from the gradients its consumers sent it (dropping them at its call record lost them: 91 of
        104 gradients differed after a kill right after such a drop)."""
        for i in range(self.calls.get(unit, 0)):
            for c in self.consumers.get((unit, i), []):
                if not c.keep and all(self.journal.unit_done(p[0]) for p in c.producers):
                    self.journal.drop_call(c.unit, c.index)

    # -- the head ----------------------------------------------------------------------------------
    def _prepare_head(self, head: torch.nn.Module):
        if self.head is None or head.weight.device != META:
            return head.weight
        return CaptureHead(self.cap, self.compute, self.journal, self.order)  # by vocabulary chunks (head.py)

    # -- progress ----------------------------------------------------------------------------------
    def _tick(self, phase: str, unit: str) -> None:
        if not self.progress:
            return
        bar = self._bars.get(phase)
        if bar is None:
            total = sum(self.calls.values()) if phase == "backward" else None
            bar = self._bars[phase] = tqdm(total=total, desc=f"{self.member}: {phase}", unit="unit", leave=False)
        bar.update(1)
        bar.set_postfix_str(unit[-40:], refresh=False)

    # -- the step ------------------------------------------------------------------------------------
    def run(self, inputs: dict[str, torch.Tensor], reduction: str) -> float:
        with self.mode, chunked_head(self._prepare_head):
            loss, _ = self.recipe.forward_loss(self.model, inputs, reduction)
            if self.mode.round_to is None:
                assert loss.dtype == torch.float64, f"oracle loss is {loss.dtype}, expected float64"
            hooks = []
            for n in self.resident:
                p = self.model.get_parameter(n)
                hooks.append(p.register_post_accumulate_grad_hook(lambda _, n=n: self.order.append(n)))
            if self.before_backward is not None:
                self.before_backward(self)
            self.skippable = self._skippable()
            try:
                loss.backward()
            finally:
                for h in hooks:
                    h.remove()
                for bar in self._bars.values():
                    bar.close()
        rest = {n: self.model.get_parameter(n).grad for n in self.resident if self.model.get_parameter(n).grad is not None}
        self.journal.write_unit("resident", rest)
        return float(loss.item())


# -- the work directory ---------------------------------------------------------------------------
def work_dir(out: Path, header: dict[str, Any], *, overwrite: bool = False, replace: str = "this-step") -> tuple[Path, bool]:
    """``.NAME.partial`` beside ``out``: adopted (resume) only when it is ours for this run, a new one
    otherwise; a folder that is not ours is never touched (streaming/workdir.py, exit 6)."""
    return workdir.open_work(out, header, overwrite=overwrite, replace=replace)


MAX_SIZE = 1 << 60  # 1 EiB: larger is a typo, not a budget


def parse_size(spec: str) -> int:
    """``16G``, ``512M``, ``1.5T``, ``1073741824`` -> bytes (binary units: G = 2^30)."""
    s = spec.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        number = float(s[:-1]) * units[s[-1]] if s and s[-1] in units else float(s)
    except ValueError:
        raise UsageError(f"--max-memory {spec!r}: expected a size such as 16G, 512M or 1.5T") from None
    if not math.isfinite(number) or number > MAX_SIZE:  # inf, nan, 1e400 (float() reads it as inf)
        raise UsageError(f"--max-memory {spec!r}: expected a finite size of at most 1 EiB, such as 16G, 512M or 1.5T")
    if int(number) <= 0:
        raise UsageError(f"--max-memory {spec!r} must be positive")
    return int(number)


def rss_bytes() -> int:
    """Resident set size now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):  # pragma: no cover
        return 0


def max_rss_bytes() -> int:
    """This process's peak resident set since it started its program: ``VmHWM`` of /proc/self/status.
    Not ``ru_maxrss``: Linux carries a parent's resident set at fork into the child's ru_maxrss
    across exec, so a replay started by a process holding 6 GiB reported a 6 GiB peak whatever it
    held itself (measured: benchmarks/user_step.py's child, 6.02 GiB ru_maxrss, 5.15 GiB VmHWM).
    ru_maxrss only where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):  # pragma: no cover - not Linux
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
