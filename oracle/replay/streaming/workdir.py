"""The streamed replay's work folder ``.NAME.partial``: ours, or left untouched.

A work folder holds what a killed run had finished (gradient shards, input gradients, a journal per
member); a rerun of the same command adopts it and continues. A folder of that name may also be
the user's own, another tool's, a run of another step, or ours but damaged. Rules:

- ``header.json`` is signed: HMAC-SHA256 with this user's key (``$XDG_CACHE_HOME/oracle/work.key``,
  else ``~/.cache/oracle/work.key``, 32 random bytes made 0600 on first use) over the header's
  canonical JSON: what made it (``made_by``), the oracle version, the step's fingerprint, the
  command (dtype, ensemble, threads, ranks, the --out name) and a random nonce. A folder is adopted
  only if its header verifies and equals this run's. Anything else is left exactly as it is and
  named (OutputExists, exit 6); never deleted, never moved. With ``--overwrite`` a folder of ours
  (its header verifies) is replaced only when it is provably this run's: the same step (fingerprint)
  and the same ``--out`` name, made by another command (dtype, ensemble, threads, ranks, version).
  One of ours for another step (a replay of another capture that used this --out name: hours of
  someone's work) is named and kept: resume it with the command that made it, or delete it. A
  caller that owns the folder ``out`` lies in (the judge's stages, inside its own marked --out)
  passes ``replace="any-ours"``: any folder of ours that is not this run's is replaced, as the
  stage's inputs changed. A foreign folder is never replaced.
- Every journal record (one JSON line) carries a MAC over the header's nonce and the record, so
  records are bound to this folder; its file must be a plain name of the form we write
  (``shard-00001.safetensors``, ``gin-<12 hex>-<call>.safetensors``), a regular file inside the
  member's folder (no symlink), and every tensor in it must match the sha256 recorded at write.
- A record that fails any check is where the run resumes from: the journal is an append-only log
  of completed work in completion order, so every prefix of it is a state the run passed through
  (as if killed there). The journal is cut back to the valid prefix (rewritten atomically), the
  member's ``end.json`` dropped, and what follows is recomputed; damaged work files are thereby
  never published. The cut is reported (``notes``), not raised.
- A replay that publishes ``NAME`` without streaming (``settle``, after the publish) removes a work
  folder of ours beside it that describes the same step, precision, ensemble and ``--out`` (what it
  would have finished is now in place), and names, never touches, any other: ours of another
  command (resuming it is the user's call: that command with --overwrite), or not ours.
Where the key cannot be made (a read-only home) a fixed key is used: the header then still proves
the folder was written by this tool for this step, not by whom.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any

from safetensors import safe_open

from ...bundle import atomic, signing
from ...bundle.atomic_file import write_file
from ...bundle.store import tensor_sha256
from ...errors import OutputError, OutputExists

MADE_BY = "oracle streaming replay work folder"
HEADER, JOURNAL, END = "header.json", "journal.jsonl", "end.json"
FILE_NAME = re.compile(r"(shard-\d{5}|gin-[0-9a-f]{12}-\d{1,9})\.safetensors")


def key() -> bytes:
    """This user's signing key (``bundle/signing.py``); ``_KEY`` set here overrides it (tests)."""
    return _KEY if _KEY is not None else signing.key()


_KEY: bytes | None = None


def _mac(*parts: Any) -> str:
    msg = "\n".join(json.dumps(p, sort_keys=True) for p in parts).encode()
    return hmac.new(key(), msg, hashlib.sha256).hexdigest()


_same = signing.same


