"""Run in a subprocess of ``.venv-mindspeed`` (one rank, TP 1): ms-swift 3.12.1's own Megatron
Qwen3-VL step through its NPU branch on the CPU torch_npu stand-in: transformers'
``is_torch_npu_available()`` is True (the stand-in is found), so ms-swift imports
``mindspeed.megatron_adaptor``, applies all its init patches (the TransformerEngine ones included,
over MindSpeed's dummy TE), builds the model on the TE spec (MindSpeed's classes), and
``MegatronSft`` calls ``repatch(asdict(args))`` with ``use_flash_attn=True``; one unpacked sample
(tests/swift/tiny.py), fp32, DDP main_grad, ``get_forward_backward_func()``. Prints JSON: the
stand-in ops that ran, the loss, the parameter names in MindSpeed's order, the main_grads' sha256
(also saved to OUT/raw/grads_post.rankN.safetensors).

``python swift_npu_step.py OUT MODEL_DIR [TP [fp32|bf16 [packed]]]`` (``packed``: the user's packed step,
ms-swift's own packing collation of 3 samples, tests/swift/packed.py, ``padding_free`` on, so
``get_batch`` builds THD ``PackedSeqParams`` with ``cu_seqlens_*_padded`` as on NPU and MindSpeed's
attention runs ``npu_fusion_attention`` in TND; full uniform recompute of every layer) (the tiny model is written there if it is not yet;
TP > 1: one process per rank, launched by run.ranks, sequence parallel on). ``MINDSPEED_STEP_ARGS``
(JSON) adds flags to the arguments before ``repatch``, e.g. ``{"use_fused_rotary_pos_emb": true}``.
``SWIFT_STEP_PLAIN_FIRST=1``: the same call runs once before, on the same weights and batch, its
main_grads saved to OUT/raw/grads_post_plain.rankN.safetensors (with ``ORACLE_CAPTURE_STEP=1`` that one
is not captured and the second is: a non-invasiveness proof in one process)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from probe import _training_only, init_one_rank  # noqa: E402  (tests/npu_standin, tests/swift on sys.path)


def init_ranks(tp):
    """One gloo rank of RANK/WORLD_SIZE (set by the launcher, run.ranks) or a lone rank; TP ``tp``."""
    if "RANK" not in os.environ:
        return init_one_rank()
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.distributed.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    parallel_state.initialize_model_parallel(tp, 1)
    model_parallel_cuda_manual_seed(0)  # as Megatron-LM's initialize: the RNG tracker forks under SP (CPU generator here)


def main(out, model_dir, tp=1, dtype="fp32", mode="unpacked"):
    sys.argv = sys.argv[:1]
    import torch_npu  # the stand-in

    sys.meta_path.insert(0, _training_only()())
    from transformers.utils import is_torch_npu_available

    assert is_torch_npu_available(), "the stand-in must make transformers see an NPU"
    import mindspeed.megatron_adaptor as adaptor  # what swift/megatron/__init__.py imports on NPU
    import mindspeed_ops
    import npu_ops
    import standins
    import torch

    mindspeed_ops.install()
    standins.import_swift_megatron()  # swift.megatron without its __init__ (it clones Megatron-LM)
    from swift.megatron import init

    for name in ("_patch_transformer_engine", "_patch_TELinear", "_patch_TEGroupedLinear"):  # the NPU branch runs these too
        getattr(init, name)()
    import peer
    import tiny

    if not os.path.exists(os.path.join(model_dir, "config.json")):
        tiny.write_model_dir(model_dir)
    args = peer.make_args(model_dir, tp, tp > 1, dtype)  # TP > 1 with sequence parallel, as the user's
    from megatron.core.transformer.enums import AttnBackend

    args.transformer_impl, args.spec, args.attention_backend = "transformer_engine", None, AttnBackend.flash
    args.gradient_accumulation_fusion, args.bias_swiglu_fusion = True, True
    args.use_flash_attn = True  # MegatronSft.__init__ on NPU, attention_backend != local
    packed = mode == "packed"
    if packed:  # the user's flags: --packing true (padding_free), full uniform recompute
        args.padding_free = args.packing = True
        args.recompute_granularity, args.recompute_method, args.recompute_num_layers = "full", "uniform", 1
    args.__dict__.update(json.loads(os.environ.get("MINDSPEED_STEP_ARGS", "{}")))  # the run's own flags, e.g. MindSpeed's
    from mindspeed.args_utils import get_mindspeed_args

    for k, v in vars(get_mindspeed_args()).items():  # MindSpeed's flags, as its patched parse_args adds them
        if not hasattr(args, k):
            setattr(args, k, v)
    adaptor.repatch(dict(vars(args)))
    planted = mindspeed_ops.install_faults()  # test-only patches on MindSpeed's Python (TORCH_NPU_STANDIN_FAULTS)
    standins.set_args(args)
    init_ranks(tp)
    torch.use_deterministic_algorithms(True)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import StragglerDetector, get_model_config
    from swift.megatron.model.gpt_bridge import MultimodalGPTBridge
    from swift.megatron.model.model_provider import model_provider
    from swift.megatron.trainers.trainer import MegatronTrainer

    torch.manual_seed(0)
    model = model_provider(pre_process=True, post_process=True)
    model.model_type = ModelType.encoder_or_decoder
    MultimodalGPTBridge().load_weights(model, model_dir)
    planted += mindspeed_ops.unmark_final_norm(model)
    config = get_model_config(model)
    from megatron.core.transformer.module import Float16Module

    wrapped = Float16Module(config, model) if args.bf16 else standins.PassThroughModule(config, model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), wrapped)
    ddp.train()
    config.grad_scale_func = None
    config.finalize_model_grads_func = finalize_model_grads
    trainer = MegatronTrainer.__new__(MegatronTrainer)
    trainer.args, trainer.stimer, trainer.mcore_013 = args, StragglerDetector(), False
    trainer.unwrapped_models, trainer.wrapped_models, trainer.custom_metrics = [model], [ddp], {}
    if packed:  # SWIFT_STEP_MICROBATCHES=M: the packed step as M micro-batches (tests/swift/packed.py)
        import packed as packed_batch

        samples = packed_batch.microbatches(model_dir, padding_to=tp)
    else:
        samples = [tiny.sample(seq_multiple=tp)]
    seq = max(s["input_ids"].shape[1] for s in samples)
    from npu_ops import attention

    def step():  # a fresh copy of the batch: ms-swift's get_batch changes it in place
        ddp.zero_grad_buffer()
        npu_ops.CALLS.clear()
        npu_ops.faults.reset_counts()
        attention.TND_SEQ_QLEN.clear()
        return get_forward_backward_func()(forward_step_func=trainer.forward_step, data_iterator=iter(copy.deepcopy(samples)),
                                           model=[ddp], num_microbatches=len(samples), seq_length=seq, micro_batch_size=1,
                                           decoder_seq_length=seq, forward_only=False)  # fmt: skip

    from safetensors.torch import save_file

    rank = int(os.environ.get("RANK", 0))
    os.makedirs(os.path.join(out, "raw"), exist_ok=True)
    if os.environ.get("SWIFT_STEP_PLAIN_FIRST") == "1":  # the same call first, uncaptured (ORACLE_CAPTURE_STEP=1)
        step()
        save_file({n: p.main_grad.detach().clone() for n, p in ddp.named_parameters()},
                  os.path.join(out, "raw", f"grads_post_plain.rank{rank}.safetensors"))  # fmt: skip
    losses = step()
    grads = {n: p.main_grad.detach().clone() for n, p in ddp.named_parameters()}
    save_file(grads, os.path.join(out, "raw", f"grads_post.rank{rank}.safetensors"))

    report = {"ops_called": dict(npu_ops.CALLS), "tnd_actual_seq_qlen": attention.TND_SEQ_QLEN,
              "faults_installed": planted, "fault_calls": dict(npu_ops.faults.calls),
              "names": list(grads), "torch_npu_touched": torch_npu.touched(),
              "reported": {k: [float(x) for x in v] for k, v in (losses[0] if losses else {}).items()},
              "grads_sha256": {n: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest() for n, t in grads.items()},
              "zero_grads": sorted(n for n, t in grads.items() if not bool(t.abs().max() > 0))}  # fmt: skip
    print("SWIFT " + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:4]), *sys.argv[4:6])
