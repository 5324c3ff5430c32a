"""What the oracle costs next to the step it checks, measured side by side in one run.

    python benchmarks/replay_cost.py [--model tiny-qwen3-vl] [--repeat 3]

Prints the median wall time of: a plain fp32 step (forward + backward), the same step through
PrecisionMode(float32) (the dispatch overhead alone), the float64 oracle step, the emulated
amp-bf16 and bf16 steps, and their ratios to the plain fp32 step. Ratios, not absolute times,
are the result: this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from oracle import recipe as recipes
from oracle.bundle.store import Bundle
from oracle.capture.steps import build_model, capture_recipe_step
from oracle.precision.mode import PrecisionMode
from oracle.replay.run import run_step


def timed(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-qwen3-vl")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    r = recipes.for_model(a.model)
    src = r.load(a.model)
    with tempfile.TemporaryDirectory() as d:
        cap = Bundle(capture_recipe_step(src, r.default_sample(), f"{d}/cap"))
        model = build_model(r, src.config, src.weights, torch.float32)
        inputs = {n: t for n, t in cap.iter_group("inputs")}

        def plain(mode=None):
            model.zero_grad(set_to_none=True)
            if mode is None:
                r.forward_loss(model, inputs, "mean")[0].backward()
            else:
                with mode:
                    r.forward_loss(model, inputs, "mean")[0].backward()

        rows = {
            "fp32 step (plain)": timed(plain, a.repeat),
            "fp32 step in PrecisionMode": timed(lambda: plain(PrecisionMode(torch.float32)), a.repeat),
            "fp64 oracle step (incl. build)": timed(lambda: run_step(cap, "fp64"), a.repeat),
            "emulated amp-bf16 step (incl. build)": timed(lambda: run_step(cap, "amp-bf16"), a.repeat),
            "emulated bf16 step (incl. build)": timed(lambda: run_step(cap, "bf16"), a.repeat),
        }
    base = rows["fp32 step (plain)"]
    print(f"{a.model}, {sum(t.numel() for t in src.weights.values())} parameters, torch threads {torch.get_num_threads()}")
    for k, v in rows.items():
        print(f"  {k:<40} {v * 1e3:8.1f} ms   {v / base:6.2f}x")


if __name__ == "__main__":
    main()
