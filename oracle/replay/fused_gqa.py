"""Grouped-query attention as one fused CPU kernel under an emulating PrecisionMode, on a torch whose CPU
flash kernel cannot take it (torch 2.8: ``attention._fused_gqa_on_cpu``).

What torch 2.13 does, and this reproduces: transformers' sdpa asks for ``enable_gqa=True`` (H query heads,
Hkv < H key/value heads, no mask) and torch runs ``_scaled_dot_product_flash_attention_for_cpu`` on q (H heads),
k, v (Hkv heads). The mode rounds that one op at its boundary, in this order:
    forward   q, k, v (k, v at their Hkv heads)  ->  kernel  ->  out, logsumexp
    backward  dout, q, k, v, out, logsumexp      ->  kernel  ->  dq, dk, dv (dk, dv at Hkv heads)
(amp keeps the logsumexp in float32: ``precision.mode._FP32_SLOTS``). Inside the kernel nothing is rounded,
and a key's dk, dv are summed over the g = H/Hkv query heads sharing it before they are written.

Here the same kernel runs outside the mode on k, v repeated to the query's heads (a copy, nothing rounded),
and the backward sums each group's dk, dv (B, Hkv, g, T, D) -> (B, Hkv, T, D) outside the mode too: the mode's
rounding points, and a jittered member's draws, are the ones torch 2.13 makes, in its order and shapes. Only
the order of that group sum differs from 2.13's kernel (a last bit of the compute dtype). Repeating k, v
under the mode instead (transformers' repeat_kv) rounds, and jitters, each of the g copies of a key apart,
and the group sum once more: another emulation, and the members' band moved with it (issue 42).
"""

from __future__ import annotations

import torch

from ..precision.mode import _FP32_SLOTS, PrecisionMode, outside

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _repeat(x: torch.Tensor, g: int) -> torch.Tensor:
    b, hkv, t, d = x.shape  # (B, Hkv, T, D) -> (B, Hkv * g, T, D): head j reads key/value head j // g
    return x[:, :, None].expand(b, hkv, g, t, d).reshape(b, hkv * g, t, d)


def _group_sum(dx: torch.Tensor, g: int) -> torch.Tensor:
    b, h, t, d = dx.shape  # (B, H, T, D) -> (B, H / g, T, D): each key's gradient over its g query heads
    return dx.reshape(b, h // g, g, t, d).sum(2)


def _as_the_mode_runs(mode: PrecisionMode, func, args: list[torch.Tensor], run) -> tuple[torch.Tensor, ...]:
    """``run(*args)`` outside ``mode``, its operands and results rounded as the mode rounds ``func``'s
    (precision/mode.py ``__torch_dispatch__``, the branch a fused attention op takes)."""
    amp = mode.ops == "amp"
    keep = _FP32_SLOTS.get(func, ((), ())) if amp else ((), ())
    rounds = mode._rounds(func)
    with outside():
        if rounds:
            args = [a if i in keep[0] else mode._round(a) for i, a in enumerate(args)]
        out = run(*args)
        if not rounds:
            return out
        out = tuple(o if i in keep[1] else mode._round(o) for i, o in enumerate(out))
        return tuple(o if i in keep[1] else mode.mark_low(o) for i, o in enumerate(out)) if amp else out


class FusedGQA(torch.autograd.Function):
    """q (B, H, T, D), k, v (B, Hkv, T, D) -> out (B, H, T, D), as the one fused kernel (module docstring)."""

    @staticmethod
    def forward(ctx, query, key, value, mode: PrecisionMode, is_causal: bool, scale: float | None):
        g = query.shape[1] // key.shape[1]

        def run(q, k, v):
            return _FWD(q, _repeat(k, g), _repeat(v, g), 0.0, is_causal, scale=scale)

        out, lse = _as_the_mode_runs(mode, _FWD, [query, key, value], run)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.args = (mode, is_causal, scale, g)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        query, key, value, out, lse = ctx.saved_tensors
        mode, is_causal, scale, g = ctx.args

        def run(do, q, k, v, o, lse):
            dq, dk, dv = _BWD(do, q, _repeat(k, g), _repeat(v, g), o, lse, 0.0, is_causal, scale=scale)
            return dq, _group_sum(dk, g), _group_sum(dv, g)

        dq, dk, dv = _as_the_mode_runs(mode, _BWD, [dout, query, key, value, out, lse], run)
        return dq, dk, dv, None, None, None
