"""What the Megatron hook reads from the run (runinfo.py) and how merge uses it, on small
structures: no ms-swift needed (tests/peers/test_swift_fidelity.py runs the real thing)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionMLP

from oracle import recipe as recipes
from oracle.errors import BundleError
from oracle.integrations.megatron.hook import _vocab
from oracle.integrations.megatron.layout import kind_of
from oracle.integrations.megatron.merge import _labels
from oracle.integrations.megatron.names import NameMap
from oracle.integrations.megatron.packing import packed_inputs
from oracle.integrations.megatron.replicas import reduce_replicas
from oracle.integrations.megatron.runinfo import hf_config_of, label_convention, numerics_of, param_origins, rope_of, seq_lengths


def _tokens(seed=0, t=12):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (1, t), generator=g)


def test_pre_rolled_labels_are_detected_from_the_batch():
    """labels = roll(tokens, -1) with -100 on the prompt: pre-rolled, with the counts as evidence."""
    tok = _tokens()
    lab = torch.roll(tok, -1, 1)
    lab[0, :4], lab[0, -1] = -100, -100
    rec = label_convention({"input_ids": tok, "labels": lab})
    assert rec["labels_shift"] == "pre-rolled" and "7/7" in rec["how"]


def test_unshifted_labels_are_detected_and_a_loss_mask_with_them_is_refused():
    """HF-style labels (label t = token t) are unshifted; merge refuses them next to a loss_mask."""
    tok = _tokens(1)
    lab = tok.clone()
    lab[0, :4] = -100
    assert label_convention({"input_ids": tok, "labels": lab})["labels_shift"] == "unshifted"
    b = SimpleNamespace(manifest={"megatron": {"labels": {"labels_shift": "unshifted"}}}, path="r0")
    with pytest.raises(BundleError, match="inputs/loss_mask: the labels are unshifted"):
        _labels({(0, 0, 0): b}, {"labels": lab, "loss_mask": torch.ones(1, 12)}, None)


def test_an_undecidable_convention_is_recorded_as_ambiguous_and_merge_refuses_to_guess():
    """A repeated token satisfies both readings: 'ambiguous'; merge names the fix; a given shift wins."""
    tok = torch.full((1, 8), 7)
    lab = tok.clone()
    lab[0, :3] = -100
    rec = label_convention({"input_ids": tok, "labels": lab})
    assert rec["labels_shift"] == "ambiguous"
    b = SimpleNamespace(manifest={"megatron": {"labels": rec}}, path="r0")
    with pytest.raises(BundleError, match="pass --labels-shift pre-rolled"):
        _labels({(0, 0, 0): b}, {"input_ids": tok, "labels": lab}, None)
    inputs, out = _labels({(0, 0, 0): b}, {"input_ids": tok, "labels": lab}, "pre-rolled")
    assert out["labels_shift"] == "pre-rolled" and torch.equal(inputs["loss_mask"], (lab != -100).float())
    given = label_convention({"input_ids": tok, "labels": lab}, "pre-rolled")
    assert given["labels_shift"] == "pre-rolled" and given["detected"] == "ambiguous"


def test_replicated_transformers_modules_are_recognised_by_structure_not_by_name():
    """A transformers MLP named like Megatron's fc1 is a replica; a torch Linear named visual.* is not;
    a tensor-parallel marked parameter never is; merge then classifies them as replica / by layout."""
    cfg = Qwen3VLVisionConfig(hidden_size=8, intermediate_size=16)
    model = nn.Module()
    model.decoder = nn.Module()
    model.decoder.mlp = Qwen3VLVisionMLP(cfg)  # transformers' own class, Megatron-looking name
    model.visual = nn.Linear(4, 4)  # a torch module named like the vision tower
    model.sharded = nn.Linear(4, 4)
    model.sharded.weight.tensor_model_parallel = True
    wrapper = nn.Module()
    wrapper._hf_model = [None]  # ms-swift's HuggingFaceModule holds its transformers model so
    wrapper.inner = nn.Linear(2, 2)
    model.wrapped = wrapper
    o = param_origins(model)
    assert o["decoder.mlp.linear_fc1.weight"]["replica"] and "Qwen3VLVisionMLP" in o["decoder.mlp.linear_fc1.weight"]["hf_module"]
    assert not o["visual.weight"]["replica"] and not o["sharded.weight"]["replica"] and o["wrapped.inner.weight"]["replica"]
    assert kind_of("decoder.layers.0.mlp.linear_fc1.weight", {"replica": True, "gated": True}) == "replica"
    assert kind_of("decoder.layers.0.mlp.linear_fc1.weight", {"replica": False, "gated": True}) == "fc1"


def test_disagreeing_replicas_are_summed_and_named_agreeing_ones_kept():
    """Copies that differ are a finding and merged as their float64 sum; equal copies are rank 0's."""
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.0])
    kept, finding = reduce_replicas("m.w", "model.w", [a, b], "pre-finalize")
    assert torch.equal(kept, a + b) and finding["hf"] == "model.w" and finding["spread"] > 0.1
    kept, finding = reduce_replicas("m.w", "model.w", [a, a.clone()], "pre-finalize")
    assert kept is a and finding is None


