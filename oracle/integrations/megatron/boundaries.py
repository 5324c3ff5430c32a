"""Module boundaries recorded on Megatron ranks (hook.py ``modules=``) -> the Hugging Face modules
the recipe's replay runs, so that ``oracle replay --local`` replays them teacher-forced.

Which modules map: the recipe's ``megatron_modules`` table (mcore module template -> HF module, e.g.
``language_model.decoder.layers.{i}`` -> ``model.language_model.layers.{i}``, ``{i}`` made global
by the pipeline stage's layer offset) for mcore TransformerLayers, whose call the recipe rebuilds
in the HF layer's form (``Recipe.megatron_layer_call``), and for the sub-modules of a layer that are
one HF module each (``ROLES``, by the mcore name below the layer):

  self_attention     -> the HF attention (``self_attn``): called as the layer is (hidden states after the
                        input norm, the rotary (cos, sin), the step's mask), its output the attention's
                        output before the residual (mcore's (output, bias): the output)
  mlp, input_layernorm, pre_mlp_layernorm
                     -> ``mlp``, ``input_layernorm``, ``post_attention_layernorm``: one [s, b, h] input,
                        gathered like the layer's hidden states (SP: each rank's s/TP rows)
  self_attention.q_layernorm, .k_layernorm
                     -> ``self_attn.q_norm``, ``self_attn.k_norm``: [s, b, heads/TP, d] per TP rank, every
                        rank its own heads (query heads, or KV groups, in TP-rank order): concatenated along
                        the heads, then [b, s, heads, d]

Where the input norm is fused into linear_qkv / linear_fc1 (TransformerEngine's spec, MindSpeed's:
``layer_norm_weight`` parameters), ``self_attention`` and ``mlp`` receive the hidden states before the
norm: they map ``through`` the HF norm (``input_layernorm`` / ``post_attention_layernorm``, whose weight is
the fused ``layer_norm_weight``), replayed as that norm then the module (replay/local.py ``_Through``),
their parameter gradients the norm's and the module's; the norm modules themselves are weightless
identities there and are named unmapped. Linear layers (TP shards of fused
tensors), the attention kernel and rotary (a function in mcore, not a module) are not mapped either. The boundary is the same function on both
sides: mcore's layer is input norm (fused into linear_qkv under TE / MindSpeed, a module of its own
in the local spec), attention with the rotary embedding applied inside, residual, pre-MLP norm,
MLP, residual; so is the HF layer. Qwen3-VL's deepstack features are added after the layer on
both sides (ms-swift's patched TransformerBlock, transformers' ``_deepstack_process``): the next
layer's recorded input holds them.

Per mapped layer, from the ranks of its stage (TP rank order):
  hidden_states, output, grad_output, grad_input: mcore holds them [s, b, h]; under sequence
      parallel each TP rank holds its s/TP rows (concatenated along s in TP-rank order), else
      every TP rank holds all of them (rank 0's copy, the others checked equal). Then [b, s, h].
  rotary_pos_emb: the angles freqs [s, b or 1, 1, d] the layer received (full length on every TP
      rank); the HF layer takes position_embeddings = (cos, sin) [b, s, d] computed from them in
      float64 and rounded to the hidden states' dtype (what mcore's apply_rotary_pos_emb and HF's
      rotary embedding both hand the attention: ``cos(freqs).to(x.dtype)``; attention scaling 1).
  attention_mask: must be the mask the merged step implies (causal, block-diagonal per packed
      sample of the merged ``cu_seqlens``; True = masked); another mask is refused for that layer.
      The HF call gets None (causal) for an unpacked step, else that mask as a (B, 1, T, T) bool
      tensor, True = attends (what transformers' sdpa takes; local replay runs sdpa).
  parameter gradients: the merged ``grads`` (merge.py: TP shards merged, SP partial sums summed).
Modules outside the decoder layers that the recipe's table maps (ms-swift's Qwen3-VL vision blocks,
``visual.visual.blocks.{i}`` -> ``model.visual.blocks.{i}``, preset ``vit`` of hook.py) are Hugging Face
modules the framework holds whole on every TP rank (runinfo.py) and calls in their own form: their
recorded call is the HF module's (inputs, keywords and output as they are, no [s, b, h] layout). Their
inputs and outputs must agree on every TP rank (AGREEMENT, else unmapped); their gradients follow the
replicated parameters' rule (replicas.py): copies that agree are one gradient (rank 0's), copies that
differ are per-rank parts the framework never reduced (ms-swift slices the deepstack features per SP
rank, so the blocks that feed them receive a different grad_output on each rank) and are summed in
float64. The local backward is linear in the grad_output, so from that sum it yields sum_r of each
rank's parameter gradient: the merged ``grads`` of those parameters (replicas.py), like for like. Such a
sum is not the step's gradient (the part every rank received whole is counted TP times): the entry says
``megatron.grad_output_summed`` and nothing compares it with the step's (replay/local.py ``inherited``).
What cannot be mapped exactly is not mapped, and ``megatron.boundaries.unmapped`` says why (a
module the recipe has no template or call for, rotary cos/sin passed precomputed, cross-attention
context, an attention bias, a mask that is not the step's, post-finalize bundles whose parameter
gradients were divided by the token count while the boundaries were not, a partial record).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, treespec_dumps

from ...capture.modules import JSONABLE, group_name
from ...errors import RecipeError
from .names import NameMap, strip_wrappers

AGREEMENT = 1e-6  # TP copies of a replicated boundary tensor must agree to this (relative L2)
_UNSUPPORTED = ("context", "context_mask", "attention_bias", "rotary_pos_cos", "rotary_pos_sin")
_LAYER = re.compile(r"(decoder\.layers\.)(\d+)(?=$|\.)")
_BELOW = re.compile(r"decoder\.layers\.\d+(?:\.(.+))?$")
#: mcore name below a decoder layer -> how its boundary is merged ("" the layer itself)
ROLES = {"": "layer", "self_attention": "attention", "mlp": "hidden", "input_layernorm": "hidden",
         "pre_mlp_layernorm": "hidden", "self_attention.q_layernorm": "heads", "self_attention.k_layernorm": "heads"}  # fmt: skip
_FUSED = {"self_attention": "linear_qkv", "mlp": "linear_fc1"}  # TE / MindSpeed fuse the input norm into these
_NORM_OF = {"self_attention": "input_layernorm", "mlp": "pre_mlp_layernorm"}  # ... which is this norm's (mcore name)


def _fused_norm(name: str, ranks: list) -> str | None:
    """The mcore name of the norm fused into ``name``'s first linear layer (``layer_norm_weight``: the TE /
    MindSpeed spec), or None."""
    m = _BELOW.search(name)
    below = (m[1] or "") if m else ""
    fused = _FUSED.get(below)
    if fused and any(n.endswith(f"{below}.{fused}.layer_norm_weight") for n in ranks[0].names("grads")):
        return name[: -len(below)] + _NORM_OF[below]
    return None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-300))


def _step_mask(inputs: dict[str, torch.Tensor], b: int, t: int) -> torch.Tensor:
    """(B, 1, T, T) True = masked: causal within each sample of the merged ``cu_seqlens`` (one per row without)."""
    cu = inputs.get("cu_seqlens")
    sample = torch.zeros(b * t, dtype=torch.int64)
    if cu is not None:
        for k, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            sample[s:e] = k
    else:
        sample = torch.arange(b).repeat_interleave(t)
    sample = sample.view(b, t)
    same = sample[:, :, None] == sample[:, None, :]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return ~(same & causal)[:, None]


class _Unmapped(Exception):
    pass


def _gather(ranks: list, group: str, key: str, sp: bool, what: str, heads: bool = False) -> torch.Tensor:
    shards = [b.load(group, key) for b in ranks]
    if heads and len(shards) > 1:
        return torch.cat(shards, 2)  # [s, b, heads/TP, d] per rank, each its own heads in TP-rank order
    if sp and len(shards) > 1:
        return torch.cat(shards, 0)  # [s/TP, b, h] per rank, TP-rank order along s
    for r, t in enumerate(shards[1:], 1):
        if t.shape != shards[0].shape or _rel(t, shards[0]) > AGREEMENT:
            raise _Unmapped(f"{what}: TP rank {r}'s copy differs from rank 0's without sequence parallel")
    return shards[0]


def _role(name: str, ranks: list) -> str:
    """How ``name``'s boundary merges (``ROLES``); _Unmapped for a sub-module no single HF module matches."""
    below = (_BELOW.search(name)[1] or "") if _BELOW.search(name) else None
    if below is None:
        raise _Unmapped("only decoder layers (TransformerLayer) and their sub-modules are mapped onto HF modules")
    if below not in ROLES:
        raise _Unmapped(f"{below} inside a decoder layer is not mapped: linear layers hold TP shards of fused tensors, "
                        f"the attention kernel and rotary have no HF module of their own; mapped: "
                        f"{', '.join(k for k in ROLES if k)}")  # fmt: skip
    grads = ranks[0].names("grads")
    if below.endswith("layernorm") and not any(n.endswith(f"{below}.weight") for n in grads):
        raise _Unmapped("it has no weight: an identity where the spec fuses the norm into the next linear layer "
                        "(TransformerEngine / MindSpeed); capture the whole layer")  # fmt: skip
    return ROLES[below]


