"""Thin stand-ins that let ms-swift 3.12.1's own Megatron Qwen3-VL model run one step on CPU.

Test code only (never the library). Each stand-in replaces something this machine lacks, never a
piece of the step's numerics:

- Megatron-LM's ``megatron.training`` package (ms-swift imports it; only megatron-core is on PyPI):
  ``get_args``/``set_args``, timers, print helpers, ``core_transformer_config_from_args``,
  ``unwrap_model``; any other name is a placeholder that raises when used. ``megatron.legacy`` and
  ``megatron.core.extensions.transformer_engine`` (it imports TransformerEngine) likewise.
- ``swift.megatron``'s submodules are imported without its ``__init__`` (which clones Megatron-LM and
  imports TransformerEngine); its ``init.py`` patches are applied minus the TransformerEngine ones.
- CUDA: a torch function mode maps every ``device="cuda"`` / ``.cuda()`` / ``.to("cuda")`` to the CPU;
  ``torch.cuda.current_device`` returns ``"cpu"``; the CUDA RNG tracker's ``fork`` is a no-op (no
  dropout), and recompute's save/restore of the CUDA RNG state is the CPU generator's.
- Sequence parallel without apex: the local spec's ``WrappedTorchNorm`` refuses SP, so it is built
  with SP off and its parameters are marked ``sequence_parallel`` (as TE's norms are), which is what
  makes ``finalize_model_grads`` all-reduce them.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

import torch
from torch.overrides import TorchFunctionMode

# --------------------------------------------------------------------------- placeholders


class _PlaceholderMeta(type):
    """Placeholders answer attribute access with further placeholders (a stand-in submodule such as
    ``megatron.training.wandb_utils`` may be reached as an attribute), can be subclassed, and raise
    when called or instantiated."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{cls.__qualname__}.{name}")
        setattr(cls, name, value)
        return value

    def __call__(cls, *a, **k):
        if cls.__dict__.get("_placeholder", False):
            raise RuntimeError(f"stand-in placeholder {cls.__qualname__} was used")
        return super().__call__(*a, **k)


def _placeholder(qualname: str):
    return _PlaceholderMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname, "_placeholder": True})


class _StubModule(types.ModuleType):
    """Module whose unknown attributes are placeholders (created on first access, then fixed)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if self.__name__ == _TE_EXT and not (name.startswith("TE") or name == "_get_extra_te_kwargs"):
            # megatron-core imports TE helpers in try/except ImportError and falls back when they are
            # missing: only the TE classes ms-swift imports unconditionally exist (as placeholders)
            raise AttributeError(f"{name} (no TransformerEngine here)")
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


_TE_EXT = "megatron.core.extensions.transformer_engine"
_STUB_PREFIXES = ("megatron.training", "megatron.legacy", _TE_EXT)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == _TE_EXT or any(fullname == p or fullname.startswith(p + ".") for p in _STUB_PREFIXES[:2]):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        _fill(module)


# --------------------------------------------------------------------------- megatron.training

_ARGS = None


def get_args():
    return _ARGS


def set_args(args):
    global _ARGS
    _ARGS = args


class _Timer:
    def __init__(self, *a, **k):
        pass

    def start(self, *a, **k):
        pass

    def stop(self, *a, **k):
        pass

    def elapsed(self, *a, **k):
        return 0.0


class _Timers:
    def __call__(self, name, log_level=None):
        return _Timer()

    def log(self, *a, **k):
        pass

    def write(self, *a, **k):
        pass


_TIMERS = _Timers()


def get_timers():
    return _TIMERS


def _rank():
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def print_rank_0(message):
    if _rank() == 0:
        print(message, flush=True)


def is_last_rank():
    return not torch.distributed.is_initialized() or _rank() == torch.distributed.get_world_size() - 1


def print_rank_last(message):
    if is_last_rank():
        print(message, flush=True)


def is_rank_0():
    return _rank() == 0


def unwrap_model(model, module_instances=None):
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    module_instances = module_instances or (DistributedDataParallel, Float16Module, PassThroughModule)
    many = isinstance(model, list)
    models = model if many else [model]
    out = []
    for m in models:
        while isinstance(m, module_instances):
            m = m.module
        out.append(m)
    return out if many else out[0]


def core_transformer_config_from_args(args, config_class=None):
    """Megatron-LM's translation of the arguments into a TransformerConfig (the parts a dense
    SwiGLU GPT with RMSNorm uses): every config field present in args is copied, then the derived
    ones are set as Megatron-LM sets them."""
    import dataclasses

    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    config_class = config_class or TransformerConfig
    kw = {}
    for f in dataclasses.fields(config_class):
        if hasattr(args, f.name):
            kw[f.name] = getattr(args, f.name)
    kw["persist_layer_norm"] = not args.no_persist_layer_norm
    kw["layernorm_zero_centered_gamma"] = args.apply_layernorm_1p
    kw["layernorm_epsilon"] = args.norm_epsilon
    kw["deallocate_pipeline_outputs"] = True
    kw["pipeline_dtype"] = args.params_dtype
    kw["batch_p2p_comm"] = not args.overlap_p2p_comm
    kw["num_moe_experts"] = args.num_experts
    kw["add_bias_linear"] = not args.disable_bias_linear
    kw["add_qkv_bias"] = args.add_qkv_bias
    if args.swiglu:
        kw["activation_func"] = F.silu
        kw["gated_linear_unit"] = True
        kw["bias_activation_fusion"] = args.bias_swiglu_fusion
    else:
        kw["bias_activation_fusion"] = args.bias_gelu_fusion
    kw["init_method"] = None
    kw["output_layer_init_method"] = None
    return config_class(**kw)


def _fill(module):
    name = module.__name__
    if name == "megatron.training":
        for fn in (get_args, set_args, get_timers, print_rank_0, print_rank_last, is_last_rank, is_rank_0):
            setattr(module, fn.__name__, fn)
        module.get_tensorboard_writer = lambda: None
        module.get_wandb_writer = lambda: None
        module.get_one_logger = lambda: None
    elif name == "megatron.training.arguments":
        module.core_transformer_config_from_args = core_transformer_config_from_args
    elif name == "megatron.training.utils":
        module.unwrap_model = unwrap_model
        module.print_rank_0 = print_rank_0
        module.is_last_rank = is_last_rank
    elif name == "megatron.training.global_vars":
        module.get_args = get_args
        module.set_args = set_args
        module._GLOBAL_WANDB_WRITER = None


# --------------------------------------------------------------------------- CUDA -> CPU


def _is_cuda(d) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, int) and not isinstance(d, bool)  # a bare ordinal means a CUDA device


class CudaToCpu(TorchFunctionMode):
    """Every tensor placed on 'cuda' is placed on the CPU instead (factories, .to, .cuda)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.pin_memory:
            return args[0]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class PassThroughModule(torch.nn.Module):
    """fp32 stand-in for Megatron's Float16Module (which refuses fp32): the same ``module`` nesting,
    so names (``module.module.language_model...``) and ms-swift's ``model.module.module.vp_stage``
    are as under bf16; forward passes through unchanged."""

    def __init__(self, config, module):
        super().__init__()
        self.config = config
        self.module = module

    def forward(self, *a, **k):
        return self.module(*a, **k)

    def set_input_tensor(self, t):
        return self.module.set_input_tensor(t)


