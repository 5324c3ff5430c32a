"""One megatron-core 0.12.1 GPT layer (TransformerEngine spec) as MindSpeed 0016137 builds it on
the NPU, re-patched as ms-swift does, runs forward and backward on a packed TND batch on CPU through
the torch_npu stand-in; checked against an independent float64 computation of the same layer.
Planted stand-in faults leave the forward bitwise and move only the gradients upstream of the op.
Runs in .venv-mindspeed only."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import needs_mindspeed  # noqa: E402, F401  (skips this module outside .venv-mindspeed)
import pytest  # noqa: E402
import run  # noqa: E402

UPSTREAM = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.layer_norm_weight",
            "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")  # fmt: skip
DOWNSTREAM = ("self_attention.linear_proj.weight", "mlp.linear_fc1.weight", "mlp.linear_fc1.layer_norm_weight",
              "mlp.linear_fc2.weight")  # fmt: skip


@pytest.fixture(scope="module")
def honest():
    return run.script("layer_step.py", tag="LAYER")[0]


def test_mindspeed_layer_runs_packed_forward_and_backward_on_cpu_as_the_formula(honest):
    """fp32 MindSpeed layer vs float64 plain torch, same weights, packed samples of 5, 1, 3, 1, 6
    tokens: output, input gradient and every weight gradient within 1e-5 (relative to the largest);
    the GEMM weights' gradients arrive through npu_matmul_add_fp32 into main_grad; each stand-in op
    ran (rotary once per sample for q and k, attention once in TND)."""
    assert honest["output"] < 1e-5 and honest["input_grad"] < 1e-5
    assert max(honest["grad"].values()) < 1e-5, honest["grad"]
    assert honest["into_main_grad"] == sorted(("mlp.linear_fc1.weight", "mlp.linear_fc2.weight",
                                               "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight"))  # fmt: skip
    assert honest["ops_called"] == {"npu_rms_norm": 4, "npu_rotary_position_embedding": 10, "npu_fusion_attention": 1,
                                    "npu_swiglu": 1, "npu_matmul_add_fp32": 4}  # fmt: skip
    assert "mindspeed.te.pytorch.module.layernorm_column_parallel_linear.MindSpeedTELayerNormColumnParallelLinear" \
        in honest["modules"] and "mindspeed.core.fusions.fused_rms_norm.RMSNorm" in honest["modules"]


@pytest.mark.parametrize("fault,moved,kept,at_least", [
    ("attention_cross_boundary", UPSTREAM, DOWNSTREAM, 1e-2),
    ("rotary_sin_sign", UPSTREAM[:1] + UPSTREAM[2:], DOWNSTREAM, 1e-2),
    ("matmul_add_bf16", ("self_attention.linear_qkv.weight", "mlp.linear_fc2.weight"), UPSTREAM[1:], 1e-4),
])  # fmt: skip
def test_a_planted_fault_leaves_the_forward_bitwise_and_moves_these_gradients(honest, fault, moved, kept, at_least):
    """TORCH_NPU_STANDIN_FAULTS reaches the ranks' ops through MindSpeed's own call paths: the
    output is bitwise the honest run's; the gradients behind the faulty op are off by at least
    ``at_least`` (relative), the others stay within 1e-5."""
    bad = run.script("layer_step.py", env={"TORCH_NPU_STANDIN_FAULTS": fault}, tag="LAYER")[0]
    assert bad["output_sha256"] == honest["output_sha256"]
    for name in moved:
        assert bad["grad"][name] > at_least, (name, bad["grad"][name])
    for name in kept:
        assert bad["grad"][name] < 1e-5, (name, bad["grad"][name])
