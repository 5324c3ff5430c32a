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
    ``packed_seq_params``' ``cu_seqlens_q`` kept as ``cu_seqlens``); a call of several micro-batches
    records each (``mb{i}.NAME``, merged into one batch by merge: microbatches.py),
  - each microbatch's ``loss_func`` output is recorded (the token count: ms-swift's and Megatron-LM's
    ``(loss sum, num_tokens, logs)``, or ``(loss, logs)``; ``differentiated`` turns them into the
    loss the backward differentiated, as the schedule scales them),
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

Nothing the capture meets stops, hangs or changes the training (``_Capture``): the destination is
checked before the step (the folders can be made and written; no folder or file of the user's is
where a bundle goes: only an earlier capture or an empty folder is replaced); every hook, the
loss recorder and the writes are guarded, so a failure (unwritable or odd destination, a user's
file in the way, disk full mid-write: the half-written bundle is removed, host memory) is said
once on stderr with its fix, ends the capture, and the loop's schedule and its
``finalize_model_grads_func`` run exactly as without the variable. A bad ``ORACLE_CAPTURE_STEP``
captures nothing; a bad module selection or budget captures without boundaries; a selection regex
that could backtrack exponentially is refused before it runs (oracle/capture/modules.py
``check_pattern``: no third-party package needed).

