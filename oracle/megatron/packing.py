"""Packed sequences: the per-sample boundaries of a packed batch, as the replay takes them.

Megatron packs several samples into one row (THD layout): attention stays inside each sample and
rotary positions restart at 0 at each sample start. A rank records either the packed-sequence
parameters (``cu_seqlens``, from ``PackedSeqParams.cu_seqlens_q``; ``cu_seqlens_padded`` when
each sample was padded) or position ids that restart per sample (``reset_position_ids``). Both
become, in the merged capture's inputs:

    cu_seqlens    int64 [0, l1, l1+l2, ..., N]   N = B*T, the batch's tokens flattened row after row
                                                (a row start is always a boundary)
    position_ids  int64 (B, T)                   t - (start of the sample holding t)

A batch with neither holds one sample per row and gets neither (the plain causal mask).
"""

from __future__ import annotations

import torch

from ..errors import BundleError


def _positions(cu: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    n = shape[0] * shape[1]
    lengths = (cu[1:] - cu[:-1]).tolist()
    pos = torch.cat([torch.arange(k, dtype=torch.int64) for k in lengths]) if lengths else torch.zeros(0, dtype=torch.int64)
    if pos.numel() != n:
        raise BundleError(f"cu_seqlens ends at {int(cu[-1])} but the batch holds {n} tokens ({shape[0]} x {shape[1]})")
    return pos.reshape(shape)  # (B, T)


def _boundaries_from_positions(pos: torch.Tensor) -> torch.Tensor:
    flat = pos.reshape(-1)
    b, t = pos.shape
    starts = {i * t for i in range(b)} | {int(i) for i in torch.nonzero(flat[1:] <= flat[:-1]).reshape(-1) + 1}
    return torch.tensor(sorted(starts) + [flat.numel()], dtype=torch.int64)


def packed_inputs(inputs: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str | None]:
    """-> (the inputs with ``cu_seqlens`` and restarting ``position_ids`` set, or unchanged; a note)."""
    tokens = inputs.get("tokens", inputs.get("input_ids"))
    if tokens is None or tokens.dim() != 2:
        return inputs, None
    shape = (int(tokens.shape[0]), int(tokens.shape[1]))
    out = dict(inputs)
    cu = inputs.get("cu_seqlens_padded", inputs.get("cu_seqlens"))
    pos = inputs.get("position_ids")
    if cu is not None:
        cu = cu.reshape(-1).to(torch.int64)
        if cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
            raise BundleError(f"cu_seqlens {cu.tolist()[:8]} is not [0, l1, l1+l2, ...] (non-decreasing from 0)")
        derived = _positions(cu, shape)
        if pos is not None and pos.shape == derived.shape and not torch.equal(pos.to(torch.int64), derived):
            plain = torch.arange(shape[1]).expand(shape)
            if not torch.equal(pos.to(torch.int64), plain):
                raise BundleError("position_ids restart elsewhere than cu_seqlens says; the rank recorded two different packings")
        out["cu_seqlens"] = torch.tensor(sorted({*cu.tolist(), *(i * shape[1] for i in range(shape[0]))}), dtype=torch.int64)
        out["position_ids"] = derived
        out.pop("cu_seqlens_padded", None)
        return out, f"packed: {out['cu_seqlens'].numel() - 1} samples from the recorded cu_seqlens; positions restart per sample"
    if pos is not None and pos.dim() == 2 and tuple(pos.shape) == shape:
        cu = _boundaries_from_positions(pos.to(torch.int64))
        if cu.numel() - 1 > shape[0]:
            out["cu_seqlens"] = cu
            out["position_ids"] = pos.to(torch.int64)
            return out, f"packed: {cu.numel() - 1} samples from position ids that restart per sample"
    return inputs, None
