"""A thin stand-in for TransformerEngine's ``TEDotProductAttention`` on packed (THD) batches, for the
H20 path on CPU (test code). megatron-core 0.12.1's local ``DotProductAttention`` refuses packed
batches; on the H20 the user's packed step runs TE's fused/flash attention with ``qkv_format='thd'``,
which attends within each sample of ``cu_seqlens_q`` only (causal). This module does that, exactly,
sample by sample, and nothing else:

- inputs as megatron-core's ``Attention`` hands them in THD: query (T, np, hn), key / value
  (T, ng, hn) (the batch dimension squeezed), ``packed_seq_params.cu_seqlens_q`` (ms-swift sets no
  ``*_padded`` off NPU; when present they are used, as TE uses them);
- numerics: q, k, v upcast once to fp32 (as flash attention accumulates; fp64 stays fp64), per sample
  ``softmax(q k^T * scale + causal) v`` with GQA key/value heads repeated, rounded once to the
  input dtype; the backward is autograd of that formula;
- output (T, np * hn), which ``Attention`` reshapes to (T, 1, h).

An unpacked call (no ``packed_seq_params``) is refused: the H20 path uses this module for the packed
step only (the unpacked step keeps the local spec's own attention).
"""

from __future__ import annotations

import math

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide


class THDDotProductAttention(MegatronModule):
    """Per-sample exact causal attention over ``cu_seqlens_q`` (TE's THD semantics)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None):  # fmt: skip
        super().__init__(config=config)
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups or config.num_attention_heads, tp)
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise NotImplementedError("THDDotProductAttention stand-in: packed (THD) batches only")
        cu = packed_seq_params.cu_seqlens_q_padded
        cu = packed_seq_params.cu_seqlens_q if cu is None else cu
        bounds = [int(x) for x in cu]
        assert bounds[0] == 0 and bounds[-1] == query.shape[0], (bounds, tuple(query.shape))
        rep = self.heads // self.groups
        dt = torch.promote_types(query.dtype, torch.float32)
        q, k, v = (t.to(dt) for t in (query, key, value))  # (T, np, hn), (T, ng, hn) x2, fp32 (or fp64)
        k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))  # (T, np, hn)
        outs = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))  # (np, L, hn)
            scores = qs @ ks.transpose(1, 2) * self.scale  # (np, L, L)
            causal = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).triu(1)
            probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
            outs.append((probs @ vs).transpose(0, 1))  # (L, np, hn)
        out = torch.cat(outs, 0).to(query.dtype)  # (T, np, hn), rounded once
        return out.reshape(out.shape[0], -1)  # (T, np * hn)


def packed_spec(spec):
    """The local layer spec with its core attention replaced by the THD stand-in."""
    import copy

    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = THDDotProductAttention
    return spec
