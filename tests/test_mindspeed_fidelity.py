"""The 910B path's capture through to the answer: ms-swift 3.12.1's own Qwen3-VL step through its
NPU branch with MindSpeed 0016137 on the CPU torch_npu stand-in (tests/mindspeed/swift_npu_step.py
in ``.venv-mindspeed``), captured by ORACLE_CAPTURE alone, merged with no config (MindSpeed's
parameter order and module names), replayed in float64 and scored. TP 1, fp32, one unpacked sample
with an image. Skipped where that environment is not built (``.ci/mindspeed-env``)."""

import os
import subprocess
from pathlib import Path

import pytest

from oracle.bundle.store import Bundle
from oracle.integrations.megatron.merge import merge_ranks
from oracle.replay.run import replay
from oracle.score.scorer import score

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-mindspeed" / "bin" / "python"

pytestmark = pytest.mark.skipif(not VENV.exists(), reason="the MindSpeed environment (.venv-mindspeed) is not built")


@pytest.fixture(scope="module")
def npu_branch(tmp_path_factory):
    out = tmp_path_factory.mktemp("npu-branch")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORACLE_", "TORCH_NPU_STANDIN"))}
    env.update(PYTHONPATH=str(ROOT), ORACLE_CAPTURE=str(out / "capture"))
    p = subprocess.run([str(VENV), str(ROOT / "tests" / "mindspeed" / "swift_npu_step.py"), str(out), str(out / "hf")],
                       env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    cap = merge_ranks([out / "capture" / "pre"], out / "merged.cap", recipe="qwen3-vl")
    return str(cap), str(replay(cap, out / "oracle"))


def test_the_npu_branch_fp32_step_is_within_1e5_of_the_oracle_with_no_config_given(npu_branch):
    """MindSpeed's names and order merge with no config (mRoPE, pre-rolled labels, TE-style fused
    norm weights): every one of the 104 gradients within 1e-5 of float64, the loss within 1e-6,
    verdict within noise, no framework finding."""
    cap, oracle = npu_branch
    meg = Bundle(cap).get("megatron")
    assert meg["config"]["position_embedding_type"] == "mrope" and meg["labels"]["labels_shift"] == "pre-rolled"
    c = score(oracle, [cap])["captures"][0]
    worst = max(c["params"], key=lambda p: p["rel_l2"])
    assert len(c["params"]) == 104 and worst["rel_l2"] <= 1e-5, worst
    assert c["loss_check"]["rel"] <= 1e-6 and c["framework"] is None
    assert c["verdict"]["class"] == "within_noise"
