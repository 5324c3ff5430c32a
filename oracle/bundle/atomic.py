"""Putting a finished directory in place without losing anything: the last step of every bundle write.

Every name a writer uses beside an output ``NAME`` is ``.NAME.WHAT-HOST-PID-RAND-MAC``: ``WHAT`` is
``tmp`` (the bundle being written), ``old`` (a displaced old bundle, fallback only) or ``claim`` (this
writer's claim on ``NAME`` for the whole run); ``MAC`` is an HMAC of the rest with this user's key
(``signing.py``), so a folder of that shape made by another program is recognised as not ours and
only named, never removed or moved. A writer holds an ``flock`` on each of its own folders while it
lives; a signed folder nobody holds is a dead writer's: the next writer into the folder, or the next
reader of ``NAME``, removes it (``tmp``, ``claim``) or moves it back under ``NAME`` (``old`` where
``NAME`` is missing: an ``--overwrite`` killed between the fallback's two renames).

* **claim** (``claim``, called before any work): one live claim per ``NAME``; a second writer, in
  another process, is refused at once (OutputExists, exit 6), so of two concurrent writers exactly
  one publishes, with or without ``--overwrite``. Child processes of the claimer (``--nproc`` ranks)
  inherit the claim through ``ORACLE_CLAIMS``.
* **new** (nothing at ``NAME``): ``renameat2(RENAME_NOREPLACE)``. If anything appeared at ``NAME``
  meanwhile (a folder made by hand) the move fails and nothing is replaced.
* **replace** (``--overwrite``, ``NAME`` is a bundle): ``renameat2(RENAME_EXCHANGE)`` swaps the two
  directories in one step, so ``NAME`` is the complete old bundle until it is the complete new one;
  the old one, now under the temporary name, is then deleted (killed before: the next run deletes
  it). What was swapped out is checked to be the bundle (or empty folder) that was approved;
  anything else is swapped back and kept.

Both moves run under an exclusive ``flock`` on the parent directory, which serialises oracle writers
and readers' recovery of one folder for the check and the move (milliseconds), never the write.

Fallback, where ``renameat2`` or a flag is missing (not Linux, glibc < 2.28, a file system without
the flag): **new** is ``os.rename`` after checking that ``NAME`` is absent; **replace** renames the old
bundle to ``.NAME.old-*`` first and the new one into place second. The old bundle is deleted only
after the new one is in place. Killed between the two renames, ``NAME`` is absent until the next run
of any oracle command that writes into the folder or reads ``NAME``: it moves the old bundle back
(where it cannot, a read-only folder, it names it and the ``mv`` that restores it).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from . import signing

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock, the moves alone
    fcntl = None  # type: ignore[assignment]

_AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_TEMP = re.compile(
    r"^\.(?P<name>.+)\.(?P<what>tmp|old|claim)-(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-(?P<token>[0-9a-f]{8})(?:-(?P<mac>[0-9a-f]{16}))?$"
)
CLAIMS_ENV = "ORACLE_CLAIMS"
# test hooks (set by a test's child process only): called between the fallback's two renames, and after
# the exchange before the swapped-out old bundle is deleted
_between_renames: Callable[[], None] | None = None
_after_exchange: Callable[[], None] | None = None


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:40] or "host"


def _sign(name: str, what: str, host: str, pid: str, token: str) -> str:
    return signing.mac("oracle temporary", name, what, host, pid, token)[:16]


_HELD: dict[str, int] = {}  # absolute path of our own temporaries -> the descriptor holding its flock


def _hold(p: Path) -> None:
    """Hold an flock on our folder ``p`` until :func:`release` (a kill releases it too)."""
    if fcntl is None:
        return
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass
    _HELD[str(p.absolute())] = fd


def temp_name(final: Path, what: str = "tmp") -> Path:
    """A signed sibling name for a writer's temporary (``tmp``), displaced old bundle (``old``) or claim."""
    host, pid, token = _host(), str(os.getpid()), secrets.token_hex(4)
    return final.with_name(f".{final.name}.{what}-{host}-{pid}-{token}-{_sign(final.name, what, host, pid, token)}")


def release(p: Path) -> None:
    fd = _HELD.pop(str(p.absolute()), None)
    if fd is not None:
        os.close(fd)


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


