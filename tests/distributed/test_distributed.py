"""The distributed replay (2 ranks over 127.0.0.1, gloo): bitwise the single-process result, one
ordinary bundle, a killed or hung rank named and the run resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import HANG_S, ORACLE, rank_pid, run_oracle
from typer.testing import CliRunner

from cli import app
from oracle.bundle.store import Bundle
from oracle.capture.steps import capture_recipe_step
from oracle.errors import RankError
from oracle.replay.local import replay_local
from oracle.replay.run import replay
from oracle.replay.token_split import KILL_ENV

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cap(tmp_path_factory):
    """The tiny Qwen3 (text) step in amp-bf16 with its layers' boundaries recorded (for --local)."""
    from oracle import recipe as recipes

    r = recipes.get("qwen3")
    src = r.load("tiny-qwen3")
    root = tmp_path_factory.mktemp("dist")
    return capture_recipe_step(src, r.default_sample(), str(root / "cap"), precision="amp-bf16", modules="layers")


def _one_thread(fn, *a, **kw):
    """The single-process reference at the ranks' thread count (1): bitwise needs the same count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*a, **kw)
    finally:
        torch.set_num_threads(before)



def _assert_members_bitwise(a, b, ensemble):
    ba, bb = Bundle(a), Bundle(b)
    assert ba.member_groups() == bb.member_groups() == ["grads"] + [f"grads.{k}" for k in range(1, ensemble)]
    for g in ba.member_groups():
        ga, gb = ba.load_group(g), bb.load_group(g)
        assert set(ga) == set(gb)
        different = [n for n in ga if not torch.equal(ga[n], gb[n])]
        assert not different, f"{g}: {len(different)} gradients differ, e.g. {different[:3]}"
    assert ba.get("loss")["members"] == bb.get("loss")["members"]


def test_two_ranks_spread_an_ensemble_bitwise_into_one_bundle(cap, tmp_path):
    """--nproc 2: members 0,2 on rank 0 and 1 on rank 1; the one bundle equals the single process's bitwise."""
    r = run_oracle(["replay", str(cap), "--out", str(tmp_path / "d"), "--dtype", "amp-bf16", "--ensemble", "3", "--nproc", "2",
              "--threads", "1"])  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("replayed ") == 1  # rank 0 alone prints
    assert Bundle(tmp_path / "d").get("ranks") == 2
    ref = _one_thread(replay, cap, tmp_path / "ref", dtype="amp-bf16", ensemble=3)
    _assert_members_bitwise(ref, tmp_path / "d", 3)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no parts or work folders left behind


def test_two_ranks_spread_the_local_replay_with_the_same_rows(cap, tmp_path):
    """--local --nproc 2: modules dealt over the ranks; every row equals the single process's."""
    r = run_oracle(["replay", str(cap), "--out", str(tmp_path / "d"), "--local", "--nproc", "2", "--threads", "1", "--members", "1"])
    assert r.returncode == 0, r.stderr
    ref = _one_thread(replay_local, cap, tmp_path / "ref", members=1)
    rows, want = Bundle(tmp_path / "d").get("local"), Bundle(ref).get("local")
    assert len(rows) >= 3 and rows == want


@pytest.mark.rare  # a rare path at many moments: .ci/run's `pytest tests -m rare` (tests/conftest.py)
def test_a_killed_rank_is_named_and_the_run_resumes_bitwise(cap, tmp_path):
    """Rank 1 SIGKILLed once its member's journal holds 2 finished units (it kills itself there:
    ORACLE_TEST_KILL, oracle/replay/token_split.py kill_hook; a point every run reaches, never a race
    with the test's polling): the launcher stops rank 0 and exits 11 naming rank 1; the same command
    resumes from both ranks' journals and ends bitwise equal."""
    out = tmp_path / "o"
    args = ["replay", str(cap), "--out", str(out), "--dtype", "amp-bf16", "--ensemble", "2", "--max-memory", "4G",
            "--nproc", "2", "--threads", "1"]  # fmt: skip
    r = run_oracle(args, env={KILL_ENV: "1:2"}, timeout=HANG_S)
    err = r.stderr
    assert r.returncode == RankError.exit_code, err
    assert "rank 1 of 2 was killed by SIGKILL" in err and "resume" in err
    assert not out.exists()
    assert (tmp_path / ".o.rank1.partial" / "grads.1" / "journal.jsonl").exists()  # what the rerun resumes from
    r = run_oracle(args)
    assert r.returncode == 0, r.stderr
    assert "(resumed)" in r.stdout
    ref = _one_thread(replay, cap, tmp_path / "ref", dtype="amp-bf16", ensemble=2, max_memory=4 << 30)
    _assert_members_bitwise(ref, out, 2)
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".")]


