"""Where every float in a replay lives: one dispatch mode that fixes the compute dtype and,
for emulated runs, rounds to a low-precision format.

``PrecisionMode(compute=float64)`` -- the oracle. Model code written for mixed precision casts on
purpose (transformers' RMSNorm does ``hidden.to(float32)``, rotary embeddings compute ``.float()``
angles, eager attention softmaxes in float32). Run as-is on a float64 model those casts would round
the "truth" to float32 in places. Inside this mode every floating result, every cast and every
factory call that asks for float32/float16/bfloat16 is promoted to float64 instead, forward and
backward alike (the mode is active while autograd runs the backward on CPU). The number of
promotions is counted and written into the oracle's manifest, so the claim "computed in float64" is
checked, not assumed.

``PrecisionMode(compute=float32, round_to=bfloat16, ops="all")`` -- an emulated honest bf16 run:
every floating operand of every aten op is rounded to bf16 (round-to-nearest-even), the op is
computed in float32, and its result is rounded to bf16 again. This is what a device doing bf16
storage with fp32 accumulation inside each kernel does, up to the order of the accumulation.
``ops="amp"`` follows ``torch.autocast``: the ops autocast runs in low precision (matmul, linear,
conv, attention) get rounded operands and results, and their results are tracked as "held in
bf16"; an op outside autocast's lists whose floating inputs are all held in bf16 runs in bf16
too (its result is rounded and tracked), as it would on the device; ops on autocast's float32
list (``device_type``: CUDA's list for accelerators, CPU's for CPU captures) and any op with a
float32 input stay float32. An fp32 run is emulated
by computing in float32 itself (``compute=round_to=float32``): rounding float64 results to float32
would miss the float32 accumulation error inside each GEMM, which is as large as the rounding of
its result. (For bf16 the fp32 accumulation error is ~2^-16 of the bf16 rounding: negligible.)

Ensemble members (``jitter_seed`` set) round ``x * (1 + u)`` to nearest instead of ``x``, with
``u`` uniform in ``[-2^-(p+2), 2^-(p+2)]`` (a quarter unit in the last place of the target format,
``p`` its stored mantissa bits), except where ``x`` is exactly representable in the target format
(integers, positions, masks stay exact). A value within a quarter ulp of a rounding tie lands on
either neighbour; each rounding error stays below 3/4 ulp. The factors ``1 + u`` are read from a pool
drawn once per member at offsets its generator draws (``_POOL``: the cost of a jittered rounding is then
about a round-to-nearest one's). Each member is an equally legitimate
low-precision run; the spread of their errors against the oracle is the noise band. When the
compute and target formats are the same (fp32) there is no exact result left to re-round, so
non-integer values are moved by up to one ulp instead (to a neighbour with probability ~1/4 each
way), the spread another accumulation order gives.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from . import EMULATION, rounding

LOW_FLOATS = (torch.float16, torch.bfloat16, torch.float32)

_aten = torch.ops.aten
# The ops torch.autocast runs in the low-precision dtype (matmul family, convolutions, attention),
# with their backward kernels.
AMP_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten.addbmm.default, _aten.matmul.default, _aten.linear.default, _aten.convolution.default,
    _aten.convolution_backward.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}  # fmt: skip
# Ops autocast keeps in float32 (their inputs are cast up), per device type. At the aten level
# seen here; CUDA's list is used for every accelerator (NPU autocast follows it).
_FP32_CUDA = {
    _aten.native_layer_norm.default, _aten.native_group_norm.default, _aten._softmax.default,
    _aten._log_softmax.default, _aten.exp.default, _aten.log.default, _aten.pow.Tensor_Scalar,
    _aten.pow.Tensor_Tensor, _aten.rsqrt.default, _aten.reciprocal.default, _aten.sum.dim_IntList,
    _aten.sum.default, _aten.cumsum.default, _aten.prod.default, _aten.softplus.default,
    _aten.expm1.default, _aten.log1p.default, _aten.linalg_vector_norm.default,
    _aten.nll_loss_forward.default, _aten.mse_loss.default,
}  # fmt: skip
_FP32_CPU = {_aten.nll_loss_forward.default, _aten.mse_loss.default, _aten.prod.default, _aten.cumsum.default}
# Both lists are torch's autocast policy (aten/src/ATen/autocast_mode.cpp: the CUDA ``fp32`` list,
# the CPU ``fp32`` list; the ``lower_precision_fp`` lists are AMP_OPS above) as seen at the aten
# level; tests/unit/test_autocast_diff.py checks the emulation against real autocast op by op.
# Outside those lists an op runs in its inputs' dtype. Mixed-dtype kernels are the exception:
# CPU layer_norm takes a bf16 input with fp32 weight and returns the input's dtype (its backward
# the same for grad_input), computing in float32 inside. func -> (arg deciding, outputs that follow).
# (CPU only: CUDA's autocast runs layer_norm in float32.)
_FOLLOWS_INPUT = {
    _aten.native_layer_norm.default: (0, (0,)),
    _aten.native_layer_norm_backward.default: (1, (0,)),
}
# Slots a low-precision kernel keeps in float32 whatever its inputs: func -> (args, outputs). CPU
# flash attention returns its logsumexp in float32 and reads it back so in the backward.
_FP32_SLOTS = {
    _aten._scaled_dot_product_flash_attention_for_cpu.default: ((), (1,)),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default: ((5,), ()),
}
# Ops that only move or look at data, or make memory with no values yet: rounding around them adds nothing.
# An empty tensor's memory is whatever was there: rounding it read that, and a jittered member's "already in
# the format?" test (no draw if so) then moved its jitter stream by chance (a scalar torch.empty in the
# streamed head's backward made a band member's gradients differ from run to run; issue 43).
_PASSTHROUGH = {
    _aten.detach.default, _aten.clone.default, _aten.copy_.default, _aten.empty_like.default,
    _aten.zeros_like.default, _aten.ones_like.default, _aten.lift_fresh.default,
    _aten._local_scalar_dense.default, _aten.new_empty_strided.default, _aten.empty_strided.default,
    _aten.empty.memory_format, _aten.new_empty.default, _aten.empty_permuted.default, _aten.set_.source_Tensor,
}  # fmt: skip


# Ops that return their input's values in another shape, sharing its storage, without being views to autograd
# (a linear's 3-D output is its 2-D GEMM result through _unsafe_view): the general path took their result for
# a new value and rounded it into a new tensor (an allocation and a pass per linear layer's output).
_SAME_VALUES = {_aten._unsafe_view.default}

_DTYPE_GET = torch.Tensor.dtype.__get__

# Memory of an emulated replay over a whole sequence (the glue between streamed units: residual adds,
# the final norm, the head's input gradient scattered into the sequence; 65536 x 4096 float32 = 1 GiB a
# tensor): rounding ``x.to(bf16).to(float32)`` makes a half and a whole copy of its tensor, a jittered
# rounding (then) five more (the draws, the mask, the moved value and its two conversions; one now, the
# moved value: _POOL), and every operand of every op was rounded again. Measured on Qwen3-VL's final
# RMSNorm, forward and backward of 16384 x 4096 (benchmarks/emulated_glue.py): 10.5 tensors above the
# inputs round-to-nearest, 13.3 jittered (11.0 with the pool), against the float64 truth's 7 (its tensors
# twice as large); with what follows 7.6 and 7.3. So:
# - a tensor this mode rounded is recorded (id, version counter); met again as an operand it is passed
#   as it is: rounding a rounded value gives it back (and a jittered member draws nothing for it, as
#   ``_round``'s all-exact case already did), so the results are bitwise those of rounding it again;
#   any in-place write (a view's included) moves the version counter and the record no longer holds;
# - a tensor of _BLOCK elements or more is rounded block by block (the temporaries one block in size);
# - an op's own fresh result of _MARK_MIN elements or more is rounded in place (not held twice; a new
#   tensor of a few MiB was a fresh mapping the kernel zeroed page by page: on Qwen3-VL-8B's 2-layer cut a
#   bf16 member spent 11 % of its CPU zeroing the pages of such copies, ``perf record``).
# Only for tensors of _MARK_MIN / _BLOCK elements or more: small ones are rounded exactly as before
# (the record would cost more than the rounding). Jittered blocks draw block by block, a stream as
# legitimate as one draw and as repeatable.
_MARK_MIN = 1 << 16
_BLOCK = 1 << 22

# A jittered member's factors 1 + u come from a pool of _POOL independent draws made once per member
# (from its seed; 32 MiB in float32), read at an offset drawn per rounding (per _BLOCK elements) from
# the member's generator. Drawing every factor afresh ran torch's serial CPU generator at ~3 ns an
# element: the draws, the exactness mask and the select made a jittered member 0.78x the truth's time
# against the round-to-nearest one's 0.47x (benchmarks/band_cost.py, 2 layers x 2048, 4096 tokens, in
# memory; 0.52x with the pool), and the band of 2 streamed at 16384 tokens 2.04x the truth (1.51x with
# the pool: benchmarks/long_samples.py). Within one rounding the factors are independent; two roundings share factors only where their
# offsets line up, which pairs unrelated values (a GEMM's two operands: for given output (t, n) at most
# a few k of the dot product meet the same factor), so each member is still a legitimate rounding of
# its own, repeatable from its seed.
_POOL = 1 << 23

# A rounding converts to the format and back: ``x.to(bf16)`` made a fresh half-size temporary per rounding, and
# above glibc's mmap threshold (1 MiB in a streamed member, engine.MMAP_MB) each was a fresh mapping the kernel
# zeroed page by page: 2.7 % of a bf16 member's CPU time on Qwen3-VL-8B's 2-layer cut at 4096 tokens went to zeroing
# those pages (``perf record``: clear_page_erms under the float->bf16 copy kernel; the 11 % under the copy back was
# the rounded copies of fresh results, now rounded in place: _MARK_MIN above). A contiguous tensor of
# _NARROW_MIN to _NARROW_MAX elements (a _BLOCK: a larger tensor is rounded by blocks) is converted into a buffer
# kept per thread and format instead (the same conversion kernel: bitwise the same values); 8 MiB in bf16, held for
# the process's life.
_NARROW_MIN, _NARROW_MAX = 1 << 18, 1 << 22
_NARROW = threading.local()


def _factor_pool(seed: int, jitter: float, dtype: torch.dtype) -> torch.Tensor:
    # its own stream (the seed's, offset), so the member's generator, reseeded and restored by the streamed
    # replay, only moves the offsets
    gen = torch.Generator().manual_seed((seed + 0x5EED) % (1 << 63))
    return torch.empty(_POOL, dtype=dtype).uniform_(-jitter, jitter, generator=gen).add_(1)


def _called_by_the_engine() -> bool:
    """Whether the torch call comes from oracle's own replay kernels (chunked attention, chunked
    head and loss) rather than from model code: the first caller outside torch is in ``oracle``.
    Those kernels compute in the compute dtype by design and see tensors as they are."""
    f = sys._getframe(2)
    while f is not None and f.f_globals.get("__name__", "").startswith("torch"):
        f = f.f_back
    return f is not None and f.f_globals.get("__name__", "").startswith("oracle.")


_F = torch.nn.functional
_RMS_NORMS = (torch.rms_norm, _F.rms_norm)
# CPU autocast's float32 list at the Python level: composite ops that autocast casts up before they
# decompose (the aten pieces, e.g. cross_entropy's log_softmax, are not on the list themselves)
_FP32_CPU_COMPOSITE = (_F.cross_entropy, _F.nll_loss, _F.mse_loss, _F.l1_loss, _F.smooth_l1_loss, _F.kl_div)
# Functions that take a bf16 and an fp32 tensor without promoting the bf16 one: autocast's
# lower-precision ops (they cast everything to bf16), mixed-dtype norm kernels, writes and casts.
_NO_PROMOTION = {
    _F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.bmm, torch.addmm,
    torch.baddbmm, _F.conv1d, _F.conv2d, _F.conv3d, _F.scaled_dot_product_attention, _F.layer_norm,
    torch.layer_norm, torch.Tensor.__setitem__, torch.Tensor.copy_, torch.Tensor.to, torch.Tensor.type_as,
    torch.Tensor.type, torch.Tensor.float, torch.Tensor.masked_fill_, torch.Tensor.index_put_,
}  # fmt: skip


class _Upcast(torch.autograd.Function):
    """``x.float()`` of a tensor held in bf16: same values, no longer held low; its backward casts
    the gradient back to the held format (rounded by the dispatch mode), as autograd does for a
    real bf16 tensor."""

    @staticmethod
    def forward(ctx, x, fmt):
        ctx.fmt = fmt
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g.to(dtype=ctx.fmt), None


class _ApparentDtype(TorchFunctionMode):
    """amp emulation: a tensor held "in bf16" is a float32 tensor marked low, so model code that
    looks at its dtype or casts it to float32 would see float32 and do nothing -- where the device
    sees bf16 and upcasts (``x.float()``), or casts back (``y.to(x.dtype)``). This mode, entered
    with PrecisionMode, makes the marking visible at the Python level: ``x.dtype`` of a marked
    tensor is the emulated format; ``.float()`` / ``.to(float32)`` / ``.type_as(fp32 tensor)`` of
    one returns an unmarked copy (values exact, as the real upcast); a cast to the emulated format
    reaches the dispatch mode as one (and is rounded there). Only model code is shown this view:
    calls from oracle's own replay kernels pass through untouched (``_called_by_the_engine``)."""

    def __init__(self, owner: PrecisionMode):
        super().__init__()
        self.owner = owner

    def _apparent(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return self.owner.round_to if self.owner._is_low(x) else x.dtype
        return x if isinstance(x, torch.dtype) else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _called_by_the_engine():
            return func(*args, **kwargs)
        own = self.owner
        if func == _DTYPE_GET and args and own._is_low(args[0]):
            return own.round_to
        cpu = own._fp32_ops is _FP32_CPU
        if cpu and func in _RMS_NORMS and args and own._is_low(args[0]):
            return self._rms_norm(*args, **kwargs)
        if cpu and func in _FP32_CPU_COMPOSITE:
            args, kwargs = tree_map(self._upcast_low, (args, kwargs))
            return func(*args, **kwargs)
        if func not in _NO_PROMOTION and func != _DTYPE_GET:
            leaves = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor) and a.is_floating_point()]
            if any(own._is_low(a) for a in leaves) and not all(own._is_low(a) for a in leaves):
                # type promotion: the bf16 operands are upcast, and their gradients cast back to bf16
                # on each edge, as autograd does for a real bf16 tensor
                args, kwargs = tree_map(self._upcast_low, (args, kwargs))
        name = getattr(func, "__name__", None)
        if name in ("float", "to", "type_as", "type") and args and isinstance(args[0], torch.Tensor):
            x = args[0]
            if name == "float":
                target = torch.float32
            else:
                cands = [self._apparent(a) for a in (*args[1:], kwargs.get("dtype"), kwargs.get("other"))]
                target = next((c for c in cands if isinstance(c, torch.dtype)), None)
            if target == torch.float32 and own._is_low(x):
                return _Upcast.apply(x, own.round_to)
            if target == own.round_to and not own._is_low(x) and x.dtype == own.compute:
                return x.to(dtype=target)  # reaches the dispatch mode as a cast to the emulated format
        return func(*args, **kwargs)

    def _upcast_low(self, x: Any) -> Any:
        return _Upcast.apply(x, self.owner.round_to) if isinstance(x, torch.Tensor) and self.owner._is_low(x) else x

    def _rms_norm(self, x, normalized_shape, weight=None, eps=None):
        """torch's CPU rms_norm of a bf16 input with fp32 weight (composite, layer_norm.cpp): upcast,
        ``x * rsqrt(mean(x^2) + eps) * weight`` in float32 (eps defaults to float32's), one rounding
        to the input's format at the end (checked bitwise against real autocast)."""
        xf = _Upcast.apply(x, self.owner.round_to)
        dims = tuple(range(-len(normalized_shape), 0))
        y = xf * torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + (torch.finfo(torch.float32).eps if eps is None else eps))
        if weight is not None:
            y = y * weight
        return y.to(dtype=self.owner.round_to)


