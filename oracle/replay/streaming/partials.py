"""The token-parallel ranks' partial gradient shards added onto rank 0 (driver._replay_tokens).

Every rank journals one safetensors file per unit of its *partial* gradients (each parameter's gradient over
its own rows, the whole model's gradient set). The step's gradient of a tensor is their sum, elementwise IEEE
float64 additions (ranks without the tensor left out), one shard per unit in rank 0's journal order, then units
only later ranks reached.

Who adds what (``schedule``): a binomial tree. In round k a rank r with r mod 2^(k+1) = 2^k sends its sums to
r - 2^k; the pairs of a round are disjoint and run at once, so rank 0 takes ceil(log2 N) gradient sets where it
took N - 1 from the ranks one after another (8 hosts: 3 sets of the 8B's 70 GB, not 7). The sum is left + right
over rank blocks, ((g0 + g1) + (g2 + g3)) + ..., rank order for N <= 3; fixed, so a rerun is bitwise the same.

As the bytes arrive (``Adder``, the usual case). A sender's files come over gloo in pieces of distributed.CHUNK
bytes. Where a received file's header is the receiver's sum's (the same tensors, all float64, the same shapes and
data offsets: both reached every parameter of the unit), the data region of both is one float64 array element
for element, so each piece is added to the same bytes of the receiver's file and written to the next sum, hashed
as it goes where the sum is final (rank 0's last addition: the manifest's sha256 and value_sha256 per tensor; for
float64 both hash these bytes, the value hash after the shape). The received copy is never written: it is read
once, off the wire. Receiving every file to disk first and summing after wrote it, fsynced it and read it back:
with 2 ranks at 4096 tokens (0.9 GB of partial gradients) rank 0 spent 12 s between its last unit and the bundle
(5.7 s receiving, 6.0 s summing) against a 42 s step (one-off timings of ``benchmarks/token_parallel.py``'s 2-rank
command), 4.9 s now; ``benchmarks/partial_sums.py``: 0.16 GB/s per received byte before, 0.45 GB/s now, bitwise
the same sums.

Otherwise (a unit the receiver never reached, a tensor only some ranks reached, another dtype) the received file
is written as it came and ``sum_unit`` adds it to the receiver's: whole tensors, or row blocks of SUM_ROWS for a
one-tensor shard (the head, an embedding: never whole in memory).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ...bundle.atomic_file import open_new
from ...parallel.distributed import CHUNK
from ..token_split import merged_order

SUM_ROWS = 4096  # rows per block when a one-tensor shard (the head, a token embedding) is summed by sum_unit

Record = dict[str, Any]  # a journal's unit record: {"unit", "file", "entries": {name: {dtype, shape, sha256, value_sha256}}}


def sum_unit(have: list[tuple[Path, Record]], path: Path) -> dict[str, dict]:
    """One unit's shard at ``path`` from its partial files ``have`` (in rank order, each with its record):
    every tensor added in that order over the files holding it -> its manifest entries."""
    from safetensors import safe_open

    from ...bundle.rows import RowWriter
    from ...parallel.distributed import save_part

    names = merged_order([list(rec["entries"]) for _, rec in have])
    files = [safe_open(str(f), framework="pt") for f, _ in have]
    if len(names) == 1 and len(have[0][1]["entries"][names[0]]["shape"]) >= 2:
        name = names[0]
        shape = have[0][1]["entries"][name]["shape"]
        w = None
        for v0 in range(0, shape[0], SUM_ROWS):
            acc = None
            for f in files:
                if name in f.keys():
                    block = f.get_slice(name)[v0 : v0 + SUM_ROWS]
                    acc = block.clone() if acc is None else acc.add_(block)
            if w is None:
                w = RowWriter(path, name, shape, acc.dtype)
            w.write(acc)
        return {name: w.close()}
    summed = {}
    for name in names:
        acc = None
        for f in files:
            if name in f.keys():
                t = f.get_tensor(name)
                acc = t if acc is None else acc.add_(t)
        summed[name] = acc
    return save_part(summed, path)


def _read_header(path: Path) -> tuple[bytes, dict]:
    """A safetensors file's header: (its bytes, length prefix included; the parsed JSON)."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0]
        body = f.read(n)
    return head + body, json.loads(body)


