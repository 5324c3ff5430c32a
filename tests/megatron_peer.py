"""Real megatron-core 0.12.1 on CPU over gloo: a Qwen3-style GPTModel under Megatron's own DDP,
one step captured with oracle.integrations.megatron.hook.capture_rank before and after finalize_model_grads.

The CPU shims megatron-core needs live here, in test code, never in the library.
Run as ``python tests/megatron_peer.py OUT TP SP`` (spawns TP processes) or through run_peer(),
whose options add pipeline stages (PP > 1 runs Megatron's own 1F1B schedule, p2p over gloo),
DP ranks (each with its own micro-batch), the loss convention and a padded vocabulary.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.multiprocessing as mp
from helpers import fork_server

from oracle.parallel.launch import free_port

# A tiny Qwen3: 2 layers, GQA 16 query / 4 KV heads of 8 (head_dim != hidden / heads), SwiGLU 128,
# q/k RMSNorm, RoPE.
CFG = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 16,
       "num_key_value_heads": 4, "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "seq_len": 16}  # fmt: skip
SEED = 1234
PACKED = [0, 5, 11, CFG["seq_len"]]  # sample boundaries of the packed run

def batch(vocab: int = CFG["vocab_size"], seed: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s = CFG["seq_len"]
    tokens = torch.randint(0, vocab, (1, s), generator=g)
    labels = torch.roll(tokens, -1, dims=1)  # ms-swift / Megatron: label t is token t+1
    loss_mask = torch.ones(1, s)
    loss_mask[0, : 3 + seed % 3] = 0  # a prompt: no loss (its length differs per DP rank)
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


def _zero_padded_rows(model, vocab: int, padded: int, tp_rank: int):
    """Padded vocabulary rows as ms-swift's converter fills them: zeros (rank r holds rows [r Vp/TP, ...))."""
    for name, p in model.named_parameters():
        if name.endswith(("word_embeddings.weight", "output_layer.weight")):
            start = tp_rank * p.shape[0]
            with torch.no_grad():
                p[max(vocab - start, 0) :] = 0


def _plant_mlp_grad_scale(model, layer: int, factor: float, inside: bool = False):
    """Scale the gradient arriving at decoder layer ``layer``'s MLP output by ``factor`` (the forward,
    and so the loss, untouched): the symptom of the original report, planted in Megatron's own module.
    ``inside``: the gradient leaving linear_fc2 for the activation instead (inside the MLP's own backward:
    the MLP's recorded boundary sees its grad_output right and its grad_input wrong)."""
    offset = min((int(m.layer_number) - 1 for n, m in model.named_modules() if n.endswith("decoder.layers.0")), default=0)
    for n, m in model.named_modules():
        if n.endswith(f"decoder.layers.{layer - offset}.mlp") and hasattr(m, "linear_fc2"):
            if inside:
                m.linear_fc2.register_forward_hook(lambda mod, args, out: args[0].register_hook(lambda g: g * factor) and None)
            else:
                m.register_forward_hook(lambda mod, args, out: out[0].register_hook(lambda g: g * factor) and None)


