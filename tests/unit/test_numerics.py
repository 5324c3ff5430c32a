import math

import pytest
import torch

from oracle.precision import mode as m
from oracle.precision.mode import PrecisionMode


def test_float64_mode_promotes_casts_that_model_code_makes():
    """An RMSNorm written as hidden.to(float32) stays float64 inside the mode (and is counted)."""
    x = torch.randn(4, 8, dtype=torch.float64) * 3 + 1

    def rmsnorm(h):
        h32 = h.to(torch.float32)
        return h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)

    exact = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    mode = PrecisionMode(torch.float64)
    with mode:
        y = rmsnorm(x)
    assert y.dtype == torch.float64
    assert torch.equal(y, exact)
    assert mode.promotions >= 1
    assert not torch.equal(rmsnorm(x).double(), exact)  # without the mode the truth is rounded


def test_float64_mode_covers_factories_and_backward():
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    with PrecisionMode(torch.float64):
        ones = torch.ones(3, dtype=torch.float32)
        loss = (w.float() @ ones).sum()
        loss.backward()
    assert ones.dtype == torch.float64 and loss.dtype == torch.float64 and w.grad.dtype == torch.float64


def test_bf16_rounding_mode_rounds_operands_and_results():
    a = torch.randn(16, 16)
    b = torch.randn(16, 16)
    with PrecisionMode(torch.float32, torch.bfloat16, "all"):
        c = a @ b
    assert c.dtype == torch.float32
    assert torch.equal(c, c.to(torch.bfloat16).float())  # result is bf16-representable
    ref = (a.to(torch.bfloat16).float() @ b.to(torch.bfloat16).float()).to(torch.bfloat16).float()
    assert torch.equal(c, ref)  # operands rounded before the fp32 GEMM


def test_amp_mode_leaves_elementwise_ops_in_fp32():
    a = torch.randn(64) + 0.1
    with PrecisionMode(torch.float32, torch.bfloat16, "amp"):
        y = a.exp()
    assert torch.equal(y, a.exp())


def test_jitter_members_differ_but_keep_exact_values():
    x = torch.randn(10000)
    ints = torch.arange(100, dtype=torch.float32)
    outs = []
    for seed in (None, 1, 2):
        with PrecisionMode(torch.float32, torch.bfloat16, "all", jitter_seed=seed):
            outs.append((x * 1.0, ints * 1.0))
    assert not torch.equal(outs[1][0], outs[2][0])
    rel = ((outs[1][0] - x).abs() / x.abs()).max()
    assert rel <= 0.75 * 2**-7 + 1e-9  # each rounding stays below 3/4 ulp of bf16
    assert all(torch.equal(o[1], ints) for o in outs)  # integers are never moved


def test_a_jittered_member_draws_nothing_for_an_operand_already_in_the_format():
    """An operand a rounded op produced is already bf16: rounding it again moves nothing and draws no
    jitter (the generator's state is unchanged), while an unrounded value draws and moves."""
    mode = PrecisionMode(torch.float32, torch.bfloat16, "all", jitter_seed=3)
    held = (torch.randn(4096) * 3).to(torch.bfloat16).float()
    state = mode._gen.get_state()
    assert torch.equal(mode._round(held), held) and torch.equal(mode._gen.get_state(), state)
    fresh = torch.randn(4096) * 3
    moved = mode._round(fresh)
    assert not torch.equal(mode._gen.get_state(), state)
    assert torch.equal(moved, moved.to(torch.bfloat16).float())  # lands on the format's grid
    plain = fresh.to(torch.bfloat16).float()
    assert (moved != plain).any() and ((moved - plain).abs() <= (plain.abs() * 2**-7)).all()  # one ulp at most


