"""The CPU stand-in's NPU ops (tests/npu_standin/npu_ops, test support for the MindSpeed path):
each op's forward and its written-out backward against autograd of the plain formula, and each
planted fault changes the backward only. Pure torch: runs in every environment."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

_STANDIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "npu_standin")
sys.path.insert(0, _STANDIN)
try:
    import npu_ops
    from npu_ops import faults
finally:  # never leave the stand-in findable: transformers' is_torch_npu_available() would import torch_npu
    sys.path.remove(_STANDIN)

F64 = torch.float64


def _close(a, b, tol=1e-12):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert torch.allclose(a, b, rtol=tol, atol=tol), (a - b).abs().max()


def _grads(fn, *xs, seed=0):
    """Output and the gradients of <out, G> for a fixed random G."""
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    out = fn(*xs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    gs = torch.autograd.grad(out, xs, g, allow_unused=True)
    return out.detach(), gs


def _rand(*shape, seed=1, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


def test_importing_the_ops_leaves_torch_npu_unfindable():
    """The suite imports the ops without putting a ``torch_npu`` on sys.path (transformers'
    is_torch_npu_available() would import it and rename torch's PrivateUse1 device to npu)."""
    assert importlib.util.find_spec("torch_npu") is None


# --------------------------------------------------------------------------- rms norm, swiglu, rotary


def _rms_plain(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_rms_norm_forward_and_backward_are_the_formulas():
    """npu_rms_norm's y, rstd and its dx, dgamma equal autograd of x*rsqrt(mean(x^2)+eps)*w (fp64)."""
    x, w = _rand(3, 5, 16), _rand(16, seed=2)
    out, (dx, dw) = _grads(lambda a, b: npu_ops.npu_rms_norm(a, b, epsilon=1e-6)[0], x, w)
    ref, (rdx, rdw) = _grads(lambda a, b: _rms_plain(a, b, 1e-6), x, w)
    _close(out, ref), _close(dx, rdx), _close(dw, rdw)
    rstd = npu_ops.npu_rms_norm(x, w, epsilon=1e-6)[1]
    _close(rstd, torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.autograd.gradcheck(lambda a, b: npu_ops.npu_rms_norm(a, b)[0],
                                    (x[:1, :2].clone().requires_grad_(), w.clone().requires_grad_()))  # fmt: skip


def test_rms_norm_in_bf16_rounds_once_from_fp32():
    """bf16 inputs: computed in fp32, the output rounded once to bf16; rstd stays fp32."""
    x, w = _rand(4, 32, dtype=torch.bfloat16), _rand(32, seed=2, dtype=torch.bfloat16)
    y, rstd = npu_ops.npu_rms_norm(x, w, epsilon=1e-6)
    assert y.dtype == torch.bfloat16 and rstd.dtype == torch.float32
    assert torch.equal(y, _rms_plain(x.float(), w.float(), 1e-6).to(torch.bfloat16))


def test_swiglu_forward_and_backward_are_the_formulas():
    """npu_swiglu(x, dim) = silu(a)*b over x's halves along dim; its backward equals autograd's."""
    for dim in (-1, 0):
        x = _rand(6, 8)
        out, (dx,) = _grads(lambda t, dim=dim: npu_ops.npu_swiglu(t, dim=dim), x)
        ref, (rdx,) = _grads(lambda t, dim=dim: torch.nn.functional.silu(t.chunk(2, dim)[0]) * t.chunk(2, dim)[1], x)
        _close(out, ref), _close(dx, rdx)
    with pytest.raises(ValueError, match="odd size 7"):
        npu_ops.npu_swiglu(_rand(2, 7))


def _rot_plain(x, cos, sin, interleaved):
    if interleaved:
        r = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
    else:
        r = torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), -1)
    return x * cos + r * sin


@pytest.mark.parametrize("mode", [0, 1])
def test_rotary_forward_and_backward_are_the_formulas(mode):
    """npu_rotary_position_embedding(x, cos, sin, mode) and npu_rotary_mul: x*cos + R(x)*sin with
    R rotate-half (mode 0) or interleaved (1); dx, dcos, dsin equal autograd's (broadcast reduced)."""
    x, cos, sin = _rand(5, 2, 3, 8), _rand(5, 1, 1, 8, seed=2), _rand(5, 1, 1, 8, seed=3)
    out, gs = _grads(lambda a, c, s: npu_ops.npu_rotary_position_embedding(a, c, s, mode), x, cos, sin)
    ref, rgs = _grads(lambda a, c, s: _rot_plain(a, c, s, mode == 1), x, cos, sin)
    _close(out, ref)
    for g, r in zip(gs, rgs):
        _close(g, r)
    out2, gs2 = _grads(lambda a, c, s: npu_ops.npu_rotary_mul(a, c, s, ["half", "interleave"][mode]), x, cos, sin)
    assert torch.equal(out2, out) and all(torch.equal(a, b) for a, b in zip(gs, gs2))


def test_matmul_add_fp32_accumulates_the_weight_gradient_in_fp32():
    """npu_matmul_add_fp32(dy, x, main_grad): main_grad += dy^T x over the flattened tokens, in fp32."""
    dy, x = _rand(2, 3, 4, dtype=torch.bfloat16), _rand(2, 3, 5, seed=2, dtype=torch.bfloat16)
    grad = _rand(4, 5, seed=3, dtype=torch.float32)
    want = grad + dy.reshape(6, 4).float().t() @ x.reshape(6, 5).float()
    assert npu_ops.npu_matmul_add_fp32(dy, x, grad) is grad
    assert torch.equal(grad, want)
    with pytest.raises(TypeError, match="grad \\(main_grad\\) is torch.bfloat16"):
        npu_ops.npu_matmul_add_fp32(dy, x, grad.bfloat16())


# --------------------------------------------------------------------------- fusion attention

CU = [0, 5, 6, 9, 10, 16]  # leading 0 kept, two pad singletons (samples of 1 token), as MindSpeed passes them


def _attn_plain_tnd(q, k, v, cu, scale, causal_ok):
    """Per sample: softmax(scale q k^T + mask) v, heads of K/V repeated for GQA; (T, N, D)."""
    n = q.shape[1]
    outs = []
    for a, b in zip(cu[:-1], cu[1:]):
        if b == a:
            continue
        qs, ks, vs = q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)  # (N, s, D)
        ks, vs = ks.repeat_interleave(n // ks.shape[0], 0), vs.repeat_interleave(n // vs.shape[0], 0)
        s = scale * qs @ ks.transpose(-1, -2)
        i, j = torch.arange(b - a)[:, None], torch.arange(b - a)[None, :]
        s = s.masked_fill(~causal_ok(i, j), float("-inf"))
        outs.append((torch.softmax(s, -1) @ vs).transpose(0, 1))
    return torch.cat(outs, 0)


@pytest.mark.parametrize("sparse_mode,pre,nxt", [(0, 65536, 0), (2, 2147483647, 2147483647), (3, 0, 0), (0, 1, 0)])
def test_fusion_attention_tnd_packed_is_per_sample_attention(sparse_mode, pre, nxt):
    """TND with actual_seq_qlen = cu_seqlens (leading 0, pad singletons): each sample attends only
    within itself, causally (mode 0 with next_tockens=0 as MindSpeed passes it, modes 2 and 3), or a
    band (mode 0, pre_tockens=1); GQA (4 query heads, 2 K/V heads); forward and backward = autograd
    of the per-sample formula."""
    q, k, v = _rand(16, 4, 8), _rand(16, 2, 8, seed=2), _rand(16, 2, 8, seed=3)
    scale = 8**-0.5

    def op(a, b, c):
        return npu_ops.npu_fusion_attention(a, b, c, 4, "TND", scale=scale, pre_tockens=pre, next_tockens=nxt,
                                            sparse_mode=sparse_mode, actual_seq_qlen=CU, actual_seq_kvlen=CU)[0]  # fmt: skip

    band = (lambda i, j: (j <= i) & (j >= i - pre)) if sparse_mode == 0 else (lambda i, j: j <= i)
    out, gs = _grads(op, q, k, v)
    ref, rgs = _grads(lambda a, b, c: _attn_plain_tnd(a, b, c, CU, scale, band), q, k, v)
    _close(out, ref)
    for g, r in zip(gs, rgs):
        _close(g, r)


def test_fusion_attention_layouts_agree_and_match_the_formula():
    """SBH (MindSpeed's unpacked call), BSH, BSND and BNSD give the same attention, the plain causal
    formula's, with an explicit atten_mask (True = masked) in mode 0 and mode 1; stats are (.., 8)."""
    b, s, n, d = 2, 6, 4, 8
    q, k, v = _rand(b, s, n, d), _rand(b, s, n, d, seed=2), _rand(b, s, n, d, seed=3)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    ref = torch.softmax((q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)).masked_fill(mask, float("-inf")),
                        -1) @ v.transpose(1, 2)  # (B, N, S, D)  # fmt: skip
    ref = ref.transpose(1, 2)  # (B, S, N, D)
    bsnd = npu_ops.npu_fusion_attention(q, k, v, n, "BSND", atten_mask=mask, sparse_mode=1)
    _close(bsnd[0], ref)
    assert bsnd[1].shape == (b, n, s, 8) and bsnd[1].dtype == torch.float32
    bnsd = npu_ops.npu_fusion_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), n, "BNSD",
                                        atten_mask=mask, sparse_mode=0)[0]  # fmt: skip
    _close(bnsd.transpose(1, 2), ref)
    bsh = npu_ops.npu_fusion_attention(*(t.reshape(b, s, n * d) for t in (q, k, v)), n, "BSH", atten_mask=mask)[0]
    _close(bsh, ref.reshape(b, s, n * d))
    sbh = npu_ops.npu_fusion_attention(*(t.transpose(0, 1).reshape(s, b, n * d) for t in (q, k, v)), n, "SBH",
                                       pre_tockens=65536, next_tockens=0)[0]  # fmt: skip
    _close(sbh, ref.transpose(0, 1).reshape(s, b, n * d))


