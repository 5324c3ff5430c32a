"""ms-swift 3.12.1's own Megatron Qwen3-VL step on CPU: the facts the referee relies on.

Runs in the pinned environment only (``bash .ci/swift-env``, then
``.venv-swift/bin/python -m pytest --confcutdir=tests/swift tests/swift``); elsewhere it skips.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import needs_swift  # noqa: E402, F401  (skips this module outside .venv-swift)
import peer  # noqa: E402
import tiny  # noqa: E402
import torch  # noqa: E402
import truth  # noqa: E402

CONFIGS = {"tp1-fp32": (1, False, "fp32"), "tp2sp-fp32": (2, True, "fp32"),
           "tp1-bf16": (1, False, "bf16"), "tp2sp-bf16": (2, True, "bf16")}  # fmt: skip
DEEPSTACK = "visual.visual.deepstack_merger_list."


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny.write_model_dir(str(tmp_path_factory.mktemp("tiny-qwen3-vl")))


@pytest.fixture(scope="module")
def step(tmp_path_factory, hf_dir):
    """One run per configuration, made on first use and shared by the tests."""
    done = {}

    def get(name):
        if name not in done:
            tp, sp, dtype = CONFIGS[name]
            out = str(tmp_path_factory.mktemp(name))
            info = peer.run(out, tp=tp, sp=sp, dtype=dtype, model_dir=hf_dir)
            done[name] = (out, info, truth.load_ranks(out))
        return done[name]

    return get


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_step_runs_and_records_every_rank(step, name):
    """Each configuration runs one step and records weights, main_grads before and after finalize,
    the batch, the loss sum and the token count on every rank."""
    tp, sp, dtype = CONFIGS[name]
    out, info, ranks = step(name)
    assert len(ranks) == tp
    for r in ranks:
        m = r["meta"]
        assert (m["tp"], m["sp"], m["dtype"]) == (tp, sp, dtype)
        assert m["num_tokens"] == m["finalize_num_tokens"] == int((r["batch"]["labels"] != -100).sum())
        assert set(r["grads_pre"]) == set(r["grads_post"]) == set(r["weights"]) == set(m["params"])
        assert all(torch.isfinite(g).all() for g in r["grads_post"].values())
        assert m["versions"]["megatron.core"] == "0.12.1" and m["versions"]["ms-swift"] == "3.12.1"
        print(f"{name} rank {m['rank']}: build {m['build_s']:.2f}s step {m['step_s']:.3f}s (wall {info['wall_s']:.1f}s)")
    # finalize divides every gradient by the token count (calculate_per_token_loss)
    r = ranks[0]
    n = r["meta"]["num_tokens"]
    g = "module.module.language_model.output_layer.weight"
    assert torch.allclose(r["grads_post"][g], r["grads_pre"][g] / n, rtol=1e-6, atol=0)


def test_the_batch_is_what_ms_swift_hands_the_model(step):
    """get_batch rolls the labels by -1 (label t is token t+1), keeps the 3 mRoPE rows, passes no
    loss_mask; the loss is the sum over labels != -100, the count of those tokens."""
    out, info, ranks = step("tp1-fp32")
    b, m = ranks[0]["batch"], ranks[0]["meta"]
    s = tiny.sample(seq_multiple=1)
    assert torch.equal(b["labels"], torch.roll(s["labels"], -1, dims=-1))
    assert torch.equal(b["input_ids"], s["input_ids"])
    assert b["position_ids"].shape == (3, 1, s["input_ids"].shape[1])
    assert "loss_mask" not in m["batch_keys"] and "packed_seq_params" not in m["batch_keys"]
    assert m["reported"]["lm loss"] == [pytest.approx(m["loss_sum"]), m["num_tokens"]]


def test_weights_are_the_hf_checkpoint_in_mcore_layout(step, hf_dir):
    """The TP 1 weights, converted to transformers' names and layout, are the HF checkpoint exactly
    (so a float64 replay through transformers starts from the same step)."""
    from safetensors.torch import load_file

    out, info, ranks = step("tp1-fp32")
    hf = load_file(os.path.join(hf_dir, "model.safetensors"))
    conv = truth.mcore_to_hf(truth.merge(ranks, "weights"), tiny.TEXT)
    assert set(conv) == set(hf)
    for k in hf:
        assert torch.equal(conv[k].float(), hf[k]), k


def test_tp2_sp_language_model_gradients_merged_match_tp1(step):
    """fp32: TP 2 + SP shards merged by the megatron-core layout equal TP 1 to ~1e-5 on every
    language-model gradient, after finalize; before finalize the SP norms' partial sums add up."""
    _, _, one = step("tp1-fp32")
    _, _, two = step("tp2sp-fp32")
    for kind, partial in (("grads_post", False), ("grads_pre", True)):
        ref, got = truth.merge(one, kind), truth.merge(two, kind, partial_sum=partial)
        for name in ref:
            if ".language_model." in name:
                assert truth.rel_l2(got[name], ref[name]) < 1e-5, (kind, name, truth.rel_l2(got[name], ref[name]))
    assert two[0]["meta"]["loss_sum"] == pytest.approx(one[0]["meta"]["loss_sum"], rel=1e-6)


