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


def _not_input(path: Path, what: str, inputs, follow: bool) -> None:
    if inputs:
        from ..bundle.store import check_not_input

        check_not_input(path, inputs, what=what, follow=follow, whole=False)


def check_file(path: str | Path | None, what: str, inputs=()) -> None:
    """``path`` can take a new file (``what`` names the option in the error) and is none of ``inputs``,
    nor inside one (OutputExists, exit 6: a command never writes over what it reads)."""
    if path is None:
        return
    p = Path(path)
    _not_input(p, what, inputs, follow=False)
    if p.is_dir():
        raise OutputError(f"cannot write {what} {p}: it is a directory; give a file name")
    if p.exists() and not os.access(p, os.W_OK):
        raise OutputError(f"cannot write {what} {p}: it is not writable")
    _writable_dir(p.parent if str(p.parent) else Path("."), what, p)


def check_dir(path: str | Path | None, what: str, inputs=()) -> None:
    """``path`` can take a report folder's files and is none of ``inputs``, nor inside one (exit 6)."""
    if path is None:
        return
    p = Path(path)
    _not_input(p, what, inputs, follow=True)
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
