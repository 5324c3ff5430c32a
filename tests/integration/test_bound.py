"""The analytic round-off bound (oracle/score/bound.py): its numbers, beside the band in judge's report
(planted errors on both sides of it), and against what two grad-norm logs prove (the user's logs, and
synthetic logs within and beyond it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import rewrite_grads
from typer.testing import CliRunner

from cli import app
from oracle import recipe as recipes
from oracle.bundle.store import Bundle
from oracle.capture.steps import capture_recipe_step
from oracle.pipeline import answers
from oracle.replay.run import replay
from oracle.report.judge import render_judge
from oracle.score import bound
from oracle.score.layers import generic_key
from oracle.score.scorer import score

DATA = Path(__file__).resolve().parents[1] / "data"
LOGS = ["--log-a", str(DATA / "h20_rank0_grad_norms.log"), "--log-b", str(DATA / "910b_rank0_grad_norms.log"),
        "--name", "H20", "--name", "910B"]  # fmt: skip


# -- the numbers ----------------------------------------------------------------------------------
def test_the_bound_is_k_c_to_the_n_u_with_u_two_to_the_minus_t():
    """u = 2^-t (bf16 2^-8, fp16 2^-11, fp32 2^-24); the bound is k C^n u; fp32 adds sqrt(n_acc) 2^-24 to k u."""
    assert bound.unit_roundoff("bf16") == bound.unit_roundoff("amp-bf16") == 2.0**-8
    assert bound.unit_roundoff("fp16") == 2.0**-11 and bound.unit_roundoff("fp32") == 2.0**-24
    assert bound.bound(0, "bf16") == bound.K * 2.0**-8
    assert bound.bound(10, "bf16") == pytest.approx(bound.K * bound.C**10 * 2.0**-8, rel=1e-15)
    assert bound.bound(3, "fp32", n_acc=65536) == pytest.approx((bound.K + 256) * bound.C**3 * 2.0**-24, rel=1e-12)
    assert bound.k_for("bf16", 65536) / bound.K - 1 < 0.01  # the accumulation is negligible in bf16


def test_layers_passed_count_from_the_loss_end():
    """Head and final norm n = 0, decoder layer i of L n = L - i, then one more per label after layer 0."""
    order = ["lm_head", "norm", "layers.2", "layers.1", "layers.0", "embed_tokens", "visual.merger", "visual.blocks.1"]
    assert bound.depth_of(order) == 3
    assert bound.exponents(order, 3) == {"lm_head": 0, "norm": 0, "layers.2": 1, "layers.1": 2, "layers.0": 3,
                                         "embed_tokens": 4, "visual.merger": 5, "visual.blocks.1": 6}  # fmt: skip
    assert bound.exponents(["layers.2", "layers.0", "embedding"], 36)["embedding"] == 37
    assert bound.depth_needed(bound.bound(20, "bf16") * 1.0001, "bf16") == 21


def test_a_norm_ratio_proves_at_least_that_error_in_one_run():
    """max(e_A, e_B) >= |r-1|/(1+r) for any two gradients and any truth, tight when they err in opposite directions."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        t = torch.randn(50, generator=g, dtype=torch.float64)
        a = t + torch.randn(50, generator=g, dtype=torch.float64) * float(torch.rand(1, generator=g))
        b = t + torch.randn(50, generator=g, dtype=torch.float64) * float(torch.rand(1, generator=g))
        ea, eb = float((a - t).norm() / t.norm()), float((b - t).norm() / t.norm())
        r = float(b.norm() / a.norm())
        assert max(ea, eb) >= bound.proven_error(r) - 1e-12
        assert float((b - a).norm() / a.norm()) >= abs(r - 1) - 1e-12  # |r-1|: the runs' relative difference
    t = torch.randn(50, generator=g, dtype=torch.float64)
    assert bound.proven_error(float(((1.1 * t).norm()) / (0.9 * t).norm())) == pytest.approx(0.1, rel=1e-12)


# -- beside the band: planted errors on both sides of the bound ------------------------------------
@pytest.fixture(scope="module")
def step(tmp_path_factory):
    """The tiny Qwen3's bf16 step: capture, float64 truth, a 2-member emulated bf16 band."""
    root = tmp_path_factory.mktemp("bound")
    r = recipes.for_model("tiny-qwen3")
    src = r.load("tiny-qwen3")
    cap = capture_recipe_step(src, r.default_sample(), str(root / "cap"), precision="bf16")
    truth = replay(cap, root / "truth", dtype="fp64", verify="off")
    band = replay(cap, root / "band", dtype="bf16", ensemble=2, verify="off")
    return root, cap, truth, band


