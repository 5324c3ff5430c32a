"""The stages of a whole job, each reused when its inputs are unchanged, and one progress display.

A stage writes one output (a bundle folder, or a JSON document) inside the job's work folder and,
once that output is complete, a key file beside it: ``.NAME.key`` holding the stage key,

    key = sha256(json({stage name, its parameters, the fingerprints of its inputs}))

where an input bundle's fingerprint is the sha256 of its ``manifest.json`` (the manifest lists the
sha256 of every tensor, so it changes with any rewrite by a writer) and the name and sha256 of each of
its tensor files (so that a file edited in place, the manifest untouched, changes it too), a folder of
rank bundles the same over its bundles in name order, and a log the sha256 of its bytes. The key is
of content only: byte-identical inputs written again (a rerun of the demo's captures: new mtimes and
inodes) give the same key, and their stages are reused. A file's sha256 is read once per state
(size, mtime, inode) and recorded in the work folder's ``.hashes.json`` (``FileHashes``), so an
unchanged input is not read again on a rerun. A stage whose key
file matches and whose output is there is reused, not recomputed; otherwise its output is replaced
(it lies in the job's own work folder). The key file is written after the output, atomically, so a
job killed inside a stage recomputes that stage, and the streamed replay inside it resumes from its
own journal (``.OUT.partial``). Timings never enter an output, so a rerun ends with the same report.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..bundle.atomic_file import write_file
from ..bundle.jsonio import dumps, no_duplicate_keys
from ..errors import OutputError
from .eta import Calibration


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class FileHashes:
    """sha256 of files, each read once per state: ``{path: [size, mtime_ns, inode, sha256]}`` kept in
    ``record`` (a work folder's ``.hashes.json``; None: kept in memory only). A file whose size, mtime or
    inode differs from the record is read again; an unreadable or foreign record is started afresh."""

    MAX_BYTES = 64 << 20  # a record of our own: one line per tensor file; larger is not ours
    RACY_NS = 2 * 10**9  # a file changed this recently is hashed again next time (coarse mtimes: FAT 2 s)

    def __init__(self, record: Path | None = None):
        self.record, self.known, self.changed = record, {}, False
        try:
            if record is not None and record.is_file() and record.stat().st_size <= self.MAX_BYTES:
                known = json.loads(record.read_text())
                if isinstance(known, dict):
                    self.known = {k: v for k, v in known.items() if isinstance(v, list) and len(v) == 4}
        except (OSError, ValueError, UnicodeDecodeError):
            self.known = {}

    def sha256(self, path: Path) -> str:
        st = path.stat()
        key, state = str(path.absolute()), [st.st_size, st.st_mtime_ns, st.st_ino]
        hit = self.known.get(key)
        if hit is not None and hit[:3] == state:
            return hit[3]
        digest = file_sha256(path)
        if time.time_ns() - st.st_mtime_ns > self.RACY_NS:  # else an edit within the same mtime tick would hide
            self.known[key], self.changed = [*state, digest], True
        return digest

    def save(self) -> None:
        if self.record is not None and self.changed:
            self.known = {k: v for k, v in self.known.items() if os.path.exists(k)}
            _write_atomic(self.record, json.dumps(self.known, sort_keys=True))
            self.changed = False


def _files_state(folder: Path, hashes: FileHashes) -> str:
    """Name and sha256 of every tensor file of a bundle folder: an edit in place that leaves the manifest
    as it was still changes the key; the same bytes written again do not."""
    rows = []
    for f in sorted(folder.glob("*.safetensors")):
        try:
            rows.append(f"{f.name}:{hashes.sha256(f)}")
        except OSError:
            continue
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


def manifest_fingerprint(path: str | Path) -> str:
    """sha256 of a bundle's manifest alone: what the report names a run's capture by (the same for
    copies of one bundle, wherever they lie)."""
    return file_sha256(Path(path) / "manifest.json")


def fingerprint(path: str | Path, hashes: FileHashes | None = None) -> str:
    """sha256 of a bundle's manifest and the content of its files, of a folder's bundles (in name
    order), or of a file's bytes."""
    p, hashes = Path(path), hashes or FileHashes()
    if p.is_file():
        return file_sha256(p)
    if (p / "manifest.json").is_file():
        return hashlib.sha256((file_sha256(p / "manifest.json") + _files_state(p, hashes)).encode()).hexdigest()
    h = hashlib.sha256()
    for m in sorted(p.rglob("manifest.json")):
        h.update(str(m.relative_to(p)).encode() + b"\0" + file_sha256(m).encode() + _files_state(m.parent, hashes).encode())
    return h.hexdigest()


def stage_key(name: str, params: dict[str, Any], inputs: list[str | Path], hashes: FileHashes | None = None) -> str:
    doc = {"stage": name, "params": params, "inputs": [fingerprint(p, hashes) for p in inputs]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    try:
        write_file(path, text)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None


def duration(s: float) -> str:
    """A time estimate in words: under a second says so (a tiny model's stages), hours as hours."""
    if s < 0.5:
        return "< 1 s"
    if s < 60:
        return f"{s:.0f} s"
    return f"{s / 60:.1f} min" if s < 5400 else f"{s / 3600:.1f} h"


KILL_STAGE_ENV = "ORACLE_TEST_KILL_STAGE"  # "NAME:start" or "NAME:end": fault injection for tests only


def _test_kill(name: str, event: str) -> None:
    """SIGKILL this process at a stage's start (its line said, nothing produced) or end (its output and
    key written, its line said) when ``ORACLE_TEST_KILL_STAGE`` names that moment: a point every run
    reaches, no timer (tests/peers/test_judge.py kills judge there and reruns it)."""
    if os.environ.get(KILL_STAGE_ENV) == f"{name}:{event}":
        os.kill(os.getpid(), signal.SIGKILL)


class Progress:
    """One line per stage start and end: ``[judge 3/8] truth: ... (this stage ~20 s, ETA 1.5 min)``,
    ``... done in 18.9 s (estimated 20 s), 0.01 GFLOP/s; ETA 1.2 min``.

    A stage's estimate is the dry run's (``eta.py``: FLOPs and a probe of this machine, now) times
    the real/estimated ratio of the last finished stage of its kind (``eta.Calibration``); the ETA
    is the sum over the stages not done yet, revised as each stage ends; GFLOP/s is the stage's
    planned FLOPs over its wall time (a reused stage has none)."""

    def __init__(self, total: int, estimates: dict[str, dict[str, float]] | None = None,
                 echo: Callable[[str], None] | None = None):  # fmt: skip
        self.total, self.done, self.estimates = total, 0, estimates or {}
        self.echo = echo or (lambda s: print(s, file=sys.stderr, flush=True))
        self.left = {k: v.get("seconds", 0.0) for k, v in self.estimates.items()}
        self.calibration = Calibration()
        self.timed: list[tuple[str, float, float]] = []  # (stage, real, estimated) seconds of the stages run

    def estimate(self, name: str) -> float | None:
        """The stage's estimate now: planned seconds x the ratio of its kind (None: no plan)."""
        own = self.estimates.get(name, {}).get("seconds")
        return own * self.calibration.ratio(name) if own else None

    def eta(self) -> float:
        return sum(s * self.calibration.ratio(k) for k, s in self.left.items())

    def _eta(self) -> str:
        return f"ETA {duration(self.eta())}"

    def start(self, name: str, what: str) -> float:
        own = self.estimate(name)
        this = f"this stage ~{duration(own)}, " if own else ""
        self.echo(f"[judge {self.done + 1}/{self.total}] {name}: {what} ... ({this}{self._eta()})")
        _test_kill(name, "start")
        return time.perf_counter()

    def given(self, name: str, path: Path, flag: str) -> None:
        """A replay stage the user gave (``oracle judge --truth`` / ``--band``: made elsewhere, checked)."""
        self.done += 1
        self.left.pop(name, None)
        self.echo(f"[judge {self.done}/{self.total}] {name}: given ({flag} {path}, checked: this step's)")

    def skip(self, name: str, why: str) -> None:
        self.done += 1
        self.left.pop(name, None)
        self.echo(f"[judge {self.done}/{self.total}] {name}: skipped ({why})")

    def end(self, name: str, t0: float | None, reused: bool) -> None:
        self.done += 1
        self.left.pop(name, None)
        if reused:
            self.echo(f"[judge {self.done}/{self.total}] {name}: reused (inputs unchanged)")
            return
        dt = time.perf_counter() - t0 if t0 is not None else 0.0
        said_estimate = self.estimate(name)  # as it was when the stage started
        planned = self.estimates.get(name, {}).get("seconds")
        if planned and dt > 0:
            self.timed.append((name, dt, said_estimate))
            self.calibration.add(name, dt, planned)  # the ratio is to the plan, not to the rescaled estimate
        flops = self.estimates.get(name, {}).get("flops")
        rate = f", {flops / dt / 1e9:.2f} GFLOP/s" if flops and dt > 0 else ""
        said = f" (estimated {duration(said_estimate)})" if said_estimate else ""
        self.echo(f"[judge {self.done}/{self.total}] {name}: done in {dt:.1f} s{said}{rate}; {self._eta()}")
        _test_kill(name, "end")


class Stages:
    """Run-or-reuse of named stages inside ``work``."""

    def __init__(self, work: Path, progress: Progress):
        self.work, self.progress = work, progress
        self.reused: list[str] = []
        self.hashes = FileHashes(work / ".hashes.json")

    def _key(self, name: str, params: dict[str, Any], inputs: list[str | Path]) -> str:
        key = stage_key(name, params, inputs, self.hashes)
        self.hashes.save()
        return key

    def path(self, name: str, suffix: str = "") -> Path:
        return self.work / f"{name}{suffix}"

    def _key_file(self, out: Path) -> Path:
        return out.with_name(f".{out.name}.key")

    def bundle(self, name: str, what: str, params: dict[str, Any], inputs: list[str | Path],
               produce: Callable[[Path, bool], Any]) -> Path:  # fmt: skip
        """A bundle stage: ``produce(out, overwrite)`` writes the bundle at ``out``."""
        out = self.path(name)
        key = self._key(name, params, inputs)
        kf = self._key_file(out)
        if out.is_dir() and kf.is_file() and kf.read_text().strip() == key:
            self.progress.end(name, None, reused=True)
            self.reused.append(name)
            return out
        t0 = self.progress.start(name, what)
        kf.unlink(missing_ok=True)
        produce(out, out.exists())
        _write_atomic(kf, key + "\n")
        self.progress.end(name, t0, reused=False)
        return out

    def document(self, name: str, what: str, params: dict[str, Any], inputs: list[str | Path],
                 produce: Callable[[], dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
        """A JSON stage: ``produce()`` returns the document; stored as ``NAME.json`` with its key."""
        out = self.path(name, ".json")
        key = self._key(name, params, inputs)
        if out.is_file():
            try:
                doc = json.loads(out.read_text(), object_pairs_hook=no_duplicate_keys)
            except ValueError:
                doc = None
            if isinstance(doc, dict) and doc.get("stage_key") == key:
                self.progress.end(name, None, reused=True)
                self.reused.append(name)
                return doc["result"]
        t0 = self.progress.start(name, what)
        result = produce()
        _write_atomic(out, dumps({"stage_key": key, "result": result}) + "\n")
        self.progress.end(name, t0, reused=False)
        return json.loads(out.read_text())["result"]  # what a reuse returns: the same (JSON-clean) values
