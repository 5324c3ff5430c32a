"""Megatron-core 0.12.1 on CPU (gloo): captured per rank with the hook, merged, replayed through
transformers' Qwen3 in float64, scored; and each rank's pre-finalize main_grads against the
oracle's rank view."""

import json

import pytest
import torch
from helpers import rewrite_grads
from megatron_peer import CFG, run_peer
from typer.testing import CliRunner

from cli import app
from oracle.bundle import Bundle
from oracle.errors import BundleError
from oracle.megatron.hook import capture_rank
from oracle.megatron.layout import merge_fc1
from oracle.megatron.merge import merge_ranks
from oracle.megatron.rankview import compare_rank, rank_view
from oracle.replay import replay
from oracle.score import score

HF = {"model_type": "qwen3", "vocab_size": CFG["vocab_size"], "hidden_size": CFG["hidden_size"],
      "intermediate_size": CFG["intermediate_size"], "num_hidden_layers": CFG["num_hidden_layers"],
      "num_attention_heads": CFG["num_attention_heads"], "num_key_value_heads": CFG["num_key_value_heads"],
      "head_dim": CFG["head_dim"], "rms_norm_eps": CFG["rms_norm_eps"], "rope_theta": CFG["rope_theta"],
      "tie_word_embeddings": False, "max_position_embeddings": 64}  # fmt: skip
RUNS = {"tp1": (1, False), "tp2": (2, False), "tp2sp": (2, True)}


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    for i, (name, (tp, sp)) in enumerate(RUNS.items()):
        run_peer(str(root / name), tp, sp, port=29600 + i)
    return root


@pytest.fixture(scope="module")
def merged(peers):
    """(run, stage) -> (merged capture, its fp64 oracle)."""
    out = {}
    for run in RUNS:
        for stage in ("pre", "post"):
            cap = merge_ranks([peers / run / stage], peers / f"{run}-{stage}.merged", recipe="qwen3", hf_config=HF)
            out[run, stage] = (str(cap), str(replay(cap, peers / f"{run}-{stage}.oracle")))
    return out


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("stage", ["pre", "post"])
def test_merged_fp32_main_grads_match_the_fp64_oracle(merged, run, stage):
    cap, oracle = merged[run, stage]
    c = score(oracle, [cap])["captures"][0]
    assert len(c["params"]) == 2 + 2 * 11 + 1  # embed, norm, lm_head and 11 HF tensors per layer
    worst = max(c["params"], key=lambda p: p["rel_l2"])
    assert worst["rel_l2"] <= 1e-5, worst
    m = Bundle(cap).get("megatron")
    assert m["stage"] == f"{stage}-finalize" and not m["warnings"]
    assert Bundle(cap).get("loss")["reduction"] == ("sum" if stage == "pre" else "mean")


@pytest.mark.parametrize("run", list(RUNS))
def test_each_rank_matches_the_oracles_rank_view(peers, merged, run):
    tp, sp = RUNS[run]
    _, oracle = merged[run, "pre"]
    for rank in range(tp):
        view = rank_view(oracle, tp_size=tp, rank=rank, sequence_parallel=sp, stage="pre-finalize")
        errs = compare_rank(view, peers / run / "pre" / f"rank{rank:05d}")
        assert len(errs) == 19 and max(errs.values()) <= 1e-5, max(errs.items(), key=lambda kv: kv[1])
    if tp > 1:  # the view is a rank's own: rank 0's view does not fit rank 1
        view0 = rank_view(oracle, tp_size=tp, rank=0, sequence_parallel=sp, stage="pre-finalize")
        assert max(compare_rank(view0, peers / run / "pre" / "rank00001").values()) > 0.1


def test_a_wrong_fc1_merge_shows_up_as_a_large_error(peers, merged, tmp_path):
    cap, oracle = merged["tp2", "pre"]
    ranks = [Bundle(peers / "tp2" / "pre" / f"rank{r:05d}") for r in range(2)]
    name = "module.decoder.layers.0.mlp.linear_fc1.weight"
    shards = [b.load("grads", name) for b in ranks]
    wrong_gate, wrong_up = torch.cat(shards, 0).chunk(2, 0)  # cat then chunk: interleaves the ranks
    right_gate, _ = merge_fc1(shards)
    assert not torch.equal(wrong_gate, right_gate)
    bad = rewrite_grads(cap, str(tmp_path / "bad"), lambda n, g: {"model.layers.0.mlp.gate_proj.weight": wrong_gate,
                                                                  "model.layers.0.mlp.up_proj.weight": wrong_up}.get(n, g))  # fmt: skip
    rows = {p["name"]: p for p in score(oracle, [bad])["captures"][0]["params"]}
    assert rows["model.layers.0.mlp.gate_proj.weight"]["rel_l2"] > 0.5