def _planted(step, layer: str, factor: float) -> tuple[str, float]:
    """A copy of the capture whose error at ``layer`` is ``factor`` x the bound there (every parameter's
    error g - t scaled by one s: the layer's rel L2 scales by s); (path, the bound)."""
    root, cap, truth, band = step
    res = score(truth, [cap], band_paths=[band])
    order = res["layer_order"]
    n = bound.exponents(order, bound.depth_of(order))[layer]
    b = bound.bound(n, "bf16")
    row = next(r for r in res["captures"][0]["layers"] if r["name"] == layer)
    s = factor * b / row["rel_l2"]
    tb = Bundle(truth)
    members = {p for p in Bundle(cap).names("grads") if (generic_key(p) or ((0, 0), ""))[1] == layer}
    assert members

    def fn(p, g):
        if p not in members:
            return g
        t = tb.load("grads", p).to(torch.float64)
        return (t + s * (g.to(torch.float64) - t)).to(torch.float32)

    out = root / f"{layer}-{factor}"
    return (str(out) if out.exists() else rewrite_grads(cap, str(out), fn)), b


def _judged(step, capture: str, margin: float) -> dict:
    _, _, truth, band = step
    res = score(truth, [capture], band_paths=[band], margin=margin, names=["NPU"])
    runs = [{"name": "NPU", "num_tokens": None, "modules": False}]
    return answers.build(res, runs, local={}, explained={}, logs=None)


@pytest.mark.parametrize("factor, beyond", [(0.5, False), (3.0, True)])
def test_a_layer_at_half_and_three_times_the_bound_is_within_and_beyond_it(step, factor, beyond):
    """Layer 0's error planted at 0.5x / 3x the bound: its row says within / beyond, at bound_excess = factor."""
    cap, b = _planted(step, "layers.0", factor)
    doc = _judged(step, cap, margin=3.0)
    row = next(r for r in doc["score"]["captures"][0]["layers"] if r["name"] == "layers.0")
    assert row["bound"] == pytest.approx(b, rel=1e-12) and row["bound_n"] == 4
    assert row["bound_excess"] == pytest.approx(factor, rel=1e-6)
    assert row["bound_class"] == ("beyond" if beyond else "within")
    ans = doc["answers"]["bound"]["per_run"][0]
    assert ("layers.0" in ans["beyond"]) is beyond
    text = render_judge(doc)
    assert "analytic round-off bound k C^n u (bf16: u = 2^-8" in text
    assert ("beyond the analytic bound at 1/" in text) is beyond


def test_beyond_the_bound_but_within_the_band_is_said(step):
    """3x the bound with a margin that holds it within the band: the answer names the layer and the disagreement."""
    cap, b = _planted(step, "layers.0", 3.0)
    band_row = next(r for r in score(step[2], [cap], band_paths=[step[3]])["captures"][0]["layers"] if r["name"] == "layers.0")
    doc = _judged(step, cap, margin=2 * 3.0 * b / band_row["band"])
    row = next(r for r in doc["score"]["captures"][0]["layers"] if r["name"] == "layers.0")
    assert row["class"] == "within_noise" and row["disagrees"] == bound.BEYOND_BOUND_WITHIN_BAND
    ans = doc["answers"]["bound"]["per_run"][0]
    assert [d["layer"] for d in ans["disagree"]] == ["layers.0"]
    line = next(x for x in render_judge(doc).splitlines() if "beyond the bound, within the band" in x)
    assert "NPU: beyond the bound, within the band at layers.0" in line and "3.00x" in line
    # the band is under the bound here: the margin let the error through, and the line says so (it said the band
    # was wider than the round-off model allows)
    assert band_row["band"] < b and "wider there than the round-off model" not in line
    assert "which is itself under the bound there" in line and "a smaller --margin would call it beyond noise" in line
    assert "; beyond the bound, within the band" in next(x for x in render_judge(doc).splitlines() if x.strip().startswith("layers.0 "))


