"""Reading model weights from a local Hugging Face directory without holding them all at once."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import RecipeError


class SafetensorsDir(Mapping):
    """``model.safetensors`` or a sharded ``model.safetensors.index.json``, read tensor by tensor."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif single.is_file():
            with safe_open(str(single), framework="pt") as f:
                weight_map = {k: single.name for k in f.keys()}
        else:
            raise RecipeError(f"{self.path} holds no model.safetensors nor model.safetensors.index.json")
        self._map: dict[str, str] = weight_map

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._map:
            raise RecipeError(f"{self.path}: the checkpoint has no tensor {name!r} that the model needs")
        with safe_open(str(self.path / self._map[name]), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)
