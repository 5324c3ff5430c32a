"""`oracle demo` ends with the judge report's four answers; `oracle demo --bug` plants a wrong gradient
in one decoder layer's backward of the fp32 run and the same report names that run, that layer, the
backward and the op class (a scale)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cli import app


def _answer_block(out: str) -> list[str]:
    lines = out.rstrip().splitlines()
    start = max(i for i, ln in enumerate(lines) if ln.startswith("answer: "))
    return lines[start:]


def test_demo_bug_names_the_faulty_run_layer_direction_and_op_class(tmp_path):
    """--bug: the answer (the output's last block) names cpu-fp32, decoder layer 1, the backward and scaling;
    cpu-amp-bf16 stays honest noise."""
    res = CliRunner().invoke(app, ["demo", "--bug", "--ensemble", "2", "--dir", str(tmp_path / "demo")])
    assert res.exit_code == 0, res.output
    block = _answer_block(res.stdout)
    head = block[0]
    assert head.startswith("answer: cpu-fp32 is faulty (beyond its own noise band); born in model.language_model.layers.1."), head
    assert head.endswith("(backward); op class: scaling"), head
    assert "4. Which op class explains it?" in block and block[-1].startswith("   - ")  # the answers close the output
    assert "bug planted: the gradient into model.language_model.layers.1.mlp x1.02" in res.stderr
    doc = json.loads((tmp_path / "demo" / "judge" / "report" / "judge.json").read_text())
    assert doc["answers"]["noise"]["faulty"] == ["cpu-fp32"]
    born = {r["run"]: r for r in doc["answers"]["born"]["per_run"]}
    assert born["cpu-fp32"]["direction"] == "backward" and ".layers.1." in born["cpu-fp32"]["module"]


def test_demo_without_a_bug_ends_with_the_answer_that_both_runs_are_honest(tmp_path):
    """No bug: the last block is the four answers, both runs honest noise against their own bands."""
    res = CliRunner().invoke(app, ["demo", "--ensemble", "2", "--dir", str(tmp_path / "demo")])
    assert res.exit_code == 0, res.output
    block = _answer_block(res.stdout)
    assert "1. Bug or honest noise (each run against the band of its own precision)?" in block
    assert "faulty" not in block[0] or "no run is faulty" in block[0], block[0]
    doc = json.loads((tmp_path / "demo" / "judge" / "report" / "judge.json").read_text())
    assert doc["answers"]["noise"]["faulty"] == []
