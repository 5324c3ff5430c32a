"""The NPU ops MindSpeed 0016137 calls on the user's step, written in plain torch from the ops'
documented semantics (Ascend torch_npu API reference; no Ascend code copied). Test support only.

Pure torch, no side effects on import: the main environment's tests import this package directly;
the ``torch_npu`` stand-in beside it re-exports the ops under torch_npu's names.

Numerics, common to every op here: inputs are upcast once to the compute dtype
``promote(x.dtype, float32)`` (fp32 for bf16/fp16/fp32 inputs, fp64 for fp64 ones, so gradcheck runs
in fp64), everything is computed in it, and each output is rounded once to its input's dtype at the
end (statistics such as ``rstd`` or softmax max/sum stay in the compute dtype). Each backward is
written out (a ``torch.autograd.Function``), not taken from autograd, so a fault can be planted in
it alone (``npu_ops.faults``); tests check it against autograd of the plain formula.
"""

from collections import Counter

CALLS: Counter = Counter()  # forward calls per op in this process (which ops a step reached)

from .attention import npu_fusion_attention  # noqa: E402
from .faults import FAULTS, planted  # noqa: E402
from .matmul_add import npu_matmul_add_fp32  # noqa: E402
from .norm import npu_rms_norm  # noqa: E402
from .rotary import npu_rotary_mul, npu_rotary_position_embedding  # noqa: E402
from .swiglu import npu_swiglu  # noqa: E402

__all__ = ["CALLS", "FAULTS", "planted", "npu_fusion_attention", "npu_matmul_add_fp32", "npu_rms_norm", "npu_rotary_mul",
           "npu_rotary_position_embedding", "npu_swiglu"]  # fmt: skip


def compute_dtype(*tensors):
    """fp32, or fp64 when any input is fp64."""
    import torch

    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32
