"""Detection limits of the referee, measured: the smallest planted error it flags.

    python benchmarks/detection_limits.py [--precisions fp32 bf16 amp-bf16] [--sizes 1e-4 1e-3 1e-2 1e-1]
                                          [--seeds 3] [--members 3]

For each precision: one honest capture of the tiny Qwen3-VL gives the oracle (float64) and an
emulated band (``--members``). Then per seed a module is drawn at random among the recorded ones
(decoder sublayers, ViT blocks, mergers) and, per size s, a capture is taken with one fault planted
there:
    forward   the module's output y becomes y * (1 + s r), r = +-1 per element (seeded)
    backward  inside the module, the gradient its output receives g becomes g * (1 + s r) before
              the module's own backward uses it (the recorded grad_output is the unperturbed g)
so the planted perturbation has relative L2 size s. Each faulty capture is scored end to end
(against the band: flagged = verdict not within noise) and by local replay (flagged = the planted
module, or its parent/child, is the top culprit with the right direction). Printed per precision
and direction: the smallest s flagged for every seed, end to end and locally.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch

from oracle import recipe as recipes
from oracle.bundle.store import Bundle
from oracle.capture.steps import capture_recipe_step
from oracle.replay.local import replay_local
from oracle.replay.run import replay
from oracle.score.local import score_local
from oracle.score.scorer import score

MODULES = r"layers\.\d+\.(self_attn|mlp)$|visual\.blocks\.\d+$|visual\.merger$"


def _noise(t: torch.Tensor, s: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 2, t.shape, generator=g).to(t.dtype).mul_(2).sub_(1)
    return t * (1 + s * r.to(t.device))


def plant(path: str, direction: str, s: float, seed: int):
    def first(x):
        return x[0] if isinstance(x, tuple) else x

    def fwd(m, a, out):
        y = _noise(first(out), s, seed)
        return (y, *out[1:]) if isinstance(out, tuple) else y

    class Perturb(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return _noise(g, s, seed)

    def bwd(m, a, out):
        y = Perturb.apply(first(out))
        return (y, *out[1:]) if isinstance(out, tuple) else y

    def instrument(model):
        model.get_submodule(path).register_forward_hook(fwd if direction == "forward" else bwd)

    return instrument


def related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "amp-bf16"])
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e-4, 1e-3, 1e-2, 1e-1])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--members", type=int, default=3)
    a = ap.parse_args()
    src = recipes.for_model("tiny-qwen3-vl").load("tiny-qwen3-vl")
    sample = src.recipe.default_sample()
    root = Path(tempfile.mkdtemp())
    rows = []
    for prec in a.precisions:
        honest = capture_recipe_step(src, sample, str(root / f"{prec}-honest"), precision=prec, modules=MODULES)
        oracle = replay(honest, root / f"{prec}-oracle", verify="off")
        band = replay(honest, root / f"{prec}-band", dtype=prec, ensemble=a.members)
        names = sorted(Bundle(honest).manifest["modules"])
        for direction in ("forward", "backward"):
            smallest = {"end to end": [], "local": []}
            for seed in range(a.seeds):
                module = random.Random(f"{prec}-{direction}-{seed}").choice(names)
                hit = {"end to end": None, "local": None}
                for s in sorted(a.sizes):
                    tag = f"{prec}-{direction}-{seed}-{s:g}"
                    cap = capture_recipe_step(src, sample, str(root / tag), precision=prec, modules=MODULES,
                                              instrument=plant(module, direction, s, seed))  # fmt: skip
                    if hit["end to end"] is None:
                        v = score(oracle, [cap], band_paths=[band])["captures"][0]["verdict"]
                        if v["class"] != "within_noise":
                            hit["end to end"] = s
                    if hit["local"] is None:
                        res = score_local(replay_local(cap, root / f"{tag}.local", members=a.members))
                        top = res["verdict"]
                        if top["culprit"] and related(top["culprit"], module) and top["direction"] == direction:
                            hit["local"] = s
                    if all(v is not None for v in hit.values()):
                        break
                print(f"  {prec:8} {direction:8} seed {seed} {module:45} end to end {hit['end to end']}, local {hit['local']}",
                      flush=True)  # fmt: skip
                for k in hit:
                    smallest[k].append(hit[k])
            rows.append((prec, direction, *[_worst(smallest[k]) for k in ("end to end", "local")]))
    print()
    print(f"{'precision':10} {'fault':9} {'end to end':>11} {'local':>11}   (smallest relative size flagged for every seed)")
    for prec, direction, e2e, loc in rows:
        print(f"{prec:10} {direction:9} {e2e:>11} {loc:>11}")


def _worst(hits: list[float | None]) -> str:
    return "not seen" if any(h is None for h in hits) else f"{max(hits):g}"


if __name__ == "__main__":
    main()
