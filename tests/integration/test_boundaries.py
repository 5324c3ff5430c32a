"""Packed boundaries are validated where a bundle's inputs are read, and the replay uses the recorded
ones (issue 21, item 3): cu_seqlens that do not start at 0, do not increase, do not end at the
sequence length, or disagree with the restarting positions are exit 4 naming them; the Qwen3-VL
replay's attention follows cu_seqlens, not a guess from the positions."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from cli import app
from oracle.bundle.store import Bundle, BundleWriter
from oracle.capture.steps import capture_recipe_step
from oracle.replay.run import replay


@pytest.fixture(scope="module")
def packed_vl(source, sample, tmp_path_factory):
    """The tiny Qwen3-VL default sample packed twice into one sequence (text row restarting), and its oracle."""
    root = tmp_path_factory.mktemp("packed-vl")
    cap = capture_recipe_step(source, [sample, sample], str(root / "cap"))
    return cap, str(replay(cap, root / "oracle", verify="off"))


def with_inputs(src: str, dst, fn) -> str:
    """Copy bundle ``src`` to ``dst`` with its inputs replaced by ``fn(inputs)``."""
    b = Bundle(src)
    with BundleWriter(dst, b.kind) as w:
        w.manifest.update({k: v for k, v in b.manifest.items() if k not in ("tensors", "schema_version", "kind")})
        for group in b.groups():
            w.add(group, fn(b.load_group(group)) if group == "inputs" else b.load_group(group))
    return str(dst)


def _set(key, value):
    return lambda inputs: {**inputs, key: value}


def _cu(inputs):
    return inputs["cu_seqlens"]


CASES = {
    "short": (lambda i: _set("cu_seqlens", torch.tensor([0, 144, 200]))(i), "ends at 200, not at the sequence length 288"),
    "decreasing": (lambda i: _set("cu_seqlens", torch.tensor([0, 200, 144, 288]))(i), "does not increase at index 2"),
    "offset": (lambda i: _set("cu_seqlens", torch.tensor([5, 144, 288]))(i), "starts at 5, not 0"),
    "float": (lambda i: _set("cu_seqlens", torch.tensor([0.0, 144.0, 288.0]))(i), "1-D integer tensor"),
    "moved": (lambda i: _set("cu_seqlens", torch.tensor([0, 100, 288]))(i), "disagree with the samples the text positions mark"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_packed_boundaries_are_exit_4_naming_them(packed_vl, tmp_path, case):
    """Each bad cu_seqlens is refused before any work, exit 4, in memory, streamed and --dry-run."""
    cap, _ = packed_vl
    assert Bundle(cap).load("inputs", "cu_seqlens").tolist() == [0, 144, 288]
    fn, message = CASES[case]
    bad = with_inputs(cap, tmp_path / "bad", fn)
    for extra in ([], ["--max-memory", "4G"], ["--max-memory", "4G", "--dry-run"]):
        res = CliRunner().invoke(app, ["replay", bad, "--out", str(tmp_path / "o"), "--no-verify", *extra])
        assert res.exit_code == 4, res.output
        assert "cu_seqlens" in res.output and message in res.output and "Traceback" not in res.output, res.output
        assert not (tmp_path / "o").exists() and not (tmp_path / ".o.partial").exists()


def test_positions_restarting_elsewhere_than_cu_seqlens_are_refused(packed_vl, tmp_path):
    """The text row restarting at 100 while cu_seqlens says 144: exit 4 naming position_ids."""
    cap, _ = packed_vl

    def restart_at_100(inputs):
        pos = inputs["position_ids"].clone()
        pos[0, 0, 100:] = torch.arange(288 - 100)
        return {**inputs, "position_ids": pos}

    bad = with_inputs(cap, tmp_path / "bad", restart_at_100)
    res = CliRunner().invoke(app, ["replay", bad, "--out", str(tmp_path / "o"), "--no-verify"])
    assert res.exit_code == 4 and "position_ids" in res.output, res.output


def test_the_qwen3_vl_replay_attends_within_the_recorded_cu_seqlens(packed_vl, tmp_path):
    """A text row that does not restart (plain 0..T-1) with cu_seqlens recorded: the replay still
    attends per sample (the recorded boundaries), so its oracle is bitwise the restarting one's."""
    cap, oracle = packed_vl

    def plain_text_row(inputs):
        pos = inputs["position_ids"].clone()
        pos[0, 0] = torch.arange(pos.shape[-1])
        return {**inputs, "position_ids": pos}

    plain = with_inputs(cap, tmp_path / "plain", plain_text_row)
    got = Bundle(replay(plain, tmp_path / "o", verify="off"))
    ref = Bundle(oracle)
    assert got.get("loss")["value"] == ref.get("loss")["value"]
    changed = [n for n in ref.names("grads") if not torch.equal(got.load("grads", n), ref.load("grads", n))]
    assert changed == []