def _worker(rank: int, world: int, out: str, opts: dict, port: int, msprobe_dir: str | None, env: dict[str, str]):
    os.environ.clear()  # the caller's environment at the call, not the fork server's at its start
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    _shims()
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from oracle.integrations.megatron.hook import capture_rank
    from oracle.integrations.megatron.layout import padded_vocab

    tp, sp, pp, per_token = opts["tp"], opts["sp"], opts["pp"], opts["per_token"]
    vocab = opts["vocab"]
    padded = padded_vocab(vocab, tp, opts["divisible_by"])
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(SEED)
    config = TransformerConfig(
        num_layers=CFG["num_hidden_layers"], hidden_size=CFG["hidden_size"], num_attention_heads=CFG["num_attention_heads"],
        num_query_groups=CFG["num_key_value_heads"], kv_channels=CFG["head_dim"], ffn_hidden_size=CFG["intermediate_size"],
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm",
        layernorm_epsilon=CFG["rms_norm_eps"], qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, sequence_parallel=sp, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32, batch_p2p_comm=False, use_cpu_initialization=True,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, calculate_per_token_loss=per_token,
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
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    if pp > 1:  # 5. the schedule moves its token count to cuda, a tied embedding its weight (CPU: stay)
        torch.Tensor.cuda = lambda self, *a, **k: self
    model = GPTModel(config, get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"),
                     vocab_size=padded, max_sequence_length=CFG["seq_len"], position_embedding_type="rope",
                     rotary_base=int(CFG["rope_theta"]), share_embeddings_and_output_weights=opts.get("tied", False),
                     pre_process=first, post_process=last)  # fmt: skip
    _zero_padded_rows(model, vocab, padded, parallel_state.get_tensor_model_parallel_rank())
    if opts.get("fault"):  # a planted backward fault: the gradient entering one layer's MLP scaled
        _plant_mlp_grad_scale(model, *opts["fault"], inside=opts.get("fault_inside", False))
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                  use_distributed_optimizer=False), model)  # fmt: skip
    ddp.zero_grad_buffer()
    recorder = None
    if opts.get("modules"):  # module boundaries, recorded during the step as capture_rank's docs say
        from oracle.integrations.megatron.hook import record_modules

        recorder = record_modules(ddp, opts["modules"])
    b = batch(vocab, seed=7 + parallel_state.get_data_parallel_rank())
    s = b["tokens"].shape[1]
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)  # 2. explicit causal mask (True = masked)
    if opts.get("packed"):  # samples [0, 5), [5, 11), [11, s) packed in one row: the mask reset per sample
        mask = torch.ones(1, 1, s, s, dtype=torch.bool)
        for a, e in zip(PACKED[:-1], PACKED[1:]):
            mask[..., a:e, a:e] = torch.ones(e - a, e - a, dtype=torch.bool).triu(1)
        b["attention_mask"] = mask
    n_tokens = int(b["loss_mask"].sum())
    seen: dict[str, float] = {}
    if opts.get("mb_seeds"):  # gradient accumulation over micro-batches, captured by ORACLE_CAPTURE (autocapture)
        _accumulate(ddp, config, mask, vocab, opts["mb_seeds"], per_token, out)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        return
    if pp == 1:
        dbg = _msprobe(msprobe_dir)
        if dbg is not None:
            dbg.start(model=ddp.module)
        losses = ddp(b["tokens"], b["position_ids"], mask, labels=b["labels"])  # (1, s) token losses
        loss = (losses.float() * b["loss_mask"]).sum()
        loss = loss if per_token else loss / n_tokens
        loss.backward()
        seen["loss"] = float(loss.detach())
        if dbg is not None:
            dbg.stop()
            dbg.step()
    else:  # Megatron's own pipeline schedule (1F1B), one micro-batch, p2p over gloo
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def loss_func(output):
            total = (output.float() * b["loss_mask"]).sum()
            seen["loss"] = float(total.detach()) / (1 if per_token else n_tokens)
            return total, torch.tensor(n_tokens, dtype=torch.int), {}  # divided by the count when not per-token

        def step(data_iterator, m):
            d = next(data_iterator)
            return m(d["tokens"], d["position_ids"], mask, labels=d["labels"]), loss_func

        get_forward_backward_func()(forward_step_func=step, data_iterator=iter([b]), model=[ddp], num_microbatches=1,
                                    seq_length=s, micro_batch_size=1, forward_only=False)  # fmt: skip
    loss = None if opts.get("no_loss") else seen.get("loss")  # no_loss: a custom loop's capture_rank(loss=None)
    kw = {
        "batch": b,
        "loss": loss,
        "num_tokens": n_tokens,
        "vocab_size": vocab,
        "make_vocab_size_divisible_by": opts["divisible_by"],
        "modules": recorder,
    }
    capture_rank(ddp, os.path.join(out, "pre"), stage="pre-finalize", **kw)
    finalize_model_grads([ddp], num_tokens=torch.tensor(n_tokens, dtype=torch.int) if per_token else None)
    capture_rank(ddp, os.path.join(out, "post"), stage="post-finalize", **kw)
    if recorder is not None:
        recorder.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _accumulate(ddp, config, mask, vocab: int, seeds: list[int], per_token: bool, out: str) -> None:
    """One training call of len(seeds) micro-batches (batch(seed) each) through the schedule a loop takes,
    ``finalize_model_grads`` as the loop's, with ORACLE_CAPTURE=OUT installed as the start-up line does:
    the hook writes OUT/pre and OUT/post (each micro-batch's inputs as mb{i}.NAME)."""
    from megatron.core.distributed import finalize_model_grads

    os.environ["ORACLE_CAPTURE"] = out
    from oracle.integrations.megatron import autocapture

    autocapture.install()
    from autocapture_step import CudaToCpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batches = [batch(vocab, seed=s) for s in seeds]
    for b in batches:  # the model sees no loss_mask: masked labels are -100, as ms-swift's (the hook reads them)
        b["labels"] = b["labels"].masked_fill(b["loss_mask"] == 0, -100)

    def step(data_iterator, m):
        d = next(data_iterator)

        def loss_func(output):  # ms-swift's and Megatron-LM's (sum, tokens, logs): the schedule divides when not per-token
            return (output.float() * d["loss_mask"]).sum(), d["loss_mask"].sum().to(torch.int), {}

        return m(d["tokens"], d["position_ids"], mask, labels=d["labels"]), loss_func

    config.finalize_model_grads_func = finalize_model_grads
    s = CFG["seq_len"]
    with CudaToCpu():
        get_forward_backward_func()(forward_step_func=step, data_iterator=iter(batches), model=[ddp],
                                    num_microbatches=len(batches), seq_length=s, micro_batch_size=1, forward_only=False)  # fmt: skip


