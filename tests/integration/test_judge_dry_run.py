"""judge --dry-run and the run agree with each replay stage's own budget check: a stage above
--max-memory is marked, named with what it needs, the header never says "within", and both the dry run
and the run exit 2 before any replay (the run leaves no --out behind)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_oracle

from oracle.pipeline.judge import Judge


def test_judge_dry_run_refuses_exactly_the_stages_their_replays_would(fp32_capture, amp_capture, tmp_path):
    fits = run_oracle(["judge", fp32_capture, amp_capture, "--dry-run", "--max-memory", "2G"])
    assert fits.returncode == 0, fits.stderr
    assert "streamed within --max-memory 2G" in fits.stdout and "ABOVE" not in fits.stdout
    low = run_oracle(["judge", fp32_capture, amp_capture, "--dry-run", "--max-memory", "300M"])
    assert low.returncode == 2, low.stderr
    assert "within" not in low.stdout.splitlines()[0], low.stdout
    marked = [ln.split()[0] for ln in low.stdout.splitlines() if ln.endswith("ABOVE --max-memory")]
    assert marked == ["truth", "band-fp32", "band-amp-bf16"], low.stdout
    assert "would not fit --max-memory" in low.stderr and "raise it to at least" in low.stderr and "Traceback" not in low.stderr
    # each band stage's own replay dry run refuses the same budget (the two dry runs agree)
    own = run_oracle(["replay", amp_capture, "--dtype", "amp-bf16", "--ensemble", "2", "--max-memory", "300M", "--dry-run"])
    assert own.returncode == 2, own.stdout + own.stderr
    run = run_oracle(["judge", fp32_capture, amp_capture, "--max-memory", "300M", "--out", tmp_path / "j"])
    assert run.returncode == 2 and "would not fit" in run.stderr, run.stderr
    assert not (tmp_path / "j").exists()


def test_refusals_name_only_the_stages_above_the_budget_and_the_budget_that_would_do():
    est = {"truth": {"refusal": None, "fixed": 10 << 30, "by": "layers.0"},
           "band-bf16": {"refusal": "too small", "fixed": 19 << 30, "by": "layers.0"},
           "score": {"seconds": 1}}  # fmt: skip
    (msg,) = Judge.refusals(est)
    assert "band-bf16 (about 19.00 GiB" in msg and "truth" not in msg and "at least 20.9G" in msg
    assert Judge.refusals({"truth": {"refusal": None}}) == []


def test_the_dry_run_prices_the_answer_on_a_server_and_on_hosts(fp32_capture, amp_capture):
    """Only the replays' GEMM part scales with the cores (and over hosts by the token-parallel efficiency);
    fixed costs and the other stages stay as measured here. A stage priced on the CPU-time core probe
    (``gemm_core_seconds``) puts that over the server's cores; one without it scales its wall-clock GEMM
    time by the threads here. The dry run prints both probes and both lines."""
    from oracle.pipeline.judge import TOKEN_PARALLEL_EFFICIENCY, elsewhere

    est = {"truth": {"seconds": 1000.0, "gemm_seconds": 900.0}, "band-bf16": {"seconds": 700.0, "gemm_seconds": 640.0},
           "score": {"seconds": 30.0}}  # fmt: skip
    assert elsewhere(est, 2, 2) == 1730.0  # as many cores as here: unchanged
    assert abs(elsewhere(est, 2, 64) - (100 + 60 + 30 + (900 + 640) * 2 / 64)) < 1e-9
    # over hosts the truth splits by tokens over some (rank 0 adding ceil(log2 h) partial gradient sets) while each band
    # member runs whole on one of the others, at the same time (hosts_plan): the split of the hosts that ends first
    from oracle.pipeline.judge import RANK0_SUM_BYTES_PER_S, hosts_plan

    real = {"truth": {**est["truth"], "gradients": 22e9}, "band-bf16": {**est["band-bf16"], "members": 2}, "score": {"seconds": 30.0}}
    assert abs(elsewhere(real, 2, 64) - elsewhere(est, 2, 64)) < 1e-9  # one host: the same figure

    def truth_on(h):  # the truth's fixed 100 s, its GEMMs over h hosts (one: not split), the tree's sets into rank 0
        return 100 + 900 * 2 / (64 * h * (TOKEN_PARALLEL_EFFICIENCY if h > 1 else 1)) + (h - 1).bit_length() * 22e9 / RANK0_SUM_BYTES_PER_S

    member = 60 / 2 + 640 * 2 / 2 / 64  # its share of the band's fixed costs, its GEMMs on one host
    best = min([(truth_on(8) + member, 0), (max(truth_on(7), 2 * member), 1)] + [(max(truth_on(8 - m), member), m) for m in range(2, 8)])
    assert hosts_plan(real, 2, 64, 8) == pytest.approx(best) and abs(elsewhere(real, 2, 64, 8) - (30 + best[0])) < 1e-9
    # members long against the truth: the truth on 6 hosts while the 2 members run on the other 2, not one after the other
    long = {"truth": {"seconds": 100.0, "gemm_seconds": 0.0, "gemm_core_seconds": 35840.0},
            "band-bf16": {"seconds": 0.0, "gemm_seconds": 0.0, "gemm_core_seconds": 38400.0, "members": 2}}  # fmt: skip
    assert hosts_plan(long, 2, 64, 8) == (300.0, 2)  # 2 members of 300 s on their own hosts; the truth 233 s on 6
    assert elsewhere(long, 2, 64, 8) == 300.0 < (100 + 800 / 8) + 300  # one after the other: 500 s
    # a truth whose partial sums cost more than its GEMMs save stays on fewer hosts; the dry run says the others idle
    from oracle.pipeline.judge import Judge

    sums = {"truth": {"seconds": 0.0, "gemm_core_seconds": 0.0, "gradients": 45e9},
            "band-bf16": {"seconds": 0.0, "gemm_core_seconds": 2 * 64 * 50.0, "members": 2}}  # fmt: skip
    assert hosts_plan(sums, 2, 64, 8) == (50.0, 7)  # the truth on one host (no sums), the 2 members on 2 of the other 7
    said = Judge._hosts_split(sums, 2, 64, 8)
    assert "the truth in one process on one host while" in said and "on 2 other host(s) (5 idle" in said, said
    # without a truth (given: --truth) the members use every host; 3 members on 2 hosts: two one after the other
    three = {"band-bf16": {"seconds": 700.0, "gemm_seconds": 640.0, "members": 3}}
    assert abs(elsewhere(three, 2, 64, 2) - 2 * (60 / 3 + 640 * 2 / 3 / 64)) < 1e-9
    assert hosts_plan({"truth": {"seconds": 0.0, "given": "T"}, **three}, 2, 64, 8) == (pytest.approx(60 / 3 + 640 * 2 / 3 / 64), 0)
    assert "truth" not in Judge._hosts_split({"truth": {"seconds": 0.0, "given": "T"}, **three}, 2, 64, 8)
    # the same stages on a loaded machine: the wall-clock GEMM time tripled, the one-core CPU time not
    loaded = {"truth": {"seconds": 2800.0, "gemm_seconds": 2700.0, "gemm_core_seconds": 1800.0},
              "band-bf16": {"seconds": 1980.0, "gemm_seconds": 1920.0, "gemm_core_seconds": 1280.0}, "score": {"seconds": 30.0}}  # fmt: skip
    assert abs(elsewhere(loaded, 2, 64) - elsewhere(est, 2, 64)) < 1e-9
    # the score's pool (score/pool.py) on a server: SCORE_THREADS_PRICED workers at the measured efficiency, no
    # faster than one drive reads; its fixed cost (the 5 s above the pool's own time here) as here
    from oracle.pipeline import judge

    nbytes = 210e9
    here = judge.score_seconds(nbytes, 2)
    assert abs(here - nbytes / (judge.SCORE_CORE_BYTES_PER_S * 2 * judge.SCORE_POOL_EFFICIENCY)) < 1e-6
    server = nbytes / (judge.SCORE_CORE_BYTES_PER_S * judge.SCORE_THREADS_PRICED * judge.SCORE_POOL_EFFICIENCY)
    assert judge.score_seconds(nbytes, 64) == max(server, nbytes / judge.SCORE_DISK_BYTES_PER_S) < here / 3
    assert judge.score_seconds(nbytes, 1) == nbytes / judge.SCORE_CORE_BYTES_PER_S
    pooled = {"score": {"seconds": here + 5.0, "score_bytes": nbytes, "score_workers": 2}}
    assert abs(elsewhere(pooled, 2, 64) - (5.0 + judge.score_seconds(nbytes, 64))) < 1e-6
    assert abs(elsewhere(pooled, 2, 64, 8) - elsewhere(pooled, 2, 64)) < 1e-9  # on one host of the 8
    out = run_oracle(["judge", fp32_capture, amp_capture, "--dry-run"]).stdout
    assert "on one 64-core server: about " in out and "on 8 hosts of 64 cores" in out, out
    hosts = next(ln for ln in out.splitlines() if "on 8 hosts of 64 cores" in ln)
    assert ("the truth split by tokens over " in hosts or "the truth in one process on one host" in hosts) and "run whole" in hosts, out
    assert "GFLOP/s per core by CPU time" in out and "load average" in out, out


def test_the_core_probe_reads_cpu_time_on_one_thread_and_restores_the_threads():
    """plan.core_rates runs its products on one thread (its own CPU clock) and gives the threads back."""
    import torch

    from oracle.replay.streaming.plan import core_rates

    threads = torch.get_num_threads()
    rates = core_rates((torch.float64, torch.float32), n=128, rounds=2)
    assert torch.get_num_threads() == threads and set(rates) == {torch.float64, torch.float32}
    assert all(r > 0 for r in rates.values())


def test_band_members_are_priced_on_the_float32_probe_at_their_own_efficiency(fp32_capture, monkeypatch):
    """An emulated member computes in float32: the planner prices its FLOPs on the float32 GEMM probe at
    EMULATED_EFFICIENCY, the truth's on the float64 probe, its weights' GEMMs at EFFICIENCY and its attention at
    ATTENTION_EFFICIENCY x the diagonal share (same FLOPs, so a probe ratio of 2 prices a member at the truth's
    effective efficiency / (2 x EMULATED_EFFICIENCY) of the truth); the dry run's text names the probe it used."""
    import torch

    from oracle.bundle.store import Bundle
    from oracle.replay.streaming import plan as plans

    monkeypatch.setattr(plans, "gemm_rate", lambda dtype=torch.float64, **_: {torch.float64: 1e9, torch.float32: 2e9}[dtype])
    truth, member = (plans.plan(Bundle(fp32_capture), d, streamed=True, budget=8 << 30) for d in ("fp64", "bf16"))
    assert truth["total_flops"] == member["total_flops"] > 0
    assert member["efficiency"] == plans.EMULATED_EFFICIENCY
    ratio = member["estimated_seconds"] / truth["estimated_seconds"]
    assert abs(ratio - truth["efficiency"] / (2 * plans.EMULATED_EFFICIENCY)) < 1e-12, ratio
    # the truth: the weights' GEMMs at EFFICIENCY, the attention at ATTENTION_EFFICIENCY x its samples' diagonal share
    f = truth["flops"]
    weights = (f["linear"] + f["head"]) / (1e9 * plans.EFFICIENCY)
    shares = [plans._causal_share(n) for n in truth["samples"]]
    assert f["attention"] > 0 and plans._causal_share(512) == 0.5 and plans._causal_share(4096) == 8 / 9
    low, high = (f["attention"] / (1e9 * plans.ATTENTION_EFFICIENCY * s) for s in (1.0, min(shares)))  # vision: share 1
    assert weights + low * (1 - 1e-9) <= truth["estimated_seconds"] <= weights + high * (1 + 1e-9), truth
    assert truth["efficiency"] == pytest.approx(truth["total_flops"] / (1e9 * truth["estimated_seconds"]))
    assert "float32 GEMM probe 2.0 GFLOP/s" in plans.render(member) and "float64 GEMM probe 1.0" in plans.render(truth)


