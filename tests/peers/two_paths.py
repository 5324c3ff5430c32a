"""The user's two training paths on this CPU, each step captured by ``ORACLE_CAPTURE`` alone, ready for judge.

    bash .ci/swift-env && bash .ci/mindspeed-env        # the two pinned environments (about 10 min, once)
    python tests/peers/two_paths.py OUT [--dtype bf16|fp32] [--fault NAME[@K]]

Runs the user's packed step (TP 2 + sequence parallel, ms-swift's packing of 3 samples, 2 with images,
plus one SP pad token, full recompute; tests/swift/packed.py) of the tiny Qwen3-VL once per path, with
only ``ORACLE_CAPTURE`` and ``ORACLE_CAPTURE_MODULES=layers`` in the ranks' environment:

- H20 path: ms-swift 3.12.1's own Megatron Qwen3-VL on megatron-core 0.12.1 (``.venv-swift``,
  tests/swift/peer.py), its THD attention a stand-in for TransformerEngine's -> ``OUT/h20/capture/pre``;
- 910B path: the same step through ms-swift's NPU branch with MindSpeed 0016137 on the CPU torch_npu
  stand-in (``.venv-mindspeed``, tests/mindspeed/swift_npu_step.py) -> ``OUT/910b/capture/pre``.

``--fault`` plants one of the stand-in's faults in the 910B run (tests/npu_standin/npu_ops/faults.py, e.g.
``attention_cross_boundary@3``: layer 0's attention backward across a packed boundary). Both are CPU runs
of test harnesses standing in for the two clusters; the real TE and NPU kernels never run here. The last
lines printed are the ``oracle judge`` command for the two captures. Exit 2: an environment is not built
or a fault is unknown (the fix named); the captures are the same bitwise as the test suite's
(tests/peers/test_two_paths_judge.py::test_the_two_paths_script_captures_the_steps_the_suite_judges).

Stdlib only: the steps run in their own environments' interpreters.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "swift"))
sys.path.insert(0, str(ROOT / "tests" / "mindspeed"))
import rank_capture  # noqa: E402  (stdlib only at import)
import run as ms_run  # noqa: E402  (stdlib only)

# the stand-in's fault names: its faults.py alone (stdlib), not its package (which imports torch)
_spec = importlib.util.spec_from_file_location("standin_faults", ROOT / "tests" / "npu_standin" / "npu_ops" / "faults.py")
faults = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(faults)

ENVS = {"H20": (rank_capture, "bash .ci/swift-env"), "910B": (ms_run, "bash .ci/mindspeed-env")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="folder for both paths' runs and captures (new or empty)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="bf16: Float16Module, fp32 main_grad")
    ap.add_argument("--fault", default="", help="a stand-in fault planted in the 910B run, NAME or NAME@K")
    o = ap.parse_args(argv)
    missing = [f"{name}: {os.path.relpath(mod.VENV, ROOT)} (build it: {fix})" for name, (mod, fix) in ENVS.items()
               if not mod.available()]  # fmt: skip
    if missing:
        print("two_paths: the pinned environments are not built: " + "; ".join(missing), file=sys.stderr)
        return 2
    try:
        for spec in filter(None, o.fault.split(",")):
            faults._parse(spec)
    except ValueError as e:
        print(f"two_paths: --fault: {e}", file=sys.stderr)
        return 2
    if o.out.exists() and any(o.out.iterdir()):
        print(f"two_paths: {o.out} is not empty; choose a new or empty folder (nothing was written)", file=sys.stderr)
        return 2
    o.out.mkdir(parents=True, exist_ok=True)
    print(f"H20 path: ms-swift + megatron-core, the packed step in {o.dtype} (about 1 min) ...", flush=True)
    h20 = Path(rank_capture.packed_capture(str(o.out / "h20"), o.dtype)) / "pre"
    print(f"  captured -> {h20}", flush=True)
    print(f"910B path: ms-swift + MindSpeed on the torch_npu stand-in{', fault ' + o.fault if o.fault else ''} ...", flush=True)
    env = {faults.ENV: o.fault} if o.fault else None
    npu = Path(ms_run.packed_capture(str(o.out / "910b"), o.dtype, env=env)[0]) / "pre"
    print(f"  captured -> {npu}", flush=True)
    print("\nthe answer (on this CPU, in the test environment .venv or any with oracle-fp64 installed):")
    print(f"oracle judge {h20} {npu} --recipe qwen3-vl --name H20 --name 910B --out {o.out / 'judge'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
