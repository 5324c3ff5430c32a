"""Capture one training step of one sample from any training loop.

    import oracle
    with oracle.Capture(model, "step.bundle", precision="amp-bf16", recipe="qwen3-vl",
                        model_config=cfg_dict) as cap:
        with torch.autocast("cuda", torch.bfloat16):
            out = model(**batch)                  # the inputs handed to model are recorded
        loss = my_loss(out.logits, labels)
        cap.add_inputs(labels=labels)             # anything the loss used besides the model inputs
        cap.set_loss(loss, reduction="mean", num_tokens=int((labels != -100).sum()))
        loss.backward()
    optimizer.step()                              # after the block: weights must be those the forward used

With ``modules=[names]`` each named module's boundary tensors are recorded too (modules.py), for
``oracle replay --local``.

On a clean exit the bundle holds the inputs (first forward call only), every parameter's value
as held by the model, every parameter's gradient (``main_grad`` where it exists, else ``.grad``)
in its own dtype, and the loss. Hooks are removed in every case; nothing is written if the block
raises. Tensors are written in shards (BundleWriter.add_stream): at most one shard is held on the
CPU beyond the model itself.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..bundle.store import BundleWriter
from ..precision import capture_policy
from .modules import ModuleRecorder

SHARD_BYTES = 1 << 30  #: a capture's weights and grads are written in files of about this size


def versions() -> dict[str, str]:
    out = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    from ..version import __version__

    out["oracle"] = __version__
    return out


def describe_device(device: torch.device | str) -> dict[str, Any]:
    device = torch.device(device)
    d: dict[str, Any] = {"type": device.type, "torch_threads": torch.get_num_threads()}
    if device.type == "cuda" and torch.cuda.is_available():
        d["name"] = torch.cuda.get_device_name(device)
        d["cuda"] = torch.version.cuda
    elif device.type == "npu":  # pragma: no cover - only on Ascend
        d["name"] = "npu"
    else:
        d["name"] = platform.processor() or platform.machine()
    return d


def gradient_of(p: nn.Parameter) -> torch.Tensor | None:
    """Megatron's ``main_grad`` (the fp32 accumulator) where it exists, else ``.grad``."""
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad


class Capture:
    """Context manager that records one step of ``model`` into a bundle at ``out``."""

    def __init__(
        self,
        model: nn.Module,
        out: str,
        *,
        precision: str = "fp32",
        recipe: str | None = None,
        model_config: Mapping[str, Any] | None = None,
        seed: int | None = None,
        overwrite: bool = False,
        metadata: Mapping[str, Any] | None = None,
        modules: list[str] | None = None,
        module_budget_bytes: int | None = None,
    ):
        capture_policy(precision)  # a device precision from the one table, else UsageError
        self.model = model
        self.out = out
        self.precision = precision
        self.recipe = recipe
        self.model_config = dict(model_config or {})
        self.seed = seed
        self.overwrite = overwrite
        self.metadata = dict(metadata or {})
        self.inputs: dict[str, torch.Tensor] = {}
        self.static_inputs: dict[str, Any] = {}
        self.loss: dict[str, Any] | None = None
        self._handle = None
        self._device = None
        self.recorder = ModuleRecorder(model, modules, budget_bytes=module_budget_bytes) if modules else None

    # -- recording --------------------------------------------------------------------------
    def _pre_hook(self, module, args, kwargs):
        if self._handle is not None:  # first forward only: one step of one sample
            self._handle.remove()
            self._handle = None
        for i, a in enumerate(args):
            self._record(f"arg{i}", a)
        for k, v in kwargs.items():
            self._record(k, v)

    def _record(self, name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self._device = self._device or value.device
            self.inputs[name] = value.detach().to("cpu", copy=True)
        elif isinstance(value, (bool, int, float, str)) or value is None:
            self.static_inputs[name] = value

    def add_inputs(self, **tensors: torch.Tensor) -> None:
        """Record tensors the loss used that were not handed to the model (labels, loss mask)."""
        for k, v in tensors.items():
            self._record(k, v)

    def set_loss(self, loss: torch.Tensor, *, reduction: str, num_tokens: int | None = None) -> None:
        """Record the loss value and its convention (``mean`` over loss tokens, or ``sum``)."""
        if reduction not in ("mean", "sum"):
            raise ValueError("reduction must be 'mean' or 'sum'")
        self.loss = {"value": float(loss.detach().float().item()), "reduction": reduction, "num_tokens": num_tokens}

    # -- context ----------------------------------------------------------------------------
    def __enter__(self) -> Capture:
        self._handle = self.model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        if self.recorder is not None:
            self.recorder.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.recorder is not None:
            self.recorder.close()
        if exc_type is not None:
            return
        self.write()

    def _record_packing(self) -> dict[str, Any] | None:
        """Per-sample boundaries of a packed step, from ``cu_seqlens`` (or flash-attention's
        ``cu_seq_lens_q``) when the model received them, else from restarting text positions."""
        from .packing import cu_seqlens, lengths_from_positions

        cu = self.inputs.get("cu_seqlens", self.inputs.get("cu_seq_lens_q"))
        if cu is None and "position_ids" in self.inputs:
            pos = self.inputs["position_ids"]
            text = pos[0] if pos.ndim == 3 and pos.shape[0] == 4 else (pos if pos.ndim <= 2 else None)
            lengths = (
                lengths_from_positions(text[0] if text is not None and text.ndim == 2 else text) if text is not None else None
            )
            cu = cu_seqlens(lengths) if lengths else None
        if cu is None:
            return None
        self.inputs["cu_seqlens"] = cu.to(torch.int64).reshape(-1)  # part of the step's fingerprint
        return {"cu_seqlens": self.inputs["cu_seqlens"].tolist()}

    def write(self) -> None:
        params = dict(self.model.named_parameters())
        packing = self._record_packing()
        device = self._device or next(iter(params.values())).device
        no_grad = [n for n, p in params.items() if gradient_of(p) is None]
        with BundleWriter(self.out, "capture", overwrite=self.overwrite) as w:
            w.manifest.update(
                recipe={"name": self.recipe, "config": self.model_config},
                precision=self.precision,
                device=describe_device(device),
                versions=versions(),
                seed=self.seed,
                loss=self.loss,
                static_inputs=self.static_inputs,
                no_grad=no_grad,
                packing=packing,
                metadata=self.metadata,
            )
            w.add("inputs", self.inputs)
            # one tensor at a time to the CPU, in shards of at most SHARD_BYTES: never a full copy of the model
            w.add_stream("weights", ((n, p.detach().cpu()) for n, p in params.items()), max_bytes=SHARD_BYTES)
            w.add_stream("grads", ((n, gradient_of(p).cpu()) for n, p in params.items() if gradient_of(p) is not None),
                         max_bytes=SHARD_BYTES)  # fmt: skip
            if self.recorder is not None:
                w.manifest["modules"] = self.recorder.manifest()
                w.manifest["modules_over_budget"] = self.recorder.over_budget
                for group, tensors in self.recorder.groups().items():
                    w.add(group, tensors)
