"""The float64 truth's elementwise work as fused kernels: RMSNorm, the SwiGLU product, rotary.

Why. The truth's GEMMs run at the float64 GEMM probe's rate; transformers' RMSNorm and SwiGLU are
chains of small float64 ops, each a pass over memory (RMSNorm: cast, pow, mean, add, rsqrt, mul,
cast, mul, and about twice as many in its autograd backward), each one more call through the
replay's dispatch mode. Here each is one forward and one backward function of whole rows, compiled
by torch.compile's CPU backend (inductor, C++) into a loop over rows that reads its inputs once.

Numerics (float64 throughout, nothing rounded lower). Per row x of width H, weight w, eps:
  RMSNorm   r = 1 / sqrt(sum(x^2) / H + eps)        y = w * (x * r)          (transformers' order)
            backward from dy:  gw = dy * w
                               dx = r * gw - x * r^3 * sum(gw * x) / H
                               dw = sum over rows of dy * (x * r)
  SwiGLU    a = gate, b = up:  s = 1 / (1 + exp(-a))   h = (a * s) * b
            backward from dh:  da = dh * b * s * (1 + a * (1 - s))      db = dh * (a * s)
  rotary    q (B, H, T, D), cos, sin (B, 1, T, D), half = D / 2, rotate_half(q) = cat(-q[half:], q[:half]):
            y = q * cos + rotate_half(q) * sin
            backward from dy:  a = dy * sin   dq = dy * cos + cat(a[half:], -a[:half])   (no reduction,
            and inductor contracts no multiply-add by default: bitwise today's; cos, sin take no gradient)
These are the same formulas autograd differentiates in today's path; the fused kernels add the row
sums in another order (vectorised), so a result differs from today's by a few float64 ulps: every
gradient and the loss within 1e-13 relative of the unfused replay (tests/unit/test_fused.py;
measured ~1e-15). The finite-difference certificate (certify.py) runs on the fused model unchanged.

Which modules. A recipe names its model's fusable module classes (``Recipe.fusable``: class name ->
``"rms_norm"`` or ``"swiglu_mlp"``, whose forwards are swapped on the replay's model) and its rotary
function (dotted path -> ``"rotary"``: transformers' module-level ``apply_rotary_pos_emb``, which the
attention looks up at call time, is replaced once per process by a wrapper that fuses only inside
the float64 oracle's dispatch mode and calls the original everywhere else); the engine matches names
only and imports no model. Only the float64 oracle fuses: an emulated member keeps every op so that
each is rounded where its device rounds it. Not fused: the residual adds (transformers' decoder layer
adds them between modules; fusing them means replacing the layer's forward), the attention's softmax
(the oracle's own chunked kernel, attention.py) and the loss (headloss.py/loss.py).

Floats. Inductor's C++ is compiled without -ffinite-math-only and without unsafe math (torch's
defaults, ``cpp_builder._get_ffast_math_flags``): a NaN or Inf of the truth stays one.

Switch and fallback. Opt-in: ``ORACLE_FUSED=1`` fuses; unset or 0 keeps today's path. Off by default
because it gains nothing on a quiet machine (in memory 1.07x, streamed 1.00x warm, below: the truth is GEMM-
bound) and a first compile costs 1.6-1.7x a warm run in every new process and shape. The
first use compiles a tiny probe of
each kernel; if that fails (no C++ compiler, a compile error) the model keeps today's path,
silently, and the reason is recorded. A later compile failure at a new shape runs the same formulas
eagerly (same numerics, unfused) and is recorded too. ``state()`` is what ran; the replay writes it
into its manifest (``numerics.fused``).

Cost. Inductor compiles once per input shape (dynamic=False: a streamed replay's row chunks are a
few shapes); the compiled code is cached on disk in inductor's cache (``TORCHINDUCTOR_CACHE_DIR``,
else ``~/.cache/oracle/inductor``), so a later process with the same shapes pays only the load.
Nothing here runs in a training process: capture (oracle/capture/**) never imports this module.

Measured (benchmarks/RESULTS.md, ``streaming.py b``): at load 8.5-12.9 (two other jobs taking the memory
bandwidth, RMSNorm and SwiGLU fused) in memory 0.84x today's time, streamed 0.97x; quiet (load 1.7, rotary
too) in memory 1.07x, streamed 1.00x with its shapes compiled: 80 % of the replay is GEMM (the profile there);
the first process with an empty cache 1.6-1.7x the warm one.
"""

