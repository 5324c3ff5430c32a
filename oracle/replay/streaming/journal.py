"""A streamed member's journal: its work directory's gradient shards, the input gradients of the unit
calls it finished, and one JSON line per finished call, unit or drop (signed and fsynced,
streaming/workdir.py), which a resumed run reads back to skip what is done (streaming/engine.py)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...bundle.atomic_file import fresh, open_new
from ...bundle.store import entry_hashes, tensor_sha256
from ...precision.mode import as_stored
from . import workdir

JOURNAL = "journal.jsonl"
DROPPED = object()  # a call's input gradients, dropped from the journal once nothing needs them


class Journal:
    """The work directory of one member: gradient shards, input gradients of finished units, and a
    journal (one JSON line per finished call or unit, fsynced) that a resumed run reads back."""

    def __init__(self, work: Path, member: str):
        self.dir = work / member
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / JOURNAL
        self.work = work
        self.units: dict[str, dict] = {}
        self.calls: dict[tuple[str, int], str] = {}
        self.dropped: set[tuple[str, int]] = set()
        self.promoted: dict[tuple[str, int], int] = {}  # each journalled call's promotions (precision/mode.py)
        self.written = 0  # bytes of the files written (shards and input gradients)
        records, self.note = workdir.valid_records(work, self.dir)  # signed, inside, hash-checked; else cut there
        for rec in records:
            if rec["kind"] == "call":
                self.promoted[(rec["unit"], rec["index"])] = int(rec.get("promotions", 0))
            if rec["kind"] == "drop":
                self.dropped.add((rec["unit"], rec["index"]))
                continue
            if not (self.dir / rec["file"]).is_file():  # a call whose input gradients were dropped
                continue
            if rec["kind"] == "unit":
                self.units[rec["unit"]] = rec
            elif rec["kind"] == "call":
                self.calls[(rec["unit"], rec["index"])] = rec["file"]
        self._shard = len(self.units)

    def _append(self, rec: dict) -> None:
        with open_new(self.path, os.O_WRONLY | os.O_APPEND) as f:  # a symlink at the journal's name: ELOOP
            f.write((json.dumps(workdir.seal(self.work, rec)) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())

    def _save(self, tensors: dict[str, torch.Tensor], path: Path) -> None:
        tmp = fresh(path.with_suffix(".tmp"))
        with as_stored():
            save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp))
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self.written += path.stat().st_size

    def unit_done(self, unit: str) -> bool:
        return unit in self.units

    def call_recorded(self, unit: str, index: int) -> bool:
        return (unit, index) in self.calls or (unit, index) in self.dropped

    def drop_call(self, unit: str, index: int) -> None:
        """The call's input gradients are no longer needed: journalled as dropped, then removed."""
        f = self.calls.pop((unit, index), None)
        if f is None:
            return
        self._append({"kind": "drop", "unit": unit, "index": index})
        self.dropped.add((unit, index))
        (self.dir / f).unlink(missing_ok=True)

    def grad_inputs(self, unit: str, index: int) -> list[tuple[torch.Tensor | None, bool]] | None:
        """A finished call's input gradients, each with whether the emulation held it in low precision
        (amp: ``PrecisionMode.mark_low``); DROPPED, or None where the call is not journalled."""
        if (unit, index) in self.dropped:
            return DROPPED
        f = self.calls.get((unit, index))
        if f is None:
            return None
        with as_stored():
            d = load_file(str(self.dir / f))
        n = int(d.pop("__n__").item())
        low = d.pop("__low__", torch.zeros(n, dtype=torch.bool)).tolist()
        return [(d.get(str(i)), bool(low[i])) for i in range(n)]

    def record_call(self, unit: str, index: int, grads: list[torch.Tensor | None], low: list[bool] | None = None,
                    promotions: int = 0) -> None:  # fmt: skip
        """Journal a finished call's input gradients and, for amp emulation, which were held in low
        precision: a resumed run hands them on marked alike, so the sums they meet in the glue round
        (and draw a member's jitter) as an uninterrupted run's do. ``promotions``: the lower-precision
        casts the call's recomputation and backward promoted, which a resumed run that skips the call
        adds to its count, so the manifest's ``numerics.promotions`` is an uninterrupted run's."""
        if self.call_recorded(unit, index):
            return
        f = f"gin-{_slug(unit)}-{index}.safetensors"
        tensors = {str(i): g for i, g in enumerate(grads) if g is not None}
        tensors["__n__"] = torch.tensor(len(grads))
        tensors["__low__"] = torch.tensor([bool(x) for x in low] if low else [False] * len(grads), dtype=torch.bool)
        self._save(tensors, self.dir / f)
        self.calls[(unit, index)] = f
        sha = {k: tensor_sha256(t) for k, t in tensors.items()}
        self.promoted[(unit, index)] = promotions
        self._append({"kind": "call", "unit": unit, "index": index, "file": f, "sha256": sha, "promotions": promotions})

    def new_shard(self) -> Path:
        self._shard += 1
        return self.dir / f"shard-{self._shard:05d}.safetensors"

    def commit_file(self, unit: str, path: Path, entries: dict[str, dict]) -> None:
        """A shard written elsewhere (by rows, oracle/bundle/rows.py), fsynced and in place: journalled."""
        self.written += path.stat().st_size  # a token embedding's holes (rows.RowWriter.zeros) counted: an upper bound
        rec = {"kind": "unit", "unit": unit, "file": path.name, "entries": entries,
               "sha256": {n: e["sha256"] for n, e in entries.items()}}  # fmt: skip
        self.units[unit] = rec
        self._append(rec)

    def write_unit(self, unit: str, grads: dict[str, torch.Tensor]) -> None:
        if unit in self.units or not grads:
            return
        self._shard += 1
        f = f"shard-{self._shard:05d}.safetensors"
        entries = {}
        for n, g in grads.items():
            g = g.detach().contiguous()
            entries[n] = {"dtype": str(g.dtype).removeprefix("torch."), "shape": list(g.shape),
                          **entry_hashes(g)}  # fmt: skip
        self._save(grads, self.dir / f)
        rec = {
            "kind": "unit",
            "unit": unit,
            "file": f,
            "entries": entries,
            "sha256": {n: e["sha256"] for n, e in entries.items()},
        }
        self.units[unit] = rec
        self._append(rec)


def read_journal(member_dir: Path, kind: str | None = None) -> list[dict]:
    """The records of a member's journal (of one ``kind``: "unit" or "call"); a last line cut by a
    kill ends it, everything before it holds."""
    recs = []
    for line in workdir.read_limited(member_dir / JOURNAL, member_dir.parent).decode(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            break
        if not isinstance(rec, dict):
            break
        if kind is None or rec.get("kind") == kind:
            recs.append(rec)
    return recs


def _slug(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()[:12]
