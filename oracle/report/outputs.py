"""Outputs checked before the work: a ``--json`` file or a ``--report`` folder that cannot be written
is refused (OutputError, exit 9) before hours of computation, not after; a write that fails anyway
(disk full) is the same error."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import OutputError


def _writable_dir(d: Path, what: str, target: Path) -> None:
    while not d.exists():  # the nearest folder that exists is the one that must take the new entries
        d = d.parent
    if not d.is_dir():
        raise OutputError(f"cannot write {what} {target}: {d} is a file, not a directory")
    if not os.access(d, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {what} {target}: {d} is not writable")


def check_file(path: str | Path | None, what: str) -> None:
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise OutputError(f"cannot write {what} {p}: it is a directory; give a file name")
    if p.exists() and not os.access(p, os.W_OK):
        raise OutputError(f"cannot write {what} {p}: it is not writable")
    _writable_dir(p.parent if str(p.parent) else Path("."), what, p)


def check_dir(path: str | Path | None, what: str) -> None:
    if path is None:
        return
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputError(f"cannot write {what} {p}: it is a file, not a directory")
    _writable_dir(p, what, p)


def writing(what: str, path: str | Path):
    """Context manager: an OSError while writing ``path`` is an OutputError naming it."""
    from contextlib import contextmanager

    @contextmanager
    def cm():
        try:
            yield
        except OSError as e:
            raise OutputError(f"cannot write {what} {path}: {e.strerror or e}") from None

    return cm()
