"""Peer harness: ms-swift 3.12.1's own Megatron Qwen3-VL model, one training step on CPU over gloo.

Runs only inside the pinned environment (``.ci/swift-env``: torch 2.8.0, transformers 4.57.1,
megatron-core 0.12.1, ms-swift 3.12.1). The step is ms-swift's and megatron-core's own code:

- model: ``swift.megatron.model``'s ``model_provider`` -> ``Qwen3VLGPTModel`` (a ``MultimodalGPTModel``:
  mcore ``language_model`` + transformers' Qwen3-VL vision tower), megatron-core's local layer spec
  (given through ``args.spec``), weights loaded from the tiny HF directory by ms-swift's own
  ``MultimodalGPTBridge`` (TP-split there), wrapped as Megatron-LM wraps it: ``Float16Module`` for bf16
  (a pass-through of the same nesting for fp32), then megatron-core's DDP (``main_grad``, fp32);
- step: megatron-core's ``get_forward_backward_func()`` with ms-swift's
  ``MegatronTrainer.forward_step`` (-> ``get_batch``, labels rolled by -1 there; ``loss_func`` returns
  the sum of token losses and the token count, ``calculate_per_token_loss`` on), then
  ``config.finalize_model_grads_func = finalize_model_grads`` called by the schedule.

The harness only observes (test code): it wraps ``get_batch``/``loss_func`` on the trainer instance
and ``config.finalize_model_grads_func`` to record, per rank, into ``OUT/raw/rankN/``:
``weights``, ``grads_pre`` (main_grad after the backward, before finalize), ``grads_post`` (after),
``batch`` (as the model received it) as safetensors, and ``meta.json`` (loss sum, token count,
per-parameter TP layout marks, timings). ``OUT/hf`` is the tiny HF directory whose
``model.safetensors`` holds the same weights in transformers' layout. ``SWIFT_PEER_FAULT`` in the
environment plants a device fault in the run (``plant_fault``); ``SWIFT_PEER_PLAIN_FIRST=1`` runs the
same call once before on the same weights and batch, its main_grads in ``grads_post_plain`` (with
``ORACLE_CAPTURE_STEP=1`` that one is not captured and the second is: non-invasiveness in one process).

    from peer import run
    info = run(out_dir, tp=2, sp=True, dtype="bf16")
"""

from __future__ import annotations

