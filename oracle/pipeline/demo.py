"""The main job on the embedded default: one step of the tiny Qwen3-VL captured twice on this
CPU (autocast bf16, and fp32 -- the same weights and inputs), replayed once in float64, an
emulated noise band for each precision, then scored. Both captures are CPU runs standing in for
two devices; on real hardware run ``oracle capture --device cuda|npu`` on each machine instead.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .. import recipe as recipes
from ..capture.steps import capture_recipe_step
from ..replay.run import replay
from ..report.files import write_report
from ..report.text import render
from ..score.scorer import score

MODEL = "tiny-qwen3-vl"


def run_demo(out: str | Path, *, ensemble: int = 4, echo: Callable[[str], None] = print) -> str:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    r = recipes.for_model(MODEL)
    src = r.load(MODEL)
    sample = r.default_sample()
    caps = []
    for prec in ("amp-bf16", "fp32"):
        path = out / f"capture-{prec}"
        capture_recipe_step(src, sample, str(path), precision=prec, overwrite=True)
        caps.append(path)
        echo(f"captured {MODEL} on cpu in {prec} -> {path}")
    oracle = replay(caps[0], out / "oracle", dtype="fp64", overwrite=True)
    echo(f"replayed in float64 -> {oracle}")
    bands = []
    for prec in ("amp-bf16", "fp32"):
        bands.append(replay(caps[0], out / f"band-{prec}", dtype=prec, ensemble=ensemble, overwrite=True))
        echo(f"emulated {ensemble} honest {prec} runs (noise band) -> {bands[-1]}")
    result = score(oracle, caps, band_paths=bands, names=["cpu-amp-bf16", "cpu-fp32"])
    page = write_report(result, out / "report")
    return (
        render(result, top=5, max_layers=12) + f"\n\nreport: {page}\n(both captures are CPU runs of the embedded tiny Qwen3-VL)"
    )
