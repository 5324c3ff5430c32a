"""Embedded Qwen3-VL flavors: tiny configurations of the real architecture for CPU runs and tests.

``tiny``: 4 decoder layers (GQA 4 query / 2 KV heads, q/k RMSNorm, interleaved mRoPE), a 3-block
ViT with two deepstack mergers, byte-level vocabulary. About 0.4 M parameters. Weights are drawn
with a fixed seed by transformers' own initialisation, then rounded to bfloat16 (as a real bf16
checkpoint is), so that fp32, bf16 and amp captures of the same step share exact weights.
"""

from __future__ import annotations

from typing import Any

import torch

# Token ids of the tiny byte-level tokenizer (256 byte tokens, then the specials below).
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SPECIAL_IDS = {tok: 256 + i for i, tok in enumerate(SPECIALS)}

TINY: dict[str, Any] = {
    "model_type": "qwen3_vl",
    "text_config": {
        "vocab_size": 272, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1024, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True},
    },
    "vision_config": {
        "depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64,
        "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1],
    },
    "image_token_id": SPECIAL_IDS["<|image_pad|>"], "video_token_id": SPECIAL_IDS["<|video_pad|>"],
    "vision_start_token_id": SPECIAL_IDS["<|vision_start|>"], "vision_end_token_id": SPECIAL_IDS["<|vision_end|>"],
    "tie_word_embeddings": False,
}  # fmt: skip

# Image processor settings of the tiny flavor: 16-pixel patches, 2x2 merge, at most 64x96 pixels.
TINY_IMAGE = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 32 * 32,
              "max_pixels": 64 * 96, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}  # fmt: skip

FLAVORS = {"tiny-qwen3-vl": TINY}


def tiny_weights(build, config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights of ``config``, rounded to bfloat16 and held in float32."""
    torch.manual_seed(seed)
    model = build(config)
    return {n: p.detach().to(torch.bfloat16).to(torch.float32) for n, p in model.named_parameters()}


def tiny_tokenizer():
    """A byte-level BPE tokenizer with no merges: every byte is one token, plus Qwen's specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}  # sorted: alphabet() is a set
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def tiny_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**TINY_IMAGE)
