"""Every file the tool writes is written whole or not at all, and what a killed writer left is cleared by
the next write (issue 41, items 2 and 5): reports and JSON included, a full disk leaves the old file whole
and no temporary; a symlink at the name is replaced, never written through; a user's file named like a
temporary is never touched."""

from __future__ import annotations

import errno
import json
import os

import pytest
from helpers import invoke

from oracle.bundle import atomic, atomic_file
from oracle.bundle.atomic_file import write_json
from oracle.errors import OutputError


def _disk_full(monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic_file.os, "fsync", full)


def test_score_json_on_a_full_disk_leaves_the_old_file_whole(oracle_bundle, fp32_capture, tmp_path, monkeypatch):
    """`oracle score truth cap --json s.json` on a full disk (was: the old s.json cut to 4 KiB): exit 9, the previous
    s.json byte for byte, no temporary beside it."""
    s = tmp_path / "s.json"
    old = json.dumps({"previous": list(range(3000))})
    s.write_text(old)
    _disk_full(monkeypatch)
    res = invoke("score", oracle_bundle, fp32_capture, "--json", s)
    assert res.exit_code == 9 and "No space left" in res.output, res.output
    assert s.read_text() == old and os.listdir(tmp_path) == ["s.json"]


def test_a_report_on_a_full_disk_keeps_every_old_file(oracle_bundle, fp32_capture, tmp_path, monkeypatch):
    """`--report DIR` (score.json, params.csv, errors.png, index.html) on a full disk: exit 9, the old files whole."""
    assert invoke("score", oracle_bundle, fp32_capture, "--report", tmp_path / "rep").exit_code == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "rep").iterdir()}
    assert set(before) == {"score.json", "params.csv", "errors.png", "index.html"}
    _disk_full(monkeypatch)
    res = invoke("score", oracle_bundle, fp32_capture, "--report", tmp_path / "rep")
    assert res.exit_code == 9, res.output
    assert {p.name: p.read_bytes() for p in (tmp_path / "rep").iterdir()} == before


def test_a_symlink_at_the_name_is_replaced_not_written_through(tmp_path):
    """s.json a symlink to a file elsewhere: the write replaces the link; the file it pointed at is untouched."""
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("keep")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "s.json").symlink_to(elsewhere)
    write_json({"a": 1}, tmp_path / "d" / "s.json")
    assert elsewhere.read_text() == "keep" and not (tmp_path / "d" / "s.json").is_symlink()
    assert json.loads((tmp_path / "d" / "s.json").read_text()) == {"a": 1}


def _dead_writers_temp(final, pid: int = 2**22 + 7) -> str:
    """The name a writer of ``final`` with (dead) pid ``pid`` gave its temporary, signed as it would be."""
    host, token = atomic._host(), "0123abcd"
    return f".{final.name}.tmp-{host}-{pid}-{token}-{atomic._sign(final.name, 'tmp', host, str(pid), token)}"


def test_a_killed_writers_temporary_is_removed_by_the_next_write_into_the_folder(tmp_path):
    """A signed `.s.json.tmp-...` of a dead pid (a writer killed mid-write) goes at the next write of any name into
    that folder; the user's files named like one (unsigned, or of a live pid) stay."""
    dead = tmp_path / _dead_writers_temp(tmp_path / "s.json")
    live = tmp_path / _dead_writers_temp(tmp_path / "s.json", pid=os.getppid())
    users = tmp_path / ".s.json.tmp-123"
    for p in (dead, live, users):
        p.write_text("half")
    write_json({"a": 1}, tmp_path / "other.json")
    assert not dead.exists() and live.exists() and users.exists()


def test_the_judge_marker_on_a_full_disk_leaves_no_temporary(tmp_path, monkeypatch):
    """The judge's work folder on a full disk (was: `.oracle-judge.tmp-PID` left): exit 9, the folder holds nothing."""
    from oracle.pipeline import workfolder

    _disk_full(monkeypatch)
    with pytest.raises(OutputError, match="No space left"):
        workfolder.open_out(tmp_path / "j")
    assert os.listdir(tmp_path / "j") == []
