"""Putting a finished directory in place without losing anything: the last step of every bundle write.

A writer fills a sibling temporary directory ``.NAME.tmp-HOST-PID-TOKEN`` (the writer's host and
pid are in the name, so that a later writer recognises the temporaries of dead writers and removes
them), then publishes it under ``NAME`` with one of two moves:

* **new** (nothing at ``NAME``): ``renameat2(RENAME_NOREPLACE)``. If anything appeared at ``NAME``
  meanwhile (a folder made by hand, another writer's bundle) the move fails and nothing is replaced.
* **replace** (``--overwrite``, ``NAME`` is a bundle): ``renameat2(RENAME_EXCHANGE)`` swaps the two
  directories in one step, so ``NAME`` is the complete old bundle until it is the complete new one;
  the old one, now under the temporary name, is then deleted. What was swapped out is checked to
  be the bundle (or empty folder) that was approved; anything else is swapped back and kept.

Both moves run under an exclusive ``flock`` on the parent directory, which serialises oracle writers
of one folder for the duration of the check and the move (milliseconds), never of the write.

Fallback, where ``renameat2`` or a flag is missing (not Linux, glibc < 2.28, a file system without
the flag): under the same lock, **new** is ``os.rename`` after checking that ``NAME`` is absent (a
folder created by a process other than an oracle writer in between could be replaced if empty; a
non-empty one never is, POSIX rename refuses), and **replace** renames the old bundle to
``.NAME.old-HOST-PID-TOKEN`` first and the new one into place second. If the writer dies between the
two, the next writer of ``NAME`` (or :func:`clean_stale`) moves the old bundle back, so it is never
lost, but for that moment ``NAME`` is absent.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock, the moves alone
    fcntl = None  # type: ignore[assignment]

_AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<what>tmp|old)-(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-(?P<token>[0-9a-f]+)$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:40] or "host"


_ACTIVE: set[str] = set()  # temporaries of this process still in use (a pid alone cannot tell, after pid reuse)


def temp_name(final: Path, what: str = "tmp") -> Path:
    """A sibling name for a writer's temporary (``tmp``) or displaced old bundle (``old``); in use
    until :func:`release` is called with it."""
    p = final.with_name(f".{final.name}.{what}-{_host()}-{os.getpid()}-{secrets.token_hex(4)}")
    _ACTIVE.add(p.name)
    return p


def release(p: Path) -> None:
    _ACTIVE.discard(p.name)


def umask() -> int:
    """The process umask, read without changing it where the platform allows."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)  # not thread-safe, but only where /proc is missing
    os.umask(old)
    return old


def _renameat2_fn() -> Callable | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None


_renameat2 = _renameat2_fn()


def rename2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; False where the call or flag is unsupported (then use the fallback)."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


@contextlib.contextmanager
def dir_lock(parent: Path) -> Iterator[None]:
    """Exclusive advisory lock on a directory (flock on its descriptor), released on exit."""
    if fcntl is None:
        yield
        return
    fd = os.open(parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(final: Path) -> list[str]:
    """Remove temporaries of dead writers of ``final`` (this host only); put a displaced old bundle back
    if ``final`` is missing. Returns what was done, for tests and logs."""
    done: list[str] = []
    try:
        entries = list(final.parent.iterdir())
    except OSError:
        return done
    host = _host()
    for p in entries:
        m = _TEMP.match(p.name)
        if not m or m["name"] != final.name or m["host"] != host:
            continue
        pid = int(m["pid"])
        if p.name in _ACTIVE or (pid != os.getpid() and _alive(pid)):
            continue
        if m["what"] == "old" and not os.path.lexists(final):
            try:  # the writer died between the fallback's two renames: the old bundle goes back
                if not rename2(p, final, RENAME_NOREPLACE):
                    os.rename(p, final)
                done.append(f"restored {p.name}")
            except OSError:
                pass  # never delete an old bundle we could not put back
            continue
        shutil.rmtree(p, ignore_errors=True)
        done.append(f"removed {p.name}")
    return done


def publish(tmp: Path, final: Path, *, replace: Callable[[Path], str | None] | None) -> None:
    """Move the finished directory ``tmp`` to ``final``.

    ``replace`` is None when nothing may be replaced; otherwise it is called with what is at
    ``final`` and returns None to approve replacing it, or the reason it must not be replaced.
    Raises FileExistsError (with the reason) when ``final`` cannot be taken; ``tmp`` is then left
    for the caller to remove.
    """
    with dir_lock(final.parent):
        clean_stale(final)
        if not os.path.lexists(final):
            if rename2(tmp, final, RENAME_NOREPLACE):
                return
            if os.path.lexists(final):  # cannot happen under the lock between oracle writers
                raise FileExistsError(errno.EEXIST, "appeared while writing", str(final))
            os.rename(tmp, final)
            return
        if replace is None:
            raise FileExistsError(errno.EEXIST, "already exists", str(final))
        why = replace(final)
        if why is not None:
            raise FileExistsError(errno.EEXIST, why, str(final))
        if rename2(tmp, final, RENAME_EXCHANGE):
            # tmp now holds what was at final: check it is what was approved, else swap back
            why = replace(tmp)
            if why is not None:
                rename2(tmp, final, RENAME_EXCHANGE)
                raise FileExistsError(errno.EEXIST, why, str(final))
            shutil.rmtree(tmp, ignore_errors=True)
            return
        old = temp_name(final, "old")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        release(old)