def _replica(name: str, ranks: list) -> tuple[dict, dict]:
    """A Hugging Face module held whole on every TP rank, recorded in its own call form (module docstring)."""
    meta = ranks[0].manifest["modules"][name]
    group = group_name(name)
    stored = [set(b.names(group)) for b in ranks]
    if any(s != stored[0] for s in stored[1:]):
        raise _Unmapped("its TP ranks recorded different tensors for it (over the capture budget on some ranks)")
    if "out.0" not in stored[0] or "gout.0" not in stored[0]:
        raise _Unmapped("TP rank 0 recorded no output or grad_output for it (over the capture budget, or not called)")
    tensors: dict[str, torch.Tensor] = {}
    summed = False
    for key in sorted(stored[0]):
        copies = [b.load(group, key) for b in ranks]
        agree = all(t.shape == copies[0].shape and (not t.is_floating_point() or _rel(t, copies[0]) <= AGREEMENT)
                    for t in copies[1:])  # fmt: skip
        if key.startswith(("in.", "out.")):
            if not agree:
                raise _Unmapped(f"its {key} differs between TP ranks: not a module held whole on every rank")
            tensors[key] = copies[0]
        elif agree:
            tensors[key] = copies[0]
        else:  # per-rank parts of a gradient the framework never reduced: their sum, in float64
            tensors[key] = torch.stack([t.double() for t in copies]).sum(0).to(copies[0].dtype)
            summed = True
    entry = {k: meta[k] for k in ("calls", "order", "in_spec", "in_static", "grad_in", "grad_out", "no_grad_calls",
                                  "recomputed_calls") if k in meta}  # fmt: skip
    entry["megatron"] = {"module": name, "call": "replica", "grad_output_summed": summed}
    return entry, tensors


