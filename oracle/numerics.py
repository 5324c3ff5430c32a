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
``ops="amp"`` rounds only around the ops autocast runs in low precision (matmul, linear, conv,
attention); everything else stays float32, as under ``torch.autocast``. An fp32 run is emulated
by computing in float32 itself (``compute=round_to=float32``): rounding float64 results to float32
would miss the float32 accumulation error inside each GEMM, which is as large as the rounding of
its result. (For bf16 the fp32 accumulation error is ~2^-16 of the bf16 rounding: negligible.)

Ensemble members (``jitter_seed`` set) round ``x * (1 + u)`` to nearest instead of ``x``, with
``u`` uniform in ``[-2^-(p+2), 2^-(p+2)]`` (a quarter unit in the last place of the target format,
``p`` its stored mantissa bits), except where ``x`` is exactly representable in the target format
(integers, positions, masks stay exact). A value within a quarter ulp of a rounding tie lands on
either neighbour; each rounding error stays below 3/4 ulp. Each member is an equally legitimate
low-precision run; the spread of their errors against the oracle is the noise band. When the
compute and target formats are the same (fp32) there is no exact result left to re-round, so
non-integer values are moved by up to one ulp instead (to a neighbour with probability ~1/4 each
way), the spread another accumulation order gives.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

LOW_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}

_aten = torch.ops.aten
# The ops torch.autocast runs in the low-precision dtype (matmul family, convolutions, attention),
# with their backward kernels.
AMP_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten.addbmm.default, _aten.matmul.default, _aten.linear.default, _aten.convolution.default,
    _aten.convolution_backward.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}  # fmt: skip
# Ops that only move or look at data: rounding around them adds nothing.
_PASSTHROUGH = {
    _aten.detach.default, _aten.clone.default, _aten.copy_.default, _aten.empty_like.default,
    _aten.zeros_like.default, _aten.ones_like.default, _aten.lift_fresh.default,
    _aten._local_scalar_dense.default, _aten.new_empty_strided.default, _aten.empty_strided.default,
    _aten.set_.source_Tensor,
}  # fmt: skip


class PrecisionMode(TorchDispatchMode):
    """Fix the compute dtype of everything run inside; optionally round to a lower format."""

    def __init__(
        self,
        compute: torch.dtype = torch.float64,
        round_to: torch.dtype | None = None,
        ops: str = "all",
        jitter_seed: int | None = None,
    ):
        super().__init__()
        if ops not in ("all", "amp"):
            raise ValueError("ops must be 'all' or 'amp'")
        self.compute = compute
        self.round_to = round_to
        self.ops = ops
        self.promotions = 0
        self.rounded_ops = 0
        self._gen = None
        if jitter_seed is not None and round_to is not None:
            self._gen = torch.Generator().manual_seed(jitter_seed)
            p = MANTISSA_BITS[round_to]
            self._jitter = 2.0 ** -(p + 2) if round_to != compute else 2.0**-p

    # -- helpers ----------------------------------------------------------------------------
    def _lower(self, dtype: Any) -> bool:
        return isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype != self.compute and (
            dtype in LOW_FLOATS or dtype == torch.float64
        )

    def _promote(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.compute:
            self.promotions += 1
            return x.to(self.compute)
        return x

    def _round(self, x: Any) -> Any:
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype == self.compute):
            return x
        r = x.to(self.round_to).to(self.compute)
        if self._gen is not None:
            u = torch.rand(x.shape, generator=self._gen, dtype=torch.float64).mul_(2 * self._jitter).sub_(self._jitter)
            # jitter in float64 (1 + u is not representable in float32); values the format holds
            # exactly (integers, indices, masks) are never moved
            keep = (r == x) if self.round_to != self.compute else (x == x.round())
            r = torch.where(keep, r, (x.double() * (1 + u)).to(self.round_to).to(self.compute))
        return r

    def _rounds(self, func) -> bool:
        if self.round_to is None or func in _PASSTHROUGH:
            return False
        return self.ops == "all" or func in AMP_OPS

    # -- dispatch ---------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if self._lower(kwargs.get("dtype")):
            kwargs["dtype"] = self.compute
            self.promotions += 1
        if func.is_view or func._schema.is_mutable:
            out = func(*args, **kwargs)
            if self._rounds(func) and func._schema.is_mutable and func not in _PASSTHROUGH:
                for a, x in zip(func._schema.arguments, args):
                    if a.alias_info is not None and a.alias_info.is_write and isinstance(x, torch.Tensor):
                        if x.is_floating_point() and x.dtype == self.compute:
                            x.copy_(self._round(x))
            return out
        args, kwargs = tree_map(self._promote, (args, kwargs))
        rounds = self._rounds(func)
        if rounds:
            self.rounded_ops += 1
            args, kwargs = tree_map(self._round, (args, kwargs))
        out = tree_map(self._promote, func(*args, **kwargs))
        return tree_map(self._round, out) if rounds else out
