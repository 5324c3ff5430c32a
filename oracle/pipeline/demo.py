"""The main job on the embedded default: one step of the tiny Qwen3-VL captured twice on this
CPU (autocast bf16, and fp32 -- the same weights and inputs), then ``oracle judge`` on the two:
replayed once in float64, an emulated noise band for each precision, scored, and answered in the
judge report's four questions. Both captures are CPU runs standing in for two devices; on real
hardware run ``oracle capture --device cuda|npu`` on each machine instead.

``bug=True`` plants a bug in the fp32 run: the gradient entering decoder layer ``BUG_LAYER``'s MLP
is scaled by ``BUG_SCALE`` in the backward (the forward, and so the loss, untouched) -- what a
wrong backward kernel does. The same report then names that run, that layer's MLP, the backward
and the op class (a scale: ``scaling``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from .. import recipe as recipes
from ..capture.steps import capture_recipe_step
from ..errors import OutputExists
from ..report.judge import MORE_IN_REPORT, render_answers
from ..report.text import render
from .judge import Judge

MODEL = "tiny-qwen3-vl"
BUG_LAYER, BUG_SCALE = 1, 1.02
BUG_MODULE = f"model.language_model.layers.{BUG_LAYER}.mlp"
RUNS = (("cpu-amp-bf16", "amp-bf16"), ("cpu-fp32", "fp32"))
PARTS = frozenset([f"capture-{prec}" for _, prec in RUNS] + ["judge"])  # all a demo folder holds


def open_dir(out: Path) -> bool:
    """``--dir`` new, empty or a previous demo's (True: its captures are replaced, its judge stages
    reused where their inputs are the same); anything else is refused untouched (exit 6)."""
    if os.path.lexists(out) and (out.is_symlink() or not out.is_dir()):
        raise OutputExists(f"--dir {out} exists and is not a folder; choose another --dir (nothing was written)")
    names = {p.name for p in out.iterdir()} if out.is_dir() else set()
    stray = sorted(names - PARTS)
    if stray:
        raise OutputExists(f"--dir {out} holds files that are not a demo's ({', '.join(stray[:3])}); "
                           "nothing was written into it; choose a new or empty --dir")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    return bool(names)


def plant_bug(model) -> None:
    """Scale the gradient arriving at ``BUG_MODULE``'s output (its grad_output) by ``BUG_SCALE``."""
    model.get_submodule(BUG_MODULE).register_full_backward_pre_hook(
        lambda m, go: tuple(g * BUG_SCALE if g is not None else g for g in go)
    )


def run_demo(out: str | Path, *, ensemble: int = 4, bug: bool = False, echo: Callable[[str], None] = print) -> str:
    out = Path(out)
    if open_dir(out):
        echo(f"replacing the previous demo's captures in {out} (its judge stages are redone where their inputs changed)")
    r = recipes.for_model(MODEL)
    src = r.load(MODEL)
    sample = r.default_sample()
    caps = []
    for _name, prec in RUNS:
        path = out / f"capture-{prec}"
        planted = bug and prec == "fp32"
        capture_recipe_step(src, sample, str(path), precision=prec, overwrite=True, instrument=plant_bug if planted else None)
        caps.append(path)
        echo(f"captured {MODEL} on cpu in {prec} -> {path}" + (
            f" (bug planted: the gradient into {BUG_MODULE} x{BUG_SCALE} in the backward)" if planted else ""))
    doc = Judge(caps[0], caps[1], out=out / "judge", names=[n for n, _ in RUNS], ensemble=ensemble, echo=echo).run()
    return "\n".join([
        render(doc["score"], top=5, max_layers=12, more_in=MORE_IN_REPORT), "",
        f"report: {doc['report_files']['html']} (text {doc['report_files']['text']})",
        "(both captures are CPU runs of the embedded tiny Qwen3-VL" + (", the fp32 one with a planted bug)" if bug else ")"), "",
        render_answers(doc),
    ])  # fmt: skip