def install_cpu_redirects():
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.device_count = lambda: 0
    from megatron.core.tensor_parallel import random as tp_random

    tp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    # activation recompute saves and restores the CUDA RNG state around each checkpointed layer:
    # there is none here (no dropout either), so it is the CPU generator's, restored by torch's own call
    tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda *a, **k: None
    mode = CudaToCpu()
    mode.__enter__()  # for the whole process: the ranks are spawned for this step only
    return mode


# --------------------------------------------------------------------------- swift.megatron


def _swift_megatron_dir() -> str:
    spec = importlib.util.find_spec("swift")
    return os.path.join(os.path.dirname(spec.origin), "megatron")


def import_swift_megatron():
    """Make ``swift.megatron`` a bare package (its ``__init__`` not run) and apply the patches of its
    ``init.py`` except the TransformerEngine ones."""
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())
    import megatron.core  # noqa: F401  (the real megatron-core)
    import swift

    if "swift.megatron" not in sys.modules:
        d = _swift_megatron_dir()
        spec = importlib.machinery.ModuleSpec("swift.megatron", None, is_package=True)
        spec.submodule_search_locations = [d]
        pkg = importlib.util.module_from_spec(spec)
        pkg.__path__ = [d]
        sys.modules["swift.megatron"] = pkg
        swift.megatron = pkg
    from swift.megatron import init

    for name in ("_patch_flash_attn", "_patch_unified_memory", "_patch__batched_p2p_ops", "_patch_mla_attention",
                 "_patch_TransformerLayer", "_patch_compile_helpers", "_patch_build_train_valid_test_datasets",
                 "_patch_mrope", "_patch__write_item", "_patch_megatron_tokenizer", "_patch_mtp",
                 "_patch_megatron_timeout", "_patch_megatron_swanlab"):  # fmt: skip
        getattr(init, name)()
    # not applied: _patch_transformer_engine, _patch_TELinear, _patch_TEGroupedLinear (no TE here)
    import swift.megatron.model  # noqa: F401  (registers the Megatron model types)


def local_spec_with_sp_norms(args):
    """megatron-core 0.12.1's local layer spec (ms-swift's own local-spec call passes ``use_kitchen``,
    which 0.12.1 lacks); its torch norms accept sequence parallel and mark their parameters
    ``sequence_parallel`` (as TE's norms are), so finalize all-reduces their partial sums."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import torch_norm

    spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                    args.multi_latent_attention, normalization=args.normalization)  # fmt: skip
    if not getattr(torch_norm.WrappedTorchNorm, "_sp_standin", False):
        orig_new = torch_norm.WrappedTorchNorm.__new__

        def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                    normalization="LayerNorm"):  # fmt: skip
            sp = config.sequence_parallel
            config.sequence_parallel = False
            try:
                norm = orig_new(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
            finally:
                config.sequence_parallel = sp
            for p in norm.parameters():
                p.sequence_parallel = sp
            return norm

        torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)
        torch_norm.WrappedTorchNorm._sp_standin = True
    return spec
