"""benchmarks/detection_power.py reads the judge's answer through verdict() alone: what it counts as left out."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import detection_power as dp  # noqa: E402


def test_a_plants_effect_leaves_out_only_what_the_decision_leaves_out():
    """Gradients the framework left unreduced but the judge's rank-view stage judged are in the verdict (the
    decision's left_out is empty), so the effect counts them; without a decision, the framework's list."""
    fw = {"shared": ["model.visual.blocks.0.attn.qkv.weight"], "only": {"910B": [], "H20": []}}
    doc = {"answers": {"framework": fw, "born": {"per_run": [{"run": "910B", "module": "model.visual.blocks.0.mlp",
                                                              "direction": "backward"}]}},
           "decision": {"per_run": [{"run": "910B", "left_out": []},
                                    {"run": "H20", "left_out": [{"name": "x.weight", "why": "unreduced"}]}]}}  # fmt: skip
    v = dp.verdict(doc)
    assert v["left_out"] == {"910B": [], "H20": ["x.weight"]} and v["born"]["910B"] == ("model.visual.blocks.0.mlp", "backward")
    assert dp.called_right({**v, "faulty": ["910B"]}, "910B", ("vit", 0), "backward")
    del doc["decision"]
    assert dp.verdict(doc)["left_out"]["910B"] == ["model.visual.blocks.0.attn.qkv.weight"]
