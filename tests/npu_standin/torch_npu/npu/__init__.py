"""``torch.npu`` / ``torch_npu.npu`` on the CPU: one device, ordinal 0, answered as the CPU.

``current_device()`` returns ``"cpu"`` (MindSpeed and megatron-core pass it as ``device=``), streams
and events are no-ops that keep the order of a single CPU stream, memory counters read 0, RNG calls
go to the CPU generator. Names read are recorded in ``TOUCHED``; a missing one raises.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch
from torch.overrides import TorchFunctionMode

TOUCHED: dict[str, set[str]] = {}  # name -> the modules that read it


def is_available():
    return True


def device_count():
    return 1


def current_device():
    return "cpu"


def set_device(device):
    return None


def get_device_name(device=None):
    return "Ascend910B (CPU stand-in)"


def get_device_properties(device=None):
    return types.SimpleNamespace(name=get_device_name(), total_memory=0, major=0, minor=0, multi_processor_count=1)


def synchronize(device=None):
    return None


def empty_cache():
    return None


def init():
    return None


def set_compile_mode(jit_compile=False):
    return None


def set_option(option):
    return None


def is_initialized():
    return True


def memory_allocated(device=None):
    return 0


max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated


def reset_max_memory_allocated(device=None):
    return None


reset_peak_memory_stats = reset_max_memory_allocated


def memory_stats(device=None):
    return {}


def mem_get_info(device=None):
    return (0, 0)


def manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))  # not torch.manual_seed: it calls torch.cuda's, i.e. this


manual_seed_all = manual_seed


def get_rng_state(device=None):
    return torch.get_rng_state()


def set_rng_state(state, device=None):
    torch.set_rng_state(state)


class _OneGenerator(tuple):
    """``default_generators[i]``: the CPU generator for any index (current_device() is "cpu")."""

    def __getitem__(self, i):
        return torch.default_generator


default_generators = _OneGenerator((torch.default_generator,))


def _lazy_call(callable, **kwargs):  # noqa: A002  (torch's argument name)
    """torch_npu defers device calls until the device is initialized; the CPU always is."""
    callable()


class Stream:
    """One CPU stream: work is ordered as issued; waits and syncs are no-ops."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device = torch.device("cpu")

    def wait_stream(self, other):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event or Event()

    def synchronize(self):
        return None

    def query(self):
        return True


class Event:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        pass

    def record(self, stream=None):
        return None

    def wait(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True

    def elapsed_time(self, end):
        return 0.0


_STREAM = Stream()


def current_stream(device=None):
    return _STREAM


default_stream = current_stream


@contextlib.contextmanager
def stream(s=None):
    yield s


@contextlib.contextmanager
def device(d=None):
    yield d


def _on_device(d) -> bool:
    if isinstance(d, torch.device):
        return d.type in ("npu", "cuda")
    if isinstance(d, str):
        return d.split(":")[0] in ("npu", "cuda")
    return isinstance(d, int) and not isinstance(d, bool)  # a bare ordinal names the accelerator


class PlaceOnCpu(TorchFunctionMode):
    """Every tensor placed on 'npu' or 'cuda' (factories' ``device=``, ``.to``, ``.npu()``, ``.cuda()``)
    is placed on the CPU; ``pin_memory`` is dropped."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory) or getattr(func, "__name__", "") == "npu":
            return args[0]
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if "device" in kwargs and _on_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _on_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def caller() -> str | None:
    """The module that read a name: the first frame outside the stand-in (None for MindSpeed's patch
    manager, which probes every module for the names it patches: no use of torch_npu)."""
    f = sys._getframe(2)
    while f is not None:
        mod = f.f_globals.get("__name__", "")
        if mod == "mindspeed.patch_utils":
            return None
        if not mod.startswith(("torch_npu", "npu_ops", "importlib")):
            return mod
        f = f.f_back
    return None


def record(touched: dict, name: str) -> None:
    who = caller()
    if who is not None:
        touched.setdefault(name, set()).add(who)


class _Recording(types.ModuleType):
    def __getattribute__(self, name):
        value = types.ModuleType.__getattribute__(self, name)  # a missing name goes to __getattr__
        if not name.startswith("__") and name != "TOUCHED":
            record(types.ModuleType.__getattribute__(self, "TOUCHED"), name)
        return value

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"torch.npu stand-in (tests/npu_standin) has no {name!r}")


sys.modules[__name__].__class__ = _Recording
