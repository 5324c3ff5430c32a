"""MindSpeed's own NPU ops on the CPU: MindSpeed builds ``npu_matmul_add_fp32`` and
``npu_rotary_position_embedding`` from C++ against CANN at first use (``mindspeed.op_builder``,
``torch.utils.cpp_extension.load``), which cannot happen off Ascend. ``install()`` puts the
stand-in's ops (``npu_ops``) into the op builders' loaded-ops cache under the ops' names, so
MindSpeed's own Python wrappers (``mindspeed.ops.npu_matmul_add``,
``mindspeed.ops.npu_rotary_position_embedding``) run unchanged and call them. Test support only."""

from __future__ import annotations

import types

import npu_ops

OPS = {"npu_matmul_add_fp32": npu_ops.npu_matmul_add_fp32,
       "npu_rotary_position_embedding": npu_ops.npu_rotary_position_embedding}  # fmt: skip


def install() -> list[str]:
    """Register the ops; returns their names. Needs mindspeed importable (after torch_npu)."""
    import os

    from mindspeed.op_builder.builder import MindSpeedOpBuilder

    # the ATB builders (npu_matmul_add_fp32's) look for the Ascend ops' paths before their cache:
    # a marker, never read since the cache answers
    for var in ("ASDOPS_HOME_PATH", "ASDOPS_OPS_PATH"):
        os.environ.setdefault(var, "<torch_npu stand-in: no Ascend ops>")

    for name, fn in OPS.items():
        MindSpeedOpBuilder._loaded_ops[name] = types.SimpleNamespace(**{name: fn}, __standin__=True)
    return sorted(OPS)
