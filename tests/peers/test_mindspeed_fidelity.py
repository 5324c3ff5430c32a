"""The 910B path's capture through to the answer: ms-swift 3.12.1's own Qwen3-VL step through its
NPU branch with MindSpeed 0016137 on the CPU torch_npu stand-in (tests/mindspeed/swift_npu_step.py
in ``.venv-mindspeed``), captured by ORACLE_CAPTURE alone, merged with no config (MindSpeed's
parameter order and module names), replayed in float64 and scored. TP 1 and TP 2 + SP, fp32 (and
bf16 at TP 1), one unpacked sample with an image. Skipped where that environment is not built (``.ci/mindspeed-env``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from oracle.bundle.store import Bundle
from oracle.integrations.megatron.merge import merge_ranks
from oracle.integrations.megatron.rankview import compare_rank, rank_view
from oracle.replay.run import replay
from oracle.score.scorer import score

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mindspeed"))
import run as ms_run  # noqa: E402  (tests/mindspeed/run.py: stdlib only)

ROOT = Path(__file__).resolve().parents[2]
VENV = ms_run.VENV  # .venv-mindspeed's interpreter

pytestmark = pytest.mark.skipif(not ms_run.available(), reason="the MindSpeed environment (.venv-mindspeed) is not built")


def _one_rank(out: Path, dtype: str) -> tuple[str, str]:
    """The NPU-branch step captured by ORACLE_CAPTURE, merged and replayed: (capture, oracle)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORACLE_", "TORCH_NPU_STANDIN"))}
    env.update(PYTHONPATH=str(ROOT), ORACLE_CAPTURE=str(out / "capture"))
    p = subprocess.run([str(VENV), str(ROOT / "tests" / "mindspeed" / "swift_npu_step.py"), str(out), str(out / "hf"),
                        "1", dtype], env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    cap = merge_ranks([out / "capture" / "pre"], out / "merged.cap", recipe="qwen3-vl")
    return str(cap), str(replay(cap, out / "oracle"))


@pytest.fixture(scope="module")
def npu_branch(tmp_path_factory):
    return _one_rank(tmp_path_factory.mktemp("npu-branch"), "fp32")


def test_the_npu_branch_bf16_step_is_within_its_emulated_band(tmp_path):
    """A bf16 step through MindSpeed (Float16Module, fp32 main_grad via npu_matmul_add_fp32) captured
    by ORACLE_CAPTURE scores within the noise band of four emulated bf16 runs, on all 104 gradients."""
    cap, oracle = _one_rank(tmp_path / "bf16", "bf16")
    band = replay(cap, tmp_path / "band", dtype="bf16", ensemble=4)
    c = score(oracle, [cap], band_paths=[band])["captures"][0]
    assert len(c["params"]) == 104 and c["verdict"]["class"] == "within_noise", c["verdict"]
    assert max(p["excess"] for p in c["params"]) < 1.0


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


@pytest.fixture(scope="module")
def npu_branch_tp2sp(tmp_path_factory):
    out = tmp_path_factory.mktemp("npu-branch-tp2sp")
    env = {"PYTHONPATH": str(ROOT), "ORACLE_CAPTURE": str(out / "capture")}
    ms_run.ranks("swift_npu_step.py", str(out), str(out / "hf"), "2", world=2, env=env, tag="SWIFT", python=str(VENV))
    cap = merge_ranks([out / "capture" / "pre"], out / "merged.cap", recipe="qwen3-vl")
    return out, str(cap), str(replay(cap, out / "oracle"))


def test_the_npu_branch_tp2_sp_step_is_within_1e5_and_names_the_unreduced_vision_gradients(npu_branch_tp2sp):
    """TP 2 + SP through MindSpeed: the 77 gradients judged against the oracle within 1e-5, the loss
    within 1e-6; the 39 vision-tower gradients ms-swift never reduces across TP ranks are a framework
    finding (as on the H20 path, tests/peers/test_swift_fidelity.py), not a device error."""
    _, cap, oracle = npu_branch_tp2sp
    c = score(oracle, [cap])["captures"][0]
    worst = max(c["params"], key=lambda p: p["rel_l2"])
    assert len(c["params"]) == 77 and worst["rel_l2"] <= 1e-5 and c["loss_check"]["rel"] <= 1e-6, worst
    f = c["framework"]
    assert len(f["adds_up"]) + len(f["excluded"]) == 39 and all(".visual." in n or n.startswith("visual.")
                                                                for n in f["adds_up"] + f["excluded"])  # fmt: skip
    assert c["verdict"]["class"] == "within_noise" and "framework finding" in c["verdict"]["text"]


@pytest.mark.parametrize("rank", [0, 1])
def test_the_npu_branch_tp2_sp_rank_view_matches_each_ranks_own_capture(npu_branch_tp2sp, rank):
    """Each TP rank's own 92 gradients (MindSpeed's modules, its sequence chunk) within 1e-5 of its view."""
    out, _, oracle = npu_branch_tp2sp
    errs = compare_rank(rank_view(oracle, rank=rank), out / "capture" / "pre" / f"rank{rank:05d}")
    worst = max(errs, key=errs.get)
    assert len(errs) == 92 and errs[worst] <= 1e-5, (worst, errs[worst])
