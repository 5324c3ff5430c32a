"""``torch_npu.npu_rms_norm(x, gamma, epsilon=1e-6) -> (y, rstd)``.

rstd = 1/sqrt(mean(x^2 over gamma's dims) + epsilon), shape x.shape[:-gamma.dim()] + (1,)*gamma.dim(),
in the compute dtype; y = x * rstd * gamma, rounded once to x's dtype. Backward (xhat = x*rstd,
gy = dy*gamma): dx = rstd * (gy - xhat * mean(gy*xhat)), dgamma = sum over the leading dims of dy*xhat.
"""

from __future__ import annotations

import torch


def _dims(gamma):
    return tuple(range(-gamma.dim(), 0))


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, eps):
        from . import compute_dtype

        c = compute_dtype(x, gamma)
        xf, gf = x.to(c), gamma.to(c)
        rstd = torch.rsqrt(xf.pow(2).mean(dim=_dims(gamma), keepdim=True) + eps)
        y = (xf * rstd * gf).to(x.dtype)
        ctx.save_for_backward(x, gamma, rstd)
        ctx.mark_non_differentiable(rstd)
        return y, rstd

    @staticmethod
    def backward(ctx, dy, _drstd):
        x, gamma, rstd = ctx.saved_tensors
        c = rstd.dtype
        dims = _dims(gamma)
        xhat = x.to(c) * rstd
        dyf = dy.to(c)
        gy = dyf * gamma.to(c)
        dx = rstd * (gy - xhat * (gy * xhat).mean(dim=dims, keepdim=True))
        lead = tuple(range(x.dim() - gamma.dim()))
        dgamma = (dyf * xhat).sum(dim=lead) if lead else dyf * xhat
        return dx.to(x.dtype), dgamma.to(gamma.dtype), None


def npu_rms_norm(x, gamma, epsilon=1e-6):
    from . import CALLS

    CALLS["npu_rms_norm"] += 1
    return _RmsNorm.apply(x, gamma, float(epsilon))
