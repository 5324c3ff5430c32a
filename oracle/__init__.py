"""oracle: float64 ground truth for cross-hardware training precision.

Capture one training step on a device, replay it in float64 on CPU, score every device's
gradients against that truth with a measured noise band.

The public names below are imported on first use (PEP 562), so that ``import oracle.errors``
(the CLI's start-up) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

_LAZY = {"Bundle": ".bundle.store", "BundleWriter": ".bundle.store", "Capture": ".capture.api"}
__all__ = ["Bundle", "BundleWriter", "Capture", "__version__"]

if TYPE_CHECKING:
    from .bundle.store import Bundle, BundleWriter
    from .capture.api import Capture


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