import copy
import json
import os
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(out_dir: str, tp: int = 1, sp: bool = False, dtype: str = "fp32", model_dir: str | None = None,
        timeout: float = 600.0, env: dict | None = None, pp: int = 1, packed: bool = False) -> dict:  # fmt: skip
    """Run one step at TP ``tp`` (sequence parallel ``sp``) x PP ``pp``, ``dtype`` in {fp32, bf16},
    one process per rank (TP fastest); returns the per-rank meta (also in
    ``OUT/raw/rankN/meta.json``). ``env`` is added to the ranks' environment (e.g. ``ORACLE_CAPTURE``).
    ``packed``: the user's packed step (tests/swift/packed.py: ms-swift's own packing collation,
    ``padding_free`` on, THD ``PackedSeqParams`` from ``get_batch``; the core attention is the TE THD
    stand-in, tests/swift/te_thd.py; full uniform recompute of every layer)."""
    import subprocess

    assert dtype in ("fp32", "bf16"), dtype
    assert not sp or tp > 1, "sequence parallel needs TP > 1"
    os.makedirs(out_dir, exist_ok=True)
    model_dir = model_dir or os.path.join(out_dir, "hf")
    sys.path.insert(0, HERE)
    import tiny

    tiny.write_model_dir(model_dir)
    port = _free_port()
    procs = []
    world = tp * pp
    for rank in range(world):
        e = dict(os.environ, **(env or {}))
        e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                 LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # fmt: skip
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", out_dir, model_dir, str(tp), str(int(sp)), dtype,
               str(pp), str(int(packed))]
        log = open(os.path.join(out_dir, f"rank{rank}.log"), "w")
        procs.append((subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT), log))
    t0 = time.time()
    failed = []
    for rank, (p, log) in enumerate(procs):
        try:
            rc = p.wait(timeout=max(1.0, timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "timeout"
        log.close()
        if rc != 0:
            failed.append((rank, rc))
    if failed:
        for _, (p, _) in enumerate(procs):
            if p.poll() is None:
                p.kill()
        tail = open(os.path.join(out_dir, f"rank{failed[0][0]}.log")).read()[-6000:]
        raise RuntimeError(f"peer ranks failed {failed}; rank {failed[0][0]} log tail:\n{tail}")
    metas = []
    for rank in range(world):
        with open(os.path.join(out_dir, "raw", f"rank{rank}", "meta.json")) as f:
            metas.append(json.load(f))
    return {"ranks": metas, "wall_s": time.time() - t0, "hf_dir": model_dir}


# --------------------------------------------------------------------------- inside a rank


def make_args(model_dir: str, tp: int, sp: bool, dtype: str, pp: int = 1, packed: bool = False):
    """Megatron/ms-swift arguments: ms-swift's own dataclass defaults, the model fields converted by
    ms-swift's ``convert_hf_config`` from the HF config, then the CPU settings (no fusions, no TE)."""
    import dataclasses
    from types import SimpleNamespace

    import torch
    from megatron.core.transformer.enums import AttnBackend
    from swift.megatron.argument.megatron_args import MegatronArguments
    from swift.megatron.utils.config import convert_hf_config
    from transformers import AutoConfig

    a = {}
    for f in dataclasses.fields(MegatronArguments):
        if f.default is not dataclasses.MISSING:
            a[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            a[f.name] = f.default_factory()
    hf = AutoConfig.from_pretrained(model_dir)
    a.update(convert_hf_config(hf))
    ns = SimpleNamespace(**a)
    MegatronArguments._set_default(ns)  # ms-swift's own defaults (biases off, qk norm, ...), as __post_init__
    a = vars(ns)
    a["add_bias_linear"] = not a["disable_bias_linear"]  # as Megatron-LM's argument parser derives it
    a["group_query_attention"] = a["num_query_groups"] > 1  # as MegatronArguments.__post_init__ sets it
    bf16 = dtype == "bf16"
    a.update(
        model_dir=model_dir, hf_model_type="qwen3_vl", is_multimodal=True, task_type="causal_lm",
        torch_dtype=torch.bfloat16 if bf16 else torch.float32, padding_free=False, packing=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=1,
        expert_model_parallel_size=1, expert_tensor_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        sequence_parallel=sp, micro_batch_size=1, global_batch_size=1, data_parallel_size=1,
        fp16=False, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        accumulate_allreduce_grads_in_fp32=True, calculate_per_token_loss=True,
        transformer_impl="local", spec=("standins", "SPEC"), normalization="RMSNorm",
        attention_backend=AttnBackend.local, use_cpu_initialization=True, perform_initialization=True,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, bias_swiglu_fusion=False, bias_gelu_fusion=False,
        cross_entropy_loss_fusion=False, no_persist_layer_norm=True, persist_layer_norm=False,
        memory_efficient_layer_norm=False, apply_layernorm_1p=False, layernorm_zero_centered_gamma=False,
        attention_dropout=0.0, hidden_dropout=0.0, recompute_granularity=None, recompute_method=None,
        recompute_num_layers=None, init_method_std=0.02, overlap_p2p_comm=False, use_legacy_models=False,
        yaml_cfg=None, record_memory_history=False, heterogeneous_layers_config_path=None, mtp_num_layers=None,
        num_experts=None, moe_grouped_gemm=False, multi_latent_attention=False, moe_use_legacy_grouped_gemm=False,
        use_shared_expert_gate=False, use_rope_scaling=False, rope_scaling_factor=8.0, rotary_percent=1.0,
        rotary_seq_len_interpolation_factor=None, fp16_lm_cross_entropy=False, enable_dft_loss=False,
        enable_channel_loss=False, check_for_nan_in_loss_and_grad=False, check_for_spiky_loss=False,
        distributed_timeout_minutes=10, use_hf=False, hub_token=None, qk_l2_norm=False, fp8=None,
        seq_length=None,
        variable_seq_lengths=True, deterministic_mode=False, use_distributed_optimizer=False,
    )  # fmt: skip
    if packed:  # the user's flags: --packing true (padding_free), full uniform recompute of every layer
        a.update(padding_free=True, packing=True, recompute_granularity="full", recompute_method="uniform",
                 recompute_num_layers=1)  # fmt: skip
    return SimpleNamespace(**a)


def _bridge_cls():
    """ms-swift's MultimodalGPTBridge, its TE fused-norm names aliased to the local spec's norms."""
    from swift.megatron.model.gpt_bridge import MultimodalGPTBridge

    alias = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}  # fmt: skip

    class LocalSpecBridge(MultimodalGPTBridge):
        def _set_state_dict(self, mg_module, mg_key, *a, **k):
            return super()._set_state_dict(mg_module, alias.get(mg_key, mg_key), *a, **k)

    return LocalSpecBridge


def _tensors(d):
    return {k: v.detach().clone().contiguous() for k, v in d.items() if hasattr(v, "detach")}


def _main_grads(model):
    return {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}


def plant_fault(model, spec: str) -> None:
    """A device fault planted in the run (test code), from ``SWIFT_PEER_FAULT``:
    ``mlp-grad:K:F``: the gradient arriving at decoder layer K's MLP output is multiplied by F in the
    backward (the forward value is bitwise unchanged: ``y.detach() + (y - y.detach()) * F``), as a
    wrong scale in one MLP's backward kernel would; K is the stage-local layer index.
    ``vit-fwd:K:F``: vision block K's output is multiplied by F inside its own forward (its instance
    ``forward`` wrapped, so what the block returns is wrong for every observer, the capture's recorder
    too), as a wrong kernel in the block would."""
    kind, layer, factor = spec.split(":")
    assert kind in ("mlp-grad", "vit-fwd"), spec
    f = float(factor)
    if kind == "vit-fwd":
        block = model.visual.visual.blocks[int(layer)]
        inner = block.forward

        def forward(*args, **kwargs):
            return inner(*args, **kwargs) * f

        block.forward = forward
        return
    mlp = model.language_model.decoder.layers[int(layer)].mlp

    def hook(module, args, output):
        y, bias = output
        return y.detach() + (y - y.detach()) * f, bias

    mlp.register_forward_hook(hook)


def worker(out_dir: str, model_dir: str, tp: int, sp: bool, dtype: str, pp: int = 1, packed: bool = False) -> None:
    sys.path.insert(0, HERE)
    import standins

    standins.import_swift_megatron()
    standins.install_cpu_redirects()
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    t_start = time.time()
    dist.init_process_group("gloo", rank=rank, world_size=tp * pp)
    args = make_args(model_dir, tp, sp, dtype, pp, packed)
    standins.set_args(args)
    from megatron.core import mpu

    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module
    from megatron.core.utils import StragglerDetector, get_model_config
    from swift.megatron.model.model_provider import model_provider
    from swift.megatron.trainers.trainer import MegatronTrainer

    standins.SPEC = standins.local_spec_with_sp_norms(args)
    if packed:
        import te_thd

        standins.SPEC = te_thd.packed_spec(standins.SPEC)
    first, last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
    model = model_provider(pre_process=first, post_process=last)
    model.model_type = ModelType.encoder_or_decoder  # as Megatron-LM's get_model sets it
    _bridge_cls()().load_weights(model, model_dir)
    if os.environ.get("SWIFT_PEER_FAULT"):
        plant_fault(model, os.environ["SWIFT_PEER_FAULT"])
    config = get_model_config(model)
    wrapped = Float16Module(config, model) if args.bf16 else standins.PassThroughModule(config, model)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                              use_distributed_optimizer=False), wrapped)  # fmt: skip
    ddp.train()
    # as Megatron-LM's training.setup_model_and_optimizer / train do
    config.grad_scale_func = None  # bf16 and fp32: loss scale 1
    config.finalize_model_grads_func = finalize_model_grads
    t_built = time.time()

    rec = {}
    trainer = MegatronTrainer.__new__(MegatronTrainer)  # its __init__ builds loggers, checks the hub
    trainer.args, trainer.stimer, trainer.mcore_013 = args, StragglerDetector(), False
    trainer.unwrapped_models, trainer.wrapped_models, trainer.custom_metrics = [model], [ddp], {}
    get_batch, loss_func = trainer.get_batch, trainer.loss_func

    def recording_get_batch(*a, **k):
        batch = get_batch(*a, **k)
        rec["batch"] = _tensors(batch)
        rec["batch_keys"] = sorted(batch)
        return batch

    rec["loss_sum"] = rec["num_tokens"] = None  # only the last pipeline stage has a loss

    def recording_loss_func(output_tensor, **k):
        out = loss_func(output_tensor, **k)
        rec["loss_sum"], rec["num_tokens"] = float(out[0].detach()), int(out[1])
        return out

    trainer.get_batch, trainer.loss_func = recording_get_batch, recording_loss_func
    finalize = config.finalize_model_grads_func

    def recording_finalize(models, num_tokens=None):
        rec["pre"] = _main_grads(models[0])
        rec["finalize_num_tokens"] = None if num_tokens is None else int(num_tokens)
        out = finalize(models, num_tokens)
        rec["post"] = _main_grads(models[0])
        return out

    config.finalize_model_grads_func = recording_finalize
    if packed:  # SWIFT_STEP_MICROBATCHES=M: the packed step as M micro-batches (tests/swift/packed.py)
        samples = __import__("packed").microbatches(model_dir, padding_to=tp)
    else:
        samples = [__import__("tiny").sample(seq_multiple=tp)]
    seq = max(s["input_ids"].shape[1] for s in samples)

    def step():  # a fresh copy of the batches: ms-swift's get_batch changes them in place
        ddp.zero_grad_buffer()
        return get_forward_backward_func()(
            forward_step_func=trainer.forward_step, data_iterator=iter(copy.deepcopy(samples)), model=[ddp],
            num_microbatches=len(samples), seq_length=seq, micro_batch_size=1, decoder_seq_length=seq, forward_only=False)  # fmt: skip

    from safetensors.torch import save_file

    d = os.path.join(out_dir, "raw", f"rank{rank}")
    os.makedirs(d, exist_ok=True)
    if os.environ.get("SWIFT_PEER_PLAIN_FIRST") == "1":  # the same call first, uncaptured (ORACLE_CAPTURE_STEP=1)
        step()
        save_file(rec["post"], os.path.join(d, "grads_post_plain.safetensors"))
    t0 = time.time()
    losses = step()
    step_s = time.time() - t0
    config.finalize_model_grads_func = finalize
    params = dict(ddp.named_parameters())
    save_file({n: p.detach().contiguous() for n, p in params.items()}, os.path.join(d, "weights.safetensors"))
    save_file(rec["pre"], os.path.join(d, "grads_pre.safetensors"))
    save_file(rec["post"], os.path.join(d, "grads_post.safetensors"))
    save_file(rec["batch"], os.path.join(d, "batch.safetensors"))
    layout = {n: {"shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", ""),
                  "tensor_model_parallel": bool(getattr(p, "tensor_model_parallel", False)),
                  "partition_dim": int(getattr(p, "partition_dim", -1)),
                  "sequence_parallel": bool(getattr(p, "sequence_parallel", False))}
              for n, p in params.items()}  # fmt: skip
    import megatron.core
    import swift
    import transformers

    meta = {
        "rank": rank, "tp": tp, "sp": sp, "pp": pp, "pp_rank": mpu.get_pipeline_model_parallel_rank(),
        "tp_rank": mpu.get_tensor_model_parallel_rank(), "dtype": dtype, "seq_len": seq, "loss_sum": rec["loss_sum"],
        "num_tokens": rec["num_tokens"], "finalize_num_tokens": rec["finalize_num_tokens"],
        "batch_keys": rec["batch_keys"],
        "reported": {k: [float(x) for x in v] for k, v in (losses[0] if losses else {}).items()},
        "params": layout, "build_s": t_built - t_start, "step_s": step_s,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "megatron.core": megatron.core.__version__, "ms-swift": swift.__version__},
    }  # fmt: skip
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) == 9 and sys.argv[1] == "--worker":
        _, _, out, mdir, tp_, sp_, dt, pp_, packed_ = sys.argv
        worker(out, mdir, int(tp_), bool(int(sp_)), dt, int(pp_), bool(int(packed_)))
    else:
        import argparse

        ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        ap.add_argument("out")
        ap.add_argument("--tp", type=int, default=1)
        ap.add_argument("--sp", action="store_true")
        ap.add_argument("--pp", type=int, default=1)
        ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
        ap.add_argument("--packed", action="store_true")
        o = ap.parse_args()
        info = run(o.out, o.tp, o.sp, o.dtype, pp=o.pp, packed=o.packed)
        for m in info["ranks"]:
            print(f"rank {m['rank']}: loss_sum {m['loss_sum']} tokens {m['num_tokens']} "
                  f"build {m['build_s']:.1f}s step {m['step_s']:.2f}s")  # fmt: skip
        print(f"wall {info['wall_s']:.1f}s")
