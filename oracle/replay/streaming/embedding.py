"""A streamed token embedding holds only the rows the step used; its gradient is written as a sparse file.

A token embedding (``nn.Embedding``: 151936 x 4096 for Qwen3-VL-8B, 4.6 GiB in float64, and a dense
gradient of the same size) is read by the step only at the token ids it sees. Here its unit runs as

    used = sorted unique ids (U of them),  inv = their positions: ids = used[inv]
    W_used = the capture's rows ``used`` (read alone and upcast, exact; the whole tensor's sha256
             checked once first), (U, H)
    out = embedding(inv, W_used)   (= embedding(ids, W): the same rows gathered, bitwise)

and its gradient is grad W_used (U, H): for every used row the sum of its tokens' output gradients,
every other row exactly zero (no token reads it). The oracle stores the full (V, H) gradient, as the
scorer and the bundle format expect, written run by run of used rows, the unused rows left holes in a
sparse file (``write_dense``): the dense gradient never exists in memory and its zeros take no disk. The
sums run over the same tokens as the dense embedding backward; bound stated and tested: within 1e-12
relative (measured: bitwise here). Memory: U x H twice (U <= tokens), instead of V x H twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from ...bundle.rows import RowWriter
from ...bundle.store import Bundle

CHUNK = 4096


def by_rows(module: nn.Module) -> bool:
    """An embedding whose backward is a plain sum per row (no max_norm renormalisation, no scaling
    by frequency, not sparse): what this module streams."""
    return isinstance(module, nn.Embedding) and module.max_norm is None and not module.scale_grad_by_freq and not module.sparse


class UsedRows:
    def __init__(self, cap: Bundle, name: str, compute: torch.dtype, ids: torch.Tensor, padding_idx: int | None):
        self.cap, self.name, self.compute = cap, name, compute
        cap.verify("weights", name)  # rows are read alone, unverified: the whole tensor's sha256 once here
        self.used, self.inv = torch.unique(ids, sorted=True, return_inverse=True)  # (U,), ids.shape
        hit = (self.used == padding_idx).nonzero().reshape(-1) if padding_idx is not None else torch.empty(0)
        self.padding = int(hit[0]) if hit.numel() else None  # the padding row keeps a zero gradient, as nn.Embedding's

    def weight(self, requires_grad: bool) -> torch.Tensor:
        """The used rows, (U, H), upcast exactly; read as runs of consecutive ids."""
        ids = self.used.tolist()
        parts, start = [], 0
        with _disable_current_modes():
            for k in range(1, len(ids) + 1):
                if k == len(ids) or ids[k] != ids[k - 1] + 1:
                    parts.append(self.cap.load_rows("weights", self.name, ids[start], ids[k - 1] + 1).to(self.compute))
                    start = k
            w = torch.cat(parts) if parts else torch.empty(0, dtype=self.compute)
        return w.requires_grad_(requires_grad)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return F.embedding(self.inv, w, self.padding)


def write_dense(path, name: str, shape: list[int], used: torch.Tensor, grad: torch.Tensor) -> dict:
    """The (V, H) gradient with ``grad`` (U, H) at rows ``used`` (sorted, unique) and zeros elsewhere; its
    entry. Each run of consecutive used rows is written, the zero rows between runs are left holes
    (``RowWriter.zeros``): the file reads back as the dense gradient, hashed as it, and the disk holds
    only the used rows (about U x H: 2048 tokens' rows of Qwen3-VL-8B's 151936 take 1 % of its 4.6 GiB)."""
    w = RowWriter(path, name, shape, grad.dtype)
    ids = used.tolist()
    with _disable_current_modes():
        row, start = 0, 0  # the next row of the file; the first used row of the current run
        for k in range(1, len(ids) + 1):
            if k == len(ids) or ids[k] != ids[k - 1] + 1:  # used rows ids[start:k] are consecutive
                w.zeros(ids[start] - row)
                for r0 in range(start, k, CHUNK):
                    w.write(grad[r0 : min(k, r0 + CHUNK)])
                row, start = ids[k - 1] + 1, k
        w.zeros(shape[0] - row)
    return w.close()
