"""Megatron-core 0.12.1 on CPU (gloo), as users run it: a padded vocabulary (V = 200, padded to a
multiple of 128 x TP), GQA 4:1 with q/k layernorm, TP 2 / TP 4 + SP / PP 2 / DP 2, per-token and
mean loss. Each rank captured with the hook, merged with no hand-written config, replayed through
transformers' Qwen3 in float64 and scored; each rank's pre-finalize main_grads against the
oracle's rank view with no layout flags."""

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import rewrite_grads
from megatron_peer import CFG, PACKED, run_peer
from typer.testing import CliRunner

from cli import app
from oracle.bundle.store import Bundle, BundleWriter
from oracle.errors import BundleError, MismatchError, NotReplayable, UsageError
from oracle.integrations.megatron.hook import capture_rank
from oracle.integrations.megatron.layout import merge_fc1
from oracle.integrations.megatron.merge import merge_ranks
from oracle.integrations.megatron.rankview import compare_rank, rank_view
from oracle.replay.run import replay
from oracle.score.scorer import score

# A hand-written config, for the override checks and for msprobe imports (which record none).
HF = {"model_type": "qwen3", "vocab_size": CFG["vocab_size"], "hidden_size": CFG["hidden_size"],
      "intermediate_size": CFG["intermediate_size"], "num_hidden_layers": CFG["num_hidden_layers"],
      "num_attention_heads": CFG["num_attention_heads"], "num_key_value_heads": CFG["num_key_value_heads"],
      "head_dim": CFG["head_dim"], "rms_norm_eps": CFG["rms_norm_eps"], "rope_theta": CFG["rope_theta"],
      "tie_word_embeddings": False, "max_position_embeddings": 64}  # fmt: skip
V = 200  # not a multiple of 128 x TP: Megatron pads it to 256 (TP 1, 2) or 512 (TP 4)
RUNS = {  # name: (run_peer options, padded vocabulary)
    "tp2": ({"tp": 2, "sp": False}, 256),
    "tp4sp": ({"tp": 4, "sp": True}, 512),
    "tp2sp-mean": ({"tp": 2, "sp": True, "per_token": False}, 256),
    "pp2": ({"tp": 1, "sp": False, "pp": 2}, 256),
    "dp2": ({"tp": 1, "sp": False, "dp": 2}, 256),
}


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    for name, (opts, _) in RUNS.items():
        run_peer(str(root / name), vocab=V, divisible_by=128, **opts)
    return root


@pytest.fixture(scope="module")
def merged(peers):
    """(run, stage) -> (merged capture, its fp64 oracle); no config given: it comes from the run."""
    out = {}
    for run in RUNS:
        for stage in ("pre", "post"):
            cap = merge_ranks([peers / run / stage], peers / f"{run}-{stage}.merged", recipe="qwen3")
            out[run, stage] = (str(cap), str(replay(cap, peers / f"{run}-{stage}.oracle")))
    return out


def _ranks(folder, **want):
    """Rank bundles of a run folder whose coordinates match ``want`` (tp_rank=, pp_rank=, dp_rank=)."""
    out = []
    for p in sorted(folder.iterdir()):
        c = Bundle(p).get("megatron")["coords"]
        if all(c.get(k, 0) == v for k, v in want.items()):
            out.append(p)
    return out


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("stage", ["pre", "post"])
def test_merged_fp32_main_grads_match_the_fp64_oracle_with_equal_losses(merged, run, stage):
    cap, oracle = merged[run, stage]
    c = score(oracle, [cap])["captures"][0]
    assert len(c["params"]) == 2 + 2 * 11 + 1  # embed, norm, lm_head and 11 HF tensors per layer
    worst = max(c["params"], key=lambda p: p["rel_l2"])
    assert worst["rel_l2"] <= 1e-5, worst
    assert c["verdict"]["class"] == "within_noise"
    assert c["loss_check"]["rel"] <= 1e-6 and not c["loss_check"]["beyond"], c["loss_check"]
    m = Bundle(cap).get("megatron")
    padded = RUNS[run][1]
    assert m["stage"] == f"{stage}-finalize" and not m["warnings"]
    assert m["vocab"] == {"padded": padded, "true": V, "divisible_by": 128, "padding": "megatron",
                          "how": f"{V} padded to a multiple of 128 x TP {RUNS[run][0]['tp']} = {padded}"}  # fmt: skip
    cfg = Bundle(cap).get("recipe")["config"]
    assert cfg["vocab_size"] == padded and cfg["num_key_value_heads"] == 4 and cfg["head_dim"] == 8
    rows = {p["name"]: p for p in c["params"]}
    assert rows["lm_head.weight"]["padded_rows"]["rows"] == [V, padded]
    per_token = RUNS[run][0].get("per_token", True)
    assert Bundle(cap).get("loss")["reduction"] == ("sum" if stage == "pre" and per_token else "mean")