def run_peer(out: str, tp: int, sp: bool, port: int | None = None, msprobe_dir: str | None = None, *, pp: int = 1, dp: int = 1,
             per_token: bool = True, vocab: int = CFG["vocab_size"], divisible_by: int = 1, packed: bool = False,
             fault: tuple[int, float] | None = None, tied: bool = False, modules: str | None = None,
             no_loss: bool = False, mb_seeds: tuple[int, ...] = (), fault_inside: bool = False) -> str:  # fmt: skip
    """One step on TP x PP x DP processes. ``divisible_by``: Megatron's make_vocab_size_divisible_by (the
    vocabulary is padded to a multiple of it x TP; 1 pads only to a multiple of TP). ``packed``: three samples
    in the row, the attention mask reset per sample (megatron-core's rope keeps positions 0..T-1 outside THD).
    ``fault``: (layer, factor), the gradient entering that decoder layer's MLP scaled by factor in the backward
    (``fault_inside``: the gradient inside it, between linear_fc2 and the activation).
    ``tied``: share_embeddings_and_output_weights (with PP > 1 the last stage holds its own copy of the
    embedding as output_layer, and finalize sums the two stages' gradients). ``modules``: a selection
    for ``record_modules`` (e.g. ``layers``): those modules' boundaries go into both bundles. ``no_loss``: the
    ranks are captured with ``loss=None`` (a custom loop that records no loss). ``mb_seeds``: one training
    call of micro-batches batch(seed) each, gradients accumulated, captured by ``ORACLE_CAPTURE=OUT`` (PP 1)."""
    opts = {"tp": tp, "sp": sp, "pp": pp, "per_token": per_token, "vocab": vocab, "divisible_by": divisible_by,
            "packed": packed, "fault": fault, "tied": tied, "modules": modules, "no_loss": no_loss,
            "mb_seeds": list(mb_seeds), "fault_inside": fault_inside}  # fmt: skip
    port = port or free_port()  # a fresh rendezvous port each run: concurrent or repeated runs never collide
    # ranks fork from a server that imported torch and megatron-core once (helpers.fork_server)
    mp.start_processes(_worker, args=(tp * pp * dp, out, opts, port, msprobe_dir, dict(os.environ)), nprocs=tp * pp * dp,
                       join=True, start_method=fork_server())  # fmt: skip
    return out


if __name__ == "__main__":
    run_peer(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1")
