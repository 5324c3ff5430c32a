"""``oracle replay ... --nproc N``: N local ranks of one replay, launched the way torchrun would.

Each rank is ``python -m oracle replay ...`` (the same command without ``--nproc``) with torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT a
free port): oracle/parallel/distributed.py does the rest, exactly as under torchrun. Threads: the command's
``--threads`` per rank, by default the cores divided among the ranks.

The launcher is the watchdog of its children: the first rank that exits with an error stops the
others (SIGTERM, SIGKILL after GRACE_S) and the launcher exits with that rank's code if the rank
reported the error itself (2..10: a user mistake every rank sees; 11: the rank it lost, named by its
watchdog), else with ``RankError.exit_code`` (11) and a line naming the rank and how it ended
(killed by a signal, or an exit code).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from enum import Enum
from pathlib import Path

from ..errors import RankError, UsageError

GRACE_S = 2.0
USER_CODES = range(2, 11)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def argv_of(ctx, drop: tuple[str, ...] = ("nproc",)) -> list[str]:
    """The command line that gives ``ctx``'s parsed parameters again (click), without ``drop``."""
    args: list[str] = [ctx.info_name]
    for p in ctx.command.params:
        if p.name in drop or p.name not in ctx.params:
            continue
        v = ctx.params[p.name]
        if p.param_type_name == "argument":
            args += [str(x.value if isinstance(x, Enum) else x) for x in (v if isinstance(v, (list, tuple)) else [v])]
            continue
        if v is None or (v == p.default and not p.multiple):
            continue
        if p.is_flag:
            opts = p.opts if v else p.secondary_opts
            if opts:
                args.append(opts[0])
            continue
        for x in v if p.multiple else [v]:
            args += [p.opts[0], str(x.value if isinstance(x, Enum) else x)]
    return args


def launch(nproc: int, argv: list[str], threads: int | None) -> int:
    """Run ``python -m oracle *argv`` as ``nproc`` ranks; return the exit code of the whole run."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("--nproc inside torchrun: torchrun already starts the ranks; drop --nproc")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    per_rank = threads or max(1, cores // nproc)
    if "--threads" not in argv:
        argv = [*argv, "--threads", str(per_rank)]
    root = str(Path(__file__).resolve().parent.parent)
    port = free_port()
    procs: list[subprocess.Popen] = []
    for r in range(nproc):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(per_rank),
               "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-m", "oracle", *argv], env=env))
    try:
        return _watch(procs)
    finally:
        _stop(procs)


def _watch(procs: list[subprocess.Popen]) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        failed.sort(key=lambda rc: rc[1] == RankError.exit_code)  # a rank that lost a peer is not the cause: the peer is
        if failed:
            r, c = failed[0]
            if c in USER_CODES or c == RankError.exit_code:
                return c  # the rank said what went wrong itself (a user mistake, or the rank it lost)
            how = f"was killed by {signal.Signals(-c).name}" if c < 0 else f"exited with code {c}"
            print(f"error: rank {r} of {len(procs)} {how}; the other ranks were stopped; run the same command "
                  "again to resume from the journals", file=sys.stderr, flush=True)  # fmt: skip
            return RankError.exit_code
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