@pytest.mark.parametrize("run", list(RUNS))
def test_each_rank_matches_the_oracles_rank_view_with_no_layout_flags(peers, merged, run):
    opts = RUNS[run][0]
    _, oracle = merged[run, "pre"]
    for pp_rank in range(opts.get("pp", 1)):
        for rank in range(opts["tp"]):
            warnings = []
            view = rank_view(oracle, rank=rank, pp_rank=pp_rank, warnings=warnings)
            (bundle,) = _ranks(peers / run / "pre", tp_rank=rank, pp_rank=pp_rank, dp_rank=0)
            errs = compare_rank(view, bundle)
            n = 19 if opts.get("pp", 1) == 1 else (9, 10)[pp_rank]  # a stage holds its layer and embed or head+norm
            assert not warnings and len(errs) == n and max(errs.values()) <= 1e-5, max(errs.items(), key=lambda kv: kv[1])
    if opts["tp"] > 1:  # the view is a rank's own: rank 0's view does not fit rank 1
        view0 = rank_view(oracle, rank=0)
        (rank1,) = _ranks(peers / run / "pre", tp_rank=1)
        assert max(compare_rank(view0, rank1).values()) > 0.1


def test_the_hook_records_the_run_config_and_stage_offsets(peers):
    (stage1,) = _ranks(peers / "pp2" / "pre", pp_rank=1)
    m = Bundle(stage1).get("megatron")
    assert m["layer_offset"] == 1 and m["coords"]["pp_size"] == 2
    cfg = m["config"]
    assert (cfg["num_query_groups"], cfg["kv_channels"], cfg["vocab_size"], cfg["true_vocab_size"]) == (4, 8, 256, V)
    assert cfg["activation"] == "silu" and cfg["normalization"] == "RMSNorm" and cfg["qk_layernorm"] is True
    assert cfg["share_embeddings_and_output_weights"] is False and cfg["seq_length"] == CFG["seq_len"]


def test_dropping_the_padded_rows_is_another_step_and_the_score_says_so(merged, tmp_path):
    """The old merge: rows [V, Vp) dropped, vocab V. Its replay is not the step: beyond noise, losses differ."""
    cap, _ = merged["tp2", "pre"]
    b = Bundle(cap)
    cut = lambda n, t: t[:V] if n in ("lm_head.weight", "model.embed_tokens.weight") else t  # noqa: E731
    with BundleWriter(tmp_path / "dropped", "capture") as w:
        w.manifest.update({k: v for k, v in b.manifest.items() if k not in ("tensors", "schema_version", "kind", "megatron")})
        w.manifest["recipe"] = {"name": "qwen3", "config": {**b.get("recipe")["config"], "vocab_size": V}}
        for group in ("inputs", "weights", "grads"):
            w.add(group, {n: cut(n, t) for n, t in b.load_group(group).items()})
    oracle = replay(tmp_path / "dropped", tmp_path / "dropped.oracle")
    c = score(oracle, [tmp_path / "dropped"])["captures"][0]
    assert c["verdict"]["class"] == "beyond_noise"
    assert c["loss_check"]["beyond"] and c["loss_check"]["rel"] > 1e-3
    assert "the captured loss differs from the replay's by" in c["verdict"]["text"]
    assert "the replay is not the step that ran (config, framework) or the device's forward is wrong" in c["verdict"]["text"]


def test_a_wrong_fc1_merge_shows_up_as_a_large_error(peers, merged, tmp_path):
    cap, oracle = merged["tp2", "pre"]
    ranks = [Bundle(p) for p in sorted((peers / "tp2" / "pre").iterdir())]
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
    cap, oracle = merged["tp4sp", "pre"]
    (rank0,) = _ranks(peers / "tp4sp" / "pre", tp_rank=0)
    partial = Bundle(rank0).load("grads", "module.decoder.layers.1.input_layernorm.weight")
    bad = rewrite_grads(cap, str(tmp_path / "bad"), lambda n, g: partial if n == "model.layers.1.input_layernorm.weight" else g)
    rows = {p["name"]: p for p in score(oracle, [bad])["captures"][0]["params"]}
    assert rows["model.layers.1.input_layernorm.weight"]["rel_l2"] > 0.2


