"""Precision policies of a captured step: how parameters are held and what autocast does.

| policy    | parameters held in | forward/backward compute                      | gradient stored       |
|-----------|--------------------|-----------------------------------------------|-----------------------|
| fp32      | float32            | float32                                       | float32 .grad         |
| bf16/fp16 | bfloat16/float16   | that dtype (Megatron Float16Module style)     | main_grad or .grad    |
| amp-bf16  | float32            | autocast(bfloat16): matmuls/convs in bf16     | float32 .grad         |
| amp-fp16  | float32            | autocast(float16)                             | float32 .grad         |

The loss is always computed from logits upcast to float32 (as transformers and Megatron's fused
cross-entropy do), so the policy describes the model body.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .errors import RecipeError


@dataclass(frozen=True)
class Policy:
    name: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None

    def autocast(self, device_type: str):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)


POLICIES = {
    "fp32": Policy("fp32", torch.float32, None),
    "bf16": Policy("bf16", torch.bfloat16, None),
    "fp16": Policy("fp16", torch.float16, None),
    "amp-bf16": Policy("amp-bf16", torch.float32, torch.bfloat16),
    "amp-fp16": Policy("amp-fp16", torch.float32, torch.float16),
}


def policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise RecipeError(f"unknown precision {name!r}; choose one of {', '.join(POLICIES)}") from None
