"""The capture side installs where the step runs: its runtime dependencies are the light ones a
training environment already holds, and it imports with none of the CPU host's packages present."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
