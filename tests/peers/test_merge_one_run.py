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
    "tp2-noloss": {"tp": 2, "sp": False, "no_loss": True},  # another run, its ranks captured with loss=None
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("one-run")
    for name, opts in RUNS.items():
        run_peer(str(root / name), vocab=V, divisible_by=128, **opts)
    return root


def rank(runs, run, r, stage="pre"):
    return runs / run / stage / f"rank{r:05d}"


def edited(src, dst, *, megatron=None, weight=None, coords=None, tokens=False, extra_weight=None):
    """A copy of rank bundle ``src`` with manifest['megatron'] fields replaced, or one weight scaled by 1.5,
    ``coords`` replaced, its tokens changed (one id moved by one), or ``extra_weight`` (name, tensor) added
    as a weight that TP does not split."""
    b = Bundle(src)
    with BundleWriter(dst, b.kind) as w:
        w.manifest.update({k: v for k, v in b.manifest.items() if k not in ("tensors", "schema_version", "kind")})
        w.manifest["megatron"] = {**w.manifest["megatron"], **(megatron or {})}
        if coords is not None:
            w.manifest["megatron"]["coords"] = coords
        for group in b.groups():
            tensors = b.load_group(group)
            if group == "weights" and weight:
                tensors[weight] = tensors[weight] * 1.5
            if group == "weights" and extra_weight:
                tensors[extra_weight[0]] = extra_weight[1]
                w.manifest["megatron"]["layout"] = {**w.manifest["megatron"]["layout"], extra_weight[0]: {
                    "tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1, "sequence_parallel": False}}
            if group == "inputs" and tokens:
                tensors["tokens"] = tensors["tokens"].clone()
                tensors["tokens"][0, 0] = (tensors["tokens"][0, 0] + 1) % V
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


# -- without a loss (issue 32, item 3) -------------------------------------------------------------------------


def test_two_runs_ranks_without_a_loss_are_exit_5_naming_both_ranks_and_the_run_id(runs, tmp_path):
    """TP rank 0 of one run and TP rank 1 of another, neither with a loss (capture_rank(loss=None)), same
    inputs and replicated weights: the run id both recorded from their run's store tells them apart."""
    a = edited(rank(runs, "tp2", 0), tmp_path / "a" / "rank00000", megatron={"loss_as_given": None})
    b = rank(runs, "tp2-noloss", 1)
    assert Bundle(b).get("megatron")["loss_as_given"] is None
    assert Bundle(a).get("megatron")["run_id"] != Bundle(b).get("megatron")["run_id"]
    res = _merge_cli(tmp_path, a, b)
    assert res.exit_code == 5 and str(a) in res.output and str(b) in res.output and "run_id" in res.output, res.output


def test_a_rank_without_a_loss_that_saw_another_batch_is_exit_5(runs, tmp_path):
    """Same run id, no loss, but TP rank 1's tokens differ from rank 0's: refused, both ranks named."""
    b = edited(rank(runs, "tp2-noloss", 1), tmp_path / "b" / "rank00001", tokens=True)
    res = _merge_cli(tmp_path, rank(runs, "tp2-noloss", 0), b)
    assert res.exit_code == 5 and "saw another batch" in res.output and str(b) in res.output, res.output


def test_a_replicated_weight_that_differs_between_tp_ranks_is_exit_5(runs, tmp_path):
    """A weight TP does not split (a vision tower's, in ms-swift's Qwen3-VL) holds one value on every TP
    rank: two values name the weight (not only norm weights are compared)."""
    name = "module.vision.patch_embed.weight"
    a = edited(rank(runs, "tp2-noloss", 0), tmp_path / "a" / "rank00000", extra_weight=(name, torch.ones(4, 3)))
    b = edited(rank(runs, "tp2-noloss", 1), tmp_path / "b" / "rank00001", extra_weight=(name, torch.full((4, 3), 2.0)))
    res = _merge_cli(tmp_path, a, b)
    assert res.exit_code == 5 and name in res.output and "replicated" in res.output, res.output


def test_the_ranks_of_one_run_without_a_loss_merge(runs, tmp_path):
    """Both ranks of the loss-less run: one run id, one batch: merged (exit 0), the run id recorded."""
    res = CliRunner().invoke(app, ["merge", str(runs / "tp2-noloss" / "pre"), "--recipe", "qwen3", "--out", str(tmp_path / "m")])
    assert res.exit_code == 0, res.output
    assert Bundle(tmp_path / "m").get("megatron")["run_id"] == Bundle(rank(runs, "tp2-noloss", 0)).get("megatron")["run_id"]


@pytest.mark.parametrize("coords,says", [({"rank": 1, "tp_size": 2}, "no 'tp_rank'"),
                                         ({"rank": 1, "tp_rank": 2, "tp_size": 2}, "tp_rank=2 >= tp_size=2"),
                                         ({"rank": 1, "tp_rank": "1", "tp_size": 2}, "megatron.coords.tp_rank")])  # fmt: skip
def test_a_rank_with_missing_or_bad_coordinates_is_exit_4_naming_it(runs, tmp_path, coords, says):
    """A rank bundle whose coordinates lack tp_rank (or hold a bad one): exit 4 naming the bundle and the
    key, never exit 1."""
    b = edited(rank(runs, "tp2", 1), tmp_path / "b" / "rank00001", coords=coords)
    res = _merge_cli(tmp_path, rank(runs, "tp2", 0), b)
    assert res.exit_code == 4 and str(b) in res.output and says in res.output, res.output
