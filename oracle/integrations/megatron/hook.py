"""One call inside a Megatron training step that writes this rank's view of the step.

    # right after the backward in forward_backward_no_pipelining (stage "pre-finalize"),
    # or after finalize_model_grads (stage "post-finalize"):
    from oracle.megatron.hook import capture_rank
    capture_rank(model, f"step/{stage}", stage="pre-finalize", batch=batch, loss=loss,
                 num_tokens=int(loss_mask.sum()), vocab_size=tokenizer.vocab_size,
                 packed_seq_params=packed_seq_params)

It reads, never writes: each parameter's ``main_grad`` (else ``.grad``) and value are copied to
CPU; the step's numbers are untouched. Per rank it writes ``OUT/rank{global rank:05d}``, an
ordinary bundle holding the rank's shards under their mcore names, the batch (tokens, labels,
loss mask, position ids, pixel values, image grid: whatever tensors ``batch`` holds; packed
sequences' ``cu_seqlens_q`` as ``cu_seqlens``), and in ``manifest["megatron"]``: TP/SP/PP/DP
coordinates, the stage, the loss convention, each parameter's partition attributes, the layer
offset of this pipeline stage, and ``config``: what a replay needs from the TransformerConfig and
the model (heads, query groups, kv channels, ffn, gated linear unit, activation, qk-layernorm,
normalisation and epsilon, rotary base and percent, padded vocabulary and the true one when
given, untied embeddings, sequence length, parallel sizes). From the run itself (runinfo.py):
``hf_config`` (the model's own Hugging Face config where it holds one, ms-swift's vision wrapper
does), ``vocab`` (padded vs true, and how that was decided), ``labels`` (pre-rolled, unshifted or
ambiguous, with the evidence), ``numerics`` (fusions, recompute, attention backend, mRoPE section,
MindSpeed's flags from the training arguments) and ``seq_lengths`` (what the attention kernel
received); per parameter its owner class and whether it is a replicated transformers module.
MindSpeed registers parameters in another order under the same names; nothing here depends on
the order.

Module boundaries (``modules=``, a :class:`ModuleRecorder` from :func:`record_modules`, entered
before the step's forward): each selected module's inputs, outputs, grad_outputs and grad_inputs
as the rank saw them (sequence-parallel ranks: their own s/TP rows), recorded on the grad-enabled
call (under full recompute: the recomputation inside the backward), go into the bundle as
``mod.<mcore name>`` groups with ``manifest["modules"]`` (oracle/capture/modules.py), and
``manifest["megatron"]["modules"]`` names each call's tensor leaves by keyword (``hidden_states``,
``rotary_pos_emb``, ...) so that merge can map them onto the Hugging Face module's call without
reading a pytree spec written by another torch.
"""

from __future__ import annotations

import difflib
import itertools
import re
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...bundle.store import BundleWriter
from ...capture.api import describe_device, gradient_of, versions
from ...capture.modules import ModuleRecorder, select
from ...precision import name_of_param_dtype
from . import microbatches
from .layout import padded_vocab
from .runinfo import hf_config_of, label_convention, numerics_of, param_origins, rope_of, seq_lengths

STAGES = ("pre-finalize", "post-finalize")
_CONFIG_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                  "ffn_hidden_size", "gated_linear_unit", "qk_layernorm", "normalization", "layernorm_epsilon",
                  "add_bias_linear", "add_qkv_bias", "rotary_base", "sequence_parallel", "tensor_model_parallel_size",
                  "pipeline_model_parallel_size", "context_parallel_size", "calculate_per_token_loss")  # fmt: skip
_MODEL_FIELDS = ("vocab_size", "share_embeddings_and_output_weights", "rotary_base", "rotary_percent",
                 "max_sequence_length", "position_embedding_type")  # fmt: skip
_LAYER = re.compile(r"layers\.(\d+)$")
#: Module selections by mcore name (``ORACLE_CAPTURE_MODULES``, ``record_modules``): preset -> regex.
#: ``layers``: the decoder layers (``...decoder.layers.N``, the language model's TransformerLayers).
MODULE_PRESETS = {"layers": r"(^|\.)decoder\.layers\.\d+$",  # the decoder layers (TransformerLayer)
                  "vit": r"(^|\.)visual\.blocks\.\d+$"}  # a vision tower's blocks (ms-swift's Qwen3-VL: the HF ViT)


