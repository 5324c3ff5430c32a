"""The capture side installs where the step runs: its runtime dependencies are the light ones a
training environment already holds, and it imports with none of the CPU host's packages present."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
HOST_ONLY = ("transformers", "typer", "matplotlib", "PIL")

_BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError("blocked: " + name)
        return None
sys.meta_path.insert(0, Block())
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK.format(blocked=set(HOST_ONLY)) + code], capture_output=True, text=True, cwd=ROOT)


def test_runtime_dependencies_are_the_capture_sides_only():
    """transformers 5, typer, pillow and matplotlib come with the `host` extra, never with the plain install."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in meta["dependencies"]}
    assert names == {"torch", "safetensors", "numpy", "pydantic", "tqdm"}, names
    host = " ".join(meta["optional-dependencies"]["host"])
    for dep in ("transformers", "typer", "matplotlib", "pillow"):
        assert dep in host
    assert any("[host]" in d for d in meta["optional-dependencies"]["test"])


def test_capture_side_imports_without_the_host_packages():
    """oracle.Capture and the Megatron hook import and write a bundle with transformers, typer, matplotlib and PIL unimportable."""
    r = _run(
        "import tempfile, torch, oracle\n"
        "from oracle.integrations.megatron.hook import capture_rank\n"
        "m = torch.nn.Linear(3, 2); m(torch.ones(1, 3)).sum().backward()\n"
        "d = tempfile.mkdtemp()\n"
        "p = capture_rank(m, d, stage='pre-finalize', batch={'tokens': torch.zeros(1, 4, dtype=torch.long)}, loss=1.0, num_tokens=4,\n"
        "                 coords={'rank': 0, 'tp_rank': 0, 'tp_size': 1, 'pp_rank': 0, 'pp_size': 1, 'dp_rank': 0, 'dp_size': 1, 'cp_size': 1})\n"
        "print(oracle.Capture.__name__, sorted(x.name for x in p.iterdir())[:1])\n"
    )
    assert r.returncode == 0, r.stderr
    assert "Capture" in r.stdout


def test_cli_without_the_host_packages_says_what_to_install():
    """The console script in a capture-only environment exits 2 naming the extra, no traceback."""
    r = _run("import runpy, sys; sys.argv = ['oracle', '--help']; runpy.run_path('cli.py', run_name='__main__')")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "oracle-fp64[host]" in r.stderr and "Traceback" not in r.stderr


# -- the cluster route: a wheel built from the checkout, installed offline; the editable install; doctor --

SOURCES = ("pyproject.toml", "setup.py", "oracle_capture.pth", "README.md", "cli.py", "oracle", "replays")


def _checkout_copy(tmp: Path) -> Path:
    """The files a build reads, copied: building writes build/ and *.egg-info beside them, never into the repo."""
    import shutil

    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(p, src / name)
    return src


def _venv(where: Path) -> Path:
    """A throwaway venv whose path also holds this test environment's site-packages as a plain path entry
    (torch, pip, setuptools importable; that directory's own .pth files, e.g. an editable oracle, are not run)."""
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    py = where / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    Path(site, "_outer_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py


def _clean_env(**extra: str) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ORACLE_CAPTURE", "RANK")}
    return {**env, **extra}


def _doctor(py: Path, cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(py), "-m", "oracle", "doctor", *args], capture_output=True, text=True, cwd=cwd, env=_clean_env(**env))


def test_wheel_installed_offline_activates_the_hook_and_doctor_says_ready(tmp_path):
    """`pip wheel --no-deps .` then `pip install --no-index --no-deps` into a venv: only oracle-fp64 is added,
    the .pth lands in site-packages, ORACLE_CAPTURE loads the hook at start-up and `python -m oracle doctor` exits 0;
    with the .pth removed (what an install without it leaves) the doctor exits 12 naming the fix."""
    src = _checkout_copy(tmp_path)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
                        str(tmp_path / "wheels"), str(src)], capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "wheels").glob("oracle_fp64-*.whl")
    import zipfile

    top = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}  # namespaced: no top-level cli or replays
    assert top == {"oracle", "oracle_replays", "oracle_capture.pth", "oracle_fp64-0.1.0.dist-info"}, top
    py = _venv(tmp_path / "venv")
    before = set(Path(tmp_path / "venv").rglob("*.dist-info"))
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-index", "--no-deps", str(wheel)], capture_output=True,
                       text=True, cwd=tmp_path, env=_clean_env())  # fmt: skip
    assert r.returncode == 0, r.stderr
    added = {p.name for p in set(Path(tmp_path / "venv").rglob("*.dist-info")) - before}
    assert added == {"oracle_fp64-0.1.0.dist-info"}, added
    (pth,) = Path(tmp_path / "venv").rglob("oracle_capture.pth")
    probe = ("import sys, oracle; m = sys.modules.get('oracle.integrations.megatron.autocapture'); "
             "print(m is not None and m._state['installed'], oracle.__file__)")  # fmt: skip
    r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                       env=_clean_env(ORACLE_CAPTURE=str(tmp_path / "cap")))  # fmt: skip
    assert r.stdout.split()[0] == "True" and str(tmp_path / "venv") in r.stdout, (r.stdout, r.stderr)
    cap = tmp_path / "shared" / "h20-step"
    cap.parent.mkdir()
    r = _doctor(py, tmp_path, ORACLE_CAPTURE=str(cap))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"start-up hook: fires ({pth})" in r.stdout
    assert "torch " in r.stdout and "megatron-core" in r.stdout and "ms-swift" in r.stdout and "MindSpeed" in r.stdout
    assert f"capture folder: {cap}: writable (not there yet: the first rank makes it)" in r.stdout and f"{cap}/pre/rankNNNNN" in r.stdout
    assert "ready, with 2 thing(s) to do or check:" in r.stdout and f"{cap} does not exist yet: the first rank makes it" in r.stdout
    assert os.listdir(tmp_path / "shared") == []  # the check leaves no folder behind
    pth.unlink()
    r = _doctor(py, tmp_path, str(cap))
    assert r.returncode == 12, r.stdout + r.stderr
    assert "start-up hook will NOT fire: no oracle_capture.pth in this interpreter's site-packages" in r.stdout
    assert "install-pth" in r.stdout and "Traceback" not in r.stderr


