"""A step of several micro-batches: written apart by the rank, merged into one batch for the replay.

With gradient accumulation a training call runs M micro-batches, each its own forward and
backward, and ``main_grad`` holds the sum of their gradients (DDP's buffer, or the fused
``wgrad_gemm_accum_fp32`` / MindSpeed's ``npu_matmul_add_fp32``: the accumulation a device may get
wrong). A rank capture stores micro-batch i's inputs as ``mb{i}.NAME`` and, per micro-batch, its
loss tokens (``megatron.microbatches``).

The step's ground truth is one forward and backward of all micro-batches side by side, exact when
the micro-batches are independent samples (they are: attention never crosses a micro-batch):

  packed (every micro-batch one row with ``cu_seqlens``, ms-swift's padding-free packing):
      the rows are concatenated along the tokens, each micro-batch's ``cu_seqlens`` (and
      ``cu_seqlens_padded``, transformers' ``cu_seq_lens_q/k``) shifted by the tokens before it, so
      every sample stays a sample (``max_length_q/k``: the largest);
      mRoPE rows (3, 1, T) concatenate along T, ``pixel_values`` / ``image_grid_thw`` along their
      first dimension in micro-batch order (the images of the packed row, in order; a text-only
      micro-batch holds none);
  unpacked (no ``cu_seqlens``): micro-batches of one shape (B, T) are stacked along the batch
      dimension, as DP ranks are (merge.py); other shapes are refused.

Loss: with ``calculate_per_token_loss`` the backward of each micro-batch differentiates its
token-loss SUM and the sums add up: the gradient of the concatenated batch's sum, exactly.
Without it Megatron differentiates mean_i / M for each micro-batch (schedules.forward_step divides
by the micro-batch's tokens and by M): that is the mean over the concatenated batch only when
every micro-batch has as many loss tokens, which ``check_loss`` requires (refused otherwise,
naming the counts and the fix).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...errors import BundleError

_MB = re.compile(r"mb(\d+)\.(.+)")
_CU = ("cu_seqlens", "cu_seqlens_padded", "cu_seq_lens_q", "cu_seq_lens_k")  # mcore's and transformers' boundaries


def names(batches: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The micro-batches' values under the names a rank capture stores: ``mb{i}.NAME``."""
    return {f"mb{i}.{k}": v for i, b in enumerate(batches) for k, v in b.items()}