def _layer(name: str, hf: str, ranks: list, sp: bool, inputs: dict[str, torch.Tensor], recipe, seq: int) -> tuple[dict, dict]:
    m0 = ranks[0].manifest
    meta = m0["modules"][name]
    if _BELOW.search(strip_wrappers(name)) is None:  # mapped by the recipe's table outside the decoder layers
        return _replica(name, ranks)
    role = _role(name, ranks)
    leaves = ((m0["megatron"].get("modules") or {}).get("leaves") or {}).get(name)
    if not leaves:
        raise _Unmapped("the rank bundle names no input leaves for it (capture_rank(modules=) writes them)")
    group = group_name(name)
    stored = [set(b.names(group)) for b in ranks]
    for key in _UNSUPPORTED:
        if key in leaves and f"in.{leaves[key]}" in stored[0]:
            raise _Unmapped(f"the layer was called with a {key} tensor, which the HF layer's call has no place for")
    main = "hidden_states" if "hidden_states" in leaves else "arg0"
    if main not in leaves:
        raise _Unmapped("no hidden_states input recorded")
    if any(k.startswith("out.") and k != "out.0" and k in stored[0] for k in stored[0]):
        raise _Unmapped("it returned a second tensor (a bias returned apart: add_bias_linear), which the HF module adds itself")
    h, r = leaves[main], leaves.get("rotary_pos_emb")
    need = [f"in.{h}", "out.0", "gout.0"]
    for rank, have in enumerate(stored):
        miss = [k for k in need if k not in have]
        if miss:
            raise _Unmapped(f"TP rank {rank} recorded no {', '.join(miss)} for it (over the capture budget, or not called)")
    heads = role == "heads"
    x = _gather(ranks, group, f"in.{h}", sp, "hidden_states", heads)
    y = _gather(ranks, group, "out.0", sp, "output", heads)
    gy = _gather(ranks, group, "gout.0", sp, "grad_output", heads)
    gx = _gather(ranks, group, f"gin.{h}", sp, "grad_input", heads) if all(f"gin.{h}" in s for s in stored) else None
    if x.dim() != (4 if heads else 3) or x.shape[0] != seq:
        want = f"[s={seq}, b, heads, d]" if heads else f"[s={seq}, b, h]"
        raise _Unmapped(f"its input of shape {tuple(x.shape)} is not {want} after merging the TP ranks")
    x, y, gy = (t.transpose(0, 1).contiguous() for t in (x, y, gy))  # [s, b, ...] -> [b, s, ...]
    gx = None if gx is None else gx.transpose(0, 1).contiguous()
    b = x.shape[0]
    if role in ("hidden", "heads"):  # one tensor in, one out: the HF module's own call
        return _entry(meta, name, role, sp and len(ranks) > 1 and not heads, ((x,), {}), x, y, gy, gx)
    if r is None or f"in.{r}" not in stored[0]:
        raise _Unmapped("the layer received no rotary_pos_emb tensor; its position embeddings cannot be rebuilt")
    freqs = ranks[0].load(group, f"in.{r}")  # [s, b or 1, 1, d]
    if freqs.dim() != 4 or freqs.shape[0] != seq or freqs.shape[2] != 1:
        raise _Unmapped(f"rotary_pos_emb of shape {tuple(freqs.shape)} is not [s={seq}, b, 1, d]")
    f = freqs.double()[:, :, 0].transpose(0, 1).expand(b, -1, -1)  # [b, s, d]
    cos, sin = (torch.cos(f).to(x.dtype).contiguous(), torch.sin(f).to(x.dtype).contiguous())
    m = leaves.get("attention_mask")
    if m is not None and f"in.{m}" in stored[0]:
        mask = ranks[0].load(group, f"in.{m}")
        want = _step_mask(inputs, b, seq)
        if mask.dtype != torch.bool or mask.shape[-2:] != want.shape[-2:] or not torch.equal(mask.expand_as(want), want):
            raise _Unmapped("its attention_mask is not the causal per-sample mask of the merged step, which the "
                            "replay's attention applies; a layer that ran with another mask is not replayed as this one")  # fmt: skip
    allowed = None if inputs.get("cu_seqlens") is None else ~_step_mask(inputs, b, seq)  # packed: per-sample causal
    try:
        args, kwargs = recipe.megatron_layer_call(x, (cos, sin), inputs, allowed)
    except NotImplementedError:
        raise _Unmapped(f"recipe {recipe.name!r} builds no HF call for a decoder layer (megatron_layer_call)") from None
    return _entry(meta, name, role, sp and len(ranks) > 1, (args, kwargs), x, y, gy, gx)