def test_editable_install_carries_the_start_up_hook(tmp_path):
    """`pip install -e .` installs oracle_capture.pth too: the hook fires from the checkout and the doctor exits 0."""
    src = _checkout_copy(tmp_path)
    py = _venv(tmp_path / "venv")
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation", "-e", str(src)],
                       capture_output=True, text=True, cwd=tmp_path, env=_clean_env())  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert list(Path(tmp_path / "venv").rglob("oracle_capture.pth"))
    r = _doctor(py, tmp_path, str(tmp_path / "cap"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "start-up hook: fires" in r.stdout


def test_doctor_names_an_unwritable_folder_and_a_bad_step(tmp_path):
    """A capture folder that cannot be created (its parent is a file) and ORACLE_CAPTURE_STEP=first: exit 12, both said."""
    import os

    (tmp_path / "file").write_text("")
    r = subprocess.run([sys.executable, "-m", "oracle", "doctor", str(tmp_path / "file" / "cap")], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "ORACLE_CAPTURE_STEP": "first"})  # fmt: skip
    assert r.returncode == 12, r.stdout + r.stderr
    assert f"{tmp_path / 'file' / 'cap'}: cannot be written (Not a directory)" in r.stdout
    assert "ORACLE_CAPTURE_STEP='first' is not a non-negative integer" in r.stdout and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,code,message", [
    (["--tp", "0"], 2, "--tp 0: expected a whole number >= 1"),
    (["--tp", "-2"], 2, "--tp -2: expected a whole number >= 1"),
    (["--pp", "0"], 2, "--pp 0: expected a whole number >= 1"),
    (["--tokens", "0"], 2, "--tokens 0"),
    (["--tp", "8"], 2, "--tp size the capture: give --hf-config"),
])
def test_doctor_refuses_size_options_it_cannot_use(tmp_path, args, code, message):
    """python -m oracle doctor (no typer there): a TP of 0 or below, sizes without --hf-config are usage
    errors (exit 2, never a ZeroDivisionError, never negative sizes); a missing config is exit 3."""
    cfg = [] if message.endswith("--hf-config") else ["--hf-config", str(ROOT / "tests" / "data" / "h20_rank0_grad_norms.log")]
    r = subprocess.run([sys.executable, "-m", "oracle", "doctor", str(tmp_path / "cap"), *cfg, *args], capture_output=True,
                       text=True, cwd=ROOT)  # fmt: skip
    assert r.returncode == code and message in r.stderr and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    r = subprocess.run([sys.executable, "-m", "oracle", "doctor", str(tmp_path / "cap"), "--hf-config", str(tmp_path / "none.json")],
                       capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert r.returncode == 3 and "none.json" in r.stderr and "Traceback" not in r.stderr, (r.returncode, r.stderr)


def test_capture_size_counts_the_models_own_parameters(tmp_path):
    """capture_size's parameter count is that of transformers' Qwen3-VL built from the config (tiny flavor, and 8B
    text/vision shapes with 2 layers), and `oracle doctor --hf-config` prints the per-rank size with and without layers."""
    import json

    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from typer.testing import CliRunner

    from cli import app
    from oracle.integrations.megatron.capture_size import per_rank
    from oracle_replays.qwen3_vl.flavors import TINY

    big = {"model_type": "qwen3_vl", "tie_word_embeddings": False,
           "text_config": {"head_dim": 128, "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
                           "num_hidden_layers": 2, "num_key_value_heads": 8, "vocab_size": 151936,
                           "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"}},
           "vision_config": {"deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_size": 1152, "in_channels": 3,
                             "intermediate_size": 4304, "num_heads": 16, "num_position_embeddings": 2304,
                             "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}}  # fmt: skip
    for cfg in (dict(TINY), big):
        with torch.device("meta"):
            model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**cfg))
        assert per_rank(cfg, tp=1, tokens=16)["params"] == sum(p.numel() for p in model.parameters())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**big, "text_config": {**big["text_config"], "num_hidden_layers": 36}}))
    res = CliRunner().invoke(app, ["doctor", "--hf-config", str(path), "--tp", "8", "--tokens", "65536"])
    assert res.exit_code in (0, 12), res.output
    assert "capture size per rank (TP 8, PP 1, SP, 65536 tokens packed" in res.stdout
    assert "= 8.95 GiB per bundle; pre + post: 17.91 GiB" in res.stdout
    assert "with ORACLE_CAPTURE_MODULES=layers: + 10.12 GiB per bundle (36 decoder layers x 4 x 8192 rows); pre + post: 38.16 GiB" in res.stdout
    res = CliRunner().invoke(app, ["doctor", "--hf-config", str(tmp_path / "missing.json")])
    assert res.exit_code == 3 and "missing.json" in res.stderr and "Traceback" not in res.output  # an input path missing: exit 3
