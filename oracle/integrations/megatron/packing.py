"""Packed sequences: the per-sample boundaries of a packed batch, as the replay takes them.

Megatron packs several samples into one row. A rank records the boundaries one of three ways,
read in this order:
  1. ``cu_seqlens`` (``PackedSeqParams.cu_seqlens_q``, THD layout; ``cu_seqlens_padded`` when each
     sample was padded): attention stays inside each sample and the rotary positions restart at 0
     at each sample start (mcore's THD rotary uses cu_seqlens), so ``position_ids`` restart too;
  2. an ``attention_mask`` (B, 1, T, T), True = masked, reset per sample (``reset_attention_mask``):
     a sample starts at t when t cannot see t - 1;
  3. ``position_ids`` that restart per sample (``reset_position_ids``).
In 2 and 3 the recorded position ids are kept as they are. Note that megatron-core 0.12.1's own
rotary embedding ignores ``position_ids`` outside THD (it rotates by 0..T-1); a run whose rotary
positions did restart there (MindSpeed's reset_position_ids patch) recorded that in its ids.
The merged capture's inputs then hold

    cu_seqlens    int64 [0, l1, l1+l2, ..., N]   N = B*T, the batch's tokens flattened row after row
                                                (a row start is always a boundary)
    position_ids  int64 (B, T); with mRoPE's (3, B, T) rows (Qwen3-VL) (4, B, T): the restarting
                  text row (what marks the samples) in front of the three rows as recorded

A batch with none of these holds one sample per row and gets no ``cu_seqlens`` (plain causal mask).
"""

from __future__ import annotations

import torch

from ...errors import BundleError


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


def _boundaries_from_mask(mask: torch.Tensor) -> torch.Tensor | None:
    """Sample starts of a per-sample attention mask (B, 1, T, T), True = masked; None if it is one causal mask."""
    b, t = mask.shape[0], mask.shape[-1]
    sub = mask[:, 0].diagonal(offset=-1, dim1=-2, dim2=-1)  # (B, T-1): is t masked from t - 1
    starts = sorted({i * t for i in range(b)} | {int(r) * t + int(c) + 1 for r, c in torch.nonzero(sub)})
    return torch.tensor(starts + [b * t], dtype=torch.int64) if len(starts) > b else None


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
        if pos is not None and pos.dim() == 3 and pos.shape[0] == 3:  # mRoPE (3, B, T): the text row first, as transformers reads 4 rows
            out["position_ids"] = torch.cat([derived.unsqueeze(0), pos.to(torch.int64)])  # (4, B, T)
        else:
            out["position_ids"] = derived
        out.pop("cu_seqlens_padded", None)
        return out, f"packed: {out['cu_seqlens'].numel() - 1} samples from the recorded cu_seqlens; positions restart per sample"
    mask = inputs.get("attention_mask")
    if mask is not None and mask.dim() == 4 and tuple(mask.shape[-2:]) == (shape[1], shape[1]) and mask.dtype == torch.bool:
        cu = _boundaries_from_mask(mask.expand(shape[0], *mask.shape[1:]))
        if cu is not None:
            out["cu_seqlens"] = cu
            return out, f"packed: {cu.numel() - 1} samples from the attention mask reset per sample; position ids as recorded"
    if pos is not None and pos.dim() == 2 and tuple(pos.shape) == shape:
        cu = _boundaries_from_positions(pos.to(torch.int64))
        if cu.numel() - 1 > shape[0]:
            out["cu_seqlens"] = cu
            out["position_ids"] = pos.to(torch.int64)
            return out, f"packed: {cu.numel() - 1} samples from position ids that restart per sample"
    return inputs, None
