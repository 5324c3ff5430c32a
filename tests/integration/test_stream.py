"""The memory-bounded streaming replay: equal to the in-memory replay, spills, resumes, packs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import HANG_S, packed_text_capture
from typer.testing import CliRunner

from cli import app
from oracle.bundle.store import Bundle
from oracle.capture.steps import capture_recipe_step
from oracle.errors import MismatchError, UsageError
from oracle.replay.run import replay
from oracle.replay.streaming.engine import parse_size
from oracle.score.scorer import score

ROOT = Path(__file__).resolve().parents[2]


def _grads(path) -> dict[str, torch.Tensor]:
    return Bundle(path).load_group("grads")


def _assert_bitwise(a, b):
    ga, gb = _grads(a), _grads(b)
    assert set(ga) == set(gb)
    different = [n for n in ga if not torch.equal(ga[n], gb[n])]
    assert not different, f"{len(different)} gradients differ, e.g. {different[:3]}"
    assert Bundle(a).get("loss")["value"] == Bundle(b).get("loss")["value"]


def test_streamed_oracle_equals_the_in_memory_one_bitwise_and_spills(fp32_capture, oracle_bundle, tmp_path):
    """Every unit's inputs spilled to disk (activation budget 0): still bitwise the in-memory oracle."""
    out = replay(fp32_capture, tmp_path / "s", max_memory=8 << 30, activation_budget=0)
    _assert_bitwise(oracle_bundle, out)
    st = Bundle(out).get("streaming")
    assert st["activations_spilled"] > 0 and st["activations_in_memory_peak"] > 0
    assert Bundle(out).get("backward_order")[0] == "lm_head.weight"
    assert not (tmp_path / ".s.partial").exists()  # the work directory is gone once the bundle is published
    res = score(out, [fp32_capture])
    assert res["captures"][0]["verdict"]["class"] == "within_noise"


def test_streamed_emulation_ensemble_is_an_honest_band(fp32_capture, oracle_bundle, tmp_path):
    """amp-bf16 ensemble through the streaming engine: members differ, and their spread against the
    truth is of bf16 size (1e-4 .. 1e-1 relative), like the in-memory emulation's."""
    out = replay(fp32_capture, tmp_path / "b", dtype="amp-bf16", ensemble=2, max_memory=8 << 30)
    b, o = Bundle(out), Bundle(oracle_bundle)
    assert b.member_groups() == ["grads", "grads.1"]
    n = "model.language_model.layers.1.mlp.down_proj.weight"
    t, g0, g1 = o.load("grads", n), b.load("grads", n), b.load("grads.1", n)
    assert not torch.equal(g0, g1)
    for g in (g0, g1):
        rel = float((g.double() - t).norm() / t.norm())
        assert 1e-4 < rel < 1e-1, rel


def test_a_budget_below_one_unit_is_refused_with_the_size_that_would_do(fp32_capture, tmp_path):
    with pytest.raises(UsageError, match=r"raise it to at least \d+(\.\d+)?G"):
        replay(fp32_capture, tmp_path / "s", max_memory=1 << 20)


@pytest.mark.parametrize(
    "spec,value", [("16G", 16 << 30), ("512M", 512 << 20), ("1.5T", int(1.5 * (1 << 40))), ("2GiB", 2 << 30)]
)
def test_sizes_parse(spec, value):
    assert parse_size(spec) == value


@pytest.mark.parametrize("spec", ["lots", "-1G", "0"])
def test_bad_sizes_are_usage_errors(spec):
    with pytest.raises(UsageError, match="--max-memory"):
        parse_size(spec)


