"""``ORACLE_CAPTURE=DIR``: capture one Megatron training step on every rank, with no file edited.

Activation: the package installs ``oracle_capture.pth`` into site-packages; Python runs its one line
at start-up, which does nothing unless ``ORACLE_CAPTURE`` is set, and then only calls
:func:`install` (no torch, no megatron import). ``install`` waits for megatron-core's
``megatron.core.pipeline_parallel.schedules`` to be imported (by ms-swift, Megatron-LM,
MindSpeed-LLM or a custom loop) and wraps its three schedules, which
``get_forward_backward_func()`` returns:

- the chosen training call (``ORACLE_CAPTURE_STEP=N``, default 0: the first call with
  ``forward_only=False``; evaluation calls are not counted) runs as usual, except that
  - a forward pre-hook on the model chunk records the batch exactly as the model receives it
    (keyword and positional arguments, named by the innermost module's ``forward`` signature;
    ``packed_seq_params``' ``cu_seqlens_q`` kept as ``cu_seqlens``),
  - each microbatch's ``loss_func`` output is recorded (the loss the backward differentiates, the
    token count: ms-swift's and Megatron-LM's ``(loss, num_tokens, logs)``, or ``(loss, logs)``),
  - ``config.finalize_model_grads_func`` is wrapped for that call only: ``DIR/pre/rankNNNNN`` is
    written right before it (the backward is done), ``DIR/post/rankNNNNN`` right after;
- with ``ORACLE_CAPTURE_MODULES=SELECTION`` (a preset such as ``layers``, the decoder layers, or a
  regex over the model chunk's mcore module names; hook.py ``module_selection``) a ModuleRecorder
  (oracle/capture/modules.py) records the selected modules' boundaries during that call (the
  grad-enabled call: under full recompute the recomputation) and both bundles hold them, for
  ``oracle replay --local`` after merge; ``ORACLE_CAPTURE_MODULES_BUDGET_MB`` caps their size (a
  selection that is no preset nor valid regex, or matches nothing, is said on stderr and the step
  is captured without boundaries);
- every recorder only reads (tensors are copied to CPU by ``capture_rank``); the wrappers are
  removed when the call returns, so the step's numbers are those of a run without the variable
  (tested bitwise on ms-swift's own Qwen3-VL step).

If the loop has no ``finalize_model_grads_func`` (it finalizes itself), ``pre`` is written when
the schedule returns and ``post`` is not. At exit, a process that had the variable set and
captured nothing says so on stderr, with the reason.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import inspect
import os
import re
import sys
from typing import Any

SCHEDULES = "megatron.core.pipeline_parallel.schedules"
_FUNCS = ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
          "forward_backward_pipelining_with_interleaving")  # fmt: skip

_state: dict[str, Any] = {"installed": False, "patched": False, "calls": 0, "written": [], "why": None}


def _say(msg: str) -> None:
    print(f"oracle: {msg}", file=sys.stderr, flush=True)


def install() -> None:
    """Patch megatron-core's schedules when they are imported (now, if they already are)."""
    if _state["installed"] or not os.environ.get("ORACLE_CAPTURE"):
        return
    _state["installed"] = True
    atexit.register(_report_at_exit)
    if SCHEDULES in sys.modules:
        patch(sys.modules[SCHEDULES])
    else:
        sys.meta_path.insert(0, _Watcher())


class _Watcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when the schedules module is being imported, it lets the normal
    finders load it and patches it as soon as its code has run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != SCHEDULES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        loader.exec_module = exec_and_patch
        return spec


def patch(schedules) -> None:
    if getattr(schedules, "_oracle_capture", False):
        return
    for name in _FUNCS:
        if hasattr(schedules, name):
            setattr(schedules, name, _wrap(getattr(schedules, name)))
    schedules._oracle_capture = True
    _state["patched"] = True


