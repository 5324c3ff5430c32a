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

from ..errors import BundleError

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


def _few(xs: Sequence[int]) -> str:
    xs = list(xs)
    return str(xs[:8])[:-1] + (f", ... ({len(xs)} in all)]" if len(xs) > 8 else "]")


def text_positions(inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The text position rows (B, T) of a step: 1-D/2-D ``position_ids``, or the first of 4 rows
    (Qwen3-VL's text row in front of its 3 mRoPE rows); 3-row mRoPE positions carry none."""
    pos = inputs.get("position_ids")
    if pos is None:
        return None
    if pos.ndim == 3 and pos.shape[0] == 4:
        return pos[0]
    return pos.reshape(1, -1) if pos.ndim == 1 else (pos if pos.ndim == 2 else None)


def check_boundaries(inputs: dict[str, torch.Tensor], where: str) -> list[int] | None:
    """Validate a step's recorded ``cu_seqlens`` once, where a bundle's inputs are read: 1-D
    integers that start at 0, strictly increase, end at the sequence length N = B x T (a row start
    i x T is always a boundary), and agree with the text positions where those exist: positions
    restart (t where pos[t] != pos[t-1] + 1) exactly at the boundaries, or never within a row
    (Megatron's reset attention mask without reset positions). -> the boundaries, or None for an
    unpacked step. Anything else is a BundleError (exit 4) naming both."""
    cu_t = inputs.get("cu_seqlens")
    if cu_t is None:
        return None
    ids = inputs.get("input_ids", inputs.get("tokens"))
    fix = "the bundle records a packing the step did not run with; capture it again (or fix the boundaries)"
    if cu_t.ndim != 1 or cu_t.is_floating_point() or cu_t.dtype == torch.bool or cu_t.numel() < 2:
        raise BundleError(f"{where}: inputs/cu_seqlens must be a 1-D integer tensor [0, l1, l1+l2, ..., N] "
                          f"(found {cu_t.dtype} of shape {list(cu_t.shape)}); {fix}")  # fmt: skip
    cu = [int(x) for x in cu_t.tolist()]
    rows, T = (
        (1, int(ids.shape[-1]))
        if ids is None or ids.ndim < 2
        else (int(ids.reshape(-1, ids.shape[-1]).shape[0]), int(ids.shape[-1]))
    )
    n = rows * T if ids is not None else cu[-1]
    problems = []
    if cu[0] != 0:
        problems.append(f"starts at {cu[0]}, not 0")
    bad = [i for i in range(1, len(cu)) if cu[i] <= cu[i - 1]]
    if bad:
        problems.append(f"does not increase at index {bad[0]} ({cu[bad[0] - 1]} -> {cu[bad[0]]})")
    if cu[-1] != n:
        problems.append(
            f"ends at {cu[-1]}, not at the sequence length {n} (input_ids {list(ids.shape) if ids is not None else '?'})"
        )
    missing_rows = [i * T for i in range(rows) if i * T not in set(cu)]
    if not problems and missing_rows:
        problems.append(f"has no boundary at the row start(s) {_few(missing_rows)} of the {rows} x {T} batch")
    if problems:
        raise BundleError(f"{where}: inputs/cu_seqlens {_few(cu)} " + "; ".join(problems) + f"; {fix}")
    text = text_positions(inputs)
    if text is not None and text.numel() == n:
        flat = text.reshape(-1).to(torch.int64)
        restarts = {0} | {int(i) + 1 for i in torch.nonzero(flat[1:] != flat[:-1] + 1).reshape(-1)}
        row_starts = {i * T for i in range(rows)}
        if restarts != set(cu[:-1]) and not restarts <= row_starts:
            raise BundleError(
                f"{where}: inputs/cu_seqlens {_few(cu)} disagree with the samples the text positions mark "
                f"(restarts at {_few(sorted(restarts))}, from position_ids); {fix}"
            )
    return cu


def row_boundaries(cu: list[int], rows: int, T: int) -> list[int]:
    """The boundaries within one row of a (rows, T) batch, equal for every row; a BundleError where
    rows are packed differently (the replay's attention takes one layout for all rows)."""
    per_row = {tuple(c - i * T for c in cu if i * T <= c <= (i + 1) * T) for i in range(rows)}
    if len(per_row) != 1:
        raise BundleError(f"inputs/cu_seqlens {_few(cu)} pack the {rows} rows of the batch differently; "
                          "the replay takes one packing for every row: merge one row (one micro-batch) at a time")  # fmt: skip
    return list(per_row.pop())