def _layout(header: dict) -> dict:
    return {k: v for k, v in header.items() if k != "__metadata__"}


class Pipeline:
    """The threads behind the adding: one writes each summed piece and updates its tensors' sha256, the other
    their value_sha256 (file writes and hashlib release the GIL), while the main thread receives the next piece,
    reads the accumulated bytes and adds. Two buffers: one is added into while the other is written and hashed.
    Measured (rank 0 of the 2-rank step above, 0.9 GB): the three steps one after the other took 6.3 s, the
    writing 1.9 s and the hashing 1.6 s of it."""

    def __init__(self, size: int):
        self._threads = (ThreadPoolExecutor(1), ThreadPoolExecutor(1))
        self._bufs = [bytearray(size) for _ in range(2)]
        self._pending: list[list[Future]] = [[], []]
        self._next = 0

    def buffer(self) -> tuple[int, memoryview]:
        """A free buffer (its earlier piece written and hashed)."""
        i, self._next = self._next, self._next ^ 1
        for f in self._pending[i]:
            f.result()
        self._pending[i] = []
        return i, memoryview(self._bufs[i])

    def submit(self, i: int, write: Callable[[], None], value: Callable[[], None]) -> None:
        self._pending[i] = [self._threads[0].submit(write), self._threads[1].submit(value)]

    def drain(self) -> None:
        for i in (0, 1):
            for f in self._pending[i]:
                f.result()
            self._pending[i] = []

    def close(self) -> None:
        for t in self._threads:
            t.shutdown()


class Adder:
    """Where one received file's bytes go (distributed.recv_parts' sink): added piece by piece into the
    accumulated file ``acc`` and written to ``out`` when the layouts match (module docstring), else written to
    ``out`` as received. ``entries`` after ``close``: the sum's manifest entries (None for a received copy)."""

    def __init__(self, acc: Path | None, out: Path, pipeline: Pipeline, hashing: bool = True):
        self.acc, self.out, self._pipe, self.hashing = acc, out, pipeline, hashing
        self.adding: bool | None = None  # None until the received header is whole
        self.entries: dict[str, dict] | None = None
        self._head = bytearray()
        self._carry = b""  # received data bytes short of a whole float64
        self._pos = 0  # data bytes added so far
        self._f = self._src = None

    def write(self, piece: memoryview) -> None:
        while self.adding is None:  # the header: 8 bytes of its length, then its JSON
            want = 8 if len(self._head) < 8 else 8 + struct.unpack("<Q", self._head[:8])[0]
            if len(self._head) >= 8 and len(self._head) == want:
                self._start(bytes(self._head), json.loads(bytes(self._head[8:]) or b"{}"))
                break
            if not len(piece):
                return
            k = want - len(self._head)
            self._head += piece[:k]
            piece = piece[k:]
        if self.adding:
            self._add(piece)
        else:
            self._f.write(piece)

    def _start(self, head: bytes, header: dict) -> None:
        self._f = open_new(self.out)
        layout = _layout(header)
        acc_head, acc_header = _read_header(self.acc) if self.acc is not None else (b"", None)
        self.adding = (acc_header is not None and _layout(acc_header) == layout
                       and all(e["dtype"] == "F64" for e in layout.values()))  # fmt: skip
        if not self.adding:
            self._f.write(head)
            return
        self._src = open(self.acc, "rb")
        self._src.seek(len(acc_head))
        self._f.write(acc_head)  # the sum keeps the accumulated file's header: the same layout
        self._spans, self._hash = _hashers(layout)
        self._size = max((b for _, b, _ in self._spans), default=0)
        self._shapes = {name: list(e["shape"]) for name, e in layout.items()}

    def _add(self, piece: memoryview) -> None:
        if self._carry:
            piece = memoryview(self._carry + bytes(piece))
        n = len(piece) - len(piece) % 8
        self._carry = bytes(piece[n:])
        if n == 0:
            return
        if self._pos + n > self._size:
            raise ValueError(f"{self.out.name}: more data than its header's {self._size} bytes")
        i, buf = self._pipe.buffer()
        view = buf[:n]
        if self._src.readinto(view) != n:
            raise ValueError(f"{self.acc}: shorter than its header says")
        total = np.frombuffer(view, dtype="<f8")
        total += np.frombuffer(piece[:n], dtype="<f8")  # ours + theirs, elementwise (round to nearest): sum_unit's bits
        p0 = self._pos
        self._pos += n
        parts = _parts(self._spans, view, p0) if self.hashing else []  # a sum added to again: hashed later, if at all

        def write() -> None:
            self._f.write(view)
            for name, part in parts:
                self._hash[name][0].update(part)

        def value() -> None:
            for name, part in parts:
                self._hash[name][1].update(part)

        self._pipe.submit(i, write, value)

    def close(self) -> None:
        if self.adding is None:
            raise ValueError(f"{self.out.name}: received {len(self._head)} bytes, not a whole safetensors header")
        if self.adding:
            self._pipe.drain()
            self._src.close()
            if self._carry or self._pos != self._size:
                raise ValueError(f"{self.out.name}: received {self._pos + len(self._carry)} data bytes of {self._size}")
            self.entries = {name: {"dtype": "float64", "shape": self._shapes[name],
                                   "sha256": h.hexdigest() if self.hashing else None,
                                   "value_sha256": v.hexdigest() if self.hashing else None}
                            for name, (h, v) in self._hash.items()}  # fmt: skip
        self._f.close()  # fsynced once, with the bundle's other files, before it is published (BundleWriter)