If the loop has no ``finalize_model_grads_func`` (it finalizes itself), ``pre`` is written when
the schedule returns and ``post`` is not. At exit, a process that had the variable set and
captured nothing says so on stderr, with the reason.
"""

from __future__ import annotations

import atexit
import errno
import importlib.abc
import importlib.util
import inspect
import math
import os
import re
import sys
import tempfile
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


def _give_up(msg: str) -> None:
    """Say once (per process) why nothing more is captured, with the fix; the training runs on."""
    if _state["why"] is None:
        _state["why"] = msg
        _say(f"{msg}; nothing more is captured, the training runs on unchanged")


def _target_step() -> int | None:
    """The training call to capture; None (said once on stderr) when the variable is no integer >= 0:
    nothing is captured and the training runs on, as it does for every other capture mistake."""
    raw = os.environ.get("ORACLE_CAPTURE_STEP", "0")
    try:
        step = int(raw.strip())
    except ValueError:
        step = -1
    if step >= 0:
        return step
    if not _state.get("bad_step"):
        _state["bad_step"] = True
        _say(f"ORACLE_CAPTURE_STEP must be an integer >= 0 (the training call to capture, 0 = first), got {raw!r}: "
             "nothing will be captured; the training runs on")  # fmt: skip
    return None


_SIZE = re.compile(r"(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*([MG]i?B?)?", re.IGNORECASE)


def _budget_mb() -> float | None:
    """``ORACLE_CAPTURE_MODULES_BUDGET_MB``: MiB, a plain number or with a unit (``512``, ``64M``,
    ``2G``, ``1e3``); ValueError naming the variable for anything else, infinite or zero included."""
    raw = os.environ.get("ORACLE_CAPTURE_MODULES_BUDGET_MB", "").strip()
    if not raw:
        return None
    m = _SIZE.fullmatch(raw)
    mb = float(m[1]) * (1024 if (m[2] or "M").upper().startswith("G") else 1) if m else math.nan
    if not (math.isfinite(mb) and 0 < mb < 2**43):  # 2**43 MiB = 8 EiB: past that no budget is meant
        raise ValueError(f"ORACLE_CAPTURE_MODULES_BUDGET_MB={raw!r} is not a size in MiB (a finite number > 0, "
                         "e.g. 512, 64M or 2G)")  # fmt: skip
    return mb


def _wrap(fbf):
    def forward_backward(*args, **kwargs):
        if kwargs.get("forward_only", False):
            return fbf(*args, **kwargs)
        n = _state["calls"]
        _state["calls"] += 1
        if _state["why"] is not None or n != _target_step():
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
                rec[k] = v  # this micro-batch's boundaries (capture_rank reads cu_seqlens_q from it)
        store.setdefault("batches", []).append(rec)
        return None

    return pre_hook


def _record_loss(forward_step_func, store: dict, guard):
    def forward_step(*a, **k):
        output_tensor, loss_func = forward_step_func(*a, **k)

        def record(out):
            if isinstance(out, tuple) and len(out) == 3:  # (token-loss sum, tokens, logs)
                store.setdefault("losses", []).append((float(out[0].detach().float()), int(out[1])))
            elif isinstance(out, tuple) and len(out) >= 1:  # (mean loss, logs)
                store.setdefault("losses", []).append((float(out[0].detach().float()), None))

        def recording_loss_func(*la, **lk):
            out = loss_func(*la, **lk)  # the loop's own loss: its errors are the loop's, raised as they are
            guard(record)(out)
            return out

        return output_tensor, recording_loss_func

    return forward_step


def differentiated(losses: list[tuple[float, int | None]], per_token: bool) -> float | None:
    """The loss the step's backward differentiated, from each micro-batch's ``loss_func`` output
    (megatron-core 0.12.1 ``schedules.forward_step``): with ``calculate_per_token_loss`` the sum of
    the token-loss sums; without it each micro-batch's output divided by its tokens (a 3-tuple's sum)
    and by the M micro-batches, summed. One micro-batch of a 3-tuple: its mean."""
    if not losses:
        return None
    if per_token:
        return sum(x for x, _ in losses)
    m = len(losses)
    return sum((x / n if n else x) / m for x, n in losses)


def problem(e: BaseException, where: str) -> str:
    """What went wrong with the capture, and the fix, in one line (never a traceback)."""
    from ...errors import OracleError, OutputError, OutputExists

    if isinstance(e, OutputExists):
        return f"ORACLE_CAPTURE: {e}; move it away or point ORACLE_CAPTURE at another folder"
    if isinstance(e, OSError):
        at = e.filename or where
        what = e.strerror or str(e)
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            fix = "free space there or point ORACLE_CAPTURE at a disk with room for a step (weights, grads, inputs)"
        elif e.errno == errno.ENAMETOOLONG:
            fix = "point ORACLE_CAPTURE at a shorter path"
        elif e.errno in (errno.EEXIST, errno.ENOTDIR):
            fix = "a file is in the way of the capture's folders: point ORACLE_CAPTURE at a new or empty folder"
        else:
            fix = "point ORACLE_CAPTURE at a folder this process can write (e.g. one under your home or scratch space)"
        return f"ORACLE_CAPTURE: cannot write {at} ({what}); {fix}"
    if isinstance(e, MemoryError):
        return (f"ORACLE_CAPTURE: out of host memory at {where} ({e}): the capture copies the step's tensors to the "
                "CPU; free host memory, or with ORACLE_CAPTURE_MODULES set a smaller ORACLE_CAPTURE_MODULES_BUDGET_MB")
    if isinstance(e, OutputError):
        return (f"ORACLE_CAPTURE: {e}; point ORACLE_CAPTURE at a folder this process can write, on a disk with room "
                "for a step (weights, grads, inputs)")  # fmt: skip
    if isinstance(e, OracleError):
        return f"ORACLE_CAPTURE: {e}"
    return (f"ORACLE_CAPTURE: the capture failed at {where} ({type(e).__name__}: {e}); this is a bug of oracle, "
            "please report it with this line")  # fmt: skip


def _destination(out_dir: str, rank: int) -> dict[str, str]:
    """``DIR/pre/rankNNNNN`` and ``DIR/post/rankNNNNN``, checked before the step: the folders can be
    made and written (a probe file, removed), and no folder or file of the user's is where the
    bundle goes (only an earlier capture or an empty folder is replaced). Raises what it met."""
    from ...bundle.store import check_output

    paths = {}
    for sub in ("pre", "post"):
        parent = os.path.join(out_dir, sub)
        os.makedirs(parent, exist_ok=True)
        path = os.path.join(parent, f"rank{rank:05d}")
        check_output(path, overwrite=True)
        fd, probe = tempfile.mkstemp(prefix=".oracle-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
        paths[sub] = path
    return paths


class _Capture:
    """One captured training call. Everything it does is guarded: a failure is said once with its
    fix (``problem``) and only ends the capture; the schedule, its hooks' return values and the
    loop's ``finalize_model_grads_func`` run exactly as without the variable."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.failed = False
        self.store: dict[str, Any] = {}
        self.handle = None
        self.recorder = None
        self.config = None
        self.finalize = None
        self.chunk = None

    def fail(self, e: BaseException, where: str) -> None:
        self.failed = True
        kept = f" ({', '.join(_state['written'])} complete and kept)" if _state["written"] else ""
        _give_up(problem(e, where) + kept)

    def guard(self, fn, where: str = "a recording hook"):
        def guarded(*a, **k):
            if self.failed:
                return None
            try:
                return fn(*a, **k)
            except Exception as e:  # noqa: BLE001  (never into the training step)
                self.fail(e, where)
                return None

        return guarded

    def start(self, fbf, args, kwargs) -> tuple[tuple, dict]:
        """Check the destination, hook the model chunk and the loss: the arguments to call ``fbf`` with."""
        import torch
        from megatron.core.utils import get_model_config

        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.paths = _destination(self.out_dir, rank)
        bound = inspect.signature(fbf).bind(*args, **kwargs)
        model = bound.arguments["model"]
        chunks = model if isinstance(model, list) else [model]
        self.chunk = chunks[0]
        self.config = get_model_config(self.chunk)
        self.finalize = self.config.finalize_model_grads_func
        if os.environ.get("ORACLE_CAPTURE_MODULES"):
            from .hook import record_modules

            try:
                self.recorder = record_modules(self.chunk, os.environ["ORACLE_CAPTURE_MODULES"], budget_mb=_budget_mb())
            except ValueError as e:  # the step runs and is captured without boundaries
                _say(f"{e}; capturing without module boundaries")
        self.handle = self.chunk.register_forward_pre_hook(self.guard(_record_batch(self.store)), with_kwargs=True)
        bound.arguments["forward_step_func"] = _record_loss(bound.arguments["forward_step_func"], self.store, self.guard)
        if self.finalize is not None:
            finalize, write = self.finalize, self.write

            def finalize_and_capture(*fa, **fk):
                write("pre-finalize")
                result = finalize(*fa, **fk)
                write("post-finalize")
                return result

            self.config.finalize_model_grads_func = finalize_and_capture
        return bound.args, bound.kwargs

    def write(self, stage: str) -> None:
        if self.failed:
            return
        sub = "pre" if stage == "pre-finalize" else "post"
        self.guard(self._write, f"writing {self.paths.get(sub, self.out_dir)}")(stage, sub)

    def _write(self, stage: str, sub: str) -> None:
        from .hook import capture_rank

        losses = self.store.get("losses", [])
        counts = [c for _, c in losses if c is not None]
        batches = self.store.get("batches", [])
        loss = differentiated(losses, bool(getattr(self.config, "calculate_per_token_loss", False)))
        rec = self.recorder
        if rec is not None and rec.failed:
            _say(f"ORACLE_CAPTURE_MODULES: recording stopped ({rec.failed}); capturing without module boundaries")
            rec.close()
            self.recorder = rec = None
        path = capture_rank(self.chunk, os.path.join(self.out_dir, sub), stage=stage,
                            batch=batches[0] if len(batches) == 1 else batches, loss=loss,
                            num_tokens=sum(counts) if counts else None,
                            microbatch_tokens=[c for _, c in losses] if len(losses) == len(batches) else None,
                            modules=rec, overwrite=True)  # fmt: skip
        _state["written"].append(str(path))

    def stop(self) -> None:
        """Remove every hook and give the loop its own finalize back (each step on its own: one
        failing never keeps the others from running)."""
        if self.handle is not None:
            try:
                self.handle.remove()  # also after a failure: no hook of ours stays on the model
            except Exception as e:  # noqa: BLE001
                self.fail(e, "removing the batch hook")
            self.handle = None
        if self.config is not None and self.finalize is not None:
            self.config.finalize_model_grads_func = self.finalize
        rec, self.recorder = self.recorder, None
        if rec is not None:
            rec.close()
            if rec.over_budget and not self.failed:
                _say(f"ORACLE_CAPTURE_MODULES_BUDGET_MB reached: {len(rec.over_budget)} module(s) not fully recorded "
                     f"({', '.join(rec.over_budget[:4])})")  # fmt: skip
        self.n_modules = len(rec.manifest()) if rec is not None else None