@pytest.mark.rare  # a rare path at many moments: .ci/run's `pytest tests -m rare` (tests/conftest.py)
def test_a_hung_rank_stops_the_run_within_the_timeout(cap, tmp_path):
    """SIGSTOP rank 1 mid-step (a hang, not a death): rank 0's watchdog names it within
    ORACLE_RANK_TIMEOUT and the run exits 10."""
    args = ["replay", str(cap), "--out", str(tmp_path / "o"), "--dtype", "amp-bf16", "--ensemble", "2", "--max-memory", "4G",
            "--nproc", "2", "--threads", "1"]  # fmt: skip
    env = {**os.environ, "ORACLE_RANK_TIMEOUT": "3"}
    journal = tmp_path / ".o.rank1.partial" / "grads.1" / "journal.jsonl"
    p = subprocess.Popen([*ORACLE, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped, deadline = None, time.time() + HANG_S
    while time.time() < deadline and p.poll() is None and stopped is None:
        if journal.exists():
            stopped = rank_pid(p.pid, 1)
            os.kill(stopped, signal.SIGSTOP)
        time.sleep(0.005)
    assert stopped, "rank 1 finished before it could be stopped"
    _, err = p.communicate(timeout=HANG_S)  # a stopped rank never ends: only the watchdog can end this run
    assert p.returncode == RankError.exit_code, err
    assert "error: rank 0: rank 1 stopped answering: no heartbeat for 3 s" in err


def test_tensor_parallel_float64_oracle_equals_the_single_process_one(fp32_capture, oracle_bundle, tmp_path):
    """--dtype fp64 --nproc 2 on the tiny Qwen3-VL: heads and MLP split by DTensor, still float64
    throughout (same promotions), every gradient within 1e-12 relative of the single-process oracle."""
    r = run_oracle(["replay", str(fp32_capture), "--out", str(tmp_path / "tp"), "--nproc", "2", "--threads", "1"])
    assert r.returncode == 0, r.stderr
    tp, one = Bundle(tmp_path / "tp"), Bundle(oracle_bundle)
    assert tp.kind == "oracle" and tp.get("tensor_parallel")["ranks"] == 2
    assert {"q_proj", "o_proj", "down_proj", "lm_head"} <= set(tp.get("tensor_parallel")["split"])  # heads, MLP, vocabulary
    assert tp.get("numerics") == one.get("numerics")  # the same casts promoted: float64 holds under DTensor
    assert tp.get("loss")["value"] == pytest.approx(one.get("loss")["value"], rel=1e-12)
    gt, go = tp.load_group("grads"), one.load_group("grads")
    assert set(gt) == set(go)
    worst = {n: float((gt[n] - go[n]).norm() / go[n].norm()) for n in go if go[n].norm() > 0}
    assert max(worst.values()) <= 1e-12, max(worst.items(), key=lambda kv: kv[1])
    assert tp.get("backward_order") == one.get("backward_order")


def test_the_tensor_parallel_plan_splits_heads_and_mlp_and_refuses_uneven_splits(monkeypatch, tmp_path, cap):
    from oracle import recipe as recipes
    from oracle.errors import UsageError
    from oracle.parallel.tensor_parallel import check_divisible, plan_of

    r = recipes.get("qwen3")
    model = r.build(dict(r.load("tiny-qwen3").config))
    plan = plan_of(model)
    assert plan["model.layers.1.self_attn.q_proj"] == "colwise" and plan["model.layers.0.mlp.down_proj"] == "rowwise"
    assert plan["model.layers.0.self_attn.k_norm"] == "replicated_with_grad_allreduce" and "lm_head" not in plan
    with pytest.raises(UsageError, match="num_key_value_heads = 2; .* are not divisible by 3"):
        check_divisible(model, 3)
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: refused before the rendezvous
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UsageError, match="drop --max-memory"):
        replay(cap, tmp_path / "d", max_memory=1 << 30)


def test_nproc_hands_the_ranks_the_validated_options_not_a_command_line(cap, tmp_path, monkeypatch):
    """The ranks get the parsed options back as JSON (one process each, their threads), and a streamed
    replay's ranks start with malloc's huge-pages tunable."""
    seen = {}

    def fake(nproc, request, threads, *, env=None, echo=None):
        seen.update(nproc=nproc, request=request, threads=threads, env=env)
        return 0

    monkeypatch.setattr("oracle.replay.ranks.launch", fake)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("ORACLE_HUGE_PAGES", raising=False)
    r = CliRunner().invoke(app, ["replay", str(cap), "--out", str(tmp_path / "x"), "--dtype", "amp-bf16", "--ensemble", "3",
                                 "--max-memory", "2G", "--no-verify", "--nproc", "4", "--threads", "2"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert seen["nproc"] == 3 and seen["threads"] == 2  # one rank per member (3), not --nproc 4
    assert seen["request"]["command"] == "replay"
    o = seen["request"]["options"]
    assert json.loads(json.dumps(seen["request"])) == seen["request"]  # JSON as it travels
    assert o["capture"] == str(cap) and o["out"] == str(tmp_path / "x") and o["nproc"] == 1 and o["threads"] == 2
    assert (o["dtype"], o["ensemble"], o["max_memory"], o["verify"]) == ("amp-bf16", 3, "2G", False)
    if sys.platform.startswith("linux"):
        assert "glibc.malloc.hugetlb=1" in seen["env"]["GLIBC_TUNABLES"]


def test_nproc_starts_no_rank_without_work_and_refuses_an_uneven_split_before_any_starts(cap, fp32_capture, tmp_path, monkeypatch):
    """A band of 2 on --nproc 4 starts 2 ranks (each with the cores of 2), one member starts none (it runs here); a
    float64 split by tensors whose heads do not divide by --nproc is refused once, exit 2, before any rank starts,
    and so is its dry run (which used to price it and exit 0)."""
    starts = []
    monkeypatch.setattr("oracle.replay.ranks.launch", lambda nproc, request, threads, **_: starts.append((nproc, threads)) or 0)
    base = ["replay", str(cap), "--dtype", "amp-bf16", "--no-verify"]
    r = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "b"), "--ensemble", "2", "--nproc", "4"])
    assert r.exit_code == 0, r.output
    from oracle.parallel.launch import per_rank_threads

    assert starts == [(2, per_rank_threads(2, None))]
    r = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "one"), "--nproc", "2"])
    assert r.exit_code == 0 and len(starts) == 1, r.output  # one member: replayed in this process
    assert Bundle(tmp_path / "one").get("precision") == "amp-bf16"
    for extra in (["--out", str(tmp_path / "tp")], ["--dry-run"]):
        r = CliRunner().invoke(app, ["replay", str(cap), "--nproc", "3", *extra])
        assert r.exit_code == 2 and r.output.count("are not divisible by 3") == 1, r.output
    assert len(starts) == 1 and not (tmp_path / "tp").exists()
    # a local replay of a capture without module boundaries: said once, exit 4, before any rank starts
    r = CliRunner().invoke(app, ["replay", str(fp32_capture), "--out", str(tmp_path / "loc"), "--local", "--nproc", "2"])
    assert r.exit_code == 4 and r.output.count("has no module boundaries") == 1, r.output
    assert len(starts) == 1 and not (tmp_path / "loc").exists()


