"""Reading model weights from a local Hugging Face directory without holding them all at once."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import InputNotFound, RecipeError


@contextlib.contextmanager
def _opened(path: Path):
    """safe_open with damage and absence reported as the user's problem, not a crash."""
    if not path.is_file():
        raise InputNotFound(f"{path}: the checkpoint file does not exist")
    try:
        f = safe_open(str(path), framework="pt")
    except OSError:
        raise
    except Exception as e:  # SafetensorError (not a safetensors file, bad header) or OSError
        raise RecipeError(f"{path} is not a readable safetensors file ({e})") from None
    with f:
        yield f


class SafetensorsDir(Mapping):
    """``model.safetensors`` or a sharded ``model.safetensors.index.json``, read tensor by tensor."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_bytes())["weight_map"]
                ok = isinstance(weight_map, dict) and all(isinstance(v, str) and "/" not in v for v in weight_map.values())
            except (ValueError, KeyError, TypeError, RecursionError):  # not JSON, not UTF-8, no weight_map
                ok = False
            if not ok:
                raise RecipeError(f"{index} is not a safetensors index (a JSON object with a 'weight_map' of file names)")
        elif single.is_file():
            with _opened(single) as f:
                weight_map = {k: single.name for k in f.keys()}
        else:
            raise RecipeError(f"{self.path} holds no model.safetensors nor model.safetensors.index.json")
        self._map: dict[str, str] = weight_map

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._map:
            raise RecipeError(f"{self.path}: the checkpoint has no tensor {name!r} that the model needs")
        with _opened(self.path / self._map[name]) as f:
            try:
                return f.get_tensor(name)
            except Exception as e:  # safetensors raises its own SafetensorError for damaged data
                raise RecipeError(f"{self.path / self._map[name]}: cannot read {name} ({e}); the checkpoint is damaged") from None

    def shapes(self) -> dict[str, list[int]]:
        """Every tensor's shape from the file headers, without reading any data."""
        out: dict[str, list[int]] = {}
        for fname in sorted(set(self._map.values())):
            with _opened(self.path / fname) as f:
                out |= {k: list(f.get_slice(k).get_shape()) for k in f.keys() if self._map.get(k) == fname}
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)
