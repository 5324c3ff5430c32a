r"""Following the judge's advice works: decoder layer 0's sub-module boundaries (``ORACLE_CAPTURE_MODULES=
'decoder\.layers\.0\..*'``, conftest.py ``sub_judged``) captured on both user paths merge onto the HF
attention, MLP, norms and q/k norms (oracle/integrations/megatron/boundaries.py) and replay locally, and
``oracle judge`` names the sub-module a fault is born in. They gave "no module boundaries captured" and lost
the layer. The fault: ms-swift's layer 0 MLP scaling the gradient inside its own backward on the H20 path
(tests/swift/peer.py ``mlp-grad``; its forward, and so the loss, bitwise unchanged). Skipped where either
pinned environment is not built (``.ci/swift-env``, ``.ci/mindspeed-env``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MLP = "model.language_model.layers.0.mlp"

import rank_capture  # noqa: E402  (tests/swift/rank_capture.py, on sys.path by tests/peers/conftest.py)
import run as ms_run  # noqa: E402  (tests/mindspeed/run.py, likewise)

pytestmark = pytest.mark.skipif(not (rank_capture.available() and ms_run.available()),
                                reason="the pinned ms-swift (.venv-swift) or MindSpeed (.venv-mindspeed) env is not built")


def test_a_fault_inside_layer_0s_mlp_backward_is_named_at_that_sub_module(sub_judged):
    """H20 with layer 0's MLP backward scaled by 1.5 vs honest 910B, both with layer 0's sub-modules recorded:
    H20 faulty, born in model.language_model.layers.0.mlp (backward) from its local replay. The H20 path (the
    local spec) maps the attention, MLP, both norms and the q/k norms; the 910B path (MindSpeed's TE spec fuses
    the input norms into linear_qkv / linear_fc1) maps its q/k norms and the attention and MLP through their
    norms, and names the weightless norm modules unmapped with the reason; every mapped module of the honest 910B
    run is within its local band (before: its attention and MLP were unmapped, issue 40 item 5)."""
    from oracle.bundle.store import Bundle

    doc, out = sub_judged("")
    assert "Traceback" not in out, out[-3000:]
    local = doc["local"]
    assert local["H20"]["verdict"]["culprit"] == MLP and local["H20"]["verdict"]["direction"] == "backward", local["H20"]["verdict"]
    assert local["910B"]["verdict"]["culprit"] is None, local["910B"]["verdict"]
    assert doc["answers"]["noise"]["faulty"] == ["H20"], doc["headline"]
    born = next(r for r in doc["answers"]["born"]["per_run"] if r["run"] == "H20")
    assert born["module"] == MLP and born["direction"] == "backward" and born["source"] == "local replay", born
    assert doc["headline"].startswith(f"answer: H20 is faulty (beyond its own noise band); born in {MLP} (backward)"), doc["headline"]
    layer = "model.language_model.layers.0."
    h20 = Bundle(sub_judged.root / "judge" / "merge-H20")
    assert set(h20.get("modules")) == {layer + m for m in ("self_attn", "self_attn.q_norm", "self_attn.k_norm", "mlp",
                                                          "input_layernorm", "post_attention_layernorm")}  # fmt: skip
    npu = Bundle(sub_judged.root / "judge" / "merge-910B")
    mods = npu.get("modules")
    assert set(mods) == {layer + m for m in ("self_attn", "self_attn.q_norm", "self_attn.k_norm", "mlp")}, sorted(mods)
    # the attention and the MLP receive the hidden states before the norm fused into linear_qkv / linear_fc1: mapped
    # through the HF norm, replayed as that norm then the module (replay/local.py _Through)
    assert mods[layer + "self_attn"]["through"] == layer + "input_layernorm"
    assert mods[layer + "mlp"]["through"] == layer + "post_attention_layernorm"
    why = {u["module"].rsplit("layers.0.", 1)[1]: u["why"] for u in npu.get("megatron")["boundaries"]["unmapped"]}
    assert "self_attention" not in why and "mlp" not in why and "pre_mlp_layernorm" in why, sorted(why)
    assert why["input_layernorm"].startswith("it has no weight: an identity")
    rows = {m["module"]: m for m in local["910B"]["modules"]}
    assert all(not rows[layer + m]["beyond"] for m in ("self_attn", "mlp")), [(m, rows[layer + m]["ratio"]) for m in ("self_attn", "mlp")]
    assert rows[layer + "mlp"]["param"] is not None  # the norm's weight gradient with the MLP's


def test_a_fault_inside_vision_block_0s_forward_is_named_at_that_block(vit_judged):
    """H20 with vision block 0's output x1.1 inside its forward vs honest 910B, both with the decoder layers' and the
    vision blocks' boundaries (``ORACLE_CAPTURE_MODULES=layers,vit``): the blocks merge on both paths as the HF
    blocks ms-swift runs whole on every TP rank (boundaries.py ``_replica``; blocks 0-1 feed the deepstack mergers,
    whose features ms-swift slices per rank: their grad_outputs differ between ranks and are summed), H20 is faulty,
    born in model.visual.blocks.0 (forward) from its local replay; every vision block of the honest 910B run is
    within its local band. Before: the Megatron merge mapped decoder layers only, and the judge placed this fault
    in block 2, backward (benchmarks/detection_power.py)."""
    from oracle.bundle.store import Bundle

    doc, out = vit_judged("")
    assert "Traceback" not in out, out[-3000:]
    blocks = [f"model.visual.blocks.{i}" for i in range(3)]
    for run in ("H20", "910B"):
        merged = Bundle(vit_judged.root / "judge" / f"merge-{run}")
        mods = merged.get("modules")
        assert set(blocks) <= set(mods), sorted(mods)
        assert [mods[b]["megatron"]["grad_output_summed"] for b in blocks] == [True, True, False], run
    assert doc["local"]["H20"]["verdict"]["culprit"] == blocks[0] and doc["local"]["H20"]["verdict"]["direction"] == "forward"
    assert doc["answers"]["noise"]["faulty"] == ["H20"], doc["headline"]
    born = next(r for r in doc["answers"]["born"]["per_run"] if r["run"] == "H20")
    assert born["module"] == blocks[0] and born["direction"] == "forward" and born["source"] == "local replay", born
    honest = {m["module"]: m for m in doc["local"]["910B"]["modules"]}
    assert all(not honest[b]["beyond"] for b in blocks), [(b, honest[b]["ratio"]) for b in blocks]


def test_a_fault_inside_layer_0s_attention_backward_on_the_910b_path_is_named_at_that_sub_module(sub_judged):
    """The advice works on the 910B path too: with layer 0's sub-modules recorded, MindSpeed's attention (its input
    norm fused into linear_qkv, replayed through the HF input_layernorm) is where an attention backward fault of
    layer 0 (the stand-in's npu_fusion_attention without its causal mask in the backward, ``@3``: layer 0 of 4) is
    named, from the 910B run's local replay; the H20 run keeps its own MLP fault."""
    doc, out = sub_judged("attention_causal_leak@3")
    assert "Traceback" not in out, out[-3000:]
    attn = "model.language_model.layers.0.self_attn"
    assert doc["local"]["910B"]["verdict"]["culprit"] == attn, doc["local"]["910B"]["verdict"]
    born = {r["run"]: r for r in doc["answers"]["born"]["per_run"]}
    assert born["910B"]["module"] == attn and born["910B"]["direction"] == "backward", born["910B"]
    assert born["H20"]["module"] == MLP, born["H20"]
