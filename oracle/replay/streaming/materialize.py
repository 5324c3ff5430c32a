"""A model whose parameters live on disk until a module runs: the streaming replay's materialiser.

``skeleton(recipe, config, dtype, mode)`` builds the recipe's module with every *parameter* on the
meta device (no memory, no initialisation cost) and every *buffer* real: buffers such as rotary
inverse frequencies are computed at construction, inside the replay's PrecisionMode, so they are
float64 in the oracle exactly as in the in-memory replay.

``Weights`` reads one captured parameter at a time from the capture's safetensors files (memory
mapped by safetensors, checked against its sha256) and upcasts it to the replay's dtype, the one
upcast point of the streaming replay (exact for bf16, fp16 and fp32 values).

``materialize(module, prefix, weights)`` replaces the meta parameters under ``module`` by real
ones; ``evict(module)`` puts meta parameters back, so the real storage is freed as soon as nothing
else holds it. Parameters shared by several modules (tied embeddings) must stay resident: the
engine finds them with ``shared_parameters``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ...bundle.store import Bundle
from ...capture.steps import META
from ...precision.mode import PrecisionMode, emulating


def skeleton(recipe, config: dict[str, Any], dtype: torch.dtype, mode: PrecisionMode | None = None) -> nn.Module:
    """The recipe's module in ``dtype`` with parameters on meta and buffers computed (in ``mode``)."""
    from ...capture.steps import default_dtype, meta_parameters

    with default_dtype(dtype), meta_parameters(), mode or contextlib.nullcontext():
        model = recipe.build(dict(config))
    model.eval()  # no dropout: a step must be reproducible
    return model


class Weights:
    """Captured parameter values, one at a time, upcast to ``dtype``."""

    def __init__(self, bundle: Bundle, dtype: torch.dtype):
        self.bundle = bundle
        self.dtype = dtype

    def load(self, name: str) -> torch.Tensor:
        return self.bundle.load("weights", name).to(self.dtype)

    def stored(self, name: str) -> str:
        """The dtype the capture stored ``name`` in (``bfloat16``, ``float32``, ...)."""
        return self.bundle.entry("weights", name)["dtype"]

    def nbytes(self, name: str) -> int:
        """Bytes of the parameter once upcast to the replay's dtype."""
        e = self.bundle.entry("weights", name)
        n = 1
        for s in e["shape"]:
            n *= int(s)
        return n * self.dtype.itemsize


def _owners(module: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    for m in module.modules():
        for k, p in m._parameters.items():
            if p is not None:
                yield m, k


def materialize(module: nn.Module, prefix: str, weights: Weights, *, requires_grad: bool = True) -> None:
    """Every meta parameter under ``module`` (named ``prefix + local name``) loaded from ``weights``."""
    names = {id(m): n for n, m in module.named_modules()}
    mode = emulating()  # a member: a weight stored in its format is recorded as rounded (PrecisionMode.held_in_format)
    for m, k in _owners(module):
        p = m._parameters[k]
        if p.device != META:
            continue
        local = f"{names[id(m)]}.{k}" if names[id(m)] else k
        t = weights.load(f"{prefix}{local}" if prefix else local)
        if tuple(t.shape) != tuple(p.shape):
            raise RuntimeError(f"{prefix}{local}: captured {tuple(t.shape)}, model {tuple(p.shape)}")  # checked at load
        m._parameters[k] = nn.Parameter(t, requires_grad=requires_grad)
        if mode is not None:
            mode.held_in_format(m._parameters[k], weights.stored(f"{prefix}{local}" if prefix else local))


def evict(module: nn.Module) -> None:
    """Put meta parameters back: the module holds no storage afterwards."""
    for m, k in _owners(module):
        p = m._parameters[k]
        if p.device != META:
            m._parameters[k] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=META), requires_grad=p.requires_grad)


def shared_parameters(model: nn.Module, units: list[str]) -> set[str]:
    """Names of parameters that belong to more than one unit, or to a unit and to the rest (ties)."""
    owner: dict[int, set[str]] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        unit = next((u for u in units if n == u or n.startswith(u + ".")), "")
        for p in m._parameters.values():
            if p is not None:
                owner.setdefault(id(p), set()).add(unit)
    shared_ids = {i for i, us in owner.items() if len(us) > 1}
    return {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in shared_ids}
