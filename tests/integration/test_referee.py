"""The referee neither cries wolf nor looks away: capture is non-invasive, non-finite values are
located along the backward, bands of another precision are refused (issue 11)."""

import pytest
import torch

from oracle.bundle.store import Bundle
from oracle.capture.modules import group_name
from oracle.capture.steps import capture_recipe_step


@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp-bf16"])
def test_recording_module_boundaries_leaves_every_gradient_bitwise_unchanged(source, sample, tmp_path, precision):
    plain = Bundle(capture_recipe_step(source, sample, str(tmp_path / "plain"), precision=precision))
    rec = Bundle(capture_recipe_step(source, sample, str(tmp_path / "rec"), precision=precision, modules="all"))
    names = plain.names("grads")
    assert names == rec.names("grads")
    changed = [n for n in names if not torch.equal(plain.load("grads", n), rec.load("grads", n))]
    assert changed == []
    # and the boundaries were recorded, grad_inputs of kwargs-called modules included
    attn = "model.language_model.layers.1.self_attn"
    meta = rec.manifest["modules"][attn]
    assert meta["grad_in"] and all(rec.has(group_name(attn), f"gin.{i}") for i in meta["grad_in"])
    assert len(rec.manifest["modules"]) > 20


def _cap(result, i=0):
    return result["captures"][i]


def test_non_finite_gradients_are_named_first_along_the_backward_and_listed_first(fp32_capture, oracle_bundle, tmp_path):
    from helpers import rewrite_grads

    from oracle.report.text import render
    from oracle.score.scorer import score

    far, near = "model.language_model.embed_tokens.weight", "model.language_model.layers.3.mlp.down_proj.weight"

    def poison(n, g):
        if n in (far, near):
            g = g.clone()
            g.view(-1)[0] = float("nan")
        return g

    order = Bundle(oracle_bundle).get("backward_order")
    assert order.index(near) < order.index(far)  # the backward reaches layers.3 before the embedding
    res = score(oracle_bundle, [rewrite_grads(fp32_capture, str(tmp_path / "nan"), poison)])
    v = _cap(res)["verdict"]
    assert v["class"] == "non_finite" and v["nonfinite_params"] == [near, far]
    assert f"first along the backward: {near}" in v["text"]
    table = render(res, top=3).split("worst parameters")[1].splitlines()[2:4]
    assert near in table[0] and far in table[1]


def test_a_band_of_another_precision_is_refused_unless_forced(amp_capture, oracle_bundle, band):
    from oracle.errors import UsageError
    from oracle.score.scorer import score

    with pytest.raises(UsageError, match=r"amp-bf16 capture but no --band emulates amp-bf16.*--dtype amp-bf16 --ensemble"):
        score(oracle_bundle, [amp_capture], band_paths=[band("fp32")])
    v = _cap(score(oracle_bundle, [amp_capture], band_paths=[band("fp32")], force_band=True))["verdict"]
    assert v["band_warning"] and "WARNING: band band-fp32 (fp32) measures another precision" in v["text"]
    ok = _cap(score(oracle_bundle, [amp_capture], band_paths=[band("fp32"), band("amp-bf16")]))
    assert ok["band_kind"].startswith("emulated amp-bf16") and ok["verdict"]["band_warning"] is None


MLP2, DOWN2 = "model.language_model.layers.2.mlp", "model.language_model.layers.2.mlp.down_proj"
MLP1 = "model.language_model.layers.1.mlp"


