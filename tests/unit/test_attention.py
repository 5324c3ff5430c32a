"""Chunked float64 attention (oracle/replay/attention.py) against eager attention, finite differences,
and transformers' own Qwen3-VL run with sdpa."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oracle.precision.mode import PrecisionMode
from oracle.replay import attention, attention_flash
from oracle.replay.attention import AttentionLayoutError, chunked_attention, packed

F64 = torch.float64


def eager(q, k, v, causal, cu=None, scale=None):
    """Plain float64 softmax attention with the full T x T mask: the reference."""
    B, H, T, D = q.shape
    g = H // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # (B, H, S, D)
    s = q @ k.transpose(-1, -2) * (D**-0.5 if scale is None else scale)  # (B, H, T, S)
    allowed = torch.zeros(T, k.shape[2], dtype=torch.bool)
    if cu is None:
        allowed[:] = True
    else:
        for a, b in zip(cu, cu[1:]):
            allowed[a:b, a:b] = True
    if causal:
        allowed &= torch.ones_like(allowed).tril()
    return torch.softmax(s.masked_fill(~allowed, -math.inf), -1) @ v


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def qkv(B, H, Hkv, T, D, S=None, dtype=F64):
    S = T if S is None else S
    mk = lambda *s: torch.randn(*s, dtype=dtype, requires_grad=True)  # noqa: E731
    return mk(B, H, T, D), mk(B, Hkv, S, D), mk(B, Hkv, S, D)


@pytest.fixture(params=["flash", "loop"])
def kernel(request, monkeypatch):
    """Both kernels: torch's flash kernel (attention_flash.py, where nothing rounds) and the Python loop (a rounding
    mode's path, and a torch whose kernel cannot group heads)."""
    if request.param == "loop":
        monkeypatch.setattr(attention_flash, "usable", lambda q, k: False)
    return request.param


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("cu", [None, [0, 7, 20, 37]], ids=["single", "packed3"])
@pytest.mark.parametrize("chunk", [(8, 8), (5, 11), (64, 64)], ids=["divides-not", "uneven", "one-block"])
def test_matches_eager_forward_and_backward(causal, heads, cu, chunk, kernel):
    """Outputs and q/k/v gradients equal eager float64 attention to 1e-13 relative."""
    q, k, v = qkv(2, heads[0], heads[1], 37, 8)
    out = chunked_attention(q, k, v, causal=causal, cu_seqlens=cu, chunk_q=chunk[0], chunk_k=chunk[1])
    ref = eager(q, k, v, causal, cu)
    go = torch.randn_like(ref)
    got_g = torch.autograd.grad(out, (q, k, v), go)
    ref_g = torch.autograd.grad(ref, (q, k, v), go)
    assert out.dtype == F64 and out.shape == ref.shape
    assert rel(out, ref) <= 1e-13
    for name, a, b in zip("qkv", got_g, ref_g):
        assert rel(a, b) <= 1e-13, name


def test_chunk_divides_sequence():
    """Chunks that divide T exactly (and T a multiple of every sample length) agree too."""
    q, k, v = qkv(1, 4, 2, 32, 8)
    out = chunked_attention(q, k, v, causal=True, cu_seqlens=[0, 16, 32], chunk_q=8, chunk_k=8)
    assert rel(out, eager(q, k, v, True, [0, 16, 32])) <= 1e-13


