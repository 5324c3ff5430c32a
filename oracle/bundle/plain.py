"""Tensors hashed and written as they are stored, whatever mode is active.

A bundle's ``value_sha256`` is of the values upcast to float64 (store.py). Inside an emulated replay's
``PrecisionMode`` (a band member computing in float32) an upcast to float64 is a cast "below" nothing
the mode keeps: the mode turned ``.to(float64)`` into float32 and rounded the copy, so a streamed
member's journal recorded the hash of other bytes than the same gradient's hash outside the mode (and
spent a rounding pass per hash). Hashing and writing run with every mode set aside (torch's own
switches: the bundle package imports nothing of oracle's replay or precision)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes


@contextlib.contextmanager
def plain() -> Iterator[None]:
    """A block where torch ops see no dispatch or function mode (and build no autograd graph)."""
    with torch._C.DisableTorchFunction(), _disable_current_modes(), torch.no_grad():
        yield
