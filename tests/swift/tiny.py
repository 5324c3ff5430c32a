"""A tiny Qwen3-VL (random weights, fixed seed) as a local Hugging Face directory, and one sample.

The real architecture at toy sizes, built from transformers' own ``Qwen3VLConfig``: 4 decoder
layers (hidden 64, 4 query / 2 KV heads, head_dim 16, q/k RMSNorm, interleaved mRoPE with
``mrope_section`` [2, 3, 3] = head_dim / 2), a 3-block ViT with two deepstack mergers
(``deepstack_visual_indexes`` [0, 1]). The directory holds what ms-swift's loader reads: config,
safetensors, a byte-level tokenizer with Qwen's special tokens, and the image/video processors.
"""

from __future__ import annotations

import json
import os

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]  # fmt: skip
SPECIAL_IDS = {tok: 256 + i for i, tok in enumerate(SPECIALS)}
VOCAB = 272  # 263 real tokens, rounded up to a multiple of 16 (ms-swift keeps it: no padding)
SEED = 1234

TEXT = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1024, "tie_word_embeddings": False, "rope_theta": 5000000.0,
    "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
    "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
}  # fmt: skip
VISION = {
    "depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 16,
    "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64, "in_channels": 3,
    "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1], "hidden_act": "gelu_pytorch_tanh",
}  # fmt: skip
IMAGE = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 32 * 32, "max_pixels": 64 * 96,
         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}  # fmt: skip


def hf_config():
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(TEXT), vision_config=dict(VISION), tie_word_embeddings=False,
        image_token_id=SPECIAL_IDS["<|image_pad|>"], video_token_id=SPECIAL_IDS["<|video_pad|>"],
        vision_start_token_id=SPECIAL_IDS["<|vision_start|>"], vision_end_token_id=SPECIAL_IDS["<|vision_end|>"],
        architectures=["Qwen3VLForConditionalGeneration"], torch_dtype="bfloat16",
    )  # fmt: skip


def tokenizer():
    """A byte-level BPE tokenizer with no merges (every byte one token), plus Qwen's specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return Qwen2TokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                              unk_token=None, bos_token=None)


def hf_weights(seed: int = SEED):
    """Seeded random weights by transformers' own initialisation, rounded to bfloat16 and held in
    float32 (as a bf16 checkpoint is), so fp32 and bf16 steps start from the same values."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(hf_config())
    return {n: p.detach().to(torch.bfloat16).to(torch.float32).contiguous() for n, p in model.state_dict().items()}


def write_model_dir(d: str) -> str:
    """Config, safetensors, tokenizer and processors of the tiny model in ``d`` (idempotent)."""
    from safetensors.torch import save_file
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    if os.path.exists(os.path.join(d, "oracle_tiny.json")):
        return d
    os.makedirs(d, exist_ok=True)
    hf_config().save_pretrained(d)
    save_file(hf_weights(), os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    chat = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    proc = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**IMAGE), tokenizer=tokenizer(),
                            video_processor=Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2),
                            chat_template=chat)  # fmt: skip
    proc.save_pretrained(d)
    with open(os.path.join(d, "oracle_tiny.json"), "w") as f:
        json.dump({"seed": SEED}, f)
    return d


def sample(seq_multiple: int = 2):
    """One unpacked sample as ms-swift's data collator hands it to ``get_batch``: labels NOT yet
    rolled (``get_batch`` rolls them by -1), -100 outside the assistant turn; ``position_ids`` the
    3 mRoPE rows (1 sample); a 4-D boolean causal mask (True = masked, megatron-core's local
    attention cannot take packed THD batches). Length padded to a multiple of ``seq_multiple``
    (sequence parallel splits the sequence across TP ranks)."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import Qwen3VLForConditionalGeneration  # noqa: F401
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    rng = np.random.default_rng(7)
    img = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    media = Qwen2VLImageProcessor(**IMAGE)(images=[img], return_tensors="pt")
    grid = media["image_grid_thw"]  # (1, 3): t, h, w in patches
    n_img = int(grid.prod()) // 4  # merged tokens
    tok = tokenizer()
    sid = SPECIAL_IDS
    answer = tok("A small noisy square.", add_special_tokens=False)["input_ids"] + [sid["<|im_end|>"]]
    head = [sid["<|im_start|>"]] + tok("user\n", add_special_tokens=False)["input_ids"]
    tail = (tok("What is in the picture?", add_special_tokens=False)["input_ids"] + [sid["<|im_end|>"], 10]
            + [sid["<|im_start|>"]] + tok("assistant\n", add_special_tokens=False)["input_ids"])  # fmt: skip
    filler = tok("Look at this image carefully, please. " * 3, add_special_tokens=False)["input_ids"]
    # the image's tokens straddle the middle of the row, so that under sequence parallel at TP 2
    # each rank holds part of them (its deepstack features are sliced per rank)
    for k in range(len(filler) + 1):
        prompt = head + filler[:k] + [sid["<|vision_start|>"]] + [sid["<|image_pad|>"]] * n_img + [sid["<|vision_end|>"]] + tail
        t = len(prompt) + len(answer)
        t += -t % 2
        first = len(head) + k + 1
        if first < t // 2 < first + n_img:
            break
    else:
        raise AssertionError("no filler length puts the image across the middle of the row")
    ids = prompt + answer
    labels = [-100] * len(prompt) + answer
    while len(ids) % seq_multiple:
        ids.append(sid["<|endoftext|>"])
        labels.append(-100)
    input_ids = torch.tensor([ids])
    position_ids = mrope_positions(input_ids, grid)
    t = input_ids.shape[1]
    return {
        "input_ids": input_ids,
        "labels": torch.tensor([labels]),
        "position_ids": position_ids,  # (3, 1, T)
        "attention_mask": torch.ones(t, t, dtype=torch.bool).triu(1)[None, None],  # (1, 1, T, T)
        "pixel_values": media["pixel_values"],
        "image_grid_thw": grid,
        "num_samples": 1,
    }


def mrope_positions(input_ids, grid):
    """transformers' own Qwen3-VL rope index (3, 1, T), computed on a meta-free tiny model."""
    import torch
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    with torch.device("meta"):
        m = Qwen3VLModel(hf_config())
    pos, _ = Qwen3VLModel.get_rope_index(m, input_ids, grid, None, torch.ones_like(input_ids))
    return pos
