"""Opt-in: a streamed replay's large tensors on transparent huge pages (``ORACLE_HUGE_PAGES=1``).

glibc's tunable ``glibc.malloc.hugetlb=1`` makes malloc advise its mmapped chunks onto transparent
huge pages (2 MiB, where the kernel's THP mode is ``madvise`` or ``always``). It paid while the
streaming engine pinned glibc's mmap threshold at 1 MiB (every tensor above it a fresh mmap,
faulted 4 KiB at a time: 0.24x the faults, 0.55x the system time). With the threshold at 32 MiB
(engine.tame_malloc) only the large tensors are mmapped, and huge pages cost more than they save:
on benchmark b's shape at 4096 tokens, 0.11x the faults but 1.7x the system time (the kernel
zeroes, and under ``defrag=madvise`` compacts, 2 MiB at a time), and in memory 1.9x
(benchmarks/streaming_sys.py prints both, side by side). So it is off unless asked for. A tunable
is read when the process starts, so the command line restarts itself once with it set (``ensure``),
before anything is imported.
"""

from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb"


def wanted(argv: list[str], env: dict[str, str]) -> bool:
    """A streamed replay (``replay ... --max-memory``), asked for, the tunable not yet set."""
    if env.get("ORACLE_HUGE_PAGES", "0") != "1" or TUNABLE in env.get("GLIBC_TUNABLES", ""):
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
