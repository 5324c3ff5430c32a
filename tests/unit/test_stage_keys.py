"""A judge stage's key is of its inputs' content: the same bytes written again (the demo's rerun: new mtimes
and inodes) reuse the stage; a byte changed in place, the manifest untouched, redoes it; a file's hash is
read once per state and recorded in the work folder."""

from __future__ import annotations

import os

from oracle.pipeline import stages
from oracle.pipeline.stages import FileHashes, stage_key


def _bundle(path, data: bytes):
    path.mkdir()
    (path / "manifest.json").write_text('{"kind": "capture"}')
    (path / "grads.safetensors").write_bytes(data)
    return path


def test_identical_bytes_written_again_keep_the_key_an_edit_in_place_changes_it(tmp_path):
    """Rewritten byte for byte (a new inode, a later mtime): the same key; one byte changed in place: another."""
    cap = _bundle(tmp_path / "cap", b"\x00" * 4096)
    before = stage_key("truth", {"dtype": "fp64"}, [cap], FileHashes(tmp_path / ".hashes.json"))
    f = cap / "grads.safetensors"
    ino, data = f.stat().st_ino, f.read_bytes()
    f.unlink()
    (cap / "other").write_bytes(b"")  # keeps the old inode from being handed straight back
    f.write_bytes(data)
    os.utime(f, ns=(f.stat().st_mtime_ns + 10**9,) * 2)
    assert f.stat().st_ino != ino
    assert stage_key("truth", {"dtype": "fp64"}, [cap], FileHashes(tmp_path / ".hashes.json")) == before
    with open(f, "r+b") as h:
        h.seek(100)
        h.write(b"\x01")
    assert stage_key("truth", {"dtype": "fp64"}, [cap], FileHashes(tmp_path / ".hashes.json")) != before


def test_a_files_hash_is_read_once_per_state(tmp_path, monkeypatch):
    """A second run with the record reads no tensor file again; a file whose state changed is read again."""
    cap = _bundle(tmp_path / "cap", b"\x02" * 1024)
    os.utime(cap / "grads.safetensors", ns=(10**18, 10**18))  # written long ago: not racy
    record = tmp_path / ".hashes.json"
    first = FileHashes(record)
    stage_key("score", {}, [cap], first)
    first.save()
    reads = []
    real = stages.file_sha256
    monkeypatch.setattr(stages, "file_sha256", lambda p: reads.append(os.path.basename(p)) or real(p))
    stage_key("score", {}, [cap], FileHashes(record))
    assert reads == ["manifest.json"]  # the manifest (small) is always read; the tensor file came from the record
    os.utime(cap / "grads.safetensors", ns=(1, 1))
    stage_key("score", {}, [cap], FileHashes(record))
    assert reads == ["manifest.json", "manifest.json", "grads.safetensors"]
    (cap / "grads.safetensors").write_bytes(b"\x04" * 1024)  # just written: hashed, not recorded (an edit in the
    stage_key("score", {}, [cap], FileHashes(record))  # same mtime tick would otherwise go unseen)
    stage_key("score", {}, [cap], FileHashes(record))
    assert reads[-4:] == ["manifest.json", "grads.safetensors", "manifest.json", "grads.safetensors"]


def test_a_damaged_record_is_started_afresh(tmp_path):
    """A record that is not ours (not JSON, or another shape) is ignored, never a traceback."""
    cap = _bundle(tmp_path / "cap", b"\x03" * 64)
    want = stage_key("x", {}, [cap])
    for junk in ("not json", "[1, 2]", '{"a": 1}'):
        (tmp_path / ".hashes.json").write_text(junk)
        assert stage_key("x", {}, [cap], FileHashes(tmp_path / ".hashes.json")) == want
