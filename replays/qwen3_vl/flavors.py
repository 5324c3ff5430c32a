"""Embedded Qwen3-VL flavors: tiny configurations of the real architecture for CPU runs and tests.

``tiny``: 4 decoder layers (GQA 4 query / 2 KV heads, q/k RMSNorm, interleaved mRoPE), a 3-block
ViT with two deepstack mergers, byte-level vocabulary. About 0.4 M parameters; weights from
``replays.tiny.tiny_weights`` (seeded, rounded to bfloat16).
"""

from __future__ import annotations

from typing import Any

from ..tiny import SPECIAL_IDS, SPECIALS, VOCAB, tiny_tokenizer, tiny_weights  # noqa: F401  (shared by the flavors)

TINY: dict[str, Any] = {
    "model_type": "qwen3_vl",
    "text_config": {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
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


def tiny_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**TINY_IMAGE)
