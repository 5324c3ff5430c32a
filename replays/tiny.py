"""What the embedded tiny flavors share (no download): a byte-level tokenizer (every byte one token,
ids 0..255, then Qwen's special tokens from 256) and seeded random weights rounded to bfloat16."""

from __future__ import annotations

from typing import Any

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SPECIAL_IDS = {tok: 256 + i for i, tok in enumerate(SPECIALS)}
VOCAB = 256 + len(SPECIALS) + 9  # 272: rounded up to a multiple of 16, as real vocabularies are padded


def tiny_tokenizer():
    """A byte-level BPE tokenizer with no merges, plus Qwen's specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}  # sorted: alphabet() is a set
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def tiny_weights(build, config: dict[str, Any], seed: int = 0):
    """Seeded random weights of ``config`` by transformers' own initialisation, rounded to bfloat16
    and held in float32 (as a real bf16 checkpoint is), so that fp32, bf16 and amp captures of the
    same step share exact weights."""
    import torch

    torch.manual_seed(seed)
    model = build(config)
    return {n: p.detach().to(torch.bfloat16).to(torch.float32) for n, p in model.named_parameters()}