def test_missing_ranks_mixed_stages_and_foreign_configs_are_named(peers, tmp_path):
    pre = sorted((peers / "tp2" / "pre").iterdir())
    with pytest.raises(BundleError, match=r"captures of DP 0 PP 0 TP 1 are missing"):
        merge_ranks([pre[0]], tmp_path / "m", recipe="qwen3")
    with pytest.raises(MismatchError, match="mix stages"):  # two runs' ranks: exit 5 (issue 21)
        merge_ranks([pre[0], sorted((peers / "tp2" / "post").iterdir())[1]], tmp_path / "m", recipe="qwen3")
    with pytest.raises(UsageError, match=r"--hf-config num_key_value_heads = 2 but the run has 4"):
        merge_ranks(
            [peers / "tp2" / "pre"], tmp_path / "m", recipe="qwen3", hf_config={**HF, "vocab_size": V, "num_key_value_heads": 2}
        )
    with pytest.raises(UsageError, match="after finalize every DP rank holds the gradient of all 2 DP ranks' batches"):
        merge_ranks([peers / "dp2" / "post"], tmp_path / "m", recipe="qwen3", dp_rank=1)
    # the tokenizer's vocabulary in a user's config is the true one: accepted, the padded rows kept
    out = merge_ranks([peers / "tp2" / "pre"], tmp_path / "ok", recipe="qwen3", hf_config={**HF, "vocab_size": V})
    assert Bundle(out).get("recipe")["config"]["vocab_size"] == 256 and Bundle(out).get("megatron")["vocab"]["true"] == V


def _with_inputs(src, dst, fn):
    """Copy a rank bundle with its inputs replaced by fn(inputs)."""
    b = Bundle(src)
    with BundleWriter(dst, "capture") as w:
        w.manifest.update({k: v for k, v in b.manifest.items() if k not in ("tensors", "schema_version", "kind")})
        for group in b.groups():
            t = b.load_group(group)
            w.add(group, fn(t) if group == "inputs" else t)
    return dst


def test_packed_boundaries_become_cu_seqlens_and_restarting_positions(peers, tmp_path):
    s = CFG["seq_len"]
    cu = torch.tensor([0, 5, 11, s], dtype=torch.int32)
    for r, src in enumerate(sorted((peers / "tp2" / "pre").iterdir())):
        _with_inputs(src, tmp_path / "cu" / f"rank{r:05d}", lambda t: {**t, "cu_seqlens": cu})
        _with_inputs(src, tmp_path / "pos" / f"rank{r:05d}",
                     lambda t: {**t, "position_ids": torch.tensor([list(range(5)) + list(range(6)) + list(range(5))])})  # fmt: skip
    want_pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]])
    for how in ("cu", "pos"):
        b = Bundle(merge_ranks([tmp_path / how], tmp_path / f"{how}.merged", recipe="qwen3"))
        assert b.load("inputs", "cu_seqlens").tolist() == [0, 5, 11, s]
        assert torch.equal(b.load("inputs", "position_ids"), want_pos)
        assert b.get("megatron")["packing"].startswith("packed: 3 samples")
    plain = Bundle(merge_ranks([peers / "tp2" / "pre"], tmp_path / "plain", recipe="qwen3"))
    assert not plain.has("inputs", "cu_seqlens") and plain.get("megatron")["packing"] is None


def test_a_real_packed_step_merges_into_its_boundaries_and_is_another_step(tmp_path):
    """megatron-core with the attention mask reset per sample: the merge finds the samples; their gradients
    differ from the same batch unpacked, so a replay must restrict attention to each sample."""
    run_peer(str(tmp_path / "packed"), 1, False, vocab=V, divisible_by=128, packed=True)
    run_peer(str(tmp_path / "plain"), 1, False, vocab=V, divisible_by=128)
    b = Bundle(merge_ranks([tmp_path / "packed" / "pre"], tmp_path / "packed.merged", recipe="qwen3"))
    assert b.load("inputs", "cu_seqlens").tolist() == PACKED
    assert torch.equal(b.load("inputs", "position_ids"), torch.arange(CFG["seq_len"])[None])  # mcore's rope: 0..T-1
    plain = Bundle(merge_ranks([tmp_path / "plain" / "pre"], tmp_path / "plain.merged", recipe="qwen3"))
    assert not plain.has("inputs", "cu_seqlens") and b.fingerprint()["weights"] == plain.fingerprint()["weights"]
    name = "model.layers.0.self_attn.q_proj.weight"
    g, t = b.load("grads", name).double(), plain.load("grads", name).double()
    assert float((g - t).norm() / t.norm()) > 0.05