@pytest.mark.parametrize(
    "name,plant,module,direction",
    [("nan-bwd", "nan_in_backward", MLP2, "backward"), ("nan-fwd", "nan_in_forward", MLP1, "forward")],
)
def test_a_nan_born_in_a_module_is_its_culprit_with_the_direction(source, sample, oracle_bundle, tmp_path, name, plant, module,
                                                                  direction):  # fmt: skip
    import faults

    from oracle.replay.local import replay_local
    from oracle.report.text import render_local
    from oracle.score.local import score_local

    target = DOWN2 if plant == "nan_in_backward" else MLP1
    cap = capture_recipe_step(source, sample, str(tmp_path / name), instrument=getattr(faults, plant)(target),
                              modules="layers,sublayers,head")  # fmt: skip
    res = score_local(replay_local(cap, tmp_path / f"{name}.local", modules=r"layers\.[0-3](\.mlp)?$|^loss$", members=1))
    assert res["culprits"][0] == module and res["verdict"]["direction"] == direction, res["verdict"]["text"]
    assert res["verdict"]["class"] == "non_finite" and "non-finite values are born" in res["verdict"]["text"]
    born = [r["module"] for r in res["modules"] if r["born_nonfinite"]]
    assert born == ["model.language_model.layers." + module.split(".")[3], module]  # the layer holding it, and it
    assert res["culprits"][1:] == []  # the layer yields to its child; modules that only inherit the NaN are not blamed
    assert "NON-FINITE born in its " + direction in render_local(res)
    if direction == "backward":  # end to end: the first non-finite gradient along the backward is down_proj's
        from oracle.score.scorer import score

        v = score(oracle_bundle, [cap])["captures"][0]["verdict"]
        assert v["class"] == "non_finite" and v["nonfinite_params"][0].startswith(DOWN2), v["text"]


def test_local_scoring_honours_tol_refuses_band_and_writes_a_report(source, sample, tmp_path):
    from oracle.errors import UsageError
    from oracle.replay.local import replay_local
    from oracle.report.files import write_local_report
    from oracle.score.local import score_local

    cap = capture_recipe_step(source, sample, str(tmp_path / "c"), modules="layers")
    loc = replay_local(cap, tmp_path / "c.local", modules=r"layers\.3$", members=1)
    base = score_local(loc)
    assert base["culprits"] == [] and base["floor"] == pytest.approx(2.0**-24 / 4)
    strict = score_local(loc, tol_overrides={"fp32": {"floor": 1e-30}}, margin=1e-6)
    # at such a margin every row is beyond: the layer, and the rotary tables it received (checked where they enter)
    assert strict["floor"] == 1e-30 and set(strict["culprits"]) == {"model.language_model.layers.3",
                                                                     "model.language_model.layers.3:position_embeddings"}
    with pytest.raises(UsageError, match="own per-module band"):
        score_local(loc, band_paths=["band"])
    page = write_local_report(strict, tmp_path / "rep")
    assert "culprit: model.language_model.layers.3" in page.read_text()
    assert (tmp_path / "rep" / "modules.csv").read_text().count("\n") == 1 + len(strict["modules"])


@pytest.mark.parametrize(
    "plant,module,top,min_share",
    [("bf16_activation", "model.language_model.layers.2.mlp", "activation", 0.9),
     ("bf16_attention", "model.language_model.layers.1.self_attn", "attention", 0.05),
     (None, "model.language_model.layers.2.mlp", None, None)],
    ids=["activation-in-bf16", "attention-in-bf16", "honest"],
)  # fmt: skip
def test_explain_ranks_the_planted_op_class_first(source, sample, tmp_path, plant, module, top, min_share):
    """An fp32 capture with one op class run in bf16: explain --as bf16 ranks that class first; an
    honest capture has no class explaining its (fp32-level) error."""
    import json

    import faults
    from typer.testing import CliRunner

    from cli import app

    inst = getattr(faults, plant)(int(module.split(".")[3])) if plant else None
    cap = capture_recipe_step(source, sample, str(tmp_path / "c"), modules="sublayers", instrument=inst)
    r = CliRunner().invoke(app, ["explain", cap, "--module", module, "--as", "bf16", "--json", str(tmp_path / "x.json"),
                                 "--report", str(tmp_path / "rep")])  # fmt: skip
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "x.json").read_text())
    assert {c["class"] for c in res["classes"]} >= {"matmul", "attention", "softmax", "normalisation", "activation",
                                                     "rotary", "reduction", "cast", "loss"}  # fmt: skip
    best = res["classes"][0]
    if top is None:
        assert best["share_only"] < 0.5 and "no op class" in res["text"]
    else:
        assert res["top"] == top and best["share_only"] > min_share, r.output
        assert best["share_only"] > 3 * res["classes"][1]["share_only"]
    assert "op classes in" in (tmp_path / "rep" / "index.html").read_text() and "share_only" in r.output
    bad = CliRunner().invoke(app, ["explain", cap, "--module", "no.such.module"])
    assert bad.exit_code == 2 and "was not recorded" in bad.output
