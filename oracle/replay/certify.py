"""The oracle certifies itself: float64 central finite differences along random directions.

For K seeded directions v (Gaussian per element, scaled to unit total L2 norm over all
parameters) and step h = 1e-3 * sqrt(number of parameters) * RMS(theta) / 1e3 (that is,
a relative step of about 1e-6 of the parameter vector, clamped below by 1e-7):

    fd_k   = (L(theta + h v) - L(theta - h v)) / (2 h)        truncation O(h^2 L'''), rounding O(eps L / h)
    ad_k   = <grad L(theta), v>                                the replayed float64 gradient
    residual = max_k |fd_k - ad_k| / max(|ad_k|, ||grad||_2 * 1e-8)

In float64 the residual of a correct gradient is about 1e-7 or below; a wrong derivative formula
or a float32 island in the oracle shows up far above that. The residual certifies the replay's
derivative chain, not the accuracy of any device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

FD_WARN = 1e-5  # residuals above this make `oracle score` warn that the oracle is not trustworthy


@torch.no_grad()
def finite_difference_certificate(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    *,
    directions: int = 3,
    seed: int = 1234,
    mode_factory: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> dict:
    params = [p for p in model.parameters() if p.grad is not None]
    for p in params:
        assert p.dtype == torch.float64, "finite differences are only meaningful on the float64 oracle"
    saved = [p.detach().clone() for p in params]
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)).item()
    n = sum(p.numel() for p in params)
    rms = torch.sqrt(sum((s**2).sum() for s in saved) / n).item()
    h = max(1e-6 * rms * n**0.5, 1e-7)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(directions):
        vs = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
        norm = torch.sqrt(sum((v**2).sum() for v in vs))
        vs = [v / norm for v in vs]
        ad = sum((p.grad * v).sum() for p, v in zip(params, vs)).item()
        vals = []
        for sign in (1.0, -1.0):
            for p, s, v in zip(params, saved, vs):
                p.copy_(s + sign * h * v)
            with mode_factory():
                vals.append(loss_fn().item())
        fd = (vals[0] - vals[1]) / (2 * h)
        rows.append({"directional_grad": ad, "finite_difference": fd,
                     "rel_residual": abs(fd - ad) / max(abs(ad), grad_norm * 1e-8)})  # fmt: skip
    for p, s in zip(params, saved):
        p.copy_(s)
    return {
        "method": "central finite differences along random unit directions, float64",
        "directions": directions, "step": h, "seed": seed,
        "fd_rel_residual": max(r["rel_residual"] for r in rows), "rows": rows,
    }  # fmt: skip
