"""Where the streamed replay's system time goes (issue 19 item 5), measured side by side in one run.

    python benchmarks/streaming_sys.py [--tokens 4096] [--threads 2] [--dir DIR]

Benchmark b's capture (benchmarks/streaming.py: Qwen3 text hidden 512, 8 layers, vocab 32000) is
replayed in float64 four times, each in its own process: in memory; streamed (``--max-memory`` at
40 % of the in-memory peak) as the command runs by default (glibc's mmap threshold pinned at 1 MiB,
malloc on transparent huge pages; engine.tame_malloc, oracle/replay/streaming/pages.py); streamed
with the threshold at 32 MiB (``ORACLE_MALLOC_MMAP_MB=32 ORACLE_HUGE_PAGES=0``); and at 32 MiB with
huge pages. Printed per run: wall, user and system
seconds, minor page faults (getrusage of the child), peak RSS; and whether the gradient sets of the
streamed runs are bitwise equal (they run the same ops; the in-memory one differs by the row-chunked
layers' weight-gradient sums, <= 1e-12). Below the threshold a freed tensor's memory is reused from
the heap; above it every tensor is a fresh mmap, faulted and zeroed 4 KiB at a time.
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

PEAK = ("import resource, subprocess, sys; c = subprocess.run(sys.argv[1:]).returncode; "
        "print('peak', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(c)")  # fmt: skip


def timed(args: list[str], env: dict[str, str] | None = None) -> dict[str, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", PEAK, sys.executable, "-m", "oracle", *args], cwd=ROOT,
                       env={**os.environ, **(env or {})}, capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        raise SystemExit(f"oracle {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall": wall, "user": after.ru_utime - before.ru_utime, "sys": after.ru_stime - before.ru_stime,
            "minflt": after.ru_minflt - before.ru_minflt, "load": os.getloadavg()[0],
            "peak": int(r.stderr.strip().splitlines()[-1].split()[1]) * 1024}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = a.dir or Path(tmp)
        cap = write_capture(d / "cap", "qwen3", QWEN3_B, text_inputs(QWEN3_B["vocab_size"], [a.tokens]))
        common = ["replay", str(cap), "--no-verify", "--threads", str(a.threads), "--overwrite"]
        load0 = os.getloadavg()[0]
        mem = timed([*common, "--out", str(d / "mem")])
        budget = str(int(0.4 * mem["peak"]))
        streamed = [*common, "--max-memory", budget]
        runs = {
            "in memory": mem,
            "streamed, 1 MiB + huge pages (default)": timed([*streamed, "--out", str(d / "before")]),
            "streamed, 32 MiB": timed([*streamed, "--out", str(d / "now")],
                                      env={"ORACLE_MALLOC_MMAP_MB": "32", "ORACLE_HUGE_PAGES": "0"}),
            "streamed, 32 MiB + huge pages": timed([*streamed, "--out", str(d / "huge")],
                                                   env={"ORACLE_MALLOC_MMAP_MB": "32", "ORACLE_HUGE_PAGES": "1"}),
        }  # fmt: skip
        b, n, h = (Bundle(d / x) for x in ("before", "now", "huge"))
        equal = all(torch.equal(n.load("grads", k), b.load("grads", k)) and torch.equal(n.load("grads", k), h.load("grads", k))
                    for k in n.names("grads"))  # fmt: skip
        print(f"streaming sys time: Qwen3 text hidden 512, 8 layers, vocab 32000, {a.tokens} tokens, {a.threads} thread(s); "
              f"{os.cpu_count()} cores, load average {load0:.1f} before; streamed at {int(budget) / 2**30:.2f} GiB")  # fmt: skip
        for name, r in runs.items():
            print(f"  {name:38s}: {r['wall']:7.1f} s wall, {r['user']:7.1f} s user, {r['sys']:6.1f} s sys, "
                  f"{r['minflt'] / 1e6:6.2f} M minor faults, peak {r['peak'] / 2**30:.2f} GiB (load {r['load']:.1f} after)")  # fmt: skip
        before, now, huge = (runs[k] for k in list(runs)[1:])
        print(f"  32 MiB / default: wall {now['wall'] / before['wall']:.2f}x, sys {now['sys'] / before['sys']:.2f}x, "
              f"faults {now['minflt'] / before['minflt']:.2f}x; huge pages / 32 MiB: sys {huge['sys'] / now['sys']:.2f}x, "
              f"faults {huge['minflt'] / now['minflt']:.2f}x, wall {huge['wall'] / now['wall']:.2f}x; "
              f"32 MiB / in memory: wall {now['wall'] / mem['wall']:.2f}x, sys {now['sys'] / mem['sys']:.2f}x")  # fmt: skip
        print(f"  the three streamed gradient sets bitwise equal: {equal}")


if __name__ == "__main__":
    main()
