"""judge's ETA against each stage's real time, on the embedded tiny Qwen3-VL packed with 1..N samples.

    python benchmarks/judge_eta.py [--samples 1,24,96] [--ensemble 2] [--busy 0,1]

For each sample count: one packed step (the embedded sample, one image and one exchange, N times)
captured in amp-bf16 and in fp32 on this CPU, then ``oracle judge`` on the two (the demo's pair, in
memory), once per ``--busy`` count: that many more cores kept busy by spinning processes while the
judge runs (``--busy 1`` on 2 cores: the replays' two threads slow 3-9x, the planner's one 1.5x).
Printed per stage: the real wall time, the estimate the stage's start line gave (``eta.py``: the plan's
FLOPs, the probe, the calibration of the stage before), their ratio and whether it meets the target:
a replay stage (truth, bands) within 2x of its real time; score and report (reading, writing, drawing:
2-3x slower under load than the replays slow down) within 3x, or within 3 s when both are under 5 s.
Also the probe (the planner's wall time on the capture) and the step's attention calls (``plan``'s
count: segments x attention modules). This was tests/integration/test_judge_eta.py's check (issue 42:
it failed at load 5-12, a band 205 s against 46 s estimated); it is a benchmark because its outcome
depends on the machine's load (a job starting between two stages moves one stage 2x, which no estimate
made before the stage can know): run it quiet, read the ratios, not the seconds. The suite keeps what is
deterministic: the attention calls counted and priced in probes
(tests/integration/test_messages.py::test_judge_estimates_count_each_packed_samples_attention_calls), the
GEMM price from one probe and the fixed cost in probes (the two tests after it), and the calibration after
each stage on a planted clock (tests/unit/test_eta_logic.py).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from oracle import recipe as recipes
from oracle.bundle.store import Bundle
from oracle.capture.steps import capture_recipe_step
from oracle.pipeline.judge import Judge
from oracle.replay.streaming.plan import plan

MODEL = "tiny-qwen3-vl"


def within_target(stage: str, real: float, said: float) -> bool:
    """A replay stage within 2x of its real time; score and report within 3x, or 3 s when both are under 5 s."""
    k = 2 if stage == "truth" or stage.startswith("band-") else 3
    return (max(real, said) < 5 and abs(real - said) <= 3) or said / k <= real <= k * said


def judged(caps: list[Path], out: Path, ensemble: int, busy: int) -> Judge:
    """``oracle judge`` of the two captures in this process, ``busy`` more cores spinning meanwhile."""
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        j = Judge(caps[0], caps[1], out=out, ensemble=ensemble, echo=lambda s: None)
        j.run()
    finally:
        for p in spin:
            p.kill()
            p.wait()
    return j


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", default="1,24,96")
    ap.add_argument("--ensemble", type=int, default=2)
    ap.add_argument("--busy", default="0", help="comma-separated counts of cores kept busy during the judge, e.g. 0,1")
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
            for busy in (int(x) for x in a.busy.split(",")):
                j = judged(caps, Path(tmp) / f"judge-{n}-busy{busy}", a.ensemble, busy)
                for stage, real, said in j.progress.timed:
                    rows.append((n, busy, calls, j.probe_s, stage, real, said))
    print(f"{'samples':>7} {'busy':>4} {'attn calls':>10} {'probe s':>8}  {'stage':<16} {'real s':>8} {'estimate s':>10}"
          f" {'estimate/real':>13}  target")  # fmt: skip
    worst, missed = 1.0, 0
    for n, busy, calls, probe, stage, real, said in rows:
        ratio = said / real
        worst = max(worst, ratio, 1 / ratio)
        ok = within_target(stage, real, said)
        missed += not ok
        print(f"{n:>7} {busy:>4} {calls:>10} {probe:>8.3f}  {stage:<16} {real:>8.2f} {said:>10.2f} {ratio:>13.2f}  {'met' if ok else 'MISSED'}")
    print(f"worst estimate off by {worst:.2f}x over every stage; {missed} of {len(rows)} stages missed the target "
          "(replay stages within 2x, score and report within 3x or 3 s)")  # fmt: skip


if __name__ == "__main__":
    main()
