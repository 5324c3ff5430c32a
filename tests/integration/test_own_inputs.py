"""No command writes into or over its own inputs, and a merge never takes a step caught between its stages
(issue 41): `oracle merge R1/pre --out R1/pre/rank00000 --overwrite` replaced its input; `oracle replay cap --out
cap --overwrite` would have; `oracle score truth cap --json cap/manifest.json`, `oracle compare-logs a.log b.log
--json a.log` and `oracle judge cap capB --out capB/j` wrote over or into theirs (capture and import-msprobe
likewise); ranks recorded at stage 'mid-step' were merged as if finalized."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import invoke
from test_stale_ranks import HF, rank

from oracle.bundle.store import Bundle


@pytest.fixture
def pre(tmp_path) -> Path:
    """One TP1 rank folder (no Megatron needed) and its HF config."""
    rank(tmp_path / "pre", 0, 1, 0)
    (tmp_path / "hf.json").write_text(json.dumps(HF))
    return tmp_path / "pre"


def _merge(pre: Path, out: Path, *extra):
    return invoke("merge", pre, "--out", out, "--recipe", "qwen3", "--hf-config", pre.parent / "hf.json", *extra)


@pytest.mark.parametrize("where", ["over a rank", "inside the folder", "over the folder"])
def test_a_merge_into_or_over_its_own_input_is_refused(pre, where):
    """--out a rank it reads (with --overwrite), a new folder inside the rank folder, the rank folder itself:
    exit 6 naming the input, every rank byte for byte as it was."""
    out = {"over a rank": pre / "rank00000", "inside the folder": pre / "merged", "over the folder": pre}[where]
    before = {p: p.read_bytes() for p in sorted(pre.rglob("*")) if p.is_file()}
    res = _merge(pre, out, "--overwrite")
    assert res.exit_code == 6 and "the input" in res.output and "never writes into or over" in res.output, res.output
    assert {p: p.read_bytes() for p in sorted(pre.rglob("*")) if p.is_file()} == before


def test_a_replay_over_its_own_capture_is_refused(fp32_capture, tmp_path):
    """`oracle replay cap --out cap --overwrite`: exit 6, the capture untouched."""
    before = (Path(fp32_capture) / "manifest.json").read_bytes()
    res = invoke("replay", fp32_capture, "--out", fp32_capture, "--overwrite")
    assert res.exit_code == 6 and "the input" in res.output, res.output
    assert (Path(fp32_capture) / "manifest.json").read_bytes() == before and Bundle(fp32_capture).kind == "capture"


def test_ranks_recorded_mid_step_are_not_merged(pre, tmp_path):
    """A rank whose manifest says stage 'mid-step' (neither before nor after the finalize): exit 4 naming the stage
    and the two it can merge; nothing written."""
    m = json.loads((pre / "rank00000" / "manifest.json").read_text())
    m["megatron"]["stage"] = "mid-step"
    (pre / "rank00000" / "manifest.json").write_text(json.dumps(m))
    res = _merge(pre, tmp_path / "m")
    assert res.exit_code == 4 and "'mid-step'" in res.output and "'pre-finalize' or 'post-finalize'" in res.output, res.output
    assert not (tmp_path / "m").exists()
    m["megatron"]["stage"] = "post-finalize"  # the control: the same rank as recorded merges
    (pre / "rank00000" / "manifest.json").write_text(json.dumps(m))
    assert _merge(pre, tmp_path / "m").exit_code == 0


def _bytes(*paths) -> dict:
    return {p: p.read_bytes() for d in paths for p in sorted([Path(d)] if Path(d).is_file() else Path(d).rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["--json over the capture's manifest", "--json inside the capture", "--report the capture",
                                   "--report inside the oracle"])  # fmt: skip
def test_a_score_report_into_or_over_its_own_input_is_refused(fp32_capture, oracle_bundle, tmp_path, where):
    """`oracle score truth cap --json cap/manifest.json` (was exit 0: the capture's manifest replaced by the
    scores) and the like: exit 6 naming the option and the input, before the work; every input byte as it was."""
    cap = Path(fp32_capture)
    opt, path = {"--json over the capture's manifest": ("--json", cap / "manifest.json"),
                 "--json inside the capture": ("--json", cap / "s.json"),
                 "--report the capture": ("--report", cap),
                 "--report inside the oracle": ("--report", Path(oracle_bundle) / "rep")}[where]  # fmt: skip
    before = _bytes(cap, oracle_bundle)
    res = invoke("score", oracle_bundle, cap, opt, path)
    assert res.exit_code == 6 and f"{opt} {path}" in res.output and "never writes into or over" in res.output, res.output
    assert res.stdout == "" and res.output.startswith("error: ")  # refused before the scoring: no report printed
    assert _bytes(cap, oracle_bundle) == before


def test_a_report_folder_that_holds_the_inputs_is_fine(fp32_capture, oracle_bundle, tmp_path):
    """The control: a --report folder beside the captures (holding them, not inside them) is written, exit 0."""
    cap = shutil.copytree(fp32_capture, tmp_path / "cap")
    res = invoke("score", oracle_bundle, cap, "--report", tmp_path, "--json", tmp_path / "s.json")
    assert res.exit_code == 0 and (tmp_path / "index.html").is_file() and (tmp_path / "s.json").is_file(), res.output


def test_compare_logs_json_over_a_log_is_refused(tmp_path):
    """`oracle compare-logs a.log b.log --json a.log` (was exit 0: the log replaced by the JSON): exit 6, the log as it was."""
    data = Path(__file__).resolve().parents[1] / "data"
    a, b = (Path(shutil.copyfile(data / n, tmp_path / n)) for n in ("h20_rank0_grad_norms.log", "910b_rank0_grad_norms.log"))
    before = a.read_bytes()
    res = invoke("compare-logs", a, b, "--json", a)
    assert res.exit_code == 6 and f"--json {a} is the input" in res.output, res.output
    assert a.read_bytes() == before
    assert invoke("compare-logs", a, b, "--json", tmp_path / "c.json").exit_code == 0


@pytest.mark.parametrize("where", ["inside run B", "holding run A"])
def test_a_judge_into_or_over_its_own_runs_is_refused(fp32_capture, tmp_path, where):
    """`oracle judge cap capB --out capB/j` (was exit 0: the work folder and report written into run B) and an --out
    holding a run: exit 6 naming the run, before any stage; the runs as they were."""
    a, b = shutil.copytree(fp32_capture, tmp_path / "a"), shutil.copytree(fp32_capture, tmp_path / "w" / "b")
    out = {"inside run B": b / "j", "holding run A": tmp_path}[where]
    before = _bytes(a, b)
    res = invoke("judge", a, b, "--out", out)
    assert res.exit_code == 6 and f"--out {out}" in res.output and "never writes into or over" in res.output, res.output
    assert _bytes(a, b) == before and not (b / "j").exists()


@pytest.mark.parametrize("command", ["capture", "import-msprobe"])
def test_a_capture_or_import_into_what_it_reads_is_refused(tmp_path, command):
    """`oracle capture --sample s.jsonl --out s.jsonl/cap` and `oracle import-msprobe DUMP --out DUMP/ms`: exit 6 naming
    the input, before the step or the dump is read; nothing written."""
    if command == "capture":
        src = tmp_path / "s.jsonl"
        src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}) + "\n")
        res = invoke("capture", "--sample", src, "--out", src / "cap")
    else:
        src = tmp_path / "dump"
        src.mkdir()
        res = invoke("import-msprobe", src, "--out", src / "ms")
    assert res.exit_code == 6 and f"is inside the input {src}" in res.output, res.output
    assert sorted(p.name for p in tmp_path.rglob("*")) == [src.name]
