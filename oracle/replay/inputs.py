"""The inputs boundary: a capture's inputs checked once, where a replay first reads them, before any
replay path runs (in memory, streamed, token-parallel, local). A replay cannot use ids outside the
embedding, float ids, positions of another length, or images that disagree with their tokens: each
would stop deep inside the model (an index error, a shape error) after the model is built. Here
every offender is collected and the capture refused as a BundleError (exit 4), one line per tensor
with its fix.

Generic checks (any recipe): the token ids (``input_ids`` or Megatron's ``tokens``) are integers of
shape (B, T) with 0 <= id < the embedding's rows (``Recipe.vocab_size``); ``labels`` and
``loss_mask`` have the ids' shape, labels are integers in [0, vocab) or -100 (ignored) where the
loss mask, if any, takes them, and at least one token carries a loss (all -100: no gradient to
replay); ``position_ids`` are non-negative integers with one position per token: (B, T), or (k, B, T)
for multimodal rotary sections. Then the recipe's own (``Recipe.check_inputs``: image
tokens against vision features, grid against pixels). Only small tensors are loaded (ids, labels,
positions, masks, grids); pixel values are checked by their recorded shape.
"""

from __future__ import annotations

import torch

from ..bundle.store import Bundle
from ..errors import BundleError, problem_lines
from .setup import recipe_of

IDS = ("input_ids", "tokens")
IGNORE = -100
_INT = {"int8", "int16", "int32", "int64", "uint8"}
FIX = "the capture's inputs are not what this model receives; capture the step again (the batch exactly as the model got it)"


def _where(mask: torch.Tensor) -> str:
    """The first offending (row, token) of a (B, T) mask, and how many there are."""
    idx = mask.nonzero()
    return f"{len(idx)} of them, first at row {int(idx[0][0])} token {int(idx[0][-1])}"


def check_inputs(cap: Bundle) -> None:
    """Raise BundleError (exit 4) listing every input a replay of ``cap`` cannot use; see the module docstring."""
    entries = cap.manifest["tensors"].get("inputs", {})
    if not entries:
        return
    recipe = recipe_of(cap)
    config = (cap.get("recipe") or {}).get("config") or {}
    shapes = {n: tuple(e["shape"]) for n, e in entries.items()}
    dtypes = {n: e["dtype"] for n, e in entries.items()}
    problems: list[str] = []
    ids_name = next((n for n in IDS if n in entries), None)
    vocab = recipe.vocab_size(config)
    if ids_name is not None:
        problems += _check_ids(cap, ids_name, shapes, dtypes, vocab)
    if not problems:
        problems += recipe.check_inputs(config, shapes, lambda n: cap.load("inputs", n))
    if problems:
        raise BundleError(f"{cap.path}: {len(problems)} input(s) a replay cannot use:{problem_lines(problems, 8)}\n"
                          f"{FIX}")  # fmt: skip


def _check_ids(cap: Bundle, ids_name: str, shapes: dict, dtypes: dict, vocab: int | None) -> list[str]:
    problems: list[str] = []
    shape = shapes[ids_name]
    if dtypes[ids_name] not in _INT:
        return [f"inputs/{ids_name} is {dtypes[ids_name]}: token ids are integers (int64), the rows of the embedding "
                "they pick; record the ids, not their embeddings or a float copy"]  # fmt: skip
    if len(shape) != 2:
        return [f"inputs/{ids_name} has shape {list(shape)}: token ids are (batch, tokens)"]
    B, T = shape
    ids = cap.load("inputs", ids_name)
    bad = (ids < 0) | (ids >= vocab) if vocab is not None else ids < 0
    if bool(bad.any()):
        rows = f"the embedding's {vocab} rows (0 <= id < {vocab})" if vocab is not None else "0 <= id"
        problems.append(f"inputs/{ids_name} holds ids from {int(ids.min())} to {int(ids.max())}, outside {rows}: "
                        f"{_where(bad)}; the ids come from another tokenizer or model than the recipe config's")  # fmt: skip
    mask = None
    if "loss_mask" in shapes:
        if shapes["loss_mask"] != (B, T):
            problems.append(f"inputs/loss_mask has shape {list(shapes['loss_mask'])}, inputs/{ids_name} {[B, T]}: one "
                            "mask value per token")  # fmt: skip
        else:
            mask = cap.load("inputs", "loss_mask") != 0
    if "labels" in shapes:
        if dtypes["labels"] not in _INT:
            problems.append(f"inputs/labels is {dtypes['labels']}: labels are integer token ids (int64), -100 where no loss is taken")
        elif shapes["labels"] != (B, T):
            problems.append(f"inputs/labels has shape {list(shapes['labels'])}, inputs/{ids_name} {[B, T]}: one label per token")
        else:
            labels = cap.load("inputs", "labels")
            out = ((labels < 0) & (labels != IGNORE)) | ((labels >= vocab) if vocab is not None else False)
            if mask is not None:
                out = out & mask
            if bool(out.any()):
                problems.append(f"inputs/labels holds labels outside [0, {vocab}) that are not {IGNORE} (ignored): "
                                f"{_where(out)}; labels are token ids of this model's vocabulary")  # fmt: skip
            taken = (labels != IGNORE) if mask is None else (labels != IGNORE) & mask
            if not bool(taken.any()):
                problems.append(f"inputs/labels: no token carries a loss (every label is {IGNORE}"
                                f"{' or masked by inputs/loss_mask' if mask is not None else ''}): the step has no "
                                "gradient to replay; the labels were lost or are another batch's")  # fmt: skip
    if "position_ids" in shapes:
        ps = shapes["position_ids"]
        ok = (len(ps) == 2 and ps == (B, T)) or (len(ps) == 3 and ps[1:] == (B, T)) or (len(ps) == 2 and ps == (1, T))
        if dtypes["position_ids"] not in _INT:
            problems.append(f"inputs/position_ids is {dtypes['position_ids']}: positions are integers (int64)")
        elif not ok:
            problems.append(f"inputs/position_ids has shape {list(ps)} but inputs/{ids_name} is {[B, T]}: one position per "
                            f"token, (B, T) = {[B, T]} or (sections, B, T) = [3, {B}, {T}] for multimodal rotary positions")  # fmt: skip
        elif bool((pos := cap.load("inputs", "position_ids") < 0).any()):
            problems.append(f"inputs/position_ids holds negative positions ({int(pos.sum())} of them): positions count "
                            "from 0 within each sample")  # fmt: skip
    return problems
