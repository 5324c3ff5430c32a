"""A CPU stand-in for ``torch_npu`` (Ascend's PyTorch adapter), test support only: it lets MindSpeed
at commit 0016137 import and run on CPU. Put ``tests/npu_standin`` on ``sys.path`` (only the
MindSpeed environment's tests do); the real torch_npu never coexists with it.

- The ops MindSpeed calls on the user's step are ``npu_ops``' (plain torch, the NPU ops' documented
  semantics, written-out backwards, planted faults: ``npu_ops.faults``).
- ``torch.npu`` is this package's ``npu`` module (device calls answered for the CPU); the device
  type ``npu`` is torch's renamed PrivateUse1, and tensors placed on it (or on ``cuda``) are placed on
  the CPU (``npu.PlaceOnCpu``, entered by ``torch_npu.contrib.transfer_to_npu`` as the real one
  redirects CUDA to the NPU).
- Every name read from this module or ``torch.npu`` is recorded with the modules that read it
  (``touched()``); a name it lacks raises AttributeError naming the stand-in, so nothing MindSpeed
  reaches is silently faked.
"""

from __future__ import annotations

import sys
import types

import torch

__version__ = "2.8.0"  # the torch_npu release paired with torch 2.8.0 (the user's pin)

import npu_ops as _ops  # noqa: E402

from . import npu  # noqa: E402


class _HcclOptions:
    """``ProcessGroupHCCL.Options`` without ``hccl_config`` (as in older torch_npu): MindSpeed's
    profiler wrapper of ``get_nccl_options`` then leaves megatron-core's options as they are (the
    CPU ranks use gloo)."""


_C = types.ModuleType("torch_npu._C")
_C._distributed_c10d = types.SimpleNamespace(ProcessGroupHCCL=types.SimpleNamespace(Options=_HcclOptions))

# The quantized dtypes torch_npu lists as unsupported; MindSpeed's dist-train tensor-sync tool reads
# it at import (its validate_args imports that package whatever the arguments).
unsupported_dtype = [torch.quint8, torch.quint4x2, torch.quint2x4, torch.qint32, torch.qint8]

npu_fusion_attention = _ops.npu_fusion_attention
npu_rms_norm = _ops.npu_rms_norm
npu_swiglu = _ops.npu_swiglu
npu_rotary_mul = _ops.npu_rotary_mul
npu_matmul_add_fp32 = _ops.npu_matmul_add_fp32
_ops.faults.validate()  # a malformed TORCH_NPU_STANDIN_FAULTS stops the run at import

TOUCHED: dict[str, set[str]] = {}  # name -> the modules that read it


def touched() -> dict[str, list[str]]:
    """The names read from ``torch_npu`` and ``torch.npu`` (``npu.`` prefixed) so far, each with the
    modules that read them; MindSpeed's patch manager probing every module's names is not counted."""
    out = {n: sorted(w) for n, w in TOUCHED.items()}
    out.update({f"npu.{n}": sorted(w) for n, w in npu.TOUCHED.items()})
    return dict(sorted(out.items()))


_record = vars(npu)["record"]  # vars(): the stand-in's own reads are not recorded


class _Recording(types.ModuleType):
    def __getattribute__(self, name):
        value = types.ModuleType.__getattribute__(self, name)
        if not name.startswith("__") and name not in ("TOUCHED", "touched", "npu"):
            _record(types.ModuleType.__getattribute__(self, "TOUCHED"), name)
        return value

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"torch_npu stand-in (tests/npu_standin) has no {name!r}: add it with the op's documented "
                             "semantics if MindSpeed's path needs it")  # fmt: skip


sys.modules[__name__].__class__ = _Recording

if getattr(torch, "npu", None) is not npu:
    torch.utils.rename_privateuse1_backend("npu")
    torch._register_device_module("npu", npu)
