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

from . import atomic


def write_file(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically; OSError as the write's own (the caller
    names the output and maps it to exit 9)."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    with contextlib.suppress(OSError):  # what dead writers left in this folder (signed, pid gone)
        with atomic.dir_lock(path.parent):
            atomic.sweep(path.parent)
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
