"""The amp emulation follows real torch.autocast op by op (issue 11, item 2).

Every aten op family the recipes' models use runs forward and backward three ways: in float64 (the
truth), under real ``torch.autocast(device, bfloat16)``, and under ``PrecisionMode`` emulating amp
with that device's policy. Inputs come as fp32 tensors, or held in bf16 (the first floating input already
bf16, as the output of an autocast matmul would be). Checked per case: the output is held in bf16
by the emulation exactly when real autocast returns bf16, and the relative L2 error against the
truth of the output and of every input's gradient is within 1.5x of the real op's (errors below
4 * 2^-24 are fp32 noise and floored there). Gradients of bf16-held inputs are compared as the
device holds them (rounded to bf16, as local.py does). Shapes are tiny: CPU bf16 is slow.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from oracle.metrics import rel_l2
from oracle.precision.mode import PrecisionMode

B, T, D, H = 2, 8, 32, 4
FLOOR = 4 * 2.0**-24
WITHIN = 1.5


def _rotary(x, c, s):  # Qwen's rotate_half: slicing, neg, cat, mul
    return x * c + torch.cat((-x[..., D // 2 :], x[..., : D // 2]), -1) * s


def _hf_rms_norm(x, w):  # transformers' Qwen3RMSNorm: float32 inside, back to the input's dtype
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * y.to(x.dtype)


CASES = {
    "linear": (lambda x, w, b: F.linear(x, w, b), lambda: [torch.randn(B, T, D), torch.randn(D, D) / 6, torch.randn(D)]),
    "matmul": (lambda a, b: a @ b, lambda: [torch.randn(B, T, D), torch.randn(D, T)]),
    "bmm": (torch.bmm, lambda: [torch.randn(B, T, D), torch.randn(B, D, T)]),
    "conv3d": (lambda x, w: F.conv3d(x, w, stride=2), lambda: [torch.randn(1, 3, 2, 8, 8), torch.randn(4, 3, 2, 2, 2)]),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (D,), w, b), lambda: [torch.randn(B, T, D), 1 + torch.randn(D) / 10, torch.randn(D) / 10]),
    "rms_norm": (lambda x, w: F.rms_norm(x, (D,), w), lambda: [torch.randn(B, T, D), 1 + torch.randn(D) / 10]),
    "rms_norm_hf": (_hf_rms_norm, lambda: [torch.randn(B, T, D), 1 + torch.randn(D) / 10]),
    "softmax": (lambda x: torch.softmax(x, -1), lambda: [3 * torch.randn(B, T, D)]),
    "softmax_fp32": (lambda x: torch.softmax(x, -1, dtype=torch.float32).to(x.dtype), lambda: [3 * torch.randn(B, T, D)]),
    "log_softmax": (lambda x: torch.log_softmax(x, -1), lambda: [3 * torch.randn(B, T, D)]),
    "gelu": (lambda x: F.gelu(x, approximate="tanh"), lambda: [torch.randn(B, T, D)]),
    "silu_mul": (lambda a, b: F.silu(a) * b, lambda: [torch.randn(B, T, D), torch.randn(B, T, D)]),
    "rotary": (_rotary, lambda: [torch.randn(B, T, D), torch.randn(T, D), torch.randn(T, D)]),
    "embedding": (lambda i, w: F.embedding(i, w), lambda: [torch.randint(0, 16, (B, T)), torch.randn(16, D)]),
    "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), lambda: [torch.randn(B, H, T, 8) for _ in range(3)]),
    "cross_entropy": (lambda x, y: F.cross_entropy(x.reshape(-1, D), y.reshape(-1)), lambda: [2 * torch.randn(B, T, D), torch.randint(0, D, (B, T))]),
}  # fmt: skip


def _floats(ts):
    return [t for t in ts if isinstance(t, torch.Tensor) and t.is_floating_point()]


def differential(name: str, held_low: bool, device: str) -> dict:
    """Errors of real autocast and of the emulation against float64, for the output and each grad."""
    f, make = CASES[name]
    torch.manual_seed(sorted(CASES).index(name))
    ins = make()
    first = next(i for i, t in enumerate(ins) if t.is_floating_point())
    low = [held_low and i == first for i in range(len(ins))]
    if held_low:  # the first floating input arrives in bf16; the truth starts from the same values
        ins[first] = ins[first].to(torch.bfloat16).float()

    def leaf(t, dtype=None, dev="cpu"):
        if not t.is_floating_point():
            return t.to(dev)
        return t.to(dev, dtype or t.dtype).detach().requires_grad_(True)

    truth = [leaf(t, torch.float64) for t in ins]
    out64 = f(*truth)
    gout = torch.randn_like(out64)
    out64.backward(gout)

    real = [leaf(t, torch.bfloat16 if lo else None, device) for t, lo in zip(ins, low)]
    with torch.autocast(device, dtype=torch.bfloat16):
        out_real = f(*real)
    out_real.backward(gout.to(device, out_real.dtype))

    mode = PrecisionMode(torch.float32, torch.bfloat16, "amp", device_type=device)
    emu = [leaf(t) for t in ins]
    with mode:
        for t, lo in zip(emu, low):
            if lo:
                mode.mark_low(t)
        out_emu = f(*emu)
        emu_low = mode._is_low(out_emu)
        g = gout.float()
        out_emu.backward(mode.mark_low(g.bfloat16().float()) if emu_low else g)

    def err(x, ref):
        return max(rel_l2(x.detach().cpu(), ref.detach()), FLOOR)

    def held(t, lo):  # a gradient as the device holds it
        return t.grad.bfloat16().float() if lo else t.grad

    rows = [("out", err(out_real, out64), err(out_emu, out64))]
    for k, (r, e, t, lo) in enumerate(zip(real, emu, truth, low)):
        if t.is_floating_point():
            rows.append((f"grad{k}", err(r.grad, t.grad), err(held(e, lo), t.grad)))
    return {"real_dtype": out_real.dtype, "emu_low": emu_low, "rows": rows}


def _check(name, held_low, device):
    res = differential(name, held_low, device)
    assert res["emu_low"] == (res["real_dtype"] == torch.bfloat16), res
    bad = [(k, r, e) for k, r, e in res["rows"] if not (1 / WITHIN <= e / r <= WITHIN)]
    assert bad == [], f"{name} held_low={held_low}: (what, real error, emulated error) beyond {WITHIN}x: {bad}"


@pytest.mark.parametrize("held_low", [False, True], ids=["fp32-inputs", "bf16-inputs"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_emulation_matches_real_cpu_autocast(name, held_low):
    _check(name, held_low, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("held_low", [False, True], ids=["fp32-inputs", "bf16-inputs"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_emulation_matches_real_cuda_autocast(name, held_low):
    _check(name, held_low, "cuda")