def module_selection(model: nn.Module, selection: str) -> list[str]:
    """``selection``: comma-separated presets (``MODULE_PRESETS``), else one regex searched in the
    model chunk's module names (wrappers' ``module.`` prefixes included). ValueError when it is not
    a valid regex or selects nothing (the message lists a few names to choose from)."""
    parts = [x.strip() for x in selection.split(",") if x.strip()]
    if parts and all(x in MODULE_PRESETS for x in parts):
        pattern = "|".join(f"(?:{MODULE_PRESETS[x]})" for x in parts)
    else:
        near = [p for x in parts for p in difflib.get_close_matches(x, MODULE_PRESETS, n=1, cutoff=0.75) if p != x]
        if near and all(re.fullmatch(r"[A-Za-z_]+", x) for x in parts):  # 'layer' for 'layers': a typo, not a regex
            raise ValueError(f"module selection {selection!r} is no preset: did you mean {', '.join(near)!r}? (a regex "
                             "over module names is taken when it is not a near-miss of a preset: write it as one, "
                             "e.g. 'layers\\.\\d+$')")  # fmt: skip
        pattern = selection
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"module selection {selection!r} is neither a preset ({', '.join(MODULE_PRESETS)}) nor a "
                         f"valid regex ({e})") from None  # fmt: skip
    names = select(model, pattern)
    if not names:
        some = [n for n, _ in model.named_modules() if n][:6]
        raise ValueError(f"module selection {selection!r} matches no module of the model chunk (its names look like "
                         f"{some}); use a preset ({', '.join(MODULE_PRESETS)}) or a regex over these names")  # fmt: skip
    return names


def record_modules(model: nn.Module, selection: str, *, budget_mb: float | None = None) -> ModuleRecorder:
    """A started :class:`ModuleRecorder` over ``model``'s modules selected by ``selection`` (see
    ``module_selection``); start it before the step's forward, pass it to ``capture_rank(modules=)``
    after the backward, and ``close()`` it after the step. It only observes: the step's gradients
    are bitwise those without it."""
    names = module_selection(model, selection)
    budget = None if budget_mb is None else int(budget_mb * 2**20)
    return ModuleRecorder(model, names, budget_bytes=budget).__enter__()


def _leaf_names(meta: dict[str, Any]) -> dict[str, int]:
    """Keyword (or ``argN``, nested ``key.j``) -> pytree leaf index of one recorded call's inputs."""
    from torch.utils._pytree import tree_unflatten, treespec_loads

    spec = treespec_loads(meta["in_spec"])
    args, kwargs = tree_unflatten(list(range(spec.num_leaves)), spec)
    out: dict[str, int] = {}

    def walk(key: str, v: Any) -> None:
        if isinstance(v, int):
            out[key] = v
        elif isinstance(v, (tuple, list)):
            for j, x in enumerate(v):
                walk(f"{key}.{j}", x)
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{key}.{k}", x)

    for i, a in enumerate(args):
        walk(f"arg{i}", a)
    for k, v in kwargs.items():
        walk(str(k), v)
    return out