from __future__ import annotations

import importlib
import os
import threading
import types
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ..precision.mode import PrecisionMode, outside

ENV = "ORACLE_FUSED"  #: "1": fused kernels; unset or "0": today's unfused path (the default)
_lock = threading.Lock()
_state: dict = {"path": "unfused", "why": "not used", "fallbacks": []}
_compiled: dict[str, object] = {}


def enabled() -> bool:
    return os.environ.get(ENV, "0") in ("1", "on", "true", "yes")


def state() -> dict:
    """What the last ``use`` installed: ``{"path": "fused-inductor" | "unfused", "why": ..., "fallbacks": [...]}``."""
    return {**_state, "fallbacks": list(_state["fallbacks"])}


# -- the kernels: pure functions of float64 tensors, rows in dim 0 --------------------------------
def rms_forward(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # (N, 1)
    return w * (x * r), r


def rms_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gw = dy * w  # (N, H)
    dx = r * gw - x * (r * r * r) * (gw * x).mean(-1, keepdim=True)
    dw = (dy * (x * r)).sum(0)  # (H,)
    return dx, dw


def swiglu_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * torch.sigmoid(a)) * b


def swiglu_backward(dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.sigmoid(a)
    return dh * b * (s * (1 + a * (1 - s))), dh * (a * s)


def rope_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin  # transformers' rotate_half


def rope_backward(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = dy.shape[-1] // 2
    a = dy * sin  # (B, H, T, D)
    return dy * cos + torch.cat((a[..., h:], -a[..., :h]), -1)  # rotate_half's transpose


_EAGER = {"rms_forward": rms_forward, "rms_backward": rms_backward,
          "swiglu_forward": swiglu_forward, "swiglu_backward": swiglu_backward,
          "rope_forward": rope_forward, "rope_backward": rope_backward}  # fmt: skip


def _cache_dir() -> None:
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(base / "oracle" / "inductor")


def _kernel(name: str):
    """The compiled kernel ``name`` (eager where compiling it failed); called outside the dispatch mode."""
    fn = _compiled.get(name)
    if fn is None:
        return _EAGER[name]
    return fn


def _call(name: str, *args):
    with outside(), torch.no_grad():
        try:
            return _kernel(name)(*args)
        except Exception as e:  # a compile failure at a new shape: the same formulas, eagerly
            with _lock:
                _compiled[name] = None
                _state["fallbacks"].append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            return _EAGER[name](*args)


def _probe() -> str | None:
    """Compile every kernel once on a tiny float64 input; None, or why it failed."""
    _cache_dir()
    # one compiled kernel per shape: hidden-size and head-size norms, a streamed replay's row chunks
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    try:
        for name, fn in _EAGER.items():
            _compiled[name] = torch.compile(fn, dynamic=False, fullgraph=True)
        x, w = torch.ones(2, 4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
        with outside(), torch.no_grad():
            y, r = _compiled["rms_forward"](x, w, 1e-6)
            _compiled["rms_backward"](y, x, w, r)
            _compiled["swiglu_forward"](x, y)
            _compiled["swiglu_backward"](x, x, y)
            q = x.view(1, 1, 2, 4)
            _compiled["rope_backward"](_compiled["rope_forward"](q, q, q), q, q)
        return None
    except Exception as e:
        _compiled.clear()
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


# -- autograd nodes --------------------------------------------------------------------------------
class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (N, H)
        y, r = _call("rms_forward", x2, w, eps)
        ctx.save_for_backward(x2, w, r)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, r = ctx.saved_tensors
        dx, dw = _call("rms_backward", dy.reshape(x2.shape), x2, w, r)
        return dx.view(ctx.shape), dw, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _call("swiglu_forward", a, b)

    @staticmethod
    def backward(ctx, dh):
        a, b = ctx.saved_tensors
        return _call("swiglu_backward", dh.contiguous(), a, b)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _call("rope_forward", x, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _call("rope_backward", dy, cos, sin), None, None


def _in_the_oracle() -> bool:
    """Inside the float64 oracle's dispatch mode (not an emulated member's, not outside any replay)."""
    return any(isinstance(m, PrecisionMode) and m.round_to is None and m.compute == torch.float64
               for m in _get_current_dispatch_mode_stack())  # fmt: skip


def _rotary(original):
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` (mRoPE's too: its
    interleaving is done by the rotary embedding module, before this), fused inside the float64 oracle
    only; everywhere else, and without ``ORACLE_FUSED=1`` or with no compiled kernels, the original."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, *args, **kwargs):
        plain = (q, k, cos, sin)
        if (args or kwargs or not _compiled or not enabled() or not _in_the_oracle()
                or any(t.dtype != torch.float64 for t in plain) or cos.requires_grad or sin.requires_grad):  # fmt: skip
            return original(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)  # (B, 1, T, D)
        return _Rotary.apply(q, cos, sin), _Rotary.apply(k, cos, sin)

    apply_rotary_pos_emb.oracle_original = original
    return apply_rotary_pos_emb


def _patch_function(path: str) -> bool:
    """``module.function`` named by a recipe, replaced once per process by its fused wrapper (which
    runs the original outside the float64 oracle)."""
    modname, _, fname = path.rpartition(".")
    try:
        module = importlib.import_module(modname)
    except ImportError:
        return False
    fn = getattr(module, fname, None)
    if fn is None:
        return False
    if not hasattr(fn, "oracle_original"):
        setattr(module, fname, _rotary(fn))
    return True


def _rms_norm_forward(self, hidden_states):
    if hidden_states.dtype != torch.float64 or self.weight.dtype != torch.float64:
        return type(self).forward(self, hidden_states)  # not the float64 truth: today's path
    return _RMSNorm.apply(hidden_states.contiguous(), self.weight, float(self.variance_epsilon))


def _swiglu_mlp_forward(self, x):
    a, b = self.gate_proj(x), self.up_proj(x)
    if a.dtype != torch.float64:
        return self.down_proj(self.act_fn(a) * b)
    return self.down_proj(_SwiGLU.apply(a.contiguous(), b.contiguous()))


_FORWARDS = {"rms_norm": _rms_norm_forward, "swiglu_mlp": _swiglu_mlp_forward}
KINDS = (*_FORWARDS, "rotary")  #: "rotary": a recipe's key is the function's dotted path


def _fits(kind: str, m: nn.Module) -> bool:
    if kind == "rms_norm":
        return isinstance(getattr(m, "weight", None), torch.Tensor) and hasattr(m, "variance_epsilon")
    act = getattr(m, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")
    return silu and all(isinstance(getattr(m, p, None), nn.Linear) for p in ("gate_proj", "up_proj", "down_proj"))


def use(model: nn.Module, fusable: dict[str, str]) -> dict:
    """Swap the forward of every module whose class ``fusable`` names for its fused kernel (float64
    oracle only: the caller decides); returns ``state()``. Today's path where disabled or where
    compiling fails."""
    if not enabled():
        _state.update(path="unfused", why=f"{ENV} not 1 (off by default)", fallbacks=[])
        return state()
    if not fusable:
        _state.update(path="unfused", why="the recipe names no fusable module", fallbacks=[])
        return state()
    with _lock:
        if not _compiled:
            why = _probe()
            if why is not None:
                _state.update(path="unfused", why=f"compiling failed: {why}", fallbacks=[])
                return state()
    swapped = sum(_patch_function(path) for path, kind in fusable.items() if kind == "rotary")
    for m in model.modules():
        kind = fusable.get(type(m).__name__)
        if kind in _FORWARDS and _fits(kind, m):
            m.forward = types.MethodType(_FORWARDS[kind], m)
            swapped += 1
    _state.update(path="fused-inductor" if swapped else "unfused", why=f"{swapped} modules and functions fused", fallbacks=[])
    return state()
