"""What a recipe provides, and how the engine finds one. See replays/README.md for the contract.

The engine never imports a concrete model: recipes register themselves by name when the
``replays`` package (or a package exposing the ``oracle.replays`` entry point) is imported.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import torch
from torch import nn

from .errors import RecipeError


@dataclass
class ModelSource:
    """A model ready to capture: config, weights (the values to load) and input preparation state."""

    recipe: Recipe
    config: dict[str, Any]
    weights: dict[str, torch.Tensor]
    origin: str
    extra: dict[str, Any] = field(default_factory=dict)


class Recipe:
    """Base class of a model-family recipe; subclasses override every method below."""

    name: str = ""
    #: model names this recipe embeds (``oracle capture --model NAME``), e.g. ``tiny-qwen3-vl``
    embedded: tuple[str, ...] = ()
    #: mcore parameter name templates -> HF names (oracle/megatron/names.py), for Megatron captures
    megatron_names: dict[str, str] = {}

    def accepts(self, hf_config: dict[str, Any]) -> bool:
        """Whether a local Hugging Face directory with this config.json belongs to this recipe."""
        raise NotImplementedError

    def load(self, spec: str) -> ModelSource:
        """An embedded model name or a local directory -> config, weights, input preparation."""
        raise NotImplementedError

    def build(self, config: dict[str, Any]) -> nn.Module:
        """A module of this config in the current default dtype; its weights are loaded after."""
        raise NotImplementedError

    def default_sample(self) -> dict[str, Any]:
        raise NotImplementedError

    def prepare_inputs(self, source: ModelSource, model: nn.Module, sample: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The sample -> every tensor the step uses (model inputs and loss inputs such as labels)."""
        raise NotImplementedError

    def forward_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor], reduction: str) -> tuple[torch.Tensor, int]:
        """Run the forward and the loss; return (loss, number of loss tokens)."""
        raise NotImplementedError

    def loss_from_logits(self, logits: torch.Tensor, inputs: dict[str, torch.Tensor], reduction: str) -> tuple[torch.Tensor, int]:
        """The loss alone, from the head's output (for the local replay of the loss)."""
        raise NotImplementedError

    def boundaries(self) -> dict[str, str]:
        """Named module selections for boundary capture: preset name -> regex over module names."""
        return {}

    def layers(self, names: list[str], config: dict[str, Any]) -> list[tuple[str, list[str]]]:
        """Group parameter names into layers ordered along the backward pass, loss end first."""
        raise NotImplementedError


_RECIPES: dict[str, Recipe] = {}


def register(cls: type[Recipe]) -> type[Recipe]:
    inst = cls()
    _RECIPES[inst.name] = inst
    return cls


def _discover() -> None:
    if _RECIPES:
        return
    try:
        importlib.import_module("replays")
    except ImportError:
        pass
    for ep in entry_points(group="oracle.replays"):
        ep.load()


def get(name: str) -> Recipe:
    _discover()
    if name not in _RECIPES:
        raise RecipeError(f"no recipe named {name!r}; known recipes: {', '.join(sorted(_RECIPES)) or 'none'}")
    return _RECIPES[name]


def for_model(spec: str) -> Recipe:
    """The recipe for ``--model SPEC``: an embedded name, or a local HF directory's config.json."""
    from pathlib import Path

    _discover()
    for r in _RECIPES.values():
        if spec in r.embedded:
            return r
    path = Path(spec)
    if not path.exists():
        known = sorted(n for r in _RECIPES.values() for n in r.embedded)
        raise RecipeError(f"--model {spec!r} is neither an embedded model ({', '.join(known)}) nor an existing directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise RecipeError(f"{path} has no config.json; point --model at a Hugging Face model directory")
    hf_config = load_hf_config(cfg_file)
    for r in _RECIPES.values():
        if r.accepts(hf_config):
            return r
    raise RecipeError(f"no recipe handles model_type {hf_config.get('model_type')!r} ({cfg_file})")


def load_hf_config(path) -> dict[str, Any]:
    """A Hugging Face config.json as a dict, with a clear error when it is missing or not JSON."""
    import json
    from pathlib import Path

    from .errors import InputNotFound

    p = Path(path)
    if not p.is_file():
        raise InputNotFound(f"{p} does not exist")
    try:
        cfg = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RecipeError(f"{p} is not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise RecipeError(f"{p} does not hold a JSON object")
    return cfg


def names() -> list[str]:
    _discover()
    return sorted(_RECIPES)
