"""``oracle replay ... --nproc N``: N local ranks of one replay, launched the way torchrun would.

Each rank is ``python -m oracle.api.worker`` reading its request (the command and its validated
options as JSON, e.g. ``ReplayOptions.for_rank``) on stdin, never a rebuilt command line, with
torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1,
MASTER_PORT a free port): oracle/parallel/distributed.py does the rest, exactly as under torchrun.
Threads: ``threads`` per rank, by default the cores divided among the ranks. A streamed replay's
ranks start with malloc on huge pages (``env``: oracle/replay/streaming/pages.py).

The launcher is the watchdog of its children: the first rank that exits with an error stops the
others (SIGTERM, SIGKILL after GRACE_S) and the launcher exits with that rank's code if the rank
reported the error itself (2..10: a user mistake every rank sees; 11: the rank it lost, named by its
watchdog), else with ``RankError.exit_code`` (11) and a line naming the rank and how it ended
(killed by a signal, or an exit code). A user mistake is seen by every rank alike (the same step,
options and budget), so the others get SETTLE_S to reach it and refuse on their own, removing the
work folder they made, before they are stopped: a rank stopped between making its folder and
refusing left an empty ``.NAME.rankR.partial`` behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import RankError, UsageError

GRACE_S = 2.0
SETTLE_S = 20.0  # most a rank may take from its start to its refusal on a loaded machine
USER_CODES = range(2, 11)


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for bind(0) and outgoing connections (Linux: 32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port for the rendezvous, below the kernel's ephemeral range: between this check and rank 0's listen,
    an ephemeral port can be taken by any connection on the machine (another run's gloo pairs: EADDRINUSE, seen
    when two --nproc runs started at once); a port below the range only by an explicit bind. Random in
    [10000, that range's low end), the first that binds; else one the kernel picks."""
    import random

    low = _ephemeral_low()
    rng = random.Random()  # a process of its own state: two launchers started together draw differently
    for _ in range(64 if low > 10001 else 0):
        port = rng.randrange(10000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def per_rank_threads(nproc: int, threads: int | None) -> int:
    """--threads per rank, by default the cores divided among the ranks."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return threads or max(1, cores // nproc)


def launch(nproc: int, request: dict[str, Any], threads: int, *, env: dict[str, str] | None = None,
           echo: Callable[[str], None] | None = None) -> int:  # fmt: skip
    """Run ``request`` (``{"command": ..., "options": {...}}``) on ``nproc`` ranks of ``python -m
    oracle.api.worker``; return the exit code of the whole run. ``env``: variables every rank starts
    with (a streamed replay's malloc tunable); ``echo``: where the ranks' stdout lines go (default:
    this process's stdout)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("--nproc inside torchrun: torchrun already starts the ranks; drop --nproc")
    root = str(Path(__file__).resolve().parent.parent.parent)
    port = free_port()
    payload = json.dumps(request).encode()
    procs: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []
    for r in range(nproc):
        rank_env = {**os.environ, **(env or {}), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(threads),
               "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
        p = subprocess.Popen([sys.executable, "-m", "oracle.api.worker"], env=rank_env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE if echo else None, text=False)  # fmt: skip
        p.stdin.write(payload)
        p.stdin.close()
        procs.append(p)
        if echo:
            t = threading.Thread(target=_relay, args=(p.stdout, echo), daemon=True)
            t.start()
            readers.append(t)
    try:
        return _watch(procs)
    finally:
        _stop(procs)
        for t in readers:
            t.join(timeout=GRACE_S)


def _relay(stream, echo: Callable[[str], None]) -> None:
    for line in iter(stream.readline, b""):
        echo(line.decode(errors="replace").rstrip("\n"))


def _watch(procs: list[subprocess.Popen], settle_s: float = SETTLE_S) -> int:
    settle_until = None
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        # a user mistake first; a rank that lost a peer is not the cause: the peer is
        failed.sort(key=lambda rc: (rc[1] not in USER_CODES, rc[1] == RankError.exit_code))
        if failed:
            r, c = failed[0]
            if c in USER_CODES and None in codes:  # the others will refuse alike: let them, up to settle_s
                settle_until = settle_until or time.monotonic() + settle_s
                if time.monotonic() < settle_until:
                    time.sleep(0.1)
                    continue
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
