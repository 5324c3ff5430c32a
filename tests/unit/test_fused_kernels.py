"""The fused float64 kernels (oracle/replay/fused.py) against the transformers code they replace, op by op."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.models.qwen3 import modeling_qwen3 as q3

from oracle.precision.mode import PrecisionMode
from oracle.replay import fused

ROTARY = "transformers.models.qwen3.modeling_qwen3.apply_rotary_pos_emb"


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """Fusion is opt-in (ORACLE_FUSED=1): on for this module's tests, off again after them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(fused.ENV, "1")
        state = fused.use(torch.nn.Module(), {ROTARY: "rotary"})
        assert state["path"] == "fused-inductor", state
        yield


def _grads(fn, *xs, seed=0):
    """Output and input gradients of ``fn`` under the oracle's mode, from a seeded upstream gradient."""
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    with PrecisionMode(torch.float64):
        y = fn(*xs)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        gs = torch.autograd.grad(y, xs, g)
    return [y.detach(), *gs]


def _close(a, b, bound=1e-13):
    for x, y in zip(a, b):
        assert float((x - y).abs().max() / y.abs().max()) <= bound


def test_fused_rmsnorm_matches_transformers_within_1e_13():
    """Qwen3RMSNorm (hidden and head width): output, input and weight gradients within 1e-13 relative."""
    torch.manual_seed(0)
    for shape in ((2, 5, 64), (2, 5, 3, 16)):
        x, w = torch.randn(shape, dtype=torch.float64) * 3, torch.randn(shape[-1], dtype=torch.float64)

        def run(x, w, fwd):
            m = q3.Qwen3RMSNorm(w.shape[0], eps=1e-6)
            del m.weight
            m.weight = w  # the test's leaf, so that its gradient is returned
            if fwd is not None:
                m.forward = types.MethodType(fwd, m)
            return m(x)

        ref = _grads(lambda x, w: run(x, w, None), x, w)
        got = _grads(lambda x, w: run(x, w, fused._rms_norm_forward), x, w)
        _close(got, ref)


def test_fused_swiglu_matches_silu_times_up_within_1e_13():
    """act_fn(gate) * up: output and both input gradients within 1e-13 relative."""
    a, b = torch.randn(7, 48, dtype=torch.float64) * 4, torch.randn(7, 48, dtype=torch.float64)
    ref = _grads(lambda a, b: torch.nn.functional.silu(a) * b, a, b)
    got = _grads(lambda a, b: fused._SwiGLU.apply(a, b), a, b)
    _close(got, ref)


def test_fused_rotary_matches_transformers_and_only_inside_the_oracle():
    """apply_rotary_pos_emb: the same values and gradients in the oracle; the original outside it and for float32."""
    q, k = torch.randn(2, 4, 6, 16, dtype=torch.float64), torch.randn(2, 2, 6, 16, dtype=torch.float64)
    cos, sin = torch.randn(2, 6, 16, dtype=torch.float64), torch.randn(2, 6, 16, dtype=torch.float64)
    wrapped = q3.apply_rotary_pos_emb
    original = wrapped.oracle_original
    ref = _grads(lambda q: original(q, k, cos, sin)[0], q)
    got = _grads(lambda q: wrapped(q, k, cos, sin)[0], q)
    _close(got, ref)
    q.requires_grad_(True)
    with PrecisionMode(torch.float64):
        assert "Rotary" in type(wrapped(q, k, cos, sin)[0].grad_fn).__name__
    assert "Rotary" not in type(wrapped(q, k, cos, sin)[0].grad_fn).__name__  # no oracle mode: the original
    with PrecisionMode(torch.float32, torch.bfloat16):  # an emulated member: every op, rounded
        out = wrapped(q.float().requires_grad_(), k.float(), cos.float(), sin.float())[0]
        assert "Rotary" not in type(out.grad_fn).__name__


def test_fused_kernels_keep_nan_and_inf():
    """A NaN or Inf in the truth stays visible (inductor compiles without -ffinite-math-only): counted, never hidden."""
    x = torch.randn(3, 8, dtype=torch.float64)
    x[0, 1], x[1, 2] = float("nan"), float("inf")
    y, _ = fused._call("rms_forward", x, torch.ones(8, dtype=torch.float64), 1e-6)
    assert torch.isnan(y[0]).all() and torch.isnan(y[1]).any() and torch.isfinite(y[2]).all()
    h = fused._call("swiglu_forward", x, torch.ones_like(x))
    assert torch.isnan(h[0, 1]) and torch.isinf(h[1, 2])
