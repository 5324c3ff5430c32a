"""What scoring one parameter holds beyond its inputs: ``tensor_metrics`` in one pass against by chunks.

    python benchmarks/score_memory.py [--elements N]

Each way runs in a fresh child process (its own high-water mark, reset after the inputs exist): the
truth (float64) and a capture's gradient (float32) of N elements, then ``oracle.metrics.tensor_metrics``
with ``CHUNK`` = N (one pass, as before chunking) or its default. Prints each peak above the inputs in
units of the truth's float64 size, side by side, and what that means for Qwen3-VL-8B's largest gradient
(the embedding, 151936 x 4096 = 622 M elements). Linux only (/proc/self/clear_refs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, torch
from oracle import metrics
n, one_pass = int(sys.argv[1]), sys.argv[2] == "1"
if one_pass:
    metrics.CHUNK = n
torch.manual_seed(0)
t = torch.randn(n, dtype=torch.float64)
g = (t + 1e-3 * torch.randn(n, dtype=torch.float64)).float()
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current resident set
m = metrics.tensor_metrics(g, t)
print(json.dumps({"extra": status("VmHWM") - before, "rel_l2": m["rel_l2"]}))
"""

EMBEDDING_8B = 151936 * 4096


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", type=int, default=1 << 26)
    n = ap.parse_args().elements
    res = {}
    for name, one in (("one pass", "1"), ("by chunks", "0")):
        p = subprocess.run([sys.executable, "-c", CHILD, str(n), one], capture_output=True, text=True, check=True)
        res[name] = json.loads(p.stdout)
    f64 = 8 * n
    print(f"tensor_metrics on {n} elements (truth float64 {f64 / 2**30:.2f} GiB, gradient float32 {f64 / 2 / 2**30:.2f} GiB)")
    for name, r in res.items():
        x = r["extra"] / f64
        # one pass: its temporaries scale with the tensor; by chunks: a few chunks, whatever the tensor
        at8b = x * 8 * EMBEDDING_8B if name == "one pass" else r["extra"]
        print(f"  {name:<10} peak above the inputs {r['extra'] / 2**30:6.2f} GiB = {x:4.2f}x the truth's size; "
              f"at the 8B embedding about {at8b / 2**30:5.1f} GiB  (rel_l2 {r['rel_l2']:.6e})")
    a, b = (res[k]["extra"] for k in res)
    print(f"  by chunks / one pass: {b / a:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