def parallel_coords() -> dict[str, int]:
    """TP/PP/DP coordinates from megatron.core.parallel_state (raises if it is not initialised)."""
    from megatron.core import parallel_state as ps

    return {
        "rank": torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
        "tp_rank": ps.get_tensor_model_parallel_rank(), "tp_size": ps.get_tensor_model_parallel_world_size(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(), "pp_size": ps.get_pipeline_model_parallel_world_size(),
        "dp_rank": ps.get_data_parallel_rank(), "dp_size": ps.get_data_parallel_world_size(),
        "cp_size": ps.get_context_parallel_world_size(),
    }  # fmt: skip


def run_id() -> str | None:
    """An id every rank of one torch.distributed run shares, and another run never does: the first
    rank to ask puts a random one in the process group's store (``compare_set``: atomic, one round
    trip, never waits for other ranks), every later ask reads it. Merge compares it, so ranks of two
    runs are told apart even without a loss. None without torch.distributed (or a store that cannot)."""
    try:
        if not torch.distributed.is_initialized():
            return None
        store = torch.distributed.distributed_c10d._get_default_store()
        value = store.compare_set("oracle/run_id", "", uuid.uuid4().hex)
        return value.decode() if isinstance(value, bytes) else str(value)
    except Exception:  # noqa: BLE001  (an id we cannot get is no reason to fail a capture)
        return None


def _language_model(model: nn.Module) -> nn.Module | None:
    """The GPTModel inside DDP / Float16Module wrappers (or inside a multimodal model)."""
    return next(
        (m for m in model.modules() if hasattr(m, "vocab_size") and hasattr(m, "share_embeddings_and_output_weights")), None
    )


def _transformer_config(model: nn.Module) -> Any:
    lm = _language_model(model)
    return getattr(lm, "config", None) or next((m.config for m in model.modules() if hasattr(m, "config")), None)


def _config_of(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    lm = _language_model(model)
    cfg = _transformer_config(model)
    out: dict[str, Any] = {k: getattr(cfg, k) for k in _CONFIG_FIELDS if cfg is not None and hasattr(cfg, k)}
    act = getattr(cfg, "activation_func", None)
    if act is not None:
        out["activation"] = getattr(act, "__name__", type(act).__name__)
    if lm is not None:
        out.update({k: getattr(lm, k) for k in _MODEL_FIELDS if hasattr(lm, k)})
    tokens = batch.get("tokens", batch.get("input_ids"))
    if isinstance(tokens, torch.Tensor):
        out["seq_length"] = int(tokens.shape[-1])
    return {k: v for k, v in out.items() if isinstance(v, (bool, int, float, str, type(None)))}


def _layer_offset(model: nn.Module) -> int:
    """Global index of this stage's first decoder layer: mcore's 1-based ``layer_number`` minus the
    local index in the parameter names (0 without pipeline parallelism)."""
    offsets = {int(m.layer_number) - 1 - int(rx[1]) for n, m in model.named_modules()
               if hasattr(m, "layer_number") and (rx := _LAYER.search(n))}  # fmt: skip
    if len(offsets) > 1:
        raise ValueError(f"decoder layers of one stage disagree on their offset: {sorted(offsets)}")
    return offsets.pop() if offsets else 0


def _packed(batch: Mapping[str, Any], packed_seq_params: Any) -> dict[str, torch.Tensor]:
    """Packed-sequence boundaries (megatron.core.packed_seq_params.PackedSeqParams), as ``cu_seqlens``."""
    psp = packed_seq_params or next((v for v in batch.values() if hasattr(v, "cu_seqlens_q")), None)
    if psp is None:
        return {}
    out = {"cu_seqlens": psp.cu_seqlens_q.detach().cpu()}
    if getattr(psp, "cu_seqlens_q_padded", None) is not None:
        out["cu_seqlens_padded"] = psp.cu_seqlens_q_padded.detach().cpu()
    return out


def _vocab(rows: int | None, hf: dict | None, tokenizer: int | None, divisible_by: int | None, tp: int) -> dict[str, Any]:
    """Padded vs true vocabulary, from what the run shows. The model's ``rows`` are Vp. The run's own
    HF config's ``vocab_size`` equal to Vp means no padding (ms-swift sets ``padded_vocab_size`` to
    it); a smaller tokenizer size is then kept apart, its extra rows being real tokens. Otherwise a
    tokenizer size that Megatron-LM's padding rule turns into Vp is the true vocabulary; a size the
    rule does not turn into Vp makes no row padding."""
    text = (hf or {}).get("text_config") or hf or {}
    hf_v = text.get("vocab_size") or (hf or {}).get("vocab_size")
    out: dict[str, Any] = {"rows": rows, "tokenizer": tokenizer, "hf_config": hf_v, "divisible_by": divisible_by}
    if rows is None:
        return {**out, "true": tokenizer, "padding": "unknown", "how": "the model records no vocabulary size"}
    if hf_v == rows:
        return {**out, "true": rows, "padding": "none", "how": f"the run's HF config has vocab_size {hf_v} = the embedding's rows"}
    if tokenizer is not None and divisible_by and padded_vocab(tokenizer, tp, divisible_by) == rows:
        return {**out, "true": tokenizer, "padding": "megatron",
                "how": f"{tokenizer} padded to a multiple of {divisible_by} x TP {tp} = {rows}"}  # fmt: skip
    if tokenizer is not None and tokenizer != rows:
        rule = f"make_vocab_size_divisible_by {divisible_by}" if divisible_by else "no make_vocab_size_divisible_by"
        return {**out, "true": rows, "padding": "none", "how": f"the tokenizer's {tokenizer} does not pad to {rows} rows "
                f"at TP {tp} ({rule}): every row is taken as a real token"}  # fmt: skip
    return {**out, "true": rows, "padding": "none", "how": "no padding recorded: every row is a real token"}


def _labels(mbs: list[Mapping[str, Any]], given: str | None) -> dict[str, Any]:
    """The label convention of the step: one micro-batch's, or the micro-batches' when they agree
    (else ``ambiguous``, which merge refuses with the fix)."""
    found = [label_convention(b, given) for b in mbs]
    if len(found) == 1:
        return found[0]
    values = {f["labels_shift"] for f in found}
    if len(values) == 1:
        return {**found[0], "how": f"{len(found)} micro-batches agree; micro-batch 0: {found[0]['how']}"}
    return {"labels_shift": "ambiguous",
            "how": "micro-batches disagree: " + "; ".join(f"mb{i} {f['labels_shift']}" for i, f in enumerate(found))}


def _seq_lengths(mbs: list[Mapping[str, Any]], packs: list[dict[str, torch.Tensor]]) -> dict[str, Any] | None:
    """``seq_lengths`` of the step: each micro-batch's, its lists concatenated in micro-batch order."""
    per = [seq_lengths(pk.get("cu_seqlens"), b.get("labels"), b.get("tokens", b.get("input_ids"))) for b, pk in zip(mbs, packs)]
    if len(per) == 1 or any(x is None for x in per):
        return per[0]
    lengths = [n for x in per for n in x["lengths"]]
    out: dict[str, Any] = {"packed": per[0]["packed"], "lengths": lengths,
                           "one_token_samples": sum(x["one_token_samples"] for x in per), "microbatches": len(per)}  # fmt: skip
    if out["packed"]:  # the merged row's boundaries (microbatches.combine shifts each micro-batch's the same way)
        out["cu_seqlens"] = [0, *itertools.accumulate(lengths)]
    return out


def capture_rank(
    model: nn.Module,
    out: str | Path,
    *,
    stage: str,
    batch: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    loss: float | torch.Tensor | None = None,
    num_tokens: int | None = None,
    microbatch_tokens: Sequence[int | None] | None = None,
    calculate_per_token_loss: bool | None = None,
    vocab_size: int | None = None,
    make_vocab_size_divisible_by: int | None = None,
    packed_seq_params: Any = None,
    coords: Mapping[str, int] | None = None,
    precision: str | None = None,
    labels_shift: str | None = None,
    args: Any = None,
    modules: ModuleRecorder | None = None,
    overwrite: bool = False,
) -> Path:
    """``loss``: what this rank's backward differentiated (the token-loss sum with
    ``calculate_per_token_loss``, else the mean); ``num_tokens``: this rank's loss tokens;
    ``vocab_size``: the tokenizer's vocabulary, and ``make_vocab_size_divisible_by`` Megatron-LM's
    padding rule, when the run padded (see ``_vocab``; ms-swift does not pad);
    ``calculate_per_token_loss``: default from the model's TransformerConfig; ``labels_shift``:
    ``pre-rolled`` / ``unshifted`` when the caller knows it (else detected from the batch, see
    runinfo.py); ``args``: the training arguments (default Megatron-LM's ``get_args()``);
    ``modules``: a recorder from ``record_modules``, started before the forward (its boundaries are
    written into the bundle; see the module docstring). ``batch``: a list of batches for a step of
    several micro-batches (gradient accumulation: the gradients are their sum; ``loss`` and
    ``num_tokens`` the step's, ``microbatch_tokens`` each one's loss tokens), stored as
    ``mb{i}.NAME`` and merged into one batch by merge (microbatches.py)."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}")
    c = dict(coords) if coords is not None else parallel_coords()
    path = Path(out) / f"rank{c['rank']:05d}"
    params = dict(model.named_parameters())
    layout = {
        n: {
            "tensor_model_parallel": bool(getattr(p, "tensor_model_parallel", False)),
            "partition_dim": int(getattr(p, "partition_dim", -1)),
            "partition_stride": int(getattr(p, "partition_stride", 1)),
            "sequence_parallel": bool(getattr(p, "sequence_parallel", False)),
        }  # fmt: skip
        for n, p in params.items()
    }
    for n, o in param_origins(model).items():
        if n in layout:
            layout[n].update(o)
    mbs = [batch] if isinstance(batch, Mapping) else list(batch)
    if not mbs:
        raise ValueError("batch: an empty list of micro-batches")
    config = _config_of(model, mbs[0])
    if calculate_per_token_loss is None:
        calculate_per_token_loss = bool(config.get("calculate_per_token_loss", True))
    hf = hf_config_of(model)
    numerics = {**numerics_of(_transformer_config(model), args), **rope_of(hf)}
    run_args = numerics.get("args") or {}
    if make_vocab_size_divisible_by is None and run_args.get("make_vocab_size_divisible_by"):
        make_vocab_size_divisible_by = int(run_args["make_vocab_size_divisible_by"])
    vocab = _vocab(config.get("vocab_size"), hf, vocab_size, make_vocab_size_divisible_by, c.get("tp_size", 1))
    if vocab.get("true") is not None:
        config["true_vocab_size"] = vocab["true"]
    if make_vocab_size_divisible_by is not None:
        config["make_vocab_size_divisible_by"] = make_vocab_size_divisible_by
    packs = [_packed(b, packed_seq_params if len(mbs) == 1 else None) for b in mbs]
    dtype = next(iter(params.values())).dtype
    if isinstance(loss, torch.Tensor):
        loss = float(loss.detach().float().item())
    given = loss
    reduction = "sum" if calculate_per_token_loss and stage == "pre-finalize" else "mean"
    if loss is not None and calculate_per_token_loss and reduction == "mean" and num_tokens:
        loss = loss / num_tokens  # ``loss`` is the token-loss sum the backward saw; finalize divided the grads
    with BundleWriter(path, "capture", overwrite=overwrite) as w:
        w.manifest.update(
            recipe={"name": None, "config": {}},
            precision=precision or name_of_param_dtype(dtype),
            device=describe_device(next(iter(params.values())).device),
            versions=versions(),
            loss={"value": loss, "reduction": reduction, "num_tokens": num_tokens},
            megatron={
                "stage": stage,
                "coords": c,
                "run_id": run_id(),
                "calculate_per_token_loss": calculate_per_token_loss,
                "num_tokens": num_tokens,
                "loss_as_given": given,
                "layer_offset": _layer_offset(model),
                "config": config,
                "layout": layout,
                "hf_config": hf,
                "vocab": vocab,
                "labels": _labels(mbs, labels_shift),
                "numerics": numerics,
                "seq_lengths": _seq_lengths(mbs, packs),
            },  # fmt: skip
        )
        if len(mbs) > 1:
            counts = list(microbatch_tokens) if microbatch_tokens is not None else [None] * len(mbs)
            w.manifest["megatron"]["microbatches"] = [{"num_tokens": n} for n in counts]
        tensors = [{**{k: v for k, v in b.items() if isinstance(v, torch.Tensor)}, **pk} for b, pk in zip(mbs, packs)]
        w.add("inputs", tensors[0] if len(mbs) == 1 else microbatches.names(tensors))
        w.add("weights", {n: p.detach() for n, p in params.items()})
        w.add("grads", {n: gradient_of(p) for n, p in params.items() if gradient_of(p) is not None})
        if modules is not None:
            recorded = modules.manifest()
            w.manifest["modules"] = recorded
            w.manifest["megatron"]["modules"] = {
                "selected": list(modules.names), "over_budget": list(modules.over_budget),
                "leaves": {n: _leaf_names(m) for n, m in recorded.items() if "in_spec" in m},
            }  # fmt: skip
            for g, tensors in modules.groups().items():
                w.add(g, tensors)
    return path
