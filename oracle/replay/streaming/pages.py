"""The streamed replay's system time: its large tensors on transparent huge pages.

The streaming engine pins glibc's mmap threshold at 1 MiB (engine.tame_malloc: freed weights leave
the process, so the budget is what it holds). Every tensor above it is then a fresh mmap that the
kernel page-faults and zeroes 4 KiB at a time and unmaps at its free: measured on benchmark b's
shape at 2048 tokens (benchmarks/streaming_sys.py), 5.25 M minor faults and 6.4 s of system time
streamed against 1.32 M and 2.0 s in memory, for 14.2 s of user time in both. glibc's tunable
``glibc.malloc.hugetlb=1`` makes malloc advise its mmapped chunks onto transparent huge pages (2 MiB,
where the kernel's THP mode is ``madvise`` or ``always``): 0.24x the faults, 0.55x the system time,
the same peak RSS, the same bits. A tunable is read when the process starts, so the command line
restarts itself once with it set (``restart``, called by the CLI's replay once its options are
valid), and ``--nproc`` ranks start with it (``tunable_env``); ``ORACLE_HUGE_PAGES=0`` keeps the
process as it is.
"""

from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb"


def wanted(env: dict[str, str]) -> bool:
    """For a streamed replay about to start: the tunable not set yet, not switched off, Linux."""
    if env.get("ORACLE_HUGE_PAGES", "1") == "0" or TUNABLE in env.get("GLIBC_TUNABLES", ""):
        return False
    return sys.platform.startswith("linux")


def tunable_env(env: dict[str, str]) -> dict[str, str]:
    """The variables a process must start with to have the tunable (nothing where it is not wanted)."""
    if not wanted(env):
        return {}
    return {"GLIBC_TUNABLES": ":".join(filter(None, [env.get("GLIBC_TUNABLES"), f"{TUNABLE}=1"]))}


def restart(argv: list[str]) -> None:
    """Restart this process (``argv``: its own full command line, ``sys.orig_argv``, as the caller
    holds it) with the tunable set, if wanted; return only where it is not."""
    extra = tunable_env(dict(os.environ))
    if extra:
        os.execve(sys.executable, [sys.executable, *argv[1:]], {**os.environ, **extra})
