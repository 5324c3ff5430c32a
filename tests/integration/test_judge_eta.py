"""`oracle judge`'s first estimates from deterministic inputs: a fixed probe and a fixed GEMM rate, on the
tiny Qwen3-VL, one sample and PACKED samples packed into one step. Whether the estimates match the real
time on this machine, quiet or loaded, depends on the load: ``python benchmarks/judge_eta.py --busy 0,1``
prints each stage's estimate/real ratio against its target (replays within 2x, score and report 3x);
the calibration after each stage is tests/unit/test_eta_logic.py's, with a planted clock."""

from __future__ import annotations

import types

import pytest

from oracle.bundle.store import Bundle
from oracle.pipeline import eta
from oracle.pipeline import judge as judge_mod
from oracle.replay.streaming import plan as plan_mod

PACKED = 8
PROBE_S, RATE = 0.25, 1e9  # the fixed probe (planner seconds per plan) and GEMM rate (FLOP/s) of every estimate here


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """The tiny Qwen3-VL's sample packed PACKED times into one step, captured in fp32 and in amp-bf16."""
    from oracle import recipe as recipes
    from oracle.capture.steps import capture_recipe_step

    r, root = recipes.get("qwen3-vl"), tmp_path_factory.mktemp("many")
    src, s = r.load("tiny-qwen3-vl"), r.default_sample()
    return tuple(capture_recipe_step(src, [s] * PACKED, str(root / p), precision=p) for p in ("fp32", "amp-bf16"))


def _estimates(monkeypatch, tmp_path, fp32, amp) -> tuple[dict, dict]:
    """judge's estimates of the two captures with the probe fixed at PROBE_S per plan and every GEMM at RATE;
    -> (estimates, the float64 plan)."""
    clock = iter(range(0, 1000))
    plans = 2  # the probe times one plan per band precision (fp32, amp-bf16)
    monkeypatch.setattr(judge_mod, "time", types.SimpleNamespace(perf_counter=lambda: next(clock) * PROBE_S * plans))
    monkeypatch.setattr(plan_mod, "gemm_rates", lambda dtypes, **k: dict.fromkeys(dtypes, RATE))
    j = judge_mod.Judge(fp32, amp, out=tmp_path / "work", ensemble=2, echo=lambda s: None)
    caps = [Bundle(fp32), Bundle(amp)]
    est = j.estimates(caps)
    assert j.probe_s == pytest.approx(PROBE_S)
    return est, plan_mod.plan(caps[0], "fp64", streamed=False)


def test_each_replay_estimate_is_its_flops_plus_its_fixed_cost_and_attention_calls_in_probes(fp32_capture, amp_capture, packed,
                                                                                            monkeypatch, tmp_path):  # fmt: skip
    """From a fixed probe: the planner counts one attention call per packed sample or image and attention module
    (PACKED samples: PACKED x one sample's calls), and the truth and each band are estimated at their GEMM FLOPs
    at the probed rate plus (fixed probes + probes per call x calls) x probe (eta.truth_seconds / member_seconds;
    before the calls were counted a 96-sample step was estimated at 1/8 of its time)."""
    one, one_plan = _estimates(monkeypatch, tmp_path / "one", fp32_capture, amp_capture)
    many, many_plan = _estimates(monkeypatch, tmp_path / "many", *packed)
    calls = one_plan["attention_calls"]
    assert calls > 0 and many_plan["attention_calls"] == PACKED * calls
    for est, p in ((one, one_plan), (many, many_plan)):
        gemm = p["total_flops"] / (RATE * p["efficiency"])
        assert est["truth"]["seconds"] == pytest.approx(eta.truth_seconds(gemm, p["attention_calls"], PROBE_S))
        for prec in ("fp32", "amp-bf16"):
            assert est[f"band-{prec}"]["seconds"] > 2 * eta.MEMBER_CALL_PROBES[prec] * p["attention_calls"] * PROBE_S
    # what the calls add: the truth's estimate grows by its per-call probes for the PACKED - 1 samples' calls more
    extra = (many["truth"]["seconds"] - one["truth"]["seconds"]) - (many_plan["total_flops"] - one_plan["total_flops"]) / (
        RATE * one_plan["efficiency"])  # fmt: skip
    assert extra == pytest.approx(eta.TRUTH_CALL_PROBES * (PACKED - 1) * calls * PROBE_S)
    for prec in ("fp32", "amp-bf16"):  # each band: 2 members, each its per-call probes more
        grew = many[f"band-{prec}"]["seconds"] - one[f"band-{prec}"]["seconds"]
        assert grew >= 2 * eta.MEMBER_CALL_PROBES[prec] * (PACKED - 1) * calls * PROBE_S * 0.999


def test_score_and_report_estimates_are_in_probes_and_bytes_read(fp32_capture, amp_capture, monkeypatch, tmp_path):
    """Score: reading the truth, the captures and the bands (3 x the gradients' bytes at 500 MB/s) plus its probes;
    report: its probes only (drawing and writing); both from the same fixed probe."""
    est, p = _estimates(monkeypatch, tmp_path, fp32_capture, amp_capture)
    assert est["score"]["seconds"] == pytest.approx(3 * p["disk"]["gradients"] / 500e6 + eta.SCORE_PROBES * PROBE_S)
    assert est["report"]["seconds"] == pytest.approx(eta.REPORT_PROBES * PROBE_S)
