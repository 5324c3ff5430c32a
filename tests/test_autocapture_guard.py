"""ORACLE_CAPTURE never stops, hangs or changes a training run (issue 32, item 1): every failure of the
capture is said once on stderr with its fix, nothing of the user's is touched, and the training call's
gradients are bitwise those of a run without the variable.

The training calls run in real processes (tests/autocapture_step.py: megatron-core 0.12.1's own
schedule on a tiny GPTModel, the hook installed at start-up as oracle_capture.pth installs it): one
process without the variable, one that takes every case below in turn. As root (this CI runs as
root) mode 555 stops no write: there the read-only folders are made unwritable by refusing
``os.open``/``os.mkdir`` under them with EACCES, what the kernel answers a non-root user.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
AS_ROOT = os.geteuid() == 0
LONG = "x" * 300  # one path component longer than NAME_MAX (255)


def _read_only(path):
    """A folder this process cannot write: mode 555, or (as root) EACCES planted under it."""
    os.makedirs(path, exist_ok=True)
    if not AS_ROOT:
        os.chmod(path, 0o555)
    return "eacces" if AS_ROOT else ""


def _cases(tmp):
    """name -> (env, fault, what the one stderr line must say, user files that must stay as they are)."""
    user = {}
    os.makedirs(tmp / "pre-is-file")
    (tmp / "pre-is-file" / "pre").write_text("my notes\n")
    user["pre-is-file"] = [tmp / "pre-is-file" / "pre"]
    (tmp / "a-file").write_text("my data\n")
    user["a-file"] = [tmp / "a-file"]
    os.makedirs(tmp / "user-rank" / "pre" / "rank00000")
    (tmp / "user-rank" / "pre" / "rank00000" / "results.csv").write_text("1,2,3\n")
    user["user-rank"] = [tmp / "user-rank" / "pre" / "rank00000" / "results.csv"]
    ro_new = _read_only(tmp / "ro")
    os.makedirs(tmp / "ro-existing")
    (tmp / "ro-existing" / "keep.txt").write_text("mine\n")
    user["read-only-existing"] = [tmp / "ro-existing" / "keep.txt"]
    ro_old = _read_only(tmp / "ro-existing")
    c = {
        "read-only-new": ({"ORACLE_CAPTURE": str(tmp / "ro" / "cap")}, ro_new, "folder this process can write"),
        "read-only-existing": ({"ORACLE_CAPTURE": str(tmp / "ro-existing")}, ro_old, "folder this process can write"),
        "proc": ({"ORACLE_CAPTURE": "/proc/oracle-capture"}, "", "cannot write /proc/oracle-capture"),
        "a-file": ({"ORACLE_CAPTURE": str(tmp / "a-file")}, "", "a file is in the way"),
        "pre-is-file": ({"ORACLE_CAPTURE": str(tmp / "pre-is-file")}, "", "a file is in the way"),
        "user-rank": ({"ORACLE_CAPTURE": str(tmp / "user-rank")}, "", "move it away or point ORACLE_CAPTURE at another"),
        "too-long": ({"ORACLE_CAPTURE": str(tmp / LONG / "cap")}, "", "shorter path"),
        "disk-full": ({"ORACLE_CAPTURE": str(tmp / "full")}, "enospc", "disk with room"),
        "hook-fails": ({"ORACLE_CAPTURE": str(tmp / "hook")}, "hook", "out of host memory"),
        "budget-1e400": ({"ORACLE_CAPTURE": str(tmp / "b1"), "ORACLE_CAPTURE_MODULES": "layers",
                          "ORACLE_CAPTURE_MODULES_BUDGET_MB": "1e400"}, "", "ORACLE_CAPTURE_MODULES_BUDGET_MB='1e400'"),
        "budget-words": ({"ORACLE_CAPTURE": str(tmp / "b2"), "ORACLE_CAPTURE_MODULES": "layers",
                          "ORACLE_CAPTURE_MODULES_BUDGET_MB": "lots"}, "", "ORACLE_CAPTURE_MODULES_BUDGET_MB='lots'"),
        "step-word": ({"ORACLE_CAPTURE": str(tmp / "s1"), "ORACLE_CAPTURE_STEP": "first"}, "", "ORACLE_CAPTURE_STEP"),
        "step-negative": ({"ORACLE_CAPTURE": str(tmp / "s2"), "ORACLE_CAPTURE_STEP": "-1"}, "", "integer >= 0"),
        "step-float": ({"ORACLE_CAPTURE": str(tmp / "s3"), "ORACLE_CAPTURE_STEP": "0.5"}, "", "integer >= 0"),
        "catastrophic-regex": ({"ORACLE_CAPTURE": str(tmp / "rx"), "ORACLE_CAPTURE_MODULES": r"^(\w+\.?)+!$"}, "",
                               "exponential time"),
        "ok-with-layers": ({"ORACLE_CAPTURE": str(tmp / "ok"), "ORACLE_CAPTURE_MODULES": "layers"}, "",
                           "captured training call 0"),
    }  # fmt: skip
    return c, user


def _run(out, cases, env_start):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORACLE_CAPTURE")}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), **env_start)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, os.path.join(HERE, "autocapture_step.py"), str(out), json.dumps(cases)],
                       env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return time.monotonic() - t0, p.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guard")
    cases, user = _cases(tmp)
    before = {k: [(f.read_bytes(), f.stat().st_mtime_ns) for f in fs] for k, fs in user.items()}
    plain = tmp_path_factory.mktemp("plain")
    _run(plain, [{"name": "plain"}], {})
    out = tmp_path_factory.mktemp("captured")
    spec = [{"name": n, "env": env, "fault": fault} for n, (env, fault, _) in cases.items()]
    seconds, stderr = _run(out, spec, {"ORACLE_CAPTURE": str(tmp / "first")})  # set at start-up, as a job sets it
    yield {"tmp": tmp, "cases": cases, "user": user, "before": before, "plain": load_file(plain / "plain.safetensors"),
           "out": out, "seconds": seconds, "stderr": stderr}  # fmt: skip
    for p in (tmp / "ro", tmp / "ro-existing"):
        os.chmod(p, 0o755)


CASES = ["read-only-new", "read-only-existing", "proc", "a-file", "pre-is-file", "user-rank", "too-long", "disk-full",
         "hook-fails", "budget-1e400", "budget-words", "step-word", "step-negative", "step-float", "catastrophic-regex",
         "ok-with-layers"]  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_a_failing_capture_is_said_once_touches_nothing_and_the_step_trains_bitwise(runs, name):
    """The call ran (the process went on to the next case), its gradients after the loop's finalize
    are bitwise the run's without the variable, and stderr holds the problem once, with its fix."""
    env, fault, says = runs["cases"][name]
    grads = load_file(runs["out"] / f"{name}.safetensors")
    assert set(grads) == set(runs["plain"]) and all(torch.equal(grads[n], runs["plain"][n]) for n in grads), name
    err = (runs["out"] / f"{name}.err").read_text()
    lines = [x for x in err.splitlines() if x.startswith("oracle:")]
    assert sum(says in x for x in lines) == 1, err
    assert "Traceback" not in err, err
    if name != "ok-with-layers" and not name.startswith(("budget", "catastrophic")):
        assert len(lines) == 1, err  # once: nothing else said for it
    for f, (data, mtime) in zip(runs["user"].get(name, []), runs["before"].get(name, [])):
        assert f.read_bytes() == data and f.stat().st_mtime_ns == mtime, f


