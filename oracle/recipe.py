"""What a recipe provides, and how the engine finds one. See replays/README.md for the contract.

The engine never imports a concrete model: recipes are found through the ``oracle.replays``
entry-point group, the built-in ones (``replays/``) declared in pyproject.toml like any plugin.
"""

from __future__ import annotations

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
    #: mcore parameter name templates -> HF names (oracle/integrations/megatron/names.py), for Megatron captures
    megatron_names: dict[str, str] = {}
    #: mcore module name templates -> HF module names (``{i}``: the global layer index), for the
    #: module boundaries of Megatron captures (oracle/integrations/megatron/boundaries.py)
    megatron_modules: dict[str, str] = {}
    #: tensor-parallel plan (module path pattern -> colwise / rowwise / replicated_with_grad_allreduce)
    #: for text models whose transformers config ships no layer plan (oracle/parallel/tensor_parallel.py)
    tp_plan: dict[str, str] = {}
    #: module class name -> fused float64 kernel ("rms_norm", "swiglu_mlp") the oracle may swap in for its
    #: forward (oracle/replay/fused.py); empty: the model code runs as it is
    fusable: dict[str, str] = {}
    #: regex over a block's child names: the branches whose output the block adds into its residual stream
    #: (a pre-norm decoder layer's attention and MLP); the local replay splits a block's forward error along
    #: their outputs (replay/local.py ``_branch_coefs``). None: no split
    residual_branches: str | None = None

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

    def pack_inputs(self, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Several samples' inputs (from ``prepare_inputs``) as one packed sequence (oracle/capture/packing.py)."""
        raise RecipeError(f"recipe {self.name!r} cannot pack samples")

    def forward_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor], reduction: str) -> tuple[torch.Tensor, int]:
        """Run the forward and the loss; return (loss, number of loss tokens)."""
        raise NotImplementedError

    def loss_from_logits(self, logits: torch.Tensor, inputs: dict[str, torch.Tensor], reduction: str) -> tuple[torch.Tensor, int]:
        """The loss alone, from the head's output (for the local replay of the loss)."""
        raise NotImplementedError

    def boundaries(self) -> dict[str, str]:
        """Named module selections for boundary capture: preset name -> regex over module names."""
        return {}

    def vocab_size(self, config: dict[str, Any]) -> int | None:
        """Rows of the token embedding the model of ``config`` builds (token ids are below it); the
        engine checks a capture's ids against it before any replay (oracle/replay/inputs.py)."""
        v = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else None

    def check_inputs(self, config: dict[str, Any], shapes: dict[str, tuple[int, ...]], load) -> list[str]:
        """The model-specific agreements of a capture's inputs (image tokens against the vision
        features, ...), checked at the inputs boundary after the generic ones (ids, positions):
        ``shapes`` name -> shape of every input, ``load(name)`` a tensor (load only what is small).
        One line per problem naming the tensor and the fix; [] when they agree."""
        return []

    def stream_units(self) -> str | None:
        """Regex over module names: the units the streaming replay materialises one at a time
        (decoder layers, ViT blocks, mergers, embeddings). The head is streamed by the engine."""
        return None

    def stream_token_modules(self) -> str | None:
        """Regex over module names: submodules of streamed units whose math is per token (one tensor
        in, one out, row r of the output from row r of the input: MLPs), which the streaming replay
        runs by token chunks (oracle/replay/streaming/tokens.py). ``None``: none."""
        return None

    def layer_key(self, name: str) -> tuple[tuple[int, int], str] | None:
        """``((major, minor), label)`` of the layer ``name`` belongs to; sorting by the tuple walks
        the backward pass from the loss end (oracle/score/layers.py groups with it). ``None``: unknown."""
        raise NotImplementedError

    def megatron_layer_call(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
        inputs: dict[str, torch.Tensor], attention_mask: torch.Tensor | None,
    ) -> tuple[tuple, dict[str, Any]]:  # fmt: skip
        """``(args, kwargs)`` with which the HF model calls one decoder layer in the step whose inputs
        are ``inputs`` (a merged Megatron capture's), given the layer's ``hidden_states`` (B, T, H),
        ``position_embeddings`` (cos, sin), each (B, T, D), and ``attention_mask``: None (causal) or,
        for packed samples, a (B, 1, T, T) bool mask, True = attends. ``hidden_states`` itself must be
        among the arguments. Raise NotImplementedError when the recipe cannot (merge then names the
        layer as not mapped)."""
        raise NotImplementedError

    def restrict_injected(self, model: nn.Module, keep: torch.Tensor) -> bool:
        """Features the model adds into the token sequence after the embedding (Qwen3-VL's deepstack
        visual features) send their gradient back only from the positions where ``keep`` (B, T) is
        True; their forward values are unchanged. What one sequence-parallel rank's backward sees when
        the framework slices those features per rank (rank view, megatron/rankview.py). False: the
        model injects nothing (no restriction needed)."""
        return False

    def entry_sources(self, config: dict[str, Any], inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Which unrecorded module writes which token rows of the hidden states the decoder's first layer
        receives: {module name: bool (B, T) mask}; the local replay splits that entry row's error by them
        (replay/local.py), so that a forward error made before the decoder is placed in the module whose rows
        carry it. {}: one writer (the token embedding), nothing to split."""
        return {}


# -- the registry -------------------------------------------------------------------------------
# Recipes are plugins: each is declared under the ``oracle.replays`` entry-point group (the built-in
# ones in this project's pyproject.toml, like any outside package's), ``name = "module:Class"``.
# ``get(name)`` imports just that one. ``register`` adds a class in-process (tests, notebooks).
GROUP = "oracle.replays"
_LOADED: dict[str, Recipe] = {}
_IN_PROCESS: dict[str, type[Recipe]] = {}


def register(cls: type[Recipe]) -> type[Recipe]:
    """Register a recipe class in this process; a name already declared or registered is an error."""
    if cls.name in _IN_PROCESS or cls.name in _declared():
        raise RecipeError(f"a recipe named {cls.name!r} is already registered; recipe names must be unique")
    _IN_PROCESS[cls.name] = cls
    return cls


def _declared() -> dict[str, Any]:
    """Entry points by name; a name declared twice (two plugins) is an error naming both."""
    eps: dict[str, Any] = {}
    for ep in entry_points(group=GROUP):
        if ep.name in eps and eps[ep.name].value != ep.value:
            raise RecipeError(f"recipe {ep.name!r} is declared twice: by {eps[ep.name].value} and by {ep.value}")
        eps[ep.name] = ep
    return eps


def get(name: str) -> Recipe:
    if name in _LOADED:
        return _LOADED[name]
    declared = _declared()
    if name in _IN_PROCESS:
        cls = _IN_PROCESS[name]
    elif name in declared:
        ep = declared[name]
        try:
            cls = ep.load()
        except Exception as e:  # a broken plugin: name it, do not hide it
            raise RecipeError(f"recipe {name!r} ({ep.value}) failed to import: {type(e).__name__}: {e}") from e
        if not (isinstance(cls, type) and issubclass(cls, Recipe)) or cls.name != name:
            raise RecipeError(f"entry point {name!r} = {ep.value} is not a Recipe subclass named {name!r}")
    else:
        raise RecipeError(f"no recipe named {name!r}; known recipes: {', '.join(names()) or 'none'}")
    _LOADED[name] = cls()
    return _LOADED[name]


def names() -> list[str]:
    return sorted(set(_declared()) | set(_IN_PROCESS))


def all_recipes() -> list[Recipe]:
    return [get(n) for n in names()]


def for_model(spec: str) -> Recipe:
    """The recipe for ``--model SPEC``: an embedded name, or a local HF directory's config.json."""
    from pathlib import Path

    for r in all_recipes():
        if spec in r.embedded:
            return r
    path = Path(spec)
    if not path.exists():
        known = sorted(n for r in all_recipes() for n in r.embedded)
        raise RecipeError(f"--model {spec!r} is neither an embedded model ({', '.join(known)}) nor an existing directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise RecipeError(f"{path} has no config.json; point --model at a Hugging Face model directory")
    hf_config = load_hf_config(cfg_file)
    for r in all_recipes():
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