def split(inputs: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """A rank capture's inputs -> one dict per micro-batch (a single batch: ``[inputs]``)."""
    found = {n: _MB.fullmatch(n) for n in inputs}
    if not any(found.values()):
        return [dict(inputs)]
    stray = sorted(n for n, m in found.items() if m is None)
    if stray:
        raise BundleError(f"inputs/{stray[0]}: the batch mixes micro-batch inputs (mb0.NAME, mb1.NAME, ...) with "
                          "names of none; write every input of a multi-micro-batch step per micro-batch")  # fmt: skip
    per: dict[int, dict[str, torch.Tensor]] = {}
    for n, m in found.items():
        per.setdefault(int(m[1]), {})[m[2]] = inputs[n]
    if sorted(per) != list(range(len(per))):
        raise BundleError(f"inputs: micro-batches {sorted(per)} recorded; expected mb0 .. mb{len(per) - 1}")
    return [per[i] for i in range(len(per))]


def _tokens(b: Mapping[str, torch.Tensor], i: int) -> torch.Tensor:
    t = b.get("tokens", b.get("input_ids"))
    if t is None or t.dim() != 2:
        raise BundleError(f"inputs/mb{i}.input_ids: micro-batch {i} holds no (B, T) token ids; a multi-micro-batch "
                          "step is merged from its tokens' layout")  # fmt: skip
    return t


def combine(batches: list[dict[str, torch.Tensor]], where: str = "inputs") -> dict[str, torch.Tensor]:
    """One batch of the step from its micro-batches (module docstring); one micro-batch as it is."""
    if len(batches) == 1:
        return batches[0]
    tokens = [_tokens(b, i) for i, b in enumerate(batches)]
    packed = [any(k in b for k in _CU) for b in batches]
    if all(packed):
        return _packed(batches, tokens, where)
    if any(packed):
        raise BundleError(f"{where}: micro-batch {packed.index(False)} is not packed (no cu_seqlens) and micro-batch "
                          f"{packed.index(True)} is; a step's micro-batches come from one collator")  # fmt: skip
    keys = set(batches[0])
    for i, b in enumerate(batches[1:], 1):
        if set(b) != keys:
            odd = sorted(keys ^ set(b))[0]
            raise BundleError(f"{where}: micro-batches 0 and {i} recorded different inputs ({odd!r} in one only); "
                              "a step's micro-batches come from one collator")  # fmt: skip
    shapes = {tuple(t.shape) for t in tokens}
    if len(shapes) > 1:
        raise BundleError(f"{where}: unpacked micro-batches of shapes {sorted(shapes)} do not stack into one batch; "
                          "capture with one micro-batch (global batch = micro batch x DP) or with packing")  # fmt: skip
    B, T = shapes.pop()
    out = {}
    for k in keys:
        ts = [b[k] for b in batches]
        dim = _batch_dim(ts[0], B, T)
        if dim is None:
            if all(torch.equal(ts[0], t) for t in ts[1:]):
                out[k] = ts[0]  # one value for the step (a scalar setting)
                continue
            raise BundleError(f"{where}: mb*.{k} {tuple(ts[0].shape)} has no batch dimension of size {B} next to the "
                              f"tokens' {T} and differs between micro-batches; it cannot be stacked")  # fmt: skip
        out[k] = torch.cat(ts, dim)  # (M*B, ...) along the batch dimension
    return out


def _batch_dim(t: torch.Tensor, B: int, T: int) -> int | None:
    """Where a token-aligned tensor holds its batch: (B, T) / (B, T, ...) -> 0, mRoPE (3, B, T) -> 1,
    a mask (B, 1, T, T) -> 0; None for anything else."""
    if t.dim() >= 2 and t.shape[0] == B and t.shape[1] == T:
        return 0
    if t.dim() == 3 and t.shape[1] == B and t.shape[2] == T:
        return 1
    if t.dim() == 4 and t.shape[0] == B and tuple(t.shape[-2:]) == (T, T):
        return 0
    return None


def _packed(batches: list[dict[str, torch.Tensor]], tokens: list[torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    rows = {int(t.shape[0]) for t in tokens}
    if rows != {1}:
        raise BundleError(f"{where}: packed micro-batches hold {sorted(rows)} rows; packing makes one row per micro-batch")
    lengths = [int(t.shape[1]) for t in tokens]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    out = {}
    for k in dict.fromkeys(k for b in batches for k in b):  # every name, in first-seen order
        ts = [b[k] for b in batches if k in b]
        if len(ts) < len(batches):  # a text-only micro-batch has no pixel_values: per-image inputs of the others
            if k in _CU or any(t.dim() >= 2 and t.shape[-1] == n for b, n in zip(batches, lengths) if (t := b.get(k)) is not None):
                raise BundleError(f"{where}: mb*.{k} is token-aligned but micro-batch "
                                  f"{next(i for i, b in enumerate(batches) if k not in b)} has none")  # fmt: skip
            out[k] = torch.cat(ts, 0)  # per image, in micro-batch order (the order of their image tokens)
            continue
        if k in _CU:
            cus = [t.reshape(-1).to(torch.int64) for t in ts]
            for i, (cu, n) in enumerate(zip(cus, lengths)):
                if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) > n:  # unpadded cu_seqlens may end before T
                    raise BundleError(f"{where}: mb{i}.{k} {cu.tolist()[:8]} does not run from 0 within the "
                                      f"micro-batch's {n} tokens")  # fmt: skip
            out[k] = torch.cat([cus[0]] + [cu[1:] + s for cu, s in zip(cus[1:], starts[1:])])  # [0, ..., sum of T_i]
        elif all(t.dim() >= 1 and t.shape[-1] == n for t, n in zip(ts, lengths)) and all(t.dim() >= 2 for t in ts):
            out[k] = torch.cat(ts, -1)  # token-aligned (1, T_i) / mRoPE (3, 1, T_i): along the tokens
        elif all(t.dim() >= 1 for t in ts) and len({tuple(t.shape[1:]) for t in ts}) == 1:
            out[k] = torch.cat(ts, 0)  # per image / patch (pixel_values, image_grid_thw): in micro-batch order
        elif all(torch.equal(ts[0], t) for t in ts[1:]):
            out[k] = ts[0]
        elif k.startswith("max_length") and all(t.dim() == 0 for t in ts):
            out[k] = torch.stack(ts).max()  # transformers' longest sample: of the whole row
        else:
            raise BundleError(f"{where}: mb*.{k} of shapes {[tuple(t.shape) for t in ts]} is neither token-aligned nor "
                              "per image; it cannot be concatenated")  # fmt: skip
    return out


def check_loss(meta: Mapping[str, Any], where: str) -> None:
    """Without per-token loss, micro-batches of unequal loss tokens are no mean over the step (module docstring)."""
    counts = [m.get("num_tokens") for m in meta.get("microbatches") or []]
    if len(counts) < 2 or meta.get("calculate_per_token_loss"):
        return
    fix = ("this capture cannot be replayed as one batch: capture the step again with per-token loss "
           "(Megatron-LM --calculate-per-token-loss, ms-swift's default), with one micro-batch per call (global batch "
           "= micro batch x DP), or with micro-batches of equal loss-token counts")  # fmt: skip
    if None in counts:
        raise BundleError(f"{where}: {len(counts)} micro-batches without calculate_per_token_loss and no loss-token "
                          f"counts recorded, so whether their mean of means is the step's mean cannot be checked; {fix}")  # fmt: skip
    if len(set(counts)) > 1:
        raise BundleError(f"{where}: without calculate_per_token_loss Megatron differentiates the mean of each "
                          f"micro-batch's own mean, over micro-batches of {counts} loss tokens: unequal counts make that "
                          f"another loss than the mean over the step's tokens; {fix}")  # fmt: skip
