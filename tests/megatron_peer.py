"""Real megatron-core 0.12.1 on CPU over gloo: a Qwen3-style GPTModel under Megatron's own DDP,
one step captured with oracle.megatron.capture_rank before and after finalize_model_grads.

The four CPU shims megatron-core needs live here, in test code, never in the library.
Run as ``python tests/megatron_peer.py OUT TP SP`` (spawns TP processes) or through run_peer().
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.multiprocessing as mp

# A tiny Qwen3: 2 layers, GQA 4 query / 2 KV heads of 16, SwiGLU 128, q/k RMSNorm, RoPE.
CFG = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "seq_len": 16}  # fmt: skip
SEED = 1234


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    s = CFG["seq_len"]
    tokens = torch.randint(0, CFG["vocab_size"], (1, s), generator=g)
    labels = torch.roll(tokens, -1, dims=1)  # ms-swift / Megatron: label t is token t+1
    loss_mask = torch.ones(1, s)
    loss_mask[0, :3] = 0  # a prompt: no loss
    loss_mask[0, -1] = 0  # the rolled-around last label
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": torch.arange(s).unsqueeze(0)}


def _shims():
    """1-3 of the four CPU shims (4, the SP norm, is applied while building the model)."""
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"  # 1. the rotary embedding asks for the cuda device
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()  # 3. no dropout: no RNG fork


def _msprobe(out: str | None, summary: bool = False):
    """A mindstudio-probe debugger dumping parameter gradients at module level (L0), or None."""
    if out is None:
        return None
    import json

    from msprobe.pytorch import PrecisionDebugger

    task = "statistics" if summary else "tensor"
    cfg = {"task": task, "dump_path": out, "rank": [], "step": [], "level": "L0",
           task: {"scope": [], "list": [], "data_mode": ["all"], **({"summary_mode": "statistics"} if summary else {"file_format": "pt"})}}  # fmt: skip
    path = os.path.join(out + ".config.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return PrecisionDebugger(config_path=path)


def _worker(rank: int, world: int, out: str, sp: bool, port: int, msprobe_dir: str | None = None):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    _shims()
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from oracle.megatron.hook import capture_rank

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(SEED)
    config = TransformerConfig(
        num_layers=CFG["num_hidden_layers"], hidden_size=CFG["hidden_size"], num_attention_heads=CFG["num_attention_heads"],
        num_query_groups=CFG["num_key_value_heads"], kv_channels=CFG["head_dim"], ffn_hidden_size=CFG["intermediate_size"],
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm",
        layernorm_epsilon=CFG["rms_norm_eps"], qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=world, sequence_parallel=sp, use_cpu_initialization=True,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, calculate_per_token_loss=True,
        params_dtype=torch.float32, init_method_std=0.02,
    )  # fmt: skip
    # 4. without apex the local spec's norm refuses sequence parallel: build each norm with SP
    #    off, then mark its parameters so finalize_model_grads all-reduces them.
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def norm_without_sp(cls, config, *a, **k):
        saved, config.sequence_parallel = config.sequence_parallel, False
        try:
            norm = original_new(cls, config, *a, **k)
        finally:
            config.sequence_parallel = saved
        for p in norm.parameters():
            p.sequence_parallel = saved
        return norm

    torch_norm.WrappedTorchNorm.__new__ = norm_without_sp
    model = GPTModel(config, get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"),
                     vocab_size=CFG["vocab_size"], max_sequence_length=CFG["seq_len"], position_embedding_type="rope",
                     rotary_base=int(CFG["rope_theta"]), share_embeddings_and_output_weights=False)  # fmt: skip
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                  use_distributed_optimizer=False), model)  # fmt: skip
    ddp.zero_grad_buffer()
    b = batch()
    s = b["tokens"].shape[1]
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)  # 2. explicit causal mask (True = masked)
    dbg = _msprobe(msprobe_dir)
    if dbg is not None:
        dbg.start(model=ddp.module)
    losses = ddp(b["tokens"], b["position_ids"], mask, labels=b["labels"])  # (1, s) token losses
    loss = (losses.float() * b["loss_mask"]).sum()
    n_tokens = int(b["loss_mask"].sum())
    loss.backward()
    if dbg is not None:
        dbg.stop()
        dbg.step()
    capture_rank(ddp, os.path.join(out, "pre"), stage="pre-finalize", batch=b, loss=loss, num_tokens=n_tokens)
    finalize_model_grads([ddp], num_tokens=torch.tensor(n_tokens, dtype=torch.int))
    capture_rank(ddp, os.path.join(out, "post"), stage="post-finalize", batch=b, loss=loss, num_tokens=n_tokens)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run_peer(out: str, tp: int, sp: bool, port: int = 29531, msprobe_dir: str | None = None) -> str:
    mp.spawn(_worker, args=(tp, out, sp, port, msprobe_dir), nprocs=tp, join=True)
    return out


if __name__ == "__main__":
    run_peer(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1")
