"""`oracle judge --truth T --band B`: replay stages made made_elsewhere (over several hosts with torchrun) are
taken once checked to be what the stage would make of this step, and give the judge's own answer; a
bundle that is not (another step, another precision, another band size, another emulation) is refused
with exit 2 before any stage, and --out is left as it was."""

from __future__ import annotations

import json

import pytest
from helpers import run_oracle

from oracle.bundle.store import Bundle, BundleWriter
from oracle.precision import EMULATION
from oracle.replay.run import replay

PAIR_ARGS = ["--name", "F", "--name", "A", "--ensemble", "2", "--threads", "2"]


@pytest.fixture(scope="module")
def made_elsewhere(fp32_capture, tmp_path_factory):
    """A streamed float64 truth and an fp32 band of 2 of the fp32 capture, as `oracle replay` writes them."""
    root = tmp_path_factory.mktemp("made_elsewhere")
    truth = replay(fp32_capture, root / "truth", max_memory=4 << 30, verify="off")
    band = replay(fp32_capture, root / "band-fp32", dtype="fp32", ensemble=2)
    return root, truth, band


def _copy(src, dst, manifest=None, weights=None):
    """``src`` rewritten at ``dst``: its manifest updated with ``manifest``, its weights by ``weights(tensors)``."""
    b = Bundle(src)
    with BundleWriter(dst, b.kind) as w:
        w.manifest.update({k: v for k, v in b.manifest.items() if k not in ("tensors", "schema_version", "kind")})
        w.manifest.update(manifest or {})
        for group in b.groups():
            t = b.load_group(group)
            w.add(group, weights(t) if (weights and group == "weights") else t)
    return dst


def test_a_truth_and_a_band_made_elsewhere_are_taken_and_give_the_judges_own_answer(fp32_capture, amp_capture, made_elsewhere, tmp_path):
    _, truth, band = made_elsewhere
    own = run_oracle(["judge", fp32_capture, amp_capture, "--out", tmp_path / "own", *PAIR_ARGS])
    assert own.returncode == 0, own.stderr[-3000:]
    took = run_oracle(["judge", fp32_capture, amp_capture, "--out", tmp_path / "took", "--truth", truth, "--band", band, *PAIR_ARGS])
    assert took.returncode == 0, took.stderr[-3000:]
    assert f"truth: given (--truth {truth}, checked: this step's)" in took.stderr
    assert f"band-fp32: given (--band {band}, checked: this step's)" in took.stderr
    assert "band-amp-bf16: emulate 2 honest amp-bf16 runs" in took.stderr  # the band not given is replayed here
    assert not (tmp_path / "took" / "truth").exists() and not (tmp_path / "took" / "band-fp32").exists()
    assert took.stdout.splitlines()[0] == own.stdout.splitlines()[0]
    doc = json.loads((tmp_path / "took" / "report" / "judge.json").read_text())
    assert str(truth) in json.dumps(doc)  # the report names the truth it scored against
    again = run_oracle(["judge", fp32_capture, amp_capture, "--out", tmp_path / "took", "--truth", truth, "--band", band, *PAIR_ARGS])
    assert again.returncode == 0 and "score: reused (inputs unchanged)" in again.stderr, again.stderr[-3000:]
    dry = run_oracle(["judge", fp32_capture, amp_capture, "--dry-run", "--truth", truth, *PAIR_ARGS])
    assert dry.returncode == 0, dry.stderr
    row = next(ln.split() for ln in dry.stdout.splitlines() if ln.strip().startswith("truth "))
    assert row[1:] == ["given", str(truth)]


def test_a_bundle_that_is_not_the_stages_own_is_refused_before_any_stage(fp32_capture, amp_capture, made_elsewhere, tmp_path):
    root, truth, band = made_elsewhere
    other_step = _copy(truth, tmp_path / "other-step", weights=lambda t: {n: v * 2 if i == 0 else v for i, (n, v) in enumerate(t.items())})
    b3 = replay(fp32_capture, tmp_path / "b3", dtype="fp32", ensemble=3)
    old_emulation = _copy(band, tmp_path / "old", manifest={"emulation": {**Bundle(band).get("emulation"), "version": "older"}})
    cases = [
        (["--truth", other_step], "replayed from another step (its inputs or weights differ"),
        (["--truth", band], "it is an emulation bundle in fp32, where this stage makes an oracle bundle in fp64"),
        (["--band", truth], "a band in fp64, where this judge's runs need fp32, amp-bf16"),
        (["--band", b3], "3 member(s), where this judge's band has 2 (--ensemble)"),
        (["--band", old_emulation], f"made by emulation 'older', not this oracle's {EMULATION!r}"),
        (["--band", band, "--band", band], "a second band in fp32"),
    ]
    for given, says in cases:
        r = run_oracle(["judge", fp32_capture, amp_capture, "--out", tmp_path / "j", *given, *PAIR_ARGS])
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (given, r.stderr[-2000:])
        assert not (tmp_path / "j").exists()
    missing = run_oracle(["judge", fp32_capture, amp_capture, "--out", tmp_path / "j", "--truth", tmp_path / "none", *PAIR_ARGS])
    assert missing.returncode == 3 and "no bundle there" in missing.stderr, missing.stderr
    logs_only = run_oracle(["judge", "--log-a", root / "a.log", "--log-b", root / "b.log", "--truth", truth])
    assert logs_only.returncode == 2 and "give the two runs' capture folders with them" in logs_only.stderr, logs_only.stderr
