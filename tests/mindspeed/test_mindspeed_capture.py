"""ORACLE_CAPTURE on a step that runs through MindSpeed 0016137 (adaptor + ms-swift's repatch, the
TE spec as MindSpeed builds it, the CPU torch_npu stand-in): a tiny megatron-core GPTModel, TP 1,
fp32 with DDP main_grad, a packed TND batch (leading 0, two pad singletons), one call of
``get_forward_backward_func()``. Only the environment variables are set; nothing is edited.
Runs in .venv-mindspeed only."""

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


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    plain = str(tmp_path_factory.mktemp("plain"))
    cap = str(tmp_path_factory.mktemp("captured"))
    env = {"ORACLE_CAPTURE": os.path.join(cap, "capture"), "ORACLE_CAPTURE_MODULES": "layers"}
    got, stderr = run.script("gpt_step.py", cap, env=env, tag="GPT")
    want, _ = run.script("gpt_step.py", plain, tag="GPT")
    return cap, got, want, stderr


def test_the_mindspeed_step_reaches_every_standin_op(steps):
    """The step ran MindSpeed's paths: per layer 2 q/k norms + 2 fused-norm linears (+ the final
    norm), rotary per packed sample for q and k, TND attention, SwiGLU, and the wgrad accumulation
    into main_grad for 4 GEMMs per layer plus the output layer; every gradient is nonzero."""
    _, got, _, _ = steps
    assert got["ops_called"] == {"npu_rms_norm": 9, "npu_rotary_position_embedding": 20, "npu_fusion_attention": 2,
                                 "npu_swiglu": 2, "npu_matmul_add_fp32": 9}  # fmt: skip
    assert all(got["nonzero"].values())


def test_oracle_capture_records_the_mindspeed_step_and_changes_nothing(steps):
    """With ORACLE_CAPTURE (and ORACLE_CAPTURE_MODULES=layers) the rank writes pre and post; post's
    gradients are bitwise the step's main_grads after finalize, the inputs are the batch with the
    packed cu_seqlens as given (leading 0, pad singletons), both layers' boundaries are held; every
    main_grad is bitwise that of the same step without the variables."""
    cap, got, want, stderr = steps
    assert got["grads_sha256"] == want["grads_sha256"]
    assert "oracle: captured training call 0 into" in stderr and "with 2 module boundaries" in stderr
    raw = load_file(os.path.join(cap, "raw", "grads_post.safetensors"))
    batch = load_file(os.path.join(cap, "raw", "batch.safetensors"))
    for sub, stage in (("pre", "pre-finalize"), ("post", "post-finalize")):
        b = Bundle(os.path.join(cap, "capture", sub, "rank00000"))
        assert b.get("megatron")["stage"] == stage and b.get("megatron")["num_tokens"] == 16
        g = b.load_group("grads")
        assert set(g) == set(raw)
        x = b.load_group("inputs")
        assert all(torch.equal(x[k], batch[k]) for k in batch)
        assert x["cu_seqlens"].tolist() == [0, 5, 6, 9, 10, 16]
        assert sorted(b.get("modules")) == ["module.decoder.layers.0", "module.decoder.layers.1"]
    assert all(torch.equal(g[n], raw[n]) for n in raw)  # post
