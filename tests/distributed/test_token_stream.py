"""The streamed token-parallel float64 replay (--split tokens --nproc 2 --max-memory): every gradient
and the loss within 1e-12 of the single-process streamed replay, bitwise repeatable, the same bundle
layout; a rank killed mid-backward, the same command again resumes (skipping the units every rank
finished) and ends bitwise equal to the uninterrupted run; per-rank budgets in the dry run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    assert_bitwise,
    assert_split_within,
    packed_text_capture,
    packed_vl_capture,
    run_oracle,
    two_sample_qwen3_capture,
)

from oracle.bundle.store import Bundle
from oracle.errors import RankError, UsageError
from oracle.parallel import token_parallel
from oracle.parallel.launch import free_port
from oracle.replay import token_split
from oracle.replay.run import replay
from oracle.replay.streaming import engine, plan

ROOT = Path(__file__).resolve().parents[2]
BOUND = token_parallel.BOUND_REL
BUDGET = "4G"



def _split_args(cap, out, nproc=2):
    return ["replay", str(cap), "--out", str(out), "--split", "tokens", "--nproc", str(nproc), "--threads", "1",
            "--max-memory", BUDGET]  # fmt: skip


def _split(cap, out, nproc=2):
    r = run_oracle(_split_args(cap, out, nproc))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("replayed ") == 1  # rank 0 alone prints
    return Bundle(out)


def _files(b: Bundle) -> list[str]:
    return sorted({e["file"] for e in b.manifest["tensors"]["grads"].values()})


def _assert_within(split: Bundle, one: Bundle, ranks: int):
    assert_split_within(split, one, ranks, BOUND)
    assert split.get("token_parallel")["streamed"] and split.get("streaming")["max_memory"] == 4 << 30
    # a budget with room for the heap's retention runs the faster mmap threshold on every rank, as one process does
    assert split.get("streaming")["malloc_mmap_mb"] == one.get("streaming")["malloc_mmap_mb"] == engine.FAST_MMAP_MB
    assert _files(split) == _files(one)  # the single-process streamed layout: one shard per unit, same names
    assert {n: e["file"] for n, e in split.manifest["tensors"]["grads"].items()} == {
        n: e["file"] for n, e in one.manifest["tensors"]["grads"].items()
    }


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The tiny Qwen3 (text), two samples packed, in fp32; its single-process streamed oracle and one
    streamed token-parallel replay."""
    root = tmp_path_factory.mktemp("tokens-stream")
    cap = two_sample_qwen3_capture(root)
    one = Bundle(replay(cap, root / "one", max_memory=4 << 30))
    return cap, one, _split(cap, root / "split")


@pytest.fixture(scope="module")
def packed_vl(tmp_path_factory):
    """Three samples of the tiny Qwen3-VL (one image each) packed into one sequence, its streamed
    oracle and one streamed token-parallel replay."""
    root = tmp_path_factory.mktemp("tokens-stream-vl")
    cap = packed_vl_capture(root)
    return cap, Bundle(replay(cap, root / "one", max_memory=4 << 30)), _split(cap, root / "split")


def test_streamed_split_tiny_qwen3_within_the_bound(qwen3):
    """Two ranks, streamed: every gradient and the loss within 1e-12 of the single-process streamed
    replay (measured ~1e-15), the same shards; each rank holds about half the boundary activations."""
    cap, one, split = qwen3
    _assert_within(split, one, 2)
    # each rank holds its rows' boundary activations: about half of the single process's each
    s1, acts = one.get("streaming"), split.get("token_parallel")["activations"]
    whole = s1["activations_in_memory_peak"] + s1["activations_spilled"]
    assert len(acts) == 2 and all(0.4 * whole <= a <= 0.6 * whole for a in acts), (acts, whole)


@pytest.mark.rare  # a rare path at many moments: .ci/run's `pytest tests -m rare` (tests/conftest.py)
def test_streamed_split_repeats_bitwise_and_leaves_no_work_folder(qwen3, tmp_path):
    """A second streamed split of the same step is bitwise the first; no work folder is left beside it."""
    cap, _, split = qwen3
    assert_bitwise(split, _split(cap, tmp_path / "again"))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_four_ranks_add_their_partials_by_a_tree_within_the_bound(qwen3, tmp_path):
    """Four ranks: the partial gradients reach rank 0 by a binomial tree (streaming/partials.py: rank 2 adds
    rank 3's, then sends to rank 0, which has added rank 1's): within the bound of the single process, the
    same shards, bitwise repeatable; no work folder left."""
    cap, one, _ = qwen3
    four = _split(cap, tmp_path / "four", nproc=4)
    _assert_within(four, one, 4)
    assert_bitwise(four, _split(cap, tmp_path / "again", nproc=4))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_streamed_split_packed_tiny_qwen3_vl_within_the_bound(packed_vl, tmp_path):
    """Three packed samples with an image each (ViT replicated, its units streamed on every rank,
    image features to the rank owning each image token; per-sample causal attention across the
    ranks' rows): within 1e-12 of the single-process streamed replay."""
    _, one, s = packed_vl
    _assert_within(s, one, 2)
    assert s.get("token_parallel")["replicated"] == ["model.visual"]


