"""Module-boundary recording: each selected module's forward inputs and outputs and backward
grad_outputs and grad_inputs, for teacher-forced local replay (oracle/local.py).

How: a forward pre-hook (with kwargs) flattens the call's arguments with torch's pytree; every
floating input that requires grad is replaced by ``x.view_as(x)`` with a tensor hook on it, so the
gradient the module sends back through that input (its grad_input) is seen, kwargs included
(``register_full_backward_hook`` only sees positional inputs). A forward hook records the outputs
and puts tensor hooks on them for the grad_outputs (the total gradient arriving at each output).
Only the first call of a module per step is recorded; further calls are counted.

Every tensor is copied to CPU as soon as it is seen; recording stops (and says so) once the disk
budget would be exceeded. Hooks are removed in ``close()`` / on leaving the context, always.

Per module the bundle gets one group ``mod.<module name>`` with tensors ``in.<i>``, ``out.<i>``,
``gout.<i>``, ``gin.<i>`` (i = pytree leaf index), and ``manifest["modules"][name]`` with the
serialised tree specs, the non-tensor leaves, and the call count.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, treespec_dumps

JSONABLE = (bool, int, float, str, type(None))


def select(model: nn.Module, pattern: str) -> list[str]:
    rx = re.compile(pattern)
    return [n for n, _ in model.named_modules() if n and rx.search(n)]


def group_name(module: str) -> str:
    return f"mod.{module}"


class ModuleRecorder:
    """Record boundaries of ``names`` in ``model``; ``dry_run`` only counts bytes (size estimate)."""

    def __init__(self, model: nn.Module, names: list[str], *, budget_bytes: int | None = None, dry_run: bool = False):
        self.model = model
        self.names = names
        self.budget = budget_bytes
        self.dry_run = dry_run
        self.bytes = 0
        self.over_budget: list[str] = []
        self.tensors: dict[str, dict[str, torch.Tensor]] = {n: {} for n in names}
        self.meta: dict[str, dict[str, Any]] = {n: {"calls": 0} for n in names}
        self._handles: list[Any] = []

    # -- storing ----------------------------------------------------------------------------
    def _keep(self, module: str, key: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.budget is not None and self.bytes + nbytes > self.budget:
            if module not in self.over_budget:
                self.over_budget.append(module)
            return
        self.bytes += nbytes
        if not self.dry_run:
            self.tensors[module][key] = t.detach().to("cpu", copy=True)

    # -- hooks ------------------------------------------------------------------------------
    def _pre(self, name: str):
        def hook(module, args, kwargs):
            meta = self.meta[name]
            meta["calls"] += 1
            if meta["calls"] > 1:
                return None
            leaves, spec = tree_flatten((args, kwargs))
            meta["in_spec"] = treespec_dumps(spec)
            meta["in_static"] = {
                str(i): v for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor) and isinstance(v, JSONABLE)
            }
            meta["grad_in"] = []
            new = list(leaves)
            for i, v in enumerate(leaves):
                if not isinstance(v, torch.Tensor):
                    continue
                self._keep(name, f"in.{i}", v)
                if v.requires_grad and v.is_floating_point() and torch.is_grad_enabled():
                    w = v.view_as(v)
                    w.register_hook(self._grad_hook(name, f"gin.{i}"))
                    meta["grad_in"].append(i)
                    new[i] = w
            from torch.utils._pytree import tree_unflatten

            return tree_unflatten(new, spec)

        return hook

    def _grad_hook(self, name: str, key: str):
        def hook(g):
            if g is not None and key not in self.tensors[name]:
                self._keep(name, key, g)
            return None

        return hook

    def _post(self, name: str):
        def hook(module, args, kwargs, output):
            meta = self.meta[name]
            if meta["calls"] > 1:
                return None
            leaves, spec = tree_flatten(output)
            meta["out_spec"] = treespec_dumps(spec)
            meta["grad_out"] = []
            for i, v in enumerate(leaves):
                if isinstance(v, torch.Tensor):
                    self._keep(name, f"out.{i}", v)
                    if v.requires_grad and torch.is_grad_enabled():
                        v.register_hook(self._grad_hook(name, f"gout.{i}"))
                        meta["grad_out"].append(i)
            return None

        return hook

    def __enter__(self) -> ModuleRecorder:
        try:
            for n in self.names:
                m = self.model.get_submodule(n)
                self._handles.append(m.register_forward_pre_hook(self._pre(n), with_kwargs=True))
                self._handles.append(m.register_forward_hook(self._post(n), with_kwargs=True))
        except Exception:
            self.close()
            raise
        return self

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- output -----------------------------------------------------------------------------
    def manifest(self) -> dict[str, Any]:
        return {n: m for n, m in self.meta.items() if m["calls"] > 0}

    def groups(self) -> dict[str, dict[str, torch.Tensor]]:
        return {group_name(n): t for n, t in self.tensors.items() if t}
