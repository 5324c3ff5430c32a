"""The streamed head: its weight read from the capture by vocabulary chunks, its gradient written by them.

The chunked head/loss (oracle/replay/headloss.py) asks for chunk C's rows of the head weight twice
(forward, backward) and hands over grad_weight[C] once it is final. Here the rows are read from the
capture's file alone and upcast to the compute dtype (exact), with the replay's dispatch modes
suspended (a load is not an op of the step: nothing is rounded, counted or drawn); the whole tensor's
sha256 is checked once before the first read. The gradient goes straight to one safetensors shard of
the oracle (oracle/bundle/rows.py), chunk after chunk, and is journalled as the unit ``lm_head``
when the last chunk is written. A resumed run whose head is journalled reads the rows and writes nothing.
Memory: one chunk of rows and one of gradient (CHUNK x H each) instead of the two whole V x H tensors.
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...bundle.rows import RowWriter
from ...bundle.store import Bundle
from ..headloss import RowSource

NAME = "lm_head.weight"


class CaptureHead(RowSource):
    def __init__(self, cap: Bundle, compute: torch.dtype, journal, order: list[str]):
        e = cap.entry("weights", NAME)
        self.cap, self.journal, self.order = cap, journal, order
        self.shape, self.dtype = torch.Size([int(s) for s in e["shape"]]), compute
        cap.verify("weights", NAME)
        self._writer = None
        self._path = None

    def rows(self, v0: int, v1: int) -> torch.Tensor:
        with _disable_current_modes():
            return self.cap.load_rows("weights", NAME, v0, v1).to(self.dtype)  # (c, H), exact upcast

    def grad(self, v0: int, v1: int, g: torch.Tensor) -> None:
        if self.journal.unit_done("lm_head"):
            return
        if self._writer is None:
            self._path = self.journal.new_shard()
            self._writer = RowWriter(self._path.with_suffix(".tmp"), NAME, list(self.shape), g.dtype)
        with _disable_current_modes():
            self._writer.write(g)

    def done(self) -> None:
        self.order.append(NAME)
        if self._writer is None:
            return
        entry = self._writer.close()
        os.replace(self._path.with_suffix(".tmp"), self._path)
        self.journal.commit_file("lm_head", self._path, {NAME: entry})
        self._writer = None
