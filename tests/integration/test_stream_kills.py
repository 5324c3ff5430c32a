"""A streamed replay killed at chosen points (ORACLE_TEST_KILL, no timer) resumes bitwise; its files and leftovers.

Kill points are counted in journal records of the killed run (oracle/replay/token_split.py kill_hook):
``0:N`` after its N-th unit shard, ``0:N:any`` after its N-th record of any kind (a call's input
gradients before its unit's shard, a drop). Each rerun resumes from what the previous ones left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import stream_budget

from oracle.bundle.store import Bundle
from oracle.replay.run import replay
from oracle.replay.token_split import KILL_ENV

ROOT = Path(__file__).resolve().parents[2]


def _cmd(cap, out, *extra):
    return [sys.executable, "-c", "import cli; cli.main()", "replay", str(cap), "--out", str(out), "--threads", "1", *extra]


def _env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


def _journalled(work: Path) -> dict[str, list[str]]:
    return {m.name: [f"{r['kind']} {r['unit']}" for r in map(json.loads, (m / "journal.jsonl").read_text().splitlines())]
            for m in sorted(work.iterdir()) if (m / "journal.jsonl").is_file()}  # fmt: skip


@pytest.mark.rare  # a rare path at many moments: .ci/run's `pytest tests -m rare` (tests/conftest.py)
def test_an_amp_band_member_killed_anywhere_in_its_backward_resumes_bitwise(amp_capture, tmp_path):
    """Killed five times in a row (text and vision backward of the oracle-like member and of a
    jittered member, between a call's input gradients and its unit's shard, during a resume), the
    same command ends bitwise equal to an uninterrupted run, loss, backward order and the count of
    promoted casts (``numerics``) included."""
    out, whole = tmp_path / "o", tmp_path / "whole"
    args = ("--dtype", "amp-bf16", "--ensemble", "2", "--max-memory", stream_budget(amp_capture, "--dtype", "amp-bf16", "--ensemble", "2"))
    work = tmp_path / ".o.partial"
    kills = [
        "0:5",  # grads: after the last text layer's shard
        "0:3:any",  # grads: vision, after blocks.2's input gradients, before its shard
        "0:16",  # grads.1 (jittered): vision, after a deepstack merger (8 units of grads were left)
        "0:2",  # grads.1: vision, after blocks.1 and the first deepstack merger
        "0:1:any",  # grads.1: after blocks.0's input gradients, before its shard
    ]
    seen = []
    for kill in kills:
        r = subprocess.run(_cmd(amp_capture, out, *args), cwd=ROOT, env=_env(**{KILL_ENV: kill}), capture_output=True, text=True)
        assert r.returncode == -signal.SIGKILL, (kill, r.returncode, r.stderr[-2000:])
        assert not out.exists()
        seen.append(_journalled(work))
    assert any(any(e.startswith("unit model.visual.blocks") for e in s.get("grads.1", [])) for s in seen), seen
    r = subprocess.run(_cmd(amp_capture, out, *args), cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert r.returncode == 0 and "(resumed)" in r.stdout, r.stderr[-2000:]
    r = subprocess.run(_cmd(amp_capture, whole, *args), cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    a, b = Bundle(out), Bundle(whole)
    assert a.get("backward_order") == b.get("backward_order") and a.get("loss") == b.get("loss")
    assert a.get("numerics") == b.get("numerics")  # the promotions of skipped calls counted from the journal
    for group in b.member_groups():
        ga, gb = a.load_group(group), b.load_group(group)
        assert sorted(ga) == sorted(gb)
        assert [n for n in gb if not torch.equal(ga[n], gb[n])] == [], group
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o", "whole"]  # no work folder, no temporaries


def test_a_streamed_bundle_has_the_umasks_modes(fp32_capture, tmp_path):
    """Every file a streamed replay writes into its bundle (its gradient shards, written by safetensors
    as 0600, included) gets 0666 less the umask."""
    for mask, fmode in ((0o022, 0o644), (0o027, 0o640)):
        old = os.umask(mask)
        try:
            out = replay(fp32_capture, tmp_path / f"o{mask:o}", dtype="fp64", max_memory=8 << 30)
        finally:
            os.umask(old)
        # the capture's inputs and weights are hard links where the file system allows: the capture's own files
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir() if p.stat().st_nlink == 1}
        assert any(n.startswith("grads-") for n in modes) and set(modes.values()) == {oct(fmode)}, modes


@pytest.mark.rare  # a rare path at many moments: .ci/run's `pytest tests -m rare` (tests/conftest.py)
def test_a_work_folder_left_by_a_killed_streamed_run_is_removed_by_an_in_memory_rerun(fp32_capture, tmp_path):
    """A streamed replay killed mid-way leaves .o.partial; the in-memory replay of the same step and
    command into the same --out supersedes it: removed once the bundle is in place, and said so."""
    out = tmp_path / "o"
    r = subprocess.run(_cmd(fp32_capture, out, "--max-memory", "8G"), cwd=ROOT, env=_env(**{KILL_ENV: "0:3"}),
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert (tmp_path / ".o.partial" / "grads" / "journal.jsonl").is_file()
    r = subprocess.run(_cmd(fp32_capture, out), cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "removed the work folder" in r.stderr and ".o.partial" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
    assert Bundle(out).kind == "oracle"


@pytest.mark.rare  # a rare path at many moments: .ci/run's `pytest tests -m rare` (tests/conftest.py)
def test_a_work_folder_of_another_command_or_not_ours_is_named_and_kept(fp32_capture, tmp_path):
    """Beside an in-memory replay's --out: our work folder of another command (here another precision)
    is kept and named (its resume is the user's), a folder of that name that is not ours is kept and
    named; neither is touched."""
    out = tmp_path / "o"
    work = tmp_path / ".o.partial"
    r = subprocess.run(_cmd(fp32_capture, out, "--max-memory", "8G", "--dtype", "bf16"), cwd=ROOT, env=_env(**{KILL_ENV: "0:3"}),
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    before = sorted(str(p.relative_to(work)) for p in work.rglob("*"))
    r = subprocess.run(_cmd(fp32_capture, out), cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{work} is kept" in r.stderr and "another streamed replay" in r.stderr, r.stderr
    assert sorted(str(p.relative_to(work)) for p in work.rglob("*")) == before
    foreign = tmp_path / ".p.partial"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    r = subprocess.run(_cmd(fp32_capture, tmp_path / "p"), cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{foreign} is kept" in r.stderr and "not a work folder of this tool" in r.stderr, r.stderr
    assert (foreign / "notes.txt").read_text() == "mine"


def test_a_streamed_replay_stopped_while_publishing_keeps_every_shard_for_its_rerun(fp32_capture, oracle_bundle, tmp_path, monkeypatch):
    """Stopped inside the bundle's publish (its shards already in the writer's temporary), the work
    folder still holds every journalled shard: the rerun recomputes nothing and equals the in-memory oracle."""
    from oracle.bundle import atomic

    out = tmp_path / "o"

    def stopped(*a, **k):
        raise RuntimeError("stopped while publishing")

    monkeypatch.setattr(atomic, "publish", stopped)
    try:
        replay(fp32_capture, out, dtype="fp64", max_memory=8 << 30)
    except RuntimeError:
        pass
    monkeypatch.undo()
    assert not out.exists() and (tmp_path / ".o.partial" / "grads" / "end.json").is_file()
    replay(fp32_capture, out, dtype="fp64", max_memory=8 << 30)
    streaming = Bundle(out).get("streaming")
    assert streaming["resumed"] and "recomputed" not in streaming, streaming
    a, b = Bundle(out).load_group("grads"), Bundle(oracle_bundle).load_group("grads")
    assert sorted(a) == sorted(b) and [n for n in a if not torch.equal(a[n], b[n])] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_the_app_invoked_inside_another_program_never_execs_it(fp32_capture, tmp_path, monkeypatch):
    """A streamed replay restarts its process with huge pages only when that process is the command
    line itself: invoked in-process (CliRunner, a test session) it replays where it is."""
    from helpers import invoke

    monkeypatch.delenv("ORACLE_HUGE_PAGES", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)

    def execve(*a):
        raise AssertionError(f"the host process was exec'd: {a[1][:3]}")

    monkeypatch.setattr(os, "execve", execve)
    res = invoke("replay", fp32_capture, "--out", tmp_path / "o", "--max-memory", "8G")
    assert res.exit_code == 0 and Bundle(tmp_path / "o").kind == "oracle", res.output


@pytest.mark.rare  # a rare path at many moments: .ci/run's `pytest tests -m rare` (tests/conftest.py)
def test_a_kill_right_after_a_dropped_input_gradient_resumes_bitwise(fp32_capture, tmp_path):
    """Killed after layers.3's input gradients were dropped but before layers.2's shard: layers.2 is
    recomputed on resume and still receives layers.3's input gradients (dropped only once every unit
    producing them is finished), so the result equals an uninterrupted run bitwise."""
    out, whole = tmp_path / "o", tmp_path / "whole"
    args = ("--dtype", "amp-bf16", "--max-memory", stream_budget(fp32_capture, "--dtype", "amp-bf16"))
    journal = tmp_path / ".o.partial" / "grads" / "journal.jsonl"
    # records: unit lm_head, call layers.3, unit layers.3, call layers.2, then (before the fix) drop layers.3
    r = subprocess.run(_cmd(fp32_capture, out, *args), cwd=ROOT, env=_env(**{KILL_ENV: "0:5:any"}), capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    kinds = [(d["kind"], d["unit"]) for d in map(json.loads, journal.read_text().splitlines())]
    assert ("drop", "model.language_model.layers.3") not in kinds[:-1] or ("unit", "model.language_model.layers.2") in kinds, kinds
    for o in (out, whole):
        r = subprocess.run(_cmd(fp32_capture, o, *args), cwd=ROOT, env=_env(), capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
    a, b = Bundle(out).load_group("grads"), Bundle(whole).load_group("grads")
    assert [n for n in b if not torch.equal(a[n], b[n])] == []


@pytest.mark.rare  # a rare path at many moments: .ci/run's `pytest tests -m rare` (tests/conftest.py)
def test_a_work_folder_left_after_publishing_is_named_and_overwrite_settles_it(fp32_capture, tmp_path, monkeypatch):
    """Stopped after its bundle was published and before its work folder was removed (the last step of a
    streamed replay), the rerun of the same command is refused (exit 6) with the folder named and the way
    out; with --overwrite it resumes from that folder (nothing recomputed), publishes the same gradients
    bitwise and leaves nothing beside --out."""
    from oracle.replay.streaming import driver

    out, work = tmp_path / "o", tmp_path / ".o.partial"
    monkeypatch.setattr(driver.shutil, "rmtree", lambda *a, **k: None)  # the kill window: published, not yet cleaned
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reruns below (--threads 1): a work folder resumes only on the same thread count
    try:
        replay(fp32_capture, out, dtype="fp64", max_memory=8 << 30)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.undo()
    assert out.is_dir() and work.is_dir()
    first = Bundle(out).load_group("grads")
    r = subprocess.run(_cmd(fp32_capture, out, "--max-memory", "8G"), cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert r.returncode == 6, r.stderr[-2000:]
    assert ".o.partial" in r.stderr and "--overwrite" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run(_cmd(fp32_capture, out, "--max-memory", "8G", "--overwrite"), cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
    streaming = Bundle(out).get("streaming")
    assert streaming["resumed"] and "recomputed" not in streaming, streaming
    again = Bundle(out).load_group("grads")
    assert sorted(again) == sorted(first) and [n for n in first if not torch.equal(first[n], again[n])] == []


@pytest.mark.rare  # a rare path at many moments: .ci/run's `pytest tests -m rare` (tests/conftest.py)
def test_a_killed_float64_truth_resumes_with_an_uninterrupted_runs_manifest(fp32_capture, tmp_path):
    """The float64 truth killed twice (after a call's input gradients, after a unit's shard) ends with the
    manifest of an uninterrupted streamed run: gradients bitwise, backward order, and ``numerics.promotions``
    (the casts promoted in the calls a resumed run skips are counted from their journal records)."""
    out, whole = tmp_path / "o", tmp_path / "whole"
    args = ("--max-memory", "8G")
    for kill in ("0:2:any", "0:2"):
        r = subprocess.run(_cmd(fp32_capture, out, *args), cwd=ROOT, env=_env(**{KILL_ENV: kill}), capture_output=True, text=True)
        assert r.returncode == -signal.SIGKILL, (kill, r.stderr[-2000:])
    for o in (out, whole):
        r = subprocess.run(_cmd(fp32_capture, o, *args), cwd=ROOT, env=_env(), capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
    a, b = Bundle(out), Bundle(whole)
    assert a.get("streaming")["resumed"] and not b.get("streaming").get("resumed")
    assert b.get("numerics")["promotions"] > 0
    assert a.get("numerics") == b.get("numerics") and a.get("backward_order") == b.get("backward_order")
    ga, gb = a.load_group("grads"), b.load_group("grads")
    assert sorted(ga) == sorted(gb) and [n for n in gb if not torch.equal(ga[n], gb[n])] == []
