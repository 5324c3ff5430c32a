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
