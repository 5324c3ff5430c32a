"""What every replay path shares (in memory, streamed, local, planned): the recipe a bundle names,
the attention the replay runs, and carrying a capture's inputs and weights into an oracle."""

from __future__ import annotations

import torch

from .. import recipe as recipes
from ..bundle.store import Bundle, BundleWriter
from ..errors import RecipeError
from . import attention


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
    the honest error."""
    if round_to is None:
        attention.use(model)
