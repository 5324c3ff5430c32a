"""The token-parallel ranks' partial gradient shards added onto rank 0 by a binomial tree as their bytes
arrive (oracle/replay/streaming/partials.py): the tree's sums bit for bit and their hashes, whatever the
pieces the bytes come in; the received copies never kept."""

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
    3: {"layer": ["w", "b"], "part": ["y"], "only3": ["v"]},
    4: {"layer": ["w", "b"], "head": ["lm_head.weight"], "only4": ["q"]},
}
SHAPES = {**{n: s for u in UNITS.values() for n, s in u.items()}, "z": (3, 2), "u": (2, 3), "v": (5,), "q": (4, 2)}


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


def _feeder(sums_of, sizes: list[int], seen: list | None = None):
    """distributed.recv_parts' protocol without gloo: the sender's current sums (as send_parts sends them), each
    file's bytes handed to the sink in pieces of ``sizes`` (cycled), then closed. ``seen``: every sink."""

    def receive(r: int, sink):
        sums = sums_of[r]
        meta = {"units": [{**rec, "file": p.name} for p, rec in sums], "files": [p.name for p, _ in sums]}
        for path, _ in sums:
            data = memoryview(path.read_bytes())
            w, at, k = sink(meta, path.name), 0, 0
            if seen is not None:
                seen.append(w)
            while at < len(data):
                step = sizes[k % len(sizes)]
                w.write(data[at : at + step])
                at, k = at + step, k + 1
            w.close()
        return meta

    return receive


def _tree(tmp: Path, parts, ranks: int, sizes: list[int], seen: list) -> list[tuple[Path, dict]]:
    """What the ranks of driver._replay_tokens do, one pair after another: each its schedule, rank 0 finishing."""
    sums = {r: [(folder / rec["file"], rec) for rec in recs] for r, (folder, recs) in enumerate(parts)}
    keep = {r: {p for p, _ in sums[r]} for r in sums}
    steps = {r: partials.schedule(ranks, r) for r in range(ranks)}
    for rnd in range(max(len(s) for s in steps.values())):
        for r in range(ranks):
            if rnd < len(steps[r]) and steps[r][rnd][0] == "recv":
                src = steps[r][rnd][1]
                assert steps[src][-1] == ("send", r)
                last = r == 0 and rnd == len(steps[0]) - 1
                sums[r] = partials.add_into(sums[r], src, _feeder(sums, sizes, seen), tmp / f"summed{r}", keep[r], last)
    return partials.finish(sums[0], tmp / "summed0", keep[0])


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_the_tree_sends_each_rank_once_and_rank_0_takes_log2_sets():
    for ranks in range(1, 17):
        steps = {r: partials.schedule(ranks, r) for r in range(ranks)}
        assert all(s[-1][0] == "send" for r, s in steps.items() if r)  # every other rank sends once, last
        assert all(kind == "recv" for kind, _ in steps[0])
        assert len(steps[0]) == (ranks - 1).bit_length()  # ceil(log2 N) sets into rank 0
        edges = sorted((r, s[-1][1]) for r, s in steps.items() if r)
        assert edges == sorted((src, r) for r, s in steps.items() for kind, src in s if kind == "recv")  # sends meet receives
    assert partials.schedule(8, 0) == [("recv", 1), ("recv", 2), ("recv", 4)]
    assert partials.schedule(8, 6) == [("recv", 7), ("send", 4)]


def _expected(grads, ranks: int, n: str) -> torch.Tensor:
    """The tree's sum: left + right over rank blocks (a block's missing tensor left out)."""

    def block(r0: int, width: int):
        if width == 1:
            return grads.get((r0, n)) if r0 < ranks else None
        a, b = block(r0, width // 2), block(r0 + width // 2, width // 2)
        return a if b is None else b if a is None else a + b

    width = 1
    while width < ranks:
        width *= 2
    return block(0, width)


@pytest.mark.parametrize("ranks", [2, 3, 5])
@pytest.mark.parametrize("sizes", [[64 << 20], [3, 5, 4093, 1 << 16]], ids=["whole", "ragged"])
def test_the_tree_sum_is_bit_for_bit_and_hashed(tmp_path, ranks, sizes):
    parts, grads = _ranks(tmp_path, ranks)
    own_before = _digest(parts[0][0])
    seen = []
    out = _tree(tmp_path, parts, ranks, sizes, seen)

    order = partials.merged_order([list(HELD[r]) for r in range(ranks)])
    assert [p.name for p, _ in out] == [f"shard-{k:05d}.safetensors" for k in range(1, len(order) + 1)]
    got = {}
    for path, entries in out:
        tensors = load_file(str(path))
        assert set(tensors) == set(entries)
        for n, t in tensors.items():
            assert entries[n]["sha256"] == tensor_sha256(t) and entries[n]["value_sha256"] == value_sha256(t), n
            assert entries[n]["shape"] == list(SHAPES[n]) and entries[n]["dtype"] == "float64"
        got.update(tensors)
    assert set(got) == {n for r in range(ranks) for names in HELD[r].values() for n in names}
    for n in got:
        assert torch.equal(got[n], _expected(grads, ranks, n)), n
    if ranks == 5:  # rank order and the tree's differ at these magnitudes: the order is the tree's
        g = [grads[(r, "w")] for r in range(5)]
        assert not torch.equal(got["w"], (((g[0] + g[1]) + g[2]) + g[3]) + g[4])
        assert any(a.adding and not a.hashing for a in seen)  # sums added to again were not hashed on the way
    assert any(a.adding for a in seen) and any(not a.adding for a in seen)  # both paths ran
    assert _digest(parts[0][0]) == own_before  # rank 0's journal files read, never changed nor moved (resume)
    leftovers = {p.name for p in (tmp_path / "summed0").iterdir()} - {p.name for p, _ in out}
    assert not leftovers  # the sums superseded on the way and the received copies are removed


def test_a_truncated_file_is_refused_not_summed(tmp_path):
    parts, _ = _ranks(tmp_path, 2)
    folder, recs = parts[1]
    name = recs[0]["file"]
    data = (folder / name).read_bytes()
    (folder / name).write_bytes(data[:-16])  # the stream ends two float64 values short
    with pytest.raises(ValueError, match="data bytes of"):
        _tree(tmp_path, parts, 2, [4096], [])
