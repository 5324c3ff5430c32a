"""What one replay is asked to do, validated once: the CLI, ``oracle judge`` and every ``--nproc``
rank build this one object (ranks receive it serialised as JSON, never as a rebuilt command line).

The rules live here and nowhere else: an option that another one makes meaningless is refused with
a ``UsageError`` naming both, so a library caller gets exactly the message a CLI user gets.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from .. import precision as precisions
from ..errors import UsageError

SPLITS = ("tensor", "tokens")  #: how several ranks share the float64 oracle


def cores() -> int:
    """The cores this process may run on (its affinity mask where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_spread(dtype: str, ensemble: int, split: str, ranks: int, streamed: bool, verify: str) -> None:
    """The rules between the precision, the band and how ``ranks`` processes share a replay, for ReplayOptions
    (``ranks`` = --nproc: refused before any rank starts or any dry run prices it) and for replay/run.py (``ranks``
    = torchrun's world): one text for both."""
    if dtype == "fp64" and ensemble != 1:
        raise UsageError("--ensemble applies to emulated low-precision replays, not to --dtype fp64")
    if split == "tokens" and dtype != "fp64":
        raise UsageError("--split tokens splits the float64 oracle; emulated members spread over the ranks whole: drop --split")
    if ranks > 1 and dtype == "fp64" and verify == "on":
        raise UsageError(f"the {'token' if split == 'tokens' else 'tensor'}-parallel float64 replay ({ranks} ranks) has no "
                         "certificate: drop --verify, or replay with one process")  # fmt: skip
    if ranks > 1 and dtype == "fp64" and streamed and split != "tokens":
        raise UsageError(f"the tensor-parallel float64 replay ({ranks} ranks) runs in memory: drop --max-memory, "
                         "or stream it split by tokens (--split tokens)")  # fmt: skip


@dataclass(frozen=True)
class ReplayOptions:
    capture: str
    out: str | None = None
    dtype: str = "fp64"  #: fp64: the oracle; any other REPLAY_NAMES entry: an emulated run (the band)
    ensemble: int = 1
    verify: bool | None = None  #: None: the finite-difference certificate where it is cheap
    directions: int = 3
    local: bool = False
    modules: str | None = None  #: --local only: regex selecting recorded modules
    workers: int = 1  #: --local only
    members: int = 2  #: --local: emulated members for the expected local error
    max_memory: str | None = None  #: a size (16G, 512M): stream the replay within it
    threads: int | None = None  #: None: every core (divided among the ranks under --nproc)
    dry_run: bool = False
    nproc: int = 1
    split: str = "tensor"
    overwrite: bool = False
    #: which streamed work folder of ours that is not this run's may be replaced (streaming/workdir.py): "this-step"
    #: (with --overwrite, of this step and --out) or "any-ours" (the judge's stages, inside its own --out); no CLI option
    replace_work: str = "this-step"

    def __post_init__(self) -> None:
        for f in ("capture", "out", "max_memory", "modules"):  # Path-likes in, strings kept (JSON-serialisable)
            v = getattr(self, f)
            if v is not None and not isinstance(v, str):
                object.__setattr__(self, f, os.fspath(v))
        if self.out is None and not self.dry_run:
            raise UsageError("give --out: the bundle directory to write (only --dry-run needs none)")
        if self.dtype not in precisions.REPLAY_NAMES:
            raise UsageError(f"--dtype {self.dtype!r}: expected one of {', '.join(precisions.REPLAY_NAMES)}")
        if self.replace_work not in ("this-step", "any-ours"):
            raise UsageError(f"replace_work {self.replace_work!r}: expected 'this-step' or 'any-ours'")
        if self.split not in SPLITS:
            raise UsageError(f"--split {self.split!r}: expected one of {', '.join(SPLITS)}")
        for f in ("ensemble", "directions", "workers", "members", "nproc", "threads"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise UsageError(f"--{f} {v!r}: expected a whole number >= 1")
        if self.local and self.max_memory is not None:
            raise UsageError("--local replays one recorded module at a time (only that module is materialised); "
                             "--max-memory does not apply to it: drop --max-memory")  # fmt: skip
        if self.local and self.dry_run:
            raise UsageError("--dry-run prices a whole-model replay; --local replays one recorded module at a time "
                             "(each within its own memory): drop --dry-run or --local")  # fmt: skip
        if self.local and self.dtype != "fp64":
            raise UsageError("--local replays each module in fp64 (and emulates the capture's precision itself); drop --dtype")
        if not self.local and (self.modules is not None or self.workers != 1):
            raise UsageError("--modules and --workers apply to --local replays only")
        if self.max_memory is not None:
            self.budget  # noqa: B018  (parsed once here: a malformed size is refused before any work)
        if not self.local:
            check_spread(self.dtype, self.ensemble, self.split, self.nproc, self.max_memory is not None, self.verify_mode)

    @property
    def budget(self) -> int | None:
        """--max-memory in bytes (None: in memory)."""
        if self.max_memory is None:
            return None
        from .streaming.engine import parse_size

        return parse_size(self.max_memory)

    @property
    def verify_mode(self) -> str:
        return "auto" if self.verify is None else ("on" if self.verify else "off")

    def cpu_threads(self) -> int:
        """The thread policy bitwise repeatability depends on: --threads, else every core of this
        process (a rank of --nproc receives its share as --threads from the launcher)."""
        return self.threads or cores()

    def processes(self) -> int:
        """The rank processes --nproc starts: an emulated band's members go to them whole (round-robin), so no more
        than its members (--nproc 4 --ensemble 2 started 2 ranks with nothing to do); a float64 replay splits over
        all --nproc."""
        return min(self.nproc, self.ensemble) if self.dtype != "fp64" and not self.local else self.nproc

    def for_rank(self, threads: int) -> dict[str, Any]:
        """This replay as one rank of --nproc runs it: the same options, one process, its threads."""
        return {**dataclasses.asdict(self), "nproc": 1, "threads": threads}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReplayOptions:
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise UsageError(f"replay options: unknown {', '.join(unknown)}")
        return cls(**d)