def test_deepstack_merger_gradients_are_unreduced_partial_sums_under_sp(step):
    """TP 2 + SP: each rank's deepstack_merger_list gradient covers only its own visual tokens;
    rank 0 + rank 1 is the TP 1 gradient, and finalize_model_grads does not reduce them (so the
    replicas differ after finalize). The main merger gets the full gradient on both ranks."""
    _, _, one = step("tp1-fp32")
    _, _, two = step("tp2sp-fp32")
    names = [n for n in one[0]["grads_post"] if DEEPSTACK in n]
    assert len(names) == 12
    for kind in ("grads_pre", "grads_post"):
        for n in names:
            ref = one[0][kind][n]
            summed = two[0][kind][n].double() + two[1][kind][n].double()
            assert truth.rel_l2(summed, ref) < 1e-5, (kind, n, truth.rel_l2(summed, ref))
            assert truth.rel_l2(two[0][kind][n], ref) > 1e-2, (kind, n)  # one rank alone is not the truth
    for n in [n for n in one[0]["grads_post"] if ".visual.merger." in n]:
        for r in two:
            assert truth.rel_l2(r["grads_post"][n], one[0]["grads_post"][n]) < 1e-5, n
    layout = two[0]["meta"]["params"]
    replicated = [n for n in layout if not layout[n]["tensor_model_parallel"]]
    differ = [n for n in replicated if not torch.equal(two[0]["grads_post"][n], two[1]["grads_post"][n])]
    assert set(names) <= set(differ) and all(".visual." in n for n in differ)  # the LM's replicas agree
    assert not any(layout[n]["sequence_parallel"] for n in differ)  # why finalize leaves them alone
    print(f"{len(differ)} of {len(layout)} gradients differ between the TP ranks after finalize")


def test_bf16_steps_agree_with_fp32_within_bf16_noise(step):
    """bf16 at TP 1 and TP 2 + SP: the same step as fp32 up to bf16 rounding (loss within 1e-2)."""
    ref = step("tp1-fp32")[2][0]["meta"]["loss_sum"]
    for name in ("tp1-bf16", "tp2sp-bf16"):
        ranks = step(name)[2]
        assert ranks[0]["meta"]["loss_sum"] == pytest.approx(ref, rel=1e-2)
        assert ranks[0]["weights"]["module.module.language_model.output_layer.weight"].dtype == torch.bfloat16
        assert ranks[0]["grads_post"]["module.module.language_model.output_layer.weight"].dtype == torch.float32


def test_pp2_stages_put_together_by_layer_offset_match_tp1(step, tmp_path_factory, hf_dir):
    """PP 2 (megatron-core's 1F1B schedule, p2p over gloo): stage 0 holds the embedding, the vision
    tower and layers 0-1, stage 1 layers 2-3 (local names 0-1), the final norm and the head; only the
    last stage has a loss. Put together by layer offset, every gradient equals TP 1's (~1e-6)."""
    import re

    _, _, one = step("tp1-fp32")
    out = str(tmp_path_factory.mktemp("pp2-fp32"))
    peer.run(out, tp=1, pp=2, dtype="fp32", model_dir=hf_dir)
    stages = truth.load_ranks(out)
    assert [r["meta"]["pp_rank"] for r in stages] == [0, 1]
    assert stages[0]["meta"]["loss_sum"] is None
    assert stages[1]["meta"]["loss_sum"] == pytest.approx(one[0]["meta"]["loss_sum"], rel=1e-6)
    per_stage = one[0]["meta"]["params"]
    seen = set()
    for r in stages:
        offset = r["meta"]["pp_rank"] * 2
        for n, g in r["grads_post"].items():
            glob = re.sub(r"decoder\.layers\.(\d+)\.", lambda m, offset=offset: f"decoder.layers.{int(m.group(1)) + offset}.", n)
            assert truth.rel_l2(g, one[0]["grads_post"][glob]) < 1e-5, (n, glob)
            seen.add(glob)
    assert seen == set(per_stage)
