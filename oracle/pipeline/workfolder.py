"""The judge's ``--out`` folder: this tool's, signed, or refused untouched.

``oracle judge --out DIR`` writes every stage's output into DIR and reuses them on a rerun, so DIR
must be a judge work folder of this tool: empty or new, or holding ``.oracle-judge`` (a JSON marker
with an HMAC by this user's key, ``bundle/signing.py``). Anything else (a capture or oracle bundle,
a folder of the user's files, a judge folder of an oracle that wrote no marker) is refused with
OutputExists (exit 6) before anything is written into it.

On every run, what a killed judge left in its own folder is removed: the writers' signed temporaries
of dead writers (``bundle/atomic.py``) and the ``.NAME.tmp-PID`` files of the stage keys, documents
and report of processes no longer running. A streamed replay's ``.truth.partial`` is kept: the
truth stage resumes from it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path

from ..bundle import atomic, signing
from ..bundle.atomic_file import write_file
from ..errors import OutputError, OutputExists

MARK = ".oracle-judge"
MADE_BY = "oracle judge work folder"
_PID_TEMP = re.compile(r"^\..+\.tmp-(?P<pid>\d+)(\.png)?$")


def _signed(path: Path) -> bool:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return (isinstance(d, dict) and d.get("made_by") == MADE_BY and isinstance(d.get("nonce"), str)
            and isinstance(d.get("mac"), str) and signing.same(d["mac"], signing.mac(MADE_BY, d["nonce"])))  # fmt: skip


def open_out(out: Path) -> None:
    """Make ``out`` a judge work folder (new or empty), adopt it (signed), or refuse it (exit 6, untouched);
    then clear what killed judges left in it. Unwritable: OutputError (exit 9)."""
    if os.path.lexists(out) and (out.is_symlink() or not out.is_dir()):
        raise OutputExists(f"--out {out} exists and is not a folder; choose another --out (nothing was written)")
    if out.is_dir():
        try:
            names = sorted(p.name for p in out.iterdir())
        except OSError as e:
            raise OutputError(f"cannot read the work folder {out}: {e.strerror or e}") from None
        if names and not _signed(out / MARK):
            if "manifest.json" in names:
                what = "it is a bundle (a capture or an oracle), not a judge work folder"
            else:
                what = f"it holds files that are not a judge work folder of this tool ({', '.join(names[:3])})"
            raise OutputExists(f"--out {out}: {what}; nothing was written into it; choose a new or empty folder for --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not (out / MARK).is_file():
            nonce = secrets.token_hex(16)
            write_file(out / MARK, json.dumps({"made_by": MADE_BY, "nonce": nonce, "mac": signing.mac(MADE_BY, nonce)}))
    except OSError as e:
        raise OutputError(f"cannot write into the work folder {out}: {e.strerror or e}") from None
    clear_leftovers(out)


def clear_leftovers(out: Path) -> list[str]:
    """Remove what dead judges left in their own folder ``out`` (and ``out/report``); returns the names."""
    done = []
    with atomic.dir_lock(out):
        done += atomic.sweep(out)
    for d in (out, out / "report"):
        if not d.is_dir():
            continue
        for p in d.iterdir():
            m = _PID_TEMP.match(p.name)
            if m and p.is_file() and int(m["pid"]) != os.getpid() and not atomic._alive(int(m["pid"])):
                p.unlink(missing_ok=True)
                done.append(f"removed {p.name}")
    return done
