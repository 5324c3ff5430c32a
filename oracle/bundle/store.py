"""The bundle: one directory holding one training step (a capture) or its ground truth (an oracle).

Layout::

    BUNDLE/
      manifest.json            schema version, kind, recipe, precision, device, versions, loss, tensors
      inputs.safetensors       exactly the tensors the model received (ids, labels, positions, pixels)
      weights.safetensors      the parameter values the forward used, in the dtype it used
      grads.safetensors        every parameter's gradient (main_grad where it exists), own dtype
      <group>.safetensors      further groups (ensemble members of an emulated run, ...)

Every tensor is listed in ``manifest["tensors"][group][name]`` with ``file``, ``dtype``, ``shape``,
``sha256`` (of the stored bytes: integrity) and ``value_sha256`` (of the values upcast to float64,
or int64 for integer tensors: identity across dtypes, so an fp32 capture and an amp-bf16 capture of
the same fp32 weights fingerprint alike). A group may span several files (``shard`` calls), so that
a writer never has to hold more than one shard in memory.

Loading never executes code: JSON and safetensors only. Opening a bundle validates the manifest
(manifest.py: every field's type, every offender named) and every file it lists: inside the bundle
(no symlink leading out), a safetensors header that agrees with the manifest on dtype, shape and
byte range. Loading a tensor reads exactly its stored bytes, hashes them in slices (no second
copy) and checks them against the manifest's sha256.

Writing is atomic (atomic.py): everything goes to a sibling temporary directory, published under
the bundle's name once the manifest is written, by a move that never replaces what another writer
put there meanwhile. An existing bundle (recognised by a valid manifest, never by a file name, and
holding no file the manifest does not list) is replaced only with ``overwrite=True``, in one atomic
swap after the new one is complete. Files and folders get the usual modes (0666/0777 less the
umask).
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import queue
import shutil
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from ..errors import BundleError, InputNotFound, OutputError, OutputExists, problem_lines
from . import atomic
from .manifest import DTYPES, KINDS, SCHEMA_VERSION, looks_like_bundle, parse_json, read_manifest
from .plain import plain

__all__ = ["Bundle", "BundleWriter", "KINDS", "check_output", "MANIFEST", "SCHEMA_VERSION", "entry_hashes", "tensor_sha256",
           "value_sha256"]  # fmt: skip

MANIFEST = "manifest.json"
HASH_SLICE = 64 * 2**20  # bytes hashed per update: bounds no memory (no copies), only the loop length
VALUE_SLICE = 2**22  # elements upcast at a time for value_sha256: 32 MiB of float64 per slice
PARALLEL_HASH_MIN = 8 * 2**20  # bytes from which entry_hashes runs its two hashes on two threads (a thread costs ~0.1 ms)
HEADER_MAX = 100 * 2**20  # safetensors' own limit on a header


def _byte_view(t: torch.Tensor) -> memoryview:
    """The stored bytes of a CPU contiguous tensor, as a view (no copy)."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _sha256(view: memoryview) -> str:
    h = hashlib.sha256()
    for i in range(0, len(view), HASH_SLICE):
        h.update(view[i : i + HASH_SLICE])
    return h.hexdigest()


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of the tensor's stored bytes (dtype-specific), hashed in place."""
    return _sha256(_byte_view(t.detach().cpu().contiguous()))


def value_sha256(t: torch.Tensor) -> str:
    """sha256 of the tensor's values in a canonical dtype: float64 for floats, int64 for the rest.

    Upcasting to float64 is exact for every float format we store, so equal values hash equal
    whatever dtype they were stored in. The shape is part of the hash. The upcast is done
    ``VALUE_SLICE`` elements at a time, so a 1 GiB bf16 tensor never becomes 4 GiB of float64;
    the bytes hashed are those of the whole upcast tensor, in order.
    """
    with plain():  # inside an emulated replay's mode too: the float64 bytes, not the mode's idea of them
        t = t.detach().cpu()
        canon = torch.float64 if t.is_floating_point() else torch.int64
        h = hashlib.sha256(json.dumps(list(t.shape)).encode())
        flat = t.contiguous().reshape(-1)  # a view when already contiguous
        for i in range(0, flat.numel(), VALUE_SLICE):
            h.update(_byte_view(flat[i : i + VALUE_SLICE].to(canon)))
    return h.hexdigest()


