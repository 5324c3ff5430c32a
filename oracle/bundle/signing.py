"""This user's signing key: what proves a folder beside an output was made by this tool for this user.

Work folders (``.NAME.partial``), writers' temporaries (``.NAME.tmp-*``, ``.NAME.old-*``, ``.NAME.claim-*``)
and the judge's work folder are removed, adopted or moved back only when they carry a MAC made with this
key; a folder of the same shape made by another program (or another user) is named, never touched.

The key is 32 random bytes in ``$XDG_CACHE_HOME/oracle/work.key`` (else ``~/.cache/oracle/work.key``),
made 0600 on first use, whole (a temporary hard-linked into place), so two first runs agree. Where it cannot be made (a
read-only home) a fixed key is used: a MAC then still proves the folder was made by this tool, not by whom.
A key file that is not what this tool wrote (a symlink, a device, another size) is refused (exit 4)
after reading at most 33 bytes of it.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

UNKEYED = b"oracle-work-folder-unkeyed"
KEY_BYTES = 32
_KEY: bytes | None = None


def key() -> bytes:
    """This user's signing key, made on first use (0600, linked into place: two first runs agree)."""
    global _KEY
    if _KEY is None:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "oracle"
        path = root / "work.key"
        try:
            root.mkdir(parents=True, exist_ok=True)
            _make_key(path)
            k = _read_key(path)
        except OSError:
            k = UNKEYED
        _KEY = k
    return _KEY


def _make_key(path: Path) -> None:
    """Write a new key whole or not at all: into a private temporary, then hard-linked to ``path``
    (which fails where a key is there: two first runs agree on the first one linked)."""
    if os.path.lexists(path):
        return
    tmp = path.with_name(f".{path.name}.new-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links
            if not os.path.lexists(path):
                os.rename(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _read_key(path: Path) -> bytes:
    """The key file's 32 bytes, read without following a symlink and at most 33 bytes of it: anything
    else (a symlink to /dev/zero, a folder, another size) is not the key this tool wrote: BundleError
    (exit 4) naming it and the fix, never a read without end."""
    from ..errors import BundleError

    fix = f"delete it (rm {path}) and run again: a new key is made (work folders signed with the old one are then left as they are)"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):
            raise BundleError(f"the signing key {path} is a symlink, not the key file this tool wrote; {fix}") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BundleError(f"the signing key {path} is not a regular file; {fix}")
        k = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(k) != KEY_BYTES:
        raise BundleError(f"the signing key {path} holds {len(k)}{'+' if len(k) > KEY_BYTES else ''} bytes, not the "
                          f"{KEY_BYTES} this tool wrote; {fix}")  # fmt: skip
    return k


def mac(*parts: Any) -> str:
    """HMAC-SHA256 (hex) of ``parts`` as canonical JSON lines, with this user's key."""
    msg = "\n".join(json.dumps(p, sort_keys=True) for p in parts).encode()
    return hmac.new(key(), msg, hashlib.sha256).hexdigest()


def same(got: str, want: str) -> bool:
    """Constant-time comparison of a MAC read from a file or a name (any text) with ours."""
    return hmac.compare_digest(got.encode("utf-8", "surrogatepass"), want.encode())
