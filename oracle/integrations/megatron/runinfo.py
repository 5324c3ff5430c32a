"""What the hook reads from the run itself, beyond the tensors: the model's own Hugging Face
config, which parameters are transformers modules replicated on every TP rank, the label
convention of the batch, the settings that change numerics, and the sequence lengths the
attention kernel received. Everything here only reads attributes; nothing is guessed silently
(an undecidable label convention is recorded as ``ambiguous``, with the counts).

Replicated transformers modules (structure, not names): a parameter inside a module whose class
comes from the ``transformers`` package, or inside a wrapper holding a transformers model
(megatron-core's / ms-swift's ``HuggingFaceModule``: ``_hf_model``), and that carries no
``tensor_model_parallel`` mark, is the same full tensor on every TP rank in transformers'
layout (ms-swift 3.12's Qwen3-VL vision tower). Merge copies it and never splits it by name.

Label convention, decided from the batch on the loss positions L = {t: labels[t] != -100 (and
loss_mask[t] > 0 where given)}:
    pre-rolled   labels[t] == tokens[t+1] for every t in L (t < T-1), and not labels == tokens on L
                 (Megatron / ms-swift ``get_batch``: ``torch.roll(labels, -1)``); the loss is
                 CE(logits[t], labels[t]), no further shift
    unshifted    labels[t] == tokens[t] on L, and not the above (Hugging Face: the loss shifts)
    ambiguous    both or neither hold (e.g. a repeated token); the caller must say which
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

IGNORE = -100
LABEL_SHIFTS = ("pre-rolled", "unshifted")
# TransformerConfig / ModelParallelConfig fields that change the step's numerics
NUMERICS_FIELDS = ("mrope_section", "apply_rope_fusion", "rotary_interleaved", "cross_entropy_loss_fusion",
                   "cross_entropy_fusion_impl", "gradient_accumulation_fusion", "recompute_granularity",
                   "recompute_method", "recompute_num_layers", "recompute_modules", "distribute_saved_activations",
                   "attention_backend", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                   "persist_layer_norm", "memory_efficient_layer_norm", "apply_query_key_layer_scaling",
                   "attention_softmax_in_fp32", "fp16", "bf16", "params_dtype", "deterministic_mode",
                   "fp8", "apply_residual_connection_post_layernorm", "layernorm_zero_centered_gamma")  # fmt: skip
# training arguments (Megatron-LM / ms-swift / MindSpeed ``get_args()``) that change numerics
ARG_RX = re.compile(r"^(use_fused_\w+|use_flash_attn|use_npu\w*|npu_\w+|use_ascend\w*|use_mc2|attn_impl|"
                    r"cross_entropy_\w+|\w*_fusion|recompute_\w+|attention_backend|packing|padding_free|"
                    r"use_distributed_optimizer|accumulate_allreduce_grads_in_fp32|loss_scale|"
                    r"calculate_per_token_loss|sequence_parallel|padded_vocab_size|make_vocab_size_divisible_by)$")  # fmt: skip


def _jsonable(v: Any) -> Any:
    if isinstance(v, (bool, int, float, str, type(None))):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str, type(None))) for x in v):
        return list(v)
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    if hasattr(v, "name") and type(v).__module__ != "builtins":  # an enum (AttnBackend.local)
        return str(v.name)
    return None


def hf_config_of(model: nn.Module) -> dict[str, Any] | None:
    """The Hugging Face config the run's model was built from, if the model holds one: ms-swift's
    ``HuggingFaceModule.model_config``, an ``hf_config`` attribute, or a transformers model's ``config``."""
    for m in model.modules():
        for attr in ("hf_config", "model_config"):
            cfg = getattr(m, attr, None)
            if cfg is not None and hasattr(cfg, "to_dict"):
                return json.loads(json.dumps(cfg.to_dict(), default=str))
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if type(m).__module__.startswith("transformers.") and hasattr(cfg, "to_dict") and getattr(cfg, "model_type", None):
            return json.loads(json.dumps(cfg.to_dict(), default=str))
    return None


