"""Faults planted inside the training process, as a user's harness would (benchmarks/detection_power.py).

Runs in the ranks of the packed step of either path (ms-swift + megatron-core, or ms-swift + MindSpeed on
the torch_npu stand-in), imported at start-up by a ``sitecustomize`` shim the benchmark writes into a
folder of its own on ``PYTHONPATH``. Nothing of oracle's or of the tests' fault switches is used: the
planting is monkeypatching and module hooks on the model the step builds. ``DETECTION_PLANT`` (JSON)
says what to plant, ``DETECTION_SEED`` which weights the tiny model is written with (tests/swift/tiny.py's
``hf_weights`` seed). The hooks go on at the first ``MegatronTrainer.forward_step`` of the run (ms-swift's,
on both paths), on the unwrapped model (``Qwen3VLGPTModel``); module paths below are relative to it.

Families (``strength`` s; ``direction`` forward or backward where both exist):
    scale      the first output y of ``target`` becomes y (1 + s) (forward), or keeps its value and passes
               its gradient times (1 + s) (backward: ``y.detach() + (y - y.detach()) (1 + s)``)
    swiglu     decoder layer K's SwiGLU backward uses sigmoid(a) for silu'(a), blended: da = g b ((1 - s)
               silu'(a) + s sigmoid(a)); the value is bitwise the run's own (backward only). The
               activation's input x = [a, b] (linear_fc1's local output) and output h (linear_fc2's input)
               are taken at the two linears, h replaced by ``h.detach() + (w - w.detach())`` with w this
               formula's function of x (computed in float32, rounded to x's dtype)
    attention  in decoder layer K's core attention, the first query of every packed sample but the first
               also sees the whole previous sample (a mask / offset error at a packed boundary): its output
               row o becomes (1 - s) o + s o_leak, o_leak = softmax(q K^T / sqrt(d)) V over the previous
               sample's keys and its own, in float32 (forward); or keeps its value and passes the gradient
               of that blend (backward)
    rotary     the multimodal rotary's height and width position rows are mixed for image tokens (the
               tokens whose two rows differ): h' = h + s (w - h), w' = w + s (h - w); s = 1 swaps the
               sections; forward only, every decoder layer's rotary (born in layer 0)
    bf16acc    decoder layer K's weight gradients accumulated in a short format: every main_grad of the
               layer rounded (nearest even) to ``bits`` mantissa bits when the backward leaves the layer
               (7 = bf16: what a weight-gradient GEMM that accumulates into bf16 leaves after one
               micro-batch); backward only; the strength is the bits
"""

from __future__ import annotations

import importlib.abc
import json
import math
import os
import sys

ENV, SEED_ENV = "DETECTION_PLANT", "DETECTION_SEED"


# -- import hooks ---------------------------------------------------------------------------------
class _Loader(importlib.abc.Loader):
    def __init__(self, inner, then):
        self.inner, self.then = inner, then

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.then(module)