def test_memory_made_empty_inside_a_jittered_member_is_not_rounded_and_draws_nothing():
    """torch.empty and its kin hold whatever the memory held: rounding them read garbage, and the "already in
    the format?" test decided by chance whether the member drew jitter, so its stream (every later
    gradient) moved from run to run. Planted: garbage that is not in the format, made empty inside the mode."""
    mode = PrecisionMode(torch.float32, torch.bfloat16, "all", jitter_seed=3)
    like, read, original = torch.randn(4096), [], mode._round_values
    mode._round_values = lambda x, out=None: read.append(x.shape) or original(x, out)  # what reads values
    with mode:
        state = mode._gen.get_state()
        made = [torch.empty(()), torch.empty(4096), torch.empty_like(like), like.new_empty(4096),
                torch.empty_strided((64, 64), (1, 64)), torch.empty_permuted((8, 512), (1, 0))]  # fmt: skip
        assert read == [] and torch.equal(mode._gen.get_state(), state), "an empty tensor's memory was rounded"
        moved = like * 1.5  # real values (operand, result) are still read and draw (the checks above can fail)
    assert read and set(read) == {like.shape} and not torch.equal(mode._gen.get_state(), state) and moved.dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in made)


@pytest.mark.parametrize("fmt", [torch.bfloat16, torch.float16])
def test_a_jittered_rounding_never_moves_a_value_the_format_holds(fmt):
    """A member's factors 1 + u are drawn from a pool once; no mask keeps the format's own values: the bound
    on u does (mode._round_values). Every finite value of the format, met by the pool's extreme factors
    (1 - 2^-(p+2) and 1 + 2^-(p+2), the edges of its draws), rounds back to itself; a value off the grid
    beside them still moves."""
    info = torch.finfo(fmt)
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    values = bits.view(fmt).float()
    values = values[values.isfinite()]
    off_grid = torch.full((4096,), 1 + 0.4 * info.eps)  # 0.4 ulp above 1: rounds down to 1 unmoved
    x = torch.cat([values, off_grid])
    mode = PrecisionMode(torch.float32, fmt, "all", jitter_seed=11)
    j = mode._jitter
    assert j == 2.0 ** -(-int(math.log2(info.eps)) + 2)
    assert mode._pool.min() >= 1 - j and mode._pool.max() <= 1 + j  # the draws stay in the band
    for edge in (1 - j, 1 + j):
        mode._pool = torch.full((2 * x.numel(),), edge)
        got = mode._round_values(x)
        assert torch.equal(got[: values.numel()], values), f"a {fmt} value moved by the factor {edge}"
        assert torch.equal(got, got.to(fmt).float())
    mode._pool = torch.full((2 * x.numel(),), 1 + j)
    assert (mode._round_values(off_grid) == 1 + info.eps).all()  # moved by a quarter ulp past the tie: up


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided", "expanded", "scalar"])
def test_a_jittered_member_sees_whether_a_tensor_is_in_the_format_in_any_layout(layout):
    """The exactness check (no draw where nothing would move) reads the int16 halves of whatever layout it is
    given: one value planted off the grid is seen, wherever it sits."""
    views = {"contiguous": lambda t: t, "transposed": lambda t: t.t(), "strided": lambda t: t[:, ::2],
             "expanded": lambda t: t.unsqueeze(0).expand(3, -1, -1), "scalar": lambda t: t[4, 6]}  # fmt: skip
    mode = PrecisionMode(torch.float32, torch.bfloat16, "all", jitter_seed=3)
    held = (torch.randn(40, 30) * 5).to(torch.bfloat16).float()
    assert mode._in_format(views[layout](held))
    off = held.clone()
    off[4, 6] += off[4, 6].abs() * 2**-12  # below a bf16 ulp: off the grid
    assert not mode._in_format(views[layout](off))


def test_amp_mode_propagates_low_precision_from_inputs_held_in_bf16():
    """Fed bf16-held inputs, an op outside autocast's lists runs in bf16 (rounded, held low) on CPU;
    CUDA's float32 list keeps exp in fp32; a bf16 and an fp32 operand promote to fp32."""
    a = torch.randn(64) + 0.1
    low = a.to(torch.bfloat16).float()
    rounded = low.exp().to(torch.bfloat16).float()
    for device, expect_low in (("cpu", True), ("cuda", False)):
        mode = PrecisionMode(torch.float32, torch.bfloat16, "amp", device_type=device)
        x = low.clone()
        with mode:
            mode.mark_low(x)
            assert x.dtype == torch.bfloat16 and x.float().dtype == torch.float32  # as model code sees it
            y = x.exp()
            mixed = x * a
        assert mode._is_low(y) is expect_low
        assert torch.equal(y, rounded if expect_low else low.exp())
        assert not mode._is_low(mixed) and torch.equal(mixed, low * a)
    assert not torch.equal(rounded, low.exp())  # the rounding is visible at this size