def test_the_users_folders_in_the_way_are_never_replaced(runs):
    """A user folder where the rank bundle goes keeps its file and gets no bundle; a full disk leaves
    no half-written bundle; a bad module selection still captures the step (without boundaries)."""
    tmp = runs["tmp"]
    assert os.listdir(tmp / "user-rank" / "pre" / "rank00000") == ["results.csv"]
    assert os.listdir(tmp / "full" / "pre") == []  # no bundle, no debris, no probe
    assert sorted(os.listdir(tmp / "ro-existing")) == ["keep.txt"]
    for name in ("b1", "b2", "rx"):
        assert (tmp / name / "pre" / "rank00000" / "manifest.json").exists(), name
        assert (tmp / name / "post" / "rank00000" / "manifest.json").exists(), name
    from oracle.bundle.store import Bundle

    ok = Bundle(tmp / "ok" / "pre" / "rank00000")
    assert any(g.startswith("mod.") for g in ok.groups())
    assert not any(g.startswith("mod.") for g in Bundle(tmp / "rx" / "pre" / "rank00000").groups())


def test_a_catastrophic_selection_regex_is_refused_before_it_runs():
    """^(\\w+\\.?)+!$ over module names would backtrack for hours; it is refused at once, without the
    regex package (the standard library's parser finds the nested quantifier)."""
    from oracle.capture.modules import check_pattern

    t0 = time.monotonic()
    for bad in (r"^(\w+\.?)+!$", r"(a|ab)*c", r"(?:x+)+y", r"(\d+\.)*mlp"):
        with pytest.raises(ValueError, match="exponential time"):
            check_pattern(bad)
    for good in (r"(^|\.)decoder\.layers\.\d+$", r"layers\.\d+\.mlp$", r".*mlp.*", r"(ab){2}"):
        check_pattern(good)
    assert time.monotonic() - t0 < 1
