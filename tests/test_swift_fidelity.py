"""ms-swift 3.12.1's own Megatron Qwen3-VL step (tests/swift/peer.py in the pinned ``.venv-swift``),
each rank captured by the documented hook with nothing passed that the run does not record, then
merged with no hand-written config, replayed in float64 and scored; at TP 2 + SP each rank's own
gradients against its rank view. Skipped where the pinned environment is not built
(``.ci/swift-env``)."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent / "swift"))
import rank_capture  # noqa: E402

from cli import app  # noqa: E402
from oracle.bundle.store import Bundle, BundleWriter  # noqa: E402
from oracle.integrations.megatron.merge import merge_ranks  # noqa: E402
from oracle.integrations.megatron.rankview import compare_rank, rank_view  # noqa: E402
from oracle.replay.run import replay  # noqa: E402
from oracle.score.scorer import score  # noqa: E402

pytestmark = pytest.mark.skipif(not rank_capture.available(), reason="the pinned ms-swift environment (.venv-swift) is not built")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (rank folder, merged capture, its fp64 oracle)."""
    root = tmp_path_factory.mktemp("swift")
    out = {}
    for name, kw in {"tp1": {"tp": 1}, "tp2sp": {"tp": 2, "sp": True}}.items():
        rank_capture.run(str(root / name), **kw)
        cap = merge_ranks([root / name / "pre"], root / f"{name}.cap", recipe="qwen3-vl")
        out[name] = (root / name, str(cap), str(replay(cap, root / f"{name}.oracle")))
    return out


def _hf_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "hf" / "model.safetensors"))


@pytest.mark.parametrize("run", ["tp1", "tp2sp"])
def test_merged_weights_are_the_hf_checkpoint_bitwise_vision_tower_included(runs, run):
    """Every merged tensor equals the checkpoint ms-swift loaded: the ViT's fc1 not halved at TP 1, its
    rows not duplicated at TP 2, qkv / gated fc1 / vocabulary per Megatron's layout."""
    run_dir, cap, _ = runs[run]
    b, hf = Bundle(cap), _hf_weights(run_dir)
    assert set(b.names("weights")) == set(hf)
    for n, t in hf.items():
        assert torch.equal(b.load("weights", n), t.to(b.load("weights", n).dtype)), n
    kinds = {m["kind"] for g, m in b.get("megatron")["mapping"].items() if g.startswith("visual.")}
    assert kinds == {"replica"}  # recognised by structure (transformers modules), not as Megatron's fc1 / row


def test_tp1_fp32_step_is_within_1e5_of_the_oracle_with_no_config_given(runs):
    """TP 1: merge needs no --hf-config (the run's model holds it), mrope accepted, labels pre-rolled
    recorded and not shifted twice: every gradient within 1e-5, the loss within 1e-6."""
    _, cap, oracle = runs["tp1"]
    meg = Bundle(cap).get("megatron")
    assert meg["labels"]["labels_shift"] == "pre-rolled" and "loss_mask" in Bundle(cap).names("inputs")
    assert meg["vocab"]["padding"] == "none" and meg["vocab"]["padded"] == meg["vocab"]["true"] == 272
    assert meg["config"]["position_embedding_type"] == "mrope" and meg["numerics"]["mrope_section"] == [2, 3, 3]
    assert meg["numerics"]["hf_mrope_interleaved"] is True and meg["numerics"]["args"]["cross_entropy_loss_fusion"] is False
    c = score(oracle, [cap])["captures"][0]
    worst = max(c["params"], key=lambda p: p["rel_l2"])
    assert len(c["params"]) == 104 and worst["rel_l2"] <= 1e-5, worst
    assert c["loss_check"]["rel"] <= 1e-6 and c["framework"] is None
    assert c["verdict"]["class"] == "within_noise"