@pytest.mark.parametrize("keys", [None, 5], ids=["prefix-whole", "prefix-by-5-keys"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa2"])
def test_the_flash_kernel_at_a_row_offset_agrees_with_the_loop_and_ignores_the_thread_count(heads, keys, monkeypatch):
    """The streamed and token-parallel call (queries a..b against the whole K, V, a key's gradient added into dK, dV):
    torch's flash kernel within 1e-13 of the Python loop, a long prefix's backward given KEYS keys at a time too; its
    results bitwise the same at 1 and 2 threads."""
    from oracle.replay.attention import _backward, _forward

    if keys is not None:
        monkeypatch.setattr(attention_flash, "KEYS", keys)
    torch.manual_seed(3)
    cu, a, b, scale = [0, 11, 37], 8, 30, 0.3  # rows 8..30 cross the sample boundary at 11, chunk 4 cuts them unevenly
    q, k, v = (t.detach() for t in qkv(1, heads[0], heads[1], 37, 8))
    qa, do = q[:, :, a:b].contiguous(), torch.randn(1, heads[0], b - a, 8, dtype=F64)

    def run():
        out, lse = _forward(qa, k, v, cu, True, scale, 4, 4, q0=a)
        dk, dv = torch.ones_like(k), torch.ones_like(v)  # accumulators: the call adds into them
        dq, dk, dv = _backward(do, qa, k, v, out, lse, cu, True, scale, 4, 4, q0=a, dk=dk, dv=dv)
        return out, lse.ndim, dq, dk, dv

    flash = run()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(attention_flash, "usable", lambda q, k: False)
    loop = run()
    # the flash kernel's lse (B, H, T), the loop's (B, Hkv, T, g): each path ran (grouped heads on torch < 2.13: the loop)
    assert flash[1] == (3 if heads[0] == heads[1] or attention_flash._takes_gqa() else 4) and loop[1] == 4
    for name, x, y, z in zip(["out", "dq", "dk", "dv"], flash[:1] + flash[2:], loop[:1] + loop[2:], one[:1] + one[2:]):
        assert rel(x, y) <= 1e-13, name
        assert torch.equal(x, z), name
    assert torch.equal(flash[3][:, :, b:], torch.ones_like(k[:, :, b:]))  # keys after the rows: untouched


def test_inputs_are_not_modified():
    """q, k, v are read only (one key/value head per query head: the grouped layout is then q itself)."""
    q, k, v = qkv(1, 2, 2, 9, 4)
    before = [t.detach().clone() for t in (q, k, v)]
    chunked_attention(q, k, v, causal=True, chunk_q=4, chunk_k=4).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))


def test_cross_attention_lengths(kernel):
    """Non-causal attention with more keys than queries (S != T)."""
    q, k, v = qkv(1, 2, 2, 9, 4, S=23)
    out = chunked_attention(q, k, v, causal=False, chunk_q=4, chunk_k=5)
    assert rel(out, eager(q, k, v, False)) <= 1e-13


def test_gradcheck(kernel):
    """The custom backward agrees with float64 finite differences (causal, GQA, packed, uneven chunks)."""
    q, k, v = qkv(1, 4, 2, 9, 3)
    fn = lambda q, k, v: chunked_attention(q, k, v, causal=True, cu_seqlens=[0, 4, 9], chunk_q=3, chunk_k=2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))
    fn2 = lambda q, k, v: chunked_attention(q, k, v, causal=False, chunk_q=4, chunk_k=4)  # noqa: E731
    assert torch.autograd.gradcheck(fn2, (q, k, v))


def test_float32_stays_float32_and_float64_never_casts():
    """The kernel computes in its input dtype: no op of a float64 call produces float32 (and vice versa)."""

    class Dtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    self.seen.add(t.dtype)
            return out

    for dtype in (F64, torch.float32):
        q, k, v = qkv(1, 4, 2, 13, 8, dtype=dtype)
        with Dtypes() as d:
            out = chunked_attention(q, k, v, causal=True, chunk_q=4, chunk_k=4)
            out.sum().backward()
        assert d.seen == {dtype}
    qd, kd, vd = (t.detach().double() for t in (q, k, v))
    assert rel(out.double(), eager(qd, kd, vd, True)) < 1e-6  # float32 ulp scale


