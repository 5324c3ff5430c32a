"""Packed sequences: several samples in one sequence, attention and positions restarting per sample.

A packed step carries ``cu_seqlens`` = [0, l1, l1+l2, ..., T] (int64) among its inputs: it is part
of the step's fingerprint, so a packed capture is never scored against an oracle replayed without
its boundaries. The boundaries reach attention through the text positions, which restart at every
sample: transformers' mask functions detect packing from them (``find_packed_sequence_indices``:
a new sample wherever position[t] - position[t-1] != 1), and so does the replay's chunked attention
(oracle/replay/attention.py), so no mask of T x T is built on either side.

``pack(parts, ...)`` concatenates per-sample inputs along the sequence; recipes provide how
positions restart (text: 0..l-1 per sample; Qwen3-VL: a fourth, text row in front of the 3 mRoPE
rows, as transformers' Qwen3-VL reads ``position_ids`` of 4 rows). The first label of every sample
after the first is ignored: it would be the target of the previous sample's last token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

IGNORE = -100  # the label of a position with no loss (PyTorch's cross_entropy ignore_index)


def cu_seqlens(lengths: Sequence[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int64)


def lengths_from_positions(text_positions: torch.Tensor) -> list[int] | None:
    """Sample lengths where the text positions restart (None: one sample, not packed)."""
    pos = text_positions.reshape(-1)
    starts = (torch.nonzero(pos[1:] - pos[:-1] != 1).reshape(-1) + 1).tolist()
    if not starts:
        return None
    edges = [0, *starts, pos.numel()]
    return [b - a for a, b in zip(edges, edges[1:])]


def pack(
    parts: list[dict[str, torch.Tensor]], *, seq_keys: Sequence[str], row_keys: Sequence[str] = ()
) -> dict[str, torch.Tensor]:
    """Concatenate samples: ``seq_keys`` along their last dimension (ids, labels, positions: the
    recipe has made positions restart), ``row_keys`` along the first (pixel rows, image grids)."""
    out: dict[str, torch.Tensor] = {}
    for k in seq_keys:
        if k in parts[0]:
            ts = [p[k] for p in parts]
            if k == "labels":
                ts = [t if i == 0 else torch.cat([torch.full_like(t[..., :1], IGNORE), t[..., 1:]], -1) for i, t in enumerate(ts)]
            out[k] = torch.cat(ts, dim=-1).contiguous()
    for k in row_keys:
        present = [p[k] for p in parts if k in p]
        if present:
            out[k] = torch.cat(present, dim=0).contiguous()
    out["cu_seqlens"] = cu_seqlens([p["input_ids"].shape[-1] for p in parts])
    return out
