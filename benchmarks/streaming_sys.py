"""Where the streamed replay's system time goes (issue 19 item 5), measured side by side in one run.

    python benchmarks/streaming_sys.py [--tokens 4096] [--threads 1] [--dir DIR]

Benchmark b's capture (benchmarks/streaming.py: Qwen3 text hidden 512, 8 layers, vocab 32000) is
replayed in float64 three times, each in its own process: in memory, streamed (``--max-memory`` at
40 % of the in-memory peak) as before this fix (``ORACLE_HUGE_PAGES=0``), and streamed as the command
runs now: restarted with glibc's malloc putting its mmapped chunks on transparent huge pages
(``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, oracle/replay/streaming/pages.py). Printed per run: wall, user and
system seconds, minor page faults (getrusage of the child), peak RSS; and whether the three
gradient sets are bitwise equal. The streamed replay pins malloc's mmap threshold at 1 MiB
(engine.tame_malloc, so freed weights leave the process): every tensor above it is a fresh mmap,
page-faulted and zeroed 4 KiB at a time, and returned at its free; the minor-fault count shows it.
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
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dir", type=Path, default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = a.dir or Path(tmp)
        cap = write_capture(d / "cap", "qwen3", QWEN3_B, text_inputs(QWEN3_B["vocab_size"], [a.tokens]))
        common = ["replay", str(cap), "--no-verify", "--threads", str(a.threads), "--overwrite"]
        load0 = os.getloadavg()[0]
        mem = timed([*common, "--out", str(d / "mem")])
        budget = str(int(0.4 * mem["peak"]))
        streamed = timed([*common, "--out", str(d / "str"), "--max-memory", budget], env={"ORACLE_HUGE_PAGES": "0"})  # before
        huge = timed([*common, "--out", str(d / "huge"), "--max-memory", budget])  # the command as it runs now
        o, s, h = Bundle(d / "mem"), Bundle(d / "str"), Bundle(d / "huge")
        equal = all(torch.equal(o.load("grads", n), s.load("grads", n)) and torch.equal(o.load("grads", n), h.load("grads", n))
                    for n in o.names("grads"))  # fmt: skip
        print(f"streaming sys time: Qwen3 text hidden 512, 8 layers, vocab 32000, {a.tokens} tokens, {a.threads} thread(s); "
              f"{os.cpu_count()} cores, load average {load0:.1f} before")  # fmt: skip
        for name, r in (("in memory", mem), (f"streamed {int(budget) / 2**30:.2f} GiB, before", streamed),
                        ("streamed, huge pages (now)", huge)):  # fmt: skip
            print(f"  {name:30s}: {r['wall']:7.1f} s wall, {r['user']:7.1f} s user, {r['sys']:6.1f} s sys, "
                  f"{r['minflt'] / 1e6:6.2f} M minor faults, peak {r['peak'] / 2**30:.2f} GiB (load {r['load']:.1f} after)")  # fmt: skip
        print(f"  streamed / in memory: sys {streamed['sys'] / mem['sys']:.2f}x, faults {streamed['minflt'] / mem['minflt']:.2f}x; "
              f"huge pages / streamed: sys {huge['sys'] / streamed['sys']:.2f}x, faults {huge['minflt'] / streamed['minflt']:.2f}x, "
              f"wall {huge['wall'] / streamed['wall']:.2f}x, CPU {(huge['user'] + huge['sys']) / (streamed['user'] + streamed['sys']):.2f}x")  # fmt: skip
        print(f"  all three gradient sets bitwise equal: {equal}")


if __name__ == "__main__":
    main()