def test_fusion_attention_gradcheck_and_refusals():
    """torch.autograd.gradcheck on the TND op (fp64); wrong cumulative lengths and unimplemented
    options are refused with the name of the argument."""
    q, k, v = (_rand(6, 2, 4, seed=i).requires_grad_() for i in (1, 2, 3))
    cu = [0, 2, 3, 6]
    assert torch.autograd.gradcheck(lambda a, b, c: npu_ops.npu_fusion_attention(
        a, b, c, 2, "TND", scale=0.5, next_tockens=0, actual_seq_qlen=cu, actual_seq_kvlen=cu)[0], (q, k, v))  # fmt: skip
    with pytest.raises(ValueError, match="actual_seq_qlen \\[2, 5\\] must be .* ending at the token count 6"):
        npu_ops.npu_fusion_attention(q, k, v, 2, "TND", actual_seq_qlen=[2, 5], actual_seq_kvlen=[2, 5])
    with pytest.raises(NotImplementedError, match="keep_prob=0.9"):
        npu_ops.npu_fusion_attention(q, k, v, 2, "TND", keep_prob=0.9, actual_seq_qlen=cu, actual_seq_kvlen=cu)
    with pytest.raises(NotImplementedError, match="sparse_mode 7"):
        npu_ops.npu_fusion_attention(q, k, v, 2, "TND", sparse_mode=7, actual_seq_qlen=cu, actual_seq_kvlen=cu)