def test_a_second_label_shift_is_what_the_record_prevents(runs, tmp_path):
    """The same capture replayed as if its labels were unshifted (the old behaviour) is another step:
    its loss leaves the band and the gradients are far off."""
    _, cap, oracle = runs["tp1"]
    b = Bundle(cap)
    with BundleWriter(tmp_path / "shifted", "capture") as w:
        w.manifest.update({k: v for k, v in b.manifest.items() if k not in ("tensors", "schema_version", "kind")})
        for g in b.groups():
            w.add(g, {n: t for n, t in b.load_group(g).items() if n != "loss_mask"})
    wrong = replay(tmp_path / "shifted", tmp_path / "shifted.oracle")
    c = score(wrong, [tmp_path / "shifted"])["captures"][0]
    assert c["loss_check"]["beyond"] and max(p["rel_l2"] for p in c["params"]) > 0.1


def test_tp2_sp_unreduced_vision_gradients_are_a_framework_finding_naming_them(runs):
    """TP 2 + SP: the ViT gradients ms-swift never reduces are found from the ranks' disagreement,
    named in merge and score; the deepstack mergers' copies add up to the full gradient (scored as
    their sum), the blocks feeding them and the embeddings do not (left to rank-view)."""
    run_dir, cap, oracle = runs["tp2sp"]
    found = {u["hf"] for u in Bundle(cap).get("megatron")["unreduced"]}
    vision = {n for n in Bundle(cap).names("grads") if n.startswith("model.visual.")}
    expect = {n for n in vision if not n.startswith(("model.visual.merger.", "model.visual.blocks.2."))}  # deepstack reads blocks 0, 1
    assert found == expect and len(found) == 39
    c = score(oracle, [cap])["captures"][0]
    f = c["framework"]
    assert set(f["adds_up"]) == {n for n in found if ".deepstack_merger_list." in n}
    assert set(f["excluded"]) == found - set(f["adds_up"])
    assert all(r["shortfall"] > 0.1 for r in f["params"])  # each rank's copy is far from the full gradient
    assert all(r["sum_rel_l2"] <= 1e-5 for r in f["params"] if r["adds_up"])
    assert c["verdict"]["class"] == "within_noise" and "framework finding" in c["verdict"]["text"]
    assert not set(f["excluded"]) & {p["name"] for p in c["params"]}
    # held, judged per rank: named apart in the coverage, neither missing nor silently passed
    assert set(c["coverage"]["framework_apart"]) == set(f["excluded"]) and c["coverage"]["missing"] == []
    assert "judged per rank (rank-view)" in c["verdict"]["text"]
    worst = max(c["params"], key=lambda p: p["rel_l2"])
    assert worst["rel_l2"] <= 1e-5 and c["loss_check"]["rel"] <= 1e-6, worst
    r = CliRunner().invoke(app, ["score", oracle, cap])
    assert r.exit_code == 0 and "framework finding: 39 replicated gradient(s)" in r.output, r.output


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_sp_rank_view_matches_each_ranks_own_capture_vision_tower_included(runs, rank):
    """Each rank against its own partial truth (deepstack restricted to its sequence chunk, norms'
    partial sums over its chunk / heads): every one of its 92 parameters within 1e-5."""
    run_dir, _, oracle = runs["tp2sp"]
    errs = compare_rank(rank_view(oracle, rank=rank), run_dir / "pre" / f"rank{rank:05d}")
    assert len(errs) == 92
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-5, (worst, errs[worst])


def test_tp2_sp_after_finalize_the_finding_stays_and_each_rank_matches_its_view(runs, tmp_path):
    """After finalize (mean loss) the same 39 gradients are still unreduced; the rest of the step is
    within 1e-5 of the oracle and rank 1's post-finalize gradients match its own view."""
    run_dir, pre_cap, _ = runs["tp2sp"]
    cap = merge_ranks([run_dir / "post"], tmp_path / "post.cap", recipe="qwen3-vl")
    meg = Bundle(cap).get("megatron")
    assert {u["hf"] for u in meg["unreduced"]} == {u["hf"] for u in Bundle(pre_cap).get("megatron")["unreduced"]}
    oracle = replay(cap, tmp_path / "post.oracle")
    c = score(oracle, [cap])["captures"][0]
    worst = max(c["params"], key=lambda p: p["rel_l2"])
    assert worst["rel_l2"] <= 1e-5 and c["loss_check"]["rel"] <= 1e-6 and c["verdict"]["class"] == "within_noise", worst
    errs = compare_rank(rank_view(oracle, rank=1), run_dir / "post" / "rank00001")
    assert len(errs) == 92 and max(errs.values()) <= 1e-5, max(errs, key=errs.get)


