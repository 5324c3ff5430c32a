"""Megatron layouts and names without running megatron-core."""

import torch

from oracle import recipe as recipes
from oracle.megatron.layout import Heads, merge_tensor, shard_of
from oracle.megatron.names import NameMap


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
    assert all(torch.equal(a, b) for a, b in zip(merge_tensor("qkv", shards, heads=heads, vocab=None), (q, k, v)))
    gate, up = torch.randn(f, h), torch.randn(f, h)
    shards = [shard_of("fc1", [gate, up], tp=tp, rank=r, heads=heads) for r in range(tp)]
    g2, u2 = merge_tensor("fc1", shards, heads=heads, vocab=None)
    assert torch.equal(g2, gate) and torch.equal(u2, up)
    wrong_gate = torch.cat(shards, 0).chunk(2, 0)[0]  # the classic mistake: cat then chunk
    assert not torch.equal(wrong_gate, gate)
    emb = torch.randn(vocab, h)  # 10 rows over TP 4: padded to 12, the padding unknown (NaN)
    shards = [shard_of("vocab", [emb], tp=tp, rank=r, heads=heads) for r in range(tp)]
    assert shards[-1].shape[0] == 3 and torch.isnan(shards[-1][-2:]).all()
    (merged,) = merge_tensor("vocab", shards, heads=heads, vocab=vocab)
    assert torch.equal(merged, emb)