def param_origins(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Per parameter name: ``owner`` (the class of the module that holds it), ``hf_module`` (the
    outermost transformers module or HF wrapper above it, or None) and ``replica`` (held whole on
    every TP rank in transformers' layout, see the module docstring)."""
    out: dict[str, dict[str, Any]] = {}

    def walk(mod: nn.Module, prefix: str, within: str | None) -> None:
        cls = type(mod)
        if within is None and (cls.__module__.startswith("transformers.") or hasattr(mod, "_hf_model")
                               or any(c.__name__ == "HuggingFaceModule" for c in cls.__mro__)):  # fmt: skip
            within = f"{cls.__module__}.{cls.__qualname__}"  # the subtree is a transformers module
        for n, p in mod.named_parameters(recurse=False):
            name = prefix + n
            if name not in out:
                out[name] = {"owner": f"{cls.__module__}.{cls.__qualname__}", "hf_module": within,
                             "replica": within is not None and not getattr(p, "tensor_model_parallel", False)}  # fmt: skip
        for cn, child in mod.named_children():
            walk(child, f"{prefix}{cn}.", within)

    walk(model, "", None)
    return out


def label_convention(batch: Mapping[str, Any], given: str | None = None) -> dict[str, Any]:
    """-> {"labels_shift": pre-rolled | unshifted | ambiguous | none, "how": the evidence}."""
    if given is not None and given not in LABEL_SHIFTS:
        raise ValueError(f"labels_shift must be one of {LABEL_SHIFTS}, not {given!r}")
    tokens, labels = batch.get("tokens", batch.get("input_ids")), batch.get("labels")
    if not isinstance(tokens, torch.Tensor) or not isinstance(labels, torch.Tensor) or tokens.shape != labels.shape:
        found = {"labels_shift": "none", "how": "the batch holds no labels of the tokens' shape"}
    else:
        tok, lab = tokens.detach().cpu().long(), labels.detach().cpu().long()
        loss = lab != IGNORE
        mask = batch.get("loss_mask")
        if isinstance(mask, torch.Tensor) and mask.shape == lab.shape:
            loss &= mask.detach().cpu() > 0
        inner = loss[..., :-1]  # (B, T-1): positions with a next token
        n, n_all = int(inner.sum()), int(loss.sum())
        rolled = int((lab[..., :-1] == tok[..., 1:])[inner].sum())
        same = int((lab == tok)[loss].sum())
        is_rolled, is_same = n > 0 and rolled == n, n_all > 0 and same == n_all
        value = "pre-rolled" if is_rolled and not is_same else "unshifted" if is_same and not is_rolled else "ambiguous"
        found = {"labels_shift": value, "how": f"detected on {n_all} loss positions: labels[t] == tokens[t+1] on "
                 f"{rolled}/{n}, labels[t] == tokens[t] on {same}/{n_all}"}  # fmt: skip
    if given is None:
        return found
    return {"labels_shift": given, "how": f"given by the caller ({found['how']}: {found['labels_shift']})",
            "detected": found["labels_shift"]}  # fmt: skip


def numerics_of(config: Any, args: Any = None) -> dict[str, Any]:
    """The settings that change numerics: TransformerConfig fields, then the training arguments
    (``args``, else Megatron-LM's ``get_args()`` where it is initialised; MindSpeed's flags are
    among them), each only where present."""
    out: dict[str, Any] = {}
    for k in NUMERICS_FIELDS:
        if config is not None and hasattr(config, k):
            out[k] = _jsonable(getattr(config, k))
    if args is None:
        try:
            from megatron.training import get_args  # Megatron-LM / ms-swift / MindSpeed-LLM

            args = get_args()
        except Exception:  # no training package, or not initialised: the config alone
            args = None
    if args is not None:
        found = {k: _jsonable(v) for k, v in sorted(vars(args).items()) if ARG_RX.match(k)}
        out["args"] = {k: v for k, v in found.items() if v is not None or k.startswith("recompute")}
    try:
        import mindspeed  # noqa: F401  (present on Ascend)

        out["mindspeed"] = getattr(mindspeed, "__version__", "present")
    except ImportError:
        pass
    return out


def rope_of(hf: dict[str, Any] | None) -> dict[str, Any]:
    """mRoPE section and interleaving from the run's HF config (``rope_scaling`` in transformers 4,
    ``rope_parameters`` in 5); {} when it records none."""
    text = (hf or {}).get("text_config") or hf or {}
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        return {}
    return {f"hf_{k}": rope[k] for k in ("mrope_section", "mrope_interleaved", "rope_type") if k in rope}


def seq_lengths(cu_seqlens: torch.Tensor | None, labels: torch.Tensor | None = None,
                tokens: torch.Tensor | None = None) -> dict[str, Any] | None:  # fmt: skip
    """The sequence-length list the attention kernel received (cu_seqlens differences; MindSpeed's
    ``actual_seq_qlen`` is cu_seqlens itself) and how many are 1-token samples (packing with SP
    padding makes each pad token its own sample); unpacked: one row per sample."""
    if cu_seqlens is None:
        if tokens is None or tokens.dim() != 2:
            return None
        return {"packed": False, "lengths": [int(tokens.shape[1])] * int(tokens.shape[0]), "one_token_samples": 0}
    cu = cu_seqlens.detach().cpu().long().reshape(-1)
    lengths = (cu[1:] - cu[:-1]).tolist()
    out = {"packed": True, "cu_seqlens": cu.tolist(), "lengths": lengths,
           "one_token_samples": sum(1 for n in lengths if n == 1)}  # fmt: skip
    if labels is not None and out["one_token_samples"]:
        flat = labels.detach().cpu().reshape(-1)
        starts = [int(a) for a, n in zip(cu[:-1].tolist(), lengths) if n == 1 and int(a) < flat.numel()]
        out["one_token_samples_without_loss"] = sum(1 for a in starts if int(flat[a]) == IGNORE)
    return out