def test_vocabulary_padding_is_only_what_the_run_did():
    """ms-swift (HF vocab = rows) pads nothing even with a smaller tokenizer; Megatron-LM's rule pads;
    a tokenizer size the rule does not turn into the rows makes no row padding."""
    hf = {"text_config": {"vocab_size": 272}}
    v = _vocab(272, hf, 263, None, 2)
    assert v["padding"] == "none" and v["true"] == 272 and v["tokenizer"] == 263
    v = _vocab(256, None, 200, 128, 2)
    assert v["padding"] == "megatron" and v["true"] == 200
    v = _vocab(272, None, 263, None, 2)
    assert v["padding"] == "none" and v["true"] == 272 and "every row is taken as a real token" in v["how"]


def test_numerics_settings_and_mindspeed_flags_are_recorded():
    """TransformerConfig fusions / recompute / attention backend and the training args' fused-op flags."""
    cfg = SimpleNamespace(mrope_section=[2, 3, 3], cross_entropy_loss_fusion=True, gradient_accumulation_fusion=True,
                          recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                          apply_rope_fusion=False, attention_backend=SimpleNamespace(name="flash"), params_dtype=torch.bfloat16)  # fmt: skip
    args = SimpleNamespace(use_fused_rmsnorm=True, use_fused_swiglu=True, use_flash_attn=True, lr=1e-5,
                           cross_entropy_fusion_impl="te", recompute_granularity="full")  # fmt: skip
    n = numerics_of(cfg, args)
    assert n["mrope_section"] == [2, 3, 3] and n["cross_entropy_loss_fusion"] and n["gradient_accumulation_fusion"]
    assert n["recompute_granularity"] == "full" and n["attention_backend"] == "flash" and n["params_dtype"] == "bfloat16"
    assert n["args"] == {"cross_entropy_fusion_impl": "te", "recompute_granularity": "full", "use_flash_attn": True,
                         "use_fused_rmsnorm": True, "use_fused_swiglu": True}  # fmt: skip


def test_the_kernels_sequence_lengths_show_sp_pad_singletons():
    """cu_seqlens with SP padding (each pad token its own sample) -> lengths and the 1-token count."""
    labels = torch.tensor([[5, 6, -100, 7, 8, 9, -100, -100]])
    s = seq_lengths(torch.tensor([0, 2, 3, 6, 7, 8], dtype=torch.int32), labels)
    assert s["lengths"] == [2, 1, 3, 1, 1] and s["one_token_samples"] == 3 and s["one_token_samples_without_loss"] == 3
    assert seq_lengths(None, labels, torch.zeros(2, 8)) == {"packed": False, "lengths": [8, 8], "one_token_samples": 0}


def test_mrope_positions_of_a_packed_batch_keep_their_three_rows_behind_a_text_row():
    """(3, 1, T) mRoPE rows with cu_seqlens -> (4, 1, T): the restarting text row, then the rows as recorded."""
    pos = torch.stack([torch.arange(6), torch.arange(6) + 10, torch.arange(6) + 20]).unsqueeze(1)  # (3, 1, 6)
    out, note = packed_inputs({"input_ids": torch.zeros(1, 6, dtype=torch.long), "position_ids": pos,
                               "cu_seqlens": torch.tensor([0, 4, 6], dtype=torch.int32)})  # fmt: skip
    assert out["position_ids"].shape == (4, 1, 6) and out["position_ids"][0, 0].tolist() == [0, 1, 2, 3, 0, 1]
    assert torch.equal(out["position_ids"][1:], pos) and "2 samples" in note


def test_both_norm_namings_map_to_the_hf_norms():
    """TE/MindSpeed fused names and megatron-core's local-spec names give the same HF parameter."""
    m = NameMap(recipes.get("qwen3-vl").megatron_names)
    p = "module.module.language_model.decoder.layers.3."
    assert m.to_hf(p + "self_attention.linear_qkv.layer_norm_weight") == m.to_hf(p + "input_layernorm.weight") == [
        "model.language_model.layers.3.input_layernorm.weight"]  # fmt: skip
    assert m.to_hf(p + "mlp.linear_fc1.layer_norm_weight") == m.to_hf(p + "pre_mlp_layernorm.weight") == [
        "model.language_model.layers.3.post_attention_layernorm.weight"]  # fmt: skip


def test_the_hf_config_is_read_from_the_models_own_wrapper():
    """ms-swift's HuggingFaceModule keeps ``model_config``: it is the recorded config."""
    from transformers import Qwen3VLConfig

    holder = nn.Module()
    holder.visual = nn.Module()
    holder.visual.model_config = Qwen3VLConfig(text_config={"vocab_size": 99})
    cfg = hf_config_of(holder)
    assert cfg["model_type"] == "qwen3_vl" and cfg["text_config"]["vocab_size"] == 99
    rope = rope_of({"text_config": {"rope_scaling": {"mrope_section": [2, 3, 3], "mrope_interleaved": True}}})
    assert rope == {"hf_mrope_section": [2, 3, 3], "hf_mrope_interleaved": True}
    assert hf_config_of(nn.Linear(2, 2)) is None