Receive = Callable[[int, Callable[[dict, str], Adder]], dict]
Sums = list[tuple[Path, Record]]  # a rank's sums so far: one file per unit, in unit order


def schedule(ranks: int, me: int) -> list[tuple[str, int]]:
    """This rank's part of the binomial tree that adds every rank's partials onto rank 0: ("recv", src) steps,
    then one ("send", dst) (rank 0 only receives). Round k (step 2^k): a rank r with r mod 2^(k+1) = 2^k sends its
    sums to r - 2^k and is done; one with r mod 2^(k+1) = 0 adds those of r + 2^k, where that rank exists. A round's
    pairs are disjoint, so they run at once on their hosts: rank 0 takes ceil(log2 N) gradient sets, not N - 1.
    The sum is then left + right over rank blocks: ((g0 + g1) + (g2 + g3)) + ...; for N <= 3 that is rank order."""
    out, step = [], 1
    while step < ranks:
        if me % (2 * step) == step:
            out.append(("send", me - step))
            break
        if me % (2 * step) == 0 and me + step < ranks:
            out.append(("recv", me + step))
        step *= 2
    return out


def add_into(have: Sums, src: int, receive: Receive, into: Path, keep: set[Path], hashing: bool) -> Sums:
    """This rank's sums so far (``have``) plus rank ``src``'s, taken by ``receive(src, sink)``
    (distributed.recv_parts: its meta, each file's bytes into ``sink(meta, name)``) and added as they arrive
    (ours + theirs) -> the new sums, units only ``src`` had after ours in its order. A superseded sum under
    ``into`` is removed; files in ``keep`` (the rank's journal: resume) are only read. ``hashing``: the sums hashed
    as they are written (rank 0's last addition); else their entries carry no hashes and ``finish`` hashes what
    reaches it so."""
    into.mkdir(parents=True, exist_ok=True)
    acc = {rec["unit"]: (path, rec) for path, rec in have}
    order = [rec["unit"] for _, rec in have]
    sinks: dict[str, tuple[Record, Adder]] = {}
    pipeline = Pipeline(CHUNK + 8)  # a piece and the few bytes a misaligned one carries

    def sink(meta: dict, name: str) -> Adder:
        rec = next(u for u in meta["units"] if u["file"] == name)
        mine = acc.get(rec["unit"])
        out = into / f"rank{src}-{len(sinks):05d}.safetensors"
        sinks[name] = (rec, Adder(mine[0] if mine else None, out, pipeline, hashing))
        return sinks[name][1]

    try:
        meta = receive(src, sink)
    finally:
        pipeline.close()
    for rec, adder in sinks.values():
        unit = rec["unit"]
        before = acc.get(unit)
        if adder.adding:  # our record's order of names
            acc[unit] = (adder.out, {**rec, "file": adder.out.name, "entries": {n: adder.entries[n] for n in before[1]["entries"]}})
        elif before is None:  # a unit only theirs so far: their file is the sum
            acc[unit] = (adder.out, {**rec, "file": adder.out.name})
        else:
            path = into / f"{adder.out.stem}-sum.safetensors"
            entries = sum_unit([before, (adder.out, rec)], path)
            adder.out.unlink()
            acc[unit] = (path, {**rec, "file": path.name, "entries": entries})
        if before is not None and before[0] not in keep:
            before[0].unlink()  # an earlier sum of ours, superseded
    return [acc[u] for u in merged_order([order, [rec["unit"] for rec in meta["units"]]])]


