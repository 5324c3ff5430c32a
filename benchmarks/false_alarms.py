"""False alarms of the calibrated threshold (score/calibrate.py), measured on honest captures.

    python benchmarks/false_alarms.py [--precisions amp-bf16 bf16 fp32] [--samples 4] [--members 2] [--local]

Honest captures of the tiny Qwen3-VL (CPU runs: real autocast, real bf16, fp32), ``--samples`` samples
(the default sample, then its answer replaced; a capture's seed changes nothing here); each is replayed in float64, given the judge's band (``--members`` emulated members, as
``oracle judge --ensemble``) and scored end to end with the default (calibrated) rule; with ``--local``
its decoder layers and ViT blocks are replayed locally too (``--members`` members per module). Printed
per capture: the units judged, the members' spread (sigma), the threshold T, the largest excess of the
honest run (parameter or layer; local row) and whether anything was called; then the false alarms
(runs with any unit called) and the largest honest excess over all captures: the emulation's
fidelity (calibrate.FIDELITY and LOCAL_FIDELITY are set from it).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from oracle import recipe as recipes
from oracle.capture.steps import capture_recipe_step
from oracle.replay.local import replay_local
from oracle.replay.run import replay
from oracle.score.local import score_local
from oracle.score.scorer import score

LOCAL = r"layers\.\d+$|visual\.blocks\.\d+$|visual\.merger$"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precisions", nargs="+", default=["amp-bf16", "bf16", "fp32"])
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--members", type=int, default=2)
    ap.add_argument("--local", action="store_true")
    args = ap.parse_args()
    r = recipes.for_model("tiny-qwen3-vl")
    src, sample = r.load("tiny-qwen3-vl"), r.default_sample()
    answers = ["Squares, red to green.", "A grid of four colours.", "Two squares above, two below, all bright."]
    samples = [sample] + [dict(sample, messages=[*sample["messages"][:-1], {"role": "assistant", "content": a}]) for a in answers]
    runs, alarms, worst = 0, 0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for s, smp in enumerate(samples[: args.samples]):
            for prec in args.precisions:
                for _ in (0,):
                    name = f"s{s}-{prec}"
                    cap = capture_recipe_step(src, smp, str(root / name), precision=prec,
                                              modules=LOCAL if args.local else None)  # fmt: skip
                    orc = replay(cap, root / f"{name}.oracle", verify="off")
                    band = replay(cap, root / f"{name}.band", dtype=prec, ensemble=args.members)
                    c = score(orc, [cap], band_paths=[band])["captures"][0]
                    t = c["threshold"]
                    top = max([*c["params"], *c["layers"]], key=lambda u: u["excess"])
                    called = [u["name"] for u in [*c["params"], *c["layers"]] if u["class"] != "within_noise"]
                    line = (f"{name:<18} e2e: {t['n']:4d} units, sigma {t.get('sigma', float('nan')):.3f}, T {t['value']:.2f}x, "
                            f"largest {top['excess']:.2f}x ({top['name']}), called {len(called)}")  # fmt: skip
                    worst = max(worst, top["excess"])
                    if args.local:
                        loc = score_local(replay_local(cap, root / f"{name}.local", members=args.members))
                        lt = loc["threshold"]
                        ltop = max(loc["modules"], key=lambda m: m["ratio"])
                        line += (f"; local: {lt['n']} rows, T {lt['value']:.2f}x, largest {ltop['ratio']:.2f}x "
                                 f"({ltop['module']}), called {len(loc['culprits'])}")  # fmt: skip
                        called += loc["culprits"]
                        worst = max(worst, ltop["ratio"])
                    runs += 1
                    alarms += bool(called)
                    print(line, flush=True)
    print(f"false alarms: {alarms}/{runs} honest runs (target: at most 1 % of runs); "
          f"largest honest excess over the band: {worst:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