def _entry(meta: dict, name: str, role: str, concat: bool, call: tuple, x, y, gy, gx) -> tuple[dict, dict]:
    """The HF module's recorded call (capture/modules.py's form): inputs as a pytree of ``call``, the
    output, its gradient and the gradient of the input ``x``."""
    flat, spec = tree_flatten(call)
    hidx = next(i for i, v in enumerate(flat) if v is x)
    tensors = {f"in.{i}": v for i, v in enumerate(flat) if isinstance(v, torch.Tensor)}
    tensors.update({"out.0": y, "gout.0": gy})
    if gx is not None:
        tensors[f"gin.{hidx}"] = gx
    entry = {
        "calls": meta.get("calls", 1), "order": meta.get("order"), "in_spec": treespec_dumps(spec),
        "in_static": {str(i): v for i, v in enumerate(flat) if not isinstance(v, torch.Tensor) and isinstance(v, JSONABLE)},
        "grad_in": [hidx] if gx is not None else [], "grad_out": [0],
        "megatron": {"module": name, "call": {"layer": "decoder_layer"}.get(role, role),
                     "sequence_parallel_concat": bool(concat), "heads_concat": role == "heads"},
    }  # fmt: skip
    for k in ("no_grad_calls", "recomputed_calls"):
        if k in meta:
            entry[k] = meta[k]
    return entry, tensors


