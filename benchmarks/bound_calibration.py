"""Calibration of the analytic round-off bound (oracle/score/bound.py) against measured noise bands.

    python benchmarks/bound_calibration.py [--layers 4 12] [--members 4] [--precisions bf16 amp-bf16]

For each depth L: the embedded tiny Qwen3 (text) with ``num_hidden_layers = L`` (seeded weights,
``replays.tiny.tiny_weights``), one step of its default sample captured in each precision, replayed
in float64 (the truth) and emulated ``--members`` times per precision (the band). Printed per layer
(backward order, loss end first): n (layers the backward has passed, bound.py's exponent), the
smallest and the largest member's rel L2 against the truth, the capture's own rel L2, all in units of
u (the precision's unit round-off), and the analytic bound k * C^n (in u). Last: per precision the
growth fitted through the members' largest error per decoder layer (log-linear least squares over n),
and the largest ratio of a member's error to the bound (<= 1: the bound covers every honest member).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

from oracle import precision as precisions
from oracle import recipe as recipes
from oracle.capture.steps import capture_recipe_step
from oracle.recipe import ModelSource
from oracle.replay.run import replay
from oracle.score.bound import C, K, depth_of, exponents
from oracle.score.scorer import score


def source(layers: int) -> ModelSource:
    from oracle_replays.tiny import tiny_weights

    r = recipes.for_model("tiny-qwen3")
    src = r.load("tiny-qwen3")
    cfg = {**src.config, "num_hidden_layers": layers}
    return ModelSource(r, cfg, tiny_weights(r.build, cfg), f"tiny-qwen3 with {layers} layers", src.extra)


def measure(layers: int, members: int, precs: list[str], root: Path) -> list[dict]:
    src = source(layers)
    sample = src.recipe.default_sample()
    caps = {p: capture_recipe_step(src, sample, str(root / f"cap-{p}"), precision=p) for p in precs}
    truth = replay(caps[precs[0]], root / "truth", dtype="fp64", verify="off")
    bands = [replay(caps[p], root / f"band-{p}", dtype=p, ensemble=members, verify="off") for p in precs]
    res = score(truth, [caps[p] for p in precs], band_paths=bands, names=precs)
    out = []
    for c in res["captures"]:
        u = precisions.get(c["precision"]).unit_roundoff
        labels = [r["name"] for r in c["layers"]]
        ns = exponents(labels, depth_of(labels))
        rows = [{"layer": r["name"], "n": ns[r["name"]], "low": r["band_low"] / u, "high": r["band"] / u,
                 "capture": r["rel_l2"] / u, "bound": K * C ** ns[r["name"]]} for r in c["layers"]]  # fmt: skip
        out.append({"L": layers, "precision": c["precision"], "rows": rows})
    return out


def fit_growth(rows: list[dict]) -> float:
    """exp(slope) of log(high) against n over the decoder layers: the measured per-layer growth."""
    pts = [(r["n"], math.log(r["high"])) for r in rows if r["layer"].startswith("layers.")]
    if len(pts) < 2:
        return math.nan
    mx = sum(n for n, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return math.exp(sum((n - mx) * (y - my) for n, y in pts) / sum((n - mx) ** 2 for n, _ in pts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 12])
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--precisions", nargs="+", default=["bf16", "amp-bf16"])
    a = ap.parse_args()
    print(f"bound: k = {K:g}, C = {C:g}; every number below in units of u (bf16: 2^-8)")
    for L in a.layers:
        with tempfile.TemporaryDirectory() as tmp:
            for m in measure(L, a.members, a.precisions, Path(tmp)):
                print(f"\nL = {m['L']}, {m['precision']}: {a.members} emulated members")
                print(f"  {'layer':<14} {'n':>3} {'min member':>10} {'max member':>10} {'capture':>9} {'bound':>8}")
                for r in m["rows"]:
                    print(f"  {r['layer']:<14} {r['n']:>3} {r['low']:>10.2f} {r['high']:>10.2f} {r['capture']:>9.2f} {r['bound']:>8.2f}")
                worst = max(max(r["high"], r["capture"]) / r["bound"] for r in m["rows"])
                print(f"  growth per decoder layer (fit of the max member): {fit_growth(m['rows']):.3f}; "
                      f"largest honest error / bound: {worst:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
