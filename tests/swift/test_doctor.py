"""The cluster install in the pinned training environment: the wheel built from this checkout
installs offline changing nothing else, and `python -m oracle doctor` (no typer here) says ready,
with the megatron-core, ms-swift and transformers it sees. Runs in that environment only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import needs_swift  # noqa: E402, F401  (skips this module outside .venv-swift)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = ("pyproject.toml", "setup.py", "oracle_capture.pth", "README.md", "cli.py", "oracle", "replays")


def test_the_wheel_installs_offline_adding_only_itself(tmp_path):
    """`pip wheel --no-deps .`, then an offline dry run of installing it WITH its dependencies: it resolves
    from what the env holds and would install oracle-fp64 alone (torch 2.8, transformers 4.57.1 untouched)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        p = os.path.join(REPO, name)
        (shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__")) if os.path.isdir(p)
         else shutil.copy2(p, src / name))  # fmt: skip
    # another version than the one installed, so that pip plans it instead of answering "already installed"
    toml = src / "pyproject.toml"
    toml.write_text(toml.read_text().replace('version = "0.1.0"', 'version = "0.1.0+wheeltest"', 1))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
                        str(tmp_path / "w"), str(src)], capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "w").glob("oracle_fp64-*.whl")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", str(wheel)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    plan = [ln for ln in r.stdout.splitlines() if ln.startswith("Would install")]
    assert plan == ["Would install oracle-fp64-0.1.0+wheeltest"], r.stdout


def test_doctor_in_the_training_env_says_ready_and_what_it_sees(tmp_path):
    """python -m oracle doctor: the hook fires, torch 2.8.0 / megatron-core 0.12.1 / ms-swift 3.12.1 seen, exit 0."""
    env = {**os.environ, "ORACLE_CAPTURE": str(tmp_path / "h20-step"), "PYTHONPATH": REPO}
    r = subprocess.run([sys.executable, "-m", "oracle", "doctor"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "start-up hook: fires" in r.stdout
    for seen in ("torch 2.8.0", "megatron-core 0.12.1", "ms-swift 3.12.1", "transformers 4.57.1", "MindSpeed not found"):
        assert seen in r.stdout, r.stdout
    assert f"{tmp_path / 'h20-step'}: writable" in r.stdout


def test_the_oracle_console_script_runs_doctor_in_the_training_env(tmp_path):
    """`oracle doctor DIR` (the README's Commands table) through the console script the wheel installed: ready, and
    ORACLE_CAPTURE=DIR to set (where typer is missing too: tests/integration/test_doctor_help.py blocks it)."""
    script = os.path.join(os.path.dirname(sys.executable), "oracle")
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("ORACLE_CAPTURE", None)
    r = subprocess.run([script, "doctor", str(tmp_path / "h20-step")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "start-up hook: fires" in r.stdout and "ms-swift 3.12.1" in r.stdout
    assert f"start the training with ORACLE_CAPTURE={tmp_path / 'h20-step'}" in r.stdout
    r = subprocess.run([script, "doctor", "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0 and "Usage: oracle doctor [OPTIONS] [DIR]" in r.stdout, r.stdout + r.stderr


def _tensor_bytes(path: str) -> int:
    import math

    from safetensors import safe_open

    size = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "F64": 8, "BOOL": 1}
    with safe_open(path, "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) * size[f.get_slice(k).get_dtype()] for k in f.keys())


def test_capture_size_is_what_the_hook_writes(tmp_path):
    """ms-swift's own tiny Qwen3-VL step at TP 2 + SP (fp32, padded: its [1, 1, T, T] mask recorded) captured with
    ORACLE_CAPTURE_MODULES=layers,vit: every rank's weights, grads, inputs, layer boundaries and vision blocks' boundaries
    hold, byte for byte, what capture_size.per_rank computes from the HF config and the layout."""
    import json

    import peer
    import tiny

    from oracle.integrations.megatron.capture_size import per_rank

    out = str(tmp_path / "run")
    peer.run(out, tp=2, sp=True, dtype="fp32", model_dir=tiny.write_model_dir(str(tmp_path / "hf")),
             env={"ORACLE_CAPTURE": out + "/capture", "ORACLE_CAPTURE_MODULES": "layers,vit"})  # fmt: skip
    for r in range(2):
        d = os.path.join(out, "capture", "pre", f"rank{r:05d}")
        seq = json.load(open(os.path.join(out, "raw", f"rank{r}", "meta.json")))["seq_len"]
        inputs = _tensor_bytes(os.path.join(d, "inputs.safetensors"))  # its 16 pixel patches: one 64x64 image
        want = per_rank(tiny.hf_config().to_dict(), tp=2, tokens=seq, images=1, image_side=64, param_bytes=4, grad_bytes=4,
                        act_bytes=4, packed=False)  # fmt: skip
        assert _tensor_bytes(os.path.join(d, "weights.safetensors")) == want["weights"], r
        assert _tensor_bytes(os.path.join(d, "grads.safetensors")) == want["grads"], r
        assert inputs == want["inputs"], r
        mods = {f: _tensor_bytes(os.path.join(d, f)) for f in os.listdir(d) if f.startswith("mod.")}
        vit = sum(v for f, v in mods.items() if "visual" in f)
        assert sum(mods.values()) - vit == want["layers_boundaries"], r
        assert vit == want["vit_boundaries"] > 0, (r, sorted(mods))


def test_doctor_help_in_the_training_env_reads_as_the_host_cli_with_examples_that_run(tmp_path):
    """`python -m oracle doctor --help` (argparse, no typer needed): typer's sections and usage, every option
    with its metavar, help and default, the examples and exit codes; the size example runs as printed."""
    import tiny

    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("ORACLE_CAPTURE", None)
    r = subprocess.run([sys.executable, "-m", "oracle", "doctor", "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0 and not r.stderr, r.stderr
    text = " ".join(r.stdout.split())
    assert r.stdout.startswith("Usage: python -m oracle doctor [OPTIONS] [DIR]\n"), r.stdout
    for part in ("Arguments: [DIR] The folder ORACLE_CAPTURE will name (default: $ORACLE_CAPTURE).",
                 "--tp INTEGER Tensor-parallel size of the run. [default: 1]",
                 "--tokens INTEGER Tokens of the captured micro-batch (packed). [default: 4096]",
                 "--hf-config PATH The model's Hugging Face config.json", "--help Show this message and exit.",
                 "Examples:", "Exit codes: 0 ready (what is left to do said below the answer); 12 not ready"):  # fmt: skip
        assert part in text, r.stdout
    assert "usage: python -m oracle doctor [-h]" not in r.stdout and "positional arguments" not in r.stdout
    example = next(ln.strip() for ln in r.stdout.splitlines() if "--hf-config config.json" in ln)
    (tmp_path / "config.json").write_text(json.dumps(tiny.hf_config().to_dict()))
    argv = example.replace("/shared/h20-step", str(tmp_path / "h20-step")).split()[3:]  # after "python -m oracle"
    r = subprocess.run([sys.executable, "-m", "oracle", *argv], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "per rank" in r.stdout and f"{tmp_path / 'h20-step'}: writable" in r.stdout, r.stdout


def test_doctor_usage_mistake_in_the_training_env_says_where_help_is():
    """A bad value: typer's shape (usage, the --help hint, the error), exit 2, no traceback."""
    env = {**os.environ, "PYTHONPATH": REPO}
    r = subprocess.run([sys.executable, "-m", "oracle", "doctor", "--tp", "eight"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "Try 'python -m oracle doctor --help' for help." in r.stderr and "Error: argument --tp" in r.stderr, r.stderr