class PrecisionMode(TorchDispatchMode):
    """Fix the compute dtype of everything run inside; optionally round to a lower format."""

    def __init__(
        self,
        compute: torch.dtype = torch.float64,
        round_to: torch.dtype | None = None,
        ops: str = "all",
        jitter_seed: int | None = None,
        device_type: str = "cuda",
    ):
        super().__init__()
        self._fp32_ops = _FP32_CPU if device_type == "cpu" else _FP32_CUDA
        self._low: dict[int, weakref.ref] = {}  # amp: tensors that autocast would hold in low precision
        self._rounded: dict[int, tuple[weakref.ref, int]] = {}  # tensors this mode rounded: (ref, version)
        if ops not in ("all", "amp"):
            raise ValueError("ops must be 'all' or 'amp'")
        self.compute = compute
        self.round_to = round_to
        self.ops = ops
        self.promotions = 0
        self._gen = None
        if jitter_seed is not None and round_to is not None:
            self._gen = torch.Generator().manual_seed(jitter_seed)
            p = -int(math.log2(torch.finfo(round_to).eps))  # stored mantissa bits: 7 bf16, 10 fp16, 23 fp32
            self._jitter = 2.0 ** -(p + 2) if round_to != compute else 2.0**-p
            if round_to != compute:  # drawn once per member (see _POOL), here so the process's measured
                self._pool = _factor_pool(jitter_seed, self._jitter, compute)  # resident set holds it

    def __enter__(self):
        out = super().__enter__()
        self._fn_mode = None
        if self.round_to is not None and self.ops == "amp" and self.round_to != self.compute:
            self._fn_mode = _ApparentDtype(self)
            self._fn_mode.__enter__()
        return out

    def __exit__(self, *exc):
        if self._fn_mode is not None:
            self._fn_mode.__exit__(*exc)
            self._fn_mode = None
        return super().__exit__(*exc)

    # -- helpers ----------------------------------------------------------------------------
    def _lower(self, dtype: Any) -> bool:
        return (
            isinstance(dtype, torch.dtype)
            and dtype.is_floating_point
            and dtype != self.compute
            and (dtype in LOW_FLOATS or dtype == torch.float64)
        )

    def _promote(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.compute:
            self.promotions += 1
            return x.to(self.compute)
        return x

    def _holds_rounded(self, x: torch.Tensor) -> bool:
        e = self._rounded.get(id(x))
        return e is not None and e[0]() is x and not x.is_inference() and e[1] == x._version

    def _record_rounded(self, x: torch.Tensor) -> None:
        if x.numel() < _MARK_MIN or x.is_inference():
            return
        key, book = id(x), self._rounded

        def forget(ref, key=key, book=book):
            if book.get(key, (None,))[0] is ref:
                del book[key]

        book[key] = (weakref.ref(x, forget), x._version)

    def held_in_format(self, x: torch.Tensor, stored: str | torch.dtype) -> torch.Tensor:
        """``x``, a weight upcast from values stored as ``stored``: where those are the emulated format's own
        (bf16 stored, a bf16 member), ``x`` holds only the format's values and is recorded as rounded, so no op
        rounds it again (a weight used as an operand was rounded into a new tensor at every use, forward,
        recomputation and backward; as a transposed view eagerly, into two). The same bits: rounding a value
        of the format gives it back, and a jittered member draws nothing for it (``_round_values``)."""
        same = str(stored).removeprefix("torch.") == str(self.round_to).removeprefix("torch.")
        if same and self.round_to != self.compute:
            self._record_rounded(x)
        return x

    def _round(self, x: Any, fresh: bool = False) -> Any:
        """``x`` rounded to the emulated format (jittered in a member), as a new tensor; in place where
        ``fresh`` (an op's own result, aliasing no input) and the tensor is large (see _BLOCK)."""
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype == self.compute):
            return x
        if x.device.type == "meta":  # a placeholder (an evicted unit's parameter) holds no value: nothing to round,
            return x  # and the jitter stream must not move
        low = self.round_to != self.compute
        if low and self._holds_rounded(x):
            return x
        n = x.numel()
        if not x.is_contiguous():
            out = self._round_values(x)
        elif n < _BLOCK or (self._gen is None and rounding.usable(x, self.round_to)):  # (the kernel: no blocks)
            # an op's own result in place (``fresh``): a new tensor was a fresh mapping to fault in
            out = self._round_values(x, out=x if fresh else None)
        else:
            out = x if fresh else torch.empty_like(x)
            src, dst = x.view(-1), out.view(-1)
            for a in range(0, n, _BLOCK):  # the format's values copied straight back into the block (a pass and
                self._round_values(src[a : a + _BLOCK], out=dst[a : a + _BLOCK])  # a temporary fewer: 0.73x the time)
        if low:
            self._record_rounded(out)
        return out

    def _round_values(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` rounded to the format (jittered in a member), into ``out`` where given (``x``'s shape,
        contiguous; ``x`` itself allowed), else as a new tensor."""
        fast = rounding.usable(x, self.round_to)  # the C kernel's one pass (precision/rounding.py): the same bits
        if self._gen is None:
            if fast:
                return rounding.nearest(x, torch.empty_like(x) if out is None else out)
            r = self._narrowed(x)
            return r.to(self.compute) if out is None else out.copy_(r)
        if self.round_to == self.compute:  # fp32 computed in float32: the move is a whole ulp (2^-23), so 1 + u
            u = torch.rand(x.shape, generator=self._gen, dtype=torch.float64).mul_(2 * self._jitter).sub_(self._jitter)
            r = torch.where(x == x.round(), x, (x.double() * (1 + u)).to(self.round_to).to(self.compute))
            return r if out is None else out.copy_(r)
        if self._in_format(x):  # the result of a rounded op met again as an operand: nothing to move, no draw
            if out is None:
                return x.clone()
            return out if out is x else out.copy_(x)
        # x (1 + u) as one float32 product with the factor 1 + u read from the member's pool (_POOL; 1 + u held
        # in float32 puts u on a grid of 2^14-2^15 points per quarter ulp of bf16), in the
        # logical (row-major) order of x's elements whatever its strides (issue 41: the same values laid
        # out otherwise must draw the same jitter), then rounded to nearest. A value the format holds
        # exactly is never moved (x = m 2^(e-p), |x u| <= m 2^(e-2p-2) < half its ulp; at m = 2^p the
        # step below is half as wide and x u reaches at most that tie, which rounds back to x, the even
        # one), so integers, positions and masks stay exact without a mask.
        if fast:
            return rounding.jittered(x, self._factors(x.shape), torch.empty_like(x) if out is None else out)
        moved = torch.mul(x, self._factors(x.shape), out=out) if out is not None else x * self._factors(x.shape)
        return moved.copy_(self._narrowed(moved))

    def _narrowed(self, x: torch.Tensor) -> torch.Tensor:
        """``x.to(self.round_to)``, for a large contiguous ``x`` in this thread's reused buffer (_NARROW_MIN):
        read it before the next rounding on this thread."""
        n = x.numel()
        if n < _NARROW_MIN or n > _NARROW_MAX or x.dtype == self.round_to or not x.is_contiguous() or x.device.type != "cpu":
            return x.to(self.round_to)
        bufs = _NARROW.__dict__.setdefault("bufs", {})
        buf = bufs.get(self.round_to)
        if buf is None:
            buf = bufs[self.round_to] = torch.empty(_NARROW_MAX, dtype=self.round_to)
        return buf[:n].view(x.shape).copy_(x)

    def _in_format(self, x: torch.Tensor) -> bool:
        """Every value of ``x`` (float32) already one of the format's: for bf16 its low 16 bits are zero
        (read as int16 halves, one strided pass: 0.3x the time of comparing with a rounded copy), its
        dimensions taken densest last (a transposed weight is read as it is stored)."""
        if rounding.usable(x, self.round_to):  # the kernel: contiguous, stops at the first block that is not
            return rounding.in_format(x)
        if self.round_to == torch.bfloat16 and x.dtype == torch.float32 and sys.byteorder == "little" and x.dim() > 0:
            x = x.permute(*sorted(range(x.dim()), key=lambda d: (x.stride(d) == 1, -x.stride(d))))
            if x.stride(-1) == 1:
                return int(torch.count_nonzero(x.view(torch.int16)[..., 0::2])) == 0
        return torch.equal(x.to(self.round_to).to(self.compute), x)

    def _factors(self, shape: torch.Size) -> torch.Tensor:
        """``prod(shape)`` factors 1 + u for one rounding: slices of the member's pool at offsets drawn from
        its generator (one draw per _BLOCK elements, at most half the pool), in ``shape``."""
        n, parts, step = math.prod(shape), [], min(_BLOCK, self._pool.numel() // 2)
        for a in range(0, max(n, 1), step):
            m = min(step, n - a)
            o = int(torch.randint(0, self._pool.numel() - m + 1, (1,), generator=self._gen))
            parts.append(self._pool[o : o + m])
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(shape)

    def _is_low(self, x: Any) -> bool:
        r = self._low.get(id(x))
        return r is not None and r() is x

    def mark_low(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            self._low[id(x)] = weakref.ref(x)
        return x

    def _amp_follows(self, func, args, kwargs) -> bool:
        """amp: an op outside autocast's lists runs in its inputs' dtype -- low iff all are low."""
        if func in self._fp32_ops or func in _PASSTHROUGH:
            return False
        if func == _aten._to_copy.default:
            return self._is_low(args[0]) and kwargs.get("dtype") is None
        floats = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor) and x.is_floating_point()]
        return bool(floats) and all(self._is_low(x) for x in floats)

    def _layer_norm_param_grads(self, out, grad_out, x, shape, mean, rstd):
        """CPU layer_norm backward of a bf16 input: grad_weight = sum_rows(g * xhat), grad_bias =
        sum_rows(g). The kernel splits the rows into one chunk per thread, sums each chunk
        sequentially into a bf16 buffer (each partial sum rounded), then adds the buffers in
        float32 -- reproduced bitwise against real autocast with this host's thread count
        (``torch.get_num_threads()``; a capture from a host with another count differs by the
        order of that sum only)."""
        if out[1] is None and out[2] is None:
            return out
        d = math.prod(shape)
        g = grad_out.reshape(-1, d)
        xhat = ((x - mean) * rstd).reshape(-1, d)
        for i, rows in ((1, g * xhat), (2, g)):
            if out[i] is not None:
                total = torch.zeros(d, dtype=self.compute)
                for chunk in rows.chunk(max(1, torch.get_num_threads())):
                    acc = torch.zeros(d, dtype=self.compute)
                    for r in chunk:
                        acc = (acc + r).to(self.round_to).to(self.compute)
                    total = total + acc
                out[i] = total.reshape(out[i].shape)
        return out

    def _rounds(self, func) -> bool:
        if self.round_to is None or func in _PASSTHROUGH:
            return False
        return self.ops == "all" or func in AMP_OPS

    # -- dispatch ---------------------------------------------------------------------------
    def _oracle_dispatch(self, func, args, kwargs):
        """The oracle's path, kept short (it runs for every op of the replay, forward and backward):
        a lower dtype asked for is replaced by the compute dtype; a lower floating result (an op fed
        only by a tensor made outside the mode, e.g. a float32 constant) is promoted. Inputs are
        not scanned: inside the mode every floating tensor is produced in the compute dtype, and a
        float32 operand meeting a float64 one is widened exactly by type promotion."""
        dt = kwargs.get("dtype")
        if dt is not None and self._lower(dt):
            kwargs = {**kwargs, "dtype": self.compute}
            self.promotions += 1
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            if out.is_floating_point() and out.dtype != self.compute and not func._schema.is_mutable and not func.is_view:
                self.promotions += 1
                return out.to(self.compute)
            return out
        if func.is_view or func._schema.is_mutable:
            return out
        return tree_map(self._promote, out)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.round_to is None:
            return self._oracle_dispatch(func, args, kwargs or {})
        kwargs = dict(kwargs or {})
        explicit_low = False
        if self._lower(kwargs.get("dtype")):
            # model code asking for a low format on purpose (``.to(bfloat16)``): in an emulated
            # run that is a rounding to the emulated format; in the oracle it is promoted away
            explicit_low = self.round_to is not None and kwargs["dtype"] in (torch.float16, torch.bfloat16)
            kwargs["dtype"] = self.compute
            self.promotions += 1
        if explicit_low and not func.is_view and not func._schema.is_mutable:
            out = tree_map(self._round, tree_map(self._promote, func(*args, **kwargs)))
            return tree_map(self.mark_low, out)
        amp = self.round_to is not None and self.ops == "amp"
        if func in _SAME_VALUES and self.round_to != self.compute and self._holds_rounded(args[0]):
            out = func(*args, **kwargs)  # the input's values, rounded already: recorded, not copied and rounded again
            self._record_rounded(out)
            return self.mark_low(out) if amp and self._is_low(args[0]) else out
        if amp and func.is_view:
            out = func(*args, **kwargs)
            return tree_map(self.mark_low, out) if self._is_low(args[0]) else out
        cpu_low = self._fp32_ops is _FP32_CPU and self.round_to not in (None, self.compute)
        if amp and cpu_low and func in _FOLLOWS_INPUT and self._is_low(args[_FOLLOWS_INPUT[func][0]]):
            out = list(tree_map(self._promote, func(*tree_map(self._promote, args), **kwargs)))
            for i in _FOLLOWS_INPUT[func][1]:
                out[i] = self.mark_low(self._round(out[i]))
            if func == _aten.native_layer_norm_backward.default:
                out = self._layer_norm_param_grads(out, *args[:5])
            return tuple(out)
        if amp and func not in AMP_OPS and self._amp_follows(func, args, kwargs):
            if func._schema.is_mutable:
                out = func(*args, **kwargs)
                if isinstance(args[0], torch.Tensor) and args[0].dtype == self.compute:
                    args[0].copy_(self._round(args[0]))
                return out
            return tree_map(self.mark_low, tree_map(self._round, tree_map(self._promote, func(*args, **kwargs))))
        if func.is_view or func._schema.is_mutable:
            out = func(*args, **kwargs)
            if func.is_view and isinstance(args[0], torch.Tensor) and self._holds_rounded(args[0]):
                tree_map(lambda o: self._record_rounded(o) if isinstance(o, torch.Tensor) else None, out)  # its values
            if self._rounds(func) and func._schema.is_mutable and func not in _PASSTHROUGH:
                for a, x in zip(func._schema.arguments, args):
                    if a.alias_info is not None and a.alias_info.is_write and isinstance(x, torch.Tensor):
                        if x.is_floating_point() and x.dtype == self.compute:
                            x.copy_(self._round(x))
            return out
        args, kwargs = tree_map(self._promote, (args, kwargs))
        rounds = self._rounds(func)
        keep = _FP32_SLOTS.get(func, ((), ())) if amp else ((), ())
        if rounds:
            args = [a if i in keep[0] else tree_map(self._round, a) for i, a in enumerate(args)]
            kwargs = tree_map(self._round, kwargs)
        out = tree_map(self._promote, func(*args, **kwargs))
        if not rounds:
            return out
        held = None  # the inputs' storages, looked up only for a result large enough to round in place
        if any(isinstance(o, torch.Tensor) and o.numel() >= _MARK_MIN for o in tree_flatten(out)[0]):
            held = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                    if isinstance(t, torch.Tensor) and t.layout == torch.strided}  # fmt: skip
        if cpu_low and func == _aten.native_layer_norm_backward.default:  # pure bf16: the same kernel sums
            out = tuple(self._layer_norm_param_grads(list(out), *args[:5]))
        if keep[1]:  # outputs the kernel keeps in float32 (attention's logsumexp)
            return tuple(o if i in keep[1] else self.mark_low(self._round(o)) for i, o in enumerate(out))
        out = tree_map(lambda o: self._round(o, fresh=_fresh(o, held)), out)
        return tree_map(self.mark_low, out) if amp else out


def emulation_record(compute: torch.dtype, round_to: torch.dtype | None, ops: str) -> dict[str, Any]:
    """What an emulated replay writes into its manifest (``emulation``): what it computes as a version
    (precision.EMULATION: a judge adopts a band of its own version only), the formats, the ops rounded, the
    members' jitter, and how the rounding ran (precision/rounding.py: the same bits either way)."""
    return {"version": EMULATION, "compute": str(compute).removeprefix("torch."), "round_to": str(round_to).removeprefix("torch."), "ops": ops,
            "jitter": "members >= 1 round x*(1+u), u uniform in ±1/4 ulp (±1 ulp when compute = target); exact values kept",
            "rounding": rounding.describe(round_to)}  # fmt: skip


# -- one fused kernel of the emulated device ----------------------------------------------------
# A device's fused (flash) attention reads its bf16 operands, computes in float32 inside (no rounding
# between its steps) and writes each result once in bf16. An emulated replay that runs such a kernel
# as several torch ops (a decoder layer run by row chunks, oracle/replay/streaming/layers.py) must
# not let this mode round every op of it (that would overstate the honest error), so it runs the
# kernel with the mode set aside (``outside``) and rounds the operands and results itself, as the
# mode rounds the fused attention op (in AMP_OPS: rounded under "all" and under amp alike).
_FUSED_ATTENTION = _aten._scaled_dot_product_flash_attention_for_cpu.default


def _fresh(o: Any, held: set[int] | None) -> bool:
    """An op's large result owning its storage (sharing none with the op's inputs): rounded in place."""
    return (held is not None and isinstance(o, torch.Tensor) and o.layout == torch.strided and o._base is None
            and o.untyped_storage().data_ptr() not in held)  # fmt: skip


def emulating() -> PrecisionMode | None:
    """The active PrecisionMode when it rounds (an emulated replay), else None (the oracle, no mode)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    mode = _get_current_dispatch_mode()
    return mode if isinstance(mode, PrecisionMode) and mode.round_to is not None else None


def outside():
    """A block run with the dispatch modes set aside: torch ops compute in their operands' dtype,
    unrounded (a fused kernel's inside; buffers written without a rounding pass over them)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


@contextlib.contextmanager
def as_stored():
    """A block that writes or reads tensor files of the replay's own (spilled activations, journalled
    input gradients), or restores a layout: every mode set aside (the dispatch mode rounds nothing
    here; the function mode shows no apparent dtype), so a tensor held "in bf16" by the amp emulation
    (a float32 tensor marked low, shown as bf16 by ``_ApparentDtype``) is written as the float32 it is
    and read back bitwise. Under the modes safetensors wrote it as real bf16: a spilled activation came
    back another dtype, and the backward failed or not with the memory left for activations."""
    from torch.utils._python_dispatch import _disable_current_modes

    with torch._C.DisableTorchFunction(), _disable_current_modes():
        yield


def kernel_io(mode: PrecisionMode | None, x: Any) -> Any:
    """``x`` as a fused attention kernel of the emulated device reads or writes it: rounded once to the
    emulated format (jittered in a jittered member), held low under amp. Call it ``outside`` the mode;
    a no-op without an emulating mode or for a non-float."""
    if mode is None or not mode._rounds(_FUSED_ATTENTION):
        return x
    x = mode._round(x)
    return mode.mark_low(x) if mode.ops == "amp" else x
