"""A bundle's parameter shapes checked against what the recipe builds, before anything is allocated.

The recipe builds its module on the ``meta`` device (shapes and dtypes, no storage), so a config that
would describe a 22 GB model costs milliseconds to refuse; only when every stored weight has the
shape the recipe expects is the real module built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import BundleError, OracleError, RecipeError, problem_lines
from ..recipe import Recipe


def entry_numel(e: Mapping[str, Any]) -> int:
    """Elements of a manifest tensor entry (its ``shape``), no tensor read."""
    n = 1
    for d in e["shape"]:
        n *= int(d)
    return n


def itemsize(dtype: str) -> int:
    """Bytes per element of a manifest dtype name (``float32``, ``bfloat16``, ``int64``, ...)."""
    return getattr(torch, dtype).itemsize


def entry_nbytes(e: Mapping[str, Any]) -> int:
    """Stored bytes of a manifest tensor entry, from its shape and dtype."""
    return entry_numel(e) * itemsize(e["dtype"])


def stored_shapes(bundle) -> tuple[dict[str, list[int]], str]:
    """A bundle's weight shapes from its manifest (no tensor read), for ``build_model(shapes=...)``."""
    return {n: e["shape"] for n, e in bundle.manifest["tensors"].get("weights", {}).items()}, str(bundle.path)


def meta_model(recipe: Recipe, config: Mapping[str, Any]) -> torch.nn.Module:
    """``recipe.build(config)`` on the meta device (its structure and shapes, no weights); RecipeError for a config
    it cannot build."""
    # torch 2.8 cannot import torch._dynamo for the first time under a device context (its import runs ops through
    # the context's __torch_function__, which reaches torch._dynamo.disable before the module has it: "partially
    # initialized module"); transformers' model modules import it, so a fresh process built nothing. Import it first.
    import torch._dynamo  # noqa: F401

    try:
        with torch.device("meta"):
            return recipe.build(dict(config))
    except Exception as e:  # the config is user data: transformers raises many types for bad ones
        raise RecipeError(f"recipe {recipe.name!r} cannot build a model from this config ({type(e).__name__}: {e})") from None


def expected_shapes(recipe: Recipe, config: Mapping[str, Any]) -> dict[str, list[int]]:
    """Parameter name -> shape of ``recipe.build(config)``, built on the meta device."""
    return {n: list(p.shape) for n, p in meta_model(recipe, config).named_parameters()}


def check_shapes(recipe: Recipe, config: Mapping[str, Any], stored: Mapping[str, Sequence[int]], where: str, *,
                 error: type[OracleError] = BundleError, fix: str = "the bundle is damaged or its config was edited") -> None:  # fmt: skip
    """Raise ``error`` listing every weight whose stored shape (or presence) differs from the recipe's."""
    expect = expected_shapes(recipe, config)
    problems = [f"{n}: stored {list(stored[n])}, the recipe's model has {s}" for n, s in expect.items()
                if n in stored and list(stored[n]) != s]  # fmt: skip
    problems += [f"{n}: missing (the recipe's model has it, shape {s})" for n, s in expect.items() if n not in stored]
    problems += [f"{n}: stored, but the recipe's model has no such parameter" for n in stored if n not in expect]
    if problems:
        raise error(
            f"{where}: the weights do not fit the model its config describes ({len(problems)} problem(s)); "
            f"{fix}:" + problem_lines(problems, 20)
        )
