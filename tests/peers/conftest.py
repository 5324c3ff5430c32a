"""The two user paths' steps and ``oracle judge`` work folders, shared by every peer file in one session.

test_packed_fidelity.py and test_two_paths_judge.py use the same packed bf16 captures (honest H20,
honest 910B) and the judge's honest H20 truth and band; CI runs both files in one pytest command, so
each step runs once and each truth/band is replayed once (the judge reuses its work folder's stages by
content, oracle/pipeline/workfolder.py). A path whose pinned environment is not built is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "swift"))
sys.path.insert(0, str(ROOT / "tests" / "mindspeed"))
import rank_capture  # noqa: E402  (tests/swift/rank_capture.py: stdlib only at import)
import run as ms_run  # noqa: E402  (tests/mindspeed/run.py: stdlib only)

PATHS = {"h20": rank_capture.VENV, "910b": ms_run.VENV}
READY = {"h20": rank_capture.available, "910b": ms_run.available}  # built and marked ready (.ci/install-oracle)
UNPACKED = {"tp": 2, "sp": True, "dtype": "bf16"}  # the user's TP 2 + SP, bf16 with fp32 main_grad, one unpacked sample
ACCUMULATED = 96  # micro-batches of the accumulated step: a bf16 main_grad accumulation leaves the band (at 24: 1.6x)


def need(path: str) -> None:
    if not READY[path]():
        pytest.skip(f"the {path} path's environment ({os.path.relpath(PATHS[path], ROOT)}) is not built")


def capture(path: str, out: Path, env: dict[str, str] | None = None) -> Path:
    """One UNPACKED step of ``path`` ("H20" or "910B") captured by ORACLE_CAPTURE (module boundaries of the
    decoder layers) with ``env`` added to its ranks' environment; -> the rank folder ``OUT/capture/pre``."""
    env = {"ORACLE_CAPTURE_MODULES": "layers", **(env or {})}
    if path == "H20":
        rank_capture.env_capture(str(out), tp=UNPACKED["tp"], sp=UNPACKED["sp"], dtype=UNPACKED["dtype"], env=env)
    else:
        env.update(PYTHONPATH=str(ROOT), ORACLE_CAPTURE=str(out / "capture"))
        res = ms_run.ranks("swift_npu_step.py", str(out), str(out / "hf"), str(UNPACKED["tp"]), UNPACKED["dtype"],
                           world=UNPACKED["tp"], env=env, tag="SWIFT", python=str(ms_run.VENV))  # fmt: skip
        (out / "step.json").write_text(json.dumps([r for r, _ in res]))
    return out / "capture" / "pre"


@pytest.fixture(scope="session")
def steps(tmp_path_factory):
    """steps(path, dtype, capture=True, faults="", microbatches=1) -> (OUT, OUT/capture, the 910B ranks' reports
    or None): the user's PACKED step of ``path`` ("h20" or "910b"), each once per session; ``faults`` planted in
    the 910B stand-in (``TORCH_NPU_STANDIN_FAULTS``); ``microbatches`` > 1: the step as that many micro-batches
    of gradient accumulation (``SWIFT_STEP_MICROBATCHES``, tests/swift/packed.py). The honest captured bf16 step runs its call twice in one process
    (``plain_first``): first uncaptured, then captured (``ORACLE_CAPTURE_STEP=1``), the first's main_grads in
    ``OUT/raw/..grads_post_plain..``: the non-invasiveness proof, with no extra run."""
    root, cache = tmp_path_factory.mktemp("packed"), {}

    def get(path, dtype, capture=True, faults="", microbatches=1):
        need(path)
        key = (path, dtype, capture, faults, microbatches)
        if key not in cache:
            tag = faults.replace(",", "+").replace("@", "_")
            out = str(root / f"{path}-{dtype}-{'captured' if capture else 'plain'}{'-' + tag if tag else ''}-mb{microbatches}")
            plain_first = capture and dtype == "bf16" and not faults and microbatches == 1
            mb = {"SWIFT_STEP_MICROBATCHES": str(microbatches)} if microbatches > 1 else {}  # tests/swift/packed.py
            if path == "h20":
                assert not faults, "faults are planted in the 910B stand-in only"
                cache[key] = (out, rank_capture.packed_capture(out, dtype, env=mb, capture=capture, plain_first=plain_first), None)
            else:
                env = {**({"TORCH_NPU_STANDIN_FAULTS": faults} if faults else {}), **mb} or None
                cap, reports = ms_run.packed_capture(out, dtype, env=env, capture=capture, plain_first=plain_first)
                cache[key] = (out, cap, reports)
        return cache[key]

    return get