def entry_hashes(t: torch.Tensor) -> dict[str, str]:
    """A manifest entry's two hashes of ``t``: ``sha256`` (``tensor_sha256``) and ``value_sha256``.

    Every gradient a replay writes is hashed twice, over its stored bytes and over its float64 values
    (a float64 tensor: the same bytes twice; a float32 one: its bytes, then the upcast's, twice as many):
    a tenth of a short 8B replay on one core. hashlib and torch's casts release the GIL, so from
    ``PARALLEL_HASH_MIN`` bytes a helper thread upcasts each slice (at most 2 ahead) and hashes its
    stored bytes while this thread hashes the upcast values as they come: the same digests (one sha256 over the
    same bytes in the same order), the wall time of the longer of the two where a core is free
    (benchmarks/hashing.py: 0.49x for float64, 0.61x for float32), holding at most 4 upcast slices (128 MiB)
    where value_sha256 holds one. A new thread per tensor (no pool) leaves a forked child no pool whose thread it lacks."""
    with plain():
        t = t.detach().cpu().contiguous()
    if t.numel() * t.element_size() < PARALLEL_HASH_MIN:
        return {"sha256": tensor_sha256(t), "value_sha256": value_sha256(t)}
    ready: queue.Queue = queue.Queue(maxsize=2)  # upcast slices; None after the last
    done: dict[str, Any] = {}

    def helper() -> None:
        try:
            with plain():  # per slice: value_sha256's upcast handed over, then the slice's stored bytes hashed here
                canon = torch.float64 if t.is_floating_point() else torch.int64
                flat, stored = t.reshape(-1), hashlib.sha256()
                for i in range(0, flat.numel(), VALUE_SLICE):
                    piece = flat[i : i + VALUE_SLICE]
                    ready.put(_byte_view(piece.to(canon)))
                    stored.update(_byte_view(piece))  # consecutive slices: tensor_sha256's bytes in order
                ready.put(None)
                done["sha256"] = stored.hexdigest()
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread below
            done["error"] = e
            ready.put(None)

    worker = threading.Thread(target=helper, name="oracle-hash", daemon=True)
    worker.start()
    h = hashlib.sha256(json.dumps(list(t.shape)).encode())
    try:
        while (piece := ready.get()) is not None:
            h.update(piece)
    finally:
        while worker.is_alive():  # never leave the helper blocked on a full queue
            try:
                ready.get(timeout=0.05)
            except queue.Empty:
                pass
    if "error" in done:
        raise done["error"]
    return {"sha256": done["sha256"], "value_sha256": h.hexdigest()}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _replaceable(p: Path) -> str | None:
    """None if ``--overwrite`` may replace ``p``: an empty folder, or a bundle (valid manifest) holding
    nothing but its manifest and the files it lists. Otherwise the reason it may not."""
    if p.is_symlink() or not p.is_dir():
        return "exists and is not a bundle directory (a file or a symlink); refusing to replace it"
    try:
        names = set(os.listdir(p))
    except OSError as e:
        return f"cannot be listed ({e.strerror}); refusing to replace it"
    if not names:
        return None
    if not looks_like_bundle(p):
        return "exists and is not a bundle (no valid oracle manifest.json); refusing to replace it"
    m = read_manifest(p / MANIFEST)
    listed = {e["file"] for g in m["tensors"].values() for e in g.values()} | {MANIFEST}
    extra = sorted(names - listed)
    if extra:
        return f"holds files that are not part of the bundle ({', '.join(extra[:3])}); refusing to replace it"
    return None


