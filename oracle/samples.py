"""Reading one sample from an ms-swift style ``.jsonl`` (one JSON object per line).

The format is the trainer's, not a model's: ``{"messages": [{"role", "content"}...], "images": [...]}``
with ``<image>`` tags in the content. Recipes turn the sample into tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import InputNotFound, RecipeError


def read_sample(path: str, index: int = 0) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise InputNotFound(f"sample file {p} does not exist")
    lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
    if not 0 <= index < len(lines):
        raise RecipeError(f"{p} has {len(lines)} samples; --index {index} is out of range")
    try:
        sample = json.loads(lines[index])
    except json.JSONDecodeError as e:
        raise RecipeError(f"{p} line {index + 1} is not valid JSON ({e})") from e
    if not isinstance(sample, dict) or not isinstance(sample.get("messages"), list):
        raise RecipeError(f"{p} line {index + 1}: expected an object with a 'messages' list (ms-swift format)")
    sample["_base"] = str(p.parent)
    return sample