def _norm_step(mode, x, r, g, w):
    """Qwen3-VL's final RMSNorm on a residual sum, forward and backward: glue between streamed units."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRMSNorm

    norm = Qwen3VLTextRMSNorm(x.shape[-1])
    norm.weight.data.copy_(w)
    x = x.clone().requires_grad_()
    with mode:
        y = norm(x + r)
        y.backward(g)
    return y.detach(), x.grad, norm.weight.grad


def test_large_tensors_rounded_by_blocks_and_once_give_the_same_bits(monkeypatch):
    """Tensors of _MARK_MIN / _BLOCK elements or more: a value the mode rounded is not rounded again as an
    operand, and the rounding runs block by block (in place on an op's fresh result). Round-to-nearest:
    bitwise what rounding every operand whole gives. Jittered: the record alone changes no bit (an exact
    operand drew nothing before either); blocks draw block by block: repeatable, on the grid, an honest member."""
    import oracle.precision.mode as m

    torch.manual_seed(0)
    x, r, g = (torch.randn(1024, 4608) for _ in range(3))  # 4.7 M elements: two blocks of 2^22
    w = 1 + 0.1 * torch.randn(4608)
    assert x.numel() > m._BLOCK
    new = {s: _norm_step(PrecisionMode(torch.float32, torch.bfloat16, jitter_seed=s), x, r, g, w) for s in (None, 5)}
    again = _norm_step(PrecisionMode(torch.float32, torch.bfloat16, jitter_seed=5), x, r, g, w)
    monkeypatch.setattr(m, "_BLOCK", 1 << 40)
    record_only = _norm_step(PrecisionMode(torch.float32, torch.bfloat16, jitter_seed=5), x, r, g, w)
    monkeypatch.setattr(m, "_MARK_MIN", 1 << 40)
    old = {s: _norm_step(PrecisionMode(torch.float32, torch.bfloat16, jitter_seed=s), x, r, g, w) for s in (None, 5)}
    for a, b in zip(new[None], old[None]):
        assert torch.equal(a, b)
    for a, b in zip(record_only, old[5]):
        assert torch.equal(a, b)
    for a, b, c in zip(new[5], again, new[None]):
        assert torch.equal(a, b) and torch.equal(a, a.to(torch.bfloat16).float())  # repeatable, on the grid
        assert not torch.equal(a, c)  # jittered: not the round-to-nearest member
        assert (a - c).norm() / c.norm() < 2**-6  # an honest member: of a bf16 rounding's size from the other


def test_a_rounded_tensor_written_in_place_is_rounded_again_as_an_operand():
    """The record is the tensor's version: a write outside the mode (a buffer filled by an emulated fused
    kernel) makes the next op round it as an operand again. 1 + 2^-10 is not a bf16 value: rounded it is
    1, and (1 + 2^-10) - 1 is 0; unrounded it would be 2^-10."""
    from oracle.precision.mode import outside

    mode = PrecisionMode(torch.float32, torch.bfloat16)
    ones = torch.ones(1 << 17)
    with mode:
        y = ones * 1.0  # rounded by the mode, recorded
        assert mode._holds_rounded(y)
        with outside():
            y.add_(2.0**-10)
        assert not mode._holds_rounded(y)
        z = y - ones
    assert torch.equal(z, torch.zeros_like(z))
    with mode:
        v = (ones * 1.0).view(-1, 2)  # a view of a rounded tensor holds rounded values too
        assert mode._holds_rounded(v)


@pytest.mark.parametrize("seed", [None, 11])
def test_a_fresh_result_is_rounded_in_place_and_an_operand_into_a_new_tensor(seed):
    """_round of 2^17 float32 values (above _MARK_MIN, below _BLOCK): an op's own fresh result is rounded in its own
    storage, an operand into a new tensor leaving it unchanged; both the same bits as the format's conversion
    (round to nearest; a jittered member the same draws either way). The conversion's reused buffer (_narrowed) never
    leaks: two roundings in a row keep their own values, and an fp32 member's rounding (the identity) is not it."""
    x = torch.randn(1 << 17, generator=torch.Generator().manual_seed(3))
    fresh, operand = x.clone(), x.clone()
    a = m.PrecisionMode(torch.float32, torch.bfloat16, jitter_seed=seed)
    b = m.PrecisionMode(torch.float32, torch.bfloat16, jitter_seed=seed)
    got = a._round(fresh, fresh=True)
    new = b._round(operand)
    assert got is fresh and new is not operand and torch.equal(operand, x)
    assert torch.equal(got, new)
    if seed is None:
        assert torch.equal(got, x.to(torch.bfloat16).float())
    y = torch.randn(1 << 19, generator=torch.Generator().manual_seed(4))
    ry = m.PrecisionMode(torch.float32, torch.bfloat16)._round(y)
    rx = m.PrecisionMode(torch.float32, torch.bfloat16)._round(x)
    assert torch.equal(ry, y.to(torch.bfloat16).float()) and torch.equal(rx, x.to(torch.bfloat16).float())
    f32 = m.PrecisionMode(torch.float32, torch.float32)._round(y)
    assert torch.equal(f32, y) and f32.data_ptr() == y.data_ptr()


