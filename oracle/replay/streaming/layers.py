"""A decoder layer run by row chunks inside a streamed unit: working set O(keys + chunk x width).

Everything in a decoder layer is per token (norms, q/k/v/o projections, their norms, rotary, the
residual additions, the MLP) except the attention core, where query row i reads the keys and
values of rows j <= i of its sample. The layer's own transformers forward therefore runs on a
chunk of rows ``x[a:b]`` at a time (its per-token arguments, the rotary tables and position ids,
sliced to those rows), and the attention interface the replay installs (oracle/replay/attention.py,
``rows_call``) hands the causal attention call to this module, which knows the whole sequence:

forward   pass 1 "collect": for each chunk the layer runs up to its attention call, whose k, v
          (post-rotary, as the interface receives them) are written into whole-sequence buffers
          K, V (B, Hkv, T, D); the rest of the chunk's forward is skipped (``_Collected``).
          pass 2 "compute": for each chunk the layer runs whole; its queries attend to K, V with
          the exact chunked kernel at a row offset (``attention._forward(..., q0=a)``, the ability
          token-parallel replay uses; torch's CPU flash kernel per query chunk where nothing rounds,
          attention_flash.py), with the whole sequence's causal + packed boundaries.
backward  K, V collected again (pass 1), dK, dV zeros; then per chunk, LAST TO FIRST: the layer
          runs with autograd on ``x[a:b]`` (a leaf); its attention is one node whose backward adds
          this chunk's queries' share into dK, dV (``attention._backward(..., dk=dK, dv=dV)``) and
          hands back dQ and dK[a:b], dV[a:b] as the gradients of the chunk's own k, v; causal, so
          no query of an earlier chunk sees these keys: the rows are final. One autograd backward
          from dy[a:b] then yields dx[a:b] through the q, k and v paths together (autograd adds the
          three branches where they meet, as in the unchunked layer), the residuals and the MLP,
          and accumulates the chunk's share into every weight's ``.grad``.
Held: x, y (forward) or x, dy, dx (backward), K, V, dK, dV and one chunk's autograd graph, instead
of the whole layer's graph (about 16 x T x hidden plus the MLP's intermediates).

Numbers. Chunk boundaries lie on the attention kernel's query-chunk grid (sample starts plus
multiples of its chunk), so every query block the kernel computes is the one the unchunked layer
computes; the kernel's backward visits query chunks last to first in both. Outputs, input
gradients and the loss are then the same ops on the same rows as the unchunked layer: bitwise
equal wherever a float64 GEMM's row does not depend on how many rows it is given (OpenBLAS/MKL
on this CPU; tested). A weight's gradient is a sum over tokens, here added chunk by chunk (last
chunk first): within 1e-12 relative of the unchunked sum (tested; measured ~1e-16).

Split by tokens (a rank of --split tokens, oracle/replay/token_split.py): the layer's call holds the
rank's rows (two runs of the sequence); chunks are cut within each run on the whole sequence's grid,
and the collected K, V are every rank's, gathered. The backward cannot finish a chunk's keys
locally (later queries on other ranks read them), so it runs in two phases with one exchange
between (``_backward_split``).

Emulated (a band member streamed: ``attention.FUSED``, setup.use_replay_attention). The layer's ops
run by chunks under the member's PrecisionMode as anywhere else, each rounded where the device rounds
it; the attention core is its device's fused kernel: the exact kernel above in float32, run outside
the mode (no rounding between its steps), its operands and results rounded once
(``precision.mode.kernel_io``), the logsumexp kept unrounded, a key's dK, dV summed over every
query chunk unrounded and rounded once when final -- what the unchunked layer's sdpa op is under
the mode (one op, rounded at its output). The two differ only in the float32 kernel's summation
order (one flash call on the whole sample against flash calls per query chunk, a chunk's prefix and
diagonal merged by their logsumexp), which can move a result across a bf16
rounding boundary: equal to the unchunked member in distribution, not bitwise (a layer of at most
one chunk runs unchunked: bitwise). A jittered member's chunk i draws the same jitter in its
collect, compute and backward passes (``_restore``), so its recomputation is its forward.

When: float64 oracle replays with the registered kernel (``attention.NAME``, or the token-parallel
rows kernel ``token_split.NAME`` while a split step runs) and streamed emulated replays
(``attention.FUSED``; not split by tokens). A layer whose attention is another implementation, an
attention mask tensor, a per-token argument that needs a gradient, or an output other than one
tensor runs unchunked, as before (its MLP still by token chunks, tokens.py): correct, only not
bounded by the chunk.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...errors import RecipeError
from ...parallel.token_parallel import gather_rows, scatter_sum_rows
from ...precision.mode import emulating, kernel_io, outside
from .. import attention, token_split

CHUNK = 1024  # rows per chunk: at Qwen3-VL-8B (hidden 4096, MLP 12288) one chunk's graph is ~1.1 GiB
_state = threading.local()


class _Collected(Exception):
    """Raised by the collect pass's attention call: this chunk's k, v are written, the rest of its forward is skipped."""


def backward_only():
    """Within this block a chunked layer called with autograd on does not compute its output (the
    streaming engine's recomputation backpropagates it and never reads it): pass 2 is skipped."""
    return _flag("backward_only")


@contextlib.contextmanager
def _flag(name: str):
    prev = getattr(_state, name, False)
    setattr(_state, name, True)
    try:
        yield
    finally:
        setattr(_state, name, prev)


def spans(T: int, cu: list[int], grid: int, chunk: int, lo: int = 0) -> list[tuple[int, int]]:
    """Consecutive row spans covering lo..T whose ends lie on the kernel's query-chunk grid (every
    sample start cu[s] plus multiples of ``grid``), each at most ``chunk`` rows where the grid allows
    (else one grid step). ``lo`` > 0: a token-parallel rank's run of rows lo..T-1 (its ends need not
    lie on the grid: the kernel clips its grid to the rows it is given, attention._blocks)."""
    cuts = sorted({c for s in range(len(cu) - 1) for c in range(cu[s], cu[s + 1], grid) if lo < c < T} | {T})
    out, a = [], lo
    for i, c in enumerate(cuts):
        if c <= a:
            continue
        nxt = cuts[i + 1] if i + 1 < len(cuts) else None
        if nxt is None or nxt - a > chunk:  # c is the last cut within a + chunk (or the first beyond it)
            out.append((a, c))
            a = c
    return out


class _Plan:
    """One call of a chunked layer: how to cut its arguments into rows a..b. ``spans``: (a, b, q0),
    local rows a..b-1 of the call, q0 the global row of a (a == q0 in one process); ``layout``: the
    token-parallel rank's (oracle/parallel/token_parallel.py), or None."""

    __slots__ = ("leaves", "spec", "x_pos", "rows_of", "T", "cu", "spans", "grid", "layout", "fused", "mode", "gens")

    def args(self, x: torch.Tensor, a: int, b: int):
        leaves = list(self.leaves)
        for i, dim in self.rows_of.items():
            leaves[i] = leaves[i].narrow(dim, a, b - a)
        leaves[self.x_pos] = x
        return tree_unflatten(leaves, self.spec)


def _plan(module: nn.Module, args: tuple, kwargs: dict, chunk: int) -> _Plan | None:
    """The row plan of one call, or None: run it unchunked (see the module docstring's "When")."""
    impls = {c._attn_implementation for m in module.modules() if (c := getattr(m, "config", None)) is not None}
    split = token_split.current() if impls == {token_split.NAME} else None  # (layout, runs, cu) of a rank
    fused = impls == {attention.FUSED}  # an emulated replay (its device's fused attention, "Emulated" above)
    if impls != {attention.NAME} and split is None and not fused:
        return None
    leaves, spec = tree_flatten((args, kwargs))
    x_pos = 0 if args else next((i for i, v in enumerate(leaves) if v is kwargs.get("hidden_states")), None)
    if x_pos is None or not isinstance(leaves[x_pos], torch.Tensor) or leaves[x_pos].ndim != 3:
        return None
    x = leaves[x_pos]
    T = x.shape[1]
    if T <= chunk or kwargs.get("attention_mask") is not None:
        return None
    rows_of = {}
    for i, v in enumerate(leaves):
        if i == x_pos or not isinstance(v, torch.Tensor):
            continue
        if v.requires_grad:
            return None  # a per-token argument with a gradient: not handled here
        if not v.is_floating_point():
            if v.ndim >= 1 and v.shape[-1] == T:
                rows_of[i] = v.ndim - 1  # position ids: rows on the last dimension
        elif v.ndim >= 2 and v.shape[-2] == T:
            rows_of[i] = v.ndim - 2  # rotary cos / sin: (B, T, D)
        else:
            return None
    p = _Plan()
    p.leaves, p.spec, p.x_pos, p.rows_of, p.T = leaves, spec, x_pos, rows_of, T
    p.fused, p.mode, p.gens = fused, emulating() if fused else None, None
    p.grid = next((int(m.oracle_attention_chunk) for m in module.modules() if hasattr(m, "oracle_attention_chunk")),
                  attention.CHUNK)  # fmt: skip
    if split is not None:  # a rank's rows: its runs of global rows, the whole sequence's boundaries
        p.layout, runs, p.cu = split
        if T != p.layout.counts[p.layout.me]:
            return None
        p.spans = [(lo + a - g0, lo + b - g0, a) for (g0, g1), lo in runs for a, b in spans(g1, p.cu, p.grid, chunk, g0)]
        return p
    p.layout = None
    probe = torch.empty((1, 1, T, 1), device="meta")  # the interface reads the boundaries of T rows
    attn_kwargs = {k: v for k, v in kwargs.items() if k in ("position_ids", "cu_seq_lens_q", "cu_seqlens")}
    p.cu = attention._boundaries(probe, True, attn_kwargs) or [0, T]
    p.spans = [(a, b, a) for a, b in spans(T, p.cu, p.grid, chunk)]
    jitter = p.mode is not None and p.mode._gen is not None
    p.gens = [None] * len(p.spans) if jitter else None  # each chunk's jitter stream state, set by the collect pass
    return p


def _plain(plan: _Plan):
    """Buffer writes of an emulated layer (K, V, y, dx, dK, dV) happen outside its rounding mode: the
    values written are already the format's (rounded where computed); a rounding pass over a whole
    buffer per chunk would cost O(T^2 / chunk) and round its unwritten rows."""
    return outside() if plan.fused else contextlib.nullcontext()


def _restore(plan: _Plan, i: int) -> None:
    """A jittered member: chunk ``i`` draws what the collect pass drew for it, in every pass (its k, v,
    q, the attention's rounding and the rest of the layer identical in the forward and the backward's
    recomputation, as the unchunked layer's are)."""
    if plan.gens is not None:
        plan.mode._gen.set_state(plan.gens[i])


def _held_as(plan: _Plan, buf: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """amp: a buffer of low rows is held low as its rows were (the next op decides by it)."""
    if plan.mode is not None and plan.mode._is_low(part):
        plan.mode.mark_low(buf)
    return buf


def _one_tensor(out) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise RecipeError(f"a row-chunked decoder layer returned {type(out).__name__}, expected one tensor")
    return out


def _collect(fn, plan: _Plan, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1: the whole sequence's post-rotary K, V (B, Hkv, S, D), chunk by chunk (a rank: its
    rows' K, V, then every rank's gathered into the whole sequence's, S the global length)."""
    kv: list[torch.Tensor] = []

    def write(a, b):
        def call(q, k, v, scale, chunk):
            with _plain(plan):
                if not kv:
                    kv.append(k.new_empty((*k.shape[:2], plan.T, k.shape[-1])))
                    kv.append(v.new_empty((*v.shape[:2], plan.T, v.shape[-1])))
                kv[0][:, :, a:b] = k
                kv[1][:, :, a:b] = v
            raise _Collected

        return call

    with torch.no_grad():
        for i, (a, b, _) in enumerate(plan.spans):
            if plan.gens is not None:
                plan.gens[i] = plan.mode._gen.get_state()
            _until_attention(fn, plan, x[:, a:b], a, b, write(a, b))
    if plan.layout is not None:
        return gather_rows(kv[0], plan.layout, 2), gather_rows(kv[1], plan.layout, 2)
    if plan.fused:  # the fused kernel's operands as it reads them (already the format's: no draw), once
        with outside():
            return kernel_io(plan.mode, kv[0]), kernel_io(plan.mode, kv[1])
    return kv[0], kv[1]


class _Given(torch.autograd.Function):
    """One node standing for a chunk's attention in phase 2 of a rank's backward: its backward hands
    q, k, v the given gradients at once, as the attention node does (autograd then runs their
    paths in the order the unchunked layer's backward does)."""

    @staticmethod
    def forward(ctx, q, k, v, dq, dk, dv):
        ctx.grads = (dq, dk, dv)
        return q.new_zeros(())

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, _):
        dq, dk, dv = ctx.grads
        return dq, dk, dv, None, None, None


def _backprop_qkv(fn, plan: _Plan, xc: torch.Tensor, a: int, b: int, dq, dk, dv) -> None:
    """The chunk's layer up to its attention call (the rest of its forward skipped), backpropagated
    from the given q, k, v gradients into ``xc.grad`` and the weights before the attention."""
    got: list[torch.Tensor] = []

    def call(q, k, v, scale, chunk):
        got.append(_Given.apply(q, k, v, dq, dk, dv))
        raise _Collected

    with torch.enable_grad():
        _until_attention(fn, plan, xc, a, b, call)
    got[0].backward()


def _until_attention(fn, plan: _Plan, xc: torch.Tensor, a: int, b: int, call) -> None:
    """Rows a..b's layer forward up to its attention call, which ``call`` takes and ends by raising
    ``_Collected``: the rest of the forward is skipped."""
    args, kwargs = plan.args(xc, a, b)
    with attention.rows_call(call):
        try:
            fn(*args, **kwargs)
        except _Collected:
            return
    raise RecipeError("a row-chunked decoder layer finished without calling its attention")


def _attend(plan: _Plan, K, V, q0: int):
    def call(q, k, v, scale, chunk):
        _check(plan, chunk)
        if plan.fused:
            return _fused_forward(plan, q, K, V, q0, scale, chunk)[1]
        out, _ = attention._forward(q.contiguous(), K, V, plan.cu, True, scale, chunk, chunk, q0=q0)
        return out

    return call


def _fused_forward(plan: _Plan, q, K, V, q0: int, scale: float, chunk: int):
    """An emulated layer's attention of rows q0.. against the whole K, V, as its device's fused kernel:
    the exact kernel in the compute dtype (float32) outside the rounding mode, the operands and the
    output rounded once (``kernel_io``); the logsumexp kept unrounded, as the kernel keeps it.
    -> (q as read, out, lse)."""
    with outside():
        q = kernel_io(plan.mode, q.contiguous())
        out, lse = attention._forward(q, K, V, plan.cu, True, scale, chunk, chunk, q0=q0)
        return q, kernel_io(plan.mode, out), lse


class _FusedRowsOfKV(torch.autograd.Function):
    """``_RowsOfKV`` of an emulated layer (``_fused_forward``): the backward adds the chunk's queries'
    share into dK, dV unrounded (the device's kernel sums a key's gradient over all queries inside, in
    float32) and rounds dq and the chunk's final dK, dV rows once, as the fused backward writes them."""

    @staticmethod
    def forward(ctx, q, k, v, plan, K, V, dK, dV, a, scale, chunk):
        q, out, lse = _fused_forward(plan, q, K, V, a, scale, chunk)
        ctx.save_for_backward(q, out, lse)
        ctx.args = (plan, K, V, dK, dV, a, scale, chunk, k.shape[2])
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, out, lse = ctx.saved_tensors
        plan, K, V, dK, dV, a, scale, chunk, n = ctx.args
        with outside():
            dout = kernel_io(plan.mode, dout.contiguous())
            dq, _, _ = attention._backward(dout, q, K, V, out, lse, plan.cu, True, scale, chunk, chunk, q0=a, dk=dK, dv=dV)
            dk, dv = (kernel_io(plan.mode, d[:, :, a : a + n].clone()) for d in (dK, dV))
            return kernel_io(plan.mode, dq), dk, dv, *([None] * 8)


def _check(plan: _Plan, chunk: int) -> None:
    if chunk != plan.grid:
        raise RecipeError(f"the attention chunk {chunk} is not the {plan.grid} the layer's row spans were cut on")


class _QueriesOfKV(torch.autograd.Function):
    """A rank's backward, phase 1: queries of global rows q0.. against the whole K, V; the backward
    adds their share into dK, dV (every row), writes dq into ``dQ`` at the chunk's local rows and
    stops there: q comes cut from its path, k, v are not its inputs (their paths are backpropagated in phase
    2, once every rank's queries have added into the keys' gradients)."""

    @staticmethod
    def forward(ctx, q, K, V, dK, dV, dQ, a, q0, cu, scale, chunk):
        q = q.contiguous()
        out, lse = attention._forward(q, K, V, cu, True, scale, chunk, chunk, q0=q0)
        ctx.save_for_backward(q, out, lse)
        ctx.args = (K, V, dK, dV, dQ, a, q0, cu, scale, chunk)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, out, lse = ctx.saved_tensors
        K, V, dK, dV, dQ, a, q0, cu, scale, chunk = ctx.args
        dq, _, _ = attention._backward(dout.contiguous(), q, K, V, out, lse, cu, True, scale, chunk, chunk, q0=q0, dk=dK, dv=dV)
        dQ[:, :, a : a + q.shape[2]] = dq
        return (None,) * 11


class _RowsOfKV(torch.autograd.Function):
    """Queries of rows a..b against the whole K, V; backward adds into dK, dV and returns the chunk's rows of them."""

    @staticmethod
    def forward(ctx, q, k, v, K, V, dK, dV, a, cu, scale, chunk):
        q = q.contiguous()
        out, lse = attention._forward(q, K, V, cu, True, scale, chunk, chunk, q0=a)
        ctx.save_for_backward(q, out, lse)
        ctx.args = (K, V, dK, dV, a, cu, scale, chunk, k.shape[2])
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, out, lse = ctx.saved_tensors
        K, V, dK, dV, a, cu, scale, chunk, n = ctx.args
        dq, _, _ = attention._backward(dout.contiguous(), q, K, V, out, lse, cu, True, scale, chunk, chunk, q0=a, dk=dK, dv=dV)
        return dq, dK[:, :, a : a + n].clone(), dV[:, :, a : a + n].clone(), *([None] * 8)


def _forward(fn, plan: _Plan, x: torch.Tensor, compute: bool):
    K, V = _collect(fn, plan, x)
    if not compute:
        return x.new_zeros(()).expand_as(x), K, V  # backward_only: never read
    with _plain(plan):
        y = torch.empty_like(x)
    with torch.no_grad():
        for i, (a, b, q0) in enumerate(plan.spans):
            _restore(plan, i)
            with attention.rows_call(_attend(plan, K, V, q0)):
                args, kwargs = plan.args(x[:, a:b], a, b)
                yc = _one_tensor(fn(*args, **kwargs))
            with _plain(plan):
                y[:, a:b] = yc
    return _held_as(plan, y, yc), K, V


class _ChunkedLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, plan: _Plan, x: torch.Tensor):
        y, K, V = _forward(fn, plan, x, compute=not getattr(_state, "backward_only", False))
        ctx.fn, ctx.plan, ctx.kv = fn, plan, (K, V)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        fn, plan = ctx.fn, ctx.plan
        if plan.layout is not None:
            return None, None, _backward_split(fn, plan, x, dy, ctx)
        K, V = ctx.kv
        ctx.kv = None
        with _plain(plan):
            dK, dV = torch.zeros_like(K), torch.zeros_like(V)
            dx = torch.empty_like(x) if ctx.needs_input_grad[2] else None
        outer = plan.mode._gen.get_state() if plan.gens is not None else None
        for i, (a, b, _) in reversed(list(enumerate(plan.spans))):  # last to first: a chunk's keys are final once its own queries are done
            _restore(plan, i)
            xc = x[:, a:b].detach().requires_grad_(True)

            def call(q, k, v, scale, chunk, a=a):
                _check(plan, chunk)
                if plan.fused:
                    return _FusedRowsOfKV.apply(q, k, v, plan, K, V, dK, dV, a, scale, chunk)
                return _RowsOfKV.apply(q, k, v, K, V, dK, dV, a, plan.cu, scale, chunk)

            with torch.enable_grad(), attention.rows_call(call):
                args, kwargs = plan.args(xc, a, b)
                yc = _one_tensor(fn(*args, **kwargs))
                torch.autograd.backward(yc, dy[:, a:b])
            if dx is not None:
                with _plain(plan):
                    dx[:, a:b] = xc.grad
                _held_as(plan, dx, xc.grad)
            del xc, yc
        if outer is not None:
            plan.mode._gen.set_state(outer)
        return None, None, dx


def _backward_split(fn, plan: _Plan, x, dy, ctx) -> torch.Tensor:
    """A token-parallel rank's layer backward by row chunks. A key's gradient collects from every
    later query, most of which other ranks own, so a chunk's k, v paths cannot be backpropagated
    until all ranks are done with their queries; two phases, with one exchange between:
      1. per chunk, last to first: the layer with autograd on x[a:b]; its attention is a node
         (``_QueriesOfKV``) whose backward adds the chunk's queries' share into dK, dV (the whole
         sequence's rows) and keeps dq, and stops: one autograd backward from dy[a:b] yields the
         residual share of dx[a:b] and every weight gradient after the attention (o_proj, the
         post-attention norm, the MLP), accumulated into ``.grad``;
      2. dK, dV summed over the ranks onto their owners (``scatter_sum_rows``, rank order); then per
         chunk the layer up to its attention call again (``_backprop_qkv``), backpropagated from the kept
         dq and the rank's final dk, dv rows: the rest of dx[a:b] (through the input norm) and the
         q/k/v projections' and their norms' gradients.
    Held besides the unchunked rank's K, V, dK, dV: dQ (the rank's rows x the query width) and its
    final dk, dv rows. Numbers: the same ops per row as the rank's unchunked layer; dx is the
    two branches' sum (as autograd adds them), a weight gradient is added chunk by chunk: within
    the token-parallel bound of the single process (token_parallel.BOUND_REL), bitwise repeatable."""
    K, V = ctx.kv
    ctx.kv = None  # the only references left are these: freed after phase 1
    dK, dV = torch.zeros_like(K), torch.zeros_like(V)
    dx = torch.empty_like(x)
    dQ = None
    for a, b, q0 in reversed(plan.spans):
        xc = x[:, a:b].detach().requires_grad_(True)

        def call(q, k, v, scale, chunk, a=a, q0=q0):
            nonlocal dQ
            _check(plan, chunk)
            if dQ is None:
                dQ = q.new_zeros((*q.shape[:2], plan.T, q.shape[-1]))
            # q cut from its path (phase 2 backpropagates it) but still a leaf needing a gradient, so
            # that autograd runs this node's backward
            return _QueriesOfKV.apply(q.detach().requires_grad_(True), K, V, dK, dV, dQ, a, q0, plan.cu, scale, chunk)

        with torch.enable_grad(), attention.rows_call(call):
            args, kwargs = plan.args(xc, a, b)
            yc = _one_tensor(fn(*args, **kwargs))
            torch.autograd.backward(yc, dy[:, a:b])
        dx[:, a:b] = xc.grad
        del xc, yc
    dk, dv = scatter_sum_rows(dK, plan.layout, 2), scatter_sum_rows(dV, plan.layout, 2)  # the rank's rows, final
    K = V = dK = dV = None  # freed before phase 2
    for a, b, _ in reversed(plan.spans):
        xc = x[:, a:b].detach().requires_grad_(True)
        _backprop_qkv(fn, plan, xc, a, b, dQ[:, :, a:b], dk[:, :, a:b], dv[:, :, a:b])
        dx[:, a:b] += xc.grad
        del xc
    return dx


def is_decoder_layer(module: nn.Module) -> bool:
    """A unit holding a causal attention (a decoder layer; the ViT's blocks are not causal)."""
    return any(getattr(m, "is_causal", False) is True for m in module.modules())


def chunk_layer(module: nn.Module, chunk: int = CHUNK) -> None:
    """Make decoder layer ``module`` run by row chunks of about ``chunk`` rows where it can (the
    module docstring's "When"); other calls run its forward unchanged."""
    original = module.forward

    def forward(*args, **kwargs):
        plan = _plan(module, args, kwargs, chunk)
        if plan is None:
            return original(*args, **kwargs)
        x = plan.leaves[plan.x_pos]
        if not torch.is_grad_enabled() or not x.requires_grad:  # the unit's first forward: nothing saved
            return _forward(original, plan, x, compute=True)[0]
        return _ChunkedLayer.apply(original, plan, x)

    module._oracle_unchunked_layer = original
    module.forward = forward