def test_unsummed_sequence_parallel_partial_sums_show_up(peers, merged, tmp_path):
    cap, oracle = merged["tp2sp", "pre"]
    rank0 = Bundle(peers / "tp2sp" / "pre" / "rank00000")
    partial = rank0.load("grads", "module.decoder.layers.1.input_layernorm.weight")
    bad = rewrite_grads(cap, str(tmp_path / "bad"), lambda n, g: partial if n == "model.layers.1.input_layernorm.weight" else g)
    rows = {p["name"]: p for p in score(oracle, [bad])["captures"][0]["params"]}
    assert rows["model.layers.1.input_layernorm.weight"]["rel_l2"] > 0.2


def test_missing_ranks_and_mixed_stages_are_named(peers, tmp_path):
    with pytest.raises(BundleError, match=r"TP rank\(s\) \[1\] are missing"):
        merge_ranks([peers / "tp2" / "pre" / "rank00000"], tmp_path / "m", recipe="qwen3", hf_config=HF)
    with pytest.raises(BundleError, match="mix stages"):
        merge_ranks([peers / "tp2" / "pre" / "rank00000", peers / "tp2" / "post" / "rank00001"], tmp_path / "m",
                    recipe="qwen3", hf_config=HF)  # fmt: skip


def test_cli_merge_and_rank_view(peers, merged, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF))
    r = CliRunner().invoke(app, ["merge", str(peers / "tp2sp" / "pre"), "--out", str(tmp_path / "m"), "--recipe", "qwen3",
                                 "--hf-config", str(tmp_path / "config.json")])  # fmt: skip
    assert r.exit_code == 0 and "merged 2 TP rank(s) (pre-finalize)" in r.output, r.output
    _, oracle = merged["tp2sp", "pre"]
    rank0 = Bundle(peers / "tp2sp" / "pre" / "rank00000")
    honest = "".join(
        f"[DEBUG_GRAD_NORM][POST_BACKWARD_LAYER] {n} norm={float(rank0.load('grads', n).norm())}\n" for n in rank0.names("grads")
    )
    off = "".join(
        f"[DEBUG_GRAD_NORM][POST_BACKWARD_LAYER] {n} norm={float(rank0.load('grads', n).norm()) * 1.2}\n"
        for n in rank0.names("grads")
    )
    (tmp_path / "a.log").write_text(honest)
    (tmp_path / "b.log").write_text(off)
    r = CliRunner().invoke(app, ["rank-view", oracle, "--tp", "2", "--rank", "0", "--sp", "--compare",
                                 str(peers / "tp2sp" / "pre" / "rank00000"), "--log", str(tmp_path / "a.log"),
                                 "--log", str(tmp_path / "b.log"), "--name", "GPU", "--name", "NPU"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "max rel L2" in r.output and "closer to the truth: GPU on 19 parameter(s), NPU on 0" in r.output


def test_the_hook_only_reads(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    model(torch.randn(2, 4)).sum().backward()
    for p in model.parameters():
        p.main_grad = p.grad.clone() * 2  # Megatron's fp32 accumulator
    before = {n: (p.detach().clone(), p.main_grad.clone(), p.grad.clone()) for n, p in model.named_parameters()}
    path = capture_rank(model, tmp_path, stage="pre-finalize", batch={"tokens": torch.arange(4)},
                        coords={"rank": 0, "tp_rank": 0, "tp_size": 1})  # fmt: skip
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n][0]) and torch.equal(p.main_grad, before[n][1]) and torch.equal(p.grad, before[n][2])
    b = Bundle(path)
    assert torch.equal(b.load("grads", "0.weight"), before["0.weight"][1])  # main_grad, not .grad
    assert b.get("megatron")["coords"]["tp_size"] == 1
