"""An ms-swift style sample -> the tensors a Qwen3-VL step uses.

Sample format (one JSON object, as one line of an ms-swift ``.jsonl``; content may also be a list
of OpenAI-style parts, see oracle/capture/samples.py, which is normalised to this form first)::

    {"messages": [{"role": "user", "content": "<image>Describe it."},
                  {"role": "assistant", "content": "..."}],
     "images": ["data:image/png;base64,...", "relative/or/absolute/path.png"]}

The text follows Qwen's chat format (``<|im_start|>role\\n ... <|im_end|>\\n``); each ``<image>``
becomes ``<|vision_start|>`` + one ``<|image_pad|>`` per merged patch + ``<|vision_end|>``. Labels
cover the assistant turns only (their content and closing ``<|im_end|>``), -100 elsewhere.
"""

from __future__ import annotations

import base64
import io
import warnings
from pathlib import Path
from typing import Any

import torch

from oracle.capture.packing import IGNORE
from oracle.capture.samples import normalize
from oracle.errors import InputNotFound, RecipeError

MAX_IMAGE_PIXELS = 2**26  # 67 M pixels (8192 x 8192): a decompression-bomb guard, checked before decoding


def _open_image(ref: str, base: str):
    """A sample's image as an RGB PIL image; only its header is read before the size is checked."""
    from PIL import Image

    if ref.startswith("data:"):
        name = "an inline image"
        try:
            src = io.BytesIO(base64.b64decode(ref.split(",", 1)[1]))
        except (IndexError, ValueError) as e:  # binascii.Error is a ValueError
            raise RecipeError(f"cannot decode an inline image ({e}); expected data:image/...;base64,...") from None
    else:
        p = Path(ref) if Path(ref).is_absolute() else Path(base) / ref
        if not p.is_file():
            raise InputNotFound(f"image {p} named by the sample does not exist")
        name, src = f"image {p}", p
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit is lower
            with Image.open(src) as img:  # reads the header only
                w, h = img.size
                if w * h > MAX_IMAGE_PIXELS:
                    raise Image.DecompressionBombError(f"{w} x {h} pixels")
                return img.convert("RGB")
    except Image.DecompressionBombError as e:
        raise RecipeError(
            f"{name} is too large to decode ({e}; the limit is {MAX_IMAGE_PIXELS} pixels, a guard against "
            "decompression bombs); downscale it"
        ) from None
    except PermissionError as e:
        raise InputNotFound(f"cannot read {name}: {e.strerror}") from None
    except (OSError, ValueError, SyntaxError) as e:  # UnidentifiedImageError is an OSError
        raise RecipeError(f"{name} is not an image PIL can decode ({e})") from None


def build_inputs(
    sample: dict[str, Any], tokenizer, image_processor, model, special_ids: dict[str, int]
) -> dict[str, torch.Tensor]:
    sample = normalize(sample)  # content lists -> strings with <image> tags; anything else refused
    images = [_open_image(r, sample.get("_base", ".")) for r in sample["images"]]
    try:
        pixel = image_processor(images=images, return_tensors="pt") if images else {}
    except ValueError as e:  # e.g. an image smaller than one merged patch, or an extreme aspect ratio
        raise RecipeError(f"the image processor refuses the sample's images ({e})") from None
    grid = pixel.get("image_grid_thw")
    merge = image_processor.merge_size**2

    def text_ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    ids: list[int] = []
    labels: list[int] = []
    img_i = 0
    for msg in sample["messages"]:
        role, content = msg["role"], msg["content"]
        piece = [special_ids["<|im_start|>"]] + text_ids(f"{role}\n")
        ids += piece
        labels += [IGNORE] * len(piece)
        body: list[int] = []
        for j, chunk in enumerate(content.split("<image>")):
            if j > 0:
                n = int(grid[img_i].prod()) // merge
                body += [special_ids["<|vision_start|>"]] + [special_ids["<|image_pad|>"]] * n + [special_ids["<|vision_end|>"]]
                img_i += 1
            body += text_ids(chunk)
        body += [special_ids["<|im_end|>"]]
        ids += body
        labels += body if role == "assistant" else [IGNORE] * len(body)
        ids += text_ids("\n")
        labels += [IGNORE] * len(text_ids("\n"))
    if all(x == IGNORE for x in labels):
        raise RecipeError("the sample has no assistant turn: there is no token to take a loss on")

    input_ids = torch.tensor([ids], dtype=torch.long)  # (1, T)
    out = {"input_ids": input_ids, "labels": torch.tensor([labels], dtype=torch.long)}
    mm_types = (input_ids == special_ids["<|image_pad|>"]).int()  # (1, T): 1 on image tokens
    if images:
        out["pixel_values"] = pixel["pixel_values"]  # (patches, C*tp*p*p)
        out["image_grid_thw"] = grid  # (n_images, 3)
        position_ids, _ = model.model.get_rope_index(input_ids, mm_token_type_ids=mm_types, image_grid_thw=grid)
    else:
        position_ids = torch.arange(input_ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
    out["position_ids"] = position_ids.contiguous()  # (3, 1, T): temporal, height, width
    return out
