import math

import pytest
from faults import lowp_norm_backward, scale_grad, wrong_mask_backward
from helpers import rewrite_grads

from oracle.bundle.store import Bundle, BundleWriter
from oracle.capture.steps import capture_recipe_step
from oracle.errors import MismatchError
from oracle.score.scorer import score


def _cap(result, i=0):
    return result["captures"][i]


def test_identical_gradients_score_zero(oracle_bundle):
    r = score(oracle_bundle, [oracle_bundle])
    c = _cap(r)
    assert all(p["rel_l2"] == 0.0 and p["cosine"] == pytest.approx(1.0) and p["max_abs"] == 0.0 for p in c["params"])
    assert c["verdict"]["class"] == "within_noise" and c["verdict"]["onset"] is None


def test_the_text_report_states_the_loss_check_when_it_agrees(fp32_capture, oracle_bundle):
    from oracle.report.text import render

    text = render(score(oracle_bundle, [fp32_capture]))
    assert "  loss: the loss agrees with the replay within the band" in text, text


def test_a_5_percent_error_in_one_parameter_is_reported_worst(fp32_capture, oracle_bundle, band, tmp_path):
    target = "model.language_model.layers.2.mlp.up_proj.weight"
    bad = rewrite_grads(fp32_capture, str(tmp_path / "bad"), lambda n, g: g * 1.05 if n == target else g)
    c = _cap(score(oracle_bundle, [bad], band_paths=[band("fp32")]))
    worst = max(c["params"], key=lambda p: p["excess"])
    assert worst["name"] == target and worst["class"] == "beyond_noise"
    assert worst["rel_l2"] == pytest.approx(0.05, rel=1e-3)
    assert c["verdict"]["onset"]["layer"] == "layers.2"


def test_a_different_step_is_refused_with_the_tensors_named(oracle_bundle, source, sample, tmp_path):
    other_sample = dict(sample, messages=[*sample["messages"][:-1], {"role": "assistant", "content": "Something else."}])
    other = capture_recipe_step(source, other_sample, str(tmp_path / "other"))
    with pytest.raises(MismatchError, match=r"inputs/input_ids: values differ") as e:
        score(oracle_bundle, [other])
    assert "inputs/labels" in str(e.value)
    shifted = dict(source.weights)
    shifted["lm_head.weight"] = shifted["lm_head.weight"] * 2
    src2 = type(source)(source.recipe, source.config, shifted, "test", source.extra)
    other_w = capture_recipe_step(src2, sample, str(tmp_path / "other_w"))
    with pytest.raises(MismatchError, match=r"weights/lm_head.weight: values differ"):
        score(oracle_bundle, [other_w])


def test_honest_amp_bf16_is_within_its_measured_band(amp_capture, oracle_bundle, band):
    c = _cap(score(oracle_bundle, [amp_capture], band_paths=[band("amp-bf16")]))
    assert c["band_kind"].startswith("emulated amp-bf16")
    assert c["verdict"]["class"] == "within_noise", c["verdict"]["text"]
    assert 0.05 < c["verdict"]["excess"] < 3  # a real error, of the band's size


PLANTS = [
    ("grad-scaled-decoder-layer", scale_grad("model.language_model.layers.2.mlp", 1.02), "layers.2", "mlp"),
    ("wrong-mask-attention-backward", wrong_mask_backward(1), "layers.1", "self_attn"),
    ("rmsnorm-backward-in-bf16", lowp_norm_backward(2), "layers.2", "post_attention_layernorm"),
    ("vit-block-fault", scale_grad("model.visual.blocks.1.mlp", 1.02), "visual.blocks.1", "mlp."),
]


@pytest.fixture(scope="module")
def streamed_oracle(fp32_capture, tmp_path_factory):
    from oracle.replay.run import replay

    return str(replay(fp32_capture, tmp_path_factory.mktemp("streamed") / "oracle", max_memory=8 << 30))


@pytest.mark.parametrize("name,instrument,layer,module", PLANTS, ids=[p[0] for p in PLANTS])
def test_a_streamed_oracle_names_the_same_onset_as_the_in_memory_one(name, instrument, layer, module, make_capture,
                                                                      streamed_oracle, oracle_bundle, band):  # fmt: skip
    """A streamed oracle records the order its units' recomputations complete their parameters in,
    so the onset names the parameter the in-memory oracle names (the first the backward completes)."""
    cap = make_capture(name, "fp32", instrument)
    v = _cap(score(streamed_oracle, [cap], band_paths=[band("fp32")]))["verdict"]
    ref = _cap(score(oracle_bundle, [cap], band_paths=[band("fp32")]))["verdict"]
    assert v["class"] == "beyond_noise" and v["onset"]["layer"] == layer, v["text"]
    assert v["onset"]["param"].startswith(module) and v["onset"]["param"] == ref["onset"]["param"], v["text"]


