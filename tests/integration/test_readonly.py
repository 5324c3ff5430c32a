"""The tool's own writes in a place it may not write (issue 30): exit 9 with a message, never a traceback.

Tests run as root, for whom chmod does not stop writes, so a read-only folder is simulated: os.mkdir
raises EACCES for every path inside it (what a mode-555 folder gives another user), and a path under
a regular file gives the real ENOTDIR."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
from helpers import stream_budget
from typer.testing import CliRunner

from cli import app

runner = CliRunner()


@pytest.fixture
def ro(tmp_path, monkeypatch) -> Path:
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.mkdir

    def mkdir(path, *a, **k):
        if str(os.path.abspath(path)).startswith(str(ro) + os.sep):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", mkdir)
    return ro


def _cases(cap: str, out: Path) -> dict[str, list[str]]:
    log = out.parent.parent / "norms.log"
    log.write_text("[DEBUG_GRAD_NORM][X] a.weight norm=1.5\n")
    return {
        "replay": ["replay", cap, "--out", str(out / "o")],
        "streamed replay": ["replay", cap, "--out", str(out / "o"), "--max-memory", stream_budget(cap)],
        "judge": ["judge", cap, str(shutil.copytree(cap, out.parent.parent / "twin", dirs_exist_ok=True)),  # A's step, another folder
                  "--name", "A", "--name", "B", "--out", str(out / "j")],
        "import-log": ["import-log", str(log), "--out", str(out / "b")],
    }


@pytest.mark.parametrize("case", ["replay", "streamed replay", "judge", "import-log"])
def test_writes_into_a_read_only_folder_exit_9_with_a_message(fp32_capture, ro, case):
    r = runner.invoke(app, _cases(fp32_capture, ro)[case])
    assert r.exit_code == 9, r.output
    assert "Permission denied" in r.output and "Traceback" not in r.output and "internal error" not in r.output
    assert list(ro.iterdir()) == []


@pytest.mark.parametrize("case", ["replay", "streamed replay", "judge", "import-log"])
def test_writes_under_a_regular_file_exit_9_with_a_message(fp32_capture, tmp_path, case):
    f = tmp_path / "d" / "afile"
    f.parent.mkdir()
    f.write_text("keep")
    r = runner.invoke(app, _cases(fp32_capture, f)[case])
    assert r.exit_code == 9, r.output
    assert str(f) in r.output and "Traceback" not in r.output and f.read_text() == "keep"
