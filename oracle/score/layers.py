"""Grouping parameter names into layers, ordered along the backward pass (loss end first).

One implementation for every caller (score, norm logs, reports). A recipe supplies only a key:
``layer_key(name) -> ((major, minor), label)`` where sorting by ``(major, minor)`` walks the
backward pass from the loss end; names the key does not know (``None``) fall back to the generic
key below, then to "the name up to its first index" ordered as the reverse of first appearance
(registration order runs forward, so its reverse approximates the backward).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

LayerKey = Callable[[str], "tuple[tuple[int, int], str] | None"]

_DECODER = re.compile(r"(?:decoder\.layers|language_model\.layers|model\.layers)\.(\d+)\.")
_VIT = re.compile(r"blocks\.(\d+)\.")


def generic_key(name: str) -> tuple[tuple[int, int], str] | None:
    """Layers from the name alone, for Megatron-core and Hugging Face names of decoder LMs and
    their vision towers: output layer, final norm, decoder layers last to first, embeddings, then
    the vision tower from its blocks' end back to its input."""
    if m := _DECODER.search(name):
        return (2, -int(m[1])), f"layers.{m[1]}"
    if re.search(r"output_layer|lm_head", name):
        return (0, 0), "output_layer"
    if re.search(r"final_layernorm|language_model\.norm\.|^model\.norm\.", name):
        return (1, 0), "final_norm"
    if re.search(r"word_embeddings|embed_tokens", name):
        return (3, 0), "embedding"
    if m := _VIT.search(name):
        return (5, -int(m[1])), f"visual.blocks.{m[1]}"
    if "visual" in name:
        return (4, 0), "visual"
    return None


def group(names: Iterable[str], key: LayerKey | None = None) -> list[tuple[str, list[str]]]:
    """``[(label, [names...]), ...]`` in backward order; within a layer, names keep their order."""
    names = list(names)
    keyed: dict[str, tuple[tuple, list[str]]] = {}
    unknown: dict[str, list[str]] = {}
    for n in names:
        k = (key(n) if key else None) or generic_key(n)
        if k is None:
            m = re.match(r"^(.*?\.\d+)\.", n)
            unknown.setdefault(m[1] if m else n.rsplit(".", 1)[0], []).append(n)
        else:
            keyed.setdefault(k[1], (k[0], []))[1].append(n)
    ordered = [(lab, ns) for lab, (_, ns) in sorted(keyed.items(), key=lambda kv: kv[1][0])]
    return ordered + list(reversed(list(unknown.items())))
