"""Reading one sample from an ms-swift style ``.jsonl`` (one JSON object per line), checked once.

Two forms of a message's content are read, as ms-swift reads them:

* a string with ``<image>`` tags, the images listed in order in the sample's ``images``::

    {"messages": [{"role": "user", "content": "<image>Describe it."},
                  {"role": "assistant", "content": "..."}],
     "images": ["path.png"]}

* a list of parts, OpenAI style: ``{"type": "text", "text": ...}``, ``{"type": "image", "image": REF}``
  or ``{"type": "image_url", "image_url": {"url": REF}}`` (or ``"image_url": REF``); each image part
  stands where it is in the text.

:func:`normalize` turns either into the first form (content a string, images in ``images``), which
is what recipes read. Anything else (a part of another type, a message that is not an object, a
role other than system/user/assistant, images given both ways, tags and images that do not pair
up, text that is not UTF-8, duplicate keys) is a :class:`RecipeError` naming the line and the
field, never a silent misread such as tokenising the repr of a list.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..bundle.jsonio import no_duplicate_keys
from ..errors import InputNotFound, RecipeError

ROLES = ("system", "user", "assistant")
TAG = "<image>"


def _nth_line(p: Path, index: int) -> tuple[bytes, int]:
    """The ``index``-th non-blank line (bytes) and its 1-based line number; reads lazily."""
    count = 0
    try:
        with open(p, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                if count == index:
                    return raw, lineno
                count += 1
    except OSError as e:
        raise InputNotFound(f"cannot read the sample file {p}: {e.strerror or e}") from None
    raise RecipeError(f"{p} has {count} samples; --index {index} is out of range")


def read_sample(path: str, index: int = 0) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise InputNotFound(f"sample file {p} does not exist")
    if index < 0:
        raise RecipeError(f"--index {index} is negative; samples are numbered from 0")
    raw, lineno = _nth_line(p, index)
    where = f"{p} line {lineno}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError(f"{where} is not UTF-8 text ({e}); save the file as UTF-8") from None
    try:
        sample = json.loads(text, object_pairs_hook=no_duplicate_keys)
    except RecursionError:
        raise RecipeError(f"{where} nests too deeply to be a sample") from None
    except ValueError as e:
        raise RecipeError(f"{where} is not valid JSON ({e})") from None
    sample = normalize(sample, where)
    sample["_base"] = str(p.parent)
    return sample


def _image_ref(part: dict[str, Any], where: str) -> str:
    if part["type"] == "image":
        ref = part.get("image")
    else:
        ref = part.get("image_url")
        ref = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(ref, str) or not ref:
        raise RecipeError(f"{where}: an {part['type']} part needs a path or data: URL string, found {ref!r}")
    return ref


def _content(content: Any, where: str, images: list[str]) -> str:
    """A message's content as a string with ``<image>`` tags; inline images appended to ``images``."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RecipeError(f"{where}: content must be a string or a list of parts, found {type(content).__name__}")
    out = []
    for j, part in enumerate(content):
        pw = f"{where} part {j}"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise RecipeError(f"{pw}: a content part must be an object with a 'type' (text, image, image_url)")
        if part["type"] == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise RecipeError(f"{pw}: a text part needs a 'text' string, found {text!r}")
            if TAG in text:
                raise RecipeError(f"{pw}: the text holds an {TAG} tag; in a list of parts images are image parts")
            out.append(text)
        elif part["type"] in ("image", "image_url"):
            images.append(_image_ref(part, pw))
            out.append(TAG)
        else:
            raise RecipeError(f"{pw}: part type {part['type']!r} is not supported (text, image, image_url)")
    return "".join(out)


def normalize(sample: Any, where: str = "the sample") -> dict[str, Any]:
    """The sample with every content a string and every image in ``images`` (see the module doc)."""
    if not isinstance(sample, dict) or not isinstance(sample.get("messages"), list) or not sample["messages"]:
        raise RecipeError(f"{where}: expected an object with a non-empty 'messages' list (ms-swift format)")
    listed = sample.get("images", [])
    if not isinstance(listed, list):
        raise RecipeError(f"{where}: 'images' must be a list of paths or data: URLs")
    listed_refs = []
    for k, ref in enumerate(listed):
        ref = ref.get("path") if isinstance(ref, dict) else ref
        if not isinstance(ref, str) or not ref:
            raise RecipeError(f"{where}: images[{k}] must be a path or data: URL string, found {listed[k]!r}")
        listed_refs.append(ref)
    inline: list[str] = []
    messages = []
    for i, msg in enumerate(sample["messages"]):
        mw = f"{where} messages[{i}]"
        if not isinstance(msg, dict):
            raise RecipeError(f"{mw}: a message must be an object with 'role' and 'content', found {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise RecipeError(f"{mw}: role {role!r} is not system, user or assistant")
        if "content" not in msg:
            raise RecipeError(f"{mw}: no 'content'")
        messages.append({"role": role, "content": _content(msg["content"], mw, inline)})
    if inline and listed_refs:
        raise RecipeError(f"{where}: images are given both as image parts and in 'images'; use one form")
    images = inline or listed_refs
    n_tags = sum(m["content"].count(TAG) for m in messages)
    if n_tags != len(images):
        raise RecipeError(f"{where} has {n_tags} {TAG} tags but {len(images)} images")
    return {**sample, "messages": messages, "images": images}
