"""A streamed replay restarts itself once with malloc's large chunks on transparent huge pages
(oracle/replay/streaming/pages.py); nothing else does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from oracle.replay.streaming import pages

ROOT = Path(__file__).resolve().parents[2]


def test_only_a_streamed_replay_without_the_tunable_restarts():
    """replay --max-memory (either spelling) wants it; other commands, a set tunable, or ORACLE_HUGE_PAGES=0 do not."""
    assert pages.wanted(["replay", "cap", "--out", "o", "--max-memory", "4G"], {})
    assert pages.wanted(["replay", "cap", "--max-memory=4G"], {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert not pages.wanted(["replay", "cap", "--out", "o"], {})
    assert not pages.wanted(["capture", "--max-memory", "4G"], {})
    assert not pages.wanted(["replay", "cap", "--max-memory", "4G"], {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    assert not pages.wanted(["replay", "cap", "--max-memory", "4G"], {"ORACLE_HUGE_PAGES": "0"})


def test_ensure_restarts_the_same_command_line_with_the_tunable_added(monkeypatch):
    """The same interpreter and arguments, GLIBC_TUNABLES keeping what was there plus hugetlb=1."""
    seen = {}
    monkeypatch.setattr(os, "execve", lambda exe, argv, env: seen.update(exe=exe, argv=argv, env=env))
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "oracle", "replay", "c", "--max-memory", "1G"])
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    monkeypatch.delenv("ORACLE_HUGE_PAGES", raising=False)
    pages.ensure(["replay", "c", "--max-memory", "1G"])
    assert seen["exe"] == sys.executable and seen["argv"] == [sys.executable, "-m", "oracle", "replay", "c", "--max-memory", "1G"]
    assert seen["env"]["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    seen.clear()
    pages.ensure(["replay", "c"])  # not streamed: no restart
    assert seen == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables")
def test_the_command_line_runs_a_streamed_replay_with_the_tunable(tmp_path):
    """A process started for replay --max-memory restarts exactly once and then carries the tunable
    (the probe line is written only after the restart: one line, with hugetlb=1)."""
    probe = tmp_path / "env"
    code = ("import os, sys; sys.argv[0] = 'oracle'; from oracle.replay.streaming.pages import ensure; ensure(); "
            f"open({str(probe)!r}, 'a').write(os.environ.get('GLIBC_TUNABLES', '') + '\\n')")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "ORACLE_HUGE_PAGES")}
    r = subprocess.run([sys.executable, "-c", code, "replay", "missing", "--max-memory", "1G"], cwd=ROOT, env=env,
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert probe.read_text().splitlines() == ["glibc.malloc.hugetlb=1"]  # restarted once, with the tunable


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_mmap_threshold_is_pinned_at_1_mib_unless_raised():
    """tame_malloc pins the mmap threshold at 1 MiB by default (a freed tensor leaves the process: the
    budget's estimate holds) and at ORACLE_MALLOC_MMAP_MB when set: 100 allocations of an 8 MiB
    tensor then fault its pages once (reused from the heap) at 32, and about 2048 faults each at
    the default; a malformed value falls back to the default."""
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
    assert min(faults["1"], faults[""], faults["lots"]) > 100 * 1500, faults  # every allocation faults its pages again
    assert faults["32"] < 100 * 100, faults  # the heap's pages are reused
