"""One call inside a Megatron training step that writes this rank's view of the step.

    # right after the backward in forward_backward_no_pipelining (stage "pre-finalize"),
    # or after finalize_model_grads (stage "post-finalize"):
    from oracle.megatron import capture_rank
    capture_rank(model, f"step/{stage}", stage="pre-finalize", batch=batch,
                 num_tokens=int(loss_mask.sum()), calculate_per_token_loss=True)

It reads, never writes: each parameter's ``main_grad`` (else ``.grad``) and value are copied to
CPU; the step's numbers are untouched. Per rank it writes ``OUT/rank{global rank:05d}``, an
ordinary bundle holding the rank's shards under their mcore names, the batch (tokens, labels,
loss mask, position ids, packed-sequence boundaries, pixel values, image grid: whatever tensors
``batch`` holds), and in ``manifest["megatron"]``: TP/SP/PP/DP coordinates, the stage, the loss
convention, and each parameter's partition attributes. MindSpeed registers parameters in another
order under the same names; nothing here depends on the order.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..bundle import BundleWriter
from ..capture import describe_device, gradient_of, versions
from ..precision import name_of_param_dtype

STAGES = ("pre-finalize", "post-finalize")
_CONFIG_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                  "ffn_hidden_size", "gated_linear_unit", "qk_layernorm", "layernorm_epsilon",
                  "sequence_parallel", "tensor_model_parallel_size", "calculate_per_token_loss")  # fmt: skip


def parallel_coords() -> dict[str, int]:
    """TP/PP/DP coordinates from megatron.core.parallel_state (raises if it is not initialised)."""
    from megatron.core import parallel_state as ps

    return {
        "rank": torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
        "tp_rank": ps.get_tensor_model_parallel_rank(), "tp_size": ps.get_tensor_model_parallel_world_size(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(), "pp_size": ps.get_pipeline_model_parallel_world_size(),
        "dp_rank": ps.get_data_parallel_rank(), "dp_size": ps.get_data_parallel_world_size(),
    }  # fmt: skip


def _config_of(model: nn.Module) -> dict[str, Any]:
    m = model
    while not hasattr(m, "config") and hasattr(m, "module"):
        m = m.module
    cfg = getattr(m, "config", None)
    out = {k: getattr(cfg, k) for k in _CONFIG_FIELDS if cfg is not None and hasattr(cfg, k)}
    if getattr(m, "vocab_size", None) is not None:
        out["vocab_size"] = m.vocab_size
    return {k: v for k, v in out.items() if isinstance(v, (bool, int, float, str, type(None)))}


def capture_rank(
    model: nn.Module,
    out: str | Path,
    *,
    stage: str,
    batch: Mapping[str, torch.Tensor],
    loss: float | torch.Tensor | None = None,
    num_tokens: int | None = None,
    calculate_per_token_loss: bool = True,
    coords: Mapping[str, int] | None = None,
    precision: str | None = None,
    overwrite: bool = False,
) -> Path:
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
    dtype = next(iter(params.values())).dtype
    if isinstance(loss, torch.Tensor):
        loss = float(loss.detach().float().item())
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
                "config": _config_of(model),
                "layout": layout,
            },  # fmt: skip
        )
        w.add("inputs", {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)})
        w.add("weights", {n: p.detach() for n, p in params.items()})
        w.add("grads", {n: gradient_of(p) for n, p in params.items() if gradient_of(p) is not None})
    return path
