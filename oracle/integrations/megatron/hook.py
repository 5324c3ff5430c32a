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
given, untied embeddings, sequence length, parallel sizes). MindSpeed registers parameters in
another order under the same names; nothing here depends on the order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...bundle.store import BundleWriter
from ...capture.api import describe_device, gradient_of, versions
from ...precision import name_of_param_dtype
from .layout import VOCAB_DIVISIBLE_BY

STAGES = ("pre-finalize", "post-finalize")
_CONFIG_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                  "ffn_hidden_size", "gated_linear_unit", "qk_layernorm", "normalization", "layernorm_epsilon",
                  "add_bias_linear", "add_qkv_bias", "rotary_base", "sequence_parallel", "tensor_model_parallel_size",
                  "pipeline_model_parallel_size", "context_parallel_size", "calculate_per_token_loss")  # fmt: skip
_MODEL_FIELDS = ("vocab_size", "share_embeddings_and_output_weights", "rotary_base", "rotary_percent",
                 "max_sequence_length", "position_embedding_type")  # fmt: skip
_LAYER = re.compile(r"layers\.(\d+)$")


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


def _language_model(model: nn.Module) -> nn.Module | None:
    """The GPTModel inside DDP / Float16Module wrappers (or inside a multimodal model)."""
    return next(
        (m for m in model.modules() if hasattr(m, "vocab_size") and hasattr(m, "share_embeddings_and_output_weights")), None
    )


def _config_of(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    lm = _language_model(model)
    cfg = getattr(lm, "config", None) or next((m.config for m in model.modules() if hasattr(m, "config")), None)
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


def capture_rank(
    model: nn.Module,
    out: str | Path,
    *,
    stage: str,
    batch: Mapping[str, Any],
    loss: float | torch.Tensor | None = None,
    num_tokens: int | None = None,
    calculate_per_token_loss: bool | None = None,
    vocab_size: int | None = None,
    make_vocab_size_divisible_by: int = VOCAB_DIVISIBLE_BY,
    packed_seq_params: Any = None,
    coords: Mapping[str, int] | None = None,
    precision: str | None = None,
    overwrite: bool = False,
) -> Path:
    """``loss``: what this rank's backward differentiated (the token-loss sum with
    ``calculate_per_token_loss``, else the mean); ``num_tokens``: this rank's loss tokens;
    ``vocab_size``: the tokenizer's true vocabulary (the model holds only the padded one);
    ``calculate_per_token_loss``: default from the model's TransformerConfig."""
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
    config = _config_of(model, batch)
    if calculate_per_token_loss is None:
        calculate_per_token_loss = bool(config.get("calculate_per_token_loss", True))
    if vocab_size is not None:
        config["true_vocab_size"] = int(vocab_size)
    config["make_vocab_size_divisible_by"] = make_vocab_size_divisible_by
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
                "calculate_per_token_loss": calculate_per_token_loss,
                "num_tokens": num_tokens,
                "loss_as_given": given,
                "layer_offset": _layer_offset(model),
                "config": config,
                "layout": layout,
            },  # fmt: skip
        )
        w.add("inputs", {**{k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}, **_packed(batch, packed_seq_params)})
        w.add("weights", {n: p.detach() for n, p in params.items()})
        w.add("grads", {n: gradient_of(p) for n, p in params.items() if gradient_of(p) is not None})
    return path
