"""Per-token submodules run by token chunks inside a streamed unit: working set O(chunk x width).

A unit's recomputation (oracle/replay/streaming/engine.py) holds, besides its boundary tensors,
whatever its forward saves for the backward. For an MLP that is gate, up, act(gate) and their
product: 4 x tokens x intermediate_size (at 65536 tokens and Qwen3-VL-8B's 12288, 24 GiB in
float64). A module whose math is per token (row r of the output depends on row r of the input
only: linear layers, MLPs, norms, elementwise) can instead run by chunks of rows:

forward   ``y[a:b] = f(x[a:b])`` for consecutive chunks of the token dimension (dim -2), without
          recording a graph; only x is saved (it is the unit's own tensor, no copy).
backward  per chunk: ``f(x[a:b])`` recomputed with autograd, backpropagated from ``dy[a:b]``:
          ``dx[a:b]`` directly, each parameter's gradient accumulated over the chunks into its
          ``.grad`` (autograd's own accumulation, chunk after chunk in token order).

Numbers: each output row and each input-gradient row is the same ops on the same row as the
unchunked module (bitwise equal wherever the GEMM's per-row result does not depend on how many
rows it is given, which is what OpenBLAS/MKL float64 kernels do on this CPU: tested). A
parameter's gradient is a sum over tokens; split into chunks it is added in another order:
within 1e-12 relative of the unchunked sum (tested, measured ~1e-16). Emulated replays draw their
jitter per chunk and replay the same draws in the backward (the generator state is kept per chunk).
"""

from __future__ import annotations

import torch
from torch import nn

CHUNK = 4096  # token rows per chunk: at Qwen3-VL-8B's MLP, 4096 x 12288 x 8 B = 384 MiB per intermediate


class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, mode, chunk: int, x: torch.Tensor):
        n = x.shape[-2]
        spans = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
        gens, outs = [], []
        low = mode is not None and mode._is_low(x)
        for a, b in spans:
            gens.append(mode._gen.get_state() if mode is not None and mode._gen is not None else None)
            xc = x[..., a:b, :]
            if low:
                mode.mark_low(xc)
            outs.append(fn(xc))
        y = torch.cat(outs, dim=-2)  # (..., n, out)
        ctx.fn, ctx.mode, ctx.spans, ctx.gens, ctx.low = fn, mode, spans, gens, low
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        mode = ctx.mode
        dx = torch.empty_like(x) if ctx.needs_input_grad[3] else None
        outer = mode._gen.get_state() if mode is not None and mode._gen is not None else None
        for (a, b), gen in zip(ctx.spans, ctx.gens):
            if gen is not None:
                mode._gen.set_state(gen)  # the draws the forward made for this chunk
            xc = x[..., a:b, :].detach().requires_grad_(dx is not None)
            if ctx.low:
                mode.mark_low(xc)
            with torch.enable_grad():
                yc = ctx.fn(xc)
                torch.autograd.backward(yc, dy[..., a:b, :])
            if dx is not None:
                dx[..., a:b, :] = xc.grad
        if outer is not None:
            mode._gen.set_state(outer)
        return None, None, None, dx


def chunk_tokens(module: nn.Module, mode, chunk: int = CHUNK) -> None:
    """Make ``module`` (one tensor in, one tensor out, per-token math) run by token chunks of ``chunk``
    rows; inputs of at most ``chunk`` rows run unchanged. ``mode``: the replay's PrecisionMode."""
    original = module.forward

    def forward(x, *args, **kwargs):
        if args or kwargs or x.ndim < 2 or x.shape[-2] <= chunk:
            return original(x, *args, **kwargs)
        if not torch.is_grad_enabled():  # the unit's first forward: chunk too, nothing saved
            return _Chunked.forward(_NoCtx(), original, mode, chunk, x)
        return _Chunked.apply(original, mode, chunk, x)

    module._oracle_unchunked = original
    module.forward = forward


class _NoCtx:
    """Stands in for autograd's ctx when the forward runs without a graph."""

    def save_for_backward(self, *tensors) -> None:
        pass
