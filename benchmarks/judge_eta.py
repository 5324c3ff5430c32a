"""judge's ETA against each stage's real time, on the embedded tiny Qwen3-VL packed with 1..N samples.

    python benchmarks/judge_eta.py [--samples 1,24,96] [--ensemble 2]

For each sample count: one packed step (the embedded sample, one image and one exchange, N times)
captured in amp-bf16 and in fp32 on this CPU, then ``oracle judge`` on the two (the demo's pair, in
memory). Printed per stage: the real wall time, the estimate the stage's start line gave
(``eta.py``: the plan's FLOPs, the probe, the calibration of the stage before) and their ratio; the
issue's target is an estimate within 2x of the real time. Also the probe (the planner's wall time
on the capture) and the step's attention calls (``plan``'s count: segments x attention modules).
The machine is shared: run it quiet, and read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from oracle import recipe as recipes
from oracle.bundle.store import Bundle
from oracle.capture.steps import capture_recipe_step
from oracle.pipeline.judge import Judge
from oracle.replay.streaming.plan import plan

MODEL = "tiny-qwen3-vl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", default="1,24,96")
    ap.add_argument("--ensemble", type=int, default=2)
    a = ap.parse_args()
    r = recipes.for_model(MODEL)
    src, base = r.load(MODEL), r.default_sample()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in a.samples.split(",")):
            caps = []
            for prec in ("amp-bf16", "fp32"):
                path = Path(tmp) / f"{n}-{prec}"
                capture_recipe_step(src, [base] * n, str(path), precision=prec)
                caps.append(path)
            calls = plan(Bundle(caps[0]), "fp64", streamed=False)["attention_calls"]
            j = Judge(caps[0], caps[1], out=Path(tmp) / f"judge-{n}", ensemble=a.ensemble, echo=lambda s: None)
            j.run()
            for stage, real, said in j.progress.timed:
                rows.append((n, calls, j.probe_s, stage, real, said))
    print(
        f"{'samples':>7} {'attn calls':>10} {'probe s':>8}  {'stage':<16} {'real s':>8} {'estimate s':>10} {'estimate/real':>13}"
    )
    worst = 1.0
    for n, calls, probe, stage, real, said in rows:
        ratio = said / real
        worst = max(worst, ratio, 1 / ratio)
        print(f"{n:>7} {calls:>10} {probe:>8.3f}  {stage:<16} {real:>8.2f} {said:>10.2f} {ratio:>13.2f}")
    print(f"worst estimate off by {worst:.2f}x over every stage (target: within 2x)")


if __name__ == "__main__":
    main()