def test_within_the_bound_but_beyond_the_band_is_said(step):
    """0.9x the bound with a margin that puts it (alone) beyond the band: said the other way round."""
    cap, b = _planted(step, "layers.0", 0.9)
    band_row = next(r for r in score(step[2], [cap], band_paths=[step[3]])["captures"][0]["layers"] if r["name"] == "layers.0")
    doc = _judged(step, cap, margin=0.75 * 0.9 * b / band_row["band"])
    row = next(r for r in doc["score"]["captures"][0]["layers"] if r["name"] == "layers.0")
    assert row["class"] == "beyond_noise" and row["disagrees"] == bound.WITHIN_BOUND_BEYOND_BAND
    assert [d["layer"] for d in doc["answers"]["bound"]["per_run"][0]["disagree"]] == ["layers.0"]
    line = next(x for x in render_judge(doc).splitlines() if "NPU: within the bound, beyond the band at " in x)
    assert "at layers.0; first layers.0 (n = 4" in line and "0.90x" in line


def test_an_honest_capture_is_within_the_bound_and_agrees_with_the_band(step):
    """The honest bf16 step: within the bound at every layer, no disagreement."""
    _, cap, _, _ = step
    doc = _judged(step, cap, margin=3.0)
    ans = doc["answers"]["bound"]["per_run"][0]
    assert ans["beyond"] == [] and ans["disagree"] == []
    assert "within the analytic bound at every layer" in ans["text"] and "agree at every layer" in ans["text"]


# -- the logs alone ---------------------------------------------------------------------------------
def test_the_users_logs_are_beyond_the_bound_at_the_embedding(tmp_path):
    """The user's logs: L = 3 named; |r-1| = 48.1 % at the embedding, proven 19.4 %, beyond the bound; in JSON too."""
    res = CliRunner().invoke(app, ["judge", *LOGS, "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    out = res.stdout
    b3 = bound.bound(4, "bf16")
    assert "L = 3 decoder layers, as many as the logs name" in out
    assert (f"embedding: the norms differ by |r-1| = 48.1% (r = 1.4815), so at least one run is at least |r-1|/(1+r) = 19.4% "
            f"off the truth there, {0.4815 / 2.4815 / b3:.1f}x the bound {b3:.1%}: BEYOND honest round-off for this depth") in out
    # what the logs cannot tell is said once, and never that the gap's size against noise is unknown
    assert "whether the gap exceeds honest bf16 noise" not in out and out.count("which run is right") == 1, out
    doc = json.loads((tmp_path / "o" / "judge.json").read_text())
    emb = doc["bound"]["rows"][-1]
    assert emb["layer"] == "embedding" and emb["n"] == 4 and emb["beyond"] and doc["bound"]["beyond"]
    assert emb["diff"] == pytest.approx(0.48150, abs=5e-5) and emb["proven"] == pytest.approx(0.19403, abs=5e-5)


def test_the_users_logs_at_the_models_depth(tmp_path):
    """--num-layers 36 (Qwen3-VL-8B): the bound at layer 0 is k C^36 u, and the verdict at the embedding follows it."""
    res = CliRunner().invoke(app, ["judge", *LOGS, "--num-layers", "36"])
    assert res.exit_code == 0, res.output
    b0, b1, be = bound.bound(36, "bf16"), bound.bound(1, "bf16"), bound.bound(37, "bf16")
    assert f"b = {b1:.1%} at the last decoder layer (n = 1), {b0:.1%} at layer 0 (n = 36), {be:.1%} at embedding (n = 37)" in res.stdout
    word = "BEYOND" if 0.19403 > be else "within"
    assert f"the bound {be:.1%}: {word} honest round-off for this depth" in res.stdout
    bad = CliRunner().invoke(app, ["judge", *LOGS, "--num-layers", "2"])
    assert bad.exit_code == 2 and "the logs name 3 decoder layers" in bad.stderr and "Traceback" not in bad.output


def _log(path: Path, ratios: dict[str, float], base: float = 100.0) -> None:
    lines = [f"[DEBUG_GRAD_NORM][POST_BACKWARD_LAYER] module.module.{n} norm={base * r!r}" for n, r in ratios.items()]
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("where, beyond", [(0.5, False), (2.0, True)])
def test_synthetic_logs_within_and_beyond_the_bound(tmp_path, where, beyond):
    """Two 8-layer logs whose ratio at each layer is 1 + where x the largest two honest runs can differ there."""
    names = ["language_model.output_layer.weight"] + [f"language_model.decoder.layers.{i}.mlp.linear_fc2.weight" for i in range(7, -1, -1)]
    names.append("language_model.embedding.word_embeddings.weight")
    order = bound.exponents(["output_layer", *[f"layers.{i}" for i in range(7, -1, -1)], "embedding"], 8)
    labels = ["output_layer", *[f"layers.{i}" for i in range(7, -1, -1)], "embedding"]
    ratios = {}
    for n, lab in zip(names, labels):
        b = bound.bound(order[lab], "bf16")
        ratios[n] = 1 + where * 2 * b / (1 - b)
    _log(tmp_path / "a.log", {n: 1.0 for n in names})
    _log(tmp_path / "b.log", ratios)
    res = CliRunner().invoke(app, ["judge", "--log-a", str(tmp_path / "a.log"), "--log-b", str(tmp_path / "b.log"),
                                   "--out", str(tmp_path / "o")])  # fmt: skip
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "o" / "judge.json").read_text())
    assert doc["bound"]["constants"]["L"] == 8
    assert [r["beyond"] for r in doc["bound"]["rows"]] == [beyond] * len(names)
    assert ("BEYOND honest round-off" if beyond else "within honest round-off") in res.stdout