def test_dry_run_prints_flops_time_memory_and_disk(fp32_capture, tmp_path):
    r = CliRunner().invoke(app, ["replay", fp32_capture, "--out", str(tmp_path / "x"), "--dry-run", "--max-memory", "2G"])
    assert r.exit_code == 0, r.output
    for word in ("FLOPs", "GFLOP/s", "memory   peak", "disk", "1 sample(s)"):
        assert word in r.output
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "extra,member",
    [([], "grads"), pytest.param(["--dtype", "amp-bf16", "--ensemble", "2"], "grads.1", marks=pytest.mark.rare)],
    ids=["oracle", "jittered-band-member"],
)
def test_a_killed_streaming_replay_resumes_bitwise(fp32_capture, tmp_path, extra, member):
    """SIGKILL once units of ``member`` have finished their backward; the same command continues from the
    journal and ends bitwise identical to an uninterrupted run (jittered emulation members included)."""
    out = tmp_path / "o"
    tail = ["--max-memory", "8G", "--threads", "1", *extra]
    cmd = [sys.executable, "-c", "import cli; cli.main()", "replay", str(fp32_capture), "--out", str(out), *tail]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    journal = tmp_path / ".o.partial" / member / "journal.jsonl"
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + HANG_S
    while time.time() < deadline and p.poll() is None:
        if journal.exists() and sum(1 for line in journal.read_text().splitlines() if '"unit"' in line) >= 3:
            os.kill(p.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    p.wait()
    assert p.returncode == -signal.SIGKILL, "the replay finished before it could be killed"
    assert not out.exists()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "(resumed)" in r.stdout
    whole = [*cmd[:4], str(fp32_capture), "--out", str(tmp_path / "whole"), *tail]  # same command, same threads
    assert subprocess.run(whole, cwd=ROOT, env=env, capture_output=True).returncode == 0
    assert Bundle(out).get("backward_order") == Bundle(tmp_path / "whole").get("backward_order")
    for group in Bundle(out).member_groups():
        a, b = Bundle(tmp_path / "whole").load_group(group), Bundle(out).load_group(group)
        assert [n for n in a if not torch.equal(a[n], b[n])] == [], group


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """Three samples of the tiny Qwen3 packed into one sequence, and each captured alone (loss sum)."""
    root = tmp_path_factory.mktemp("packed")
    cap, samples, src = packed_text_capture(root)
    alone = [capture_recipe_step(src, s, str(root / f"s{i}"), reduction="sum") for i, s in enumerate(samples)]
    return root, cap, alone


def test_a_packed_step_replays_as_its_samples_alone(packed):
    """Per-sample attention and restarting positions: the packed oracle is the sum of the samples'
    oracles (loss sum) within 1e-13, in memory and streamed (bitwise equal to each other)."""
    root, cap, alone = packed
    b = Bundle(cap)
    cu = b.get("packing")["cu_seqlens"]
    assert len(cu) == 4 and cu[0] == 0 and cu[-1] == b.entry("inputs", "input_ids")["shape"][-1]
    o = replay(cap, root / "o", verify="off")
    s = replay(cap, root / "os", max_memory=8 << 30)
    _assert_bitwise(o, s)
    parts = [replay(a, root / f"o{i}", verify="off") for i, a in enumerate(alone)]
    assert Bundle(o).get("loss")["value"] == pytest.approx(sum(Bundle(p).get("loss")["value"] for p in parts), rel=1e-13)
    go = _grads(o)
    for n, g in go.items():
        ref = sum(_grads(p)[n] for p in parts)
        assert float((g - ref).norm()) <= 1e-13 * float(ref.norm()) + 1e-300, n


def test_packing_boundaries_are_part_of_the_step(packed, tmp_path):
    """The same tokens without their boundaries are another step: scoring across is refused."""
    root, cap, _ = packed
    src = Bundle(cap)
    from oracle.bundle.store import BundleWriter

    with BundleWriter(tmp_path / "unpacked", "capture") as w:
        w.manifest.update({k: v for k, v in src.manifest.items() if k not in ("tensors", "schema_version", "kind", "packing")})
        inputs = src.load_group("inputs")
        del inputs["cu_seqlens"]
        inputs["position_ids"] = torch.arange(inputs["input_ids"].shape[-1]).view(1, -1)
        w.add("inputs", inputs)
        w.add("weights", src.load_group("weights"))
        w.add("grads", src.load_group("grads"))
    o = replay(tmp_path / "unpacked", tmp_path / "o", verify="off")
    with pytest.raises(MismatchError, match="cu_seqlens"):
        score(o, [cap])


def test_capture_packs_from_the_cli(tmp_path):
    sample = ROOT / "replays" / "qwen3" / "sample.jsonl"
    r = CliRunner().invoke(app, ["capture", "--model", "tiny-qwen3", "--sample", str(sample), "--index", "1", "--pack", "2",
                                 "--out", str(tmp_path / "c")])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert len(Bundle(tmp_path / "c").get("packing")["cu_seqlens"]) == 3
    r = CliRunner().invoke(
        app, ["capture", "--model", "tiny-qwen3", "--sample", str(sample), "--index", "0,3", "--out", str(tmp_path / "d")]
    )
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["capture", "--model", "tiny-qwen3", "--index", "0,1", "--out", str(tmp_path / "e")])
    assert r.exit_code == 2 and "--sample" in r.output
