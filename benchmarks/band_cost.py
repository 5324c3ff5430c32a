"""What the noise band costs next to the float64 truth, and how many members it needs, side by side in one run.

    python benchmarks/band_cost.py [--layers 8] [--hidden 512] [--tokens 1024] [--members 4] [--precision bf16]

The embedded Qwen3 (text) architecture widened to ``--hidden`` (intermediate 3x, head_dim 64, GQA 2:1),
``--layers`` decoder layers, seeded weights (``replays.tiny.tiny_weights``), one packed-free sample of
about ``--tokens`` byte tokens. One step is captured in ``--precision``, then, alternating, twice each
(the medians are printed): the float64 truth (in memory, no certificate), the round-to-nearest member alone
and the emulated band with ``--members`` members (1 round-to-nearest + jittered ones, oracle/precision/mode.py).

Printed:
  - wall time of the truth and of the band, the band's cost per member, the round-to-nearest member's and
    a jittered member's (the band less the round-to-nearest one) against the truth, and the band's cost with
    K = 1..members members as a multiple of the truth's (K x the per-member cost / truth);
  - how much of the band K members already give: per layer, band_K / band_members (the band is the
    max over members of each member's rel L2 against the truth, score/scorer.py), its smallest value
    and median over the layers, and the largest excess (capture's rel L2 / band) the capture reaches
    with K members (a smaller band can only raise it; an honest run stays far under the margin, 3).
  - the planner's price of one member over the truth's (``judge --dry-run`` uses it), beside the measured one.
Ratios are the result (this machine is shared and noisy), not absolute times.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from oracle import recipe as recipes
from oracle.bundle.store import Bundle
from oracle.capture.steps import capture_recipe_step
from oracle.recipe import ModelSource
from oracle.replay.run import replay
from oracle.replay.streaming.plan import plan
from oracle.score.scorer import score
from oracle.score.tolerance import MARGIN

WORDS = ("the gradient of a layer is the product of what came in and what goes back out, "
         "rounded at every step where a device writes a number in sixteen bits. ")  # fmt: skip


def source(layers: int, hidden: int) -> ModelSource:
    from oracle_replays.tiny import tiny_weights

    r = recipes.for_model("tiny-qwen3")
    src = r.load("tiny-qwen3")
    heads = max(2, hidden // 64)
    cfg = {**src.config, "num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": 3 * hidden,
           "num_attention_heads": heads, "num_key_value_heads": heads // 2, "head_dim": 64,
           "max_position_embeddings": 32768}  # fmt: skip
    return ModelSource(r, cfg, tiny_weights(r.build, cfg), f"qwen3 {layers} x {hidden}", src.extra)


def sample(tokens: int) -> dict:
    text = (WORDS * (tokens // len(WORDS) + 1))[: max(16, tokens - 40)]
    half = len(text) // 2
    return {"messages": [{"role": "user", "content": text[:half]}, {"role": "assistant", "content": text[half:]}]}


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--precision", default="bf16")
    a = ap.parse_args()
    src = source(a.layers, a.hidden)
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        cap = capture_recipe_step(src, sample(a.tokens), str(root / "cap"), precision=a.precision)
        truth_t, band_t, rtn_t = [], [], []
        for i in range(2):  # alternating, so a load change on the machine hits all alike
            truth_t.append(timed(lambda i=i: replay(cap, root / f"truth{i}", dtype="fp64", verify="off")))
            rtn_t.append(timed(lambda i=i: replay(cap, root / f"rtn{i}", dtype=a.precision, verify="off")))
            band_t.append(timed(lambda i=i: replay(cap, root / f"band{i}", dtype=a.precision, ensemble=a.members, verify="off")))
        truth, band, rtn = statistics.median(truth_t), statistics.median(band_t), statistics.median(rtn_t)
        member = band / a.members
        res = score(root / "truth0", [cap], band_paths=[root / "band0"], names=[a.precision])
        layers = res["captures"][0]["layers"]
        print(f"step: {src.origin}, {a.precision} capture, {a.members} band members")
        print(f"truth (float64, in memory): {truth:.2f} s; band ({a.members} members): {band:.2f} s; "
              f"one member = {member / truth:.2f}x the truth")  # fmt: skip
        if a.members > 1:  # the band less its round-to-nearest member (timed alone) is the jittered ones
            print(f"round-to-nearest member alone: {rtn:.2f} s = {rtn / truth:.2f}x the truth; a jittered member "
                  f"{(band - rtn) / (a.members - 1) / truth:.2f}x the truth")  # fmt: skip
        p64, pm = (plan(Bundle(cap), d, streamed=False) for d in ("fp64", a.precision))
        print(f"planner (what judge --dry-run prices): one member = {pm['estimated_seconds'] / p64['estimated_seconds']:.2f}x "
              f"the truth (float32 probe x {pm['efficiency']} against float64 probe x {p64['efficiency']}; FLOPs only, "
              "no fixed costs: meaningful at hidden >= 1024)")  # fmt: skip
        print(" K  band cost / truth   band_K / band_all: min  median   largest excess (capture / band_K)")
        for k in range(1, a.members + 1):
            ratios, excess = [], []
            for row in layers:
                ms = row["members"]
                bk, ball = max(ms[:k]), max(ms)
                ratios.append(bk / ball)
                excess.append((row["rel_l2"] / max(bk, 1e-300), row["name"]))
            worst = max(excess)
            print(f"{k:2d}  {k * member / truth:17.2f}   {min(ratios):27.2f}  {statistics.median(ratios):6.2f}   "
                  f"{worst[0]:11.2f} at {worst[1]} (margin {MARGIN:g})")  # fmt: skip
        print("per layer (backward order): the capture's rel L2 and each member's")
        for row in layers:
            print(f"  {row['name']:<24} {row['rel_l2']:.3e}   " + " ".join(f"{m:.3e}" for m in row["members"]))


if __name__ == "__main__":
    main()
