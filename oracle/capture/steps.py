"""Running one step of a recipe's model: on a device for a capture, on CPU for a replay."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..bundle.shapes import check_shapes
from ..bundle.store import check_output
from ..errors import RecipeError
from ..precision import capture_policy, torch_dtype
from ..precision.mode import PrecisionMode
from ..recipe import ModelSource, Recipe
from .api import Capture
from .modules import ModuleRecorder, select

META = torch.device("meta")


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Inside, every parameter a module registers is moved to the meta device at registration
    (``torch.empty`` before it is lazily allocated and never touched; initialisers then run on meta,
    a no-op). Buffers are untouched. The patch is removed on exit, always."""
    original = nn.Module.register_parameter

    def register(self, name, param):
        original(self, name, param)
        if param is not None and param.device != META:
            p = self._parameters[name]
            self._parameters[name] = type(p)(p.to(META), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(
    recipe: Recipe,
    config: Mapping[str, Any],
    weights: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    mode: PrecisionMode | None = None,
    shapes: tuple[Mapping[str, Any], str] | None = None,
    init: bool = True,
) -> nn.Module:
    """Build the recipe's module in ``dtype`` and copy ``weights`` in (upcasts are exact).

    With a ``mode`` the module is built inside it, so that buffers computed at init (rotary
    frequencies) are computed in the mode's compute dtype too. With ``shapes`` (name -> stored
    shape, and where they come from) they are checked first on the meta device (shapes.py).
    ``init=False`` (a replay, which reseeds before its step): parameters are built on the meta
    device, so their random initialisation, overwritten anyway, is never computed (6-7 % of an
    in-memory float64 replay of benchmark b); buffers are computed as before. With ``init=True``
    (a capture) the random generator advances through the initialisers as it always did.
    """
    if shapes is not None:
        check_shapes(recipe, config, *shapes)
    with default_dtype(dtype), meta_parameters() if not init else contextlib.nullcontext(), mode or contextlib.nullcontext():
        model = recipe.build(dict(config))
    model = model.to(dtype)
    model.eval()  # no dropout: a step must be reproducible
    get = weights.__getitem__ if isinstance(weights, Mapping) else weights
    real: dict[int, nn.Parameter] = {}  # a parameter shared by several modules (tied) stays one parameter
    with torch.no_grad():
        for mod_name, m in model.named_modules():
            for k, p in list(m._parameters.items()):
                if p is None:
                    continue
                if id(p) not in real:
                    name = f"{mod_name}.{k}" if mod_name else k
                    w = get(name)
                    if w.shape != p.shape:
                        raise RecipeError(
                            f"weight {name} has shape {list(w.shape)}, the model built from the config expects {list(p.shape)}"
                        )
                    if p.device == META:
                        real[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype).copy_(w), requires_grad=p.requires_grad)
                    else:
                        p.copy_(w.to(dtype))
                        real[id(p)] = p
                m._parameters[k] = real[id(p)]
    return model


def capture_recipe_step(
    source: ModelSource,
    sample: dict[str, Any] | list[dict[str, Any]],
    out: str,
    *,
    precision: str = "fp32",
    device: str = "cpu",
    reduction: str = "mean",
    seed: int = 0,
    overwrite: bool = False,
    instrument: Callable[[nn.Module], Any] | None = None,
    modules: str | None = None,
    module_budget_mb: float | None = None,
    echo: Callable[[str], Any] | None = None,
) -> str:
    """Capture one step of ``source`` on ``device`` under ``precision`` into a bundle at ``out``.

    ``instrument(model)`` runs after the model is built and before the step (tests plant faults
    with it; users can attach their own hooks).
    """
    check_output(out, overwrite)  # before the step is spent
    torch.manual_seed(seed)
    pol = capture_policy(precision)
    recipe = source.recipe
    w = source.weights
    shapes = w.shapes() if hasattr(w, "shapes") else {n: list(t.shape) for n, t in w.items()}
    check_shapes(recipe, source.config, shapes, source.origin, error=RecipeError, fix="config.json and the checkpoint disagree")
    model = build_model(recipe, source.config, source.weights, torch_dtype(pol.param_dtype))
    if isinstance(sample, list):  # several samples packed into one sequence
        inputs = recipe.pack_inputs([recipe.prepare_inputs(source, model, smp) for smp in sample])
    else:
        inputs = recipe.prepare_inputs(source, model, sample)
    dev = torch.device(device)
    model.to(dev)
    if instrument is not None:
        instrument(model)
    inputs = {k: v.to(dev) for k, v in inputs.items()}
    names = None
    budget = int(module_budget_mb * 2**20) if module_budget_mb is not None else None
    if modules:
        names = select_modules(recipe, model, modules)
        estimate = estimate_module_bytes(recipe, model, names, inputs, reduction, pol, dev)
        if echo:
            echo(f"recording {len(names)} module boundaries: about {estimate / 2**20:.1f} MiB"
                 + (f" (budget {module_budget_mb:g} MiB)" if budget else ""))  # fmt: skip
        if budget is not None and estimate > budget:
            raise RecipeError(
                f"module capture needs about {estimate / 2**20:.1f} MiB, over the budget of {module_budget_mb:g} MiB; "
                "select fewer modules (--modules) or raise --budget-mb"
            )
    model.zero_grad(set_to_none=True)
    with Capture(
        model,
        out,
        precision=precision,
        recipe=recipe.name,
        model_config=source.config,
        seed=seed,
        overwrite=overwrite,
        metadata={"model": source.origin},
        modules=names,
        module_budget_bytes=budget,
    ) as cap:
        with pol.autocast(dev.type):
            loss, n_tokens = recipe.forward_loss(model, inputs, reduction)
        cap.add_inputs(**{k: v for k, v in inputs.items() if k not in cap.inputs})
        cap.set_loss(loss, reduction=reduction, num_tokens=n_tokens)
        loss.backward()
    return out


def select_modules(recipe: Recipe, model: nn.Module, spec: str) -> list[str]:
    """``spec``: comma-separated boundary presets of the recipe (``layers,vit``), or a regex."""
    presets = recipe.boundaries()
    parts = [p.strip() for p in spec.split(",")]
    pattern = "|".join(f"(?:{presets[p]})" for p in parts) if all(p in presets for p in parts) else spec
    try:
        names = select(model, pattern)
    except re.error as e:
        raise RecipeError(f"--modules {spec!r} is neither presets ({', '.join(presets)}) nor a valid regex ({e})") from None
    except ValueError as e:  # modules.check_pattern: not a regex, or one that could backtrack for ever
        raise RecipeError(f"--modules {spec!r} is not one of the presets ({', '.join(presets)}): {e}") from None
    if not names:
        raise RecipeError(f"--modules {spec!r} selects no module; presets: {', '.join(presets)}")
    return names


def estimate_module_bytes(recipe, model, names, inputs, reduction, pol, dev) -> int:
    """A forward-only dry run counting boundary bytes; gradients double the floating part."""
    with ModuleRecorder(model, names, dry_run=True) as rec, torch.no_grad(), pol.autocast(dev.type):
        recipe.forward_loss(model, inputs, reduction)
    return 2 * rec.bytes
