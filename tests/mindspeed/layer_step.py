"""Run in a subprocess of ``.venv-mindspeed``: one megatron-core 0.12.1 GPT decoder layer built from
the TransformerEngine spec as MindSpeed 0016137 patches it (TE classes replaced by MindSpeed's,
``repatch`` as ms-swift's NPU branch calls it, ``use_flash_attn``), TP 1, runs one forward and
backward on a PACKED batch (TND, ``cu_seqlens`` with the leading 0 and two pad singletons) on the
CPU stand-in; prints as JSON the largest relative differences from an independent float64 plain-torch
computation of the same layer from the same weights (output, input gradient, every weight's
``main_grad``, accumulated by MindSpeed's npu_matmul_add_fp32 path) and which stand-in ops ran.

``python layer_step.py`` (faults from TORCH_NPU_STANDIN_FAULTS apply)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from probe import _training_only, init_one_rank  # noqa: E402  (puts tests/npu_standin and tests/swift on sys.path)

REPATCH = {"use_flash_attn": True, "use_fused_rotary_pos_emb": True, "position_embedding_type": "rope"}
CU = [0, 5, 6, 9, 10, 16]  # leading 0, pad singletons at 5 and 9
H, NQ, NG, HN, FFN, EPS = 32, 4, 2, 8, 48, 1e-6


def build():
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=NQ, num_query_groups=NG, kv_channels=HN,
                               ffn_hidden_size=FFN, normalization="RMSNorm", layernorm_epsilon=EPS, qk_layernorm=True,
                               gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=True,
                               add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                               use_cpu_initialization=True, gradient_accumulation_fusion=True,
                               params_dtype=torch.float32, apply_rope_fusion=False)  # fmt: skip
    spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    torch.manual_seed(0)
    layer = build_module(spec, config=config, layer_number=1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.1) + (1.0 if p.dim() == 1 else 0.0))
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    return layer, config


def freqs(n):
    import torch

    inv = 1.0 / (10000 ** (torch.arange(0, HN, 2, dtype=torch.float64) / HN))
    f = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    return torch.cat([f, f], -1)  # (n, HN), megatron's rotate-half layout


def reference(params, x):
    """The layer in float64 plain torch: RMSNorm -> QKV (per query group: its q heads, k, v) ->
    q/k RMSNorm -> rotary per sample (positions restart) -> causal attention within each sample ->
    proj + residual -> RMSNorm -> fc1 -> silu(gate)*up -> fc2 + residual."""
    import torch

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + EPS) * w

    def rot(t):
        a, b = t.chunk(2, -1)
        return torch.cat([-b, a], -1)

    t = x.shape[0]
    h = rms(x[:, 0], params["self_attention.linear_qkv.layer_norm_weight"])  # (T, H)
    qkv = (h @ params["self_attention.linear_qkv.weight"].t()).view(t, NG, NQ // NG + 2, HN)
    q = qkv[:, :, : NQ // NG].reshape(t, NQ, HN)
    k, v = qkv[:, :, NQ // NG], qkv[:, :, NQ // NG + 1]  # (T, NG, HN)
    q = rms(q, params["self_attention.q_layernorm.weight"])
    k = rms(k, params["self_attention.k_layernorm.weight"])
    outs = []
    for a, b in zip(CU[:-1], CU[1:]):
        if b == a:
            continue
        f = freqs(b - a)[:, None, :]
        qs = q[a:b] * f.cos() + rot(q[a:b]) * f.sin()
        ks = k[a:b] * f.cos() + rot(k[a:b]) * f.sin()
        ks, vs = ks.repeat_interleave(NQ // NG, 1), v[a:b].repeat_interleave(NQ // NG, 1)
        s = torch.einsum("ind,jnd->nij", qs, ks) / math.sqrt(HN)
        s = s.masked_fill(torch.triu(torch.ones(b - a, b - a, dtype=torch.bool), 1), float("-inf"))
        outs.append(torch.einsum("nij,jnd->ind", torch.softmax(s, -1), vs))
    o = torch.cat(outs).reshape(t, NQ * HN)
    x2 = x[:, 0] + o @ params["self_attention.linear_proj.weight"].t()
    u = rms(x2, params["mlp.linear_fc1.layer_norm_weight"]) @ params["mlp.linear_fc1.weight"].t()
    g, up = u.chunk(2, -1)
    return (x2 + (torch.nn.functional.silu(g) * up) @ params["mlp.linear_fc2.weight"].t())[:, None]


def main():
    sys.argv = sys.argv[:1]
    import torch_npu  # noqa: F401  (the stand-in)

    sys.meta_path.insert(0, _training_only()())
    import mindspeed.megatron_adaptor as adaptor
    import mindspeed_ops
    import npu_ops
    import torch

    mindspeed_ops.install()
    # ms-swift passes asdict(its MegatronArguments) (Megatron-LM's argument names) with use_flash_attn=True
    adaptor.repatch(REPATCH)
    init_one_rank()
    from megatron.core.packed_seq_params import PackedSeqParams

    layer, config = build()
    T = CU[-1]
    x = (torch.randn(T, 1, H, generator=torch.Generator().manual_seed(1))).requires_grad_()
    cu = torch.tensor(CU, dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
    rope = freqs(T).float()[:, None, None, :]  # (T, 1, 1, HN)
    npu_ops.CALLS.clear()
    out, _ = layer(x, attention_mask=None, rotary_pos_emb=rope, packed_seq_params=psp)
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    out.backward(gy)

    params = {n: p.detach().double().requires_grad_() for n, p in layer.named_parameters()}
    xr = x.detach().double().requires_grad_()
    ref = reference(params, xr)
    ref.backward(gy.double())

    def rel(a, b):
        return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30))

    def grad(p):  # the GEMM weights' go to main_grad (npu_matmul_add_fp32); the norms' to .grad (DDP adds it)
        return p.main_grad if p.grad is None else p.main_grad + p.grad

    report = {"output": rel(out.detach(), ref.detach()), "input_grad": rel(x.grad, xr.grad),
              "grad": {n: rel(grad(p), params[n].grad) for n, p in layer.named_parameters()},
              "into_main_grad": sorted(n for n, p in layer.named_parameters() if p.grad is None),
              "output_sha256": hashlib.sha256(out.detach().numpy().tobytes()).hexdigest(),
              "input_grad_sha256": hashlib.sha256(x.grad.numpy().tobytes()).hexdigest(),
              "ops_called": dict(npu_ops.CALLS), "modules": sorted({type(m).__module__ + "." + type(m).__name__
                                                                    for m in layer.modules()})}  # fmt: skip
    print("LAYER " + json.dumps(report))


if __name__ == "__main__":
    main()
