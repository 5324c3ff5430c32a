"""No command writes into or over its own inputs, and a merge never takes a step caught between its stages
(issue 41): `oracle merge R1/pre --out R1/pre/rank00000 --overwrite` replaced its input; `oracle replay cap --out
cap --overwrite` would have; ranks recorded at stage 'mid-step' were merged as if finalized."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import invoke
from test_stale_ranks import HF, rank

from oracle.bundle.store import Bundle


@pytest.fixture
def pre(tmp_path) -> Path:
    """One TP1 rank folder (no Megatron needed) and its HF config."""
    rank(tmp_path / "pre", 0, 1, 0)
    (tmp_path / "hf.json").write_text(json.dumps(HF))
    return tmp_path / "pre"


def _merge(pre: Path, out: Path, *extra):
    return invoke("merge", pre, "--out", out, "--recipe", "qwen3", "--hf-config", pre.parent / "hf.json", *extra)


@pytest.mark.parametrize("where", ["over a rank", "inside the folder", "over the folder"])
def test_a_merge_into_or_over_its_own_input_is_refused(pre, where):
    """--out a rank it reads (with --overwrite), a new folder inside the rank folder, the rank folder itself:
    exit 6 naming the input, every rank byte for byte as it was."""
    out = {"over a rank": pre / "rank00000", "inside the folder": pre / "merged", "over the folder": pre}[where]
    before = {p: p.read_bytes() for p in sorted(pre.rglob("*")) if p.is_file()}
    res = _merge(pre, out, "--overwrite")
    assert res.exit_code == 6 and "the input" in res.output and "never writes into or over" in res.output, res.output
    assert {p: p.read_bytes() for p in sorted(pre.rglob("*")) if p.is_file()} == before


def test_a_replay_over_its_own_capture_is_refused(fp32_capture, tmp_path):
    """`oracle replay cap --out cap --overwrite`: exit 6, the capture untouched."""
    before = (Path(fp32_capture) / "manifest.json").read_bytes()
    res = invoke("replay", fp32_capture, "--out", fp32_capture, "--overwrite")
    assert res.exit_code == 6 and "the input" in res.output, res.output
    assert (Path(fp32_capture) / "manifest.json").read_bytes() == before and Bundle(fp32_capture).kind == "capture"


def test_ranks_recorded_mid_step_are_not_merged(pre, tmp_path):
    """A rank whose manifest says stage 'mid-step' (neither before nor after the finalize): exit 4 naming the stage
    and the two it can merge; nothing written."""
    m = json.loads((pre / "rank00000" / "manifest.json").read_text())
    m["megatron"]["stage"] = "mid-step"
    (pre / "rank00000" / "manifest.json").write_text(json.dumps(m))
    res = _merge(pre, tmp_path / "m")
    assert res.exit_code == 4 and "'mid-step'" in res.output and "'pre-finalize' or 'post-finalize'" in res.output, res.output
    assert not (tmp_path / "m").exists()
    m["megatron"]["stage"] = "post-finalize"  # the control: the same rank as recorded merges
    (pre / "rank00000" / "manifest.json").write_text(json.dumps(m))
    assert _merge(pre, tmp_path / "m").exit_code == 0
