"""`oracle judge` end to end on two real megatron-core 0.12.1 peer runs of one step (TP 2, padded
vocabulary): H20 honest, NPU with the gradient entering decoder layer 1's MLP scaled by 1.02 in the
backward. One command from the two rank folders to a report; killed midway and rerun it resumes;
the HTML page is checked in a real headless browser."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from megatron_peer import run_peer
from typer.testing import CliRunner

from cli import app

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
ARGS = ["--recipe", "qwen3", "--name", "H20", "--name", "NPU", "--ensemble", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge")
    run_peer(str(root / "h20"), tp=2, sp=False, port=29701, vocab=200, divisible_by=128)
    run_peer(str(root / "npu"), tp=2, sp=False, port=29711, vocab=200, divisible_by=128, fault=(1, 1.02))
    return root


@pytest.fixture(scope="module")
def judged(runs):
    """One uninterrupted judge run, streamed within 1G: (work folder, CLI result)."""
    work = runs / "work"
    res = CliRunner().invoke(app, ["judge", str(runs / "h20" / "pre"), str(runs / "npu" / "pre"), "--out", str(work),
                                   "--max-memory", "1G", *ARGS])  # fmt: skip
    return work, res


def _cmd(runs, work, *extra):
    return [sys.executable, "-m", "oracle", "judge", str(runs / "h20" / "pre"), str(runs / "npu" / "pre"), "--out", str(work),
            "--max-memory", "1G", *ARGS, *extra]  # fmt: skip


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _report(work: Path) -> dict:
    """The report with the work folder's own path taken out (two work folders, one report)."""
    return json.loads((work / "report" / "judge.json").read_text().replace(str(work), "WORK"))


def test_one_command_names_the_faulty_run_module_direction_and_op_class_first(judged):
    """The report's first line names NPU, decoder layer 1's MLP, the backward, and a scaling op; H20 is honest."""
    work, res = judged
    assert res.exit_code == 0, res.output
    first = res.stdout.splitlines()[0]
    assert first == ("answer: NPU is faulty (beyond its own noise band); born in model.layers.1.mlp (backward); "
                     "op class: scaling"), first  # fmt: skip
    doc = json.loads((work / "report" / "judge.json").read_text())
    assert doc["schema_version"] == 1 and doc["kind"] == "oracle-judge"
    noise = {r["run"]: r for r in doc["answers"]["noise"]["per_run"]}
    assert noise["H20"]["honest"] and not noise["NPU"]["honest"]
    assert doc["answers"]["farther"]["run"] == "NPU"
    born = {r["run"]: r for r in doc["answers"]["born"]["per_run"]}
    assert born["NPU"]["module"] == "model.layers.1.mlp" and born["NPU"]["direction"] == "backward"
    assert born["H20"]["module"] is None
    assert doc["stages"] == ["merge-H20", "merge-NPU", "truth", "band-fp32", "score", "report"]
    assert any("module boundaries" in x for x in doc["not_concluded"])


def test_killed_midway_and_rerun_resumes_and_ends_with_the_same_report(runs, judged):
    """SIGKILL while the band is replayed; the rerun reuses merge and truth and writes the same report."""
    work = runs / "work-killed"
    p = subprocess.Popen(_cmd(runs, work), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=_env(), cwd=REPO)
    seen = []
    for line in p.stderr:
        seen.append(line)
        if "band-fp32: emulate" in line:
            time.sleep(0.3)
            p.send_signal(signal.SIGKILL)
            break
    p.wait(timeout=120)
    assert p.returncode == -signal.SIGKILL, "".join(seen)
    assert not (work / "report" / "judge.json").exists()
    again = subprocess.run(_cmd(runs, work), capture_output=True, text=True, env=_env(), cwd=REPO, timeout=600)
    assert again.returncode == 0, again.stderr
    for stage in ("merge-H20", "merge-NPU", "truth"):
        assert f"{stage}: reused (inputs unchanged)" in again.stderr, again.stderr
    assert "band-fp32: done" in again.stderr
    assert _report(work) == _report(judged[0])


def test_a_rerun_with_unchanged_inputs_reuses_every_stage(runs, judged):
    """Nothing is recomputed when no input changed; the report is the same."""
    work, _ = judged
    before = _report(work)
    res = CliRunner().invoke(app, ["judge", str(runs / "h20" / "pre"), str(runs / "npu" / "pre"), "--out", str(work),
                                   "--max-memory", "1G", *ARGS])  # fmt: skip
    assert res.exit_code == 0, res.output
    for stage in ("merge-H20", "merge-NPU", "truth", "band-fp32", "score"):
        assert f"{stage}: reused" in res.stderr
    assert _report(work) == before


def test_dry_run_lists_every_stage_without_out(runs, tmp_path, monkeypatch):
    """--dry-run needs no --out, writes nothing, and gives time, GFLOP, memory and disk per stage."""
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["judge", str(runs / "h20" / "pre"), str(runs / "npu" / "pre"), "--dry-run",
                                   "--max-memory", "1G", *ARGS])  # fmt: skip
    assert res.exit_code == 0, res.output
    for stage in ("merge-H20", "merge-NPU", "truth", "band-fp32", "score", "report"):
        assert any(line.strip().startswith(stage) for line in res.stdout.splitlines()), res.stdout
    assert "time" in res.stdout and "GFLOP" in res.stdout and "peak memory" in res.stdout and "disk" in res.stdout
    assert list(tmp_path.iterdir()) == []


