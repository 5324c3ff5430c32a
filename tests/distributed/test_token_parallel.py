"""The token-parallel float64 replay (--split tokens, 2-3 ranks over 127.0.0.1, gloo): every gradient
and the loss within 1e-12 of the single process, bitwise repeatable, a killed rank named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import HANG_S, assert_split_within, killed_at_barrier, packed_vl_capture, run_oracle

from oracle import recipe as recipes
from oracle.bundle.store import Bundle
from oracle.capture.steps import capture_recipe_step
from oracle.errors import RankError
from oracle.parallel import token_parallel
from oracle.replay import attention
from oracle.replay.run import replay

ROOT = Path(__file__).resolve().parents[2]
BOUND = token_parallel.BOUND_REL



def _split(cap, out, nproc=2):
    r = run_oracle(["replay", str(cap), "--out", str(out), "--split", "tokens", "--nproc", str(nproc), "--threads", "1"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("replayed ") == 1  # rank 0 alone prints
    assert f"split by tokens over {nproc} ranks (every gradient within 1e-12" in r.stdout, r.stdout
    return Bundle(out)


def _assert_within(split: Bundle, one: Bundle, ranks: int):
    assert_split_within(split, one, ranks, BOUND)
    assert split.get("numerics") == one.get("numerics")  # the same casts promoted: float64 throughout


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The tiny Qwen3 (text) step in fp32 and its single-process float64 oracle."""
    r = recipes.get("qwen3")
    root = tmp_path_factory.mktemp("tokens")
    cap = capture_recipe_step(r.load("tiny-qwen3"), r.default_sample(), str(root / "cap"), precision="fp32")
    return cap, replay(cap, root / "one", verify="off")


@pytest.fixture(scope="module")
def packed_vl(tmp_path_factory):
    """Three samples of the tiny Qwen3-VL (one image each) packed into one sequence, and its oracle."""
    root = tmp_path_factory.mktemp("tokens-vl")
    cap = packed_vl_capture(root)
    return cap, replay(cap, root / "one", verify="off")


def test_the_rows_cover_the_sequence_once_and_balance_causal_work():
    """Rank r owns blocks r and 2N-1-r: a partition of 0..T-1, and causal attention work within 10 % across ranks."""
    for T, n in ((37, 2), (1000, 2), (1001, 3), (16384, 4)):
        rows = [token_parallel.rows_of(T, n, r) for r in range(n)]
        assert sorted(torch.cat(rows).tolist()) == list(range(T))
        work = [float((x + 1).sum()) for x in rows]  # query i sees i+1 keys
        assert max(work) / min(work) < 1.1, (T, n, work)