def test_a_bundle_without_inputs_can_only_be_scored(merged, tmp_path):
    cap, _ = merged["tp2", "pre"]
    b = Bundle(cap)
    with BundleWriter(tmp_path / "noinputs", "capture") as w:
        w.manifest.update({k: v for k, v in b.manifest.items() if k not in ("tensors", "schema_version", "kind")})
        w.add("weights", b.load_group("weights"))
        w.add("grads", b.load_group("grads"))
    with pytest.raises(NotReplayable, match="holds no inputs"):
        replay(tmp_path / "noinputs", tmp_path / "o")
    r = CliRunner().invoke(app, ["replay", str(tmp_path / "noinputs"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 10 and "can only be scored against an oracle of the same step" in r.output


def test_cli_merge_and_rank_view_need_no_config_and_no_layout_flags(peers, merged, tmp_path):
    r = CliRunner().invoke(app, ["merge", str(peers / "tp4sp" / "pre"), "--out", str(tmp_path / "m"), "--recipe", "qwen3"])
    assert r.exit_code == 0 and "merged 4 rank(s) (TP 4, PP 1, DP ranks [0], pre-finalize)" in r.output, r.output
    assert "vocabulary: 512 rows (padded; true 200)" in r.output
    r = CliRunner().invoke(app, ["merge", str(peers / "tp2" / "pre"), "--out", str(tmp_path / "x"), "--recipe", "qwen3",
                                 "--hf-config", str(tmp_path / "cfg.json")])  # fmt: skip
    assert r.exit_code == 3, r.output  # the override file does not exist
    (tmp_path / "cfg.json").write_text(json.dumps({**HF, "vocab_size": V, "head_dim": 16}))
    r = CliRunner().invoke(app, ["merge", str(peers / "tp2" / "pre"), "--out", str(tmp_path / "x"), "--recipe", "qwen3",
                                 "--hf-config", str(tmp_path / "cfg.json")])  # fmt: skip
    assert r.exit_code == 2 and "head_dim = 16 but the run has 8" in r.output and "Traceback" not in r.output
    _, oracle = merged["tp4sp", "pre"]
    (rank0,) = _ranks(peers / "tp4sp" / "pre", tp_rank=0)
    norms = {n: float(Bundle(rank0).load("grads", n).norm()) for n in Bundle(rank0).names("grads")}
    (tmp_path / "a.log").write_text("".join(f"[DEBUG_GRAD_NORM][POST_BACKWARD_LAYER] {n} norm={v}\n" for n, v in norms.items()))
    (tmp_path / "b.log").write_text(
        "".join(f"[DEBUG_GRAD_NORM][POST_BACKWARD_LAYER] {n} norm={v * 1.2}\n" for n, v in norms.items())
    )
    r = CliRunner().invoke(app, ["rank-view", oracle, "--rank", "0", "--compare", str(rank0), "--log", str(tmp_path / "a.log"),
                                 "--log", str(tmp_path / "b.log"), "--name", "GPU", "--name", "NPU"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "TP=4 SP rank 0" in r.output and "pre-finalize, per-token" in r.output and "warning" not in r.output
    # rank 0's sequence chunk (tokens 0-3) is all prompt: its final_layernorm and layers.1 pre_mlp_layernorm
    # partial sums are exactly zero, so 17 of the 19 norms can be judged
    assert "max rel L2" in r.output and "closer to the truth: GPU on 17 parameter(s), NPU on 0" in r.output
    (rank1,) = _ranks(peers / "tp4sp" / "pre", tp_rank=1)
    r = CliRunner().invoke(app, ["rank-view", oracle, "--rank", "1", "--tp", "2", "--compare", str(rank1)])
    assert r.exit_code == 4 and "overrides the recorded 4" in r.output and "has shape" in r.output, r.output
    assert "Traceback" not in r.output


def test_the_hook_only_reads(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    model(torch.randn(2, 4)).sum().backward()
    for p in model.parameters():
        p.main_grad = p.grad.clone() * 2  # Megatron's fp32 accumulator
    before = {n: (p.detach().clone(), p.main_grad.clone(), p.grad.clone()) for n, p in model.named_parameters()}
    packed = SimpleNamespace(cu_seqlens_q=torch.tensor([0, 1, 4], dtype=torch.int32), cu_seqlens_q_padded=None)
    path = capture_rank(model, tmp_path, stage="pre-finalize", batch={"tokens": torch.arange(4)[None]},
                        packed_seq_params=packed, coords={"rank": 0, "tp_rank": 0, "tp_size": 1})  # fmt: skip
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n][0]) and torch.equal(p.main_grad, before[n][1]) and torch.equal(p.grad, before[n][2])
    b = Bundle(path)
    assert torch.equal(b.load("grads", "0.weight"), before["0.weight"][1])  # main_grad, not .grad
    assert b.get("megatron")["coords"]["tp_size"] == 1
    assert b.load("inputs", "cu_seqlens").tolist() == [0, 1, 4]
