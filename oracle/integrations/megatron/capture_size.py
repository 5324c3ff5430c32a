"""What ``ORACLE_CAPTURE`` writes per rank for a Qwen3-VL step under ms-swift's Megatron layout,
computed from the model's Hugging Face config and the parallel layout (no torch, no model built):
``oracle doctor DIR --hf-config config.json --tp 8 --tokens 65536`` prints it.

Per rank, per bundle (``pre`` and ``post`` each hold all of it):

    weights  = params(rank) * param bytes             (bf16: 2; what the model chunk holds)
    grads    = params(rank) * grad bytes              (Megatron's main_grad: fp32, 4, under bf16)
    inputs   = T * (8 + 8 + 3 * 8) + images * 24      tokens, labels, the 3 mRoPE position rows, grid (int64)
             + patches * C * t_p * p^2 * act bytes    pixel values, patches = images * (side / p)^2
             + T^2 unless packed                      a padded step's [1, 1, T, T] bool attention mask
    layers   = L/PP * (4 * T_r * h * act bytes        in, out, grad_out, grad_in of each decoder layer
                       + T * d * 4                    its rotary angles (fp32), T_r = T / TP under SP
                       + T^2 unless packed)           and the mask it received

params(rank): the decoder's q/k/v/o and MLP weights, the embedding and the output layer split over
TP (column/row/vocabulary parallel); its norms and the whole vision tower (transformers' module,
replicated on every TP rank in ms-swift) held whole; the decoder layers split over PP, the vision
tower and embedding on the first stage, the output layer on the last. ms-swift's Megatron runs
pack (padding_free, THD): no [T, T] mask is passed, none recorded; ``packed=False`` counts it (at
65536 tokens 4 GiB per layer). Two bundles (``pre`` and ``post``) per rank. Checked byte for byte
against ms-swift's own tiny Qwen3-VL step captured at TP 2 + SP (tests/swift/test_doctor.py).
"""

from __future__ import annotations

from typing import Any

GiB = 2**30
# transformers' Qwen3VLTextConfig / Qwen3VLVisionConfig defaults, for keys a config.json leaves out
TEXT_DEFAULTS = {"hidden_size": 4096, "intermediate_size": 22016, "num_attention_heads": 32, "num_key_value_heads": 32,
                 "num_hidden_layers": 32, "vocab_size": 151936, "head_dim": 128, "attention_bias": False}  # fmt: skip
VISION_DEFAULTS = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "out_hidden_size": 3584, "patch_size": 16,
                   "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3, "num_position_embeddings": 2304,
                   "deepstack_visual_indexes": [8, 16, 24], "num_heads": 16}  # fmt: skip


def text_params(t: dict[str, Any], tie: bool) -> dict[str, int]:
    """Parameters of the Qwen3 decoder by how TP splits them: ``split`` (over TP), ``whole``."""
    h, i, d = t["hidden_size"], t["intermediate_size"], t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    nq, nkv, v = t["num_attention_heads"], t["num_key_value_heads"], t["vocab_size"]
    layer_split = h * nq * d + 2 * h * nkv * d + nq * d * h + 3 * h * i  # q, k, v, o; gate, up, down
    if t.get("attention_bias"):
        layer_split += nq * d + 2 * nkv * d
    layer_whole = 2 * h + 2 * d  # input / post-attention RMSNorm, q_norm, k_norm
    return {"layer_split": layer_split, "layer_whole": layer_whole, "embedding": v * h, "head": 0 if tie else v * h, "final_norm": h}


def vision_params(vc: dict[str, Any]) -> int:
    """Qwen3-VL's vision tower: patch embedding (Conv3d with bias), learned position embedding,
    ``depth`` blocks (LayerNorms, qkv and proj with biases, a GELU MLP), the merger and one
    deepstack merger per ``deepstack_visual_indexes`` entry (their LayerNorm after the 2x2 shuffle)."""
    hv, iv, out = vc["hidden_size"], vc["intermediate_size"], vc["out_hidden_size"]
    m2 = vc["spatial_merge_size"] ** 2
    patch = vc["in_channels"] * vc["temporal_patch_size"] * vc["patch_size"] ** 2 * hv + hv
    pos = vc.get("num_position_embeddings", 0) * hv
    block = 4 * hv + (3 * hv * hv + 3 * hv) + (hv * hv + hv) + (hv * iv + iv) + (iv * hv + hv)
    fc = (hv * m2) * (hv * m2) + hv * m2 + (hv * m2) * out + out
    merger = 2 * hv + fc
    deepstack = len(vc.get("deepstack_visual_indexes") or []) * (2 * hv * m2 + fc)
    return patch + pos + vc["depth"] * block + merger + deepstack