class _After(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` right after the named module is first executed."""

    def __init__(self):
        self.todo = {}

    def find_spec(self, name, path, target=None):
        then = self.todo.pop(name, None)
        if then is None:
            return None
        for f in sys.meta_path:
            if f is self or not hasattr(f, "find_spec"):
                continue
            spec = f.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, then)
                return spec
        return None


_after = _After()


def when_imported(name, then):
    if name in sys.modules:
        then(sys.modules[name])
        return
    _after.todo[name] = then
    if _after not in sys.meta_path:
        sys.meta_path.insert(0, _after)


def install() -> None:
    """The shim's one call: nothing unless the benchmark set ``DETECTION_PLANT`` or ``DETECTION_SEED``."""
    seed = os.environ.get(SEED_ENV)
    if seed:
        when_imported("tiny", lambda m: setattr(m.hf_weights, "__defaults__", (int(seed),)))
    spec = json.loads(os.environ.get(ENV) or "null")
    if spec:
        when_imported("swift.megatron.trainers.trainer", lambda m: _patch_trainer(m, spec))


def _patch_trainer(mod, spec) -> None:
    trainer = mod.MegatronTrainer
    forward_step = trainer.forward_step
    done = []

    def planting_forward_step(self, data_iterator, model, *a, **k):
        if not done:
            m = model
            while hasattr(m, "module"):
                m = m.module
            plant(m, spec)
            done.append(True)
        return forward_step(self, data_iterator, model, *a, **k)

    trainer.forward_step = planting_forward_step


# -- the families ---------------------------------------------------------------------------------
def plant(model, spec: dict) -> None:
    fam = spec["family"]
    if fam == "probe":
        return _probe(model, spec)
    PLANTS[fam](model, spec)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _replace(out, y):
    return (y, *out[1:]) if isinstance(out, tuple) else y


def _layer(model, k: int):
    return model.language_model.decoder.layers[int(k)]


def _scale(model, spec):
    f, backward = 1.0 + float(spec["strength"]), spec["direction"] == "backward"

    # inside the module's own forward (its instance ``forward``, not a hook): what the module returns is
    # wrong, so every observer of its output (a capture's boundary recorder too) sees it, as a kernel's fault
    m = model.get_submodule(spec["target"])
    inner = m.forward

    def forward(*args, **kwargs):
        out = inner(*args, **kwargs)
        y = _first(out)
        y = y.detach() + (y - y.detach()) * f if backward else y * f
        return _replace(out, y)

    m.forward = forward


def _swiglu(model, spec):
    import torch
    import torch.nn.functional as F

    s = float(spec["strength"])

    class WrongSwiGLU(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            a, b = x.float().chunk(2, dim=-1)
            return (F.silu(a) * b).to(x.dtype)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            a, b = x.float().chunk(2, dim=-1)
            g = g.float()
            sig = torch.sigmoid(a)
            d = (1 - s) * sig * (1 + a * (1 - sig)) + s * sig  # silu'(a), blended with the wrong sigmoid(a)
            return torch.cat([g * b * d, g * F.silu(a)], dim=-1).to(x.dtype)

    mlp = _layer(model, spec["layer"]).mlp
    seen = {}

    def keep_x(module, args, out):
        seen["x"] = _first(out)

    def swap_h(module, args):
        h, x = args[0], seen.pop("x")
        assert x.shape[:-1] == h.shape[:-1] and x.shape[-1] == 2 * h.shape[-1], (tuple(x.shape), tuple(h.shape))
        w = WrongSwiGLU.apply(x)
        return (h.detach() + (w - w.detach()), *args[1:])

    mlp.linear_fc1.register_forward_hook(keep_x)
    mlp.linear_fc2.register_forward_pre_hook(swap_h)


def _leak_rows(q, k, v, bounds):
    """o_leak for the first query of every packed sample but the first: it attends to the previous
    sample's keys and its own. q (T, np, hn), k, v (T, ng, hn); -> (rows, (n, np, hn) float32)."""
    import torch

    rep = q.shape[1] // k.shape[1]
    rows, outs = [], []
    for i in range(1, len(bounds) - 1):
        p, prev = bounds[i], bounds[i - 1]
        if bounds[i + 1] - p < 2 or p - prev < 2:  # the SP pad singleton: no sample to leak into or from
            continue
        qp = q[p].float()  # (np, hn)
        ks, vs = (t[prev : p + 1].float().repeat_interleave(rep, dim=1) for t in (k, v))  # (L, np, hn)
        probs = (torch.einsum("hd,lhd->hl", qp, ks) / math.sqrt(q.shape[-1])).softmax(-1)  # (np, L)
        outs.append(torch.einsum("hl,lhd->hd", probs, vs))
        rows.append(p)
    return rows, torch.stack(outs)


def _attention(model, spec):
    s, backward = float(spec["strength"]), spec["direction"] == "backward"
    core = _layer(model, spec["layer"]).self_attention.core_attention

    def hook(module, args, kwargs, out):
        q, k, v = args[:3]
        psp = kwargs.get("packed_seq_params") if "packed_seq_params" in kwargs else args[6] if len(args) > 6 else None
        cu = psp.cu_seqlens_q_padded if getattr(psp, "cu_seqlens_q_padded", None) is not None else psp.cu_seqlens_q
        bounds = [int(x) for x in cu]
        q, k, v = (t.reshape(bounds[-1], -1, t.shape[-1]) for t in (q, k, v))  # (T, heads, hn)
        y = _first(out)
        flat = y.reshape(bounds[-1], q.shape[1], q.shape[2])  # (T, np, hn)
        rows, leak = _leak_rows(q, k, v, bounds)
        o = flat[rows].float()
        blend = (1 - s) * o + s * leak
        new = o + ((blend - blend.detach()) - (o - o.detach())) if backward else blend
        flat = flat.index_put((__import__("torch").tensor(rows),), new.to(flat.dtype))
        return _replace(out, flat.reshape(y.shape))

    core.register_forward_hook(hook, with_kwargs=True)


def _rotary(model, spec):
    s = float(spec["strength"])
    rope = model.language_model.rotary_pos_emb

    def hook(module, args, kwargs):
        key = "position_ids"
        pos = kwargs[key] if key in kwargs else args[0]
        assert pos.dim() == 3 and pos.shape[0] == 3, tuple(pos.shape)  # (3: t, h, w, B, T) mRoPE rows
        p = pos.double()
        h, w = p[1].clone(), p[2].clone()
        p[1], p[2] = h + s * (w - h), w + s * (h - w)
        p = p if s not in (0.0, 1.0) else p.to(pos.dtype)
        if key in kwargs:
            return args, {**kwargs, key: p}
        return (p, *args[1:]), kwargs

    rope.register_forward_pre_hook(hook, with_kwargs=True)


def _round_bits(t, bits: int):
    import torch

    m, e = torch.frexp(t)
    return torch.ldexp(torch.round(m * 2.0 ** (bits + 1)) / 2.0 ** (bits + 1), e)


def _bf16acc(model, spec):
    import torch

    bits = int(spec["strength"])
    layer = _layer(model, spec["layer"])
    params = [p for p in layer.parameters() if p.requires_grad]

    class RoundOnLeave(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):  # the layer's backward is done: its weight gradients are in main_grad
            with torch.no_grad():
                for p in params:
                    mg = getattr(p, "main_grad", None)
                    if mg is not None:
                        mg.copy_(_round_bits(mg, bits))
            return g

    def pre(module, args, kwargs):
        if "hidden_states" in kwargs:
            hs = kwargs["hidden_states"]
            return args, {**kwargs, "hidden_states": RoundOnLeave.apply(hs) if hs.requires_grad else hs}
        hs = args[0]
        return ((RoundOnLeave.apply(hs) if hs.requires_grad else hs), *args[1:]), kwargs

    layer.register_forward_pre_hook(pre, with_kwargs=True)


def _probe(model, spec):
    """Writes the model's module names, and the first core attention call's shapes, to spec["out"]."""
    rank = os.environ.get("RANK", "0")
    doc = {"modules": [n for n, _ in model.named_modules()]}
    core = _layer(model, 0).self_attention.core_attention
    rope = model.language_model.rotary_pos_emb

    def shapes(x):
        return list(x.shape) if hasattr(x, "shape") else type(x).__name__

    def save():
        with open(f"{spec['out']}.rank{rank}.json", "w") as f:
            json.dump(doc, f, indent=1)

    def att(module, args, kwargs, out):
        doc.setdefault("attention", {"args": [shapes(a) for a in args], "kwargs": {k: shapes(v) for k, v in kwargs.items()},
                                     "out": shapes(_first(out)), "class": type(module).__name__})  # fmt: skip
        psp = kwargs.get("packed_seq_params")
        if psp is not None:
            doc["attention"]["cu"] = [int(x) for x in psp.cu_seqlens_q]
        save()

    def rot(module, args, kwargs):
        doc.setdefault("rotary", {"args": [shapes(a) for a in args], "kwargs": {k: shapes(v) for k, v in kwargs.items()},
                                  "class": type(module).__name__})  # fmt: skip
        save()

    core.register_forward_hook(att, with_kwargs=True)
    rope.register_forward_pre_hook(rot, with_kwargs=True)
    save()


PLANTS = {"scale": _scale, "swiglu": _swiglu, "attention": _attention, "rotary": _rotary, "bf16acc": _bf16acc}
