"""Run one of this folder's scripts in a subprocess of this interpreter and return its JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def script(name: str, *args: str, env: dict | None = None, tag: str) -> tuple[dict, str]:
    """(the JSON the script printed after ``tag``, its stderr); fails with the script's output."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("ORACLE_", "TORCH_NPU_STANDIN"))}
    full.update(env or {})
    p = subprocess.run([sys.executable, os.path.join(HERE, name), *args], env=full, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(tag + " ")]
    assert p.returncode == 0 and lines, f"{name} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return json.loads(lines[-1][len(tag) + 1:]), p.stderr


def ranks(name: str, *args: str, world: int, env: dict | None = None, tag: str,
          python: str = sys.executable) -> list[tuple[dict, str]]:  # fmt: skip
    """The script as ``world`` gloo ranks (RANK, WORLD_SIZE, MASTER_ADDR/PORT set) of ``python``,
    each rank's (JSON, stderr)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ORACLE_", "TORCH_NPU_STANDIN"))}
    base.update(env or {}, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([python, os.path.join(HERE, name), *args], env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]  # fmt: skip
    outs = [p.communicate(timeout=600) for p in procs]
    res = []
    for r, (p, (so, se)) in enumerate(zip(procs, outs)):
        lines = [ln for ln in so.splitlines() if ln.startswith(tag + " ")]
        assert p.returncode == 0 and lines, f"{name} rank {r} failed (rc {p.returncode}):\n{so[-3000:]}\n{se[-6000:]}"
        res.append((json.loads(lines[-1][len(tag) + 1:]), se))
    return res
