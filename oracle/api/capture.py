"""``oracle capture`` as a library call: ``capture(CaptureOptions(...))`` takes one step of one
sample (or of several packed into one sequence) and writes the capture bundle. Which sample lines,
packed how, and whether the device is there are decided in ``CaptureOptions``, once."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import RecipeError, UsageError

Echo = Callable[[str], None]
DEVICES = ("cpu", "cuda", "npu")


def check_device(device: str) -> None:
    """The device exists here: CUDA visible to torch, torch_npu importable."""
    if device not in DEVICES:
        raise UsageError(f"--device {device!r}: expected one of {', '.join(DEVICES)}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RecipeError("--device cuda: no CUDA device is visible to torch")
    if device == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            raise RecipeError("--device npu: torch_npu is not installed") from None


def sample_lines(index: str, pack: int | None) -> list[int]:
    """``--index 3`` -> [3]; ``--index 0,3,7`` -> [0, 3, 7]; ``--index 4 --pack 3`` -> [4, 5, 6]."""
    try:
        indices = [int(i) for i in str(index).split(",")]
    except ValueError:
        raise UsageError(f"--index {index!r}: expected a line number or a comma-separated list (0,3,7)") from None
    if pack is not None:
        if len(indices) > 1:
            raise UsageError("give either --index 0,3,7 or --index N --pack K, not both lists")
        if pack < 1:
            raise UsageError(f"--pack {pack}: expected a whole number >= 1")
        indices = list(range(indices[0], indices[0] + pack))
    if any(i < 0 for i in indices):
        raise UsageError(f"--index {index!r}: line numbers start at 0")
    return indices


@dataclass(frozen=True)
class CaptureOptions:
    out: str
    model: str = "tiny-qwen3-vl"
    sample: str | None = None  #: an ms-swift style .jsonl; None: the recipe's embedded sample
    index: str = "0"
    pack: int | None = None
    device: str = "cpu"
    precision: str = "fp32"
    loss_reduction: str = "mean"
    seed: int = 0
    modules: str | None = None
    budget_mb: float | None = None
    overwrite: bool = False

    def __post_init__(self) -> None:
        for f in ("out", "sample"):
            v = getattr(self, f)
            if v is not None:
                object.__setattr__(self, f, os.fspath(v))
        lines = sample_lines(self.index, self.pack)
        if self.sample is None and len(lines) > 1:
            raise UsageError("packing needs --sample (a .jsonl with several samples)")
        if self.sample is None and lines != [0]:  # the embedded sample is one: --index 1 would capture it all the same
            raise UsageError(f"--index {self.index} picks a line of --sample; without --sample the recipe's one embedded "
                             "sample is captured: give --sample FILE.jsonl, or leave --index out")  # fmt: skip

    @property
    def lines(self) -> list[int]:
        return sample_lines(self.index, self.pack)


def capture(opts: CaptureOptions, echo: Echo = print) -> int:
    """One step as ``opts`` says, written to ``opts.out``; prints what it captured."""
    from .. import recipe
    from ..bundle.store import Bundle, check_not_input
    from ..capture.samples import read_sample
    from ..capture.steps import capture_recipe_step

    check_device(opts.device)
    check_not_input(opts.out, [m for m in (opts.model, opts.sample) if m and os.path.exists(m)])  # a model folder or sample
    r = recipe.for_model(opts.model)
    src = r.load(opts.model)
    smp = [read_sample(opts.sample, i) for i in opts.lines] if opts.sample else [r.default_sample()]
    capture_recipe_step(src, smp[0] if len(smp) == 1 else smp, opts.out, precision=opts.precision, device=opts.device,
                        reduction=opts.loss_reduction, seed=opts.seed, overwrite=opts.overwrite, modules=opts.modules,
                        module_budget_mb=opts.budget_mb, echo=echo)  # fmt: skip
    b = Bundle(opts.out)
    echo(f"captured {r.name} ({src.origin}) on {opts.device} in {opts.precision}: loss {b.get('loss')['value']:.8g} "
         f"over {b.get('loss')['num_tokens']} tokens, {len(b.names('grads'))} gradients -> {opts.out}")  # fmt: skip
    return 0
