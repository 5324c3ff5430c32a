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

Loading never executes code: JSON and safetensors only. Writing is atomic: everything goes to a
sibling temporary directory that is renamed into place once the manifest is written; an existing
bundle is only replaced with ``overwrite=True``, and then only after the new one is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import BundleError, InputNotFound, OutputExists

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
KINDS = ("capture", "oracle", "emulation", "norms", "local")


def _raw_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of the tensor's stored bytes (dtype-specific)."""
    return hashlib.sha256(_raw_bytes(t)).hexdigest()


def value_sha256(t: torch.Tensor) -> str:
    """sha256 of the tensor's values in a canonical dtype: float64 for floats, int64 for the rest.

    Upcasting to float64 is exact for every float format we store, so equal values hash equal
    whatever dtype they were stored in. The shape is part of the hash.
    """
    t = t.detach().cpu()
    canon = t.to(torch.float64) if t.is_floating_point() else t.to(torch.int64)
    h = hashlib.sha256(json.dumps(list(t.shape)).encode())
    h.update(_raw_bytes(canon))
    return h.hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class BundleWriter:
    """Writes a bundle atomically. Use as a context manager; nothing appears at ``path`` on error."""

    def __init__(self, path: str | os.PathLike, kind: str, *, overwrite: bool = False):
        if kind not in KINDS:
            raise ValueError(f"bundle kind must be one of {KINDS}, got {kind!r}")
        self.path = Path(path)
        if self.path.exists() and not overwrite:
            raise OutputExists(f"output {self.path} already exists; choose another --out or pass --overwrite")
        if self.path.exists() and (not self.path.is_dir() or (not (self.path / MANIFEST).exists() and any(self.path.iterdir()))):
            raise OutputExists(f"output {self.path} exists and is not a bundle; refusing to replace it")
        self.overwrite = overwrite
        self.manifest: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "kind": kind, "tensors": {}}
        self._tmp: Path | None = None
        self._files: set[str] = set()

    def __enter__(self) -> BundleWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.tmp-", dir=self.path.parent))
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
        for name, t in tensors.items():
            if name in entries:
                raise ValueError(f"tensor {group}/{name} written twice")
            t = t.detach().to("cpu").contiguous()
            clean[name] = t
            entries[name] = {
                "file": fname,
                "dtype": _dtype_name(t.dtype),
                "shape": list(t.shape),
                "sha256": tensor_sha256(t),
                "value_sha256": value_sha256(t),
            }
        save_file(clean, str(self._tmp / fname))
        self._files.add(fname)

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self._tmp is not None
        if exc_type is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            return
        with open(self._tmp / MANIFEST, "w") as f:
            json.dump(self.manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        old = None
        if self.path.exists():
            old = self.path.with_name(f".{self.path.name}.old-{os.getpid()}")
            os.rename(self.path, old)
        os.rename(self._tmp, self.path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


class Bundle:
    """A bundle opened for reading. Only the manifest is read on open; tensors load on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        mpath = self.path / MANIFEST
        if not self.path.exists():
            raise InputNotFound(f"bundle {self.path} does not exist")
        if not mpath.is_file():
            raise BundleError(f"{self.path} is not a bundle: {MANIFEST} is missing")
        try:
            self.manifest: dict[str, Any] = json.loads(mpath.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BundleError(f"{mpath} is not valid JSON ({e}); the bundle is damaged, capture it again") from e
        self._validate_manifest()

    def _validate_manifest(self) -> None:
        m = self.manifest
        where = f"{self.path / MANIFEST}"
        if not isinstance(m, dict) or "schema_version" not in m:
            raise BundleError(f"{where}: no schema_version; not an oracle bundle")
        if m["schema_version"] != SCHEMA_VERSION:
            raise BundleError(
                f"{where}: schema_version {m['schema_version']} is not supported (this oracle reads "
                f"{SCHEMA_VERSION}); use the oracle version that wrote it"
            )
        if m.get("kind") not in KINDS:
            raise BundleError(f"{where}: kind {m.get('kind')!r} is not one of {KINDS}")
        problems = []
        for group, entries in m.get("tensors", {}).items():
            for name, e in entries.items():
                f = e.get("file", "")
                if not f or "/" in f or "\\" in f or f.startswith("."):
                    problems.append(f"{group}/{name}: bad file name {f!r}")
                elif not (self.path / f).is_file():
                    problems.append(f"{group}/{name}: file {f} is missing")
        if problems:
            raise BundleError(f"{where} lists tensors it cannot find:\n  " + "\n  ".join(problems[:20]))

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
        """Load one tensor; with ``verify`` its bytes are checked against the manifest's sha256."""
        e = self.entry(group, name)
        try:
            with safe_open(str(self.path / e["file"]), framework="pt") as f:
                t = f.get_tensor(name)
        except Exception as err:  # safetensors raises several types for damaged files
            raise BundleError(f"{self.path / e['file']}: cannot read {group}/{name} ({err}); the file is damaged") from err
        if list(t.shape) != e["shape"] or _dtype_name(t.dtype) != e["dtype"]:
            raise BundleError(
                f"{self.path}: {group}/{name} is {_dtype_name(t.dtype)}{list(t.shape)} on disk but "
                f"{e['dtype']}{e['shape']} in the manifest; the bundle is damaged"
            )
        if verify and tensor_sha256(t) != e["sha256"]:
            raise BundleError(
                f"{self.path}: {group}/{name} does not match its sha256 in the manifest; the bundle "
                "is damaged or was edited, capture it again"
            )
        return t

    def load_group(self, group: str, *, verify: bool = True) -> dict[str, torch.Tensor]:
        return {n: self.load(group, n, verify=verify) for n in self.names(group)}

    def iter_group(self, group: str, *, verify: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        for n in self.names(group):
            yield n, self.load(group, n, verify=verify)

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
