"""The cluster install in the pinned training environment: the wheel built from this checkout
installs offline changing nothing else, and `python -m oracle doctor` (no typer here) says ready,
with the megatron-core, ms-swift and transformers it sees. Runs in that environment only."""

from __future__ import annotations

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