def _work_beside(path: Path) -> str:
    """Names a streamed replay's work folder left beside an existing output (a run killed after it
    published ``path`` and before it removed ``.NAME.partial``, or one that another command left)."""
    work = [p.name for p in (path.parent / f".{path.name}.partial", *sorted(path.parent.glob(f".{glob.escape(path.name)}.rank*.partial")))
            if os.path.lexists(p)]  # fmt: skip
    if not work:
        return ""
    return (f"; beside it, {', '.join(work)} may hold a streamed replay's work for this name: with --overwrite "
            "a streamed rerun of the command that made it resumes it (another command of the same step replaces it; "
            "another step's, or a folder this tool did not make, is never touched), or delete it")


def check_output(path: str | os.PathLike, overwrite: bool) -> None:
    """Refuse an output that exists (without ``overwrite``), may not be replaced, or that another oracle
    process is writing now (atomic.claim: one live writer per name), before any work is spent on it;
    the final move checks again (a folder may appear meanwhile). The claim lasts until the bundle is
    published (BundleWriter) or this process ends."""
    path = Path(path)
    if os.path.lexists(path):
        if not overwrite:
            raise OutputExists(f"output {path} already exists; choose another --out or pass --overwrite{_work_beside(path)}")
        why = _replaceable(path)
        if why:
            raise OutputExists(f"output {path} {why}")
    if path.parent.is_dir() and os.environ.get("RANK", "0") in ("", "0"):  # ranks > 0 of a distributed run never publish
        try:
            atomic.claim(path)
        except FileExistsError as e:
            raise OutputExists(f"output {path} {e.strerror}; nothing was written: wait for it to finish or choose "
                               "another --out") from None  # fmt: skip
        except OSError as e:
            raise OutputError(f"cannot write the output {path}: {e.strerror or e} ({e.filename or path.parent})") from None


def check_not_input(out: str | os.PathLike, inputs: Iterable[str | os.PathLike], what: str = "--out",
                    follow: bool = True, whole: bool = True) -> None:
    """Refuse an output that is one of the command's inputs, lies inside one or holds one (OutputExists,
    exit 6), with or without ``--overwrite``: no command writes into or over what it reads (issue 41:
    ``oracle merge R1/pre --out R1/pre/rank00000 --overwrite`` replaced its own input; ``oracle score
    truth cap --json cap/manifest.json`` wrote over the capture's manifest). ``follow=False`` for a
    single file written by ``atomic_file.write_file``, which replaces a symlink at the name, never
    writes through it: only its folder is resolved. ``whole=False`` for a folder that files are written
    into (``--report``), never replaced whole: one that holds an input is then fine."""
    o = Path(os.path.abspath(out))
    o = o.resolve() if follow else o.parent.resolve() / o.name
    for i in inputs:
        p = Path(os.path.abspath(i)).resolve()
        how = "is" if o == p else "is inside" if p in o.parents else "holds" if whole and o in p.parents else None
        if how:
            raise OutputExists(f"{what} {out} {how} the input {i}: a command never writes into or over what it reads; "
                               f"choose {'an' if what == '--out' else 'a'} {what} outside its inputs (nothing was written)")  # fmt: skip