def test_bf16_attention_rounds_the_output_once():
    """bf16 q/k/v: computed in fp32, the output rounded once to bf16 (the fp32 result's rounding)."""
    q, k, v = (_rand(8, 2, 4, seed=i, dtype=torch.bfloat16) for i in (1, 2, 3))
    cu = [0, 3, 8]
    o = npu_ops.npu_fusion_attention(q, k, v, 2, "TND", next_tockens=0, actual_seq_qlen=cu, actual_seq_kvlen=cu)[0]
    o32 = npu_ops.npu_fusion_attention(q.float(), k.float(), v.float(), 2, "TND", next_tockens=0,
                                       actual_seq_qlen=cu, actual_seq_kvlen=cu)[0]  # fmt: skip
    assert o.dtype == torch.bfloat16 and torch.equal(o, o32.to(torch.bfloat16))


# --------------------------------------------------------------------------- planted faults


def _attn_tnd(a, b, c):
    return npu_ops.npu_fusion_attention(a, b, c, 4, "TND", scale=0.3, pre_tockens=65536, next_tockens=0,
                                        actual_seq_qlen=CU, actual_seq_kvlen=CU)[0]  # fmt: skip


def _attn_sbh(a, b, c):  # MindSpeed's unpacked call: SBH, causal (sparse_mode 2)
    return npu_ops.npu_fusion_attention(a, b, c, 4, "SBH", scale=0.3, sparse_mode=2)[0]


FAULT_CASES = {
    "attention_cross_boundary": (_attn_tnd, lambda: (_rand(16, 4, 8), _rand(16, 2, 8, seed=2), _rand(16, 2, 8, seed=3))),
    "attention_kv_offset": (_attn_tnd, lambda: (_rand(16, 4, 8), _rand(16, 2, 8, seed=2), _rand(16, 2, 8, seed=3))),
    "attention_causal_leak": (_attn_sbh, lambda: (_rand(6, 1, 32), _rand(6, 1, 16, seed=2), _rand(6, 1, 16, seed=3))),
    "rotary_sin_sign": (lambda a, c, s: npu_ops.npu_rotary_position_embedding(a, c, s, 0),
                        lambda: (_rand(5, 2, 8), _rand(5, 1, 8, seed=2), _rand(5, 1, 8, seed=3))),
}  # fmt: skip


@pytest.mark.parametrize("name", list(FAULT_CASES))
def test_a_planted_fault_changes_the_backward_only(name):
    """With the fault planted, the forward is bitwise the honest one and the input gradient differs."""
    fn, inputs = FAULT_CASES[name]
    out, gs = _grads(fn, *inputs())
    with faults.planted(name):
        fout, fgs = _grads(fn, *inputs())
    assert torch.equal(out, fout)
    assert not torch.equal(gs[0], fgs[0])
    if name == "rotary_sin_sign":  # dcos, dsin are the forward's own: unchanged
        assert torch.equal(gs[1], fgs[1]) and torch.equal(gs[2], fgs[2])


