"""Decoder layers run by row chunks in the streamed float64 replay (oracle/replay/streaming/layers.py):
equal to the unchunked replay, several chunks per layer, across packed samples."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import packed_text_capture

from oracle.bundle.store import Bundle
from oracle.replay import attention
from oracle.replay.run import replay
from oracle.replay.streaming import layers

ROOT = Path(__file__).resolve().parents[2]


def _grads(path) -> dict[str, torch.Tensor]:
    return Bundle(path).load_group("grads")


def _split_sums(a: dict, b: dict, in_layers) -> tuple[float, list[str]]:
    """(worst relative difference of the row-chunked layers' weight gradients, the other gradients that moved)."""
    chunked = [n for n in a if in_layers(n)]
    assert chunked and set(a) == set(b)
    worst = max(float((a[n] - b[n]).norm() / a[n].norm()) for n in chunked if a[n].norm() > 0)
    moved = [n for n in a if n not in chunked and not torch.equal(a[n], b[n])]
    return worst, moved


@pytest.fixture
def small_grid(monkeypatch):
    """The attention kernel's chunk at 16 rows, in memory and streamed alike: several query chunks per sample."""
    monkeypatch.setattr(attention, "CHUNK", 16)


@pytest.fixture
def chunk_calls(monkeypatch):
    """How many row chunks each chunked layer call ran (the collect pass's attention calls)."""
    seen = []
    original = layers._collect

    def spy(fn, plan, x):
        seen.append(len(plan.spans))
        return original(fn, plan, x)

    monkeypatch.setattr(layers, "_collect", spy)
    return seen


def test_spans_lie_on_the_kernel_grid_and_cover_the_sequence():
    cu = [0, 40, 41, 100]
    s = layers.spans(100, cu, 16, 32)
    assert s[0][0] == 0 and s[-1][1] == 100 and all(b == c for (_, b), (c, _) in zip(s, s[1:]))
    grid = {c for a, b in zip(cu, cu[1:]) for c in range(a, b, 16)} | {100}
    assert all(a in grid and b in grid for a, b in s)
    assert all(b - a <= 32 for a, b in s)
    assert layers.spans(100, [0, 100], 64, 16) == [(0, 64), (64, 100)]  # below the grid: one grid step


def test_row_chunked_layers_equal_the_in_memory_oracle(fp32_capture, tmp_path, small_grid, chunk_calls):
    """Tiny Qwen3-VL (144 text tokens) with 16-row chunks: loss and every input-side gradient bitwise
    the in-memory oracle's; the decoder layers' weight gradients (sums split by chunk) within 1e-12."""
    mem = replay(fp32_capture, tmp_path / "m", verify="off")
    cut = replay(fp32_capture, tmp_path / "c", max_memory=8 << 30, token_chunk=16)
    assert chunk_calls and min(chunk_calls) >= 8, chunk_calls  # forward and recomputation, every layer
    assert Bundle(mem).get("loss")["value"] == Bundle(cut).get("loss")["value"]
    worst, moved = _split_sums(_grads(mem), _grads(cut), lambda n: ".language_model.layers." in n or ".mlp." in n)
    assert worst <= 1e-12, worst
    assert moved == [], moved  # embeddings, the ViT's attention, final norm, head: untouched bitwise


@pytest.fixture(scope="module")
def packed_text(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed_layers")
    return root, packed_text_capture(root)[0]


def test_row_chunks_across_packed_samples_equal_the_unchunked_replay(packed_text, tmp_path, small_grid, chunk_calls):
    """Tiny Qwen3 text, three packed samples (chunks end at sample boundaries and on the grid), 16-row
    chunks vs no row chunks at all: loss bitwise, every gradient within 1e-12;
    streamed chunked also bitwise across two runs (repeatable)."""
    _, cap = packed_text
    cu = Bundle(cap).get("packing")["cu_seqlens"]
    whole = replay(cap, tmp_path / "w", max_memory=8 << 30, token_chunk=1 << 20)
    assert chunk_calls == []  # one chunk covers the sequence: the layer runs unchanged
    cut = replay(cap, tmp_path / "c", max_memory=8 << 30, token_chunk=16)
    assert chunk_calls and min(chunk_calls) >= len(cu) - 1 + 2, (chunk_calls, cu)
    assert Bundle(whole).get("loss")["value"] == Bundle(cut).get("loss")["value"]
    ga, gb = _grads(whole), _grads(cut)
    worst, moved = _split_sums(ga, gb, lambda n: ".layers." in n)
    assert worst <= 1e-12, worst
    # Embedding, final norm and head: bitwise where the BLAS picks the same kernels for every row
    # count; on some CPUs a 16-row chunk and the whole sequence round differently at the last ulp
    # (measured on this suite's 2-core CI machine: the three moved, within 1e-15), so within 1e-12.
    rest = max((float((ga[n] - gb[n]).norm() / ga[n].norm()) for n in moved if ga[n].norm() > 0), default=0.0)
    assert rest <= 1e-12, (moved, rest)
    again = replay(cap, tmp_path / "c2", max_memory=8 << 30, token_chunk=16)
    a, b = _grads(cut), _grads(again)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_planted_key_error_is_seen(packed_text, tmp_path, small_grid, monkeypatch):
    """The collected keys are what the chunks attend to: one key row off by 1e-9 moves the loss."""
    _, cap = packed_text
    ok = replay(cap, tmp_path / "ok", max_memory=8 << 30, token_chunk=16)
    original = layers._collect

    def planted(fn, plan, x):
        K, V = original(fn, plan, x)
        K[:, :, 3] += 1e-9
        return K, V

    monkeypatch.setattr(layers, "_collect", planted)
    bad = replay(cap, tmp_path / "bad", max_memory=8 << 30, token_chunk=16)
    assert Bundle(ok).get("loss")["value"] != Bundle(bad).get("loss")["value"]


def test_emulated_replays_keep_their_layers_whole(fp32_capture, tmp_path, chunk_calls):
    """An emulated replay's attention is the fused sdpa (not the oracle kernel): its layers run unchunked."""
    replay(fp32_capture, tmp_path / "e", dtype="amp-bf16", max_memory=8 << 30, token_chunk=16)
    assert chunk_calls == []


def test_a_crashed_chunked_replay_resumes_bitwise(packed_text, tmp_path, small_grid, monkeypatch):
    """The run dies after two units' backward (row-chunked layers, 16-row chunks); the same call resumes
    from the journal and ends bitwise identical to an uninterrupted run."""
    from oracle.replay.streaming import journal

    _, cap = packed_text
    whole = replay(cap, tmp_path / "whole", max_memory=8 << 30, token_chunk=16)
    original, written = journal.Journal.write_unit, []

    def dies(self, unit, grads):
        original(self, unit, grads)
        written.append(unit)
        if len(written) == 2:
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(journal.Journal, "write_unit", dies)
    with pytest.raises(KeyboardInterrupt):
        replay(cap, tmp_path / "o", max_memory=8 << 30, token_chunk=16)
    monkeypatch.setattr(journal.Journal, "write_unit", original)
    out = replay(cap, tmp_path / "o", max_memory=8 << 30, token_chunk=16)
    assert Bundle(out).get("streaming")["resumed"]
    a, b = _grads(whole), _grads(out)
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
    assert Bundle(out).get("backward_order") == Bundle(whole).get("backward_order")
