"""What every replay path shares (in memory, streamed, local, planned): the recipe a bundle names,
the attention the replay runs, and carrying a capture's inputs and weights into an oracle."""

from __future__ import annotations

import contextlib

import torch

from .. import recipe as recipes
from ..bundle.store import Bundle, BundleWriter
from ..capture.packing import check_boundaries, row_boundaries
from ..errors import RecipeError
from . import attention, fused


def recipe_of(cap: Bundle):
    name = (cap.get("recipe") or {}).get("name")
    if not name:
        raise RecipeError(
            f"{cap.path} names no recipe, so it cannot be rebuilt; capture with recipe=... (known: {', '.join(recipes.names())})"
        )
    return recipes.get(name)


def carry_inputs_and_weights(cap: Bundle, w: BundleWriter) -> None:
    """The capture's inputs and weights into the oracle file by file (hard links where the file
    system allows), never loaded: the oracle is readable wherever a capture is expected."""
    for group in ("inputs", "weights"):
        by_file: dict[str, dict] = {}
        for name, e in cap.manifest["tensors"].get(group, {}).items():
            by_file.setdefault(e["file"], {})[name] = {k: v for k, v in e.items() if k != "file"}
        for fname, entries in by_file.items():
            w.adopt(group, cap.path / fname, entries)


def use_replay_attention(model: torch.nn.Module, round_to) -> None:
    """The oracle runs attention through the exact chunked kernel (oracle/replay/attention.py): float64,
    O(T x chunk) memory. An emulated run keeps the recipe's fused sdpa: one op, rounded once at its
    output, as a device's fused (flash) attention is; rounding each chunk's scores would overstate
    the honest error. It runs that sdpa through ``attention.FUSED``, in memory and streamed alike:
    packed samples one call each (a device's varlen kernel), and streamed decoder layers by row chunks
    (streaming/layers.py) with the same kernel semantics."""
    attention.use(model, attention.NAME if round_to is None else attention.FUSED)


def use_fused(model: torch.nn.Module, recipe, round_to) -> dict:
    """The float64 oracle's RMSNorm and SwiGLU as fused kernels (oracle/replay/fused.py), where the recipe
    names them and ``ORACLE_FUSED=1``; an emulated run keeps every op (each is rounded where its
    device rounds it). Returns what ran, for the manifest's ``numerics.fused``."""
    if round_to is not None:
        return {"path": "unfused", "why": "an emulated run rounds every op", "fallbacks": []}
    return fused.use(model, getattr(recipe, "fusable", {}) or {})


def load_inputs(cap: Bundle, compute: torch.dtype) -> dict[str, torch.Tensor]:
    """The capture's inputs for a replay, float ones upcast to ``compute`` (the one boundary where
    they are); packed boundaries validated here (capture/packing.check_boundaries, exit 4)."""
    inputs = {n: (t.to(compute) if t.is_floating_point() else t) for n, t in cap.iter_group("inputs")}
    check_boundaries(inputs, str(cap.path))
    return inputs


def recorded_boundaries(inputs: dict[str, torch.Tensor]):
    """A context in which the replay's attention takes the recorded ``cu_seqlens`` (per row) as the
    sample boundaries, instead of inferring them from the positions; a no-op for an unpacked step."""
    cu = check_boundaries(inputs, "the step")
    if cu is None:
        return contextlib.nullcontext()
    ids = inputs.get("input_ids", inputs.get("tokens"))
    T = int(ids.shape[-1])
    return attention.packed(row_boundaries(cu, cu[-1] // T, T))