@pytest.mark.parametrize("seed", [None, 9])
def test_a_weight_stored_in_the_members_format_is_not_rounded_again_at_each_use(seed):
    """A bf16-stored weight (held_in_format) used by linear layers, forward and backward: the mode rounds it
    nowhere, its transposed view included, and every result is bitwise what rounding it at each use gave; a
    weight stored in float32 is still rounded. A linear's 3-D output (_unsafe_view of its GEMM result) is
    recorded, not copied and rounded again."""
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(384, 256, generator=g).to(torch.bfloat16).float()
    x0 = torch.randn(2, 200, 256, generator=g)

    def run(stored: str):
        w = torch.nn.Parameter(w0.clone())
        x = x0.clone().requires_grad_(True)
        mode = m.PrecisionMode(torch.float32, torch.bfloat16, jitter_seed=seed)
        mode.held_in_format(w, stored)
        rounded = []  # the memory of every tensor the mode rounds
        real = mode._round_values
        mode._round_values = lambda t, out=None: rounded.append(t.data_ptr()) or real(t, out)
        with mode:
            y = torch.nn.functional.linear(x, w)
            (y * y).sum().backward()
        return y, x.grad, w.grad, rounded.count(w.data_ptr()), rounded.count(y.data_ptr())

    y1, gx1, gw1, weight1, out1 = run("bfloat16")
    y2, gx2, gw2, weight2, _ = run("float32")  # as before: the weight rounded at every use
    assert torch.equal(y1, y2) and torch.equal(gx1, gx2) and torch.equal(gw1, gw2)
    assert weight1 == 0 and weight2 >= 2  # the weight and its transposed view: never rounded / at each use
    assert out1 == 1  # the GEMM's result in place; its 3-D reshape recorded, not rounded a second time


def test_a_values_reshape_of_a_tensor_written_in_place_is_rounded_again():
    """_unsafe_view's record holds only while the input is the same: a reshape of a tensor changed in place
    is rounded as before (the version counter moved)."""
    mode = m.PrecisionMode(torch.float32, torch.bfloat16)
    with mode:
        a = torch.randn(64, 1024) @ torch.randn(1024, 1024)
        a.mul_(1.0 + 2**-12)  # in place: rounded again by the mode
        b = torch.ops.aten._unsafe_view(a, (64, 32, 32))
    assert torch.equal(b.reshape(64, 1024), b.reshape(64, 1024).to(torch.bfloat16).float())