def test_the_logs_alone_print_the_environment_variable_recipe():
    """The recipe is the README's: the wheel and doctor, ORACLE_CAPTURE=... on the unchanged swift command with the
    seeds pinned, both clusters; capture_rank only for custom loops."""
    res = CliRunner().invoke(app, ["judge", *LOGS])
    out = res.stdout
    pinned = "--model Qwen/Qwen3-VL-8B-Instruct --seed 42 --data_seed 42 ..."  # the same step on both (README)
    assert f"ORACLE_CAPTURE=/shared/h20-step swift megatron sft {pinned}   # your flags unchanged" in out
    assert f"ORACLE_CAPTURE=/shared/910b-step swift megatron sft {pinned}" in out
    # the README's install: a wheel of the checkout, offline, checked by doctor; never a PyPI name
    assert "pip install\n--no-index --no-deps dist/oracle_fp64-*.whl" in out and "python -m oracle doctor DIR" in out
    assert "pip install oracle-fp64" not in out and 'pip install "oracle-fp64' not in out
    assert "oracle judge /shared/h20-step/pre /shared/910b-step/pre --recipe qwen3-vl --name H20 --name 910B" in out
    assert out.index("ORACLE_CAPTURE=") < out.index("Only for a custom training loop") < out.index("capture_rank(model")


def test_judge_writes_the_bound_into_its_text_json_and_html(step, tmp_path):
    """`oracle judge` on the honest capture and one with 3x the bound at layer 0: every report file carries the bound."""
    _, cap, _, _ = step
    bad, b = _planted(step, "layers.0", 3.0)
    work = tmp_path / "work"
    res = CliRunner().invoke(app, ["judge", cap, bad, "--name", "H20", "--name", "NPU", "--ensemble", "2", "--out", str(work)])
    assert res.exit_code == 0, res.output
    assert "H20: within the analytic bound at every layer" in res.stdout
    assert "NPU: beyond the analytic bound at 1/" in res.stdout and "first along the backward at layers.0 (3.0x)" in res.stdout
    doc = json.loads((work / "report" / "judge.json").read_text())
    npu = next(c for c in doc["score"]["captures"] if c["name"] == "NPU")
    row = next(r for r in npu["layers"] if r["name"] == "layers.0")
    n_acc = next(r["num_tokens"] for r in doc["runs"] if r["name"] == "NPU")  # the accumulation term: 2^-16 sqrt(N) u
    assert n_acc and row["bound"] == pytest.approx(bound.bound(4, "bf16", n_acc=n_acc), rel=1e-12)
    assert row["bound"] == pytest.approx(b, rel=1e-3) and row["bound_class"] == "beyond"
    assert [r["run"] for r in doc["answers"]["bound"]["per_run"]] == ["H20", "NPU"]
    page = (work / "report" / "index.html").read_text()
    assert "<th>analytic bound</th>" in page and "class='bound'" in page and "NPU: beyond the analytic bound" in page
    assert "x bound" in (work / "report" / "judge.txt").read_text()
