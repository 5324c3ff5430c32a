"""Module-boundary activations of a streaming replay, kept in memory up to a budget, spilled past it.

The forward stores each unit's inputs (``put``); the backward takes them back in reverse order
(``take``). A tensor handed to several units (rotary cos/sin go to every decoder layer, the same
hidden state to a block and to a deepstack merger) is stored once: entries hold references to
blobs keyed by the tensor's identity. Past ``budget`` bytes the *oldest* blobs go to disk first
(the backward needs the newest first), one safetensors file each, written with its bytes and read
back bitwise, in its layout (a dense tensor's strides); nothing is pickled. Files are removed as soon
as their blob is no longer referenced.
A spilled blob is still matched while the tensor it came from is alive (a weak reference): the rotary
tables every decoder layer receives are written once, not once per layer. ``written`` counts the
bytes of the files written (what ``--dry-run`` estimates as spilled activations).
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...bundle.atomic_file import fresh
from ...precision.mode import as_stored


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dense_strides(t: torch.Tensor) -> tuple[int, ...] | None:
    """The strides of a non-contiguous tensor whose elements fill its storage span exactly once (a
    permutation of a contiguous one: a transpose), which ``empty_strided`` can lay out again; None for
    a contiguous tensor, or one that overlaps itself or leaves gaps (an expanded view: stored contiguous)."""
    if t.is_contiguous() or t.numel() == 0:
        return None
    expect = 1
    for d in sorted(range(t.dim()), key=lambda d: (t.stride(d), t.shape[d])):
        if t.shape[d] != 1 and t.stride(d) != expect:
            return None
        expect *= t.shape[d]
    return tuple(t.stride())


class ActivationStore:
    def __init__(self, budget: int | None, directory: str | Path):
        self.budget = budget  # None: never spill
        self.dir = Path(directory)
        self._blobs: OrderedDict[int, dict] = OrderedDict()  # key -> {tensor|file, refs, nbytes}; insertion = age
        self._key_of: dict[tuple, int] = {}
        self._entries: dict[int, list[int]] = {}
        self._next = 0
        self.in_memory = 0
        self.peak_in_memory = 0
        self.spilled_bytes = 0
        self.written = 0

    @staticmethod
    def _identity(t: torch.Tensor) -> tuple:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)

    def put(self, tensors: list[torch.Tensor]) -> int:
        keys = []
        for t in tensors:
            ident = self._identity(t)
            key = self._key_of.get(ident)
            blob = self._blobs.get(key) if key is not None else None
            if blob is not None and "tensor" not in blob and blob["weak"]() is None:
                blob = None  # spilled, and its tensor is gone: the identity may be another tensor's now
            if blob is None:
                key = self._next
                self._next += 1
                self._key_of[ident] = key
                self._blobs[key] = {"tensor": t.detach(), "refs": 0, "nbytes": nbytes(t), "ident": ident, "weak": weakref.ref(t)}
                self.in_memory += nbytes(t)
            self._blobs[key]["refs"] += 1
            keys.append(key)
        handle = self._next
        self._next += 1
        self._entries[handle] = keys
        self.peak_in_memory = max(self.peak_in_memory, self.in_memory)
        self._spill()
        return handle

    def _spill(self) -> None:
        if self.budget is None:
            return
        for key, blob in self._blobs.items():  # oldest first
            if self.in_memory <= self.budget:
                break
            if "tensor" not in blob:
                continue
            self.dir.mkdir(parents=True, exist_ok=True)
            path = fresh(self.dir / f"act-{key}.safetensors")
            t = blob.pop("tensor")
            # the layout comes back too (a dense non-contiguous tensor: its strides), so that what a unit's
            # recomputation makes of it is what it makes of the tensor kept in memory
            blob["strides"] = _dense_strides(t)
            with as_stored():
                save_file({"t": t.contiguous()}, str(path))
            blob["file"] = path
            self.in_memory -= blob["nbytes"]
            self.spilled_bytes += blob["nbytes"]
            self.written += path.stat().st_size

    def take(self, handle: int) -> list[torch.Tensor]:
        out = []
        for key in self._entries.pop(handle):
            blob = self._blobs[key]
            t = blob.get("tensor")
            if t is None:
                with as_stored():
                    t = load_file(str(blob["file"]))["t"]
                    if blob["strides"] is not None:
                        t = torch.empty_strided(t.shape, blob["strides"], dtype=t.dtype).copy_(t)
            out.append(t)
            blob["refs"] -= 1
            if blob["refs"] == 0:
                self._blobs.pop(key)
                if self._key_of.get(blob["ident"]) == key:
                    self._key_of.pop(blob["ident"])
                if "tensor" in blob:
                    self.in_memory -= blob["nbytes"]
                else:
                    os.unlink(blob["file"])
        return out