@pytest.mark.parametrize("kernel", ["flash", "loop"])
def test_skips_masked_blocks(kernel, monkeypatch):
    """Cost follows the real work: a causal, packed call computes only blocks on or below the diagonal of each sample,
    through torch's flash kernel (a chunk's prefix and diagonal) and through the Python loop (a rounding mode's path)."""
    if kernel == "loop":
        monkeypatch.setattr(attention_flash, "usable", lambda q, k: False)
    calls = []
    gemms = (torch.ops.aten.bmm.default, torch.ops.aten.mm.default, torch.ops.aten.bmm.out, torch.ops.aten.mm.out)

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in gemms or func is attention_flash._FWD:  # is_causal: trimmed from args where it is its default
                causal = func is attention_flash._FWD and bool(args[4] if len(args) > 4 else (kwargs or {}).get("is_causal"))
                calls.append((func, args[0].shape[-2], args[1].shape[-2], causal))
            return func(*args, **(kwargs or {}))

    q, k, v = qkv(1, 2, 2, 16, 4)
    with torch.no_grad(), Count():
        chunked_attention(q, k, v, causal=True, cu_seqlens=[0, 8, 16], chunk_q=4, chunk_k=4)
    if kernel == "loop":  # two samples of 2 query chunks: 1 + 2 key chunks each -> 6 blocks, 2 matmuls (S, PV) each
        assert len(calls) == 6 * 2
    else:  # per sample: chunk 1 its diagonal (causal); chunk 2 its prefix of 4 keys (all seen) and its diagonal
        assert [c[1:] for c in calls] == [(4, 4, True), (4, 4, False), (4, 4, True)] * 2


def test_bad_layouts_are_errors():
    q, k, v = qkv(1, 3, 2, 8, 4)
    with pytest.raises(AttentionLayoutError, match="3 query heads are not a multiple of 2"):
        chunked_attention(q, k, v, causal=True)
    q, k, v = qkv(1, 2, 2, 8, 4)
    with pytest.raises(AttentionLayoutError, match=r"must start at 0, never decrease and end at the sequence length 8"):
        chunked_attention(q, k, v, causal=True, cu_seqlens=[0, 5, 7])


# -- through transformers: the tiny Qwen3-VL ------------------------------------------------


@pytest.fixture(scope="module")
def vl(source):
    from oracle.capture.steps import build_model

    def make(impl: str, chunk: int | None = None):
        mode = PrecisionMode(F64)
        model = build_model(source.recipe, source.config, source.weights, F64, mode=mode)
        if impl == "eager":
            for m in model.modules():
                if getattr(m, "config", None) is not None:
                    m.config._attn_implementation = "eager"
        elif impl != "sdpa":
            attention.register(impl)
            attention.use(model, impl)
        if chunk is not None:
            for m in model.modules():
                if hasattr(m, "is_causal") and hasattr(m, "scaling"):
                    m.oracle_attention_chunk = chunk
        return model, mode

    return make


def _step(source, model, mode):
    r = source.recipe
    inputs = r.prepare_inputs(source, model, r.default_sample())
    inputs = {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()}
    with mode:
        loss, _ = r.forward_loss(model, inputs, "mean")
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, inputs


def test_qwen3_vl_matches_sdpa(source, vl):
    """The tiny Qwen3-VL step (image + text) in float64: loss and every gradient equal sdpa's to 1e-12;
    the ViT (non-causal, per image) and the decoder (causal) both route through the registered function;
    no T x T tensor exists anywhere in the step (chunk 40 < T = 144)."""
    from transformers import AttentionInterface

    calls = []

    def counting(module, query, *a, **kw):
        calls.append((type(module).__name__, query.shape[2], kw.get("is_causal", module.is_causal)))
        return attention.attention_forward(module, query, *a, **kw)

    AttentionInterface.register("oracle_counting", counting)
    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register("oracle_counting", attention.mask_forward)

    loss_ref, g_ref, inputs = _step(source, *vl("sdpa"))
    T = inputs["input_ids"].shape[1]
    model, mode = vl("oracle_chunked", chunk=40)
    for m in model.modules():
        if getattr(m, "config", None) is not None:
            m.config._attn_implementation = "oracle_counting"

    big = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.ndim >= 2 and tuple(t.shape[-2:]) == (T, T):
                    big.append((str(func), tuple(t.shape)))
            return out

    with Shapes():
        loss, grads, _ = _step(source, model, mode)
    assert big == []
    kinds = {(name, causal) for name, _, causal in calls}
    assert kinds == {("Qwen3VLVisionAttention", False), ("Qwen3VLTextAttention", True)}
    assert abs(loss - loss_ref).item() <= 1e-12 * abs(loss_ref).item()
    worst = max((rel(grads[n], g_ref[n]), n) for n in g_ref if g_ref[n].norm() > 0)
    assert worst[0] <= 1e-12, worst


