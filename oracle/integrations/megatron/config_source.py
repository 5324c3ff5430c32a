"""Where ``--hf-config`` comes from: a config.json, a model folder, or the model id the training ran
(``swift megatron sft --model Qwen/Qwen3-VL-8B-Instruct``) found in this machine's model caches, offline.

Looked up in order (stdlib only: ``oracle doctor`` runs in the training environment, without torch):

1. a file: that file; a folder: its ``config.json``;
2. an id ``ORG/NAME`` in the Hugging Face cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
   ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``; the file is
   ``models--ORG--NAME/snapshots/REV/config.json``, REV the one ``refs/main`` names, else the newest;
3. the same id in the ModelScope cache (ms-swift downloads from ModelScope unless ``--use_hf``):
   ``$MODELSCOPE_CACHE``, else ``~/.cache/modelscope/hub``; ``models/ORG/NAME/config.json`` or
   ``ORG/NAME/config.json``.

Nothing is downloaded. Not found: ``FileNotFoundError`` whose message names every place looked in.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hf_hub_dir(env: dict[str, str]) -> Path:
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "huggingface" / "hub"


def modelscope_dir(env: dict[str, str]) -> Path:
    return Path(env.get("MODELSCOPE_CACHE") or Path.home() / ".cache" / "modelscope" / "hub").expanduser()


def _hf_snapshot(hub: Path, model_id: str) -> Path | None:
    repo = hub / f"models--{model_id.replace('/', '--')}"
    snaps = repo / "snapshots"
    try:
        main = (repo / "refs" / "main").read_text().strip()
    except (OSError, UnicodeDecodeError):
        main = ""
    if main and (snaps / main / "config.json").is_file():
        return snaps / main / "config.json"
    found = [p for p in snaps.glob("*/config.json") if p.is_file()] if snaps.is_dir() else []
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def resolve(spec: str, env: dict[str, str] | None = None) -> tuple[str, str]:
    """``(path of the config.json, where it comes from in words)``; ``FileNotFoundError`` naming the places looked."""
    env = dict(os.environ if env is None else env)
    p = Path(spec).expanduser()
    try:
        if p.is_file():
            return str(p), "the file given"
        if (p / "config.json").is_file():
            return str(p / "config.json"), f"the model folder {p}"
    except OSError as e:  # a name too long for the file system, ...
        raise FileNotFoundError(errno.ENOENT, f"--hf-config: cannot read it ({e.strerror or e})", spec) from None
    looked = [str(p)]
    if _ID.fullmatch(spec.strip("/")) and not spec.endswith(".json") and not p.exists():
        model_id = spec.strip("/")
        hub = hf_hub_dir(env)
        hit = _hf_snapshot(hub, model_id)
        if hit is not None:
            return str(hit), f"{model_id} in the Hugging Face cache {hub}"
        looked.append(str(hub / f"models--{model_id.replace('/', '--')}"))
        ms = modelscope_dir(env)
        for cand in (ms / "models" / model_id / "config.json", ms / model_id / "config.json"):
            if cand.is_file():
                return str(cand), f"{model_id} in the ModelScope cache {ms}"
        looked.append(str(ms / "models" / model_id))
    why = (f"--hf-config: no such file, folder with a config.json, or model id in this machine's caches (looked in "
           f"{', '.join(looked)}); give the config.json's path, the model folder, or the --model id the training "
           "downloaded (set HF_HOME / HF_HUB_CACHE / MODELSCOPE_CACHE as the training does)")  # fmt: skip
    raise FileNotFoundError(errno.ENOENT, why, spec)
