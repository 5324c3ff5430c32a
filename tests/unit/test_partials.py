"""Rank 0's sum of the token-parallel ranks' partial gradient shards as their bytes arrive
(oracle/replay/streaming/partials.py): the same bits and hashes as adding whole files in rank order,
whatever the pieces the bytes come in."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from oracle.bundle.store import tensor_sha256, value_sha256
from oracle.parallel.distributed import save_part
from oracle.replay.streaming import partials

# unit -> {tensor: shape}; which rank holds which (a tensor only some ranks reached, units only one reached)
UNITS = {"layer": {"w": (7, 5), "b": (5,)}, "head": {"lm_head.weight": (9000, 3)}, "part": {"x": (4, 4), "y": (6,)}}
HELD = {
    0: {"layer": ["w", "b"], "head": ["lm_head.weight"], "only0": ["z"], "part": ["x", "y"]},
    1: {"layer": ["w", "b"], "head": ["lm_head.weight"], "part": ["x"], "only1": ["u"]},
    2: {"layer": ["w", "b"], "head": ["lm_head.weight"], "part": ["x", "y"], "only1": ["u"]},
}
SHAPES = {**{n: s for u in UNITS.values() for n, s in u.items()}, "z": (3, 2), "u": (2, 3)}


def _values(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # magnitudes spread over 2^-20..2^20: the order of the additions shows in the last bits
    return torch.randn(shape, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-20, 21, shape, generator=g).double())


def _ranks(tmp: Path, ranks: int) -> tuple[list[tuple[Path, list[dict]]], dict]:
    parts, grads = [], {}
    for r in range(ranks):
        folder = tmp / f"rank{r}"
        folder.mkdir()
        recs = []
        for k, (unit, names) in enumerate(HELD[r].items(), 1):
            tensors = {n: _values(SHAPES[n], 1000 * r + 10 * k + i) for i, n in enumerate(names)}
            for n, t in tensors.items():
                grads[(r, n)] = t
            f = f"shard-{k:05d}.safetensors"
            recs.append({"kind": "unit", "unit": unit, "file": f, "entries": save_part(tensors, folder / f)})
        parts.append((folder, recs))
    return parts, grads


def _feeder(parts, sizes: list[int], seen: list | None = None):
    """distributed.recv_parts' protocol without gloo: each file's bytes handed to the sink in pieces of ``sizes``
    (cycled), then closed. ``seen``: (rank, unit, the sink) of every file."""

    def receive(r: int, sink):
        folder, recs = parts[r]
        meta = {"units": recs, "files": [rec["file"] for rec in recs]}
        for rec, name in zip(recs, meta["files"]):
            data = memoryview((folder / name).read_bytes())
            w, at, k = sink(meta, name), 0, 0
            if seen is not None:
                seen.append((r, rec["unit"], w))
            while at < len(data):
                step = sizes[k % len(sizes)]
                w.write(data[at : at + step])
                at, k = at + step, k + 1
            w.close()
        return meta

    return receive


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("sizes", [[64 << 20], [3, 5, 4093, 1 << 16]], ids=["whole", "ragged"])
@pytest.mark.parametrize("hash_last", [False, True], ids=["hash-each", "hash-last"])
def test_streamed_sum_is_the_rank_order_sum_bit_for_bit(tmp_path, ranks, sizes, hash_last):
    parts, grads = _ranks(tmp_path, ranks)
    own_before = _digest(parts[0][0])
    last = partials.holders([[rec["unit"] for rec in recs] for _, recs in parts]) if hash_last else None
    seen = []
    out = partials.add_received(parts[0], ranks, _feeder(parts, sizes, seen), tmp_path / "summed", last)
    for r, unit, adder in seen:  # a partial sum is hashed only where no later rank adds to it
        assert adder.hashing == (not hash_last or r == max(q for q in range(ranks) if unit in HELD[q])), (r, unit)
    if hash_last and ranks == 3:
        assert any(a.adding and not a.hashing for _, _, a in seen)  # the case this covers: sums not hashed

    order = [u for u in ["layer", "head", "only0", "part", "only1"] if any(u in HELD[r] for r in range(ranks))]
    assert [p.name for p, _ in out] == [f"shard-{k:05d}.safetensors" for k in range(1, len(order) + 1)]
    got = {}
    for (path, entries), unit in zip(out, order):
        tensors = load_file(str(path))
        assert set(tensors) == set(entries)
        for n, t in tensors.items():
            assert entries[n]["sha256"] == tensor_sha256(t) and entries[n]["value_sha256"] == value_sha256(t), n
            assert entries[n]["shape"] == list(SHAPES[n]) and entries[n]["dtype"] == "float64"
        got.update(tensors)
    assert set(got) == set(SHAPES)
    for n in got:
        want = None
        for r in range(ranks):  # rank order: ((g0 + g1) + g2)
            g = grads.get((r, n))
            if g is not None:
                want = g.clone() if want is None else want + g
        assert torch.equal(got[n], want), n
    if ranks == 3:  # the order matters at these magnitudes: another order would have been seen
        g0, g1, g2 = (grads[(r, "w")] for r in range(3))
        assert not torch.equal((g0 + g1) + g2, g0 + (g1 + g2))
    assert _digest(parts[0][0]) == own_before  # rank 0's journal files read, never changed nor moved (resume)
    leftovers = {p.name for p in (tmp_path / "summed").iterdir()} - {p.name for p, _ in out}
    assert not leftovers  # the partial sums superseded on the way are removed


def test_a_truncated_file_is_refused_not_summed(tmp_path):
    parts, _ = _ranks(tmp_path, 2)
    folder, recs = parts[1]
    name = recs[0]["file"]
    data = (folder / name).read_bytes()
    (folder / name).write_bytes(data[:-16])  # the stream ends two float64 values short
    with pytest.raises(ValueError, match="data bytes of"):
        partials.add_received(parts[0], 2, _feeder(parts, [4096]), tmp_path / "summed")