def finish(sums: Sums, into: Path, keep: set[Path]) -> list[tuple[Path, dict]]:
    """On rank 0 after its last addition: [(file under ``into``, manifest entries)], one shard per unit named
    shard-00001... in unit order; a sum written without hashes is hashed now (read once, by CHUNK)."""
    into.mkdir(parents=True, exist_ok=True)
    out = []
    for k, (path, rec) in enumerate(sums, 1):
        dst = into / f"shard-{k:05d}.safetensors"
        if path in keep:  # a journal file of rank 0's own: the journal keeps it (resume)
            try:
                os.link(path, dst)
            except OSError:
                shutil.copyfile(path, dst)
        else:
            os.replace(path, dst)
        entries = rec["entries"]
        if any(e.get("sha256") is None for e in entries.values()):
            entries = _hashed(dst, entries)
        out.append((dst, dict(entries)))
    return out


def _hashed(path: Path, entries: dict[str, dict]) -> dict[str, dict]:
    """``entries`` with both hashes of a float64 file written without them."""
    head, header = _read_header(path)
    layout = _layout(header)
    spans, hashes = _hashers(layout)
    buf, pos = bytearray(CHUNK), 0
    with open(path, "rb") as f:
        f.seek(len(head))
        while n := f.readinto(buf):
            for name, part in _parts(spans, memoryview(buf)[:n], pos):
                for h in hashes[name]:
                    h.update(part)
            pos += n
    return {name: {**e, "sha256": hashes[name][0].hexdigest(), "value_sha256": hashes[name][1].hexdigest()}
            for name, e in entries.items()}  # fmt: skip


def _hashers(layout: dict) -> tuple[list[tuple[int, int, str]], dict[str, tuple[Any, Any]]]:
    """A file's tensors by data offset (begin, end, name), and each one's two hashes, fresh (bundle/store.py:
    tensor_sha256 of the bytes; value_sha256 of the shape, then the float64 bytes)."""
    spans = sorted((e["data_offsets"][0], e["data_offsets"][1], name) for name, e in layout.items())
    hashes = {name: (hashlib.sha256(), hashlib.sha256(json.dumps(list(e["shape"])).encode())) for name, e in layout.items()}
    return spans, hashes


def _parts(spans: list[tuple[int, int, str]], view: memoryview, p0: int) -> list[tuple[str, memoryview]]:
    """The pieces of ``view`` (data bytes p0.. of a file) that fall in each tensor's span (begin, end, name)."""
    n = len(view)
    return [(name, view[max(b, p0) - p0 : min(e, p0 + n) - p0]) for b, e, name in spans if max(b, p0) < min(e, p0 + n)]
