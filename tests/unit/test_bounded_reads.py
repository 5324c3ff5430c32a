"""What the tool reads back of its own (the signing key, a work folder's journal and header) is read
with a size limit, without following a symlink: anything else than what it wrote is a clear error
(issue 41, item 3), never a read without end."""

from __future__ import annotations

import json
import os

import pytest

from oracle.bundle import signing
from oracle.errors import BundleError, OutputExists
from oracle.replay.streaming import journal, workdir


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh key folder of this test, the key not yet read in this process."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(signing, "_KEY", None)
    (tmp_path / "cache" / "oracle").mkdir(parents=True)
    return tmp_path / "cache" / "oracle"


def test_a_new_key_is_32_bytes_0600_and_read_back(cache):
    """No key yet: one is made whole (32 bytes, 0600), and the same bytes are read by the next process."""
    k = signing.key()
    assert len(k) == 32 and k != signing.UNKEYED
    assert (cache / "work.key").read_bytes() == k and (cache / "work.key").stat().st_mode & 0o777 == 0o600
    assert [p.name for p in cache.iterdir()] == ["work.key"]  # no temporary left


@pytest.mark.parametrize("what", ["dev-zero", "too-long", "empty", "folder"])
def test_a_key_that_is_not_ours_is_refused_at_once(cache, what):
    """work.key a symlink to /dev/zero (was: read until killed at 22 GB), 4 KiB, empty, a folder: exit 4 naming the
    key and the fix; at most 33 bytes read."""
    key = cache / "work.key"
    if what == "dev-zero":
        os.symlink("/dev/zero", key)
    elif what == "too-long":
        key.write_bytes(b"k" * 4096)
    elif what == "empty":
        key.write_bytes(b"")
    else:
        key.mkdir()
    with pytest.raises(BundleError, match=r"signing key .*work\.key.*delete it") as e:
        signing.key()
    assert e.value.exit_code == 4


def test_a_write_with_a_key_on_dev_zero_exits_4_from_the_cli(cache, tmp_path, oracle_bundle, fp32_capture):
    """The same through a command that signs a temporary (`oracle score --json`): exit 4, one message, no traceback."""
    from helpers import invoke

    os.symlink("/dev/zero", cache / "work.key")
    res = invoke("score", oracle_bundle, fp32_capture, "--json", tmp_path / "s.json")
    assert res.exit_code == 4 and "signing key" in res.output, res.output


@pytest.mark.parametrize("what", ["dev-zero", "over-limit"])
def test_a_journal_that_is_not_ours_is_refused(tmp_path, monkeypatch, what):
    """A member's journal.jsonl a symlink to /dev/zero or over the limit: exit 6 naming it, nothing deleted."""
    member = tmp_path / "work" / "grads"
    member.mkdir(parents=True)
    if what == "dev-zero":
        os.symlink("/dev/zero", member / journal.JOURNAL)
    else:
        monkeypatch.setattr(workdir, "JOURNAL_MAX", 64)
        (member / journal.JOURNAL).write_text(json.dumps({"kind": "unit"}) * 10)
    for read in (lambda: workdir.valid_records(tmp_path / "work", member), lambda: journal.read_journal(member)):
        with pytest.raises(OutputExists, match="journal.jsonl .*delete it") as e:
            read()
        assert e.value.exit_code == 6
    assert os.path.lexists(member / journal.JOURNAL)


def test_a_header_on_dev_zero_is_not_ours(tmp_path):
    """header.json a symlink to /dev/zero reads as no header (the folder is then not ours: named, exit 6)."""
    (tmp_path / "h.json").symlink_to("/dev/zero")
    assert workdir._read_json(tmp_path / "h.json") is None