def test_fused_norm_names_merge_like_the_unfused_ones(runs, tmp_path):
    """TE / MindSpeed name the decoder norms linear_qkv.layer_norm_weight and
    linear_fc1.layer_norm_weight; renamed so, the capture merges to the same gradients bitwise."""
    run_dir, cap, _ = runs["tp1"]
    src = Bundle(run_dir / "pre" / "rank00000")
    ren = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
           "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}  # fmt: skip

    def rename(n: str) -> str:
        return next((n.replace(a, b) for a, b in ren.items() if n.endswith(a)), n)

    with BundleWriter(tmp_path / "fused" / "rank00000", "capture") as w:
        meta = {k: v for k, v in src.manifest.items() if k not in ("tensors", "schema_version", "kind")}
        meta["megatron"] = {**meta["megatron"], "layout": {rename(n): v for n, v in meta["megatron"]["layout"].items()}}
        w.manifest.update(meta)
        for g in src.groups():
            w.add(g, {rename(n) if g != "inputs" else n: t for n, t in src.load_group(g).items()})
    fused = Bundle(merge_ranks([tmp_path / "fused"], tmp_path / "fused.cap", recipe="qwen3-vl"))
    plain = Bundle(cap)
    assert sorted(fused.names("grads")) == sorted(plain.names("grads"))
    assert all(torch.equal(fused.load("grads", n), plain.load("grads", n)) for n in plain.names("grads"))


@pytest.fixture(scope="module")
def env_runs(tmp_path_factory):
    """dtype -> (merged capture, its fp64 oracle): TP 1 steps captured through ORACLE_CAPTURE alone."""
    root = tmp_path_factory.mktemp("swift-env")
    out = {}
    for dtype in ("fp32", "bf16"):
        cap_dir = rank_capture.env_capture(str(root / dtype), tp=1, dtype=dtype)
        cap = merge_ranks([Path(cap_dir) / "pre"], root / f"{dtype}.cap", recipe="qwen3-vl")
        out[dtype] = (str(cap), str(replay(cap, root / f"{dtype}.oracle")))
    return out


def test_env_captured_fp32_step_is_within_1e5_of_the_oracle(env_runs):
    """The user's path end to end: ORACLE_CAPTURE (no file edited) -> merge (no --hf-config) -> fp64
    replay -> score: every gradient within 1e-5 relative, the loss within 1e-6, within noise."""
    cap, oracle = env_runs["fp32"]
    c = score(oracle, [cap])["captures"][0]
    worst = max(c["params"], key=lambda p: p["rel_l2"])
    assert len(c["params"]) == 104 and worst["rel_l2"] <= 1e-5, worst
    assert c["loss_check"]["rel"] <= 1e-6 and c["verdict"]["class"] == "within_noise"


def test_env_captured_bf16_step_is_within_its_emulated_band(env_runs, tmp_path):
    """A bf16 step (Float16Module, fp32 main_grad) captured through ORACLE_CAPTURE scores within the
    noise band of four emulated bf16 runs of the same step, on every one of its 104 gradients."""
    cap, oracle = env_runs["bf16"]
    band = replay(cap, tmp_path / "band", dtype="bf16", ensemble=4)
    c = score(oracle, [cap], band_paths=[band])["captures"][0]
    assert len(c["params"]) == 104 and c["verdict"]["class"] == "within_noise", c["verdict"]
    assert max(p["excess"] for p in c["params"]) < 1.0
