"""The user's PACKED batch, collated by ms-swift 3.12.1's own Qwen3-VL template (test code).

Three conversations of different lengths, images in the first and the third, encoded by
``get_template('qwen3_vl', processor, padding_free=True)`` and collated by its own
``data_collator(batch, padding_to=TP)`` in Megatron mode, as ``MegatronSft`` builds its collator
(``get_padding_to``: TP under sequence parallel). That is ms-swift's ``packing_row`` (per-sample
mRoPE rows from transformers' ``get_rope_index``, concatenated) and its padding: the pad tokens
get text position 0, so each is a 1-token sample in ``cu_seqlens`` (a "pad singleton"), while
``num_samples`` counts the 3 real ones. Lengths: 55 + 39 + 81 = 175 real tokens (4 and 6 image
tokens), 1 pad at TP 2. The template's ``image_token_id`` is Qwen's 151655, a constant of the class;
it is set to the tiny vocabulary's ``<|image_pad|>`` on the instance (tests/swift/tiny.py).
"""

from __future__ import annotations

import contextlib
import io

LENGTHS = (55, 39, 81)  # each sample's token count as the template encodes it (asserted)


def _rows():
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(7)

    def img(h, w):
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))

    return [
        {"messages": [{"role": "user", "content": "<image>What is this?"},
                      {"role": "assistant", "content": "A noisy square."}], "images": [img(64, 64)]},
        {"messages": [{"role": "user", "content": "Say hi twice."}, {"role": "assistant", "content": "hi hi"}]},
        {"messages": [{"role": "user", "content": "Describe <image> briefly please"},
                      {"role": "assistant", "content": "Random pixels in a wide box."}], "images": [img(32, 64)]},
    ]  # fmt: skip


# the user's step split into micro-batches (SWIFT_STEP_MICROBATCHES=M; gradient accumulation): each a packed row
SPLITS = {1: ((0, 1, 2),), 2: ((0, 1), (2,)), 3: ((0,), (1,), (2,))}


def microbatches(model_dir: str, padding_to: int = 2) -> list[dict]:
    """The step's micro-batches: ``SWIFT_STEP_MICROBATCHES`` (default 1, the whole packed batch; 2: samples
    0 and 1, then 2; 3: one sample each, the second text only; more: the three in turn, one per micro-batch),
    each collated as ``batch`` does."""
    import os

    m = int(os.environ.get("SWIFT_STEP_MICROBATCHES", "1"))
    splits = SPLITS.get(m) or [(i % len(LENGTHS),) for i in range(m)]  # M > 3: the samples in turn, one each
    return [batch(model_dir, padding_to, rows) for rows in splits]


def batch(model_dir: str, padding_to: int = 2, rows: tuple[int, ...] = (0, 1, 2)) -> dict:
    """ms-swift's collated packed batch for ``get_batch`` (labels not yet rolled): ``input_ids``,
    ``labels`` (1, T), ``position_ids`` (3, 1, T) mRoPE, ``text_position_ids`` (1, T), the HF
    ``cu_seq_lens_*`` / ``max_length_*`` the template adds (ms-swift's Megatron model ignores them),
    ``pixel_values``, ``image_grid_thw`` (2, 3), ``num_samples`` 3; ``rows``: those samples only."""
    with contextlib.redirect_stdout(io.StringIO()):
        import tiny
        from swift.llm import get_model_tokenizer, get_template

        _, processor = get_model_tokenizer(model_dir, load_model=False, model_type="qwen3_vl")
        template = get_template("qwen3_vl", processor, padding_free=True)
        template.set_mode("train")
        template.use_megatron = True  # as MegatronArguments' template is built
        template.image_token_id = tiny.SPECIAL_IDS["<|image_pad|>"]  # the tiny vocabulary's (Qwen's is 151655)
        template.video_token_id = tiny.SPECIAL_IDS["<|video_pad|>"]
        encoded = [template.encode(r, return_length=True) for i, r in enumerate(_rows()) if i in rows]
        assert tuple(e["length"] for e in encoded) == tuple(LENGTHS[i] for i in rows), [e["length"] for e in encoded]
        res = template.data_collator(encoded, padding_to=padding_to)
    images = sum(1 for i in rows if i != 1)  # the first and the third sample hold an image
    assert res["num_samples"] == len(rows) and (res["image_grid_thw"].shape[0] if images else 0) == images
    return res
