"""The streamed replay's system time: its large tensors on transparent huge pages.

The streaming engine pins glibc's mmap threshold at 1 MiB (engine.tame_malloc: freed weights leave
the process, so the budget is what it holds). Every tensor above it is then a fresh mmap that the
kernel page-faults and zeroes 4 KiB at a time and unmaps at its free: measured on benchmark b's
shape at 2048 tokens (benchmarks/streaming_sys.py), 5.25 M minor faults and 6.4 s of system time
streamed against 1.32 M and 2.0 s in memory, for 14.2 s of user time in both. glibc's tunable
``glibc.malloc.hugetlb=1`` makes malloc advise its mmapped chunks onto transparent huge pages (2 MiB,
where the kernel's THP mode is ``madvise`` or ``always``): 0.24x the faults, 0.55x the system time,
the same peak RSS, the same bits. A tunable is read when the process starts, so the command line
restarts itself once with it set (``ensure``), before anything is imported; ``ORACLE_HUGE_PAGES=0``
keeps the process as it is.
"""

from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb"


def wanted(argv: list[str], env: dict[str, str]) -> bool:
    """A streamed replay (``replay ... --max-memory``), the tunable not set, not switched off."""
    if env.get("ORACLE_HUGE_PAGES", "1") == "0" or TUNABLE in env.get("GLIBC_TUNABLES", ""):
        return False
    if not sys.platform.startswith("linux"):
        return False
    return "replay" in argv and any(a == "--max-memory" or a.startswith("--max-memory=") for a in argv)


def ensure(argv: list[str] | None = None) -> None:
    """Restart this command line (same interpreter, same arguments) with the tunable set, if wanted."""
    argv = sys.argv[1:] if argv is None else argv
    if not wanted(argv, dict(os.environ)):
        return
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(filter(None, [env.get("GLIBC_TUNABLES"), f"{TUNABLE}=1"]))
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
