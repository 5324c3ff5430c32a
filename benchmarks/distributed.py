"""Speed-up and parallel efficiency of the distributed replay (issue "Spread one replay over many
processes and machines"): 2 ranks of 1 thread each against 1 process of 1 thread, side by side.

    python benchmarks/distributed.py [--tokens 1024] [--ensemble 2] [--dir DIR]
    python benchmarks/distributed.py --work tp      # the tensor-parallel float64 oracle instead

The work is an emulated amp-bf16 ensemble (the noise band) on Qwen3 text hidden 512, 8 layers,
vocab 32000 (benchmark b's shape of benchmarks/streaming.py) with fewer tokens: member k runs on
rank k % 2. Times are the whole command's wall time (process start, rendezvous, the transfer of the
members to rank 0 and the bundle write included), so the efficiency is what a user sees. The two
results are checked bitwise equal. Target efficiency >= 0.8. The CPU seconds of all processes are
printed too: on a machine busy with other work the wall-time ratio measures the contention, while
CPU(2 ranks) / CPU(1 process) is the work the distribution adds (start-up of a second process,
the transfer, the launcher).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from streaming import QWEN3_B, text_inputs, write_capture  # noqa: E402

from oracle.bundle.store import Bundle  # noqa: E402


def timed(args: list[str]) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds of the command and all its processes, and the load average after."""
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "oracle", *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"oracle {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime, os.getloadavg()[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--ensemble", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--work", choices=("ensemble", "tp"), default="ensemble", help="tp: the tensor-parallel fp64 oracle")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = a.dir or Path(tmp)
        cap = write_capture(d / "cap", "qwen3", QWEN3_B, text_inputs(QWEN3_B["vocab_size"], [a.tokens]))
        if a.work == "tp":
            common = ["replay", str(cap), "--dtype", "fp64", "--no-verify", "--threads", "1", "--overwrite"]
        else:
            common = ["replay", str(cap), "--dtype", "amp-bf16", "--ensemble", str(a.ensemble), "--threads", "1", "--overwrite"]
        t1, c1, l1 = timed([*common, "--out", str(d / "one")])
        t2, c2, l2 = timed([*common, "--out", str(d / "two"), "--nproc", "2"])
        one, two = Bundle(d / "one"), Bundle(d / "two")
        if a.work == "tp":  # sums split differently: within the stated bound, not bitwise
            rel = max(float((two.load("grads", n) - g).norm() / g.norm()) for n, g in one.load_group("grads").items())
            same = f"max relative difference {rel:.1e} (bound 1e-12)"
        else:
            ok = all(torch.equal(g, two.load(m, n)) for m in one.member_groups() for n, g in one.load_group(m).items())
            same = f"bitwise equal: {ok}"
        speedup = t1 / t2
        what = "tensor-parallel fp64 oracle" if a.work == "tp" else f"amp-bf16 ensemble of {a.ensemble}"
        print(f"distributed: Qwen3 text hidden 512, 8 layers, vocab 32000, {a.tokens} tokens, {what}, 1 thread per process")
        print(f"  1 process : {t1:7.2f} s wall, {c1:7.2f} s CPU (load average {l1:.1f} on {os.cpu_count()} cores)")
        print(f"  2 ranks   : {t2:7.2f} s wall, {c2:7.2f} s CPU (load average {l2:.1f}; --nproc 2, gloo over 127.0.0.1)")
        print(f"  speed-up {speedup:.2f}x, parallel efficiency {speedup / 2:.2f} (target >= 0.8); "
              f"{same}")  # fmt: skip


if __name__ == "__main__":
    main()