def _read_json(path: Path, limit: int = 1 << 20) -> Any:
    """A small JSON file of ours (a header, an end record), or None: missing, a symlink, not a regular
    file, over ``limit`` bytes (never read past it) or not JSON."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
        return json.loads(data) if len(data) <= limit else None
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)


def _signed(d: Any) -> dict | None:
    """``d`` without its mac if the mac verifies, else None."""
    if not isinstance(d, dict) or not isinstance(d.get("mac"), str):
        return None
    body = {k: v for k, v in d.items() if k != "mac"}
    return body if _same(d["mac"], _mac(body)) else None


def _differences(have: dict, want: dict) -> list[str]:
    keys = sorted((set(have) | set(want)) - {"nonce"})
    return [f"{k} {have.get(k)!r} (this run: {want.get(k)!r})" for k in keys if have.get(k) != want.get(k)][:3]


REPLACE = ("this-step", "any-ours")  #: which work folders of ours that are not this run's a replay may replace
THIS_STEP = ("fingerprint", "out")  # a folder of ours with these equal is provably this run's (other settings)


def open_work(out: Path, header: dict[str, Any], *, overwrite: bool = False, replace: str = "this-step") -> tuple[Path, bool]:
    """``.NAME.partial`` beside ``out``: ``(path, adopted)``. A new folder is made with a signed header;
    an existing one is adopted only if its header verifies and describes this run. One of ours that does
    not is replaced with ``overwrite`` where it is of this step and --out (``THIS_STEP``), or with
    ``replace="any-ours"`` (a caller owning the folder around ``out``: the judge's stages) whatever it
    describes; anything else: OutputExists, the folder left as it is."""
    if replace not in REPLACE:
        raise ValueError(f"replace={replace!r}: expected one of {REPLACE}")
    work = out.parent / f".{out.name}.partial"
    want = {"made_by": MADE_BY, **header}
    if (work.exists() or work.is_symlink()) and not _empty_dir(work):
        have = _signed(_read_json(work / HEADER)) if work.is_dir() and not work.is_symlink() else None
        if have is not None and {k: v for k, v in have.items() if k != "nonce"} == want:
            _NONCES[str(work.resolve())] = have["nonce"]
            return work, True
        ours = have is not None and have.get("made_by") == MADE_BY
        this_step = ours and all(have.get(k) == want.get(k) for k in THIS_STEP)
        if ours and (replace == "any-ours" or (overwrite and this_step)):
            shutil.rmtree(work)  # ours (the header verifies), of this step under other settings, or the caller's own
        else:
            raise OutputExists(f"work folder {work} exists and was left as it is: {_refusal(have, want, this_step)}")
    body = {**want, "nonce": secrets.token_hex(16)}
    try:
        _make(work, body)
    except OSError as e:
        raise OutputError(f"cannot make the work folder {work}: {e.strerror or e} ({e.filename or work.parent})") from None
    _NONCES[str(work.resolve())] = body["nonce"]
    return work, False


def _refusal(have: dict | None, want: dict, this_step: bool) -> str:
    """Why a work folder is not this run's to adopt or replace, and what the user can do."""
    if have is None or have.get("made_by") != MADE_BY:
        return ("it holds no header signed by this tool for this user (not ours, or damaged); "
                "if it is not yours to keep, delete or move it yourself; or choose another --out")  # fmt: skip
    if this_step:
        return (f"it is this tool's work folder of another run of this step ({'; '.join(_differences(have, want))}); "
                "rerun the command that made it to resume, pass --overwrite to replace it, or delete it")  # fmt: skip
    what = "another step (its capture's inputs or weights differ from this capture's)" if have.get("fingerprint") != want.get(
        "fingerprint") else f"another --out ({have.get('out')!r}; moved here?)"  # fmt: skip
    return (f"it is this tool's work folder of a replay of {what}, someone's unfinished work that --overwrite "
            "does not replace; resume it with the command that made it, choose another --out, or delete it (rm -r)")


def _empty_dir(p: Path) -> bool:
    try:
        return p.is_dir() and not p.is_symlink() and not any(p.iterdir())
    except OSError:
        return False


def _make(work: Path, body: dict[str, Any]) -> None:
    """The work folder with its signed header, in one move: made as a signed temporary of the writer
    (atomic.py; a kill before the move leaves one the next writer removes), then renamed into place.
    An empty folder at ``work`` (nothing in it to lose) is taken."""
    work.parent.mkdir(parents=True, exist_ok=True)
    if _empty_dir(work):
        work.rmdir()
    tmp = atomic.make_temp(work)
    try:
        write_file(tmp / HEADER, json.dumps({**body, "mac": _mac(body)}, sort_keys=True))
        with atomic.dir_lock(work.parent):
            if os.path.lexists(work):
                raise OutputExists(f"work folder {work} appeared while this run made its own; it was left as it is")
            if not atomic.rename2(tmp, work, atomic.RENAME_NOREPLACE):
                os.rename(tmp, work)
    finally:
        atomic.release(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


_NONCES: dict[str, str] = {}


def nonce(work: Path) -> str:
    """The nonce of an open (verified or new) work folder's header (read once per folder)."""
    k = str(work.resolve())
    if k not in _NONCES:
        _NONCES[k] = (_read_json(work / HEADER) or {}).get("nonce", "")
    return _NONCES[k]


def seal(work: Path, rec: dict[str, Any]) -> dict[str, Any]:
    """``rec`` with its MAC, bound to this work folder."""
    return {**rec, "mac": _mac(nonce(work), rec)}


def _opened(work: Path, d: Any) -> dict | None:
    if not isinstance(d, dict) or not isinstance(d.get("mac"), str):
        return None
    body = {k: v for k, v in d.items() if k != "mac"}
    return body if _same(d["mac"], _mac(nonce(work), body)) else None


def _check_file(member_dir: Path, rec: dict) -> str | None:
    """Why the record's file cannot be adopted, or None: a plain name we write, a regular file inside
    the member's folder, every tensor's sha256 as recorded."""
    f = rec.get("file")
    if not isinstance(f, str) or not FILE_NAME.fullmatch(f):
        return f"names a file {f!r} this tool does not write"
    path = member_dir / f
    if path.is_symlink() or not path.is_file() or path.resolve().parent != member_dir.resolve():
        return f"{f} is missing or not a regular file inside the folder"
    hashes = rec.get("sha256")
    if not isinstance(hashes, dict):
        return f"{f} has no recorded hashes"
    try:
        with safe_open(str(path), framework="pt") as st:
            if sorted(st.keys()) != sorted(hashes):
                return f"{f} holds other tensors than recorded"
            for name, want in hashes.items():
                if tensor_sha256(st.get_tensor(name)) != want:
                    return f"{f}: tensor {name} does not match its sha256"
    except Exception as e:  # a truncated or garbled safetensors file: its header or data cannot be read
        return f"{f} is not a readable safetensors file ({type(e).__name__})"
    return None


def valid_records(work: Path, member_dir: Path) -> tuple[list[dict], str | None]:
    """The journal's records up to the first that fails its MAC or its file's checks (a line cut by a
    kill ends it too); the journal is cut back to them. -> (records without their MACs, a note naming
    what was dropped, or None)."""
    path = member_dir / JOURNAL
    lines = read_limited(path, work).decode(errors="replace").splitlines()
    good: list[str] = []
    recs: list[dict] = []
    note = None
    seen: set = set()  # (kind, unit, index) and file names recorded so far: a second record of either is damage
    dropped = set()  # calls whose input gradients a later (signed) record dropped: their files are gone by design
    for line in lines:
        try:
            d = _opened(work, json.loads(line))
        except ValueError:
            d = None
        if d is not None and d.get("kind") == "drop":
            dropped.add((d.get("unit"), d.get("index")))
    for i, line in enumerate(lines):
        try:
            raw, torn = json.loads(line), False
        except ValueError:
            raw, torn = None, True
        rec = _opened(work, raw)
        if rec is None:
            why = "is not valid JSON" if torn else "is not signed for this folder"
        elif rec.get("kind") == "drop" or (rec.get("kind") == "call" and (rec.get("unit"), rec.get("index")) in dropped):
            why = None
        else:
            why = _check_file(member_dir, rec) if rec.get("kind") in ("unit", "call") else "is of an unknown kind"
        if why is None and rec.get("kind") in ("unit", "call"):
            ids = {(rec["kind"], json.dumps(rec.get("unit")), json.dumps(rec.get("index"))), ("file", rec.get("file"))}
            if ids & seen:
                why = f"records {rec.get('kind')} {rec.get('unit')!r} ({rec.get('file')}) a second time"
            seen |= ids
        if why is not None:
            if not (torn and i == len(lines) - 1):  # a torn last line is an ordinary kill, not news
                note = f"{member_dir.name}: journal record {i + 1} {why}; recomputing from there"
            break
        good.append(line)
        recs.append(rec)
    if len(good) < len(lines):
        write_file(path, "".join(ln + "\n" for ln in good))
        (member_dir / END).unlink(missing_ok=True)
    return recs, note


JOURNAL_MAX = 256 << 20  # bytes; a journal holds one line per unit and call (~1 KiB each at Qwen3-VL-8B): far below


def read_limited(path: Path, work: Path, limit: int | None = None) -> bytes:
    """The bytes of a work file this tool wrote (a journal; b"" where there is none), read without
    following a symlink and never past ``limit``: a symlink, a device or a file over the limit is not
    what this tool wrote: OutputExists (exit 6) naming it, the folder left as it is."""
    fix = f"the work folder {work} was left as it is; delete it (rm -r) and run again"
    limit = JOURNAL_MAX if limit is None else limit
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return b""
    except OSError as e:
        raise OutputExists(f"{path} is not a file this tool wrote ({e.strerror or e}: a symlink?); {fix}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OutputExists(f"{path} is not a regular file (this tool writes its journal as one); {fix}")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise OutputExists(f"{path} is over {limit >> 20} MiB, more than this tool writes into a journal; {fix}")
    return data


def write_end(work: Path, member_dir: Path, end: dict[str, Any]) -> None:
    write_file(member_dir / END, json.dumps(seal(work, end)))


def read_end(work: Path, member_dir: Path) -> dict[str, Any] | None:
    """A member's end record if it verifies and its whole journal does, else None (recompute)."""
    if not (member_dir / END).is_file():
        return None
    _, note = valid_records(work, member_dir)
    end = _opened(work, _read_json(member_dir / END)) if note is None else None
    return end if end is not None and {"loss", "order", "promotions"} <= set(end) else None


SUPERSEDED_BY = ("fingerprint", "dtype", "ensemble", "out")  # what a published in-memory replay settles


def settle(out: Path, header: dict[str, Any]) -> list[str]:
    """After a replay published ``out`` without streaming: what streamed runs of ``out`` left beside it
    (``.NAME.partial``, ``.NAME.rankR.partial``). Ours for the same step and command (``header``'s
    SUPERSEDED_BY fields): removed; anything else: kept and named. -> one note per folder."""
    notes = []
    try:
        found = sorted(p for p in out.parent.iterdir() if re.fullmatch(rf"\.{re.escape(out.name)}(\.rank\d+)?\.partial", p.name))
    except OSError:
        return notes
    for work in found:
        if _empty_dir(work):
            continue  # nothing in it to lose or to name: a streamed run takes it as its own
        have = _signed(_read_json(work / HEADER)) if work.is_dir() and not work.is_symlink() else None
        ours = have is not None and have.get("made_by") == MADE_BY
        if ours and all(have.get(k) == header.get(k) for k in SUPERSEDED_BY):
            try:
                shutil.rmtree(work)
                notes.append(f"removed the work folder {work} of a killed streamed replay of this step: {out} now holds its result")
            except OSError as e:
                notes.append(f"{work} is kept: it is the work folder of a killed streamed replay of this step, superseded by {out}, "
                             f"but it cannot be removed ({e.strerror or e}); delete it")  # fmt: skip
        elif ours:
            diff = "; ".join(_differences({k: have.get(k) for k in SUPERSEDED_BY}, {k: header.get(k) for k in SUPERSEDED_BY}))
            notes.append(f"{work} is kept: it is this tool's work folder of another streamed replay into {out.name} ({diff}); "
                         "rerun that command with --overwrite to resume it, or delete it")  # fmt: skip
        else:
            notes.append(f"{work} is kept: it is not a work folder of this tool for this user (no header signed by this tool); "
                         "it was not touched; delete or move it yourself if it is not yours")  # fmt: skip
    return notes