@pytest.mark.parametrize("name,instrument,layer,module", PLANTS, ids=[p[0] for p in PLANTS])
def test_planted_fault_onset_is_found_at_the_right_layer(name, instrument, layer, module, make_capture, oracle_bundle, band):
    cap = make_capture(name, "fp32", instrument)
    assert Bundle(cap).get("loss")["value"] == Bundle(oracle_bundle).get("captured_loss")["value"]  # forward untouched
    c = _cap(score(oracle_bundle, [cap], band_paths=[band("fp32")]))
    v = c["verdict"]
    assert v["class"] == "beyond_noise", v["text"]
    assert v["onset"]["layer"] == layer, v["text"]
    assert v["onset"]["param"].startswith(module), v["text"]
    # the sentence pairs each number with its own: the layer's excess, then the first parameter's own
    lr = next(r for r in c["layers"] if r["name"] == layer)
    pr = next(p for p in c["params"] if p["name"] == lr["first_param"])
    assert (
        f"leaves the band at {layer} ({lr['excess']:.1f}x; first out along the backward: {v['onset']['param']}, "
        f"{pr['excess']:.1f}x)" in v["text"]
    ), v["text"]
    order = [lr["name"] for lr in c["layers"]]
    before = order[: order.index(layer)]
    assert all(lr["class"] == "within_noise" for lr in c["layers"] if lr["name"] in before)


def test_global_scale_mismatch_is_diagnosed(fp32_capture, oracle_bundle, band, tmp_path):
    n = 8.0
    scaled = rewrite_grads(fp32_capture, str(tmp_path / "scaled"), lambda _, g: g / n)
    v = _cap(score(oracle_bundle, [scaled], band_paths=[band("fp32")]))["verdict"]
    assert v["class"] == "beyond_noise"
    assert v["global_scale"]["explains"] and v["global_scale"]["c"] == pytest.approx(n, rel=1e-5)
    assert "loss scaling / normalisation mismatch, c = 8" in v["text"]


def test_planted_fault_is_not_mistaken_for_a_global_scale(make_capture, oracle_bundle, band):
    cap = make_capture("grad-scaled-decoder-layer", "fp32", PLANTS[0][1])
    v = _cap(score(oracle_bundle, [cap], band_paths=[band("fp32")]))["verdict"]
    assert not v["global_scale"]["explains"]


def test_non_finite_gradients_are_counted_and_classed(fp32_capture, oracle_bundle, tmp_path):
    def poison(n, g):
        if n == "lm_head.weight":
            g = g.clone()
            g[0, 0] = float("nan")
        return g

    bad = rewrite_grads(fp32_capture, str(tmp_path / "nan"), poison)
    c = _cap(score(oracle_bundle, [bad]))
    row = next(p for p in c["params"] if p["name"] == "lm_head.weight")
    assert row["nonfinite"] == 1 and row["class"] == "non_finite"
    assert c["verdict"]["class"] == "non_finite" and "lm_head.weight" in c["verdict"]["text"]
    for order in ([bad, fp32_capture], [fp32_capture, bad]):  # a NaN layer never wins "closer to the truth"
        cmp = score(oracle_bundle, order, names=["x", "y"] if order[0] == bad else ["y", "x"])["comparison"]
        lm = next(r for r in cmp["per_layer"] if r["layer"] == "lm_head")
        assert lm["closest"] == "y" and cmp["layers_won"]["x"] == 0 and cmp["closest_overall"] == "y"
    cmp = score(oracle_bundle, [fp32_capture, fp32_capture], names=["a", "b"])["comparison"]
    assert cmp["closest_overall"] is None and cmp["layers_won"] == {"a": 0, "b": 0}  # identical captures: ties


