"""MindSpeed at the user's commit (0016137) imported on CPU through its adaptor, on the torch_npu
stand-in, and re-patched as ms-swift 3.12.1's NPU branch does (``repatch(asdict(args))`` with
``use_flash_attn=True``): which megatron-core names it replaces, which torch_npu names it reads, and
whether ORACLE_CAPTURE's wrap of the schedules survives. Runs in .venv-mindspeed only."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import needs_mindspeed  # noqa: E402, F401  (skips this module outside .venv-mindspeed)
import pytest  # noqa: E402
import run  # noqa: E402

SWIFT_REPATCH = json.dumps({"use_flash_attn": True})
WRAPPED = "oracle.integrations.megatron.autocapture._wrap.<locals>.forward_backward (wrapping {})"
SCHED = "megatron.core.pipeline_parallel.schedules."

# what the adaptor alone replaces (its optimization-level-0 features), as the user's step reaches it
AT_IMPORT = {
    "megatron.core.models.common.embeddings.rope_utils.apply_rotary_pos_emb":
        "mindspeed.core.fusions.fused_rope.apply_rotary_pos_emb",
    "megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_bshd":
        "mindspeed.core.fusions.fused_rope.apply_rotary_pos_emb_bshd",
    "megatron.core.fusions.fused_bias_swiglu.SwiGLUFunction": "mindspeed.core.fusions.fused_bias_swiglu.SwiGLUFunction",
    "megatron.core.fusions.fused_bias_swiglu.BiasSwiGLUFunction":
        "mindspeed.core.fusions.fused_bias_swiglu.BiasSwiGLUFunction",
    "megatron.core.transformer.torch_norm.WrappedTorchNorm": "mindspeed.core.megatron_basic.megatron_basic.PTNorm",
    "megatron.core.models.gpt.gpt_layer_specs.LNImpl": "mindspeed.core.megatron_basic.megatron_basic.PTNorm",
    "megatron.core.extensions.transformer_engine.TENorm": "mindspeed.core.megatron_basic.megatron_basic.PTNorm",
    "megatron.core.extensions.transformer_engine.TELayerNormColumnParallelLinear":
        "mindspeed.te.pytorch.module.layernorm_column_parallel_linear.MindSpeedTELayerNormColumnParallelLinear",
    "megatron.core.extensions.transformer_engine.TEDotProductAttention":
        "megatron.core.transformer.dot_product_attention.DotProductAttention",
    "megatron.core.tensor_parallel.layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32":
        "mindspeed.ops.npu_matmul_add.npu_matmul_add_fp32",
    "megatron.core.transformer.dot_product_attention.DotProductAttention.forward":
        "megatron.core.transformer.dot_product_attention.DotProductAttention.forward",
    "torch.Tensor.view": "mindspeed.core.megatron_basic.requirements_basic.TensorBase.view",
    "torch.compile": "mindspeed.core.megatron_basic.requirements_basic.dummy_compile",
    SCHED + "get_forward_backward_func": SCHED + "get_forward_backward_func",
    "megatron.core.distributed.finalize_model_grads.finalize_model_grads":
        "megatron.core.distributed.finalize_model_grads.finalize_model_grads",
}  # fmt: skip


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    out = tmp_path_factory.mktemp("capture")
    return run.script("probe.py", "--repatch", SWIFT_REPATCH, env={"ORACLE_CAPTURE": str(out)}, tag="PROBE")


def test_the_adaptor_imports_on_cpu_and_replaces_these_megatron_core_names(probed):
    """``import mindspeed.megatron_adaptor`` succeeds on the stand-in and replaces rotary (both entry
    points), SwiGLU, the norms (RMSNorm also inside the norm-linear), TE's classes and the fused
    wgrad accumulation; core attention's forward is megatron-core's until ms-swift's repatch."""
    report, _ = probed
    for name, want in AT_IMPORT.items():
        assert report["after_adaptor"][name] == want, name


def test_repatch_as_ms_swift_calls_it_routes_core_attention_to_npu_fusion_attention(probed):
    """After ``repatch({..., use_flash_attn: True})`` DotProductAttention.forward is MindSpeed's
    flash-attention adaptor (npu_fusion_attention, TND for packed batches); the rest is unchanged."""
    report, _ = probed
    after = report["after_repatch"]
    assert after["megatron.core.transformer.dot_product_attention.DotProductAttention.forward"] == \
        "mindspeed.core.transformer.flash_attention.flash_attention.adaptor.dot_product_attention_forward_impl"
    for name, want in AT_IMPORT.items():
        if not name.endswith("DotProductAttention.forward"):
            assert after[name] == want, name


def test_the_torch_npu_names_mindspeed_reads_at_import_and_repatch(probed):
    """Exactly these torch_npu names are read by import + repatch (each op is read when called):
    the HCCL options class (its profiler's get_nccl_options wrapper), ``npu._lazy_call`` and
    ``npu.device`` (its CUDA RNG state setter)."""
    report, _ = probed
    assert report["torch_npu_touched"] == {
        "_C": ["mindspeed.functional.profiler.profiler_info"],
        "npu._lazy_call": ["mindspeed.core.megatron_basic.megatron_basic"],
        "npu.device": ["mindspeed.core.megatron_basic.megatron_basic"],
    }


def test_oracle_capture_wrap_survives_the_adaptor_and_repatch(probed):
    """With ORACLE_CAPTURE set, the schedules megatron-core's get_forward_backward_func returns are
    still the capture's wrappers after MindSpeed's adaptor and ms-swift's repatch (MindSpeed's patch
    manager replaces only objects identical to what it registered, and restores its own on remove)."""
    report, _ = probed
    for stage in ("after_adaptor", "after_repatch"):
        snap = report[stage]
        for fn in ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving"):
            assert snap[SCHED + fn] == WRAPPED.format(SCHED + fn), (stage, fn)
        assert snap["schedule run by get_forward_backward_func()"] == WRAPPED.format(SCHED + "forward_backward_no_pipelining")


def test_a_mindspeed_schedule_feature_bypasses_the_wrap_and_the_capture_says_nothing_was_captured(tmp_path):
    """MindSpeed's --optimize-send-recv-comm replaces get_forward_backward_func itself: even at PP 1 it
    returns MindSpeed's own flexible_schedules.forward_backward_pipelining_without_interleaving, which
    the capture never wraps; the process then ends saying on stderr that nothing was captured."""
    report, stderr = run.script("probe.py", "--repatch", json.dumps({"use_flash_attn": True, "optimize_send_recv_comm": True}),
                                env={"ORACLE_CAPTURE": str(tmp_path / "cap")}, tag="PROBE")  # fmt: skip
    after = report["after_repatch"]
    assert after[SCHED + "get_forward_backward_func"] == \
        "mindspeed.core.pipeline_parallel.optimize_send_recv_comm.adaptor.mindspeed_get_forward_backward_func"
    assert after["schedule run by get_forward_backward_func()"] == \
        "mindspeed.core.pipeline_parallel.flexible_schedules.forward_backward_pipelining_without_interleaving"
    assert f"ORACLE_CAPTURE={tmp_path / 'cap'} is set but nothing was captured" in stderr
