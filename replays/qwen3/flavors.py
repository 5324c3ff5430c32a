"""Embedded Qwen3 (text) flavors: tiny configurations of the real architecture for CPU runs and tests.

``tiny-qwen3``: 4 decoder layers (GQA 4 query / 2 KV heads, q/k RMSNorm, SwiGLU), byte-level
vocabulary (``replays.tiny``), untied head. About 0.2 M parameters; weights from
``replays.tiny.tiny_weights`` (seeded, rounded to bfloat16).
"""

from __future__ import annotations

from typing import Any

from ..tiny import VOCAB

TINY: dict[str, Any] = {
    "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 1024, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}  # fmt: skip

FLAVORS = {"tiny-qwen3": TINY}
