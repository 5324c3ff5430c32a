"""Run in a subprocess of ``.venv-mindspeed``: one training step of a tiny megatron-core 0.12.1
GPTModel (TransformerEngine spec as MindSpeed 0016137 patches it, re-patched as ms-swift's NPU branch
does), TP 1, fp32 with megatron-core's DDP (fp32 main_grad), on a packed TND batch, through
``get_forward_backward_func()`` with ``finalize_model_grads`` as Megatron-LM sets it, on the CPU
torch_npu stand-in. With ORACLE_CAPTURE in the environment the start-up hook captures it, no file
edited. Prints as JSON each parameter's main_grad after finalize (sha256) and the stand-in ops that
ran; writes the main_grads and the batch to ``OUT/raw`` for comparison with the capture.

``python gpt_step.py OUT``."""

from __future__ import annotations

import hashlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from layer_step import CU, REPATCH  # noqa: E402
from probe import _training_only, init_one_rank  # noqa: E402

VOCAB, H, NQ, NG, HN, FFN, LAYERS = 64, 32, 4, 2, 8, 48, 2


def main(out):
    sys.argv = sys.argv[:1]
    import torch_npu  # noqa: F401  (the stand-in)

    sys.meta_path.insert(0, _training_only()())
    import mindspeed.megatron_adaptor as adaptor
    import mindspeed_ops
    import npu_ops
    import torch
    import torch.nn.functional as F

    mindspeed_ops.install()
    adaptor.repatch(REPATCH)
    init_one_rank()
    torch.use_deterministic_algorithms(True)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=LAYERS, hidden_size=H, num_attention_heads=NQ, num_query_groups=NG,
                               kv_channels=HN, ffn_hidden_size=FFN, normalization="RMSNorm", layernorm_epsilon=1e-6,
                               qk_layernorm=True, gated_linear_unit=True, activation_func=F.silu,
                               bias_activation_fusion=True, add_bias_linear=False, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True, gradient_accumulation_fusion=True,
                               params_dtype=torch.float32, apply_rope_fusion=False, calculate_per_token_loss=True,
                               init_method_std=0.2)  # fmt: skip
    torch.manual_seed(0)
    model = GPTModel(config, get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True), vocab_size=VOCAB,
                     max_sequence_length=64, position_embedding_type="rope", share_embeddings_and_output_weights=False)  # fmt: skip
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = None
    T = CU[-1]
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (1, T), generator=g)
    labels = torch.randint(0, VOCAB, (1, T), generator=g)
    pos = torch.cat([torch.arange(b - a) for a, b in zip(CU[:-1], CU[1:])])[None]
    cu = torch.tensor(CU, dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
    batch = {"input_ids": tokens, "position_ids": pos, "labels": labels}

    def loss_func(per_token):  # per-token loss sum and count, as ms-swift's with calculate_per_token_loss
        loss = per_token.float().sum()
        return loss, torch.tensor(T, dtype=torch.int), {"lm loss": torch.stack([loss.detach(), torch.tensor(float(T))])}

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["input_ids"], b["position_ids"], None, labels=b["labels"], packed_seq_params=psp)
        return out, loss_func

    ddp.zero_grad_buffer()
    npu_ops.CALLS.clear()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([batch]), model=[ddp],
                                num_microbatches=1, seq_length=T, micro_batch_size=1, forward_only=False)  # fmt: skip
    from safetensors.torch import save_file

    grads = {n: p.main_grad.detach().clone() for n, p in ddp.named_parameters()}
    os.makedirs(os.path.join(out, "raw"), exist_ok=True)
    save_file(grads, os.path.join(out, "raw", "grads_post.safetensors"))
    save_file({k: v.contiguous() for k, v in batch.items()}, os.path.join(out, "raw", "batch.safetensors"))
    report = {"grads_sha256": {n: hashlib.sha256(t.numpy().tobytes()).hexdigest() for n, t in grads.items()},
              "nonzero": {n: bool(t.abs().max() > 0) for n, t in grads.items()}, "ops_called": dict(npu_ops.CALLS)}  # fmt: skip
    print("GPT " + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
