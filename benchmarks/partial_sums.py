"""Rank 0's sum of the token-parallel ranks' partial gradients (oracle/replay/streaming/partials.py), per byte.

    python benchmarks/partial_sums.py [--gb 1.0] [--ranks 3] [--dir DIR]

Each of ``--ranks`` ranks holds one partial of every unit (4 units of float64, ``--gb`` in all per rank, as a
rank's journal holds them); rank 0 takes the others' files as ``add_into`` does in the step, fed from disk in
64 MiB pieces (distributed.CHUNK; no gloo: the network is the deployment's, priced on its own), three ways side by
side: the earlier path (each received file written and fsynced, then every unit summed from whole files,
``sum_unit``), the streamed sum hashing every partial sum, and hashing only the last (``holders``, the step's
way). Prints seconds and GB/s per received byte, and the bits of the three against each other. The received files
are read from the page cache (warmed first): what is timed is rank 0's own work, which the dry run prices for
several hosts (pipeline/judge.py, RANK0_SUM_BYTES_PER_S).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from oracle.parallel.distributed import CHUNK, save_part  # noqa: E402
from oracle.replay.streaming import partials  # noqa: E402


def _ranks(d: Path, ranks: int, gb: float) -> list[tuple[Path, list[dict]]]:
    per_unit = int(gb * 1e9 / 8 / 4)
    parts = []
    for r in range(ranks):
        folder = d / f"rank{r}"
        folder.mkdir()
        recs = []
        for k in range(4):
            g = torch.Generator().manual_seed(100 * r + k)
            t = {"w": torch.randn(per_unit // 1024, 1024, generator=g, dtype=torch.float64)}
            f = f"shard-{k + 1:05d}.safetensors"
            recs.append({"kind": "unit", "unit": f"layers.{k}", "file": f, "entries": save_part(t, folder / f)})
        parts.append((folder, recs))
    return parts


def _feed(sums_of):
    """distributed.recv_parts' protocol read from the sender's files (no gloo)."""

    def receive(r: int, sink):
        sums = sums_of[r]
        meta = {"units": [{**rec, "file": p.name} for p, rec in sums], "files": [p.name for p, _ in sums]}
        buf = bytearray(CHUNK)
        for path, _ in sums:
            w = sink(meta, path.name)
            with open(path, "rb") as f:
                while n := f.readinto(buf):
                    w.write(memoryview(buf)[:n])
            w.close()
        return meta

    return receive


def _earlier(parts, into: Path) -> list[tuple[Path, dict]]:
    """Each received file written and fsynced first (distributed._recv_file), then summed from whole files."""
    got = [parts[0]]
    for r in range(1, len(parts)):
        folder, recs = parts[r]
        dst = into / f"from-rank{r}"
        dst.mkdir(parents=True)
        for rec in recs:
            with open(folder / rec["file"], "rb") as s, open(dst / rec["file"], "wb") as f:
                while chunk := s.read(CHUNK):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
        got.append((dst, recs))
    out = []
    for k, rec in enumerate(got[0][1], 1):
        have = [(d / rs[k - 1]["file"], rs[k - 1]) for d, rs in got]
        path = into / f"shard-{k:05d}.safetensors"
        out.append((path, partials.sum_unit(have, path)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0, help="partial gradients per rank, GB")
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        d = Path(tmp)
        parts = _ranks(d, a.ranks, a.gb)
        received = sum((f / rec["file"]).stat().st_size for f, recs in parts[1:] for rec in recs)
        for f, recs in parts:  # into the page cache, as a rank's fresh journal is
            for rec in recs:
                (f / rec["file"]).read_bytes()
        def streamed(into: Path, hash_each: bool):
            """Rank 0 of a tree over these ranks, fed their files in rank order (for 3 ranks: rank 1's in round 1,
            rank 2's in round 2), as driver._replay_tokens runs it; then ``finish``."""
            sums = [(parts[0][0] / rec["file"], rec) for rec in parts[0][1]]
            keep = {p for p, _ in sums}
            for src in range(1, a.ranks):
                src_sums = {src: [(parts[src][0] / rec["file"], rec) for rec in parts[src][1]]}
                sums = partials.add_into(sums, src, _feed(src_sums), into, keep, hash_each or src == a.ranks - 1)
            return partials.finish(sums, into, keep)

        runs = {
            "earlier: received files written, then summed": lambda into: _earlier(parts, into),
            "streamed, every sum hashed": lambda into: streamed(into, True),
            "streamed, the last sum hashed (the step's)": lambda into: streamed(into, False),
        }
        print(f"partial sums: {a.ranks} ranks x {a.gb:.2f} GB of float64 partial gradients (4 units); rank 0 receives "
              f"{received / 1e9:.2f} GB; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} before")  # fmt: skip
        results = {}
        for label, run in runs.items():
            into = d / f"out-{len(results)}"
            t = time.perf_counter()
            out = run(into)
            dt = time.perf_counter() - t
            results[label] = [load_file(str(p))["w"] for p, _ in out]
            print(f"  {label:46s}: {dt:6.2f} s, {received / dt / 1e9:.2f} GB/s per received byte")
            shutil.rmtree(into)
        first = next(iter(results.values()))
        same = all(torch.equal(x, y) for r in results.values() for x, y in zip(first, r))
        print(f"  the three sums bitwise equal: {same}")


if __name__ == "__main__":
    main()