def test_a_dry_run_on_nproc_ranks_prices_them_sharing_this_machines_cores(cap, monkeypatch):
    """--split tokens --nproc 2: each rank computes half the rows on half the cores, so the dry run prices the GEMMs
    of one process (it priced half of that, as if each rank had the machine), probed on the threads the ranks use
    together, and says why; the memory and disk stay per rank."""
    import torch

    from oracle.replay.options import cores
    from oracle.replay.streaming import plan as plans

    seen = []
    real = plans.render

    def render(p):
        seen.append((dict(p), torch.get_num_threads()))
        return real(p)

    monkeypatch.setattr(plans, "gemm_rate", lambda dtype=torch.float64, **_: 1e9)
    monkeypatch.setattr(plans, "render", render)
    keep = torch.get_num_threads()
    try:
        one = CliRunner().invoke(app, ["replay", str(cap), "--dry-run", "--max-memory", "4G"])
        split = CliRunner().invoke(app, ["replay", str(cap), "--dry-run", "--max-memory", "4G", "--split", "tokens", "--nproc", "2"])
    finally:
        torch.set_num_threads(keep)
    assert one.exit_code == 0 and split.exit_code == 0, one.output + split.output
    (p1, _), (p2, threads) = seen
    assert p2["ranks"] == 2 and p2["estimated_seconds"] == pytest.approx(p1["estimated_seconds"])  # not half of it
    assert threads == min(cores(), 2 * max(1, cores() // 2))
    assert "  ranks    2 on this machine (--nproc): their GEMMs share its cores" in split.output
    assert "per rank of 2 (split by tokens)" in split.output and "  ranks " not in one.output


def test_the_worker_runs_a_request_and_speaks_like_the_cli(cap, tmp_path):
    """python -m oracle.api.worker: the JSON request replays (the same bundle as the library call); a
    request the options refuse is exit 2 with the CLI's message, no traceback."""
    from oracle.replay.options import ReplayOptions

    opts = ReplayOptions(capture=cap, out=tmp_path / "w", dtype="amp-bf16", verify=False, threads=1)
    req = json.dumps({"command": "replay", "options": opts.for_rank(1)})
    r = subprocess.run([sys.executable, "-m", "oracle.api.worker"], input=req, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"replayed {cap} in amp-bf16")
    ref = tmp_path / "ref"
    replay(cap, ref, dtype="amp-bf16", verify="off")
    wa, wb = Bundle(tmp_path / "w"), Bundle(ref)
    assert all(torch.equal(wa.load("grads", n), wb.load("grads", n)) for n in wb.names("grads"))
    bad = json.dumps({"command": "replay", "options": {**opts.for_rank(1), "local": True}})
    r = subprocess.run([sys.executable, "-m", "oracle.api.worker"], input=bad, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "error: --local" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_rank_refusing_first_lets_the_others_refuse_too_and_a_hung_one_is_stopped(tmp_path):
    """Every rank sees the same user mistake: after the first refuses (exit 2) the launcher waits for
    the others to refuse on their own (and tidy their folders) instead of killing them mid-way; one
    that never ends is stopped after the settle time and the run's code is still the refusal's."""
    from oracle.parallel import launch

    late = tmp_path / "late-rank-tidied"
    slow = f"import pathlib, sys, time; time.sleep(1.0); pathlib.Path({str(late)!r}).write_text('x'); sys.exit(2)"
    procs = [subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(2)"]), subprocess.Popen([sys.executable, "-c", slow])]
    try:
        assert launch._watch(procs, settle_s=30.0) == 2
    finally:
        launch._stop(procs)
    assert late.read_text() == "x" and procs[1].returncode == 2  # it ended on its own, not by SIGTERM
    hung = [subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"]),
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])]  # fmt: skip
    try:
        assert launch._watch(hung, settle_s=0.5) == 3
    finally:
        launch._stop(hung)
    assert hung[1].returncode == -signal.SIGTERM  # stopped: its own end (sleep 60) would be exit 0


RANK_END = """
import sys, torch, torch.distributed as dist
from oracle.parallel import distributed
assert distributed.init()
t = torch.ones(4) * (distributed.rank() + 1)
dist.all_reduce(t)  # gloo's worker threads have run
distributed.finish()
print("initialized after finish:", dist.is_initialized(), "sum:", int(t[0]), flush=True)
"""


def test_finish_destroys_the_process_group_before_the_interpreter_ends(tmp_path):
    """Three real ranks over gloo: after finish() the process group is gone on every rank (left to the
    interpreter's teardown, gloo's threads can abort a rank that has done its work: SIGABRT, read by
    the launcher as a lost rank, pytorch/pytorch#190489), and every rank exits 0."""
    from oracle.parallel import launch

    port, n = launch.free_port(), 3
    procs = [subprocess.Popen([sys.executable, "-c", RANK_END], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})  # fmt: skip
             for r in range(n)]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "initialized after finish: False sum: 6" in out, (out, err)
