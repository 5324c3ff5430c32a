"""This user's signing key: what proves a folder beside an output was made by this tool for this user.

Work folders (``.NAME.partial``), writers' temporaries (``.NAME.tmp-*``, ``.NAME.old-*``, ``.NAME.claim-*``)
and the judge's work folder are removed, adopted or moved back only when they carry a MAC made with this
key; a folder of the same shape made by another program (or another user) is named, never touched.

The key is 32 random bytes in ``$XDG_CACHE_HOME/oracle/work.key`` (else ``~/.cache/oracle/work.key``),
made 0600 on first use with an exclusive create, so two first runs agree. Where it cannot be made (a
read-only home) a fixed key is used: a MAC then still proves the folder was made by this tool, not by whom.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any

UNKEYED = b"oracle-work-folder-unkeyed"
_KEY: bytes | None = None


def key() -> bytes:
    """This user's signing key, made on first use (0600, exclusive create: two first runs agree)."""
    global _KEY
    if _KEY is None:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "oracle"
        path = root / "work.key"
        try:
            root.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(secrets.token_bytes(32))
            except FileExistsError:
                pass
            k = path.read_bytes()
            _KEY = k if len(k) == 32 else UNKEYED
        except OSError:
            _KEY = UNKEYED
    return _KEY


def mac(*parts: Any) -> str:
    """HMAC-SHA256 (hex) of ``parts`` as canonical JSON lines, with this user's key."""
    msg = "\n".join(json.dumps(p, sort_keys=True) for p in parts).encode()
    return hmac.new(key(), msg, hashlib.sha256).hexdigest()


def same(got: str, want: str) -> bool:
    """Constant-time comparison of a MAC read from a file or a name (any text) with ours."""
    return hmac.compare_digest(got.encode("utf-8", "surrogatepass"), want.encode())
