"""The truth and the noise band at the user's sample length, the attention through torch's flash kernel against
the Python loop it replaced (issue 43), side by side in one run.

    python benchmarks/long_samples.py [--tokens 16384] [--layers 2] [--hidden 2048] [--members bf16] [--ensemble 2]
                                      [--kernels flash,loop]

The embedded Qwen3 (text) widened as benchmarks/band_cost.py does (head_dim 64, GQA 2:1, intermediate 3x), one
sample of about ``--tokens`` tokens (the user's 65536-token step packs 4 of 16384: there the attention is a
quarter of the FLOPs), captured in bf16. Each replay streamed at 16G, in this order, for each of ``--kernels``: the
float64 truth, then the ``--members`` band of ``--ensemble`` members (1 round-to-nearest + jittered ones, as
``replay --ensemble`` runs it); the loop forced by ``attention_flash.usable`` returning False in that replay's
process. Printed: each one's wall time, its FLOPs over its time against its own dtype's GEMM probe (taken before
it; a band's FLOPs are its members'), and flash against loop; the dry run's time (``plan``, its own probe) against
each flash replay's; the band's time over the truth's.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

RUN = """
import sys, time, torch
from oracle.replay import attention_flash
from oracle.replay.run import replay
if sys.argv[4] == "loop":
    attention_flash.usable = lambda q, k: False
t = time.perf_counter()
replay(sys.argv[1], sys.argv[2], dtype=sys.argv[3], verify="off", max_memory=16 << 30, ensemble=int(sys.argv[5]))
print(time.perf_counter() - t)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--members", default="bf16")
    ap.add_argument("--ensemble", type=int, default=2)
    ap.add_argument("--kernels", default="flash,loop")
    a = ap.parse_args()
    import torch
    from band_cost import sample, source

    from oracle.bundle.store import Bundle
    from oracle.capture.steps import capture_recipe_step
    from oracle.replay.streaming.plan import gemm_rate, plan

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        t = time.perf_counter()
        cap = capture_recipe_step(source(a.layers, a.hidden), sample(a.tokens), str(root / "cap"), precision="bf16")
        print(f"Qwen3 text {a.layers} x {a.hidden}, captured in bf16 in {time.perf_counter() - t:.0f} s", flush=True)
        seconds, kernels = {}, a.kernels.split(",")
        for dtype in ("fp64", a.members):
            priced = plan(Bundle(cap), dtype, streamed=True)
            runs = 1 if dtype == "fp64" else a.ensemble
            flops = priced["total_flops"] * runs
            for kernel in kernels:
                rate = gemm_rate(reps=15, dtype=torch.float64 if dtype == "fp64" else torch.float32)
                out = subprocess.run([sys.executable, "-c", RUN, str(cap), str(root / f"{dtype}-{kernel}"), dtype, kernel, str(runs)],
                                     capture_output=True, text=True, cwd=ROOT, check=True)  # fmt: skip
                s = seconds[dtype, kernel] = float(out.stdout.split()[-1])
                what = "truth" if dtype == "fp64" else f"band of {runs}"
                print(f"   {dtype:<5} {what:<10} {kernel:<6} {s:7.1f} s, {flops / s / 1e9:6.1f} GFLOP/s = {flops / s / rate:.2f}x "
                      f"of its probe ({rate / 1e9:.1f})" + (f"; the dry run priced it {priced['estimated_seconds'] * runs / s:.2f}x of that"
                                                            if kernel == "flash" else ""), flush=True)  # fmt: skip
        if "loop" in kernels and "flash" in kernels:
            for dtype in ("fp64", a.members):
                print(f"{dtype}: the flash kernel's replay {seconds[dtype, 'loop'] / seconds[dtype, 'flash']:.2f}x the loop's speed")
        for kernel in kernels:
            print(f"{kernel}: the {a.members} band of {a.ensemble} = {seconds[a.members, kernel] / seconds['fp64', kernel]:.2f}x "
                  "the truth's time")  # fmt: skip

if __name__ == "__main__":
    main()