def test_band_members_in_processes_share_the_cores_and_overlap_only_the_rest(fp32_capture, amp_capture, tmp_path, monkeypatch):
    """--nproc: a band's members run in processes on this machine's cores, so their GEMMs do not overlap (the same
    FLOPs on the same cores) and the rest does (measured on the 8B cut: 0.89x of the members one after the other, not
    the 0.5x it was priced at). A member alone on a host (hosts_plan) and the serial sums cost what they did."""
    import itertools
    import types

    import torch

    from oracle.bundle.store import Bundle
    from oracle.pipeline import judge as judge_mod
    from oracle.replay.streaming import plan as plans

    # the same probes for both estimates: the GEMM rates, and the planner's wall time (1 s per plan)
    monkeypatch.setattr(plans, "gemm_rate", lambda dtype=torch.float64, **_: {torch.float64: 1e9, torch.float32: 2e9}[dtype])
    monkeypatch.setattr(plans, "gemm_rates", lambda dtypes, **_: {d: plans.gemm_rate(dtype=d) for d in dtypes})
    monkeypatch.setattr(plans, "core_rates", lambda dtypes, **_: {d: plans.gemm_rate(dtype=d) / 2 for d in dtypes})
    clock = itertools.count()
    monkeypatch.setattr(judge_mod, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    caps = [Bundle(fp32_capture), Bundle(amp_capture)]
    keep = torch.get_num_threads()
    torch.set_num_threads(2)  # the probe's threads: 2 ranks of at least one core each (per_rank_threads) share them
    try:
        one, two, three = (judge_mod.Judge(fp32_capture, amp_capture, out=tmp_path / f"j{n}{k}", names=["a", "b"], ensemble=k,
                                           nproc=n, max_memory="8G").estimates(caps) for n, k in ((1, 2), (2, 2), (2, 3)))  # fmt: skip
    finally:
        torch.set_num_threads(keep)
    bands = [s for s in one if s.startswith("band-")]
    assert len(bands) == 2
    for s in bands:
        a, b, c = one[s], two[s], three[s]
        gemm, fixed = a["member_gemm"], a["member_fixed"]
        assert gemm > 0 and fixed > 0 and (b["member_gemm"], b["member_fixed"]) == (gemm, fixed)
        assert a["seconds"] == pytest.approx(2 * (gemm + fixed)) and a["gemm_seconds"] == pytest.approx(2 * gemm)
        assert b["gemm_seconds"] == pytest.approx(2 * gemm)  # the same cores: no faster
        start = plans.PROCESS_START_SECONDS  # the rank processes start first
        assert b["seconds"] == pytest.approx(2 * gemm + fixed + start)  # the fixed parts overlap
        assert a["seconds"] / 2 < b["seconds"] - start < a["seconds"]
        # 3 members on 2 processes: one process runs 2 of them, each on half the cores (they are dealt whole)
        assert c["seconds"] == pytest.approx(2 * (2 * gemm + fixed) + start) and c["seconds"] > 1.5 * (b["seconds"] - start)
    assert judge_mod.hosts_plan(two, 2, 64, 8) == pytest.approx(judge_mod.hosts_plan(one, 2, 64, 8))
    # --threads 1 per rank where the probe ran on 4: each member's GEMMs on a quarter of those cores, not half
    torch.set_num_threads(4)
    try:
        thin = judge_mod.Judge(fp32_capture, amp_capture, out=tmp_path / "t", names=["a", "b"], ensemble=2, nproc=2, threads=1,
                               max_memory="8G").estimates(caps)  # fmt: skip
    finally:
        torch.set_num_threads(keep)
    for s in bands:
        assert thin[s]["gemm_seconds"] == pytest.approx(4 * one[s]["member_gemm"])  # 1 round x 4 x a member's GEMMs
    # more processes than members: one per member, and the line says why it is not --nproc
    said = judge_mod.Judge(fp32_capture, amp_capture, out=tmp_path / "j4", names=["a", "b"], ensemble=2, nproc=4,
                           max_memory="8G").dry_run()[0]  # fmt: skip
    assert "(2 members in float32, 2 process(es): one per member, of --nproc 4)" in said, said


def test_the_server_figure_says_its_gemms_and_what_they_cost_at_the_probes_full_rate(fp32_capture, amp_capture, tmp_path, monkeypatch):
    """The one-server line splits its figure: the replays' GEMMs at this machine's per-core rate on the server's
    cores, the same FLOPs at one core's probe rate (the floor no faster replay goes below on such cores), and the
    fixed costs and other stages as here. The floor is each replay's FLOPs over its compute dtype's core probe
    (a member's float32), a band's times its members, a TP rank stage's times its ranks."""
    import itertools
    import re
    import types

    import torch

    from oracle.bundle.store import Bundle
    from oracle.pipeline import judge as judge_mod
    from oracle.pipeline.stages import duration
    from oracle.replay.streaming import plan as plans

    monkeypatch.setattr(plans, "gemm_rate", lambda dtype=torch.float64, **_: {torch.float64: 1e5, torch.float32: 2e5}[dtype])  # slow: minutes on a tiny model
    monkeypatch.setattr(plans, "gemm_rates", lambda dtypes, **_: {d: plans.gemm_rate(dtype=d) for d in dtypes})
    monkeypatch.setattr(plans, "core_rates", lambda dtypes, **_: {d: plans.gemm_rate(dtype=d) / 2 for d in dtypes})
    clock = itertools.count()
    monkeypatch.setattr(judge_mod, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    j = judge_mod.Judge(fp32_capture, amp_capture, out=tmp_path / "j", names=["a", "b"], ensemble=2, max_memory="8G")
    caps = [Bundle(fp32_capture), Bundle(amp_capture)]
    est = j.estimates(caps)
    truth = plans.plan(caps[0], "fp64", streamed=True, budget=8 << 30)
    assert est["truth"]["floor_core_seconds"] == pytest.approx(truth["total_flops"] / 0.5e5)  # the float64 core probe
    bands = [s for s in est if s.startswith("band-")]
    assert bands
    for s in bands:
        member = plans.plan(caps[0], s.removeprefix("band-"), streamed=True, budget=8 << 30)
        assert est[s]["floor_core_seconds"] == pytest.approx(2 * member["total_flops"] / 1e5)  # 2 members, float32 core probe
        assert est[s]["gemm_core_seconds"] > est[s]["floor_core_seconds"]  # priced below the probe's full rate
    at, floor = judge_mod.server_gemms(est, 64)
    assert at == pytest.approx(sum(e["gemm_core_seconds"] for e in est.values() if "gemm_core_seconds" in e) / 64)
    assert floor == pytest.approx(sum(e["floor_core_seconds"] for e in est.values() if "floor_core_seconds" in e) / 64)
    assert 60 < floor < at < judge_mod.elsewhere(est, torch.get_num_threads(), 64)  # figures the line shows in minutes
    text, _ = j.dry_run()
    line = next(ln for ln in text.splitlines() if "on one 64-core server" in ln)
    rest = judge_mod.elsewhere(j.estimates(caps), torch.get_num_threads(), 64) - at  # the probes pinned: the same estimate
    for figure in (at, floor, rest):
        assert f" {duration(figure)} " in line, (duration(figure), line)
    assert re.search(r"GEMMs .+ on 64 cores like this machine's, at the fraction of the per-core probe they reach here, no less than .+ at 100 % of it", line), line


def test_threads_are_each_ranks_under_nproc_and_this_processes_without(fp32_capture, amp_capture, tmp_path, monkeypatch):
    """--threads T alone: the replays and the score in the judge's process run on T threads, and the dry run probes
    this machine on T (its times are theirs). --nproc N --threads T: T is each rank process's (a band's members at
    once), and what the judge runs itself (the streamed truth, the score) keeps every core, probed on them."""
    import torch

    from oracle.bundle.store import Bundle
    from oracle.replay import run as run_mod
    from oracle.replay.options import cores
    from oracle.replay.streaming import plan as plans

    seen: dict[str, int] = {}
    real_rates = plans.gemm_rates

    def rates(dtypes, **kw):
        seen["probe"] = torch.get_num_threads()
        return real_rates(dtypes, n=64, rounds=1)

    monkeypatch.setattr(plans, "gemm_rates", rates)
    monkeypatch.setattr(run_mod, "replay", lambda *a, **k: seen.__setitem__("replay", torch.get_num_threads()))
    keep = torch.get_num_threads()
    caps = [Bundle(fp32_capture), Bundle(amp_capture)]
    try:
        alone = Judge(fp32_capture, amp_capture, out=tmp_path / "a", names=["a", "b"], threads=1, max_memory="8G")
        alone.estimates(caps)
        assert seen["probe"] == 1 and torch.get_num_threads() == keep  # probed on 1 thread, the threads given back
        assert " on 1 thread by the wall clock" in alone.dry_run()[0]
        alone._replay(Path(fp32_capture), tmp_path / "t", True, "fp64")
        assert seen["replay"] == 1 and alone.score_workers() == 1
        torch.set_num_threads(keep)
        ranks = Judge(fp32_capture, amp_capture, out=tmp_path / "r", names=["a", "b"], threads=1, nproc=2, max_memory="8G")
        ranks.estimates(caps)
        assert seen["probe"] == keep
        ranks._replay(Path(fp32_capture), tmp_path / "t", True, "fp64")  # the streamed truth: in this process
        assert seen["replay"] == keep and ranks.score_workers() == cores()
        assert f" on {keep} thread{'s' if keep > 1 else ''} by the wall clock" in ranks.dry_run()[0]
        # in memory too: the truth is this process's (split by tensors over ranks it had no certificate, and heads
        # that did not divide by --nproc failed the stage); only a band's members go to the ranks
        launched = []
        monkeypatch.setattr("oracle.replay.ranks.launch", lambda n, request, threads, **_: launched.append(request["options"]["dtype"]) or 0)
        inmem = Judge(fp32_capture, amp_capture, out=tmp_path / "m", names=["a", "b"], threads=1, nproc=3)
        seen.pop("replay")
        inmem._replay(Path(fp32_capture), tmp_path / "t", True, "fp64")
        assert seen["replay"] == keep and launched == []
        inmem._replay(Path(fp32_capture), tmp_path / "t", True, "bf16", 2)
        assert launched == ["bf16"]
    finally:
        torch.set_num_threads(keep)