def test_without_a_band_the_tolerance_table_is_used_and_overridable(amp_capture, oracle_bundle):
    c = _cap(score(oracle_bundle, [amp_capture]))
    assert c["band_kind"] == "tolerance table (amp-bf16)" and c["verdict"]["class"] == "within_noise"
    strict = _cap(score(oracle_bundle, [amp_capture], tol_overrides={"amp-bf16": {"expected": 1e-4}}))
    assert strict["verdict"]["class"] == "beyond_noise"


def test_the_closer_capture_is_named(amp_capture, fp32_capture, oracle_bundle):
    r = score(oracle_bundle, [amp_capture, fp32_capture], names=["A", "B"])
    assert r["comparison"]["closest_overall"] == "B"
    assert r["comparison"]["layers_won"]["B"] == len(r["comparison"]["per_layer"])


def test_norm_only_capture_is_scored_on_norm_ratio(oracle_bundle, tmp_path):
    o = Bundle(oracle_bundle)
    norms = {n: float(o.load("grads", n).norm()) for n in o.names("grads")}
    norms["lm_head.weight"] *= 1.5
    with BundleWriter(tmp_path / "norms", "norms") as w:
        w.manifest.update(precision="bf16", norms=norms)
    c = _cap(score(oracle_bundle, [tmp_path / "norms"]))
    assert c["norms_only"] and "norm-only" in c["verdict"]["text"]
    worst = max(c["params"], key=lambda p: p["excess"])
    assert worst["name"] == "lm_head.weight" and worst["norm_ratio"] == pytest.approx(1.5)
    assert math.isclose(next(p for p in c["params"] if p["name"] != "lm_head.weight")["norm_ratio"], 1.0, rel_tol=1e-12)


def test_the_loss_is_judged_against_its_members_losses(make_capture, amp_capture, oracle_bundle, band):
    """The band's members' losses (each emulated run's cross-entropy as the device's float32 kernel) are the loss's
    band: far below the tolerance table's 3e-2, an honest amp-bf16 capture within it, a capture whose logits were
    scaled by 1.1 in its forward (a hook on lm_head: every gradient moves by about one factor) beyond it."""
    honest = _cap(score(oracle_bundle, [amp_capture], band_paths=[band("amp-bf16")]))["loss_check"]
    assert honest["members"] == 3 and honest["loss_band"] < 1e-3 and not honest["beyond"], honest

    def hot_logits(model):
        model.lm_head.register_forward_hook(lambda module, inputs, out: out * 1.1)

    scaled = make_capture("amp-bf16-logits-x1.1", "amp-bf16", instrument=hot_logits)
    lc = _cap(score(oracle_bundle, [scaled], band_paths=[band("amp-bf16")]))["loss_check"]
    assert lc["beyond"] and lc["excess"] > lc["threshold"], lc


def test_the_logit_slope_predicts_how_far_scaled_logits_move_the_loss(make_capture, oracle_bundle):
    """scorer._logit_slope (<W, dL/dW> of the output layer, from the capture's weight and the truth's gradient) is
    dL/df at f = 1 of the truth's loss with its logits scaled by f: an fp32 capture whose logits were scaled by 1.01
    in its forward moved the loss by 0.01 x it, to first order (within 5 %: the second-order term and fp32
    rounding); answers._logits_scaled reads a loss-end scale's direction from it."""

    def hot_logits(model):
        model.lm_head.register_forward_hook(lambda module, inputs, out: out * 1.01)

    lc = _cap(score(oracle_bundle, [make_capture("fp32-logits-x1.01", "fp32", instrument=hot_logits)]))["loss_check"]
    moved = lc["captured"] - lc["replayed"]
    assert lc["logit_slope"] is not None and abs(moved) > 1e-5, lc
    assert abs(moved / (0.01 * lc["logit_slope"]) - 1) < 0.05, (moved, lc["logit_slope"])


def test_an_emulated_members_loss_is_the_devices_float32_cross_entropy(oracle_bundle, band):
    """A pure-bf16 member's cross-entropy runs as the device's float32 kernel on its bf16 logits (headloss.device_ce):
    its loss within 1e-4 of the truth (measured 4e-6..8e-6). Rounding every step to bf16 put it 5.6e-4..5.1e-3 off
    (the loss itself a bf16 number), too wide for any loss band."""
    truth = Bundle(oracle_bundle).get("loss")["value"]
    members = Bundle(band("bf16")).get("loss")["members"]
    assert len(members) == 3 and len(set(members)) == 3, members  # three draws, not one number three times
    assert max(abs(m - truth) / abs(truth) for m in members) < 1e-4, (members, truth)
