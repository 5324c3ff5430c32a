"""Module boundaries under full recompute: recorded on the grad-enabled recomputation, so a
recomputed step's local replay gives the verdicts of the same step without recompute."""

import functools

import pytest
import torch
from faults import scale_grad
from torch.utils.checkpoint import checkpoint

from oracle.bundle.store import Bundle
from oracle.capture.steps import capture_recipe_step
from oracle.replay.local import replay_local
from oracle.score.local import score_local

LAYERS = r"^model\.language_model\.layers\.\d+(\.(self_attn|mlp|input_layernorm|post_attention_layernorm))?$"


def recompute_layers(model, reentrant: bool = True):
    """Megatron's full recompute, on the decoder layers: each layer's whole call (its module hooks
    included) inside torch.utils.checkpoint; reentrant = a no-grad forward, then the grad-enabled
    recomputation inside the backward (megatron.core.tensor_parallel.checkpoint does the same)."""
    for layer in model.model.language_model.layers:
        cls = type(layer)

        def call(self, *args, **kwargs):
            return checkpoint(functools.partial(super(type(self), self).__call__, **kwargs), *args, use_reentrant=reentrant)

        layer.__class__ = type(f"Recomputed{cls.__name__}", (cls,), {"__call__": call})


def both(*instruments):
    def run(model):
        for f in instruments:
            if f is not None:
                f(model)

    return run


@pytest.fixture(scope="module")
def captures(source, sample, tmp_path_factory):
    root = tmp_path_factory.mktemp("recompute")
    fault = scale_grad("model.language_model.layers.1.self_attn.q_proj", 1.02)
    out = {}
    for name, inst in [("plain", None), ("recomputed", recompute_layers), ("non-reentrant", functools.partial(recompute_layers, reentrant=False)),
                       ("plain-fault", fault), ("recomputed-fault", both(fault, recompute_layers))]:  # fmt: skip
        out[name] = capture_recipe_step(source, sample, str(root / name), instrument=inst, modules=LAYERS)
    return root, out


def test_a_recomputed_step_records_the_boundaries_and_gradients_of_the_plain_step(captures):
    _, caps = captures
    plain, rec = Bundle(caps["plain"]), Bundle(caps["recomputed"])
    for g in plain.groups():
        if g.startswith("mod.") or g == "grads":
            assert rec.names(g) == plain.names(g), g
            for n in plain.names(g):
                assert torch.equal(rec.load(g, n), plain.load(g, n)), f"{g}/{n}"
    mods, pmods = rec.get("modules"), plain.get("modules")
    layer = mods["model.language_model.layers.2.mlp"]
    assert layer["calls"] == 1 and layer["no_grad_calls"] == 1 and layer["recomputed_calls"] == 1
    assert {n: m["order"] for n, m in mods.items()} == {n: m["order"] for n, m in pmods.items()}  # forward order kept
    nr = Bundle(caps["non-reentrant"]).get("modules")["model.language_model.layers.2.mlp"]
    assert nr["calls"] == 1 and nr.get("recomputed_calls") == 1 and not nr.get("no_grad_calls")


def test_local_replay_verdicts_are_the_same_with_and_without_recompute(captures):
    root, caps = captures
    res = {n: score_local(Bundle(replay_local(caps[n], root / f"{n}.local"))) for n in ("plain", "recomputed", "plain-fault", "recomputed-fault")}
    assert res["plain"]["culprits"] == res["recomputed"]["culprits"] == []
    assert res["plain-fault"]["culprits"][0] == "model.language_model.layers.1.self_attn"
    assert res["recomputed-fault"]["culprits"] == res["plain-fault"]["culprits"]
    assert res["recomputed-fault"]["verdict"]["direction"] == res["plain-fault"]["verdict"]["direction"] == "backward"
    rows = {r["module"]: r for r in res["recomputed"]["modules"]}
    assert rows["model.language_model.layers.3.mlp"]["param"] is not None  # parameters judged: one graph-building call
