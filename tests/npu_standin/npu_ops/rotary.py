"""Rotary position embedding, both entry points MindSpeed reaches:

- MindSpeed's own ``npu_rotary_position_embedding(x, cos, sin, mode)`` (its op builder's JIT op;
  ``mode`` 0 = rotate-half, 1 = interleaved) and
- ``torch_npu.npu_rotary_mul(x, r1, r2, rotary_mode="half"|"interleave")`` (r1 = cos, r2 = sin).

y = x*cos + R(x)*sin, R the rotation: half: R(x1, x2) = (-x2, x1) over the last dim's halves;
interleaved: R(x)[2i] = -x[2i+1], R(x)[2i+1] = x[2i]. cos/sin broadcast against x; y is rounded
once to x's dtype. Backward: dx = dy*cos + R^T(dy*sin) (R^T = -R), dcos = dy*x and dsin = dy*R(x),
each summed down to cos's/sin's shape.
"""

from __future__ import annotations

import torch

from . import faults


def _rot(x, interleaved):
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _sum_to(t, shape):
    while t.dim() > len(shape):
        t = t.sum(0)
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and t.shape[i] != 1)
    return t.sum(dim=dims, keepdim=True) if dims else t


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved):
        from . import compute_dtype

        c = compute_dtype(x, cos, sin)
        xf = x.to(c)
        ctx.save_for_backward(x, cos, sin)
        ctx.interleaved = interleaved
        return (xf * cos.to(c) + _rot(xf, interleaved) * sin.to(c)).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        from . import compute_dtype

        x, cos, sin = ctx.saved_tensors
        c = compute_dtype(x, cos, sin)
        g, xf, cf, sf = dy.to(c), x.to(c), cos.to(c), sin.to(c)
        sign = -1.0 if faults.hit("rotary_sin_sign") else 1.0
        dx = g * cf - sign * _rot(g * sf, ctx.interleaved)  # R^T = -R
        dcos = _sum_to(g * xf, cos.shape).to(cos.dtype) if ctx.needs_input_grad[1] else None
        dsin = _sum_to(g * _rot(xf, ctx.interleaved), sin.shape).to(sin.dtype) if ctx.needs_input_grad[2] else None
        return dx.to(x.dtype), dcos, dsin, None


def npu_rotary_position_embedding(x, cos, sin, mode=0):
    from . import CALLS

    CALLS["npu_rotary_position_embedding"] += 1
    if mode not in (0, 1):
        raise ValueError(f"npu_rotary_position_embedding: mode {mode!r} is not 0 (rotate-half) or 1 (interleaved)")
    return _Rotary.apply(x, cos, sin, mode == 1)


def npu_rotary_mul(input, r1, r2, rotary_mode="half"):  # noqa: A002  (torch_npu's argument name)
    from . import CALLS

    CALLS["npu_rotary_mul"] += 1
    if rotary_mode not in ("half", "interleave"):
        raise ValueError(f"npu_rotary_mul: rotary_mode {rotary_mode!r} is not 'half' or 'interleave'")
    return _Rotary.apply(input, r1, r2, rotary_mode == "interleave")
