"""`oracle judge --truth T --band B`: replay stages made made_elsewhere (over several hosts with torchrun) are
taken once checked to be what the stage would make of this step, and give the judge's own answer; a
bundle that is not (another precision, another band size, another emulation: exit 2; another step: exit 5) is
refused before any stage, and --out is left as it was; a damaged one is named at the score, with its fix."""

from __future__ import annotations

import json
import shutil

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
    bf16 = replay(fp32_capture, tmp_path / "bf16", dtype="bf16", ensemble=2)
    cases = [
        (["--truth", other_step], 5, "replayed from another step (its inputs or weights differ"),  # as any other step
        (["--truth", band], 2, "it is an emulation bundle in fp32, where this stage makes an oracle bundle in fp64"),
        (["--band", truth], 2, "it is an oracle bundle, not a noise band"),
        (["--band", bf16], 2, "a band in bf16, where this judge's runs need fp32, amp-bf16"),
        (["--band", b3], 2, "3 member(s), where this judge's band has 2 (--ensemble)"),
        (["--band", old_emulation], 2, f"made by emulation 'older', not this oracle's {EMULATION!r}"),
        (["--band", band, "--band", band], 2, "a second band in fp32"),
    ]
    for given, code, says in cases:
        r = run_oracle(["judge", fp32_capture, amp_capture, "--out", tmp_path / "j", *given, *PAIR_ARGS])
        assert r.returncode == code and says in r.stderr and "Traceback" not in r.stderr, (given, r.stderr[-2000:])
        assert not (tmp_path / "j").exists()
    dry = run_oracle(["judge", fp32_capture, amp_capture, "--dry-run", "--truth", other_step, *PAIR_ARGS])
    assert dry.returncode == 5 and "replayed from another step" in dry.stderr, dry.stderr
    missing = run_oracle(["judge", fp32_capture, amp_capture, "--out", tmp_path / "j", "--truth", tmp_path / "none", *PAIR_ARGS])
    assert missing.returncode == 3 and "no bundle there" in missing.stderr, missing.stderr
    # a damaged truth (a byte of its gradients flipped) is found where its tensors are read, the score: exit 4, the fix named
    damaged = tmp_path / "damaged"
    shutil.copytree(truth, damaged)
    f = next(p for p in sorted(damaged.glob("*.safetensors")) if "grads" in p.name or "shard" in p.name)
    data = bytearray(f.read_bytes())
    data[-8] ^= 0xFF
    f.write_bytes(bytes(data))
    r = run_oracle(["judge", fp32_capture, amp_capture, "--out", tmp_path / "jd", "--truth", damaged, *PAIR_ARGS])
    assert r.returncode == 4 and "does not match its sha256" in r.stderr and "replay it again" in r.stderr, r.stderr[-2000:]
    logs_only = run_oracle(["judge", "--log-a", root / "a.log", "--log-b", root / "b.log", "--truth", truth])
    assert logs_only.returncode == 2 and "give the two runs' capture folders with them" in logs_only.stderr, logs_only.stderr
