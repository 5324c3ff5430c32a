"""Test helpers: rewrite a bundle's gradients (planting errors after the fact)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from oracle.bundle.store import Bundle, BundleWriter


def rewrite_grads(src: str, dst: str, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> str:
    """Copy bundle ``src`` to ``dst`` with every gradient g of parameter n replaced by fn(n, g)."""
    b = Bundle(src)
    with BundleWriter(dst, b.kind) as w:
        w.manifest.update({k: v for k, v in b.manifest.items() if k not in ("tensors", "schema_version", "kind")})
        for group in b.groups():
            tensors = b.load_group(group)
            if group == "grads":
                tensors = {n: fn(n, g) for n, g in tensors.items()}
            w.add(group, tensors)
    return dst
