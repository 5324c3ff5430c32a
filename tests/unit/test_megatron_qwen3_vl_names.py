"""Qwen3-VL mcore names -> HF names, checked against ms-swift's own HF<->mcore converter.

ms-swift's Qwen3-VL mcore model needs TransformerEngine and CUDA to build, so the parameter names
are taken from its converter instead (ms-swift 3.12.6, ``swift/megatron/model/gpt_bridge.py``:
``MultimodalGPTBridge`` prefixes, ``_set_layer_attn``, ``_set_attn_state``, ``_set_layer_mlp``,
``_convert_pre_process``, ``_convert_post_process``; ``mm_gpt/qwen3_vl.py``: ``Qwen3VL_Vit.module_mapping
= {'model.visual': 'visual'}``, the ViT held as ``visual.visual`` of the mcore model). The table below
is that converter's pairing, (mcore name under ``language_model.``, HF name), for one dense layer.
"""

from oracle import recipe as recipes
from oracle.integrations.megatron.names import NameMap

# (mcore, HF) as ms-swift 3.12.6's converter pairs them; {i} is the layer, q/k/v and gate/up fused in mcore
MS_SWIFT_PAIRS = [
    ("language_model.embedding.word_embeddings.weight", ["model.language_model.embed_tokens.weight"]),
    ("language_model.decoder.final_layernorm.weight", ["model.language_model.norm.weight"]),
    ("language_model.output_layer.weight", ["lm_head.weight"]),  # untie_embeddings_and_output_weights
    ("language_model.decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight",
     ["model.language_model.layers.{i}.input_layernorm.weight"]),
    ("language_model.decoder.layers.{i}.self_attention.linear_qkv.weight",
     [f"model.language_model.layers.{{i}}.self_attn.{x}_proj.weight" for x in "qkv"]),
    ("language_model.decoder.layers.{i}.self_attention.linear_proj.weight", ["model.language_model.layers.{i}.self_attn.o_proj.weight"]),
    ("language_model.decoder.layers.{i}.self_attention.q_layernorm.weight", ["model.language_model.layers.{i}.self_attn.q_norm.weight"]),
    ("language_model.decoder.layers.{i}.self_attention.k_layernorm.weight", ["model.language_model.layers.{i}.self_attn.k_norm.weight"]),
    ("language_model.decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight",
     ["model.language_model.layers.{i}.post_attention_layernorm.weight"]),
    ("language_model.decoder.layers.{i}.mlp.linear_fc1.weight",
     ["model.language_model.layers.{i}.mlp.gate_proj.weight", "model.language_model.layers.{i}.mlp.up_proj.weight"]),
    ("language_model.decoder.layers.{i}.mlp.linear_fc2.weight", ["model.language_model.layers.{i}.mlp.down_proj.weight"]),
]  # fmt: skip


def test_the_name_map_agrees_with_ms_swifts_converter_and_covers_every_hf_parameter():
    rec = recipes.get("qwen3-vl")
    config = rec.load("tiny-qwen3-vl").config
    hf_names = {n for n, _ in rec.build(config).named_parameters()}
    m = NameMap(rec.megatron_names)
    covered = set()
    for layer in range(config["text_config"]["num_hidden_layers"]):
        for mc, hf in MS_SWIFT_PAIRS:
            want = [h.replace("{i}", str(layer)) for h in hf]
            got = m.to_hf("module.module." + mc.replace("{i}", str(layer)))  # DDP + Float16Module prefixes
            assert got == want, (mc, got)
            covered |= set(got)
    vision = sorted(n for n in hf_names if n.startswith("model.visual."))
    for n in vision:  # the ViT kept whole: mcore visual.visual.<x> is HF model.visual.<x>
        assert m.to_hf("module.module.visual.visual." + n.removeprefix("model.visual.")) == [n]
        covered.add(n)
    assert any(".deepstack_merger_list." in n for n in vision) and any(".merger." in n for n in vision)
    assert covered == hf_names, sorted(hf_names ^ covered)[:5]
