"""Tensor-parallel float64 replay of one step: torch's DTensor applied from outside the model.

``oracle replay CAPTURE --dtype fp64 --nproc N`` (or torchrun) with N > 1 ranks. The recipe's
transformers model is built as in the single-process oracle (float64, every rank), then split by
``parallelize_module`` on a 1-D gloo CPU mesh following the plan transformers ships with the model
(``config.base_model_tp_plan`` of each text model, e.g. Qwen3 and Qwen3-VL's language model):

  q/k/v_proj, gate/up_proj   ColwiseParallel: output features (attention heads, MLP columns) split
  o_proj, down_proj          RowwiseParallel: input features split, the partial outputs all-reduced
  q_norm, k_norm             replicated; they see only the rank's heads, so their gradients are
                             summed over the ranks after the backward ("replicated_with_grad_allreduce")
  lm_head (untied)           ColwiseParallel: vocabulary rows split; the vocabulary-chunked head
                             and loss (oracle/replay/headloss.py) run on each rank's rows and combine the
                             shards' log-sum-exp and target logits by all-reduce

Everything else is replicated on every rank: the embedding (and a head tied to it), norms and the
ViT. The step runs inside the same PrecisionMode(float64) as the single-process oracle: DTensor's
ops dispatch through the mode, every float op computes in float64 and the loss is asserted float64
before ``backward()``; each sharded gradient is gathered (``full_tensor()``) in float64. Every rank
builds the whole float64 model before DTensor keeps its shard (memory per rank is not yet 1/N).

Numerics: the only difference from the single-process oracle is the order of the sums a row split
makes (o_proj/down_proj outputs, the gradients of replicated activations and the head's
log-sum-exp are sums of N partial sums, all-reduced), so results are not bitwise equal; the bound stated and tested is 1e-12
relative on every parameter's gradient (measured on the tiny recipes: about 1e-15).
"""

from __future__ import annotations

from fnmatch import fnmatch

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UsageError
from . import distributed

BOUND_REL = 1e-12  # per parameter, ||g_tp - g|| / ||g||: sums split in another order (measured ~1e-15)
STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")


def plan_of(model: nn.Module, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Module path -> style, from ``base_model_tp_plan`` of every text model inside ``model`` (a
    module with ``layers`` whose config carries the plan) and the recipe's ``tp_plan`` (full-path
    patterns, for models whose config ships none); patterns expanded to real module paths."""
    patterns: dict[str, str] = {}
    for path, m in model.named_modules():
        base = getattr(getattr(m, "config", None), "base_model_tp_plan", None)
        if base and hasattr(m, "layers"):
            patterns.update({(f"{path}." if path else "") + k: v for k, v in base.items()})
    patterns.update(extra or {})
    plan: dict[str, str] = {}
    for n, _ in model.named_modules():
        for pattern, style in patterns.items():
            # embedding_rowwise, colwise_gather_output (head): the vocabulary stays whole (not split yet)
            if style in STYLES and n.count(".") == pattern.count(".") and fnmatch(n, pattern):
                plan[n] = style
    return plan


def check_divisible(model: nn.Module, ranks: int) -> None:
    """Heads (query and key/value) and MLP columns must split evenly over the ranks."""
    bad = []
    for path, m in model.named_modules():
        cfg = getattr(m, "config", None)
        if cfg is None or not hasattr(m, "layers"):
            continue
        for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            v = getattr(cfg, key, None)
            if isinstance(v, int) and v % ranks:
                bad.append(f"{path or 'model'}.config.{key} = {v}")
    if bad:
        raise UsageError(f"the tensor-parallel replay splits heads and MLP columns over {ranks} ranks, but "
                         f"{'; '.join(bad)} {'is' if len(bad) == 1 else 'are'} not divisible by {ranks}; choose an --nproc that divides them")  # fmt: skip


def vocabulary_split(model: nn.Module, ranks: int) -> bool:
    """Whether the head is split by vocabulary rows: an untied ``lm_head`` whose rows divide evenly
    (a head tied to the embedding stays whole: the embedding lookup is not split)."""
    head = getattr(model, "lm_head", None)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(head, nn.Linear) or head.bias is not None or (emb is not None and emb.weight is head.weight):
        return False
    return head.weight.shape[0] % ranks == 0


def parallelize(model: nn.Module, ranks: int, extra: dict[str, str] | None = None) -> list[str]:
    """Split ``model`` in place over a gloo CPU mesh of ``ranks``; returns the parameter names whose
    gradients must be summed over the ranks after the backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    check_divisible(model, ranks)
    plan = plan_of(model, extra)
    if not plan:
        raise UsageError("the model ships no tensor-parallel plan (config.base_model_tp_plan); replay it with one process")
    distributed.barrier("tp-built")  # every rank has built its model: the collectives can start
    mesh = init_device_mesh("cpu", (ranks,))
    styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel()}
    layout = {n: styles[s] for n, s in plan.items() if s in styles}
    if vocabulary_split(model, ranks):  # the head by vocabulary rows: oracle/replay/headloss.py computes per shard
        layout["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, mesh, layout)
    return [f"{n}.{p}" for n, s in plan.items() if s == "replicated_with_grad_allreduce"
            for p, _ in model.get_submodule(n).named_parameters()]  # fmt: skip


def full_grads(model: nn.Module, summed: list[str]) -> dict[str, torch.Tensor]:
    """Every parameter's whole float64 gradient on every rank (collectives: all ranks, same order)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            g = g.full_tensor()
        elif n in summed:
            g = g.clone()
            dist.all_reduce(g, op=dist.ReduceOp.SUM)
        assert g.dtype == torch.float64, f"gradient of {n} is {g.dtype} under tensor parallelism, expected float64"
        out[n] = g
    return out