def per_rank(config: dict[str, Any], *, tp: int, pp: int = 1, tokens: int, sequence_parallel: bool = True,
             images: int = 4, image_side: int = 448, param_bytes: int = 2, grad_bytes: int = 4,
             act_bytes: int = 2, packed: bool = True) -> dict[str, Any]:  # fmt: skip
    """Bytes one rank writes into each of its two bundles (the largest rank: PP stage 0, which holds
    the vision tower; with PP 1 every rank), by group, and with ``ORACLE_CAPTURE_MODULES=layers``."""
    t = {**TEXT_DEFAULTS, **config.get("text_config", config)}
    vc = {**VISION_DEFAULTS, **config["vision_config"]} if "vision_config" in config else None
    tie = bool(config.get("tie_word_embeddings", t.get("tie_word_embeddings", False)))
    tx = text_params(t, tie)
    layers = -(-t["num_hidden_layers"] // pp)
    split = layers * tx["layer_split"] + tx["embedding"] + (tx["head"] if pp == 1 else 0)
    whole = layers * tx["layer_whole"] + (tx["final_norm"] if pp == 1 else 0) + (vision_params(vc) if vc else 0)
    params = -(-split // tp) + whole
    d = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    patches = images * (image_side // vc["patch_size"]) ** 2 if vc else 0
    pixel = (vc["in_channels"] * vc["temporal_patch_size"] * vc["patch_size"] ** 2) if vc else 0
    mask = 0 if packed else tokens * tokens
    inputs = tokens * (8 + 8 + 3 * 8) + (images * 24 if vc else 0) + patches * pixel * act_bytes + mask
    rows = -(-tokens // tp) if sequence_parallel else tokens
    boundary = layers * (4 * rows * t["hidden_size"] * act_bytes + tokens * d * 4 + mask)
    # ``vit``: every rank records every vision block whole (hidden states in, out, grad_output, grad_input over the
    # patches; the rotary cos and sin of one head; cu_seqlens, int32, one per image and one more)
    hv = vc["hidden_size"] if vc else 0
    vit = vc["depth"] * (4 * patches * hv * act_bytes + 2 * patches * (hv // vc["num_heads"]) * act_bytes
                         + (images + 1) * 4) if vc and patches else 0  # fmt: skip
    base = params * (param_bytes + grad_bytes) + inputs
    return {"params": params, "weights": params * param_bytes, "grads": params * grad_bytes, "inputs": inputs,
            "layers_boundaries": boundary, "vit_boundaries": vit, "bundle": base, "bundle_with_layers": base + boundary,
            "rank": 2 * base, "rank_with_layers": 2 * (base + boundary), "rank_with_layers_vit": 2 * (base + boundary + vit),
            "decoder_layers": layers, "vision_blocks": vc["depth"] if vc else 0, "patches": patches, "rows": rows}  # fmt: skip


def render(s: dict[str, Any], *, tp: int, pp: int, tokens: int, sequence_parallel: bool, images: int, image_side: int) -> str:
    g = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
    sp = "SP" if sequence_parallel else "no SP"
    return "\n".join([
        f"  capture size per rank (TP {tp}, PP {pp}, {sp}, {tokens} tokens packed, {images} images of {image_side}x{image_side}):",
        f"    weights {g(s['weights'])} (bf16) + grads {g(s['grads'])} (fp32 main_grad) + inputs {g(s['inputs'])} "
        f"= {g(s['bundle'])} per bundle; pre + post: {g(s['rank'])}",
        f"    with ORACLE_CAPTURE_MODULES=layers: + {g(s['layers_boundaries'])} per bundle ({s['decoder_layers']} decoder "
        f"layers x 4 x {s['rows']} rows); pre + post: {g(s['rank_with_layers'])}",
        *([f"    with ORACLE_CAPTURE_MODULES=layers,vit: + {g(s['vit_boundaries'])} more per bundle ({s['vision_blocks']} vision "
           f"blocks x 4 x {s['patches']} patches); pre + post: {g(s['rank_with_layers_vit'])}"] if s["vit_boundaries"] else []),
    ])  # fmt: skip
