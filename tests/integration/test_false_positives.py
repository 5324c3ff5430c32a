"""False-positive rate: honest captures are never flagged (issue 11, item 3).

20 honest captures of the tiny Qwen3-VL -- fp32, bf16 and amp-bf16, two samples, capture seeds and
module selections varied, every normalisation module recorded by some capture of each precision --
are scored end to end against their own step's oracle (tolerance table) and replayed locally: none
may be beyond noise, and no module may be named a culprit. Captures of one step share its oracle
(fp32 and amp-bf16 hold the same fp32 weights; bf16 its own rounded ones); oracles skip the
finite-difference certificate (tested elsewhere) and local replays use one emulated member.
"""

from __future__ import annotations

import pytest

from oracle.capture.steps import capture_recipe_step
from oracle.replay.local import replay_local
from oracle.replay.run import replay
from oracle.score.local import score_local
from oracle.score.scorer import score

NORMS_LM_01 = r"layers\.[01]\.(input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm)$"
NORMS_LM_23 = r"layers\.[23]\.(input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm)$|language_model\.norm$"
NORMS_VIT = r"visual\..*norm\d?$"
BLOCKS = r"layers\.[13]\.(mlp|self_attn)$|visual\.blocks\.1$|visual\.merger$"
SELECTIONS = {
    "fp32": [NORMS_LM_01, NORMS_LM_23, NORMS_VIT],
    "bf16": [NORMS_LM_01, NORMS_LM_23, NORMS_VIT],
    "amp-bf16": [NORMS_LM_01, NORMS_LM_23, NORMS_VIT, BLOCKS],
}
PLAN = [(s, p, sel, seed) for s in (0, 1) for p, sels in SELECTIONS.items() for seed, sel in enumerate(sels)]


@pytest.fixture(scope="module")
def samples(sample):
    other = dict(sample, messages=[*sample["messages"][:-1], {"role": "assistant", "content": "Squares, red to green."}])
    return [sample, other]


def test_twenty_honest_captures_are_never_flagged(source, samples, tmp_path):
    assert len(PLAN) >= 20
    oracles: dict[tuple[int, str], str] = {}
    flagged, culprits = [], []
    for s, prec, sel, seed in PLAN:
        name = f"s{s}-{prec}-{seed}"
        cap = capture_recipe_step(source, samples[s], str(tmp_path / name), precision=prec, seed=seed, modules=sel)
        step = (s, "bf16" if prec == "bf16" else "fp32")  # the weights the step holds
        if step not in oracles:
            oracles[step] = str(replay(cap, tmp_path / f"oracle-{s}-{step[1]}", verify="off"))
        v = score(oracles[step], [cap])["captures"][0]["verdict"]
        if v["class"] != "within_noise":
            flagged.append(v["text"])
        res = score_local(replay_local(cap, tmp_path / f"{name}.local", members=1))
        if res["culprits"]:
            culprits.append(f"{name}: {res['verdict']['text']}")
        assert len(res["modules"]) >= 2
    assert flagged == [] and culprits == []
