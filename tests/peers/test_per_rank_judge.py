"""``oracle judge`` judges the gradients ms-swift leaves per TP rank (the ViT under SP) itself, rank by rank
(its rank-view stage, oracle/integrations/megatron/perrank.py), on the user's PACKED bf16 step of the two
paths (conftest.py ``packed_judged``: the honest H20 capture, its truth and band shared with
test_two_paths_judge.py). They were left out of the verdict; a ViT fault went unseen ("both honest").

On the packed 910B step the ViT's attention runs TND (one segment per image) and its 3 backward calls come
after the 4 decoder layers' ones, last block first: ``@6`` is ViT block 0, which feeds the first deepstack
merger, so its gradients are among those the framework leaves per rank. Skipped where either pinned
environment is not built (``.ci/swift-env``, ``.ci/mindspeed-env``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VIT_BLOCK0 = "attention_kv_offset@6"  # ViT block 0's TND backward: the second image's queries also see the first's keys
QKV = "model.visual.blocks.0.attn.qkv.weight"

import rank_capture  # noqa: E402  (tests/swift/rank_capture.py, on sys.path by tests/peers/conftest.py)
import run as ms_run  # noqa: E402  (tests/mindspeed/run.py, likewise)

pytestmark = pytest.mark.skipif(not (rank_capture.available() and ms_run.available()),
                                reason="the pinned ms-swift (.venv-swift) or MindSpeed (.venv-mindspeed) env is not built")


def _capture(doc: dict, run: str) -> dict:
    return next(c for c in doc["score"]["captures"] if c["name"] == run)


def _per_rank(c: dict) -> dict[str, dict]:
    return {p["name"]: p for p in c["params"] if p.get("judged") == "per rank"}


def test_honest_runs_have_every_per_rank_gradient_in_the_verdict_and_within_its_own_band(packed_judged):
    """Honest H20 vs honest 910B: the ViT gradients that are neither one rank's copy nor their sum are rows of
    the verdict, each judged on its worst TP rank against that rank's truth and a band of 2 members projected
    the same way, all within it; nothing is left out; both runs honest."""
    doc, out = packed_judged("")
    assert doc["answers"]["noise"]["faulty"] == [], doc["headline"]
    assert "rank-view" in doc["stages"]
    for run in ("H20", "910B"):
        c = _capture(doc, run)
        rows = _per_rank(c)
        assert sorted(rows) == sorted(c["framework"]["per_rank"]) and QKV in rows, sorted(rows)
        assert all(n.startswith("model.visual.") for n in rows)
        assert c["left_out"] == [] and c["coverage"]["framework_apart"] == [], c["left_out"]
        for p in rows.values():
            assert p["class"] == "within_noise" and p["excess"] <= 3, p
            assert p["tp"] == 2 and len(p["per_rank"]) == 2 and p["worst_rank"] in (0, 1)
            assert all(r["band"] > 0 and r["rel_l2"] > 0 for r in p["per_rank"])
    assert "Traceback" not in out


def test_a_vit_block_0_attention_backward_leak_is_found_per_rank_by_the_judge(packed_judged, steps):
    """ViT block 0's attention backward lets every query of the second image see the first image's keys (forward
    exact) in the 910B run: the judge names 910B faulty, and block 0's qkv weight is a per-rank row far beyond
    its band there, within it in H20. The fault acted: the loss is bitwise the honest one and only vision
    gradients moved."""
    doc, out = packed_judged(VIT_BLOCK0)
    assert doc["answers"]["noise"]["faulty"] == ["910B"], doc["headline"]
    bad, good = _per_rank(_capture(doc, "910B"))[QKV], _per_rank(_capture(doc, "H20"))[QKV]
    assert bad["class"] == "beyond_noise" and bad["excess"] > 10, bad
    assert good["class"] == "within_noise", good
    assert "Traceback" not in out
    _, _, honest = steps("910b", "bf16")
    _, _, faulty = steps("910b", "bf16", faults=VIT_BLOCK0)
    for h, f in zip(honest, faulty):
        assert f["fault_calls"]["attention_kv_offset"] == 7 and f["reported"] == h["reported"], f["fault_calls"]
        changed = [n for n in h["grads_sha256"] if f["grads_sha256"][n] != h["grads_sha256"][n]]
        assert changed and all("vision" in n or "visual" in n for n in changed), changed


def test_the_dry_run_prices_the_rank_view_stage(packed_judged, tmp_path):
    """``oracle judge --dry-run`` of the packed pair lists the rank-view stage between the band and the score, with a
    time: TP 2 x (the truth + the 2 band members), the whole step in memory."""
    from oracle.pipeline.judge import Judge

    packed_judged("")
    j = Judge(packed_judged.h20, packed_judged.folders[""], out=tmp_path / "dry", recipe="qwen3-vl", names=["H20", "910B"])
    text, refused = j.dry_run()
    rows = [ln.split()[0] for ln in text.splitlines()[2:] if ln.startswith("  ") and not ln.startswith("  total")]
    assert rows[rows.index("band-bf16") + 1] == "rank-view" and rows[rows.index("rank-view") + 1] == "score", text
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("rank-view"))
    assert line.split()[1] not in ("<", "0"), line
    assert refused == []