class Judged:
    """``oracle judge H20 910B`` in ONE work folder (``ROOT/judge``: run A's merge, truth and band made once);
    each 910B capture judged once (its JSON report kept). ``capture_b(faults, folder)`` -> the 910B rank
    folder with ``faults`` planted ("" honest)."""

    def __init__(self, root: Path, h20: Path, capture_b):
        self.root, self.h20, self.capture_b, self.done, self.folders = root, h20, capture_b, {}, {}

    def __call__(self, faults: str) -> tuple[dict, str]:
        if faults not in self.done:
            b = self.capture_b(faults, self.root / (faults.replace(",", "+").replace("@", "_") or "honest"))
            self.folders[faults], self.done[faults] = b, self.judge(b, faults)
        return self.done[faults]

    def judge(self, b: Path, label: str) -> tuple[dict, str]:
        """``oracle judge`` (the console command's module, a subprocess) of the honest H20 capture and ``b``:
        (judge.json, stdout + stderr); a copy of the report is kept per label."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ORACLE_", "TORCH_NPU_STANDIN"))}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        p = subprocess.run([sys.executable, "-m", "oracle", "judge", str(self.h20), str(b), "--recipe", "qwen3-vl",
                            "--name", "H20", "--name", "910B", "--out", str(self.root / "judge")], env=env, cwd=self.root,
                           capture_output=True, text=True, timeout=900)  # fmt: skip
        assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
        doc = json.loads((self.root / "judge" / "report" / "judge.json").read_text())
        (self.root / f"judge-{label or 'honest'}.txt").write_text(p.stdout)
        return doc, p.stdout + p.stderr


@pytest.fixture(scope="session")
def judged(tmp_path_factory):
    """The UNPACKED step judged: honest H20 capture vs the 910B one with faults planted."""
    need("h20"), need("910b")
    root = tmp_path_factory.mktemp("two-paths")
    return Judged(root, capture("H20", root / "h20"),
                  lambda faults, folder: capture("910B", folder, {"TORCH_NPU_STANDIN_FAULTS": faults} if faults else None))


@pytest.fixture(scope="session")
def packed_judged(steps, tmp_path_factory):
    """The PACKED bf16 step judged: the honest H20 capture of ``steps`` vs the 910B one of ``steps`` with
    faults planted (the honest ones are test_packed_fidelity.py's; its H20 bf16 band test reads this work
    folder's truth and band)."""
    need("h20"), need("910b")
    root = tmp_path_factory.mktemp("two-paths-packed")
    return Judged(root, Path(steps("h20", "bf16")[1]) / "pre",
                  lambda faults, folder: Path(steps("910b", "bf16", faults=faults)[1]) / "pre")


@pytest.fixture(scope="session")
def accumulated_judged(steps, tmp_path_factory):
    """The PACKED bf16 step as ``ACCUMULATED`` micro-batches (the three samples in turn, one each) judged: the
    honest H20 capture vs the 910B one with faults planted, in a work folder of its own."""
    need("h20"), need("910b")
    root = tmp_path_factory.mktemp("two-paths-accumulated")
    return Judged(root, Path(steps("h20", "bf16", microbatches=ACCUMULATED)[1]) / "pre",
                  lambda faults, folder: Path(steps("910b", "bf16", faults=faults, microbatches=ACCUMULATED)[1]) / "pre")


@pytest.fixture(scope="session")
def unpacked_capture():
    """``capture(path, out, env)``: one UNPACKED step captured (for a capture no judge work folder shares)."""
    need("h20"), need("910b")
    return capture


SUB_MODULES = r"decoder\.layers\.0\..*"  # the judge's advice: decoder layer 0's sub-modules, not the layer
MLP_FAULT = "mlp-grad:0:1.5"  # tests/swift/peer.py plant_fault: layer 0's MLP scales the gradient inside its backward


@pytest.fixture(scope="session")
def sub_judged(tmp_path_factory):
    """The UNPACKED step with decoder layer 0's sub-module boundaries (``SUB_MODULES``) on both paths, judged:
    the H20 run with ``MLP_FAULT`` planted (A) vs the 910B one with ``faults`` planted in the stand-in."""
    need("h20"), need("910b")
    root = tmp_path_factory.mktemp("two-paths-sub")
    return Judged(root, capture("H20", root / "h20", {"ORACLE_CAPTURE_MODULES": SUB_MODULES, "SWIFT_PEER_FAULT": MLP_FAULT}),
                  lambda faults, folder: capture("910B", folder, {"ORACLE_CAPTURE_MODULES": SUB_MODULES,
                                                                  **({"TORCH_NPU_STANDIN_FAULTS": faults} if faults else {})}))


VIT_MODULES = "layers,vit"  # the decoder layers and the vision blocks (hook.py MODULE_PRESETS)
VIT_FAULT = "vit-fwd:0:1.1"  # tests/swift/peer.py plant_fault: vision block 0's output x1.1 inside its forward


@pytest.fixture(scope="session")
def vit_judged(tmp_path_factory):
    """The UNPACKED step with the decoder layers' and the vision blocks' boundaries on both paths, judged: the
    H20 run with ``VIT_FAULT`` planted (A) vs the 910B one with ``faults`` planted in the stand-in."""
    need("h20"), need("910b")
    root = tmp_path_factory.mktemp("two-paths-vit")
    return Judged(root, capture("H20", root / "h20", {"ORACLE_CAPTURE_MODULES": VIT_MODULES, "SWIFT_PEER_FAULT": VIT_FAULT}),
                  lambda faults, folder: capture("910B", folder, {"ORACLE_CAPTURE_MODULES": VIT_MODULES,
                                                                  **({"TORCH_NPU_STANDIN_FAULTS": faults} if faults else {})}))
