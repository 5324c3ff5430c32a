"""Two writers of one --out (issue 32, item 4): exactly one publishes, the other is refused with exit 6
and touches nothing, with and without --overwrite, streamed or not; real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import stream_budget

from oracle.bundle.store import Bundle

pytestmark = pytest.mark.rare  # concurrent writers: .ci/run's `pytest tests -m rare` (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
HOLD = """
import sys, time
from pathlib import Path
from oracle.replay.streaming import workdir
from oracle.replay.run import replay
cap, out, mark = sys.argv[1:4]
real = workdir.open_work
def held(*a, **k):
    got = real(*a, **k)
    Path(mark).write_text("")
    time.sleep(600)  # mid-run, holding its claim on OUT and its work folder
workdir.open_work = held
replay(cap, out, max_memory=int(float(sys.argv[4].rstrip("G")) * 2**30), overwrite=True)
"""


def replay_cmd(cap, out, *extra):
    return [sys.executable, "-m", "oracle", "replay", str(cap), "--out", str(out), "--max-memory", stream_budget(str(cap)), *extra]


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def same_grads(a: Path, b: str) -> bool:
    x, y = Bundle(a), Bundle(b)
    return all(torch.equal(x.load("grads", n), y.load("grads", n)) for n in y.names("grads"))


def test_two_streamed_replays_started_together_one_publishes_one_exit_6(fp32_capture, oracle_bundle, tmp_path):
    """Started at the same moment, no --overwrite: one bundle, one exit 6, no work folder or temporary left."""
    out = tmp_path / "o"
    procs = [subprocess.Popen(replay_cmd(fp32_capture, out), env=ENV, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              text=True) for _ in range(2)]  # fmt: skip
    done = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    assert sorted(c for c, _ in done) == [0, 6], done
    refused = next(err for c, err in done if c == 6)
    assert "is being written by another oracle process now" in refused or "already exists" in refused, refused
    assert "Traceback" not in refused and same_grads(out, oracle_bundle) and leftovers(out) == []


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_a_second_replay_onto_an_out_being_written_is_refused_and_touches_nothing(fp32_capture, oracle_bundle, tmp_path, overwrite):
    """While one streamed replay of OUT runs (held mid-run), a second (streamed, in memory, with or without
    --overwrite) exits 6 naming the live writer; the first's work folder is untouched; once the first is
    gone (SIGKILL) a rerun adopts its work folder and publishes the bundle."""
    out, mark = tmp_path / "o", tmp_path / "running"
    if overwrite:
        out_old = subprocess.run(replay_cmd(fp32_capture, out), env=ENV, capture_output=True, text=True)
        assert out_old.returncode == 0, out_old.stderr
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(fp32_capture), str(out), str(mark), stream_budget(fp32_capture)], env=ENV)
    try:
        t0 = time.time()
        while not mark.exists():
            assert first.poll() is None and time.time() - t0 < 300, "the first replay ended early"
            time.sleep(0.05)
        work = tmp_path / ".o.partial"
        before = sorted((p.relative_to(work), p.stat().st_mtime_ns) for p in work.rglob("*"))
        extra = ["--overwrite"] if overwrite else []
        in_memory = [sys.executable, "-m", "oracle", "replay", str(fp32_capture), "--out", str(out), *extra]
        for cmd in (replay_cmd(fp32_capture, out, *extra), in_memory):
            r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
            assert r.returncode == 6, r.stderr
            assert f"is being written by another oracle process now (pid {first.pid}" in r.stderr, r.stderr
            assert "Traceback" not in r.stderr
        assert sorted((p.relative_to(work), p.stat().st_mtime_ns) for p in work.rglob("*")) == before
    finally:
        first.kill()
        first.wait()
    r = subprocess.run(replay_cmd(fp32_capture, out, "--overwrite"), env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert same_grads(out, oracle_bundle) and leftovers(out) == []
