"""Crashes and holes closed at the boundary (issue 21, item 5): each bad value gets its documented
exit code and one error line, never exit 1 or a traceback, and no option can switch the referee off."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import invoke, rewrite_grads

from oracle.errors import LogParseError, UsageError
from oracle.integrations import normlog
from oracle.replay.streaming.engine import parse_size
from oracle.score.scorer import score


def test_a_manifest_without_tensors_is_exit_4_naming_the_field(fp32_capture, oracle_bundle, tmp_path):
    """No `tensors` key: refused as a malformed bundle (exit 4, 'tensors: missing'), not a KeyError."""
    bad = tmp_path / "nt"
    shutil.copytree(fp32_capture, bad)
    m = json.loads((bad / "manifest.json").read_text())
    del m["tensors"]
    (bad / "manifest.json").write_text(json.dumps(m))
    for args in (["score", oracle_bundle, bad], ["replay", bad, "--out", tmp_path / "o"],
                 ["replay", bad, "--out", tmp_path / "o", "--dry-run", "--max-memory", "1G"]):  # fmt: skip
        res = invoke(*args)
        assert res.exit_code == 4 and "tensors: missing" in res.output, res.output


@pytest.mark.parametrize("spec", ["inf", "1e400", "nan", "-inf", "1e400G", "2e18G"])
def test_infinite_or_absurd_memory_budgets_are_usage_errors(spec, fp32_capture, tmp_path):
    """--max-memory inf / 1e400 / nan: exit 2 with the expected form, not an OverflowError."""
    with pytest.raises(UsageError, match="finite size|expected a size"):
        parse_size(spec)
    res = invoke("replay", fp32_capture, "--out", tmp_path / "o", "--max-memory", spec)
    assert res.exit_code == 2 and "--max-memory" in res.output, res.output


@pytest.mark.parametrize("margin", ["inf", "nan", "-1", "0.5"])
def test_a_margin_must_be_finite_and_at_least_one(margin, fp32_capture, oracle_bundle, tmp_path):
    """--margin inf would pass any fault: refused, exit 2, by the CLI (>= 1) and, when not finite and
    positive, by score() alike."""
    res = invoke("score", oracle_bundle, fp32_capture, "--margin", margin)
    assert res.exit_code == 2, res.output
    if margin != "0.5":
        with pytest.raises(UsageError, match="--margin"):
            score(oracle_bundle, [fp32_capture], margin=float(margin))


def test_a_planted_fault_cannot_be_hidden_by_an_infinite_margin(fp32_capture, oracle_bundle, tmp_path):
    """A 50000x fault is beyond noise at the default margin and no --margin can make it pass."""
    bad = rewrite_grads(fp32_capture, str(tmp_path / "bad"), lambda n, g: g * 2 if "layers.1.mlp.down_proj" in n else g)
    c = score(oracle_bundle, [bad])["captures"][0]
    assert c["verdict"]["class"] == "beyond_noise" and c["verdict"]["excess"] > 1000
    with pytest.raises(UsageError):
        score(oracle_bundle, [bad], margin=float("inf"))


def test_a_tol_floor_applies_without_a_band(fp32_capture, oracle_bundle, tmp_path):
    """--tol fp32:floor=V raises every band to V when no --band is given (it had no effect)."""
    bad = rewrite_grads(fp32_capture, str(tmp_path / "bad"), lambda n, g: g * 1.01 if "layers.1.mlp.down_proj" in n else g)
    plain = score(oracle_bundle, [bad])["captures"][0]
    assert plain["verdict"]["class"] == "beyond_noise"
    floored = score(oracle_bundle, [bad], tol_overrides={"fp32": {"floor": 0.5}})["captures"][0]
    assert {p["band"] for p in floored["params"]} == {0.5} and {r["band"] for r in floored["layers"]} == {0.5}
    assert floored["verdict"]["class"] == "within_noise"
    res = invoke("score", oracle_bundle, bad, "--tol", "fp32:floor=0.5")
    assert res.exit_code == 0 and "within noise" in res.output, res.output


def test_a_catastrophic_pattern_is_stopped_by_the_time_guard(tmp_path, monkeypatch):
    """A backtracking --pattern ((a|aa)+ on 'aaa...b': about fib(60) = 1.5e12 steps) is stopped by the guard with
    exit 8, naming the line and the guard's 0.2 s (only the guard can end that search: no clock is read here)."""
    log = tmp_path / "x.log"
    log.write_text("[DEBUG_GRAD_NORM][X] a.weight norm=1.0\n" + "a" * 60 + "b\n")
    monkeypatch.setattr(normlog, "PATTERN_LINE_SECONDS", 0.2)
    with pytest.raises(LogParseError, match="line 2: the pattern .* took over 0.2 s"):
        normlog.parse(log, pattern=r"^(?P<name>(a|aa)+)(?P<value>\d)$")
    res = invoke("import-log", log, "--out", tmp_path / "n", "--pattern", r"^(?P<name>(a|aa)+)(?P<value>\d)$")
    assert res.exit_code == 8 and "catastrophic backtracking" in res.output, res.output
    assert not (tmp_path / "n").exists()
