"""score/framework.py ``judge_per_rank``: a gradient the framework left per rank is scored rank by rank
against each rank's own truth and band (the judge's rank-view bundle), the worst rank naming its row;
without a per-rank truth it is left out with the reason."""

from __future__ import annotations

import pytest
import torch

from oracle.bundle.store import Bundle, BundleWriter
from oracle.score.framework import KEY, judge_per_rank

P = "model.visual.blocks.0.attn.qkv.weight"


def _bundle(path, kind: str, groups: dict, **manifest) -> Bundle:
    with BundleWriter(path, kind) as w:
        w.manifest.update(manifest)
        for g, ts in groups.items():
            w.add(g, ts)
    return Bundle(path)


def _band_of(members: list[dict]) -> float:  # score's rule: the widest member, above a floor
    return max([m["rel_l2"] for m in members] + [1e-4])


@pytest.fixture
def runs(tmp_path):
    g = torch.Generator().manual_seed(0)
    truth = [torch.randn(96, 32, generator=g, dtype=torch.float64) for _ in range(2)]  # each rank's own part
    noise = [torch.randn(96, 32, generator=g, dtype=torch.float64) for _ in range(2)]
    members = [[{"rel_l2": 0.010}, {"rel_l2": 0.012}], [{"rel_l2": 0.020}, {"rel_l2": 0.015}]]  # per rank, per member
    view = _bundle(tmp_path / "view", "oracle", {"grads": {f"{P}|tp{r}": truth[r] for r in range(2)}}, precision="fp64",
                   metadata={KEY: {"tp": 2, "sequence_parallel": True, "names": [P], "band": {"bf16": {P: members}}}})

    def capture(name: str, off: list[float]) -> Bundle:
        held = {f"{P}|tp{r}": (truth[r] + off[r] * noise[r] * truth[r].norm() / noise[r].norm()).float() for r in range(2)}
        return _bundle(tmp_path / name, "capture", {"grads": {P: sum(held.values())}, "framework_grads": held},
                       precision="bf16", megatron={"unreduced": [{"hf": P, "mcore": P, "tp": 2, "spread": 0.5}]})

    return view, capture, members


def test_a_rank_off_by_half_is_the_row_beyond_its_own_band_and_named_as_the_worst_rank(runs):
    view, capture, members = runs
    judged, left_out = judge_per_rank([view], capture("bad", [0.004, 0.5]), [P], "bf16", _band_of)
    assert left_out == []
    row, info = judged[P]["row"], judged[P]["info"]
    assert info["judged"] == "per rank" and info["worst_rank"] == 1 and info["tp"] == 2
    assert row["rel_l2"] == pytest.approx(0.5, rel=1e-3)
    assert judged[P]["members"] == members[1]  # the band of the rank the row is
    ranks = {x["rank"]: x for x in info["per_rank"]}
    assert ranks[0]["rel_l2"] == pytest.approx(0.004, rel=1e-2) and ranks[0]["band"] == 0.012
    assert ranks[1]["band"] == 0.020 and ranks[1]["rel_l2"] / ranks[1]["band"] > 20


def test_honest_ranks_stay_within_their_bands_and_the_worst_is_the_larger_ratio(runs):
    view, capture, _ = runs
    judged, _ = judge_per_rank([view], capture("honest", [0.006, 0.008]), [P], "bf16", _band_of)
    info = judged[P]["info"]
    assert info["worst_rank"] == 0  # 0.006 / 0.012 = 0.5 beats 0.008 / 0.020 = 0.4
    assert all(x["rel_l2"] <= x["band"] for x in info["per_rank"])


def test_without_a_per_rank_truth_the_gradient_is_left_out_with_its_reason(runs):
    _, capture, _ = runs
    judged, left_out = judge_per_rank([], capture("alone", [0.0, 0.0]), [P], "bf16", _band_of)
    assert judged == {} and [x["name"] for x in left_out] == [P]
    assert left_out[0]["reason"].startswith("left unreduced across TP ranks by the framework and not the sum of its "
                                            "copies; no per-rank truth: the judge's rank-view stage did not project it")