def _captured_call(fbf, args, kwargs, n):
    cap = _Capture(os.environ["ORACLE_CAPTURE"])
    try:
        call_args, call_kwargs = cap.start(fbf, args, kwargs)
    except Exception as e:  # noqa: BLE001  (the destination or the set-up: said, and the call runs untouched)
        cap.fail(e, f"setting up the capture into {cap.out_dir}")
        cap.stop()
        return fbf(*args, **kwargs)
    try:
        result = fbf(*call_args, **call_kwargs)
        if cap.finalize is None:
            cap.write("pre-finalize")
            if not cap.failed:
                _say("no config.finalize_model_grads_func in this loop: captured pre-finalize only")
    finally:
        cap.stop()
    if not cap.failed:
        mods = f" with {cap.n_modules} module boundaries" if cap.n_modules is not None else ""
        _say(f"captured training call {n} into {cap.out_dir}{mods}")
    return result


def _report_at_exit() -> None:
    if _state["written"] or _state["why"] or not (_state["patched"] or "RANK" in os.environ):
        return  # a captured step, a failure already said, or not a training rank (a launcher, a pip subprocess ...)
    if not _state["patched"]:
        why = f"{SCHEDULES} was never imported (not a megatron-core training loop?)"
    elif _target_step() is None:
        return  # said once, on one line, where the variable was read (_target_step)
    elif _state["calls"] <= _target_step():
        why = (f"the training loop ran {_state['calls']} forward-backward call(s), "
               f"ORACLE_CAPTURE_STEP={_target_step()} was never reached")  # fmt: skip
    else:
        why = "the capture call did not complete"
    _say(f"ORACLE_CAPTURE={os.environ.get('ORACLE_CAPTURE')} is set but nothing was captured: {why}")


def main(argv: list[str]) -> int:
    """``python -m oracle.integrations.megatron.autocapture install-pth``: write the start-up hook
    into this interpreter's site-packages (an editable install does not carry it)."""
    import sysconfig

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
    sys.exit(main(sys.argv[1:]))