def parse(p: Path) -> dict[str, str] | None:
    """The parts of a writer's temporary name, with ``signed`` ("yes"/"no"), or None if ``p`` is not one."""
    m = _TEMP.match(p.name)
    if not m:
        return None
    d = m.groupdict()
    ok = d["mac"] is not None and signing.same(d["mac"], _sign(d["name"], d["what"], d["host"], d["pid"], d["token"]))
    return {**{k: v or "" for k, v in d.items()}, "signed": "yes" if ok else "no"}


def _inherited(p: Path) -> bool:
    return str(p.absolute()) in os.environ.get(CLAIMS_ENV, "").split(os.pathsep)


def in_use(p: Path) -> bool:
    """Whether a writer's folder ``p`` (this host's) is held by a live writer: ours, an ancestor's
    claim we inherit, or another process's flock; without flock, its pid is alive."""
    if str(p.absolute()) in _HELD or _inherited(p):
        return True
    info = parse(p)
    if fcntl is None or p.is_symlink() or not p.is_dir():  # a file's temporary (atomic_file.py) is this process's while it lives
        return info is not None and _alive(int(info["pid"])) and (int(info["pid"]) != os.getpid() or not p.is_dir())
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        return True  # cannot look: leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # a file system without flock: the pid tells
        return info is not None and _alive(int(info["pid"])) and int(info["pid"]) != os.getpid()
    finally:
        os.close(fd)
    return False


_NAMED: set[str] = set()


def _say(msg: str) -> None:
    if msg not in _NAMED:
        _NAMED.add(msg)
        print(f"note: {msg}", file=sys.stderr, flush=True)


def sweep(parent: Path, only: str | None = None) -> list[str]:
    """The writers' folders in ``parent`` (of ``NAME == only`` if given): a signed one that no live writer
    holds is removed (``tmp``, ``claim``) or moved back (``old`` where its ``NAME`` is missing, else
    removed); one that is not signed by this user's oracle, or of another host, is named and left.
    Call under :func:`dir_lock`. Returns what was done (for tests and logs)."""
    done: list[str] = []
    try:
        entries = sorted(parent.iterdir())
    except OSError:
        return done
    host = _host()
    for p in entries:
        info = parse(p)
        if info is None or (only is not None and info["name"] != only):
            continue
        if info["signed"] != "yes":
            _say(f"{p} is named like an oracle temporary but not signed by this user's oracle: left as it is "
                 "(delete it yourself if it is yours)")  # fmt: skip
            continue
        if info["host"] != host:
            continue  # another host's writer: it may be alive; its own host cleans it
        if in_use(p):
            continue
        final = p.with_name(info["name"])
        if info["what"] == "old" and not os.path.lexists(final):
            try:  # an --overwrite killed between the fallback's two renames: the old bundle goes back
                if not rename2(p, final, RENAME_NOREPLACE):
                    os.rename(p, final)
                done.append(f"restored {p.name}")
            except OSError:
                pass  # never delete an old bundle we could not put back
            continue
        if info["what"] == "old" and not _is_bundle(final):
            _say(f"{p} holds the previous {final.name}, displaced by an --overwrite that died; {final} is now not a "
                 "bundle, so it was kept: move it back yourself if you want it")  # fmt: skip
            continue
        try:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            done.append(f"removed {p.name}")
        except OSError:
            pass
    return done


def _is_bundle(p: Path) -> bool:
    from .manifest import looks_like_bundle  # the manifest's schema, only where a displaced bundle is about to go

    return p.is_dir() and not p.is_symlink() and looks_like_bundle(p)


def displaced(final: Path) -> list[Path]:
    """Signed ``.NAME.old-*`` folders beside a missing ``final``: what an interrupted --overwrite left."""
    try:
        return sorted(p for p in final.parent.iterdir() if (i := parse(p)) and i["name"] == final.name
                      and i["what"] == "old" and i["signed"] == "yes")  # fmt: skip
    except OSError:
        return []


def recover(final: Path) -> list[Path]:
    """A reader's recovery of a missing ``final``: move back a displaced old bundle (see :func:`sweep`).
    Returns the displaced folders still there (that could not be moved back: read-only, another host)."""
    if os.path.lexists(final) or not displaced(final):
        return []
    try:
        with dir_lock(final.parent):
            for line in sweep(final.parent, final.name):
                if line.startswith("restored"):
                    _say(f"{final} was restored from {line.split()[1]}: an --overwrite of it was killed before the new bundle was in place")  # fmt: skip
    except OSError:
        pass
    return [] if os.path.lexists(final) else displaced(final)


