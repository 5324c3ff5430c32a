"""One file written whole or not at all: every report, JSON document, stage record and marker the
tool writes goes through :func:`write_file`.

The bytes go into a signed sibling ``.NAME.tmp-HOST-PID-RAND-MAC`` (``atomic.temp_name``), made with
an exclusive create (never a file that was there, never through a symlink), fsynced, then renamed
over ``NAME``: a full disk or a kill leaves the old ``NAME`` whole. On a failed write the temporary
is removed at once; a killed writer's is removed by the next oracle write into the same folder (its
pid no longer running: ``atomic.sweep``). A ``NAME`` that is a symlink is replaced by the file, never
written through.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from . import atomic
from .jsonio import dumps


def write_file(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically; OSError as the write's own (the caller
    names the output and maps it to exit 9)."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    _sweep(path.parent)
    tmp = atomic.temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def write_json(obj: Any, path: str | os.PathLike) -> Path:
    """``obj`` as strict JSON (``jsonio.dumps``), written atomically (a full disk or a kill leaves the old file whole)."""
    return write_file(path, dumps(obj) + "\n")


def _sweep(parent: Path) -> None:
    """What dead writers left in ``parent`` (signed, pid gone), removed under the folder's lock where it
    is free at once; a folder locked by a writer (this process's own temporary folder included) is left
    for a later write."""
    if atomic.fcntl is None:
        return
    try:
        fd = os.open(parent, os.O_RDONLY)
    except OSError:
        return
    try:
        atomic.fcntl.flock(fd, atomic.fcntl.LOCK_EX | atomic.fcntl.LOCK_NB)
        atomic.sweep(parent)
    except OSError:
        pass
    finally:
        os.close(fd)


def fresh(path: str | os.PathLike) -> Path:
    """``path`` cleared for a new file of this tool's own in its work folder (a temporary it writes then
    renames): whatever is there, a symlink included, is removed, never written through."""
    path = Path(path)
    if os.path.lexists(path) and not path.is_dir():
        os.unlink(path)
    return path


def open_new(path: str | os.PathLike, flags: int = os.O_WRONLY):
    """A new regular file at ``path`` (``fresh``, then an exclusive create that follows no symlink),
    opened binary for writing (``os.O_APPEND`` in ``flags``: an existing file of ours appended to, a
    symlink refused with ELOOP)."""
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    if flags & os.O_APPEND:
        return os.fdopen(os.open(path, flags | os.O_CREAT | nofollow, 0o666), "ab")
    return os.fdopen(os.open(fresh(path), flags | os.O_CREAT | os.O_EXCL | nofollow, 0o666), "wb")