class BundleWriter:
    """Writes a bundle atomically. Use as a context manager; nothing appears at ``path`` on error."""

    def __init__(self, path: str | os.PathLike, kind: str, *, overwrite: bool = False):
        if kind not in KINDS:
            raise ValueError(f"bundle kind must be one of {KINDS}, got {kind!r}")
        self.path = Path(path)
        self.overwrite = overwrite
        self._check_target()  # early, so that no work is wasted; checked again at the final move
        self.manifest: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "kind": kind, "tensors": {}}
        self._tmp: Path | None = None
        self._files: set[str] = set()
        self._mode = 0o666 & ~atomic.umask()

    def _check_target(self) -> None:
        check_output(self.path, self.overwrite)

    def __enter__(self) -> BundleWriter:
        blocker = next((a for a in self.path.parents if os.path.lexists(a)), None)
        if blocker is not None and not blocker.is_dir():
            raise OutputError(f"cannot write the bundle {self.path}: {blocker} is a file, not a directory")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(
                f"cannot write the bundle {self.path}: {e.strerror or e} ({e.filename or self.path.parent})"
            ) from None
        check_output(self.path, self.overwrite)  # claims the name (now that its folder exists)
        try:
            tmp = atomic.make_temp(self.path)  # 0777 less the umask
        except OSError as e:
            atomic.unclaim(self.path)
            raise OutputError(
                f"cannot write the bundle {self.path}: {e.strerror or e} ({e.filename or self.path.parent})"
            ) from None
        self._tmp = tmp
        return self

    def add(self, group: str, tensors: Mapping[str, torch.Tensor], *, shard: int | None = None) -> None:
        """Write one file of ``group`` now; call again with ``shard=1, 2, ...`` to stream a group."""
        assert self._tmp is not None, "BundleWriter must be used as a context manager"
        if not group.replace("_", "").replace(".", "").isalnum():
            raise ValueError(f"group name {group!r} must be letters, digits, '_' or '.'")
        fname = f"{group}.safetensors" if shard is None else f"{group}-{shard:05d}.safetensors"
        if fname in self._files:
            raise ValueError(f"{fname} written twice")
        entries = self.manifest["tensors"].setdefault(group, {})
        clean: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        for name, t in tensors.items():
            if name in entries:
                raise ValueError(f"tensor {group}/{name} written twice")
            t = t.detach().to("cpu").contiguous()
            if t.numel() and t.untyped_storage().data_ptr() in storages:
                t = t.clone()  # tied parameters (embeddings = lm_head) share storage; safetensors refuses that
            storages.add(t.untyped_storage().data_ptr())
            clean[name] = t
            entries[name] = {
                "file": fname,
                "dtype": _dtype_name(t.dtype),
                "shape": list(t.shape),
                **entry_hashes(t),
            }
        try:
            save_file(clean, str(self._tmp / fname))
            os.chmod(self._tmp / fname, self._mode)  # safetensors creates 0600 whatever the umask
        except OSError as e:
            raise OutputError(f"cannot write {self.path / fname}: {e.strerror or e}") from None
        except SafetensorError as e:  # the Rust writer reports I/O errors (disk full) as its own type
            raise OutputError(f"cannot write {self.path / fname}: {e}") from None
        self._files.add(fname)

    def add_stream(self, group: str, items: Iterable[tuple[str, torch.Tensor]], *, max_bytes: int = 1 << 30) -> None:
        """Write ``group`` from an iterator in shards of about ``max_bytes``: at most one shard is held."""
        shard: dict[str, torch.Tensor] = {}
        size, k = 0, 0
        for name, t in items:
            shard[name] = t
            size += t.numel() * t.element_size()
            if size >= max_bytes:
                k += 1
                self.add(group, shard, shard=k)
                shard, size = {}, 0
        if shard or k == 0:
            self.add(group, shard, shard=k + 1 if k else None)

    def adopt(self, group: str, src: str | os.PathLike, entries: Mapping[str, Mapping[str, Any]], *, move: bool = False,
              own: bool = False, fname: str | None = None) -> None:  # fmt: skip
        """Take a finished safetensors file into the bundle as it is with its manifest ``entries`` (name ->
        {dtype, shape, sha256, value_sha256}), as ``fname`` (default: its own name): a replay carries the
        capture's inputs and weights (hard link, else copy: the capture's files, modes untouched), the
        streaming replay its gradient shards (``own``: hard link, else rename, so that its work folder
        keeps them until the bundle is published; ``move``: rename), file by file without loading them.
        Files of this writer's own (``own``, ``move``) get the bundle's mode, 0666 less the umask."""
        assert self._tmp is not None, "BundleWriter must be used as a context manager"
        src = Path(src)
        fname = fname or src.name
        if fname in self._files:
            raise ValueError(f"{fname} written twice")
        dst = self._tmp / fname
        try:
            if move:
                os.replace(src, dst)
            else:
                try:
                    os.link(src, dst)
                except OSError:
                    if own:  # no hard links here: the file itself (a rerun recomputes what it held)
                        os.replace(src, dst)
                    else:
                        shutil.copyfile(src, dst)
            if move or own:
                os.chmod(dst, self._mode)  # a shard written by safetensors is 0600 whatever the umask
        except OSError as e:
            raise OutputError(f"cannot write {self.path / fname}: {e.strerror or e}") from None
        group_entries = self.manifest["tensors"].setdefault(group, {})
        for name, e in entries.items():
            if name in group_entries:
                raise ValueError(f"tensor {group}/{name} written twice")
            group_entries[name] = {**e, "file": fname}
        self._files.add(fname)

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self._tmp is not None
        try:
            if exc_type is None:
                self._finish()
        finally:
            atomic.release(self._tmp)
            shutil.rmtree(self._tmp, ignore_errors=True)  # gone after a publish; the debris after an error
            atomic.unclaim(self.path)

    def _finish(self) -> None:
        tmp = self._tmp
        assert tmp is not None
        try:
            with open(tmp / MANIFEST, "x") as f:
                json.dump(self.manifest, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            for fname in self._files:  # durable before it is published
                fd = os.open(tmp / fname, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            atomic.publish(tmp, self.path, replace=_replaceable if self.overwrite else None)
        except FileExistsError as e:
            if e.strerror == "already exists":
                raise OutputExists(
                    f"output {self.path} was created by someone else while this one was written; nothing was "
                    "replaced; choose another --out or pass --overwrite"
                ) from None
            raise OutputExists(f"output {self.path} {e.strerror}") from None
        except OSError as e:
            raise OutputError(f"cannot write the bundle {self.path}: {e.strerror or e}") from None


def _temp_text(p: Path, info: dict[str, str]) -> str:
    """What one of this tool's writer folders is, for a user who gives it as a bundle."""
    final = p.with_name(info["name"])
    who = f"writer pid {info['pid']} on {info['host']}"
    live = atomic.in_use(p) if info["host"] == atomic._host() else None
    state = "still running" if live else ("no longer running" if live is False else "on another host")
    if info["what"] == "old":
        return (f"{p} is not a bundle to use: it is the previous {final.name}, moved aside by an --overwrite ({who}, "
                f"{state}); give {final} instead (any oracle command reading {final} moves it back if the new one "
                "never arrived)")  # fmt: skip
    if info["what"] == "claim":
        return f"{p} is not a bundle: it is the claim of an oracle writer of {final} ({who}, {state}); give {final}"
    return (f"{p} is not a bundle: it is the unfinished temporary folder of an oracle writer of {final} ({who}, {state}); "
            f"it is incomplete and is removed by the next oracle run writing into {p.parent}; rerun the command that "
            f"writes {final}")  # fmt: skip


def _inside(root: Path, p: Path) -> bool:
    try:
        p.resolve().relative_to(root)
    except (ValueError, OSError, RuntimeError):
        return False
    return True


class Bundle:
    """A bundle opened for reading. The manifest and file headers are checked on open; tensors load on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        mpath = self.path / MANIFEST
        try:
            if not self.path.exists():
                left = atomic.recover(self.path)  # an --overwrite killed between the fallback's two renames
                if left:
                    raise InputNotFound(
                        f"bundle {self.path} does not exist: an --overwrite of it was killed before the new bundle was in "
                        f"place, and the previous bundle, kept at {left[-1]}, could not be moved back here; move it "
                        f"back yourself: mv '{left[-1]}' '{self.path}'"
                    )
                if not self.path.exists():
                    raise InputNotFound(f"bundle {self.path} does not exist")
            temp = atomic.parse(self.path)
            if temp is not None and temp["signed"] == "yes":
                raise BundleError(_temp_text(self.path, temp))
            if self.path.name.startswith(".") and self.path.name.endswith(".partial") and (self.path / "header.json").is_file():
                final = self.path.with_name(self.path.name[1 : -len(".partial")])
                raise BundleError(f"{self.path} is not a bundle: it is the work folder of a streamed replay into {final} "
                                  "that has not finished; rerun that replay (the same command) to resume and publish it")  # fmt: skip
            if not self.path.is_dir():
                inside = self.path.parent / MANIFEST
                fix = f": it is a file of the bundle {self.path.parent}; give that folder" if inside.is_file() else ""
                raise BundleError(f"{self.path} is a file, not a bundle directory{fix}")
            if not mpath.is_file():
                raise BundleError(f"{self.path} is not a bundle: {MANIFEST} is missing")
            self._root = self.path.resolve()
            if not _inside(self._root, mpath):
                raise BundleError(f"{mpath} is a symlink leading out of the bundle; refusing to follow it")
            self.manifest: dict[str, Any] = read_manifest(mpath)
            self._where: dict[tuple[str, str], tuple[int, int]] = {}
            self._check_files()
        except OSError as e:
            raise InputNotFound(f"cannot read the bundle {self.path}: {e.strerror or e} ({e.filename or mpath})") from None

    def _check_files(self) -> None:
        """Every listed file exists inside the bundle; its header agrees with the manifest."""
        by_file: dict[str, list[tuple[str, str, dict]]] = {}
        for group, entries in self.manifest["tensors"].items():
            for name, e in entries.items():
                by_file.setdefault(e["file"], []).append((group, name, e))
        problems: list[str] = []
        for fname, listed in by_file.items():
            p = self.path / fname
            if not os.path.lexists(p):
                problems.append(f"{fname}: missing ({len(listed)} tensor(s) listed in it, e.g. {listed[0][0]}/{listed[0][1]})")
            elif not _inside(self._root, p):
                problems.append(f"{fname}: a symlink leading out of the bundle; refusing to follow it")
            elif not p.is_file():
                problems.append(f"{fname}: not a regular file")
            else:
                problems += self._check_header(p, listed)
        if problems:
            raise BundleError(
                f"{self.path} is damaged ({len(problems)} problem(s)); capture or replay it again:" + problem_lines(problems, 20)
            )

    def _check_header(self, p: Path, listed: list[tuple[str, str, dict]]) -> list[str]:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 0 or n > min(size - 8, HEADER_MAX):
                return [f"{p.name}: not a safetensors file or truncated ({size} bytes, header length {n})"]
            try:
                header = parse_json(f.read(n), p.name)
            except BundleError as e:
                return [f"{p.name}: header {e}"]
        if not isinstance(header, dict):
            return [f"{p.name}: header is not a JSON object"]
        data_start = 8 + n
        problems = []
        for group, name, e in listed:
            h = header.get(name)
            where = f"{group}/{name} in {p.name}"
            if not isinstance(h, dict):
                problems.append(f"{where}: not in the file's header")
                continue
            dtype, shape, offs = h.get("dtype"), h.get("shape"), h.get("data_offsets")
            if not isinstance(dtype, str) or DTYPES.get(dtype) != e["dtype"] or shape != e["shape"]:
                problems.append(f"{where}: stored as {dtype} {shape}, the manifest says {e['dtype']} {e['shape']}")
                continue
            if not (isinstance(offs, list) and len(offs) == 2 and all(type(x) is int for x in offs)):
                problems.append(f"{where}: data_offsets {offs!r} are not two integers")
                continue
            begin, end = offs
            want = math.prod(e["shape"]) * getattr(torch, e["dtype"]).itemsize
            if not 0 <= begin <= end or end - begin != want or data_start + end > size:
                problems.append(f"{where}: bytes [{begin}, {end}) do not hold {want} bytes inside the {size - data_start} stored")
                continue
            self._where[(group, name)] = (data_start + begin, end - begin)
        return problems

    # -- metadata -----------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    def get(self, key: str, default: Any = None) -> Any:
        return self.manifest.get(key, default)

    def groups(self) -> list[str]:
        return list(self.manifest.get("tensors", {}))

    def names(self, group: str) -> list[str]:
        return list(self.manifest.get("tensors", {}).get(group, {}))

    def has(self, group: str, name: str) -> bool:
        return name in self.manifest.get("tensors", {}).get(group, {})

    def entry(self, group: str, name: str) -> dict[str, Any]:
        try:
            return self.manifest["tensors"][group][name]
        except KeyError:
            raise BundleError(f"bundle {self.path} has no tensor {group}/{name}") from None

    # -- tensors ------------------------------------------------------------------------------
    def load(self, group: str, name: str, *, verify: bool = True) -> torch.Tensor:
        """Load one tensor: its stored bytes are read once; with ``verify`` they are hashed in place
        and checked against the manifest's sha256 before the tensor is made from them."""
        e = self.entry(group, name)
        offset, nbytes = self._where[(group, name)]
        dtype = getattr(torch, e["dtype"])
        buf = bytearray(nbytes)
        path = self.path / e["file"]
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                got = f.readinto(buf)
        except OSError as err:
            raise InputNotFound(f"cannot read {path}: {err.strerror or err}") from None
        if got != nbytes:
            raise BundleError(f"{path}: {group}/{name} is truncated ({got} of {nbytes} bytes); the bundle is damaged")
        if verify and _sha256(memoryview(buf)) != e["sha256"]:
            raise BundleError(
                f"{self.path}: {group}/{name} does not match its sha256 in the manifest; the bundle "
                f"is damaged or was edited, {self._remake()}"
            )
        if nbytes == 0:
            return torch.empty(e["shape"], dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(e["shape"])

    def load_rows(self, group: str, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of a tensor (its first dimension), read alone and not verified: the
        caller verifies the whole tensor once (``verify``), as the streaming head does."""
        e = self.entry(group, name)
        offset, nbytes = self._where[(group, name)]
        shape = [int(s) for s in e["shape"]]
        row = nbytes // max(shape[0], 1)
        buf = bytearray((stop - start) * row)
        path = self.path / e["file"]
        with open(path, "rb") as f:
            f.seek(offset + start * row)
            got = f.readinto(buf)
        if got != len(buf):
            raise BundleError(f"{path}: {group}/{name} is truncated; the bundle is damaged")
        if not buf:
            return torch.empty([stop - start, *shape[1:]], dtype=getattr(torch, e["dtype"]))
        return torch.frombuffer(buf, dtype=getattr(torch, e["dtype"])).reshape([stop - start, *shape[1:]])

    def verify(self, group: str, name: str, block: int = 1 << 26) -> None:
        """Check one tensor's stored bytes against the manifest's sha256, ``block`` bytes at a time."""
        e = self.entry(group, name)
        offset, nbytes = self._where[(group, name)]
        h = hashlib.sha256()
        with open(self.path / e["file"], "rb") as f:
            f.seek(offset)
            left = nbytes
            while left:
                data = f.read(min(block, left))
                if not data:
                    break
                h.update(data)
                left -= len(data)
        if left or h.hexdigest() != e["sha256"]:
            raise BundleError(
                f"{self.path}: {group}/{name} does not match its sha256 in the manifest; the bundle "
                f"is damaged or was edited, {self._remake()}"
            )

    def load_group(self, group: str, *, verify: bool = True) -> dict[str, torch.Tensor]:
        return {n: self.load(group, n, verify=verify) for n in self.names(group)}

    def iter_group(self, group: str, *, verify: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        for n in self.names(group):
            yield n, self.load(group, n, verify=verify)

    def _remake(self) -> str:
        """How a damaged bundle of this kind is made again (the fix its error names)."""
        if self.kind in ("oracle", "emulation"):
            return f"replay it again (oracle replay CAPTURE --out {self.path})"
        return "capture it again"

    # -- what step this is ------------------------------------------------------------------------
    def fingerprint(self) -> dict[str, dict[str, str]]:
        """value_sha256 of every input and weight: what makes two bundles "the same step"."""
        if "fingerprint" in self.manifest:
            return self.manifest["fingerprint"]
        t = self.manifest.get("tensors", {})
        return {g: {n: e["value_sha256"] for n, e in t.get(g, {}).items()} for g in ("inputs", "weights")}

    def capture_device(self) -> str:
        """Device type the step was captured on (selects autocast's float32 op list when emulating);
        a bundle replayed from a capture carries its source's."""
        if self.kind == "capture":
            return (self.get("device") or {}).get("type") or "cuda"
        return (self.get("source") or {}).get("device") or "cuda"

    def member_groups(self) -> list[str]:
        """The gradient groups of an emulation bundle (or the single ``grads`` of any other)."""
        k = int(self.get("members", 1))
        return ["grads"] + [f"grads.{i}" for i in range(1, k)]
