"""Asked for (ORACLE_HUGE_PAGES=1), a streamed replay restarts itself once with malloc's large chunks
on transparent huge pages (oracle/replay/streaming/pages.py); nothing else does, and by default
nothing does. The streamed replay pins glibc's mmap threshold (engine.tame_malloc)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from oracle.replay.streaming import pages

ROOT = Path(__file__).parent.parent


def test_only_an_asked_for_streamed_replay_without_the_tunable_restarts():
    """ORACLE_HUGE_PAGES=1 and replay --max-memory (either spelling) want it; by default, other
    commands, a set tunable, or ORACLE_HUGE_PAGES=0 do not."""
    on = {"ORACLE_HUGE_PAGES": "1"}
    assert pages.wanted(["replay", "cap", "--out", "o", "--max-memory", "4G"], on)
    assert pages.wanted(["replay", "cap", "--max-memory=4G"], {**on, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert not pages.wanted(["replay", "cap", "--out", "o", "--max-memory", "4G"], {})  # off by default
    assert not pages.wanted(["replay", "cap", "--out", "o"], on)
    assert not pages.wanted(["capture", "--max-memory", "4G"], on)
    assert not pages.wanted(["replay", "cap", "--max-memory", "4G"], {**on, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    assert not pages.wanted(["replay", "cap", "--max-memory", "4G"], {"ORACLE_HUGE_PAGES": "0"})


def test_ensure_restarts_the_same_command_line_with_the_tunable_added(monkeypatch):
    """The same interpreter and arguments, GLIBC_TUNABLES keeping what was there plus hugetlb=1."""
    seen = {}
    monkeypatch.setattr(os, "execve", lambda exe, argv, env: seen.update(exe=exe, argv=argv, env=env))
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "oracle", "replay", "c", "--max-memory", "1G"])
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    monkeypatch.setenv("ORACLE_HUGE_PAGES", "1")
    pages.ensure(["replay", "c", "--max-memory", "1G"])
    assert seen["exe"] == sys.executable and seen["argv"] == [sys.executable, "-m", "oracle", "replay", "c", "--max-memory", "1G"]
    assert seen["env"]["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    seen.clear()
    pages.ensure(["replay", "c"])  # not streamed: no restart
    assert seen == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables")
def test_the_command_line_runs_a_streamed_replay_with_the_tunable(tmp_path):
    """A process started for replay --max-memory with ORACLE_HUGE_PAGES=1 restarts exactly once and
    then carries the tunable (the probe line is written only after the restart: one line, with
    hugetlb=1); without it the process runs as it is (one empty line)."""
    probe = tmp_path / "env"
    code = ("import os, sys; sys.argv[0] = 'oracle'; from oracle.replay.streaming.pages import ensure; ensure(); "
            f"open({str(probe)!r}, 'a').write(os.environ.get('GLIBC_TUNABLES', '') + '\\n')")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "ORACLE_HUGE_PAGES")}
    for asked, line in ((None, ""), ("1", "glibc.malloc.hugetlb=1")):
        probe.unlink(missing_ok=True)
        r = subprocess.run([sys.executable, "-c", code, "replay", "missing", "--max-memory", "1G"], cwd=ROOT,
                           env={**env, **({"ORACLE_HUGE_PAGES": asked} if asked else {})}, capture_output=True, text=True)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert probe.read_text().splitlines() == [line]  # restarted once, with the tunable, only when asked


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_streamed_replay_reuses_tensors_below_32_mib_from_the_heap():
    """tame_malloc pins the mmap threshold at 32 MiB: 100 allocations of an 8 MiB tensor fault in its
    pages once (reused from the heap), where at ORACLE_MALLOC_MMAP_MB=1 each is a fresh mmap faulted
    page by page (about 2048 faults each). A malformed value falls back to the default."""
    code = ("import resource, torch; from oracle.replay.streaming.engine import tame_malloc; tame_malloc()\n"
            "f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "for _ in range(100): torch.ones(1 << 20, dtype=torch.float64)\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)")  # fmt: skip
    faults = {}
    for mb in ("1", "32", "", "lots"):
        env = {**os.environ, "ORACLE_MALLOC_MMAP_MB": mb}
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        faults[mb] = int(r.stdout.split()[-1])
    assert faults["1"] > 100 * 1500, faults  # every allocation faults its 2048 pages again
    assert max(faults["32"], faults[""], faults["lots"]) < 100 * 100, faults  # the heap's pages are reused