def test_the_kernel_on_a_ranks_rows_equals_the_whole_sequence_kernel():
    """attention._forward/_backward with q0 (queries a..b-1 against all keys, packed and causal):
    outputs equal the whole kernel's rows, and the rows' dk/dv add up to the whole dk/dv (<= 1e-13)."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, D = 1, 4, 2, 45, 8
    q, k, v, do = (torch.randn(B, h, T, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv, H))
    for cu in ([0, T], [0, 11, 30, T]):
        out, lse = attention._forward(q, k, v, cu, True, D**-0.5, 8, 8)
        dq, dk, dv = attention._backward(do, q, k, v, out, lse, cu, True, D**-0.5, 8, 8)
        dk_sum, dv_sum = torch.zeros_like(dk), torch.zeros_like(dv)
        for a, b in ((0, 7), (7, 26), (26, 45)):
            o, lse_r = attention._forward(q[:, :, a:b].contiguous(), k, v, cu, True, D**-0.5, 8, 8, q0=a)
            assert float((o - out[:, :, a:b]).abs().max()) <= 1e-13
            dqr, dkr, dvr = attention._backward(do[:, :, a:b].contiguous(), q[:, :, a:b].contiguous(), k, v, o, lse_r,
                                                cu, True, D**-0.5, 8, 8, q0=a)  # fmt: skip
            assert float((dqr - dq[:, :, a:b]).abs().max()) <= 1e-13
            dk_sum += dkr
            dv_sum += dvr
        assert float((dk_sum - dk).abs().max()) <= 1e-13 and float((dv_sum - dv).abs().max()) <= 1e-13


def test_two_ranks_split_tiny_qwen3_within_the_bound(qwen3, tmp_path):
    """--split tokens --nproc 2 on the tiny Qwen3: every gradient and the loss within 1e-12 of the
    single process; no work folder left."""
    cap, one = qwen3
    _assert_within(_split(cap, tmp_path / "a"), Bundle(one), 2)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.rare  # a rare path at many moments: .ci/run's `pytest tests -m rare` (tests/conftest.py)
def test_two_ranks_split_repeats_bitwise(qwen3, tmp_path):
    """A second --split tokens --nproc 2 run is bitwise the first (fixed reduction order)."""
    cap, _ = qwen3
    a, b = _split(cap, tmp_path / "a"), _split(cap, tmp_path / "b")
    ga, gb = a.load_group("grads"), b.load_group("grads")
    assert [n for n in ga if not torch.equal(ga[n], gb[n])] == []
    assert a.get("loss")["value"] == b.get("loss")["value"]


@pytest.mark.rare  # a rare path at many moments: .ci/run's `pytest tests -m rare` (tests/conftest.py); two ranks stay in command 2
def test_three_ranks_split_tiny_qwen3_within_the_bound(qwen3, tmp_path):
    """--nproc 3: six blocks, the same bound."""
    cap, one = qwen3
    _assert_within(_split(cap, tmp_path / "c", nproc=3), Bundle(one), 3)


def test_two_ranks_split_tiny_qwen3_vl_within_the_bound(fp32_capture, oracle_bundle, tmp_path):
    """The tiny Qwen3-VL (image tokens, deepstack, mRoPE): the ViT replicated, its features handed to
    the rank that owns each image token; every gradient within 1e-12 of the single process."""
    s = _split(fp32_capture, tmp_path / "vl")
    _assert_within(s, Bundle(oracle_bundle), 2)
    assert s.get("token_parallel")["replicated"] == ["model.visual"]


def test_two_ranks_split_a_packed_tiny_qwen3_vl_within_the_bound(packed_vl, tmp_path):
    """Three packed samples with an image each: per-sample causal attention across the ranks' rows
    (boundaries from the whole sequence's positions); every gradient within 1e-12 of the single process."""
    cap, one = packed_vl
    _assert_within(_split(cap, tmp_path / "p"), Bundle(one), 2)


def test_split_tokens_refuses_what_it_does_not_do(qwen3, tmp_path, monkeypatch):
    """Emulated replays spread members, not tokens; the split has no certificate; an unknown split is
    named (UsageError, exit 2, before any rendezvous)."""
    from oracle.errors import UsageError

    cap, _ = qwen3
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UsageError, match="--split tokens splits the float64 oracle"):
        replay(cap, tmp_path / "x", dtype="amp-bf16", split="tokens")
    with pytest.raises(UsageError, match=r"token-parallel float64 replay \(2 ranks\) has no certificate"):
        replay(cap, tmp_path / "y", split="tokens", verify="on")
    with pytest.raises(UsageError, match="--split is 'tensor' or 'tokens', got 'rows'"):
        replay(cap, tmp_path / "z", split="rows")
    assert UsageError.exit_code == 2


def test_the_split_refuses_by_the_inputs_shapes_alone():
    """One rule (token_split.refusal) for the splitter and for a caller choosing the split from a manifest."""
    from oracle.replay.token_split import refusal

    vl = {"input_ids": (1, 144), "pixel_values": (256, 1536), "position_ids": (3, 1, 144)}
    assert refusal(vl, 2) is None
    assert refusal({"input_ids": (2, 144)}, 2) is None  # text: a batch, its positions made whole
    assert "video" in refusal({**vl, "pixel_values_videos": (8, 1536)}, 2)
    assert "(batch 1), got 2" in refusal({**vl, "input_ids": (2, 144)}, 2)
    assert "use --nproc <= 72" in refusal(vl, 73)
    assert "without position_ids" in refusal({"input_ids": (1, 144), "pixel_values": (256, 1536)}, 2)
    assert "needs (batch, tokens)" in refusal({"pixel_values": (256, 1536)}, 2)


@pytest.mark.rare  # a rare path at many moments: .ci/run's `pytest tests -m rare` (tests/conftest.py)
def test_a_rank_killed_mid_step_is_named(qwen3, tmp_path):
    """Rank 1 SIGKILLed once every rank has built its model (inside the step's exchanges; it kills itself
    there, tests/helpers.py killed_at_barrier): the launcher stops rank 0 and exits 11 naming rank 1; no
    bundle is written."""
    cap, _ = qwen3
    out = tmp_path / "o"
    r = run_oracle(["replay", str(cap), "--out", str(out), "--split", "tokens", "--nproc", "2", "--threads", "1"],
                   env=killed_at_barrier(tmp_path / "site", 1, "tokens-built"), timeout=HANG_S)  # fmt: skip
    assert r.returncode == RankError.exit_code, r.stderr
    assert "rank 1 of 2 was killed by SIGKILL" in r.stderr
    assert not out.exists()
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".")]  # no work folder left either


