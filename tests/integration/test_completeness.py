"""Every part of a capture is there or its absence is named (issue 30, item 3): a capture without
gradients is refused (exit 4), one whose manifest leaves recipe, precision or loss unsaid is judged
INCOMPLETE with the reason, a replay of one without a loss says so; bundles that state them (null
where not known) keep working as before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from oracle.score.scorer import score

runner = CliRunner()


def edited(src, dst: Path, fn) -> Path:
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    fn(m)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


@pytest.mark.parametrize("how", ["no group", "empty group"])
def test_a_capture_without_gradients_is_never_scored_exit_4(fp32_capture, oracle_bundle, tmp_path, how):
    """No 'grads' group, or an empty one: exit 4 naming the group, never exit 0."""
    def drop(m):
        if how == "no group":
            del m["tensors"]["grads"]
        else:
            m["tensors"]["grads"] = {}

    cap = edited(fp32_capture, tmp_path / "cap", drop)
    r = runner.invoke(app, ["score", oracle_bundle, str(cap)])
    assert r.exit_code == 4, r.output
    assert "a capture needs its gradients: the 'grads' group is missing or empty" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("field,reason", [
    ("recipe", "'recipe' is missing: the model it belongs to is unknown"),
    ("precision", "'precision' is missing: its band and tolerance cannot be chosen"),
    ("loss", "'loss' is missing: the replayed loss cannot be checked"),
])  # fmt: skip
def test_a_manifest_leaving_a_field_unsaid_is_judged_incomplete_with_the_reason(fp32_capture, oracle_bundle, tmp_path, field, reason):
    """The same gradients that are within noise with the field are INCOMPLETE without it, the reason named: the
    report's first line says INCOMPLETE and `oracle score` exits 4 naming the field (issue 41: exit 0, INCOMPLETE
    only in the verdict section), after writing --json; the complete capture exits 0."""
    whole = score(oracle_bundle, [fp32_capture])["captures"][0]["verdict"]
    assert whole["class"] == "within_noise"
    assert runner.invoke(app, ["score", oracle_bundle, fp32_capture]).exit_code == 0
    cap = edited(fp32_capture, tmp_path / "cap", lambda m: m.pop(field))
    r = runner.invoke(app, ["score", oracle_bundle, str(cap), "--json", str(tmp_path / "s.json")])
    assert r.exit_code == 4 and r.stdout.startswith(f"INCOMPLETE: cap: its manifest {reason}"), r.output
    assert f"error: 1 capture manifest field(s) the verdict needs are not stated:\n  cap: its manifest {reason}" in r.stderr
    assert json.loads((tmp_path / "s.json").read_text())["captures"][0]["verdict"]["class"] == "incomplete"
    v = score(oracle_bundle, [cap])["captures"][0]["verdict"]
    assert v["class"] == "incomplete" and v["checked_class"] == "within_noise" and reason in v["text"]


def test_a_precision_given_as_null_is_incomplete_and_stated_values_keep_working(fp32_capture, oracle_bundle, tmp_path):
    """precision null cannot choose a band (incomplete); a loss stated as null (a custom loop) and a
    recipe without a name are what writers record when they do not know: judged as before."""
    cap = edited(fp32_capture, tmp_path / "null", lambda m: m.update(precision=None))
    v = score(oracle_bundle, [cap])["captures"][0]["verdict"]
    assert v["class"] == "incomplete" and "'precision' is not given" in v["text"]
    r = runner.invoke(app, ["score", oracle_bundle, str(cap)])
    assert r.exit_code == 4 and r.stdout.startswith("INCOMPLETE: null: its manifest 'precision' is not given"), r.output
    ok = edited(fp32_capture, tmp_path / "stated", lambda m: m.update(loss=None, recipe={"name": None, "config": {}}))
    assert score(oracle_bundle, [ok])["captures"][0]["verdict"]["class"] == "within_noise"


@pytest.mark.parametrize("how", ["absent", "null"])
def test_a_capture_without_a_loss_is_replayed_saying_so(fp32_capture, tmp_path, how):
    cap = edited(fp32_capture, tmp_path / "cap", lambda m: m.pop("loss") if how == "absent" else m.update(loss=None))
    r = runner.invoke(app, ["replay", str(cap), "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    said = "its manifest has no 'loss'" if how == "absent" else "its loss was not recorded (null)"
    assert f"records no loss ({said}): the replayed loss cannot be checked" in r.output


@pytest.mark.parametrize("field", ["recipe", "loss", "precision"])
@pytest.mark.parametrize("which", [0, 1], ids=["run A", "run B"])
def test_a_judge_of_a_capture_lacking_a_stated_field_is_refused_before_any_replay(fp32_capture, tmp_path, field, which):
    """`oracle judge cap capB` with either run's manifest lacking recipe, loss or precision (issue 41: exit 0 with
    "capB is faulty"): exit 4 naming the run and the field, before any stage ran; nothing but the marker written."""
    bad = edited(fp32_capture, tmp_path / "capB", lambda m: m.pop(field))
    runs = [fp32_capture, str(bad)] if which else [str(bad), fp32_capture]
    r = runner.invoke(app, ["judge", *runs, "--name", "A", "--name", "B", "--out", str(tmp_path / "j")])
    assert r.exit_code == 4 and f"'{field}' is missing" in r.output and ("B (" if which else "A (") in r.output, r.output
    assert "faulty" not in r.output and "Traceback" not in r.output
    assert not (tmp_path / "j").exists() or sorted(p.name for p in (tmp_path / "j").iterdir()) == [".oracle-judge"]
