"""Run one of this folder's scripts in a subprocess of this interpreter and return its JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
VENV = os.path.join(ROOT, ".venv-mindspeed", "bin", "python")


def available() -> bool:
    """.venv-mindspeed is built and this checkout's oracle installed in it (marked last by .ci/install-oracle, as
    rank_capture.available)."""
    return os.path.exists(os.path.join(ROOT, ".venv-mindspeed", ".oracle-ready"))


def script(name: str, *args: str, env: dict | None = None, tag: str) -> tuple[dict, str]:
    """(the JSON the script printed after ``tag``, its stderr); fails with the script's output."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("ORACLE_", "TORCH_NPU_STANDIN"))}
    full.update(env or {})
    p = subprocess.run([sys.executable, os.path.join(HERE, name), *args], env=full, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(tag + " ")]
    assert p.returncode == 0 and lines, f"{name} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return json.loads(lines[-1][len(tag) + 1:]), p.stderr


def ranks(name: str, *args: str, world: int, env: dict | None = None, tag: str,
          python: str = sys.executable) -> list[tuple[dict, str]]:  # fmt: skip
    """The script as ``world`` gloo ranks (RANK, WORLD_SIZE, MASTER_ADDR/PORT set) of ``python``,
    each rank's (JSON, stderr)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ORACLE_", "TORCH_NPU_STANDIN"))}
    base.update(env or {}, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([python, os.path.join(HERE, name), *args], env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]  # fmt: skip
    outs = [p.communicate(timeout=600) for p in procs]
    res = []
    for r, (p, (so, se)) in enumerate(zip(procs, outs)):
        lines = [ln for ln in so.splitlines() if ln.startswith(tag + " ")]
        assert p.returncode == 0 and lines, f"{name} rank {r} failed (rc {p.returncode}):\n{so[-3000:]}\n{se[-6000:]}"
        res.append((json.loads(lines[-1][len(tag) + 1:]), se))
    return res


def packed_capture(out: str, dtype: str = "bf16", env: dict | None = None, capture: bool = True,
                   python: str = VENV, plain_first: bool = False) -> tuple[str, list[dict]]:  # fmt: skip
    """The 910B path of the user's PACKED step, captured as the user would (harness for other tests).

    ms-swift 3.12.1's NPU branch with MindSpeed 0016137 (its adaptor and ``repatch``) on the CPU
    torch_npu stand-in, in ``.venv-mindspeed`` (``python``): TP 2 + SP, ms-swift's packing collation
    of 3 samples (2 with images) plus 1 SP pad singleton (tests/swift/packed.py), MindSpeed's
    attention as ``npu_fusion_attention`` in TND with ``actual_seq_qlen`` from ``cu_seqlens``, full
    uniform recompute, ``dtype`` fp32 or bf16 (Float16Module, fp32 main_grad through
    ``npu_matmul_add_fp32``). swift_npu_step.py unchanged, only ``ORACLE_CAPTURE=OUT/capture`` and
    ``ORACLE_CAPTURE_MODULES=layers`` in its environment, plus ``env`` (e.g.
    ``{"TORCH_NPU_STANDIN_FAULTS": "attention_cross_boundary"}``, tests/npu_standin/npu_ops/faults.py).
    ``capture=False``: the same run without them. Returns (``OUT/capture``, each rank's report: the
    ops called, ``tnd_actual_seq_qlen``, the main_grads' sha256, ...); each rank's main_grads are in
    ``OUT/raw/grads_post.rankN.safetensors``. ``plain_first``: each rank runs the same call once before,
    uncaptured (``ORACLE_CAPTURE_STEP=1`` captures the second; the report is the second's), its main_grads
    in ``OUT/raw/grads_post_plain.rankN.safetensors``: non-invasiveness without a second run. For example::

        cap, reports = packed_capture(str(tmp_path / "910b"), "bf16",
                                      env={"TORCH_NPU_STANDIN_FAULTS": "attention_cross_boundary"})
        merged = merge_ranks([Path(cap) / "pre"], tmp_path / "910b.cap", recipe="qwen3-vl")
    """
    hf = os.path.join(out, "hf")
    os.makedirs(out, exist_ok=True)
    subprocess.run([python, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import tiny; tiny.write_model_dir(sys.argv[2])",
                    os.path.join(ROOT, "tests", "swift"), hf], check=True, capture_output=True, timeout=600)  # fmt: skip
    cap = os.path.join(out, "capture")
    e = {"PYTHONPATH": ROOT, **({"ORACLE_CAPTURE": cap, "ORACLE_CAPTURE_MODULES": "layers"} if capture else {}), **(env or {})}
    if plain_first:
        e.update(SWIFT_STEP_PLAIN_FIRST="1", ORACLE_CAPTURE_STEP="1")
    res = ranks("swift_npu_step.py", out, hf, "2", dtype, "packed", world=2, env=e, tag="SWIFT", python=python)
    return cap, [r for r, _ in res]
