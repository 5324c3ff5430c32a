"""ms-swift 3.12.1's own Megatron Qwen3-VL step through its NPU branch (transformers sees the
torch_npu stand-in, so ms-swift imports MindSpeed 0016137's adaptor, applies its TE patches over
MindSpeed's dummy TE, builds the TE spec as MindSpeed's classes, and repatches with
use_flash_attn), one rank, fp32, one unpacked sample with an image, on CPU; and ORACLE_CAPTURE on it
with no edit. Runs in .venv-mindspeed only."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import needs_mindspeed  # noqa: E402, F401  (skips this module outside .venv-mindspeed)
import pytest  # noqa: E402
import run  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from oracle.bundle.store import Bundle  # noqa: E402

LAYER0 = "module.module.language_model.decoder.layers.0."


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    sys.path.insert(0, os.path.join(os.path.dirname(run.HERE), "swift"))
    import tiny

    hf = tiny.write_model_dir(str(tmp_path_factory.mktemp("tiny-qwen3-vl")))
    cap, plain = str(tmp_path_factory.mktemp("captured")), str(tmp_path_factory.mktemp("plain"))
    env = {"ORACLE_CAPTURE": os.path.join(cap, "capture"), "ORACLE_CAPTURE_MODULES": "layers"}
    got, stderr = run.script("swift_npu_step.py", cap, hf, env=env, tag="SWIFT")
    want, _ = run.script("swift_npu_step.py", plain, hf, tag="SWIFT")
    return cap, got, want, stderr


def test_the_npu_branch_runs_mindspeed_and_transformers_npu_kernels(steps):
    """The step reaches MindSpeed's attention (4 text layers) and transformers' NPU flash attention
    (3 ViT blocks), MindSpeed's RMSNorm (inside the fused norm-linears too), SwiGLU and the wgrad
    accumulation; the rotary embedding is mRoPE, ms-swift's own, so no NPU rotary op runs with
    ms-swift's default flags; every gradient is nonzero and the loss is finite."""
    _, got, _, _ = steps
    assert got["ops_called"] == {"npu_fusion_attention": 7, "npu_rms_norm": 17, "npu_swiglu": 4,
                                 "npu_matmul_add_fp32": 17}  # fmt: skip
    assert sorted(got["torch_npu_touched"]["npu_fusion_attention"]) == [
        "mindspeed.core.transformer.flash_attention.flash_attention.adaptor", "transformers.integrations.npu_flash_attention"]
    assert got["zero_grads"] == [] and torch.isfinite(torch.tensor(got["reported"]["lm loss"])).all()


def test_mindspeed_orders_the_qkv_weight_before_its_norm_weight_as_the_910b_log(steps):
    """MindSpeed's fused norm-linear registers ``linear_qkv.weight`` before
    ``linear_qkv.layer_norm_weight`` (the 910B log's order; TE's is the reverse)."""
    _, got, _, _ = steps
    names = [n[len(LAYER0):] for n in got["names"] if n.startswith(LAYER0)]
    assert names.index("self_attention.linear_qkv.weight") < names.index("self_attention.linear_qkv.layer_norm_weight")
    assert names.index("mlp.linear_fc1.weight") < names.index("mlp.linear_fc1.layer_norm_weight")


def test_oracle_capture_records_the_npu_branch_step_and_changes_nothing(steps):
    """ORACLE_CAPTURE with ORACLE_CAPTURE_MODULES=layers: pre and post written, post's gradients
    bitwise the step's, the 4 decoder layers' boundaries held; every main_grad bitwise that of the
    run without the variables."""
    cap, got, want, stderr = steps
    assert got["grads_sha256"] == want["grads_sha256"]
    assert "oracle: captured training call 0 into" in stderr and "with 4 module boundaries" in stderr
    raw = load_file(os.path.join(cap, "raw", "grads_post.rank0.safetensors"))
    post = Bundle(os.path.join(cap, "capture", "post", "rank00000"))
    g = post.load_group("grads")
    assert set(g) == set(raw) and all(torch.equal(g[n], raw[n]) for n in raw)
    assert sorted(post.get("modules")) == [f"module.module.language_model.decoder.layers.{i}" for i in range(4)]
    assert Bundle(os.path.join(cap, "capture", "pre", "rank00000")).get("megatron")["stage"] == "pre-finalize"


def test_mindspeed_refuses_its_fused_rotary_op_with_qwen3_vl_mrope(tmp_path):
    """The NPU rotary op cannot be on the user's step: MindSpeed's --use-fused-rotary-pos-emb is
    refused for Qwen3-VL's position_embedding_type mrope (its rotary runs as torch ops in ms-swift's
    mRoPE through MindSpeed's unfused branch), so a rotary fault on this path is not an NPU kernel's."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORACLE_", "TORCH_NPU_STANDIN"))}
    env["MINDSPEED_STEP_ARGS"] = '{"use_fused_rotary_pos_emb": true}'
    p = subprocess.run([sys.executable, os.path.join(run.HERE, "swift_npu_step.py"), str(tmp_path), str(tmp_path / "hf")],
                       env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode != 0
    assert "--use-fused-rotary-pos-emb must enable with--position-embedding-type=rope" in p.stderr


RECOMPUTE = '{"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}'


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "full-recompute"])
def test_oracle_capture_changes_nothing_in_the_bf16_npu_branch_step(tmp_path, recompute):
    """bf16 (Float16Module, fp32 main_grad), also under full uniform recompute (the decoder layers'
    NPU ops run twice): with ORACLE_CAPTURE and ORACLE_CAPTURE_MODULES=layers every main_grad is
    bitwise that of the run without them, and the capture is written."""
    extra = {"MINDSPEED_STEP_ARGS": RECOMPUTE} if recompute else {}
    env = {"ORACLE_CAPTURE": str(tmp_path / "cap" / "capture"), "ORACLE_CAPTURE_MODULES": "layers", **extra}
    got, stderr = run.script("swift_npu_step.py", str(tmp_path / "cap"), str(tmp_path / "hf"), "1", "bf16", env=env,
                             tag="SWIFT")  # fmt: skip
    want, _ = run.script("swift_npu_step.py", str(tmp_path / "plain"), str(tmp_path / "hf"), "1", "bf16", env=extra,
                         tag="SWIFT")  # fmt: skip
    assert got["grads_sha256"] == want["grads_sha256"] and got["zero_grads"] == []
    assert "oracle: captured training call 0 into" in stderr and "with 4 module boundaries" in stderr
    text_layers = 4 if recompute else 0  # recomputed forwards: attention, 4 norms, SwiGLU per decoder layer
    assert got["ops_called"] == {"npu_fusion_attention": 7 + text_layers, "npu_rms_norm": 17 + 4 * text_layers,
                                 "npu_swiglu": 4 + text_layers, "npu_matmul_add_fp32": 17}  # fmt: skip
