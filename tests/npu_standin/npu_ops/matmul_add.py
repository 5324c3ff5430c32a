"""``npu_matmul_add_fp32(grad_output, total_input, grad)`` (MindSpeed's op-builder op and
``torch_npu.npu_matmul_add_fp32``; MindSpeed's Python wrapper ``mindspeed.ops.npu_matmul_add``
takes ``(total_input, grad_output, grad)`` and swaps them): the weight-gradient GEMM accumulated
in place into the fp32 ``main_grad``: grad += dy^T @ x, dy and x flattened to 2-D (tokens, features),
the product and the sum in fp32 (a bf16 dy/x is upcast before the GEMM, so no bf16 rounding of the
product). Planted fault ``matmul_add_bf16``: the sum is rounded to bf16.
"""

from __future__ import annotations

import torch

from . import faults


def npu_matmul_add_fp32(grad_output, total_input, grad):
    from . import CALLS

    CALLS["npu_matmul_add_fp32"] += 1
    if grad.dtype != torch.float32:
        raise TypeError(f"npu_matmul_add_fp32: grad (main_grad) is {grad.dtype}; the op accumulates into fp32")
    dy = grad_output.reshape(-1, grad_output.shape[-1]).float()  # (tokens, out)
    x = total_input.reshape(-1, total_input.shape[-1]).float()  # (tokens, in)
    prod = dy.t() @ x  # (out, in), fp32
    if faults.hit("matmul_add_bf16"):
        grad.copy_((grad.to(torch.bfloat16) + prod.to(torch.bfloat16)).float())
    else:
        grad.add_(prod)
    return grad
