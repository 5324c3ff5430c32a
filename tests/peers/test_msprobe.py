"""mindstudio-probe dumps made with the real package, imported and scored against an oracle."""

import json
import multiprocessing

import pytest
import torch
from helpers import fork_server
from megatron_peer import CFG, run_peer
from test_megatron import HF
from typer.testing import CliRunner

from cli import app
from oracle.bundle.store import Bundle
from oracle.capture.steps import build_model
from oracle.errors import BundleError, NotReplayable
from oracle.integrations.megatron.merge import merge_ranks
from oracle.integrations.msprobe import import_dump
from oracle.replay.run import replay
from oracle.score.scorer import score


def _dump_in_child(out: str, summary: bool) -> None:
    """msprobe's PrecisionDebugger is a process-wide singleton: each dump gets a fresh process."""
    from msprobe.pytorch import PrecisionDebugger

    from oracle import recipe as recipes

    task = "statistics" if summary else "tensor"
    cfg = {"task": task, "dump_path": out, "rank": [], "step": [], "level": "L0",
           task: {"scope": [], "list": [], "data_mode": ["all"], **({"summary_mode": "statistics"} if summary else {"file_format": "pt"})}}  # fmt: skip
    with open(out + ".json", "w") as f:
        json.dump(cfg, f)
    r = recipes.for_model("tiny-qwen3-vl")
    source = r.load("tiny-qwen3-vl")
    model = build_model(r, source.config, source.weights, torch.float32)
    inputs = r.prepare_inputs(source, model, r.default_sample())
    dbg = PrecisionDebugger(config_path=out + ".json")
    dbg.start(model=model)
    loss, _ = r.forward_loss(model, inputs, "mean")
    loss.backward()
    dbg.stop()
    dbg.step()


def _dump_tiny(out, summary=False):
    """A dump of the same step as the session's fp32 capture (embedded model and sample)."""
    ctx = multiprocessing.get_context(fork_server())  # a fresh process, without re-importing torch and transformers
    p = ctx.Process(target=_dump_in_child, args=(str(out), summary))
    p.start()
    p.join(300)
    assert p.exitcode == 0, "the msprobe dump process failed"
    return out


def test_tensor_dump_of_the_tiny_qwen3_vl_scores_against_the_oracle(oracle_bundle, tmp_path):
    dump = _dump_tiny(tmp_path / "dump")
    r = CliRunner().invoke(app, ["import-msprobe", str(dump), "--out", str(tmp_path / "ms"), "--precision", "fp32"])
    assert r.exit_code == 0 and "imported 104 gradient tensors" in r.output, r.output
    c = score(oracle_bundle, [tmp_path / "ms"])["captures"][0]
    assert len(c["params"]) == 104 and max(p["rel_l2"] for p in c["params"]) <= 1e-4
    assert c["unverified"] == ["inputs"]  # the weights were checked against the oracle's


def test_statistics_dump_becomes_a_norm_only_capture(oracle_bundle, tmp_path):
    dump = _dump_tiny(tmp_path / "dump", summary=True)
    b = Bundle(import_dump(dump, tmp_path / "ms"))
    assert b.kind == "norms" and len(b.get("norms")) == 104
    c = score(oracle_bundle, [tmp_path / "ms"])["captures"][0]
    assert c["norms_only"] and all(abs(p["norm_ratio"] - 1) < 1e-4 for p in c["params"])


def test_megatron_tp2_dump_is_merged_and_scored(tmp_path):
    run_peer(str(tmp_path / "run"), 2, True, msprobe_dir=str(tmp_path / "dump"))
    with pytest.raises(BundleError, match="choose one with --step / --rank"):
        import_dump(tmp_path / "dump", tmp_path / "x")
    ranks = [import_dump(tmp_path / "dump", tmp_path / f"r{r}", rank=r, megatron_tp=2, megatron_rank=r, sequence_parallel=True)
             for r in range(2)]  # fmt: skip
    merged = merge_ranks(ranks, tmp_path / "merged", recipe="qwen3", hf_config=HF)
    oracle = replay(merge_ranks([tmp_path / "run" / "pre"], tmp_path / "hook", recipe="qwen3", hf_config=HF), tmp_path / "oracle")
    c = score(oracle, [merged])["captures"][0]
    assert len(c["params"]) == 25 and max(p["rel_l2"] for p in c["params"]) <= 1e-5
    assert [Bundle(r).get("megatron")["coords"]["tp_rank"] for r in ranks] == [0, 1]
    with pytest.raises(NotReplayable, match="holds no inputs"):  # an msprobe merge can only be scored
        replay(merged, tmp_path / "no")


def test_dump_json_cannot_point_outside_its_folder(tmp_path):
    dump = _dump_tiny(tmp_path / "dump")
    dj = next(dump.rglob("dump.json"))
    d = json.loads(dj.read_text())
    key = next(k for k in d["data"] if "parameters_grad" in k)
    leaf = next(iter(d["data"][key]))
    d["data"][key][leaf][0]["data_name"] = "../../../../etc/passwd"
    dj.write_text(json.dumps(d))
    with pytest.raises(BundleError, match="outside dump_tensor_data"):
        import_dump(dump, tmp_path / "ms")


def test_megatron_dp2_dump_ranks_take_their_dp_coordinates(tmp_path):
    """A dump names only its global rank: with --megatron-dp 2 rank 1 is DP rank 1, and its merge is DP rank 1's step."""
    run_peer(str(tmp_path / "run"), 1, False, msprobe_dir=str(tmp_path / "dump"), dp=2)
    ranks = [import_dump(tmp_path / "dump", tmp_path / f"r{r}", rank=r, megatron_tp=1, megatron_dp=2, megatron_rank=r)
             for r in range(2)]  # fmt: skip
    assert [Bundle(r).get("megatron")["coords"]["dp_rank"] for r in ranks] == [0, 1]
    hf = {**HF, "vocab_size": CFG["vocab_size"]}
    for dp in (0, 1):
        merged = merge_ranks(ranks, tmp_path / f"m{dp}", recipe="qwen3", hf_config=hf, dp_rank=dp)
        hook = merge_ranks([tmp_path / "run" / "pre"], tmp_path / f"hook{dp}", recipe="qwen3", dp_rank=dp)
        c = score(replay(hook, tmp_path / f"oracle{dp}"), [merged])["captures"][0]
        assert max(p["rel_l2"] for p in c["params"]) <= 1e-5
    with pytest.raises(
        BundleError, match=r"(weights|grads)/.*linear_qkv.weight \(qkv.*does not hold 16 query heads and 8 query groups"
    ):
        merge_ranks(ranks, tmp_path / "bad", recipe="qwen3", hf_config={**hf, "num_key_value_heads": 8})