def test_eager_step_does_build_t_by_t(source, vl):
    """Control for the test above: the same detector does see eager attention's T x T scores (sdpa on
    CPU is one fused op: its scores never reach the dispatcher)."""
    model, mode = vl("eager")
    r = source.recipe
    inputs = r.prepare_inputs(source, model, r.default_sample())
    T = inputs["input_ids"].shape[1]
    seen = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.ndim >= 2 and tuple(out.shape[-2:]) == (T, T):
                seen.append(func)
            return out

    with torch.no_grad(), mode, Shapes():
        r.forward_loss(model, {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()}, "mean")
    assert seen


def _text_inputs(model, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    H = model.config.text_config.hidden_size
    embeds = [torch.randn(1, n, H, generator=g, dtype=F64) for n in lengths]
    return embeds


def test_packed_text_equals_separate_samples(vl):
    """Three samples packed in one sequence (positions restarting per sample) give, token for token,
    the decoder outputs of each sample run alone: through packed(cu_seqlens) with 3-row mRoPE positions,
    and through 4-row position ids from whose text row transformers (and this function) detect the packing."""
    model, mode = vl("oracle_chunked", chunk=8)
    lm = model.model.language_model
    lengths = [11, 5, 20]
    embeds = _text_inputs(model, lengths)
    with torch.no_grad(), mode:
        alone = [lm(inputs_embeds=e, position_ids=torch.arange(e.shape[1]).view(1, 1, -1).expand(3, 1, -1)).last_hidden_state
                 for e in embeds]  # fmt: skip
        ref = torch.cat(alone, dim=1)  # (1, T, H)
        x = torch.cat(embeds, dim=1)
        pos = torch.cat([torch.arange(n) for n in lengths]).view(1, 1, -1)  # (1, 1, T)
        cu = [0, 11, 16, 36]
        with packed(cu):
            out3 = lm(inputs_embeds=x, position_ids=pos.expand(3, 1, -1)).last_hidden_state
        out4 = lm(inputs_embeds=x, position_ids=pos.expand(4, 1, -1)).last_hidden_state
        unpacked = lm(inputs_embeds=x, position_ids=pos.expand(3, 1, -1)).last_hidden_state
    assert rel(out3, ref) <= 1e-13
    assert rel(out4, ref) <= 1e-13
    assert rel(unpacked[:, 11:], ref[:, 11:]) > 1e-3  # without boundaries the later samples see the earlier ones


def test_packed_context_disagreeing_with_positions_is_an_error(vl):
    model, mode = vl("oracle_chunked")
    lm = model.model.language_model
    x = torch.cat(_text_inputs(model, [6, 6]), dim=1)
    pos = torch.cat([torch.arange(6), torch.arange(6)]).view(1, 1, -1).expand(4, 1, -1)
    with torch.no_grad(), mode, packed([0, 4, 12]), pytest.raises(AttentionLayoutError, match="disagree"):
        lm(inputs_embeds=x, position_ids=pos)


def test_padding_mask_is_an_error(vl):
    model, mode = vl("oracle_chunked")
    lm = model.model.language_model
    x = torch.cat(_text_inputs(model, [6]), dim=1)
    mask = torch.ones(1, 6, dtype=torch.long)
    mask[0, :2] = 0
    with torch.no_grad(), mode, pytest.raises(AttentionLayoutError, match="padded"):
        lm(inputs_embeds=x, attention_mask=mask)


def test_mask_function_refuses_patterns_it_cannot_compute():
    """The registered mask function builds nothing for causal / bidirectional / packed-causal patterns and
    refuses others (a sliding window) instead of silently computing full attention."""
    from transformers.masking_utils import and_masks, causal_mask_function, packed_sequence_mask_function, sliding_window_overlay

    kw = dict(batch_size=1, q_length=12, kv_length=12)
    assert attention.mask_forward(**kw, mask_function=causal_mask_function) is None
    sample = torch.tensor([[0] * 5 + [1] * 7])
    packed_causal = and_masks(causal_mask_function, packed_sequence_mask_function(sample))
    assert attention.mask_forward(**kw, mask_function=packed_causal) is None
    with pytest.raises(AttentionLayoutError, match="sliding window"):
        attention.mask_forward(**kw, mask_function=and_masks(causal_mask_function, sliding_window_overlay(3)))
    with pytest.raises(AttentionLayoutError, match="without a KV cache"):
        attention.mask_forward(batch_size=1, q_length=1, kv_length=12, q_offset=11, mask_function=causal_mask_function)


class _Draws(PrecisionMode):
    """A jittered float32 member that lists the shape of every tensor it rounds."""

    def __init__(self):
        super().__init__(torch.float32, torch.float32, jitter_seed=7, device_type="cpu")
        self.shapes = []

    def _round(self, x, fresh=False):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype == self.compute:
            self.shapes.append(tuple(x.shape))
        return super()._round(x, fresh=fresh)


def _member_step(attend, heads, kv_heads):
    """out and q, k, v gradients of ``attend`` run under a fresh jittered member; -> (tensors, its rounding shapes)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, 8, 16, requires_grad=True) for h in (heads, kv_heads, kv_heads))
    dout = torch.linspace(-1, 1, heads * 8 * 16).reshape(1, 8, heads, 16).transpose(1, 2)  # (B, H, T, D), as a model's
    mode = _Draws()
    with mode:
        out = attend(q, k, v, mode)
        out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad, mode._gen.get_state()], mode.shapes


def test_the_fused_gqa_kernel_rounds_where_the_fused_op_does():
    """replay/fused_gqa.py (torch < 2.13): with one query head per key head it is torch's fused sdpa op under the same
    jittered member, bitwise (values, gradients, the jitter stream after); with two it rounds k, v and dk, dv once at
    their own heads, in the op's order (was: each repeated copy rounded, the group sum once more)."""
    from oracle.replay.fused_gqa import FusedGQA

    def fused(q, k, v, mode):
        return FusedGQA.apply(q, k, v, mode, True, 0.25)

    def sdpa(q, k, v, mode):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)

    ours, ours_shapes = _member_step(fused, 4, 4)
    op, op_shapes = _member_step(sdpa, 4, 4)
    assert ours_shapes == op_shapes and all(torch.equal(a, b) for a, b in zip(ours, op))
    _, shapes = _member_step(fused, 4, 2)
    q, kv, lse = (1, 4, 8, 16), (1, 2, 8, 16), (1, 4, 8)
    assert shapes == [q, kv, kv, q, lse, q, q, kv, kv, q, lse, q, kv, kv]


def test_sdpa_forward_gives_transformers_grouped_query_attention_on_every_supported_torch():
    """``attention.sdpa_forward`` (what the recipes register as "sdpa" below torch 2.13) returns transformers' own
    sdpa result for a grouped-query call, with transformers 5 and 4.57 alike (their ``use_gqa_in_sdpa`` differ in
    arity); where nothing rounds it is transformers' function on the same values."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from oracle.replay.attention import sdpa_forward

    class Layer(torch.nn.Module):
        num_key_value_groups, is_causal = 2, True

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 8, generator=g)  # (B, H, T, D): 4 query heads over 2 k/v heads
    k, v = torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    got, _ = sdpa_forward(Layer(), q, k, v, None, scaling=8**-0.5)
    want, _ = sdpa_attention_forward(Layer(), q, k, v, None, scaling=8**-0.5)
    assert got.shape == (1, 6, 4, 8) and torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