# A rank of the streamed split with the attention grid and the layers' row chunks at 16 rows (the
# tiny models' sequences fit one 1024-row chunk): its decoder layers run by row chunks on its rows
# (streaming/layers.py ``_backward_split``). Prints how many row chunks each chunked layer call had.
CHUNKED_RANK = r"""
import sys
from oracle.replay import attention
attention.CHUNK = 16
from oracle.replay.streaming import layers
seen, original = [], layers._collect
def spy(fn, plan, x):
    seen.append(len(plan.spans) if plan.layout is not None else 0)
    return original(fn, plan, x)
layers._collect = spy
from oracle.replay.run import replay
replay(sys.argv[1], sys.argv[2], max_memory=4 << 30, token_chunk=16, split="tokens")
print("row chunks per layer call", seen)
"""


def _chunked_split(cap, out, ranks=2) -> tuple[Bundle, list[str]]:
    env = {"WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", CHUNKED_RANK, str(cap), str(out)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, **env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(ranks)]  # fmt: skip
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-3000:] for _, e in outs]
    return Bundle(out), [o for o, _ in outs]


def test_a_ranks_decoder_layers_run_by_row_chunks_within_the_bound(tmp_path):
    """Three packed samples of the tiny Qwen3 (201 tokens), 2 ranks, 16-row chunks: every decoder
    layer call on each rank runs in several row chunks (its rows' K, V gathered, the two-phase
    backward), and the result is within 1e-12 of the single-process streamed replay with whole
    layers (every q/k/v projection's gradient included: they come from the second phase alone),
    and bitwise the same on a second run."""
    cap = packed_text_capture(tmp_path)[0]
    one = Bundle(replay(cap, tmp_path / "one", max_memory=4 << 30))
    split, printed = _chunked_split(cap, tmp_path / "split")
    for text in printed:
        calls = eval(text.strip().splitlines()[-1].removeprefix("row chunks per layer call "))
        assert calls and min(calls) >= 4, calls  # every layer call chunked, on both ranks
    assert_split_within(split, one, 2, BOUND)
    grads = split.load_group("grads")
    assert all(grads[n].norm() > 0 for n in grads if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")))
    assert_bitwise(split, _chunked_split(cap, tmp_path / "again")[0])


@pytest.mark.rare  # a rare path at many moments: .ci/run's `pytest tests -m rare` (tests/conftest.py)
@pytest.mark.parametrize("kill", ["1:3", "0:3"])
def test_a_rank_killed_mid_backward_resumes_bitwise(qwen3, tmp_path, kill):
    """ORACLE_TEST_KILL=R:N SIGKILLs rank R right after it journals its N-th unit (inside the backward:
    the head is the first, then decoder layers 3, 2: the other rank has journalled layer 3 by then,
    since layer 2's exchanges needed it): the launcher stops the other rank and exits 11
    naming the dead one, the work folders stay; the same command again resumes, skips the units
    both ranks finished and ends bitwise equal to the uninterrupted run."""
    cap, _, whole = qwen3
    out = tmp_path / "k"
    r = run_oracle(_split_args(cap, out), env={token_split.KILL_ENV: kill})
    dead = kill.split(":")[0]
    assert r.returncode == RankError.exit_code, r.stderr[-3000:]
    assert f"rank {dead} of 2 was killed by SIGKILL" in r.stderr
    assert not out.exists()
    assert (tmp_path / ".k.rank0.partial").is_dir() and (tmp_path / ".k.rank1.partial").is_dir()
    again = _split(cap, out)
    rec = again.get("token_parallel")
    assert again.get("streaming")["resumed"] is True
    assert rec["skipped_units"] and all(u.startswith("model.layers.") for u in rec["skipped_units"]), rec
    assert_bitwise(again, whole)
    assert again.get("backward_order") == whole.get("backward_order")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.rare  # a rare path at many moments: .ci/run's `pytest tests -m rare` (tests/conftest.py)
def test_a_rank_killed_in_the_vision_tower_resumes_bitwise(packed_vl, tmp_path):
    """Packed tiny Qwen3-VL: rank 1 SIGKILLed after its 7th unit (the head, the 4 decoder layers,
    the merger, ViT block 2). The ViT's backward exchanges nothing, so rank 0 may be several units
    further there, and its journal has dropped input gradients that rank 1 still needs (layer 2's,
    once the deepstack merger feeding it was done; seen in a run of this test): the agreement then
    recomputes those units everywhere. Whatever the skipped set, the rerun ends bitwise equal to
    the uninterrupted run."""
    cap, _, whole = packed_vl
    out = tmp_path / "k"
    r = run_oracle(_split_args(cap, out), env={token_split.KILL_ENV: "1:7"})
    assert r.returncode == RankError.exit_code and "rank 1 of 2 was killed by SIGKILL" in r.stderr, r.stderr[-3000:]
    again = _split(cap, out)
    assert again.get("streaming")["resumed"] is True
    assert_bitwise(again, whole)
    assert again.get("backward_order") == whole.get("backward_order")


def test_the_agreement_skips_only_what_every_rank_finished():
    """token_split.agree on journals that differ (rank 0 ahead): only the units both finished are
    skipped; a unit whose journalled input gradients a rank dropped is skipped only with its producers."""

    class Call:
        def __init__(self, unit, index, producers):
            self.unit, self.index, self.producers = unit, index, producers

    class Journal:
        def __init__(self, units, dropped):
            self.units, self.dropped = dict.fromkeys(units, {}), set(dropped)

    class Engine:
        unit_params = {"a": [], "b": [], "c": []}
        # c's input comes from b, b's from a
        consumers = {("a", 0): [Call("b", 0, {("a", 0)})], ("b", 0): [Call("c", 0, {("b", 0)})]}

    def agreed(per_rank):
        lists = iter([[sorted(j.units) for j in per_rank], [sorted(f'["{u}", {i}]' for u, i in j.dropped) for j in per_rank]])
        e = Engine()
        e.journal = per_rank[0]
        orig = token_parallel.gather_lists
        token_parallel.gather_lists = lambda items: next(lists)
        try:
            token_split.agree(e)
        finally:
            token_parallel.gather_lists = orig
        return e.agreed

    assert agreed([Journal(["c", "b"], []), Journal(["c"], [])]) == {"c"}
    # rank 0 finished a and b and so dropped c's input gradients; rank 1 finished c only: c skipped
    # without its gradients would starve b, which rank 1 recomputes: c is recomputed too
    assert agreed([Journal(["c", "b", "a"], [("c", 0)]), Journal(["c"], [])]) == set()
    assert agreed([Journal(["c", "b"], [("c", 0)]), Journal(["c", "b"], [])]) == {"b", "c"}


def test_the_dry_run_reports_per_rank_numbers(qwen3):
    """plan(ranks=2): the boundary activations and resume journal per rank about half the single
    process's (the largest rank's rows), the reserve named; rank 0's end-of-run partials counted."""
    cap, _, _ = qwen3
    p1, p2 = plan.plan(Bundle(cap), "fp64", budget=4 << 30), plan.plan(Bundle(cap), "fp64", budget=4 << 30, ranks=2)
    T = p1["tokens"]
    share = max(token_parallel.Layout(T, 2, 0).counts) / T
    assert p2["ranks"] == 2 and 0.4 < share <= 0.55
    assert p2["memory"]["activations"] == pytest.approx(p1["memory"]["activations"] * share, rel=0.01)
    assert p2["disk"]["resume_journal"] == pytest.approx(p1["disk"]["resume_journal"] * share, rel=0.01)
    assert p2["disk"]["rank0_partials"] == p1["disk"]["gradients"]
    # added as they arrive by a tree: one set of sums beside rank 0's own partials, not one per other rank
    assert plan.plan(Bundle(cap), "fp64", budget=4 << 30, ranks=4)["disk"]["rank0_partials"] == p1["disk"]["gradients"]
    assert "per rank of 2 (split by tokens)" in plan.render(p2)


def test_what_the_streamed_split_refuses_exits_2(qwen3, tmp_path, monkeypatch):
    """Emulated dtypes spread members, not tokens; the tensor split does not stream; a budget below
    one rank's need is refused by every rank alike with the size that would do: all exit 2."""
    cap, _, _ = qwen3
    r = run_oracle(["replay", str(cap), "--out", str(tmp_path / "e"), "--dtype", "bf16", "--split", "tokens", "--nproc", "2",
              "--max-memory", BUDGET])  # fmt: skip
    assert r.returncode == UsageError.exit_code == 2 and "--split tokens splits the float64 oracle" in r.stderr
    r = run_oracle(_split_args(cap, tmp_path / "small")[:-1] + ["64M"])
    assert r.returncode == 2 and "per rank, 2 ranks" in r.stderr and "raise it to at least" in r.stderr, r.stderr[-2000:]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing to resume: no folder left
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UsageError, match=r"tensor-parallel float64 replay \(2 ranks\) runs in memory"):
        replay(cap, tmp_path / "t", max_memory=4 << 30)
