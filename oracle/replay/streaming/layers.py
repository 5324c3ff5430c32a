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
          token-parallel replay uses), with the whole sequence's causal + packed boundaries.
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

When: float64 oracle replays with the registered kernel (``attention.NAME``) only. A layer whose
attention is another implementation (emulated replays keep the fused sdpa, setup.use_replay_attention;
token-parallel replay's rows kernel), an attention mask tensor, a per-token argument that needs a
gradient, or an output other than one tensor runs unchunked, as before (its MLP still by token
chunks, tokens.py): correct, only not bounded by the chunk.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...errors import RecipeError
from .. import attention

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


def spans(T: int, cu: list[int], grid: int, chunk: int) -> list[tuple[int, int]]:
    """Consecutive row spans covering 0..T whose ends lie on the kernel's query-chunk grid (every
    sample start cu[s] plus multiples of ``grid``), each at most ``chunk`` rows where the grid allows
    (else one grid step)."""
    cuts = sorted({c for s in range(len(cu) - 1) for c in range(cu[s], cu[s + 1], grid)} | {T})
    out, a = [], 0
    for i, c in enumerate(cuts):
        if c <= a:
            continue
        nxt = cuts[i + 1] if i + 1 < len(cuts) else None
        if nxt is None or nxt - a > chunk:  # c is the last cut within a + chunk (or the first beyond it)
            out.append((a, c))
            a = c
    return out


class _Plan:
    """One call of a chunked layer: how to cut its arguments into rows a..b."""

    __slots__ = ("leaves", "spec", "x_pos", "rows_of", "T", "cu", "spans", "grid")

    def args(self, x: torch.Tensor, a: int, b: int):
        leaves = list(self.leaves)
        for i, dim in self.rows_of.items():
            leaves[i] = leaves[i].narrow(dim, a, b - a)
        leaves[self.x_pos] = x
        return tree_unflatten(leaves, self.spec)


def _plan(module: nn.Module, args: tuple, kwargs: dict, chunk: int) -> _Plan | None:
    """The row plan of one call, or None: run it unchunked (see the module docstring's "When")."""
    impls = {c._attn_implementation for m in module.modules() if (c := getattr(m, "config", None)) is not None}
    if impls != {attention.NAME}:
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
    probe = torch.empty((1, 1, T, 1), device="meta")  # the interface reads the boundaries of T rows
    attn_kwargs = {k: v for k, v in kwargs.items() if k in ("position_ids", "cu_seq_lens_q", "cu_seqlens")}
    p.cu = attention._boundaries(probe, True, attn_kwargs) or [0, T]
    p.grid = next((int(m.oracle_attention_chunk) for m in module.modules() if hasattr(m, "oracle_attention_chunk")),
                  attention.CHUNK)  # fmt: skip
    p.spans = spans(T, p.cu, p.grid, chunk)
    return p


def _one_tensor(out) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise RecipeError(f"a row-chunked decoder layer returned {type(out).__name__}, expected one tensor")
    return out


def _collect(fn, plan: _Plan, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1: the whole sequence's post-rotary K, V (B, Hkv, T, D), chunk by chunk."""
    kv: list[torch.Tensor] = []

    def write(a, b):
        def call(q, k, v, scale, chunk):
            if not kv:
                kv.append(k.new_empty((*k.shape[:2], plan.T, k.shape[-1])))
                kv.append(v.new_empty((*v.shape[:2], plan.T, v.shape[-1])))
            kv[0][:, :, a:b] = k
            kv[1][:, :, a:b] = v
            raise _Collected

        return call

    with torch.no_grad():
        for a, b in plan.spans:
            args, kwargs = plan.args(x[:, a:b], a, b)
            with attention.rows_call(write(a, b)):
                try:
                    fn(*args, **kwargs)
                except _Collected:
                    continue
            raise RecipeError("a row-chunked decoder layer finished without calling its attention")
    return kv[0], kv[1]


def _attend(plan: _Plan, K, V, a: int):
    def call(q, k, v, scale, chunk):
        _check(plan, chunk)
        out, _ = attention._forward(q.contiguous(), K, V, plan.cu, True, scale, chunk, chunk, q0=a)
        return out

    return call


def _check(plan: _Plan, chunk: int) -> None:
    if chunk != plan.grid:
        raise RecipeError(f"the attention chunk {chunk} is not the {plan.grid} the layer's row spans were cut on")


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
    y = torch.empty_like(x)
    with torch.no_grad():
        for a, b in plan.spans:
            with attention.rows_call(_attend(plan, K, V, a)):
                args, kwargs = plan.args(x[:, a:b], a, b)
                y[:, a:b] = _one_tensor(fn(*args, **kwargs))
    return y, K, V


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
        K, V = ctx.kv
        ctx.kv = None
        dK, dV = torch.zeros_like(K), torch.zeros_like(V)
        dx = torch.empty_like(x) if ctx.needs_input_grad[2] else None
        for a, b in reversed(plan.spans):  # last to first: a chunk's keys are final once its own queries are done
            xc = x[:, a:b].detach().requires_grad_(True)

            def call(q, k, v, scale, chunk, a=a):
                _check(plan, chunk)
                return _RowsOfKV.apply(q, k, v, K, V, dK, dV, a, plan.cu, scale, chunk)

            with torch.enable_grad(), attention.rows_call(call):
                args, kwargs = plan.args(xc, a, b)
                yc = _one_tensor(fn(*args, **kwargs))
                torch.autograd.backward(yc, dy[:, a:b])
            if dx is not None:
                dx[:, a:b] = xc.grad
            del xc, yc
        return None, None, dx


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
