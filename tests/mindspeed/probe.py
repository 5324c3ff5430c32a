"""Run in a subprocess of the MindSpeed environment (``.venv-mindspeed``): import MindSpeed at the
user's commit through its adaptor on the CPU stand-in (tests/npu_standin), optionally call its
``repatch`` as ms-swift 3.12.1's NPU branch does, and print as JSON what each patched megatron-core
name now is, what ORACLE_CAPTURE's wrap of the schedules looks like, and which torch_npu names
were read. ``python probe.py [--repatch JSON_ARGS]``."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "npu_standin"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "swift"))

TARGETS = [
    "megatron.core.models.common.embeddings.rope_utils.apply_rotary_pos_emb",
    "megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_bshd",
    "megatron.core.fusions.fused_bias_swiglu.SwiGLUFunction",
    "megatron.core.fusions.fused_bias_swiglu.BiasSwiGLUFunction",
    "megatron.core.transformer.torch_norm.WrappedTorchNorm",
    "megatron.core.models.gpt.gpt_layer_specs.LNImpl",
    "megatron.core.transformer.dot_product_attention.DotProductAttention.forward",
    "megatron.core.extensions.transformer_engine.TELayerNormColumnParallelLinear",
    "megatron.core.extensions.transformer_engine.TEDotProductAttention",
    "megatron.core.extensions.transformer_engine.TENorm",
    "megatron.core.tensor_parallel.layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32",
    "megatron.core.pipeline_parallel.schedules.get_forward_backward_func",
    "megatron.core.pipeline_parallel.schedules.forward_backward_no_pipelining",
    "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving",
    "megatron.core.distributed.finalize_model_grads.finalize_model_grads",
    "torch.Tensor.view",
    "torch.compile",
]


def resolve(path):
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            obj = getattr(obj, p)
        return obj
    raise ImportError(path)


def describe(obj):
    inner = getattr(obj, "__wrapped__", None)
    name = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
    if inner is not None and getattr(obj, "__module__", "").startswith("oracle."):
        name += f" (wrapping {inner.__module__}.{inner.__qualname__})"
    return name


def snapshot():
    out = {}
    for t in TARGETS:
        try:
            out[t] = describe(resolve(t))
        except Exception as e:  # a name MindSpeed or megatron-core does not provide here
            out[t] = f"<{type(e).__name__}: {e}>"
    s = sys.modules.get("megatron.core.pipeline_parallel.schedules")
    fbf = s.get_forward_backward_func() if s is not None else None
    out["schedule run by get_forward_backward_func()"] = describe(fbf) if fbf is not None else None
    return out


def _training_only():
    import standins

    class TrainingOnly(standins._StubFinder):
        """megatron.training / megatron.legacy stubbed as in the swift peer; megatron-core's own
        transformer_engine extension is the real one (MindSpeed gives it dummy TE modules, as on
        the user's NPU machine, which has no TransformerEngine)."""

        def find_spec(self, fullname, path=None, target=None):
            return None if fullname == standins._TE_EXT else super().find_spec(fullname, path, target)

    return TrainingOnly


def init_one_rank():
    """One gloo rank, TP = PP = 1 (get_forward_backward_func reads the PP size)."""
    import socket

    import torch
    from megatron.core import parallel_state

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repatch", help="JSON dict passed to mindspeed.megatron_adaptor.repatch (ms-swift passes asdict(args))")
    a = ap.parse_args()
    sys.argv = sys.argv[:1]  # MindSpeed parses sys.argv for its own flags: none, as under ms-swift
    import torch_npu

    TrainingOnly = _training_only()  # Megatron-LM's megatron.training (only megatron-core is on PyPI)

    sys.meta_path.insert(0, TrainingOnly())

    import mindspeed.megatron_adaptor as adaptor
    import mindspeed_ops

    mindspeed_ops.install()
    import megatron.core.pipeline_parallel.schedules  # noqa: F401  (as the training loop imports it)
    init_one_rank()

    report = {"after_adaptor": snapshot()}
    if a.repatch is not None:
        adaptor.repatch(json.loads(a.repatch))
        report["after_repatch"] = snapshot()
    report["torch_npu_touched"] = torch_npu.touched()
    print("PROBE " + json.dumps(report))


if __name__ == "__main__":
    main()
