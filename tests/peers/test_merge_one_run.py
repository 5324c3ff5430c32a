"""Merge refuses ranks that are not one run, and merges PP with tied embeddings as Megatron reduces
them (issue 21, item 4). Peers: real megatron-core 0.12.1 on CPU (tests/megatron_peer.py)."""

from __future__ import annotations

import pytest
import torch
from megatron_peer import run_peer
from typer.testing import CliRunner

from cli import app
from oracle.bundle.store import Bundle, BundleWriter
from oracle.errors import MismatchError
from oracle.integrations.megatron.merge import merge_ranks
from oracle.replay.run import replay
from oracle.score.scorer import score

V = 200
RUNS = {
    "tp2": {"tp": 2, "sp": False},
    "tp2-mean": {"tp": 2, "sp": False, "per_token": False},
    "tp2sp": {"tp": 2, "sp": True},
    "pp2-tied": {"tp": 1, "sp": False, "pp": 2, "tied": True},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("one-run")
    for name, opts in RUNS.items():
        run_peer(str(root / name), vocab=V, divisible_by=128, **opts)
    return root


def rank(runs, run, r, stage="pre"):
    return runs / run / stage / f"rank{r:05d}"


def edited(src, dst, *, megatron=None, weight=None):
    """A copy of rank bundle ``src`` with manifest['megatron'] fields replaced, or one weight scaled by 1.5."""
    b = Bundle(src)
    with BundleWriter(dst, b.kind) as w:
        w.manifest.update({k: v for k, v in b.manifest.items() if k not in ("tensors", "schema_version", "kind")})
        w.manifest["megatron"] = {**w.manifest["megatron"], **(megatron or {})}
        for group in b.groups():
            tensors = b.load_group(group)
            if group == "weights" and weight:
                tensors[weight] = tensors[weight] * 1.5
            w.add(group, tensors)
    return dst


def _merge_cli(tmp_path, *ranks):
    res = CliRunner().invoke(app, ["merge", *map(str, ranks), "--recipe", "qwen3", "--out", str(tmp_path / "m")])
    assert "Traceback" not in res.output and not (tmp_path / "m").exists(), res.output
    return res


@pytest.mark.parametrize("other,field", [("tp2-mean", "calculate_per_token_loss"), ("tp2sp", "config.sequence_parallel")])
def test_ranks_of_runs_with_another_loss_convention_or_sp_are_exit_5_naming_ranks_and_field(runs, tmp_path, other, field):
    """TP rank 0 of one run + TP rank 1 of another: refused, exit 5, both rank paths and the field named."""
    a, b = rank(runs, "tp2", 0), rank(runs, other, 1)
    with pytest.raises(MismatchError, match=field):
        merge_ranks([a, b], tmp_path / "m", recipe="qwen3")
    res = _merge_cli(tmp_path, a, b)
    assert res.exit_code == 5 and str(a) in res.output and str(b) in res.output and field in res.output, res.output


def test_ranks_with_other_weights_or_another_loss_are_exit_5(runs, tmp_path):
    """A TP rank whose replicated norm weight differs, or whose loss differs, is not the same run."""
    norm = next(n for n in Bundle(rank(runs, "tp2", 1)).names("weights") if n.endswith("final_layernorm.weight"))
    w = edited(rank(runs, "tp2", 1), tmp_path / "w" / "rank00001", weight=norm)
    res = _merge_cli(tmp_path, rank(runs, "tp2", 0), w)
    assert res.exit_code == 5 and norm in res.output, res.output
    loss = Bundle(rank(runs, "tp2", 1)).get("megatron")["loss_as_given"]
    lo = edited(rank(runs, "tp2", 1), tmp_path / "l" / "rank00001", megatron={"loss_as_given": loss * 1.01})
    res = _merge_cli(tmp_path, rank(runs, "tp2", 0), lo)
    assert res.exit_code == 5 and "loss_as_given" in res.output, res.output


def test_mixed_stages_are_exit_5(runs, tmp_path):
    """A pre-finalize rank with a post-finalize one: exit 5 naming both stages."""
    res = _merge_cli(tmp_path, rank(runs, "tp2", 0), rank(runs, "tp2", 1, "post"))
    assert res.exit_code == 5 and "mix stages" in res.output and "post-finalize" in res.output, res.output


def test_the_ranks_of_one_run_still_merge(runs, tmp_path):
    """The checks pass every rank of one run (TP2, TP2+SP): exit 0."""
    for run in ("tp2", "tp2sp", "tp2-mean"):
        assert (
            CliRunner()
            .invoke(app, ["merge", str(runs / run / "pre"), "--recipe", "qwen3", "--out", str(tmp_path / run)])
            .exit_code
            == 0
        )


@pytest.mark.parametrize("stage", ["pre", "post"])
def test_pp_with_tied_embeddings_merges_as_megatron_reduces_it(runs, tmp_path, stage):
    """PP2, tied: one embedding gradient = stage 0's embedding + the last stage's output layer (pre-finalize;
    either after), no lm_head; the merge replays and its fp64 oracle judges it within noise (rel L2 < 1e-5)."""
    cap = Bundle(merge_ranks([runs / "pp2-tied" / stage], tmp_path / "m", recipe="qwen3"))
    names = cap.names("grads")
    assert "lm_head.weight" not in names and "lm_head.weight" not in cap.names("weights")
    assert cap.get("recipe")["config"]["tie_word_embeddings"] is True
    s0, s1 = Bundle(rank(runs, "pp2-tied", 0, stage)), Bundle(rank(runs, "pp2-tied", 1, stage))
    ge = s0.load("grads", "module.embedding.word_embeddings.weight").double()
    go = s1.load("grads", "module.output_layer.weight").double()
    want = ge + go if stage == "pre" else ge
    assert torch.equal(cap.load("grads", "model.embed_tokens.weight"), want.float())
    oracle = replay(cap.path, tmp_path / "o", verify="off")
    c = score(oracle, [cap.path])["captures"][0]
    assert c["verdict"]["class"] == "within_noise" and c["coverage"]["missing"] == []
    emb = next(p for p in c["params"] if p["name"] == "model.embed_tokens.weight")
    assert emb["rel_l2"] < 1e-5
