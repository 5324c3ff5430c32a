"""``torch_npu.npu_swiglu(x, dim=-1)``: x split in halves a, b along ``dim``; y = silu(a) * b, rounded
once to x's dtype. Backward: s = sigmoid(a), da = dy*b*s*(1 + a*(1-s)), db = dy*silu(a)."""

from __future__ import annotations

import torch


class _Swiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):
        from . import compute_dtype

        a, b = x.to(compute_dtype(x)).chunk(2, dim=dim)
        ctx.save_for_backward(x)
        ctx.dim = dim
        return (a * torch.sigmoid(a) * b).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        from . import compute_dtype

        (x,) = ctx.saved_tensors
        a, b = x.to(compute_dtype(x)).chunk(2, dim=ctx.dim)
        g = dy.to(a.dtype)
        s = torch.sigmoid(a)
        da = g * b * s * (1 + a * (1 - s))
        db = g * a * s
        return torch.cat([da, db], dim=ctx.dim).to(x.dtype), None


def npu_swiglu(x, dim=-1):
    from . import CALLS

    CALLS["npu_swiglu"] += 1
    if x.shape[dim] % 2:
        raise ValueError(f"npu_swiglu: x's dim {dim} has odd size {x.shape[dim]}; it must split into two halves")
    return _Swiglu.apply(x, dim)
