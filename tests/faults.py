"""Faults planted in the tiny Qwen3-VL from test code, through ``instrument(model)`` hooks.

Each is a backward-side fault: the forward (and so the loss) is untouched, the gradients from the
planted module upstream are wrong -- the symptom of the original report.
"""

from __future__ import annotations

import torch


def _straight_through(correct: torch.Tensor, wrong: torch.Tensor) -> torch.Tensor:
    """Forward value of ``correct``, backward of ``wrong``."""
    return correct.detach() + (wrong - wrong.detach())


def scale_grad(path: str, factor: float):
    """Scale the gradient arriving at module ``path`` (its grad_output) by ``factor``."""

    def instrument(model):
        mod = model.get_submodule(path)
        mod.register_full_backward_pre_hook(lambda m, go: tuple(g * factor if g is not None else g for g in go))

    return instrument


def wrong_mask_backward(layer: int):
    """Decoder layer ``layer``'s attention backward sees a mask that leaks one future token."""

    def instrument(model):
        attn = model.model.language_model.layers[layer].self_attn

        def hook(module, args, kwargs, output):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            t = hidden.shape[1]
            allowed = torch.ones(t, t, dtype=torch.bool, device=hidden.device).tril(diagonal=1)
            mask = torch.zeros(1, 1, t, t, dtype=hidden.dtype, device=hidden.device).masked_fill(~allowed, float("-inf"))
            kw = {k: (None if k in ("cache", "past_key_values") else v) for k, v in kwargs.items()}
            kw["attention_mask"] = mask
            wrong = module.forward(*args, **kw)[0]
            return (_straight_through(output[0], wrong),) + tuple(output[1:])

        attn.register_forward_hook(hook, with_kwargs=True)

    return instrument


def lowp_norm_backward(layer: int, dtype=torch.bfloat16):
    """Decoder layer ``layer``'s post-attention RMSNorm runs its backward in ``dtype``."""

    def instrument(model):
        norm = model.model.language_model.layers[layer].post_attention_layernorm

        def hook(module, args, output):
            x = args[0].to(dtype)
            w = module.weight.to(dtype)
            low = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon))
            return _straight_through(output, low.to(output.dtype))

        norm.register_forward_hook(hook)

    return instrument


class _NanInBackward(torch.autograd.Function):
    """Identity forward; the backward puts a NaN into the first element of the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g.view(-1)[0] = float("nan")
        return g


def nan_in_backward(path: str):
    """Module ``path``'s backward sends a NaN back (its forward is untouched)."""

    def instrument(model):
        model.get_submodule(path).register_forward_hook(lambda m, a, out: _NanInBackward.apply(out))

    return instrument


def nan_in_forward(path: str):
    """Module ``path`` returns one NaN in its output."""

    def hook(m, a, out):
        out = out.clone()
        out.view(-1)[0] = float("nan")
        return out

    def instrument(model):
        model.get_submodule(path).register_forward_hook(hook)

    return instrument


def bf16_attention(layer: int):
    """Decoder layer ``layer``'s attention kernel runs in bf16 (q, k, v and its output rounded):
    an op class run in the wrong precision, forward and backward."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class Low(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                q, k, v = (a.to(torch.bfloat16) for a in args[:3])
                return func(q, k, v, *args[3:], **kwargs).to(args[0].dtype)
            return func(*args, **kwargs)

    def instrument(model):
        attn = model.model.language_model.layers[layer].self_attn
        mode = Low()
        attn.register_forward_pre_hook(lambda m, a: (mode.__enter__(), None)[1])
        attn.register_forward_hook(lambda m, a, out: mode.__exit__(None, None, None))

    return instrument


def bf16_activation(layer: int):
    """Decoder layer ``layer``'s MLP activation runs in bf16."""

    def instrument(model):
        act = model.model.language_model.layers[layer].mlp.act_fn
        act.register_forward_hook(
            lambda m, a, out: m(a[0].to(torch.bfloat16)).to(a[0].dtype) if a[0].dtype != torch.bfloat16 else out
        )

    return instrument
