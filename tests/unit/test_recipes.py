"""The recipe contract (replays/README.md), checked for every registered recipe, and the registry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from oracle import recipe as recipes
from oracle.capture.steps import build_model, capture_recipe_step, select_modules
from oracle.errors import RecipeError
from oracle.replay.run import replay
from oracle.score.layers import group
from oracle.score.scorer import score

ROOT = Path(__file__).resolve().parents[2]


def test_the_built_in_recipes_are_entry_point_plugins():
    assert {"qwen3", "qwen3-vl"} <= set(recipes.names())
    r = recipes.get("qwen3")
    assert r is recipes.get("qwen3") and r.name == "qwen3"  # loaded once
    with pytest.raises(RecipeError, match="no recipe named 'nope'; known recipes: .*qwen3"):
        recipes.get("nope")


def test_a_duplicate_name_is_refused():
    class Again(recipes.Recipe):
        name = "qwen3"

    with pytest.raises(RecipeError, match="already registered"):
        recipes.register(Again)


def test_a_plugin_that_fails_to_import_is_named(monkeypatch):
    from importlib.metadata import EntryPoint

    broken = EntryPoint(name="broken", value="no_such_module_xyz:Recipe", group=recipes.GROUP)
    real = recipes.entry_points
    monkeypatch.setattr(recipes, "entry_points", lambda group: [*real(group=group), broken])
    with pytest.raises(RecipeError, match=r"recipe 'broken' \(no_such_module_xyz:Recipe\) failed to import"):
        recipes.get("broken")


def test_the_engine_never_imports_a_concrete_model():
    for f in (ROOT / "oracle").rglob("*.py"):
        src = f.read_text()
        assert not re.search(r"^\s*(from|import)\s+replays\b", src, flags=re.M), f"{f} imports replays"


@pytest.mark.parametrize("name", recipes.names())
def test_every_recipe_keeps_the_contract(name, tmp_path):
    """Tiny flavor, sample, inputs, loss, layer keys and boundary presets; capture -> fp64 replay -> score."""
    r = recipes.get(name)
    assert r.embedded, f"{name} has no embedded tiny flavor"
    flavor = r.embedded[0]
    assert recipes.for_model(flavor) is r
    src = r.load(flavor)
    assert r.accepts(src.config)
    model = build_model(r, src.config, src.weights, torch.float32)
    inputs = r.prepare_inputs(src, model, r.default_sample())
    loss, n_tokens = r.forward_loss(model, inputs, "mean")
    assert loss.ndim == 0 and torch.isfinite(loss) and n_tokens > 0
    names = [n for n, _ in model.named_parameters()]
    assert all(r.layer_key(n) is not None for n in names), "layer_key must know every parameter"
    layers = group(names, r.layer_key)
    assert layers[0][0] == "lm_head" and sum(len(ns) for _, ns in layers) == len(names)
    for preset in r.boundaries():
        assert select_modules(r, model, preset), f"boundary preset {preset!r} selects nothing"
    readme = (ROOT / "replays" / "README.md").read_text()
    assert f"`{name}`" in readme and f"`{flavor}`" in readme
    cap = capture_recipe_step(src, r.default_sample(), str(tmp_path / "c"))
    o = replay(cap, tmp_path / "o", dtype="fp64", verify="off")
    res = score(o, [cap])
    assert res["captures"][0]["verdict"]["class"] == "within_noise"
    assert res["captures"][0]["layers"][0]["name"] == "lm_head"
