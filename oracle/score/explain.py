"""Op-level attribution: which class of operations reproduces the error a device made in one module.

``explain(capture, module)`` replays the module alone from the device's own boundary inputs and
grad_outputs (as local.py does) several times, on the float64 model:
    truth        every op in float64
    only(c)      every op in float64 except those of class c, whose operands and results are
                 rounded to the format F (the capture's storage format -- bf16 for bf16/amp-bf16,
                 fp16 for fp16/amp-fp16, fp32 for fp32 -- or ``fmt``)
    except(c)    every op rounded to F except those of class c, kept in float64
    all          every op rounded to F
From each run r the error vector e_r = (r - truth) over the module's outputs, grad_inputs and
parameter gradients, each part divided by the norm of its truth (so forward and backward weigh by
their relative error); e_dev the same for the device's recorded tensors. Per class c:

    share_only(c)   = <e_dev, e_only(c)>^2 / (||e_dev||^2 ||e_only(c)||^2)
                      the share of ||e_dev||^2 that the best multiple of e_only(c) explains (0..1)
    scale_only(c)   = <e_dev, e_only(c)> / ||e_only(c)||^2: how many times class c's honest error
                      in F the device's error is, along that direction
    share_except(c) = the same share for d(c) = e_all - e_except(c), class c's error in the context
                      of everything else rounded

Classes are ranked by share_only (share_except breaks ties). Rounding errors are reproduced where
the device computed on the same values: the attribution finds an op class whose precision
explains the error (an op run in bf16 where fp32 was meant, a softmax accumulated in low
precision), not a fault of another kind (a wrong mask), which shows as no class explaining much.
Classes are aten op families (``OP_CLASSES``); float ops in none of them are ``elementwise``.
Casts that model code asks for explicitly (``.to(bfloat16)``) are rounded in every run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..bundle.store import Bundle
from ..errors import BundleError, UsageError
from ..precision import get as get_precision
from ..precision.mode import PrecisionMode
from ..replay.local import LOSS, _worker

OP_CLASSES: dict[str, set[str]] = {
    "matmul": {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "convolution", "convolution_backward",
               "_convolution"},
    "attention": {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
                  "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
                  "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"},
    "softmax": {"_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data"},
    "normalisation": {"native_layer_norm", "native_layer_norm_backward", "rsqrt", "native_group_norm",
                      "native_group_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward"},
    "activation": {"silu", "silu_backward", "gelu", "gelu_backward", "sigmoid", "sigmoid_backward", "tanh",
                   "tanh_backward", "relu", "threshold_backward"},
    "rotary": {"cos", "sin", "cat", "neg"},
    "reduction": {"sum", "mean", "var", "var_mean", "amax", "amin", "cumsum", "prod", "linalg_vector_norm"},
    "cast": {"_to_copy"},
    "loss": {"nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward", "mse_loss",
             "mse_loss_backward"},
}  # fmt: skip
ELEMENTWISE = "elementwise"
CLASSES = (*OP_CLASSES, ELEMENTWISE)
_CLASS_OF = {op: c for c, ops in OP_CLASSES.items() for op in ops}
_STORAGE = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def op_class(func) -> str:
    return _CLASS_OF.get(func.overloadpacket.__name__, ELEMENTWISE)


class OpClassMode(PrecisionMode):
    """Float64 compute; the ops of ``classes`` get operands and results rounded to ``fmt``."""

    def __init__(self, fmt: torch.dtype, classes: set[str]):
        super().__init__(torch.float64, fmt, "all", device_type="cpu")
        self.classes = set(classes)

    def _rounds(self, func) -> bool:
        return op_class(func) in self.classes and super()._rounds(func)


def _error(run: dict[str, list[torch.Tensor]], truth: dict[str, list[torch.Tensor]]) -> torch.Tensor:
    parts = []
    for k in ("out", "gin", "param"):
        if not truth.get(k) or len(run.get(k, [])) != len(truth[k]):
            continue
        ref = torch.cat([t.double().reshape(-1) for t in truth[k]])
        d = torch.cat([x.double().reshape(-1) for x in run[k]]) - ref
        n = float(ref.norm())
        parts.append(d / n if n > 0 else d)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _share(e_dev: torch.Tensor, e: torch.Tensor) -> tuple[float, float]:
    """(share of ||e_dev||^2 explained by the best multiple of e, that multiple)."""
    ee, dd = float(e @ e), float(e_dev @ e_dev)
    if ee == 0.0 or dd == 0.0:
        return 0.0, 0.0
    dot = float(e_dev @ e)
    return dot * dot / (ee * dd), dot / ee


def explain(capture: str | Path, module: str, *, fmt: str | None = None) -> dict[str, Any]:
    """Rank op classes by how much of the device's error in ``module`` each reproduces (see the
    module docstring for the runs and the formulas)."""
    cap = Bundle(capture)
    recorded = cap.get("modules") or {}
    if cap.kind != "capture" or not recorded:
        how = ("capture the step again with ORACLE_CAPTURE_MODULES=layers beside ORACLE_CAPTURE, then merge it" if cap.get("megatron")
               else f"capture with --modules naming {module!r}")  # fmt: skip
        raise BundleError(f"{cap.path} has no module boundaries; {how}")
    if module not in recorded and not (module == LOSS and "lm_head" in recorded):
        near = ", ".join(sorted(n for n in recorded if module.split(".")[-1] in n)[:5]) or ", ".join(sorted(recorded)[:5])
        raise UsageError(f"module {module!r} was not recorded in {cap.path}; recorded e.g.: {near}")
    precision = cap.get("precision") or "fp32"
    fmt = fmt or _STORAGE[get_precision(precision).round_to or "float64"]  # the format the device stored in
    names = {v: k for k, v in _STORAGE.items()}
    if fmt not in names or fmt == "fp64":
        raise UsageError(f"--as {fmt!r}: choose fp32, bf16 or fp16")
    fdtype = getattr(torch, names[fmt])
    w = _worker(str(cap.path))
    truth = w.run(module, "fp64", None)
    dev = w.device(module, truth.get("param_names", []))
    e_dev = _error(dev, truth)

    def err(classes: set[str]) -> torch.Tensor:
        return _error(w.run(module, "fp64", None, mode=OpClassMode(fdtype, classes)), truth)

    e_all = err(set(CLASSES))
    rows = []
    for c in CLASSES:
        e_only = err({c})
        share, scale = _share(e_dev, e_only)
        share_x, _ = _share(e_dev, e_all - err(set(CLASSES) - {c}))
        rows.append({"class": c, "share_only": share, "scale_only": scale, "share_except": share_x,
                     "rel_only": float(e_only.norm()), "present": float(e_only.norm()) > 0})  # fmt: skip
    rows.sort(key=lambda r: (-r["share_only"], -r["share_except"]))
    top = rows[0]
    dev_rel, all_rel = float(e_dev.norm()), float(e_all.norm())
    if top["share_only"] >= 0.5:
        text = (f"{module}: {top['class']} in {fmt} reproduces {100 * top['share_only']:.0f}% of the device's error "
                f"(the device's error is {top['scale_only']:.2g}x that class's honest {fmt} error along it)")  # fmt: skip
    else:
        text = (f"{module}: no op class in {fmt} reproduces most of the device's error (best {top['class']}, "
                f"{100 * top['share_only']:.0f}%): not a precision choice of one op class")  # fmt: skip
    return {"capture": str(cap.path), "module": module, "precision": precision, "format": fmt,
            "device_rel_error": dev_rel, "all_rounded_rel_error": all_rel, "classes": rows, "top": top["class"],
            "text": text}  # fmt: skip