def _target_step() -> int | None:
    """The training call to capture; None (said once on stderr) when the variable is no integer:
    nothing is captured and the training runs on, as it does for every other capture mistake."""
    raw = os.environ.get("ORACLE_CAPTURE_STEP", "0")
    try:
        return int(raw)
    except ValueError:
        if not _state.get("bad_step"):
            _state["bad_step"] = True
            _say(f"ORACLE_CAPTURE_STEP must be an integer (the training call to capture, 0 = first), got {raw!r}: "
                 "nothing will be captured; the training runs on")  # fmt: skip
        return None


def _budget_mb() -> float | None:
    """``ORACLE_CAPTURE_MODULES_BUDGET_MB``: MiB, a plain number or with a unit (``512``, ``64M``, ``2G``)."""
    raw = os.environ.get("ORACLE_CAPTURE_MODULES_BUDGET_MB", "").strip()
    if not raw:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([MG]i?B?)?", raw, re.IGNORECASE)
    if not m:
        raise ValueError(f"ORACLE_CAPTURE_MODULES_BUDGET_MB={raw!r} is not a size in MiB (e.g. 512, 64M or 2G)")
    return float(m[1]) * (1024 if (m[2] or "M").upper().startswith("G") else 1)


def _wrap(fbf):
    def forward_backward(*args, **kwargs):
        if kwargs.get("forward_only", False):
            return fbf(*args, **kwargs)
        n = _state["calls"]
        _state["calls"] += 1
        if n != _target_step():
            return fbf(*args, **kwargs)
        return _captured_call(fbf, args, kwargs, n)

    forward_backward.__wrapped__ = fbf
    forward_backward.__name__ = fbf.__name__
    return forward_backward


def _innermost(m):
    while hasattr(m, "module"):
        m = m.module
    return m


def _record_batch(store: dict):
    def pre_hook(module, args, kwargs):
        import torch

        try:
            names = list(inspect.signature(_innermost(module).forward).parameters)
        except (TypeError, ValueError):
            names = []
        batch = {}
        for i, a in enumerate(args):
            batch[names[i] if i < len(names) else f"arg{i}"] = a
        batch.update(kwargs)
        rec = {}
        for k, v in batch.items():
            if isinstance(v, torch.Tensor):
                rec[k] = v.detach().to("cpu", copy=True)
            elif k == "packed_seq_params" and v is not None:
                store["packed_seq_params"] = v
        store.setdefault("batches", []).append(rec)
        return None

    return pre_hook


def _record_loss(forward_step_func, store: dict):
    def forward_step(*a, **k):
        output_tensor, loss_func = forward_step_func(*a, **k)

        def recording_loss_func(*la, **lk):
            out = loss_func(*la, **lk)
            if isinstance(out, tuple) and len(out) == 3:
                store.setdefault("losses", []).append((float(out[0].detach().float()), int(out[1])))
            elif isinstance(out, tuple) and len(out) >= 1:
                store.setdefault("losses", []).append((float(out[0].detach().float()), None))
            return out

        return output_tensor, recording_loss_func

    return forward_step


