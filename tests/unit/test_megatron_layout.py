"""Megatron layouts and names without running megatron-core."""

import pytest
import torch

from oracle import recipe as recipes
from oracle.errors import BundleError
from oracle.integrations.megatron.layout import Heads, merge_tensor, padded_vocab, partial_sum, shard_of
from oracle.integrations.megatron.names import NameMap
from oracle.integrations.msprobe import megatron_coords


def test_qwen3_vl_mcore_names_map_to_hf_language_and_vision_names():
    m = NameMap(recipes.get("qwen3-vl").megatron_names)
    pre = "module.module."
    assert m.to_hf(pre + "language_model.decoder.layers.7.self_attention.linear_qkv.weight") == [
        f"model.language_model.layers.7.self_attn.{x}_proj.weight" for x in "qkv"
    ]
    assert m.to_hf(pre + "language_model.decoder.layers.0.mlp.linear_fc1.weight") == [
        "model.language_model.layers.0.mlp.gate_proj.weight",
        "model.language_model.layers.0.mlp.up_proj.weight",
    ]
    assert m.to_hf(pre + "language_model.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") == [
        "model.language_model.layers.0.input_layernorm.weight"
    ]
    assert m.to_hf(pre + "language_model.embedding.word_embeddings.weight") == ["model.language_model.embed_tokens.weight"]
    assert m.to_hf(pre + "language_model.output_layer.weight") == ["lm_head.weight"]
    assert m.to_hf(pre + "visual.visual.deepstack_merger_list.1.linear_fc2.weight") == [
        "model.visual.deepstack_merger_list.1.linear_fc2.weight"
    ]


def test_every_layout_round_trips_through_shards():
    heads = Heads(np=8, ng=4, d=2)
    tp, h, f, vocab = 4, 6, 8, 10
    q, k, v = torch.randn(16, h), torch.randn(8, h), torch.randn(8, h)
    shards = [shard_of("qkv", [q, k, v], tp=tp, rank=r, heads=heads) for r in range(tp)]
    assert all(torch.equal(a, b) for a, b in zip(merge_tensor("qkv", shards, heads=heads), (q, k, v)))
    gate, up = torch.randn(f, h), torch.randn(f, h)
    shards = [shard_of("fc1", [gate, up], tp=tp, rank=r, heads=heads) for r in range(tp)]
    g2, u2 = merge_tensor("fc1", shards, heads=heads)
    assert torch.equal(g2, gate) and torch.equal(u2, up)
    wrong_gate = torch.cat(shards, 0).chunk(2, 0)[0]  # the classic mistake: cat then chunk
    assert not torch.equal(wrong_gate, gate)
    emb = torch.randn(vocab, h)  # 10 rows; a run at TP 4 padded them to 12: the two unknown rows are NaN
    shards = [shard_of("vocab", [emb], tp=tp, rank=r, heads=heads, vocab_rows=12) for r in range(tp)]
    assert shards[-1].shape[0] == 3 and torch.isnan(shards[-1][-2:]).all()
    (merged,) = merge_tensor("vocab", shards, heads=heads)  # every padded row is kept
    assert merged.shape[0] == 12 and torch.equal(merged[:vocab], emb)


def test_megatron_pads_the_vocabulary_to_a_multiple_of_128_x_tp():
    assert padded_vocab(151936, 8) == 152576 and padded_vocab(151936, 1) == 151936  # Qwen3-VL: 1187 x 128
    assert padded_vocab(200, 2) == 256 and padded_vocab(200, 4) == 512


def test_shapes_that_do_not_fit_are_errors_naming_the_fix():
    with pytest.raises(BundleError, match=r"do not split over TP 4"):
        Heads(np=8, ng=2, d=4).check(4)
    with pytest.raises(BundleError, match=r"does not hold 8 query heads and 4 query groups"):
        merge_tensor("qkv", [torch.randn(10, 3), torch.randn(10, 3)], heads=Heads(np=8, ng=4, d=2))
    with pytest.raises(BundleError, match=r"vocabulary of 10 rows does not split over TP 4"):
        shard_of("vocab", [torch.randn(10, 3)], tp=4, rank=3, heads=Heads(2, 2, 2))


def test_one_partial_sum_rule_for_mcore_and_hf_names():
    """Before finalize under TP: q/k layernorm by heads; sequence-parallel norms by tokens; vision norms complete."""
    assert partial_sum("decoder.layers.0.self_attention.q_layernorm.weight", tp=2) == "heads"
    assert partial_sum("model.layers.0.self_attn.k_norm.weight", tp=2) == "heads"
    assert partial_sum("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", tp=2, sp=True) == "tokens"
    assert partial_sum("decoder.final_layernorm.weight", tp=2, sp=False) is None
    assert partial_sum("decoder.final_layernorm.weight", tp=2, marked=True) == "tokens"  # the hook's recorded mark wins
    assert partial_sum("visual.blocks.0.norm1.weight", tp=2, sp=True) is None
    assert partial_sum("decoder.layers.0.self_attention.q_layernorm.weight", tp=1) is None


def test_msprobe_global_ranks_follow_megatrons_tp_dp_pp_order():
    assert megatron_coords(5, tp=2, dp=2, pp=2) == {"rank": 5, "tp_rank": 1, "tp_size": 2, "dp_rank": 0, "dp_size": 2,
                                                    "pp_rank": 1, "pp_size": 2, "cp_size": 1}  # fmt: skip
    with pytest.raises(BundleError, match="outside TP 2 x DP 1 x PP 1"):
        megatron_coords(3, tp=2)
