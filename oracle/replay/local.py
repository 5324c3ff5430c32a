"""Teacher-forced local replay: the error born in each module, apart from what it inherits.

For each module M recorded at capture (modules.py), on CPU:
  1. M is taken from the recipe's model built in float64 with the captured weights; the device's
     own recorded inputs of M are upcast (exact) and fed to it inside PrecisionMode(float64);
  2. forward:  fwd   = rel_l2(device outputs of M,  float64 outputs from the device's inputs)
  3. backward: from the device's own grad_output of M (upcast),
               bwd   = rel_l2(device grad_inputs of M, float64 grad_inputs)
               param = rel_l2(device gradients of M's parameters, float64 ones)
     (rel_l2 over all of a module's output / grad-input / parameter tensors jointly: sqrt of
     summed squared differences over sqrt of summed squared truths)
  4. expected: the same module from the same inputs in emulated low precision (precision/mode.py, the
     capture's precision), K members; expected_x = max(max_k x_k, floor) -- the error an honest
     run of that precision makes in this module alone;
  5. ratio_x = x / expected_x: how many times the honest local error the device made here;
  6. inherited = rel_l2(device grad_output of M, grad_output of M in the end-to-end float64
     replay): the error M received from everything after it in the backward pass.
The pseudo-module ``loss`` does the same for the loss alone, from the device's logits (the lm_head
output) to the device's gradient of the logits.

Inputs made outside the recorded modules (``input_rows``): a keyword input of M that is floating point,
carries no gradient and is not M's hidden state -- the rotary tables ``position_embeddings`` a decoder
layer or a ViT block receives, computed once from the step's positions by a module that is not recorded
(mcore's rotary is a function) -- is fed to M as the device made it, so a teacher-forced M cannot see it
wrong. It is checked on its own as a pseudo-module ``M:key`` (forward only):
    fwd      = max_i |d_i| / max_i |t_i|   d = device's value - t, t = the value M receives in the
               end-to-end float64 replay (all of the key's tensors jointly)
    members  = the same from an emulated end-to-end replay of the capture's precision (stopped before
               the last recorded module), rounded to the format the device held the value in; for a
               merged Megatron capture the amp emulation (float32 where the model code asks for it): the
               merge made its tables from the angles the ranks computed in float32, which the pure-bf16
               emulation would round to bf16 (16x the device's honest error on the packed step)
    floor    = a quarter of the unit roundoff of that format (a member that rounds nothing)
Elementwise, not rel L2: such a value is computed element by element from the positions (no sum), so
each element's honest error is its format's rounding (plus the float32 angle's), and a wrong value
confined to a few tokens (the image tokens' rotary rows) is diluted in an L2 ratio over all of them
(the tiny Qwen3-VL's sections swapped for its image tokens: rel L2 1.5x an honest bf16 member's).
One row per distinct value: the same tables handed to every layer are checked where they first enter
(the earliest recorded module, or its outermost recorded ancestor, that received that value bitwise).
A wrong value there is a forward error born before M, in whatever computed it from the positions.
The entry row ``E:hidden_states`` (``entry: true``): the hidden states the first recorded module E
receives, made by the unrecorded modules before it (embeddings, a vision tower, its merger), rel L2
against the float64 replay's, the emulated replay's as the band. With two recorded stacks (a vision
tower's blocks and the decoder layers, ``entries_of``) the first block of each later stack gets one too:
what the decoder's first layer receives passes through the unrecorded merger and embeddings. It is evidence, not a culprit
(score/local.py): a fault before E seen end to end is a forward one when this row is beyond T.

Each row also counts the NaN/Inf in the device's boundary tensors of M (``nonfinite``: in, out,
gout, gin, param) and in the float64 results (``truth_nonfinite``), and M's place in the forward
(``order``), so that scoring can name where non-finite values are born. Scoring and rendering are
score/local.py and report/text.py; this file only replays.
Modules are independent, so ``workers > 1`` replays them in separate processes.
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_loads
from tqdm import tqdm

from ..bundle.shapes import check_shapes, stored_shapes
from ..bundle.store import Bundle, BundleWriter, check_not_input, check_output
from ..capture.modules import ModuleRecorder, group_name
from ..errors import BundleError, RecipeError
from ..metrics import rel_l2
from ..parallel import distributed
from ..precision import CAPTURE_NAMES, emulation
from ..precision.mode import PrecisionMode
from .inputs import check_inputs
from .run import run_step
from .setup import recipe_of
from .streaming.materialize import Weights, evict, materialize, skeleton

LOSS = "loss"


def _rel(dev: list[torch.Tensor], ref: list[torch.Tensor]) -> float | None:
    return rel_l2(dev, ref) if ref else None


def _max_rel(dev: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """max_i |dev_i - ref_i| / max_i |ref_i| over all tensors jointly, in float64 (inf if only ref is zero)."""
    d = max((float((a.double() - b.double()).abs().max()) for a, b in zip(dev, ref) if a.numel()), default=0.0)
    t = max((float(b.double().abs().max()) for b in ref if b.numel()), default=0.0)
    return d / t if t else (0.0 if d == 0 else float("inf"))


def _nonfinite(ts: list[torch.Tensor]) -> int:
    return sum(int((~t.isfinite()).sum()) for t in ts if t.is_floating_point())


class _Through(torch.nn.Module):
    """A norm, then the module it feeds: the boundary a Megatron sub-module records where the spec fuses its
    input norm into its first linear layer (TransformerEngine / MindSpeed: ``self_attention`` receives the hidden
    states before ``input_layernorm``, ``mlp`` before ``post_attention_layernorm``). The hidden states are the
    first positional argument or ``hidden_states``; everything else goes to the module as recorded."""

    def __init__(self, norm: torch.nn.Module, module: torch.nn.Module):
        super().__init__()
        self.norm, self.inner = norm, module

    def forward(self, *args, **kwargs):
        if args:
            return self.inner(self.norm(args[0]), *args[1:], **kwargs)
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = self.norm(kwargs["hidden_states"])
        return self.inner(**kwargs)

    def named_parameters_as(self, name: str, through: str):
        """(model-wide name, parameter) of the norm's and the module's."""
        yield from ((f"{through}.{n}", p) for n, p in self.norm.named_parameters())
        yield from ((f"{name}.{n}", p) for n, p in self.inner.named_parameters())


class _Worker:
    """Per-process state: the capture, and per dtype a skeleton of the model (parameters on the meta
    device, oracle/replay/streaming/materialize.py) whose modules are materialised from the capture only while they
    are replayed: no worker ever holds the whole model."""

    def __init__(self, capture: str):
        self.cap = Bundle(capture)
        self.recipe = recipe_of(self.cap)
        self.models: dict[str, torch.nn.Module] = {}
        self._live: dict[str, list[str]] = {}  # dtype -> the modules materialised in that skeleton now

    def model(self, dtype: str) -> torch.nn.Module:
        if dtype not in self.models:
            compute = emulation(dtype)[0]
            cfg = self.cap.manifest["recipe"]["config"]
            shapes, where = stored_shapes(self.cap)
            check_shapes(self.recipe, cfg, shapes, where)
            self.models[dtype] = skeleton(self.recipe, cfg, compute, PrecisionMode(compute))
        return self.models[dtype]

    def module(self, dtype: str, name: str) -> torch.nn.Module:
        """Module ``name`` of the ``dtype`` skeleton with its captured weights (the previous one evicted); a
        boundary recorded ``through`` a norm (a Megatron sub-module whose input norm the spec fuses in,
        integrations/megatron/boundaries.py) is that norm, then the module: ``_Through``."""
        model = self.model(dtype)
        through = self.cap.manifest["modules"].get(name, {}).get("through")
        want = [n for n in (through, name) if n]
        for live in self._live.get(dtype, []):
            if live not in want:
                evict(model.get_submodule(live))
        for n in want:
            materialize(model.get_submodule(n), f"{n}.", Weights(self.cap, emulation(dtype)[0]))
        self._live[dtype] = want
        module = model.get_submodule(name)
        return _Through(model.get_submodule(through), module) if through else module

    def run(self, name: str, dtype: str, jitter: int | None, mode: PrecisionMode | None = None,
            branches: tuple[str, ...] = ()) -> dict[str, list[torch.Tensor]]:  # fmt: skip
        """Module ``name`` under ``dtype`` from the device's inputs and grad_outputs (inside ``mode``
        when given: explain.py's per-op-class modes, on the ``dtype`` model); ``branches``: children whose
        first output tensor is kept (as ``branch.CHILD``, float64)."""
        compute, round_to, ops = emulation(dtype)
        meta = self.cap.manifest["modules"][name if name != LOSS else "lm_head"]
        group = group_name(name if name != LOSS else "lm_head")
        stored = set(self.cap.names(group))

        mode = mode or PrecisionMode(compute, round_to, ops, jitter_seed=jitter, device_type=self.cap.capture_device())

        def load(key: str) -> torch.Tensor:
            t = self.cap.load(group, key)
            return t.to(compute) if t.is_floating_point() else t

        def held_low(key: str) -> bool:  # the device held this boundary tensor in bf16/fp16
            return self.cap.entry(group, key)["dtype"] in ("bfloat16", "float16")

        if name == LOSS:
            logits = load("out.0").detach().requires_grad_(True)
            if round_to is not None and held_low("out.0"):
                mode.mark_low(logits)
            inputs = {n: t for n, t in self.cap.iter_group("inputs")}
            red = (self.cap.get("loss") or {}).get("reduction", "mean")
            with mode:
                loss, _ = self.recipe.loss_from_logits(logits, inputs, red)
                loss.backward()
            g = logits.grad
            if round_to is not None and held_low("gout.0"):
                g = g.to(round_to).to(compute)  # stored as the device stores dL/dlogits
            return {"out": [loss.detach().reshape(1)], "gin": [g], "param": []}
        spec = treespec_loads(meta["in_spec"])
        n_leaves = spec.num_leaves
        leaves: list[Any] = []
        for i in range(n_leaves):
            if f"in.{i}" in stored:
                t = load(f"in.{i}")
                if i in meta.get("grad_in", []):
                    t = t.detach().requires_grad_(True)
                if round_to is not None and held_low(f"in.{i}"):
                    mode.mark_low(t)
                leaves.append(t)
            else:
                leaves.append(meta["in_static"].get(str(i)))
        args, kwargs = tree_unflatten(leaves, spec)
        module = self.module(dtype, name)
        module.zero_grad(set_to_none=True)
        kept: dict[str, torch.Tensor] = {}

        def keep(child, args, out):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(t, torch.Tensor):
                kept[names[child]] = t.detach().double().clone()

        inner = module.inner if isinstance(module, _Through) else module
        names = {inner.get_submodule(c): c for c in branches}
        hooks = [child.register_forward_hook(keep) for child in names]
        try:
            with mode:
                out = module(*args, **kwargs)
                outs, _ = tree_flatten(out)
                pairs = [(outs[i], load(f"gout.{i}")) for i in meta.get("grad_out", []) if f"gout.{i}" in stored]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        finally:
            for h in hooks:
                h.remove()
        out_t = [o.detach() for o in outs if isinstance(o, torch.Tensor)]
        gin = []
        for i in meta.get("grad_in", []):
            if f"gin.{i}" in stored and leaves[i].grad is not None:
                g = leaves[i].grad
                if round_to is not None and held_low(f"gin.{i}"):
                    g = g.to(round_to).to(compute)  # the device accumulates this gradient in its own format
                gin.append(g)
        named = (module.named_parameters_as(name, meta["through"]) if isinstance(module, _Through)
                 else ((f"{name}.{pn}", p) for pn, p in module.named_parameters()))  # fmt: skip
        params = [(n, p.grad) for n, p in named if p.grad is not None]
        return {"out": out_t, "gin": gin, "param": [g for _, g in params], "param_names": [n for n, _ in params],
                "branches": kept}  # fmt: skip

    def device(self, name: str, param_names: list[str]) -> dict[str, list[torch.Tensor]]:
        meta = self.cap.manifest["modules"][name if name != LOSS else "lm_head"]
        group = group_name(name if name != LOSS else "lm_head")
        stored = set(self.cap.names(group))
        if name == LOSS:
            lv = (self.cap.get("loss") or {}).get("value")
            return {"out": [torch.tensor([lv], dtype=torch.float64)], "gin": [self.cap.load(group, "gout.0")], "param": [],
                    "in": [self.cap.load(group, "out.0")], "gout": []}  # fmt: skip

        def leaves(prefix: str) -> list[torch.Tensor]:
            keys = sorted((k for k in stored if k.startswith(prefix)), key=lambda k: int(k.split(".")[1]))
            return [self.cap.load(group, k) for k in keys]

        gin = [self.cap.load(group, f"gin.{i}") for i in meta.get("grad_in", []) if f"gin.{i}" in stored]
        grads = set(self.cap.names("grads"))
        return {"out": leaves("out."), "gin": gin, "param": [self.cap.load("grads", n) for n in param_names if n in grads],
                "in": leaves("in."), "gout": leaves("gout.")}  # fmt: skip


_STATE: dict[str, _Worker] = {}


def _worker(capture: str) -> _Worker:
    if capture not in _STATE:
        _STATE[capture] = _Worker(capture)
    return _STATE[capture]


def _branches_of(w: _Worker, name: str) -> tuple[str, ...]:
    """The children of module ``name`` the recipe names as residual branches (``Recipe.residual_branches``)."""
    rx = getattr(w.recipe, "residual_branches", None)
    if not rx or name == LOSS:
        return ()
    return tuple(c for c, _ in w.model("fp64").get_submodule(name).named_children() if re.search(rx, c))


def _branch_coefs(err: torch.Tensor, outs: list[torch.Tensor]) -> list[float] | None:
    """Least squares of a block's forward error on its residual branches' outputs (float64 truths):
    err ~ sum_j a_j o_j, from the normal equations G a = b, G_ij = <o_i, o_j>, b_i = <o_i, err> (dot products
    only: no (N, k) stack at 8B x 64k tokens). A branch whose output came out (1 + s) times too large in the
    device's forward gives a_j = s; an honest device's roundings, and a fault in the backward, give a_j near 0
    (the members' a_j are that null). None: shapes differ or G is singular."""
    if any(o.shape != err.shape for o in outs):
        return None
    e = err.reshape(-1).double()
    flat = [o.reshape(-1) for o in outs]
    g = torch.tensor([[float(a @ b) for b in flat] for a in flat], dtype=torch.float64)
    b = torch.tensor([float(a @ e) for a in flat], dtype=torch.float64)
    try:
        return torch.linalg.solve(g, b).tolist()
    except RuntimeError:  # singular: a branch that outputs zeros, or two that output the same
        return None


def replay_module(capture: str, name: str, emulate: str, members: int) -> dict[str, Any]:
    w = _worker(capture)
    meta = w.cap.manifest["modules"].get(name if name != LOSS else "lm_head", {})
    branches = _branches_of(w, name) if meta.get("calls", 1) == 1 else ()
    truth = w.run(name, "fp64", None, branches=branches)
    dev = w.device(name, truth.get("param_names", []))
    row: dict[str, Any] = {"module": name, "calls": meta.get("calls", 1), "order": meta.get("order")}
    if name == LOSS:
        row["order"] = len(w.cap.manifest["modules"])  # after every module's forward: first in the backward
    row["nonfinite"] = {k: _nonfinite(dev[k]) for k in ("in", "out", "gout", "gin", "param")}
    row["truth_nonfinite"] = {k: _nonfinite(truth[k]) for k in ("out", "gin", "param")}
    keys = ("out", "gin", "param") if meta.get("calls", 1) == 1 else ("out", "gin")
    labels = {"out": "fwd", "gin": "bwd", "param": "param"}
    for k in keys:
        row[labels[k]] = _rel(dev[k], truth[k]) if len(dev[k]) == len(truth[k]) else None
    expected: dict[str, list[float]] = {labels[k]: [] for k in keys}
    kept = [truth["branches"].get(c) for c in branches]
    split = branches and all(o is not None for o in kept) and len(dev["out"]) == len(truth["out"]) >= 1
    coefs = _branch_coefs(dev["out"][0].double() - truth["out"][0], kept) if split else None
    null: list[list[float]] = []
    for m in range(members):
        emu = w.run(name, emulate, None if m == 0 else 2000 + m)
        for k in keys:
            v = _rel(emu[k], truth[k]) if len(emu[k]) == len(truth[k]) else None
            if v is not None:
                expected[labels[k]].append(v)
        if coefs is not None:
            c = _branch_coefs(emu["out"][0].double() - truth["out"][0], kept)
            if c is not None:
                null.append(c)
    if len(dev["out"]) == len(truth["out"]) >= 1 and dev["out"][0].shape == truth["out"][0].shape:
        # the forward output as one factor of the truth's: c = <d, t> / <t, t>, and what is left after it (a plain
        # scale leaves the members' error: answers.op_class calls it scaling)
        d, t = dev["out"][0].double(), truth["out"][0].double()
        tt = float((t * t).sum())
        if tt > 0:
            c = float((d * t).sum()) / tt
            row["fwd_scale"], row["fwd_after_scaling"] = c, float((d - c * t).norm()) / math.sqrt(tt)
    if coefs is not None and null:  # score/local.py reads the direction from them
        row["branches"] = {f"{name}.{c}": {"coef": coefs[j], "members": [x[j] for x in null]} for j, c in enumerate(branches)}
    for lab, vals in expected.items():
        row[f"expected_{lab}"] = max(vals) if vals else None
        row[f"members_{lab}"] = vals  # each member's error: the null of the threshold (score/calibrate.py)
    return row


def _inherited(cap: Bundle, names: list[str], kw: dict | None = None) -> dict[str, float | None]:
    """grad_output of each module in the end-to-end float64 replay vs the device's; ``kw`` receives the
    modules' gradient-free floating keyword inputs in that replay (``input_rows``)."""
    real = [n for n in names if n != LOSS]
    recorders: list[ModuleRecorder] = []
    hooks: list = []

    def record(model):
        recorders.append(ModuleRecorder(model, real))
        recorders[-1].__enter__()
        if kw is not None:
            hooks.extend(_kw_inputs(model, real, kw, entries=entries_of(cap, real), through=_through(cap)))

    try:
        run_step(cap, "fp64", instrument=record)  # the oracle's own step, boundaries kept
    finally:
        for r in recorders:
            r.close()
        for h in hooks:
            h.remove()
    rec = recorders[0]
    out: dict[str, float | None] = {}
    for n in real:
        meta, group = cap.manifest["modules"][n], group_name(n)
        keys = [f"gout.{i}" for i in meta.get("grad_out", [])]
        dev = [cap.load(group, k) for k in keys if cap.has(group, k)]
        ref = [rec.tensors[n][k] for k in keys if k in rec.tensors[n]]
        summed = (meta.get("megatron") or {}).get("grad_output_summed")  # not the step's gradient (megatron/boundaries.py)
        out[n] = _rel(dev, ref) if dev and len(dev) == len(ref) and not summed else None
    out[LOSS] = 0.0 if LOSS in names else None  # the loss receives the constant 1: nothing to inherit
    return out


class _Enough(Exception):
    """Raised by the emulated replay once every recorded module's inputs are in: the rest is not needed."""


ENTRY = "hidden_states"  # the key of the entry row: what the first recorded module receives from before it


def _kw_inputs(model: torch.nn.Module, names: list[str], store: dict[str, dict[str, list[torch.Tensor]]],
               stop: str | None = None, entries: tuple[str, ...] = (), through: dict[str, str] | None = None) -> list:  # fmt: skip
    """Forward pre-hooks keeping each module's gradient-free floating keyword inputs (first call), by key,
    and the ``entries``' gradient-carrying positional ones as ``ENTRY``; ``stop``: the module whose inputs
    are the last needed (raises ``_Enough`` after keeping them)."""
    hooks = []
    # one copy of a tensor handed to every layer (the rotary tables); the original is held with it, so that
    # its id cannot be taken by another tensor while the hooks run
    copies: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        key = (id(t), t.data_ptr(), t._version)
        if key not in copies:
            copies[key] = (t, t.detach().to("cpu", copy=True))
        return copies[key][1]

    seen: set[str] = set()  # modules whose first call was kept
    via = through or {}

    def hidden(args) -> list[torch.Tensor]:
        flat, _ = tree_flatten(args)
        return [t.detach().to("cpu", copy=True) for t in flat
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]  # fmt: skip

    for n in names:
        def hook(module, args, kwargs, n=n):
            if n not in seen:
                seen.add(n)
                kept = store.setdefault(n, {})
                for k, v in kwargs.items():
                    leaves, _ = tree_flatten(v)
                    if leaves and all(isinstance(t, torch.Tensor) and t.is_floating_point() and not t.requires_grad for t in leaves):
                        kept[k] = [keep(t) for t in leaves]
                if n in entries and n not in via:
                    kept[ENTRY] = hidden(args)
            if n == stop:
                raise _Enough
            return None

        hooks.append(model.get_submodule(n).register_forward_pre_hook(hook, with_kwargs=True))
        if n in entries and n in via:  # recorded through its norm (boundaries.py): what enters is the norm's input

            def norm_hook(module, args, kwargs, n=n):
                store.setdefault(n, {}).setdefault(ENTRY, hidden((args, kwargs)))

            hooks.append(model.get_submodule(via[n]).register_forward_pre_hook(norm_hook, with_kwargs=True))
    return hooks


def _through(cap: Bundle) -> dict[str, str]:
    return {n: m["through"] for n, m in cap.manifest["modules"].items() if m.get("through")}


def _recorded_call(cap: Bundle, name: str) -> tuple[Any, dict[str, Any], set[str], set[int]]:
    """(args, kwargs) of ``name``'s recorded call with each leaf replaced by its index, the stored keys and the
    indices of the inputs that carried a gradient."""
    meta = cap.manifest["modules"][name]
    spec = treespec_loads(meta["in_spec"])
    args_idx, kw_idx = tree_unflatten(list(range(spec.num_leaves)), spec)
    return args_idx, kw_idx or {}, set(cap.names(group_name(name))), set(meta.get("grad_in", []))


def _device_kw_inputs(cap: Bundle, name: str) -> dict[str, list[torch.Tensor]]:
    """The device's recorded gradient-free floating keyword inputs of ``name``, by key."""
    group = group_name(name)
    _, kw_idx, stored, grad_in = _recorded_call(cap, name)
    out = {}
    for k, v in kw_idx.items():
        idx, _ = tree_flatten(v)
        if not idx or any(not isinstance(i, int) or i in grad_in or f"in.{i}" not in stored for i in idx):
            continue
        ts = [cap.load(group, f"in.{i}") for i in idx]
        if all(t.is_floating_point() for t in ts):
            out[k] = ts
    return out


def _device_entry(cap: Bundle, name: str) -> list[torch.Tensor]:
    """The device's recorded gradient-carrying positional inputs of ``name`` (its hidden states)."""
    args_idx, _, stored, grad_in = _recorded_call(cap, name)
    idx, _ = tree_flatten(args_idx)
    return [cap.load(group_name(name), f"in.{i}") for i in idx if isinstance(i, int) and i in grad_in and f"in.{i}" in stored]


_STACKED = re.compile(r"^(.+)\.\d+$")  # a block of a numbered stack (``model.visual.blocks.3``): its stack


def entries_of(cap: Bundle, names: list[str]) -> tuple[str, ...]:
    """The modules whose hidden states get an entry row, in forward order: the first recorded module (what it
    receives comes from unrecorded modules), and the first recorded block of each other numbered stack that
    no recorded module holds (a vision tower's blocks and the decoder layers both recorded: the decoder's
    first layer receives the embeddings and the vision tower's merger, unrecorded modules between them)."""
    mods = cap.manifest["modules"]
    real = sorted((n for n in names if n in mods and mods[n].get("order") is not None), key=lambda n: mods[n]["order"])
    if not real:
        return ()
    out, stacks = [real[0]], set()
    for n in real:
        m = _STACKED.match(n)
        if m is None or m[1] in stacks or any(n.startswith(o + ".") for o in real):
            continue
        stacks.add(m[1])
        if n not in out:
            out.append(n)
    return tuple(out)


def input_rows(cap: Bundle, names: list[str], truth: dict[str, dict[str, list[torch.Tensor]]], emulate: str) -> list[dict[str, Any]]:
    """The pseudo-modules ``M:key`` of the module docstring; ``truth``: the float64 replay's kept inputs."""
    mods = cap.manifest["modules"]
    seen: list[tuple[str, str, list[torch.Tensor]]] = []  # (module, key, device value) checked already
    rows = []
    entries = entries_of(cap, names)
    for entry in entries:
        dev = _device_entry(cap, entry)
        ref = (truth.get(entry) or {}).get(ENTRY) or []
        if dev and len(dev) == len(ref) and all(a.shape == b.shape for a, b in zip(dev, ref)):
            seen.append((entry, ENTRY, dev))
    for n in sorted((n for n in names if n in mods), key=lambda n: mods[n].get("order", 0)):
        for k, dev in _device_kw_inputs(cap, n).items():
            ref = (truth.get(n) or {}).get(k)
            if ref is None or len(ref) != len(dev) or any(a.shape != b.shape for a, b in zip(dev, ref)):
                continue
            same = next((i for i, (_, k2, d2) in enumerate(seen) if k2 == k and len(d2) == len(dev)
                         and all(torch.equal(a, b) for a, b in zip(d2, dev))), None)  # fmt: skip
            if same is not None:
                m0 = seen[same][0]
                if m0.startswith(n + "."):  # n holds the module that got it first: the row is n's
                    seen[same] = (n, k, dev)
                continue
            seen.append((n, k, dev))
    if not seen:
        return []
    member: dict[str, dict[str, list[torch.Tensor]]] = {}
    last = max((n for n, _, _ in seen), key=lambda n: mods[n].get("order", 0))
    hooks: list = []

    def instrument(model):
        hooks.extend(_kw_inputs(model, [n for n, _, _ in seen], member, stop=last, entries=entries, through=_through(cap)))

    # a merged Megatron capture's tables were made by the merge from the angles the ranks computed in float32
    # (integrations/megatron/boundaries.py): its honest member keeps float32 where the model code asks for it
    # (the amp emulation: the rotary's .float() angles), not the pure-bf16 emulation's bf16 angles (measured on
    # the packed step, both paths: device 0.0019, pure-bf16 member 0.031, amp member 0.0019 max-rel)
    member_dtype = {"bf16": "amp-bf16", "fp16": "amp-fp16"}.get(emulate, emulate) if cap.get("megatron") else emulate
    try:
        run_step(cap, member_dtype, instrument=instrument)
    except _Enough:
        pass
    finally:
        for h in hooks:
            h.remove()
    for n, k, dev in seen:
        ref = truth[n][k]
        emu = [e.to(d.dtype).double() if d.dtype in (torch.bfloat16, torch.float16) else e
               for e, d in zip((member.get(n) or {}).get(k) or [], dev)]  # held as the device held it
        metric = _rel if k == ENTRY else _max_rel  # the hidden states are sums: rel L2, as every module's rows
        m = [metric(emu, ref)] if len(emu) == len(ref) else []
        floor = torch.finfo(dev[0].dtype).eps / 8  # a quarter of the unit roundoff (eps / 2) of the device's format
        rows.append({"module": f"{n}:{k}", "input_of": n, "key": k, "calls": 1, "order": mods[n].get("order"),
                     "nonfinite": {"in": 0, "out": _nonfinite(dev), "gout": 0, "gin": 0, "param": 0},
                     "truth_nonfinite": {"out": _nonfinite(ref), "gin": 0, "param": 0},
                     "fwd": metric(dev, ref), "expected_fwd": max([*m, floor]), "members_fwd": m, "floor": floor,
                     "metric": "rel_l2" if k == ENTRY else "max_rel", "entry": k == ENTRY})  # fmt: skip
        if k == ENTRY and len(emu) == len(ref) == 1:
            rows[-1]["sources"] = _entry_sources(cap, dev[0], ref[0], emu[0], floor)
    return rows


def _entry_sources(cap: Bundle, dev: torch.Tensor, ref: torch.Tensor, emu: torch.Tensor, floor: float) -> dict[str, dict]:
    """An entry row's error split by the unrecorded module that wrote each token row (``Recipe.entry_sources``):
    per module, rel L2 over its rows (device and the emulated member, against the float64 replay's) and their
    ratio, the member's as the band (at least ``floor``). {} where the recipe names one writer or the hidden
    states are not (B, T, H) rows of the step's tokens."""
    inputs = {n: cap.load("inputs", n) for n in cap.names("inputs") if n in ("input_ids", "tokens")}
    if "input_ids" not in inputs and "tokens" in inputs:
        inputs["input_ids"] = inputs["tokens"]
    masks = recipe_of(cap).entry_sources(cap.manifest["recipe"]["config"], inputs)
    out = {}
    for module, mask in masks.items():
        if dev.dim() != 3 or tuple(mask.shape) != tuple(dev.shape[:2]) or not bool(mask.any()):
            return {}
        e, x = _rel([dev[mask]], [ref[mask]]), _rel([emu[mask]], [ref[mask]])
        out[module] = {"fwd": e, "expected_fwd": max(x, floor), "ratio": e / max(x, floor), "rows": int(mask.sum())}
    return out


def recorded_modules(cap: Bundle) -> dict:
    """The module boundaries ``cap`` recorded, which a local replay needs: BundleError (exit 4) naming how to
    capture them where there are none (api/replay.py asks before --nproc's ranks start, so it is said once)."""
    recorded = cap.get("modules") or {}
    if not recorded:
        unmapped = ((cap.get("megatron") or {}).get("boundaries") or {}).get("unmapped") or []
        if unmapped:
            raise BundleError(f"{cap.path}: none of the {len(unmapped)} recorded Megatron module(s) could be mapped onto the "
                              f"recipe's modules (e.g. {unmapped[0]['module']}: {unmapped[0]['why']})")  # fmt: skip
        raise BundleError(f"{cap.path} has no module boundaries; capture with --modules (e.g. --modules all), or on "
                          "Megatron with ORACLE_CAPTURE_MODULES=layers (or capture_rank(modules=record_modules(...)))")  # fmt: skip
    return recorded


def replay_local(
    capture: str | Path, out: str | Path, *, modules: str | None = None, members: int = 2, workers: int = 1,
    overwrite: bool = False, progress: bool = False,
) -> Path:  # fmt: skip
    cap = Bundle(capture)
    check_not_input(out, [capture])
    check_output(out, overwrite)
    recorded = recorded_modules(cap)
    check_inputs(cap)  # the inputs boundary (oracle/replay/inputs.py): the loss head reads the labels
    names = sorted(recorded)
    if modules:
        try:
            rx = re.compile(modules)
        except re.error as e:
            raise RecipeError(f"--modules {modules!r} is not a valid regex ({e})") from e
        names = [n for n in names if rx.search(n)]
    if "lm_head" in recorded and (not modules or re.search(modules, LOSS)):
        names.append(LOSS)
    if not names:
        raise RecipeError(f"--modules {modules!r} matches none of the {len(recorded)} recorded modules")
    precision = cap.get("precision") or "fp32"
    emulate = precision if precision in CAPTURE_NAMES else "fp32"
    path = str(cap.path)
    bar = dict(total=len(names), desc="local replay", unit="module", disable=not progress)

    def compute(names: list[str]) -> list[dict[str, Any]]:
        if workers > 1:
            with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as ex:
                it = ex.map(replay_module, [path] * len(names), names, [emulate] * len(names), [members] * len(names))
                return list(tqdm(it, **{**bar, "total": len(names)}))
        return [replay_module(path, n, emulate, members) for n in tqdm(names, **{**bar, "total": len(names)})]

    distributed.init()  # torchrun / --nproc: module k on rank k % ranks (oracle/parallel/distributed.py)
    rows = distributed.spread("local", names, compute)
    if rows is None:  # a rank > 0: its rows went to rank 0
        distributed.finish()
        return Path(out)
    kw: dict[str, dict[str, list[torch.Tensor]]] = {}
    inh = _inherited(cap, names, kw)
    for r in rows:
        r["inherited"] = inh.get(r["module"])
    rows += input_rows(cap, names, kw, emulate)
    with BundleWriter(out, "local", overwrite=overwrite) as w:
        w.manifest.update(
            source={"path": path, "precision": precision}, precision=precision, emulated=emulate, members=members,
            fingerprint=cap.fingerprint(), recipe=cap.get("recipe"), local=rows,
        )  # fmt: skip
    distributed.finish()
    return Path(out)
