"""`oracle demo` ends with the judge report's four answers; `oracle demo --bug` plants a wrong gradient
in one decoder layer's backward of the fp32 run and the same report names that run, that layer, the
backward and the op class (a scale)."""

from __future__ import annotations

import html
import json

from helpers import options_not_on_their_command
from typer.testing import CliRunner

from cli import app


def _answer_block(out: str) -> list[str]:
    lines = out.rstrip().splitlines()
    start = max(i for i, ln in enumerate(lines) if ln.startswith("answer: "))
    return lines[start:]


def test_demo_then_demo_bug_in_the_same_folder_answers_honest_then_names_the_bug(tmp_path):
    """README's two demos one after the other in one --dir: the first answers that both runs are honest; the
    second says it replaces the first's captures and names cpu-fp32, decoder layer 1, the backward and
    scaling (its judge redoes only the stages whose inputs changed); cpu-amp-bf16 stays honest noise."""
    res = CliRunner().invoke(app, ["demo", "--ensemble", "2", "--dir", str(tmp_path / "demo")])
    assert res.exit_code == 0, res.output
    block = _answer_block(res.stdout)
    assert "1. Bug or honest noise (each run against the band of its own precision)?" in block
    assert "faulty" not in block[0] or "no run is faulty" in block[0], block[0]
    doc = json.loads((tmp_path / "demo" / "judge" / "report" / "judge.json").read_text())
    assert doc["answers"]["noise"]["faulty"] == []
    assert "replacing" not in res.stderr
    # answer 1 says each run once: its joined text is not printed before the same runs' lines
    report = tmp_path / "demo" / "judge" / "report"
    for r in doc["answers"]["noise"]["per_run"]:
        assert res.stdout.count(r["text"]) == 1 and (report / "judge.txt").read_text().count(r["text"]) == 1
        page = (report / "index.html").read_text()
        answer = page[page.index("<li id='answer-noise'>") : page.index("<li id='answer-farther'>")]
        assert answer.count(html.escape(r["text"])) == 1, answer

    res = CliRunner().invoke(app, ["demo", "--bug", "--ensemble", "2", "--dir", str(tmp_path / "demo")])
    assert res.exit_code == 0, res.output
    assert f"replacing the previous demo's captures in {tmp_path / 'demo'}" in res.stderr
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
    # run A (amp-bf16) is the same bytes again: the truth and both bands (replays of run A) are reused, the score redone
    for stage in ("truth", "band-amp-bf16", "band-fp32"):
        assert f"{stage}: reused (inputs unchanged)" in res.stderr, res.stderr
    assert "score: reused" not in res.stderr and "score: done in" in res.stderr
    # hints name options that exist: the demo's own or judge's (the demo runs judge), the judge report's judge's
    assert "more layers in the report's judge.json and index.html" in res.stdout
    assert options_not_on_their_command(res.stdout + res.stderr, "demo", "judge") == []
    report = (tmp_path / "demo" / "judge" / "report" / "judge.txt").read_text()
    assert options_not_on_their_command(report, "judge") == []


def test_a_dir_holding_anything_but_a_demo_is_refused_untouched(tmp_path):
    """--dir with a file of the user's, or a file in its place: exit 6 naming it, nothing written or removed."""
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("keep")
    res = CliRunner().invoke(app, ["demo", "--dir", str(d)])
    assert res.exit_code == 6, res.output
    assert "holds files that are not a demo's (notes.txt)" in res.output and "Traceback" not in res.output
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"] and (d / "notes.txt").read_text() == "keep"
    f = tmp_path / "file"
    f.write_text("x")
    res = CliRunner().invoke(app, ["demo", "--dir", str(f)])
    assert res.exit_code == 6 and "is not a folder" in res.output, res.output
    assert f.read_text() == "x"
