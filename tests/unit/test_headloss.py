"""LM head + cross-entropy by vocabulary chunks (oracle/replay/headloss.py) against the full-logits loss."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oracle.capture.packing import IGNORE
from oracle.precision.mode import PrecisionMode
from oracle.replay.headloss import HeadLossInputError, causal_lm_head_loss, head_loss, masked_token_head_loss
from oracle.replay.loss import causal_lm_loss, masked_token_loss

F64 = torch.float64


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def case(B=2, T=23, H=8, V=50, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(V, H, generator=g, dtype=dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :6] = IGNORE  # a prompt
    labels[1, 10:13] = IGNORE
    return h, w, labels


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("chunk,row_chunk", [(10, 11), (7, 4), (64, 1000)], ids=["divides-V", "uneven", "one-chunk"])
def test_causal_matches_full_logits(reduction, chunk, row_chunk):
    """Loss and hidden/weight gradients equal causal_lm_loss on the full logits to 1e-13 relative, ignored tokens included."""
    h, w, labels = case()
    loss, n = causal_lm_head_loss(h, w, labels, reduction, chunk=chunk, row_chunk=row_chunk)
    ref, n_ref = causal_lm_loss(h @ w.T, labels, reduction)
    got_g = torch.autograd.grad(loss, (h, w))
    ref_g = torch.autograd.grad(ref, (h, w))
    assert n == n_ref == int((labels[:, 1:] != IGNORE).sum())
    assert loss.dtype == F64 and abs(loss - ref).item() <= 1e-13 * abs(ref).item()
    for name, a, b in zip(("hidden", "weight"), got_g, ref_g):
        assert rel(a, b) <= 1e-13, name
    assert got_g[0][0, :5].abs().max() == 0  # rows whose next token is ignored get no gradient


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_masked_matches_full_logits(reduction):
    """Megatron's convention (aligned labels, float loss mask) through masked_token_head_loss equals masked_token_loss."""
    h, w, labels = case(seed=1)
    mask = (torch.rand(labels.shape, generator=torch.Generator().manual_seed(2)) > 0.3).to(F64)
    loss, n = masked_token_head_loss(h, w, labels, mask, reduction, chunk=9, row_chunk=8)
    ref, n_ref = masked_token_loss(h @ w.T, labels, mask, reduction)
    assert n == n_ref
    assert abs(loss - ref).item() <= 1e-13 * abs(ref).item()
    for a, b in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref, (h, w))):
        assert rel(a, b) <= 1e-13


def test_gradcheck():
    """The custom backward agrees with float64 finite differences (several chunks, ignored rows)."""
    h = torch.randn(6, 3, dtype=F64, requires_grad=True)
    w = torch.randn(11, 3, dtype=F64, requires_grad=True)
    labels = torch.tensor([3, IGNORE, 10, 0, 7, IGNORE])
    assert torch.autograd.gradcheck(lambda h, w: head_loss(h, w, labels, chunk=4, row_chunk=2), (h, w))
    assert torch.autograd.gradcheck(lambda h, w: head_loss(h, w, labels, reduction="sum", chunk=5, row_chunk=3), (h, w))


def test_no_full_logits_tensor():
    """No tensor anywhere near N x V elements is produced, forward or backward: every op's output
    is at most one (row_chunk x chunk) block; the result still equals the full-logits loss."""
    N, H, V, chunk, row_chunk = 512, 16, 8192, 512, 128
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g, dtype=F64, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=F64, requires_grad=True)
    labels = torch.randint(0, V, (N,), generator=g)

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    with Largest():
        loss = head_loss(h, w, labels, chunk=chunk, row_chunk=row_chunk)
        gh, gw = torch.autograd.grad(loss, (h, w))
    assert Largest.numel == max(row_chunk * chunk, V * H)  # a logit block, or the weight's gradient itself
    assert Largest.numel * 30 < N * V
    import torch.nn.functional as F

    ref = F.cross_entropy(h @ w.T, labels)
    assert abs(loss - ref).item() <= 1e-13 * ref.item()
    rg = torch.autograd.grad(ref, (h, w))
    assert rel(gh, rg[0]) <= 1e-13 and rel(gw, rg[1]) <= 1e-13


def test_low_precision_logits_upcast_like_the_loss_convention():
    """bf16 hidden/weight: logits per chunk in bf16, log-sum-exp in float32 (as causal_lm_loss upcasts)."""
    h, w, labels = case(dtype=torch.bfloat16)
    loss, _ = causal_lm_head_loss(h, w, labels, "mean", chunk=16)
    ref, _ = causal_lm_loss(h @ w.T, labels, "mean")
    assert loss.dtype == torch.float32
    assert abs(loss - ref).item() <= 1e-5 * abs(ref).item()  # equal but for where bf16 GEMM blocks round
    gh, gw = torch.autograd.grad(loss, (h, w))
    assert gh.dtype == gw.dtype == torch.bfloat16


def test_bad_inputs_are_errors():
    h, w, labels = case()
    with pytest.raises(HeadLossInputError, match=r"labels hold 1 ids outside the vocabulary \[0, 50\)"):
        bad = labels[0].clone()
        bad[7] = 50
        head_loss(h[0], w, bad)
    with pytest.raises(HeadLossInputError, match="flatten the batch and sequence dimensions"):
        head_loss(h, w, labels)
    with pytest.raises(HeadLossInputError, match="reduction must be 'sum' or 'mean'"):
        head_loss(h[0], w, labels[0], reduction="none")


def test_qwen3_vl_head_matches_full_logits(source):
    """The tiny Qwen3-VL step (image + text, float64): the decoder's hidden states through causal_lm_head_loss
    with lm_head's weight give the recipe's loss and every parameter gradient to 1e-12."""
    from oracle.capture.steps import build_model

    r = source.recipe
    results = []
    for chunked in (False, True):
        mode = PrecisionMode(F64)
        model = build_model(r, source.config, source.weights, F64, mode=mode)
        assert model.lm_head.bias is None
        inputs = r.prepare_inputs(source, model, r.default_sample())
        inputs = {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()}
        with mode:
            if chunked:
                keys = ("input_ids", "pixel_values", "image_grid_thw", "position_ids")
                hidden = model.model(**{k: inputs[k] for k in keys}).last_hidden_state  # (1, T, H)
                loss, _ = causal_lm_head_loss(hidden, model.lm_head.weight, inputs["labels"], "mean", chunk=100)
            else:
                loss, _ = r.forward_loss(model, inputs, "mean")
            loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref, g_ref), (loss, grads) = results
    assert abs(loss - ref).item() <= 1e-12 * abs(ref).item()
    worst = max((rel(grads[n], g_ref[n]), n) for n in g_ref if g_ref[n].norm() > 0)
    assert worst[0] <= 1e-12, worst
