"""Gradient accumulation: a training call of several micro-batches on megatron-core 0.12.1 (CPU, gloo, TP 2 +
SP), captured by ORACLE_CAPTURE through the loop's own schedule, merges into one batch whose float64 replay
is the accumulated main_grad (oracle/integrations/megatron/microbatches.py)."""

import pytest
import torch
from megatron_peer import run_peer
from typer.testing import CliRunner

from cli import app
from oracle.bundle.store import Bundle, BundleWriter
from oracle.errors import BundleError
from oracle.integrations.megatron.merge import merge_ranks
from oracle.integrations.megatron.microbatches import combine, split
from oracle.replay.run import replay
from oracle.score.scorer import score

V = 200
# batch(seed) masks its first 3 + seed % 3 labels: seeds 7, 8 give micro-batches of 11 and 10 loss tokens,
# 7, 10 two of 11
RUNS = {"per-token": ({"per_token": True}, (7, 8)), "mean-equal": ({"per_token": False}, (7, 10)),
        "mean-unequal": ({"per_token": False}, (7, 8))}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("microbatches")
    for name, (opts, seeds) in RUNS.items():
        run_peer(str(root / name), 2, True, vocab=V, divisible_by=128, mb_seeds=seeds, **opts)
    return root


@pytest.mark.parametrize("run", ["per-token", "mean-equal"])
@pytest.mark.parametrize("stage", ["pre", "post"])
def test_two_micro_batches_merge_into_one_batch_whose_fp64_replay_is_the_accumulated_main_grad(runs, run, stage, tmp_path):
    """Each rank stores mb0.* and mb1.*; merged, they are one (2, T) batch; every fp32 main_grad (the sum over
    both micro-batches) within 1e-5 of the float64 oracle and the loss within 1e-6."""
    ranks = sorted((runs / run / stage).iterdir())
    assert len(ranks) == 2
    b = Bundle(ranks[0])
    assert {n.split(".", 1)[0] for n in b.names("inputs")} == {"mb0", "mb1"}
    counts = [m["num_tokens"] for m in b.get("megatron")["microbatches"]]
    assert counts == ([11, 10] if run == "per-token" else [11, 11])
    cap = merge_ranks([runs / run / stage], tmp_path / "merged", recipe="qwen3")
    merged = Bundle(cap)
    assert tuple(merged.load("inputs", "input_ids").shape) == (2, 16)
    assert merged.get("megatron")["boundaries"] == {} and merged.get("megatron")["microbatches"] == [
        {"num_tokens": n} for n in counts]  # fmt: skip
    c = score(str(replay(cap, tmp_path / "oracle")), [str(cap)])["captures"][0]
    worst = max(c["params"], key=lambda p: p["rel_l2"])
    assert worst["rel_l2"] <= 1e-5, worst
    assert c["loss_check"]["rel"] <= 1e-6 and not c["loss_check"]["beyond"], c["loss_check"]


def test_one_micro_batch_alone_is_another_step_and_the_score_says_so(runs, tmp_path):
    """Planted: the step's main_grads (both micro-batches) with micro-batch 0's inputs alone (the merged batch's
    first row) are far off their replay: the concatenation is what makes them agree."""
    cap = Bundle(merge_ranks([runs / "per-token" / "pre"], tmp_path / "merged", recipe="qwen3"))
    with BundleWriter(tmp_path / "mb0-alone", "capture") as w:
        w.manifest.update({k: v for k, v in cap.manifest.items() if k not in ("tensors", "schema_version", "kind")})
        for group in cap.groups():
            tensors = cap.load_group(group)
            w.add(group, {n: t[:1] for n, t in tensors.items()} if group == "inputs" else tensors)  # (1, ...): mb0
    c = score(str(replay(tmp_path / "mb0-alone", tmp_path / "oracle")), [str(tmp_path / "mb0-alone")])["captures"][0]
    assert max(p["rel_l2"] for p in c["params"]) > 0.1 and c["verdict"]["class"] != "within_noise"


def test_mean_loss_over_micro_batches_of_unequal_tokens_is_refused_with_the_fix(runs, tmp_path):
    """Without per-token loss Megatron averages each micro-batch's mean: over 11 and 10 loss tokens that is no
    mean over the step; merge refuses (exit 4) naming the counts and the fix. The capture root (not its pre/)
    merged: the folders to merge named."""
    r = CliRunner().invoke(app, ["merge", str(runs / "mean-unequal" / "pre"), "--out", str(tmp_path / "m"),
                                 "--recipe", "qwen3"])  # fmt: skip
    assert r.exit_code == 4, r.output
    assert "micro-batches of [11, 10] loss tokens" in r.output and "--calculate-per-token-loss" in r.output
    assert "capture the step again" in r.output and "equal loss-token counts" in r.output
    assert not (tmp_path / "m").exists()
    r = CliRunner().invoke(app, ["merge", str(runs / "per-token"), "--out", str(tmp_path / "m"), "--recipe", "qwen3"])
    assert r.exit_code == 4 and f"merge {runs / 'per-token' / 'pre'} (before finalize_model_grads)" in r.output, r.output


def test_micro_batches_that_do_not_fit_together_are_named():
    """Packed micro-batches concatenate along the tokens with shifted cu_seqlens, images in order; mixed layouts,
    unpacked shapes that do not stack and stray names are refused, naming what."""
    a = {"input_ids": torch.arange(5)[None], "cu_seqlens": torch.tensor([0, 2, 5]), "position_ids": torch.zeros(3, 1, 5),
         "pixel_values": torch.ones(4, 6), "image_grid_thw": torch.tensor([[1, 2, 2]])}  # fmt: skip
    b = {"input_ids": torch.arange(3)[None], "cu_seqlens": torch.tensor([0, 3]), "position_ids": torch.ones(3, 1, 3),
         "pixel_values": torch.zeros(8, 6), "image_grid_thw": torch.tensor([[1, 2, 4]])}  # fmt: skip
    out = combine(split({f"mb{i}.{k}": v for i, d in enumerate((a, b)) for k, v in d.items()}))
    assert out["cu_seqlens"].tolist() == [0, 2, 5, 8]
    assert out["input_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]] and tuple(out["position_ids"].shape) == (3, 1, 8)
    assert tuple(out["pixel_values"].shape) == (12, 6) and out["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 4]]
    text = {k: v for k, v in b.items() if k not in ("pixel_values", "image_grid_thw")}
    out = combine([a, text, a])
    assert out["cu_seqlens"].tolist() == [0, 2, 5, 8, 10, 13] and out["image_grid_thw"].tolist() == [[1, 2, 2]] * 2
    unpacked = {k: v for k, v in b.items() if k != "cu_seqlens"}
    with pytest.raises(BundleError, match="micro-batch 1 is not packed"):
        combine([a, unpacked])
    with pytest.raises(BundleError, match="mb\\*.position_ids is token-aligned but micro-batch 1 has none"):
        combine([a, {k: v for k, v in b.items() if k != "position_ids"}])
    with pytest.raises(BundleError, match=r"unpacked micro-batches of shapes \[\(1, 3\), \(1, 5\)\]"):
        combine([{"input_ids": torch.arange(5)[None]}, {"input_ids": torch.arange(3)[None]}])
    with pytest.raises(BundleError, match="mixes micro-batch inputs"):
        split({"mb0.input_ids": torch.zeros(1, 2), "labels": torch.zeros(1, 2)})
