"""The two pieces the H20 path's packed step adds on CPU: the TE THD attention stand-in
(tests/swift/te_thd.py) and ms-swift's own packing collation (tests/swift/packed.py).
Runs in ``.venv-swift`` only."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import needs_swift  # noqa: E402, F401  (skips this module outside .venv-swift)
import torch  # noqa: E402

CU = [0, 5, 7, 12, 13]  # 3 samples and a 1-token pad sample


def _attention(monkeypatch, heads=4, groups=2, hn=8):
    import te_thd
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.transformer_config import TransformerConfig

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * hn, num_attention_heads=heads, num_query_groups=groups)
    attn = te_thd.THDDotProductAttention(cfg, 1, None, "self")
    cu = torch.tensor(CU, dtype=torch.int32)
    return attn, PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)


def test_thd_attention_is_per_sample_causal_sdpa(monkeypatch):
    """Each sample's output is torch's causal SDPA of that sample alone (GQA heads repeated), in
    float64 to 1e-12: nothing of another sample is seen."""
    attn, psp = _attention(monkeypatch)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(13, 4, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(13, 2, 8, dtype=torch.float64, generator=g) for _ in range(2))
    out = attn(q, k, v, None, packed_seq_params=psp)  # (T, np * hn)
    assert out.shape == (13, 32)
    for s, e in zip(CU[:-1], CU[1:]):
        ks, vs = (t[s:e].repeat_interleave(2, dim=1).transpose(0, 1) for t in (k, v))
        want = torch.nn.functional.scaled_dot_product_attention(q[s:e].transpose(0, 1), ks, vs, is_causal=True)
        assert torch.allclose(out[s:e], want.transpose(0, 1).reshape(e - s, 32), rtol=0, atol=1e-12)


def test_thd_attention_gradient_stays_in_its_sample(monkeypatch):
    """The backward of one sample's output reaches only that sample's query, key and value rows (its
    first query sees one key only: softmax 1, no gradient)."""
    attn, psp = _attention(monkeypatch)
    q = torch.randn(13, 4, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(13, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    attn(q, k, v, None, packed_seq_params=psp)[7:12].sum().backward()  # the third sample
    for t, want in ((q, range(8, 12)), (k, range(7, 12)), (v, range(7, 12))):
        rows = t.grad.abs().flatten(1).sum(1) > 0
        assert rows.nonzero().flatten().tolist() == list(want)


def test_thd_attention_refuses_an_unpacked_call(monkeypatch):
    attn, _ = _attention(monkeypatch)
    x = torch.zeros(4, 1, 4, 8)
    with pytest.raises(NotImplementedError, match="packed"):
        attn(x, x[:, :, :2], x[:, :, :2], None)


def test_ms_swift_packs_three_samples_and_a_pad_singleton(tmp_path):
    """ms-swift's own collation: 55 + 39 + 81 tokens, the SP pad token at text position 0 (its own
    sample), 3 mRoPE rows restarting per sample, 2 images, num_samples 3 (the pad not counted)."""
    import packed
    import tiny

    b = packed.batch(tiny.write_model_dir(str(tmp_path / "hf")), padding_to=2)
    assert b["input_ids"].shape == (1, 176) and b["position_ids"].shape == (3, 1, 176)
    starts = (b["text_position_ids"][0] == 0).nonzero().flatten().tolist()
    assert starts == [0, 55, 94, 175] and b["num_samples"] == 3
    assert (b["labels"][0, 175] == -100) and b["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6]]
    assert int((b["input_ids"] == tiny.SPECIAL_IDS["<|image_pad|>"]).sum()) == 4 + 6
    assert all(int(b["position_ids"][:, 0, s].abs().sum()) == 0 for s in starts)
