"""Token cross-entropy as SFT trainers compute it.

``labels`` holds -100 where no loss is taken (prompt, image and padding tokens). Position t
predicts label t+1 (the shift transformers and ms-swift's ``torch.roll(labels, -1)`` perform).
The logits are upcast to at least float32 before the softmax (float64 stays float64), as
transformers and Megatron's fused cross-entropy do.

reduction ``sum``: sum over loss tokens (Megatron with ``calculate_per_token_loss``, before
finalize divides by the token count); ``mean``: that sum divided by the number of loss tokens.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..capture.packing import IGNORE


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str) -> tuple[torch.Tensor, int]:
    if reduction not in ("sum", "mean"):
        raise ValueError("reduction must be 'sum' or 'mean'")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    shift_logits = logits[..., :-1, :].reshape(-1, logits.shape[-1])  # (B*(T-1), V)
    shift_labels = labels[..., 1:].reshape(-1)  # (B*(T-1),)
    n_tokens = int((shift_labels != IGNORE).sum())
    loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE, reduction="sum")
    if reduction == "mean":
        loss = loss / max(n_tokens, 1)
    return loss, n_tokens


def masked_token_loss(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, reduction: str
) -> tuple[torch.Tensor, int]:
    """Megatron's convention: ``labels`` already aligned with positions (label t = token t+1, the
    roll done by the data pipeline) and a float ``loss_mask``; loss = sum_t mask_t * CE_t
    (``sum``), or that divided by sum_t mask_t (``mean``)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")  # (B*T,)
    mask = loss_mask.reshape(-1).to(ce.dtype)
    n_tokens = int(loss_mask.sum())
    loss = (ce * mask).sum()
    if reduction == "mean":
        loss = loss / max(n_tokens, 1)
    return loss, n_tokens


# -- the head and the loss together -----------------------------------------------------------
# Recipes compute the loss from the last hidden state through ``lm_head_loss``. On a device (a
# capture) and by default it is ``head(hidden)`` then the loss above: the full (B, T, V) logits,
# exactly what the model's own forward computes. A replay sets ``chunked_head()``: the head and
# the loss are then computed by vocabulary chunks (oracle/replay/headloss.py; the T x V logits never
# exist), from the head's weight as ``prepare(head)`` returns it (the streaming replay
# materialises it there).
_CHUNKED: contextvars.ContextVar = contextvars.ContextVar("oracle_chunked_head", default=None)


@contextlib.contextmanager
def chunked_head(prepare: Callable[[torch.nn.Module], torch.Tensor] = lambda head: head.weight):
    token = _CHUNKED.set(prepare)
    try:
        yield
    finally:
        _CHUNKED.reset(token)


# A token-parallel replay (oracle/replay/token_split.py) holds only its rows of hidden: ``token_rows(fn)``
# hands the loss to ``fn(hidden, weight, labels, reduction, loss_mask)`` (labels and mask whole).
_ROWS: contextvars.ContextVar = contextvars.ContextVar("oracle_token_rows", default=None)


@contextlib.contextmanager
def token_rows(fn: Callable):
    token = _ROWS.set(fn)
    try:
        yield
    finally:
        _ROWS.reset(token)


def lm_head_loss(
    head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, reduction: str, loss_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, int]:
    """The loss of ``head(hidden)``: ``causal_lm_loss`` (labels unshifted), or with ``loss_mask``
    Megatron's ``masked_token_loss`` (labels aligned with positions)."""
    prepare = _CHUNKED.get()
    if prepare is None:
        logits = head(hidden)  # (B, T, V)
        if loss_mask is not None:
            return masked_token_loss(logits, labels, loss_mask, reduction)
        return causal_lm_loss(logits, labels, reduction)
    from .headloss import causal_lm_head_loss, masked_token_head_loss

    if getattr(head, "bias", None) is not None:
        raise ValueError("the chunked head takes a bias-free linear head")  # every recipe's head is bias-free
    weight = prepare(head)
    if (rows := _ROWS.get()) is not None:
        return rows(hidden, weight, labels, reduction, loss_mask)
    if loss_mask is not None:
        return masked_token_head_loss(hidden, weight, labels, loss_mask, reduction)
    return causal_lm_head_loss(hidden, weight, labels, reduction)
