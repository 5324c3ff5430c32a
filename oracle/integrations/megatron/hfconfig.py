"""The Hugging Face config of a Megatron run, written from what the hook recorded.

The hook keeps the TransformerConfig fields and the model's attributes (hook.py). For a Qwen3
decoder (the ``qwen3`` recipe; the ``text_config`` of ``qwen3-vl``) they map one to one:

| HF field                | from the run                                                    |
|-------------------------|-----------------------------------------------------------------|
| vocab_size              | the model's (padded) vocabulary: the replay runs with Vp rows   |
| hidden_size             | hidden_size                                                     |
| intermediate_size       | ffn_hidden_size                                                 |
| num_hidden_layers       | num_layers (all pipeline stages)                                |
| num_attention_heads     | num_attention_heads                                             |
| num_key_value_heads     | num_query_groups (else the heads)                               |
| head_dim                | kv_channels (else hidden_size / heads)                          |
| rms_norm_eps            | layernorm_epsilon                                               |
| rope_theta              | rotary_base                                                     |
| tie_word_embeddings     | share_embeddings_and_output_weights                             |
| attention_bias          | add_qkv_bias                                                    |

and the run must have the choices a Qwen3 decoder makes (SwiGLU, RMSNorm, q/k layernorm, full
rotary, no linear biases), else the recipe cannot replay it. A user's ``--hf-config`` overrides
fields the run does not record (the vision tower, max_position_embeddings) and is checked against
those it does: a disagreement is an error naming the field. Its ``vocab_size`` may be the true
vocabulary: V <= Vp is taken as the tokenizer's size, the padded rows stay.
"""

from __future__ import annotations

import math
from typing import Any

from ...errors import RecipeError, UsageError

_FIXED = {  # run field: (value a Qwen3 decoder needs, what it is)
    "gated_linear_unit": (True, "SwiGLU MLP"),
    "activation": ("silu", "SiLU activation"),
    "normalization": ("RMSNorm", "RMSNorm"),
    "qk_layernorm": (True, "q/k layernorm"),
    "rotary_percent": (1.0, "rotary on the whole head"),
    "add_bias_linear": (False, "no linear biases"),
    "position_embedding_type": ("rope", "rotary positions"),
}


def text_fields(run: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3 text config fields the run determines (only those it recorded)."""
    np_ = run.get("num_attention_heads")
    pairs = {
        "vocab_size": run.get("vocab_size"),
        "hidden_size": run.get("hidden_size"),
        "intermediate_size": run.get("ffn_hidden_size"),
        "num_hidden_layers": run.get("num_layers"),
        "num_attention_heads": np_,
        "num_key_value_heads": run.get("num_query_groups") or np_,
        "head_dim": run.get("kv_channels") or (run["hidden_size"] // np_ if np_ and run.get("hidden_size") else None),
        "rms_norm_eps": run.get("layernorm_epsilon"),
        "rope_theta": run.get("rotary_base"),
        "tie_word_embeddings": run.get("share_embeddings_and_output_weights"),
        "attention_bias": run.get("add_qkv_bias"),
    }
    return {k: v for k, v in pairs.items() if v is not None}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and not isinstance(b, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9)
    return a == b


def _rope_section(cfg: dict[str, Any]) -> list[int] | None:
    t = cfg.get("text_config") or cfg
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    return rope.get("mrope_section") if isinstance(rope, dict) else None


def hf_config(run: dict[str, Any], recipe: str, given: dict[str, Any] | None,
              recorded: dict[str, Any] | None = None, mrope_section: list[int] | None = None) -> tuple[dict[str, Any], int | None]:  # fmt: skip
    """-> (the replay's HF config, the true vocabulary if known). ``run`` is the hook's ``config``;
    ``recorded`` the HF config the run's model held (the hook's ``hf_config``), the base of a nested
    (vision-language) recipe's config when ``given`` is None, checked against the TransformerConfig's
    ``mrope_section``."""
    nested = recipe != "qwen3"
    for field, (want, what) in _FIXED.items():
        if field == "position_embedding_type" and nested and run.get(field) == "mrope":
            continue  # Qwen3-VL's multimodal rotary: the 3-row positions are recorded and replayed
        if field in run and run[field] is not None and not _same(run[field], want):
            raise RecipeError(f"the run has {field} = {run[field]!r}, but a Qwen3 decoder has {what} ({field} = {want!r}); "
                              f"the {recipe} recipe cannot replay it")  # fmt: skip
    derived = text_fields(run)
    true_vocab = run.get("true_vocab_size")
    if given is None and nested and recorded:
        given = recorded
        section = mrope_section
        if section is not None and _rope_section(given) is not None and list(section) != list(_rope_section(given)):
            raise UsageError(f"the run's TransformerConfig has mrope_section {section} but its model's HF config "
                             f"{_rope_section(given)}; the recorded configs disagree")  # fmt: skip
    if given is None:
        if nested:
            raise UsageError(f"the {recipe} recipe needs --hf-config: the run recorded no Hugging Face config of its model "
                             "(the model holds none), only the language model")  # fmt: skip
        if len(derived) < 8:
            raise UsageError(
                "the rank captures do not record the model's config (msprobe imports, older hooks); pass --hf-config"
            )
        cfg = {"model_type": "qwen3", "hidden_act": "silu", **derived}
        cfg["max_position_embeddings"] = max(int(run.get("max_sequence_length") or 0), int(run.get("seq_length") or 0), 1)
        return cfg, true_vocab
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in given.items()}
    text = cfg.setdefault("text_config", {}) if nested else cfg
    for field, value in derived.items():
        if field not in text:
            text[field] = value
            continue
        if field == "vocab_size" and isinstance(text[field], int) and text[field] < value:
            if true_vocab is not None and true_vocab != text[field]:
                raise UsageError(f"--hf-config vocab_size = {text[field]} but the run recorded a true vocabulary of {true_vocab}")
            true_vocab = text[field]  # the tokenizer's size; the replay keeps the padded rows
            text[field] = value
            continue
        if not _same(text[field], value):
            raise UsageError(f"--hf-config {'text_config.' if nested else ''}{field} = {text[field]!r} but the run has {value!r}; "
                             "the config is not this run's (drop the field to take the run's)")  # fmt: skip
    if nested and "vocab_size" in cfg and "vocab_size" in text:
        cfg["vocab_size"] = text["vocab_size"]
    return cfg, true_vocab


def with_padded_vocab(cfg: dict[str, Any], recipe: str, padded: int | None) -> tuple[dict[str, Any], int | None]:
    """The config with the merged tensors' padded vocabulary; a smaller given one is the true vocabulary."""
    text = cfg.get("text_config", cfg) if recipe != "qwen3" else cfg
    v = text.get("vocab_size")
    if padded is None or v == padded:
        return cfg, None
    if v is not None and v > padded:
        raise UsageError(f"--hf-config vocab_size = {v} but the run's vocabulary tensors hold {padded} rows")
    text["vocab_size"] = padded
    if text is not cfg and "vocab_size" in cfg:
        cfg["vocab_size"] = padded
    return cfg, v