def test_attention_fault_moves_only_the_first_query_of_each_later_sample_and_its_key():
    """The boundary fault reaches dQ only at each later sample's first token (5, 6, 9, 10 here) and
    dK/dV only at the keys that token's softmax row holds: the earlier sample's last token (4, 5, 8,
    9) and its own (causal: itself); every other token's gradients are the honest ones."""
    fn, inputs = FAULT_CASES["attention_cross_boundary"]
    _, gs = _grads(fn, *inputs())
    with faults.planted("attention_cross_boundary"):
        _, fgs = _grads(fn, *inputs())
    rows = lambda a, b: sorted(set((a != b).any(-1).any(-1).nonzero().flatten().tolist()))  # noqa: E731
    assert rows(gs[0], fgs[0]) == [5, 6, 9, 10]
    assert rows(gs[1], fgs[1]) == [4, 5, 6, 8, 9, 10] and rows(gs[2], fgs[2]) == [4, 5, 6, 8, 9, 10]


def test_kv_offset_fault_moves_every_query_of_each_later_sample_and_the_earlier_samples_keys():
    """The key window started one boundary early reaches dQ at every token of each later sample (5-15
    here, not the first sample's 0-4) and dK/dV at the first sample's keys (0-4), which honestly only
    its own queries see."""
    fn, inputs = FAULT_CASES["attention_kv_offset"]
    _, gs = _grads(fn, *inputs())
    with faults.planted("attention_kv_offset"):
        _, fgs = _grads(fn, *inputs())
    rows = lambda a, b: sorted(set((a != b).any(-1).any(-1).nonzero().flatten().tolist()))  # noqa: E731
    assert rows(gs[0], fgs[0]) == list(range(5, 16))
    assert set(range(0, 5)) <= set(rows(gs[1], fgs[1])) and set(range(0, 5)) <= set(rows(gs[2], fgs[2]))


def test_matmul_add_bf16_fault_rounds_the_accumulation():
    """matmul_add_bf16: main_grad becomes fp32(bf16(main_grad) + bf16(dy^T x)), not the fp32 sum."""
    dy, x, g0 = _rand(7, 4, dtype=torch.float32), _rand(7, 5, seed=2, dtype=torch.float32), _rand(4, 5, seed=3,
                                                                                               dtype=torch.float32)  # fmt: skip
    honest = npu_ops.npu_matmul_add_fp32(dy, x, g0.clone())
    with faults.planted("matmul_add_bf16"):
        bad = npu_ops.npu_matmul_add_fp32(dy, x, g0.clone())
    assert torch.equal(bad, (g0.bfloat16() + (dy.t() @ x).bfloat16()).float())
    assert not torch.equal(bad, honest)


def test_a_fault_at_call_k_hits_only_that_backward_call_and_is_read_from_the_environment(monkeypatch):
    """TORCH_NPU_STANDIN_FAULTS=name@K (as spawned ranks get it): only the K-th backward call is wrong;
    an unknown name is refused with the list of faults."""
    fn, inputs = FAULT_CASES["rotary_sin_sign"]
    _, honest = _grads(fn, *inputs())
    faults.reset_counts()
    monkeypatch.setenv(faults.ENV, "rotary_sin_sign@1")
    wrong = [not torch.equal(_grads(fn, *inputs())[1][0], honest[0]) for _ in range(3)]
    assert wrong == [False, True, False]
    monkeypatch.setenv(faults.ENV, "attention_sideways")
    with pytest.raises(ValueError, match="unknown fault 'attention_sideways'; the stand-in plants attention_cross_boundary"):
        faults.validate()


def test_the_causal_leak_lets_each_query_see_the_next_key_in_the_backward_only():
    """attention_causal_leak (unpacked layouts): the forward is bitwise the honest one; the backward drops the
    causal mask, so dQ changes at every query that has a key after it (0..S-2), not at the last; only
    non-TND calls are counted."""
    a, b, c = (_rand(6, 1, 32), _rand(6, 1, 16, seed=2), _rand(6, 1, 16, seed=3))
    out, gs = _grads(_attn_sbh, a, b, c)
    faults.reset_counts()
    with faults.planted("attention_causal_leak"):
        fout, fgs = _grads(_attn_sbh, a, b, c)
        _grads(*FAULT_CASES["attention_cross_boundary"][:1], *FAULT_CASES["attention_cross_boundary"][1]())  # TND
    assert torch.equal(out, fout)
    rows = sorted(set((gs[0] != fgs[0]).any(-1).any(-1).nonzero().flatten().tolist()))  # SBH: dim 0 is the token
    assert rows == [0, 1, 2, 3, 4]
    assert faults.calls["attention_causal_leak"] == 1
