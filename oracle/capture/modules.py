"""Module-boundary recording: each selected module's forward inputs and outputs and backward
grad_outputs and grad_inputs, for teacher-forced local replay (oracle/replay/local.py).

How, without touching the step: the hooks only observe. Nothing is replaced, wrapped or
re-routed, so the autograd graph -- and with it every gradient, bit for bit -- is the one the step
builds without recording (tested for fp32, bf16 and amp-bf16).
  - forward pre-hook (with kwargs): flattens the call's arguments with torch's pytree, copies the
    tensor leaves, and notes for each floating input that requires grad its gradient edge (the
    autograd node and output slot that produced it) and the autograd sequence number at the call;
  - forward hook: copies the outputs and puts tensor hooks on them for the grad_outputs (the total
    gradient arriving at each output); then walks the graph back from the outputs through the
    nodes created during this call (sequence number >= the one noted) and, on each node that
    consumes an input edge, registers a node hook that reads the gradient it sends along that
    edge. A module's grad_input for an input is the sum of these contributions (in the gradient's
    own dtype, in the order the backward produces them): exactly what the module sends back
    through that input, kwargs included (``register_full_backward_hook`` would only see
    positional inputs, and wraps them in an extra autograd function). An input the module
    returns unchanged (an identity in eval mode) has no node inside the module: no grad_input.
Which call is recorded: the first one that builds the step's graph. Under full recompute
(Megatron's ``tensor_parallel.checkpoint``, ``torch.utils.checkpoint`` reentrant) a layer's first
call is a no-grad forward and its grad-enabled recomputation runs inside the backward: that
recomputation is recorded (a no-grad call is kept only until it comes, or when none comes). With
non-reentrant checkpointing the first call builds the graph and the recomputation inside the
backward repeats it: it is not recorded nor counted as a call. ``calls`` counts the graph-building
calls (a module called twice accumulates its parameter gradients over both: local replay then
judges outputs only); ``no_grad_calls`` and ``recomputed_calls`` count the others; ``order`` is
the module's place in the forward's completion order (first calls), as without recompute.

A hook never raises into the step: a failure of the recording itself (``_guarded``) stops it and
``failed`` says why. Selection regexes are refused when they could backtrack exponentially
(``check_pattern``). Every tensor is copied to CPU as soon as it is seen; recording stops (and says so) once the disk
budget would be exceeded. Hooks are removed in ``close()`` / on leaving the context, always.

Per module the bundle gets one group ``mod.<module name>`` with tensors ``in.<i>``, ``out.<i>``,
``gout.<i>``, ``gin.<i>`` (i = pytree leaf index), and ``manifest["modules"][name]`` with the
serialised input tree spec, the non-tensor leaves, the leaf indices with gradients, the call count,
and ``order``, the module's place in the order forward calls finished.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, treespec_dumps

JSONABLE = (bool, int, float, str, type(None))


def _sequence_now() -> int:
    """The autograd sequence number the next node created on this thread gets (a throwaway node on
    a throwaway leaf: it joins no graph of the step; later nodes all shift by one, their order kept)."""
    with torch.enable_grad():
        return torch.empty(0, requires_grad=True).view(0).grad_fn._sequence_nr() + 1


#: Longest selection pattern taken (characters); module names longer than NAME_MAX are never selected.
PATTERN_MAX = 1000
NAME_MAX = 1000
#: Wall-clock bound on matching all names when the ``regex`` package (its ``timeout=``) is installed.
MATCH_SECONDS = 2.0


def _repeats(items, inside: bool) -> str | None:
    """The first construct that makes backtracking exponential: a quantifier (``+``, ``*``, ``{m,n}``
    with n > 1) or an alternation (``a|b``) inside a repeated group. ``items``: a parsed pattern."""
    try:
        from re import _constants as c
        from re import _parser as sre
    except ImportError:  # Python < 3.11
        import sre_constants as c  # noqa: F401
        import sre_parse as sre  # noqa: F401
    repeat_ops = {c.MAX_REPEAT, c.MIN_REPEAT} | ({c.POSSESSIVE_REPEAT} if hasattr(c, "POSSESSIVE_REPEAT") else set())
    for op, av in items:
        if op in repeat_ops:
            lo, hi, sub = av
            if hi > 1 and lo != hi and inside:  # a fixed count {n} inside a repeat does not multiply the ways
                return "a quantifier inside a repeated group"
            found = _repeats(sub, inside or hi > 1)
            if found:
                return found
        elif op is c.BRANCH:
            if inside:
                return "an alternation (|) inside a repeated group"
            for alt in av[1]:
                found = _repeats(alt, inside)
                if found:
                    return found
        elif op is c.SUBPATTERN:
            found = _repeats(av[-1], inside)
            if found:
                return found
        elif op in (c.ASSERT, c.ASSERT_NOT):
            found = _repeats(av[1], inside)
            if found:
                return found
        elif op is c.GROUPREF_EXISTS:
            for alt in av[1:]:
                if alt is not None:
                    found = _repeats(alt, inside)
                    if found:
                        return found
    return None


def check_pattern(pattern: str) -> None:
    """ValueError for a selection regex that could take exponential time over a module name (the
    time guard, which needs no third-party package): the pattern is parsed with the standard
    library's own regex parser and refused when a repeated group holds a quantifier or an
    alternation (``(\\w+\\.?)+``, ``(a|ab)*``: the catastrophic-backtracking shapes). What remains
    backtracks at most polynomially in the name's length, and names are at most ``NAME_MAX``
    characters; with the ``regex`` package installed the match also runs under its ``timeout``."""
    if len(pattern) > PATTERN_MAX:
        raise ValueError(f"module selection regex is {len(pattern)} characters (at most {PATTERN_MAX})")
    try:
        try:
            from re import _parser as sre
        except ImportError:  # Python < 3.11
            import sre_parse as sre
        parsed = sre.parse(pattern)
    except re.error as e:
        raise ValueError(f"module selection {pattern!r} is not a valid regex ({e})") from None
    why = _repeats(list(parsed), False)
    if why:
        raise ValueError(f"module selection {pattern!r} has {why}, which can take exponential time to match (the "
                         "training would hang): write it without nesting, e.g. 'decoder\\.layers\\.\\d+$' or "
                         "'layers\\.(?:1|2)\\.mlp$' with the alternation outside any repeat")  # fmt: skip


def select(model: nn.Module, pattern: str) -> list[str]:
    """The module names ``pattern`` searches (never the root ''). Refuses a pattern that could hang
    (``check_pattern``); with the ``regex`` package the whole selection runs under ``MATCH_SECONDS``."""
    check_pattern(pattern)
    names = [n for n, _ in model.named_modules() if n and len(n) <= NAME_MAX]
    try:
        import regex
    except ImportError:
        rx = re.compile(pattern)
        return [n for n in names if rx.search(n)]
    import time

    try:
        rx = regex.compile(pattern, flags=regex.VERSION0)
    except regex.error:  # a construct only ``re`` reads: check_pattern has parsed it with ``re``
        rx = None
    if rx is None:
        crx = re.compile(pattern)
        return [n for n in names if crx.search(n)]
    deadline = time.monotonic() + MATCH_SECONDS
    out = []
    for n in names:
        try:
            if rx.search(n, timeout=max(deadline - time.monotonic(), 1e-3)):
                out.append(n)
        except TimeoutError:
            raise ValueError(f"module selection {pattern!r} took over {MATCH_SECONDS:g} s to match the model's "
                             f"{len(names)} module names (a regex that backtracks): write a simpler one, e.g. "
                             "'decoder\\.layers\\.\\d+$'") from None  # fmt: skip
    return out


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
        self._finished = 0
        self._state: dict[str, str] = {}  # module -> "no_grad" | "graph": what its recorded call was
        self._recording: dict[str, bool] = {}  # pre -> post of the call being recorded
        self._bytes_of: dict[str, int] = {}  # bytes kept per module (a replaced record gives them back)
        self._pending: dict[str, tuple[dict[tuple[int, int], int], int, list]] = {}  # pre -> post of one call
        #: why recording stopped (a hook's own failure: out of host memory, ...); the step runs on untouched
        self.failed: str | None = None

    def _guarded(self, hook):
        """A hook that never raises into the step: a failure of the recording stops the recording
        (``failed`` says why) and the hook returns None, as every hook here does."""

        def guarded(*a, **k):
            if self.failed is not None:
                return None
            try:
                return hook(*a, **k)
            except Exception as e:  # noqa: BLE001  (a recording failure must never stop the training step)
                self.failed = f"{type(e).__name__}: {e}"
                return None

        return guarded

    # -- storing ----------------------------------------------------------------------------
    def _keep(self, module: str, key: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.budget is not None and self.bytes + nbytes > self.budget:
            if module not in self.over_budget:
                self.over_budget.append(module)
            return
        self.bytes += nbytes
        self._bytes_of[module] = self._bytes_of.get(module, 0) + nbytes
        if not self.dry_run:
            self.tensors[module][key] = t.detach().to("cpu", copy=True)

    # -- hooks (observe only) --------------------------------------------------------------
    def _drop(self, name: str) -> None:
        """Forget the provisional (no-grad) record of ``name``: a graph-building call replaces it."""
        self.bytes -= self._bytes_of.pop(name, 0)
        self.tensors[name] = {}
        if name in self.over_budget:
            self.over_budget.remove(name)

    def _pre(self, name: str):
        def hook(module, args, kwargs):
            meta = self.meta[name]
            builds = torch.is_grad_enabled()
            in_backward = torch._C._current_graph_task_id() != -1  # a recomputation inside the backward
            state = self._state.get(name)
            if not builds:
                meta["no_grad_calls"] = meta.get("no_grad_calls", 0) + 1
            elif in_backward and state == "graph":
                meta["recomputed_calls"] = meta.get("recomputed_calls", 0) + 1  # repeats a recorded call
            else:
                meta["calls"] += 1
                if in_backward:
                    meta["recomputed_calls"] = meta.get("recomputed_calls", 0) + 1
            record = state is None or (state == "no_grad" and builds)
            self._recording[name] = record
            if not record:
                return None
            if state == "no_grad":
                self._drop(name)
            self._state[name] = "graph" if builds else "no_grad"
            leaves, spec = tree_flatten((args, kwargs))
            meta["in_spec"] = treespec_dumps(spec)
            meta["in_static"] = {
                str(i): v for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor) and isinstance(v, JSONABLE)
            }
            meta["grad_in"] = []
            edges: dict[tuple[int, int], int] = {}
            alive = []  # the nodes' Python wrappers, so that their ids stay theirs until the walk
            for i, v in enumerate(leaves):
                if not isinstance(v, torch.Tensor):
                    continue
                self._keep(name, f"in.{i}", v)
                if v.requires_grad and v.is_floating_point() and torch.is_grad_enabled():
                    e = get_gradient_edge(v)
                    edges.setdefault((id(e.node), e.output_nr), i)
                    alive.append(e.node)
            if edges:
                self._pending[name] = (edges, _sequence_now(), alive)
            return None

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
            if "order" not in meta:
                meta["order"] = self._finished  # forward completion order; the backward runs it in reverse
                self._finished += 1
            if not self._recording.pop(name, False):
                return None
            leaves, _ = tree_flatten(output)
            meta["grad_out"] = []
            roots = []
            for i, v in enumerate(leaves):
                if isinstance(v, torch.Tensor):
                    self._keep(name, f"out.{i}", v)
                    if v.requires_grad and torch.is_grad_enabled():
                        v.register_hook(self._guarded(self._grad_hook(name, f"gout.{i}")))
                        meta["grad_out"].append(i)
                        if v.grad_fn is not None:
                            roots.append(v.grad_fn)
            pending = self._pending.pop(name, None)
            if pending is not None:
                self._watch_inputs(name, roots, pending[0], pending[1])
            return None

        return hook

    def _watch_inputs(self, name: str, roots: list, edges: dict[tuple[int, int], int], since: int) -> None:
        """Hook every node created in this call that consumes an input edge (see the docstring)."""
        consumers: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
        seen: dict[int, Any] = {}  # id -> node, kept alive so that ids are not reused during the walk
        stack = [r for r in roots if r._sequence_nr() >= since]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen[id(node)] = node
            for j, (nxt, nr) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                i = edges.get((id(nxt), nr))
                if i is not None:
                    consumers.setdefault(id(node), (node, []))[1].append((j, i))
                elif id(nxt) not in seen and nxt.next_functions and nxt._sequence_nr() >= since:
                    stack.append(nxt)
        self.meta[name]["grad_in"] = sorted({i for _, slots in consumers.values() for _, i in slots})
        partial: dict[int, torch.Tensor] = {}
        remaining = {i: 0 for i in self.meta[name]["grad_in"]}
        for _, slots in consumers.values():
            for _, i in slots:
                remaining[i] += 1

        def on_node(slots):
            def hook(grad_inputs, grad_outputs):
                for j, i in slots:
                    g = grad_inputs[j]
                    remaining[i] -= 1
                    if g is not None:
                        g = g.detach()
                        partial[i] = g.clone() if i not in partial else partial[i] + g
                    if remaining[i] == 0 and i in partial:
                        self._keep(name, f"gin.{i}", partial.pop(i))
                return None

            return hook

        for node, slots in consumers.values():
            self._handles.append(node.register_hook(self._guarded(on_node(slots))))

    def __enter__(self) -> ModuleRecorder:
        try:
            for n in self.names:
                m = self.model.get_submodule(n)
                self._handles.append(m.register_forward_pre_hook(self._guarded(self._pre(n)), with_kwargs=True))
                self._handles.append(m.register_forward_hook(self._guarded(self._post(n)), with_kwargs=True))
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
        return {n: m for n, m in self.meta.items() if n in self._state}

    def groups(self) -> dict[str, dict[str, torch.Tensor]]:
        return {group_name(n): t for n, t in self.tensors.items() if t}
