"""A streamed replay restarts itself once with malloc's large chunks on transparent huge pages
(oracle/replay/streaming/pages.py), its --nproc ranks start so; nothing else does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oracle.replay.streaming import pages

ROOT = Path(__file__).resolve().parents[2]


def test_the_tunable_is_wanted_unless_set_or_switched_off():
    """Wanted on Linux; not where GLIBC_TUNABLES already has it or ORACLE_HUGE_PAGES=0."""
    linux = sys.platform.startswith("linux")
    assert pages.wanted({}) == linux
    assert pages.wanted({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == linux
    assert not pages.wanted({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    assert not pages.wanted({"ORACLE_HUGE_PAGES": "0"})
    if linux:
        assert pages.tunable_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
            "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    assert pages.tunable_env({"ORACLE_HUGE_PAGES": "0"}) == {}


def test_restart_runs_the_given_command_line_again_with_the_tunable_added(monkeypatch):
    """The same interpreter and arguments, GLIBC_TUNABLES keeping what was there plus hugetlb=1; once set, no restart."""
    seen = {}
    monkeypatch.setattr(os, "execve", lambda exe, argv, env: seen.update(exe=exe, argv=argv, env=env))
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    monkeypatch.delenv("ORACLE_HUGE_PAGES", raising=False)
    pages.restart([sys.executable, "-m", "oracle", "replay", "c", "--max-memory", "1G"])
    assert seen["exe"] == sys.executable and seen["argv"] == [sys.executable, "-m", "oracle", "replay", "c", "--max-memory", "1G"]
    assert seen["env"]["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    seen.clear()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    pages.restart([sys.executable, "-m", "oracle", "replay", "c", "--max-memory", "1G"])
    assert seen == {}


def test_only_the_streamed_replay_command_restarts(fp32_capture, tmp_path, monkeypatch):
    """oracle replay --max-memory restarts its own command line (sys.orig_argv); in memory, a dry run
    or another command never does."""
    from helpers import invoke

    from oracle.cli import app as app_module

    calls = []

    def fake(argv):
        calls.append(list(argv))
        raise SystemExit(0)  # the restarted process would carry on from here

    monkeypatch.setattr(pages, "restart", fake)
    monkeypatch.setattr(app_module, "_PROGRAM", True)  # as the console script's main() sets it (never a host process)
    invoke("replay", fp32_capture, "--out", tmp_path / "a", "--max-memory", "1G", "--no-verify")
    assert calls == [list(sys.orig_argv)]
    invoke("replay", fp32_capture, "--out", tmp_path / "b", "--max-memory", "1G", "--dry-run")
    r = invoke("replay", fp32_capture, "--out", tmp_path / "c", "--no-verify", "--dtype", "amp-bf16")
    assert r.exit_code == 0, r.output
    assert len(calls) == 1


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


def test_a_budget_with_room_runs_the_faster_mmap_threshold_and_a_tight_one_keeps_1_mib(fp32_capture, tmp_path):
    """roomy_mmap_mb: 32 MiB (freed tensors reused from the heap, no page faults per tensor) for a run whose budget is
    HEADROOM x what it holds at 1 MiB (a float64 truth: its heap's retention measured 1.11-1.22x) or EMULATED_HEADROOM x
    (a band member: 1.22-1.52x); a user's ORACLE_MALLOC_MMAP_MB wins either way. The streamed replay records what it
    ran at (manifest streaming), and the dry run picks the same and prices the peak x that run's retention."""
    import json

    from helpers import run_oracle

    from oracle.replay.streaming import engine

    assert engine.roomy_mmap_mb(150, 100) == engine.FAST_MMAP_MB and engine.roomy_mmap_mb(149, 100) == engine.MMAP_MB
    assert engine.roomy_mmap_mb(160, 100, torch.float32) == engine.FAST_MMAP_MB  # an emulated member: more headroom
    assert engine.roomy_mmap_mb(159, 100, torch.float32) == engine.MMAP_MB
    ran = {}
    for name, dtype, env in (("roomy", "fp64", {}), ("user", "fp64", {"ORACLE_MALLOC_MMAP_MB": "1"}), ("member", "bf16", {})):
        r = run_oracle(["replay", fp32_capture, "--out", tmp_path / name, "--max-memory", "8G", "--no-verify", "--dtype", dtype],
                       env=env)  # fmt: skip
        assert r.returncode == 0, r.stderr
        ran[name] = json.loads((tmp_path / name / "manifest.json").read_text())["streaming"]
    assert ran["roomy"]["malloc_mmap_mb"] == engine.FAST_MMAP_MB and ran["user"]["malloc_mmap_mb"] == 1
    assert ran["member"]["malloc_mmap_mb"] == engine.FAST_MMAP_MB
    # room for the run at 1 MiB, not for the heap's retention
    tight = {"fp64": int(ran["roomy"]["fixed_estimate"] * 1.2), "bf16": int(ran["member"]["fixed_estimate"] * 1.2)}
    for name, dtype in (("tight", "fp64"), ("tight-member", "bf16")):
        r = run_oracle(["replay", fp32_capture, "--out", tmp_path / name, "--max-memory", str(tight[dtype]), "--no-verify",
                        "--dtype", dtype])  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert json.loads((tmp_path / name / "manifest.json").read_text())["streaming"]["malloc_mmap_mb"] == engine.MMAP_MB, name
    # the dry run picks as the run does, and prices the heap's retention where it picks the faster threshold
    from oracle.bundle.store import Bundle
    from oracle.replay.streaming.plan import plan

    cases = ((8 << 30, "fp64", engine.FAST_MMAP_MB, engine.HEAP_RETENTION), (tight["fp64"], "fp64", engine.MMAP_MB, 1.0),
             (8 << 30, "bf16", engine.FAST_MMAP_MB, engine.EMULATED_RETENTION), (tight["bf16"], "bf16", engine.MMAP_MB, 1.0))  # fmt: skip
    for budget, dtype, mb, retention in cases:
        m = plan(Bundle(fp32_capture), dtype, budget=budget)["memory"]
        assert m["malloc_mmap_mb"] == mb and m["heap_retention"] == retention, (dtype, m)
        one = m["fixed"] + m["activations_in_memory"]  # the 1 MiB model of what the run holds
        assert m["peak_estimate"] == round(one * m["heap_retention"]), m