def _captured_call(fbf, args, kwargs, n):
    from megatron.core.utils import get_model_config

    from .hook import capture_rank

    out_dir = os.environ["ORACLE_CAPTURE"]
    bound = inspect.signature(fbf).bind(*args, **kwargs)
    model = bound.arguments["model"]
    chunks = model if isinstance(model, list) else [model]
    store: dict[str, Any] = {}
    handle = chunks[0].register_forward_pre_hook(_record_batch(store), with_kwargs=True)
    bound.arguments["forward_step_func"] = _record_loss(bound.arguments["forward_step_func"], store)
    config = get_model_config(chunks[0])
    finalize = config.finalize_model_grads_func
    recorder = None
    if os.environ.get("ORACLE_CAPTURE_MODULES"):
        from .hook import record_modules

        try:
            budget = _budget_mb()
            recorder = record_modules(chunks[0], os.environ["ORACLE_CAPTURE_MODULES"], budget_mb=budget)
        except ValueError as e:  # the step runs and is captured without boundaries; the run is never stopped
            _say(f"{e}; capturing without module boundaries")

    def write(stage):
        losses = store.get("losses", [])
        loss = sum(x for x, _ in losses) if losses else None
        counts = [c for _, c in losses if c is not None]
        batches = store.get("batches", [])
        batch = batches[0] if len(batches) == 1 else {f"mb{i}.{k}": v for i, b in enumerate(batches) for k, v in b.items()}
        sub = "pre" if stage == "pre-finalize" else "post"
        path = capture_rank(chunks[0], os.path.join(out_dir, sub), stage=stage, batch=batch, loss=loss,
                            num_tokens=sum(counts) if counts else None,
                            packed_seq_params=store.get("packed_seq_params"), modules=recorder,
                            overwrite=True)  # fmt: skip
        _state["written"].append(str(path))

    def finalize_and_capture(*fa, **fk):
        write("pre-finalize")
        result = finalize(*fa, **fk)
        write("post-finalize")
        return result

    if finalize is not None:
        config.finalize_model_grads_func = finalize_and_capture
    try:
        result = fbf(*bound.args, **bound.kwargs)
        if finalize is None:
            write("pre-finalize")
            _say("no config.finalize_model_grads_func in this loop: captured pre-finalize only")
    finally:
        handle.remove()
        if recorder is not None:
            recorder.close()
            if recorder.over_budget:
                _say(f"ORACLE_CAPTURE_MODULES_BUDGET_MB reached: {len(recorder.over_budget)} module(s) not fully recorded "
                     f"({', '.join(recorder.over_budget[:4])})")  # fmt: skip
        if finalize is not None:
            config.finalize_model_grads_func = finalize
    mods = f" with {len(recorder.manifest())} module boundaries" if recorder is not None else ""
    _say(f"captured training call {n} into {out_dir}{mods}")
    return result


def _report_at_exit() -> None:
    if _state["written"] or not (_state["patched"] or "RANK" in os.environ):
        return  # a captured step, or not a training rank (a launcher, a pip subprocess ...)
    if not _state["patched"]:
        why = f"{SCHEDULES} was never imported (not a megatron-core training loop?)"
    elif _target_step() is None:
        why = f"ORACLE_CAPTURE_STEP={os.environ.get('ORACLE_CAPTURE_STEP')!r} is no integer"
    elif _state["calls"] <= _target_step():
        why = (f"the training loop ran {_state['calls']} forward-backward call(s), "
               f"ORACLE_CAPTURE_STEP={_target_step()} was never reached")  # fmt: skip
    else:
        why = "the capture call did not complete"
    _say(f"ORACLE_CAPTURE={os.environ.get('ORACLE_CAPTURE')} is set but nothing was captured: {why}")


def main(argv: list[str] | None = None) -> int:
    """``python -m oracle.integrations.megatron.autocapture install-pth``: write the start-up hook
    into this interpreter's site-packages (an editable install does not carry it)."""
    import sysconfig

    argv = sys.argv[1:] if argv is None else argv
    if argv != ["install-pth"]:
        print(main.__doc__, file=sys.stderr)
        return 2
    dest = os.path.join(sysconfig.get_paths()["purelib"], PTH_NAME)
    with open(dest, "w") as f:
        f.write(PTH_LINE + "\n")
    print(dest)
    return 0


PTH_NAME = "oracle_capture.pth"
# One line, run by site.py at start-up: imports nothing unless ORACLE_CAPTURE is set.
PTH_LINE = ("import os; os.environ.get('ORACLE_CAPTURE') and "
            "__import__('oracle.integrations.megatron.autocapture', fromlist=['install']).install()")  # fmt: skip

if __name__ == "__main__":
    sys.exit(main())