# -- claims: one live writer per NAME ----------------------------------------------------------
_CLAIMS: dict[str, Path] = {}
_CLAIM_LOCK = threading.RLock()


def _drop_claims() -> None:
    for k in list(_CLAIMS):
        unclaim(Path(k))


atexit.register(_drop_claims)


def rivals(final: Path) -> list[Path]:
    """Live claims and temporaries of ``final`` held by other writers (this host)."""
    out = []
    try:
        entries = sorted(final.parent.iterdir())
    except OSError:
        return out
    for p in entries:
        info = parse(p)
        if info and info["name"] == final.name and info["what"] in ("tmp", "claim") and info["signed"] == "yes" \
                and info["host"] == _host() and str(p.absolute()) not in _HELD and not _inherited(p) and in_use(p):  # fmt: skip
            out.append(p)
    return out


def claim(final: Path) -> None:
    """Claim ``final`` for this process until :func:`unclaim` (or exit): FileExistsError naming the
    other writer if a live one holds it. Reentrant; children inherit it through ``ORACLE_CLAIMS``."""
    k = str(final.absolute())
    with _CLAIM_LOCK, dir_lock(final.parent):
        if k in _CLAIMS or _ancestor_claims(final):
            return  # ours already, or the launcher's whose rank we are (it outlives us and drops it at its exit)
        sweep(final.parent)
        other = rivals(final)
        if other:
            info = parse(other[0]) or {}
            raise FileExistsError(errno.EEXIST, f"is being written by another oracle process now (pid {info.get('pid')} "
                                  f"on {info.get('host')}, {other[0].name})", str(final))  # fmt: skip
        p = temp_name(final, "claim")
        os.mkdir(p)
        _hold(p)
        _CLAIMS[k] = p
        os.environ[CLAIMS_ENV] = os.pathsep.join(filter(None, [os.environ.get(CLAIMS_ENV, ""), str(p.absolute())]))


def _ancestor_claims(final: Path) -> bool:
    """Whether a process we descend from (``--nproc``'s launcher) holds a live claim on ``final``: its
    rank then writes under it instead of making a claim of its own, which a rank stopped by SIGTERM
    (the launcher stopping the others when one fails) would leave behind."""
    for c in filter(None, os.environ.get(CLAIMS_ENV, "").split(os.pathsep)):
        c = Path(c)
        info = parse(c)
        if info and info["what"] == "claim" and info["name"] == final.name and c.parent == final.parent.absolute() and c.is_dir():
            return True
    return False


def unclaim(final: Path) -> None:
    with _CLAIM_LOCK:
        p = _CLAIMS.pop(str(final.absolute()), None)
        if p is None:
            return
        release(p)
        with contextlib.suppress(OSError):
            os.rmdir(p)
    rest = [c for c in os.environ.get(CLAIMS_ENV, "").split(os.pathsep) if c and c != str(p.absolute())]
    if rest:
        os.environ[CLAIMS_ENV] = os.pathsep.join(rest)
    else:
        os.environ.pop(CLAIMS_ENV, None)


def make_temp(final: Path) -> Path:
    """Create and hold the writer's temporary folder of ``final`` (0777 less the umask)."""
    with dir_lock(final.parent):
        sweep(final.parent)
        tmp = temp_name(final)
        os.mkdir(tmp)
        _hold(tmp)
    return tmp


def publish(tmp: Path, final: Path, *, replace: Callable[[Path], str | None] | None) -> None:
    """Move the finished directory ``tmp`` to ``final``.

    ``replace`` is None when nothing may be replaced; otherwise it is called with what is at
    ``final`` and returns None to approve replacing it, or the reason it must not be replaced.
    Raises FileExistsError (with the reason) when ``final`` cannot be taken; ``tmp`` is then left
    for the caller to remove.
    """
    with dir_lock(final.parent):
        sweep(final.parent, final.name)
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
            if _after_exchange is not None:
                _after_exchange()
            shutil.rmtree(tmp, ignore_errors=True)
            return
        old = temp_name(final, "old")
        fd = os.open(final, os.O_RDONLY)  # its flock travels with it: a live writer's old is never restored
        try:
            if fcntl is not None:
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(final, old)
            if _between_renames is not None:
                _between_renames()
            try:
                os.rename(tmp, final)
            except OSError:
                os.rename(old, final)  # the old bundle goes back at once
                raise
            shutil.rmtree(old, ignore_errors=True)
        finally:
            os.close(fd)