def merge_boundaries(
    chosen: dict, info: dict, recipe, inputs: dict[str, torch.Tensor], sp: bool, seq: int,
    sink: Callable[[str, dict[str, torch.Tensor]], None],
) -> tuple[dict, dict]:  # fmt: skip
    """-> (``manifest["modules"]`` under HF names, the record for ``megatron.boundaries``); each mapped
    module's tensors go to ``sink(group, tensors)`` as soon as they are merged (one module held at a time:
    at 8B and 65536 tokens the 36 layers' boundaries are 81 GiB)."""
    d0, tp, pp = info["dps"][0], info["tp"], info["pp"]
    recorded = [chosen[d0, p, t].manifest.get("modules") or {} for p in range(pp) for t in range(tp)]
    if not any(recorded):
        return {}, {}
    record: dict[str, Any] = {"mapped": {}, "unmapped": []}
    if info["stage"] != "pre-finalize":
        record["unmapped"] = [{"module": n, "why": "boundaries are merged from pre-finalize bundles only: after finalize "
                               "the parameter gradients are reduced and divided by the token count, the recorded "
                               "grad_outputs are not (merge DIR/pre for local replay)"} for n in sorted(recorded[0])]  # fmt: skip
        return {}, record
    table = getattr(recipe, "megatron_modules", None) or {}
    names = NameMap(table) if table else None
    modules: dict[str, dict] = {}
    order_base = 0
    for p in range(pp):
        ranks = [chosen[d0, p, t] for t in range(tp)]
        here = [set(b.manifest.get("modules") or {}) for b in ranks]
        offset = int(ranks[0].manifest["megatron"].get("layer_offset") or 0)
        local_orders = []
        first = ranks[0].manifest.get("modules") or {}
        for name in sorted(set().union(*here), key=lambda n: (first.get(n, {}).get("order") or 0, n)):
            local = strip_wrappers(name)
            gname = _LAYER.sub(lambda m, o=offset: f"{m[1]}{int(m[2]) + o}", local) if offset else local
            try:
                if any(name not in s for s in here):
                    raise _Unmapped(f"recorded on some TP ranks of stage {p} only")
                if names is None:
                    raise _Unmapped(f"recipe {recipe.name!r} has no megatron_modules table")
                inside = _BELOW.search(gname) is not None
                if inside:
                    _role(gname, ranks)  # a module no single HF module matches: unmapped, with why
                try:
                    hf = names.to_hf(gname)[0]
                except RecipeError:
                    raise _Unmapped(f"recipe {recipe.name!r} maps no HF module to it (megatron_modules)" if inside else
                                    "only decoder layers (TransformerLayer), their sub-modules and the Hugging Face "
                                    f"modules recipe {recipe.name!r} maps (megatron_modules) are mapped") from None  # fmt: skip
                entry, tensors = _layer(name, hf, ranks, sp, inputs, recipe, seq)
                norm = _fused_norm(gname, ranks) if inside else None
                if norm:  # its input is the hidden states before the fused norm: replayed as the HF norm, then it
                    try:
                        entry["through"] = names.to_hf(norm)[0]
                    except RecipeError:
                        raise _Unmapped(f"its input norm is fused into it and recipe {recipe.name!r} maps no HF module to "
                                        f"{norm} (megatron_modules)") from None  # fmt: skip
            except _Unmapped as e:
                record["unmapped"].append({"module": gname, "why": str(e)})
                continue
            if entry.get("order") is not None:
                local_orders.append(entry["order"])
                entry["order"] += order_base
            modules[hf] = entry
            sink(group_name(hf), tensors)
            del tensors
            record["mapped"][hf] = gname
        order_base += (max(local_orders) + 1) if local_orders else 0
    return modules, record