def test_another_step_is_refused_before_any_replay(runs, tmp_path):
    """Run B of another step (a merged capture with its tokens changed) exits 5 before any replay: no truth is made."""
    import torch

    from oracle.bundle.store import Bundle, BundleWriter
    from oracle.integrations.megatron.merge import merge_ranks

    merged = merge_ranks([runs / "npu" / "pre"], tmp_path / "npu.merged", recipe="qwen3")
    b = Bundle(merged)
    other = tmp_path / "other.bundle"
    with BundleWriter(other, "capture") as w:
        w.manifest.update({k: v for k, v in b.manifest.items() if k not in ("tensors", "schema_version", "kind", "megatron")})
        for group in b.groups():
            t = b.load_group(group)
            if group == "inputs":
                t["tokens"] = (t["tokens"] + 1) % 200
            w.add(group, t)
    work = tmp_path / "work"
    res = CliRunner().invoke(app, ["judge", str(runs / "h20" / "pre"), str(other), "--out", str(work), *ARGS])
    assert res.exit_code == 5, res.output
    assert "not the step the oracle replays" in res.stderr and "inputs/tokens: values differ" in res.stderr
    assert not (work / "truth").exists()


def test_the_logs_alone_say_what_they_show_what_they_cannot_and_how_to_capture(tmp_path):
    """No capture: the ratio profile and standing-out kinds, what cannot be concluded, both capture commands."""
    res = CliRunner().invoke(app, ["judge", "--log-a", str(DATA / "h20_rank0_grad_norms.log"), "--log-b",
                                   str(DATA / "910b_rank0_grad_norms.log"), "--name", "H20", "--name", "910B",
                                   "--out", str(tmp_path / "logs")])  # fmt: skip
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "910B/H20 gradient-norm ratio" in out and "toward the input" in out
    assert "Parameter kind that stands out" in out
    assert "what cannot be concluded without a capture" in out and "which run is right" in out
    assert "capture_rank(model" in out and "H20 (CUDA)" in out and "910B (NPU)" in out and "oracle judge h20/pre 910b/pre" in out
    doc = json.loads((tmp_path / "logs" / "judge.json").read_text())
    assert doc["kind"] == "oracle-judge-logs" and doc["schema_version"] == 1 and doc["compare"]["layers"]


def test_judge_usage_mistakes_exit_2(runs, tmp_path):
    """One run, one log, rank folders without --recipe, a full run without --out: exit 2, no traceback."""
    a, b = str(runs / "h20" / "pre"), str(runs / "npu" / "pre")
    cases = [["judge", a], ["judge", a, b, "--log-a", str(DATA / "h20_rank0_grad_norms.log")], ["judge", a, b, "--out", str(tmp_path / "w")],
             ["judge", a, b, "--recipe", "qwen3"], ["judge", str(runs / "h20"), b, "--recipe", "qwen3", "--out", str(tmp_path / "w")]]  # fmt: skip
    for args in cases:
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert "Traceback" not in res.output
    res = CliRunner().invoke(app, ["judge", str(runs / "h20"), b, "--recipe", "qwen3", "--out", str(tmp_path / "w")])
    assert "holds several capture folders (post, pre)" in res.stderr


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_the_html_report_renders_in_a_headless_browser(judged, tmp_path):
    """Chromium renders the page: the headline and verdicts are in the DOM, the plot image decoded, no script error."""
    work, _ = judged
    page = (work / "report" / "index.html").resolve()
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}"]
    probe = tmp_path / "probe.html"  # the page plus a check that runs after load and writes into the DOM
    probe.write_text(page.read_text().replace("</body>", "<script>window.addEventListener('load',function(){var i=document."
                     "getElementById('plot');var p=document.createElement('p');p.id='probe';p.textContent='plot '+(i&&i.complete&&"
                     "i.naturalWidth>0?'decoded '+i.naturalWidth+'x'+i.naturalHeight:'missing')+'; errors '+window.__errors.length;"
                     "document.body.appendChild(p);});</script></body>"))  # fmt: skip
    dom = subprocess.run([*base, "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert "answer: NPU is faulty" in html and "born in model.layers.1.mlp (backward)" in html
    assert "id=\"verdicts\"" in html and "beyond_noise" in html and "within_noise" in html
    assert "plot decoded" in html and "; errors 0" in html, html[-500:]
    assert '<pre id="js-errors"></pre>' in html
    console = [ln for ln in dom.stderr.splitlines() if "CONSOLE" in ln and ("Error" in ln or "error" in ln)]
    assert not console, console
    shot = tmp_path / "judge-report.png"
    res = subprocess.run([*base, f"--screenshot={shot}", "--window-size=1280,2400", page.as_uri()], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0 and shot.stat().st_size > 10_000, res.stderr[-2000:]
