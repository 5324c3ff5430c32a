"""MindSpeed's own NPU ops on the CPU: MindSpeed builds ``npu_matmul_add_fp32`` and
``npu_rotary_position_embedding`` from C++ against CANN at first use (``mindspeed.op_builder``,
``torch.utils.cpp_extension.load``), which cannot happen off Ascend. ``install()`` puts the
stand-in's ops (``npu_ops``) into the op builders' loaded-ops cache under the ops' names, so
MindSpeed's own Python wrappers (``mindspeed.ops.npu_matmul_add``,
``mindspeed.ops.npu_rotary_position_embedding``) run unchanged and call them. Test support only."""

from __future__ import annotations

import types

import npu_ops

OPS = {"npu_matmul_add_fp32": npu_ops.npu_matmul_add_fp32,
       "npu_rotary_position_embedding": npu_ops.npu_rotary_position_embedding}  # fmt: skip


def install() -> list[str]:
    """Register the ops; returns their names. Needs mindspeed importable (after torch_npu)."""
    import os

    from mindspeed.op_builder.builder import MindSpeedOpBuilder

    # the ATB builders (npu_matmul_add_fp32's) look for the Ascend ops' paths before their cache:
    # a marker, never read since the cache answers
    for var in ("ASDOPS_HOME_PATH", "ASDOPS_OPS_PATH"):
        os.environ.setdefault(var, "<torch_npu stand-in: no Ascend ops>")

    for name, fn in OPS.items():
        MindSpeedOpBuilder._loaded_ops[name] = types.SimpleNamespace(**{name: fn}, __standin__=True)
    return sorted(OPS)


class _RopeSinSign:
    """Planted fault ``rope_sin_sign`` (npu_ops/faults.py) around MindSpeed's torch rotary
    ``_apply_rotary_pos_emb_bshd``: the forward is that function's own (bitwise), the backward
    dt = g*cos - R^T(g*sin) on the rotated part (R^T = -R: dt = g*cos + R(g*sin)) instead of
    g*cos + R^T(g*sin), in t's dtype as autograd would; the pass-through part gets g. A backward
    call the fault does not hit is autograd of the same function."""

    @staticmethod
    def make(inner):
        import torch
        from npu_ops import faults

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t, freqs, kw):
                ctx.save_for_backward(t, freqs)
                ctx.kw = kw
                return inner(t, freqs, **kw)

            @staticmethod
            def backward(ctx, g):
                t, freqs = ctx.saved_tensors
                kw = ctx.kw
                if not faults.hit("rope_sin_sign"):
                    with torch.enable_grad():
                        x = t.detach().requires_grad_(True)
                        return torch.autograd.grad(inner(x, freqs, **kw), x, g)[0], None, None
                from megatron.core.models.common.embeddings.rotary_pos_embedding import _rotate_half

                if kw.get("multi_latent_attention"):
                    raise NotImplementedError("rope_sin_sign: multi-latent attention is not planted")
                rot = freqs.shape[-1]
                mscale = kw.get("mscale", 1.0)
                cos_, sin_ = ((f(freqs) * mscale).to(t.dtype) for f in (torch.cos, torch.sin))
                g1, g_pass = g[..., :rot], g[..., rot:]
                dt = g1 * cos_ + _rotate_half(g1 * sin_, kw.get("rotary_interleaved", False))  # the sign error
                return torch.cat((dt, g_pass), dim=-1), None, None

        return Fn


def install_faults() -> list[str]:
    """The test-only patches for the faults that act on MindSpeed's Python rather than on an NPU op,
    when ``TORCH_NPU_STANDIN_FAULTS`` names them; call after MindSpeed's ``repatch`` (which would
    undo them). Returns the names installed. ``sp_norm_unreduced`` is the step's (it needs the model)."""
    from npu_ops import faults

    done = []
    if faults.armed("rope_sin_sign"):
        import megatron.core.models.common.embeddings.rope_utils as ru

        inner = ru._apply_rotary_pos_emb_bshd  # MindSpeed's, put there by its patches
        fn = _RopeSinSign.make(inner)

        def planted(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
            kw = {"rotary_interleaved": rotary_interleaved, "multi_latent_attention": multi_latent_attention,
                  "mscale": mscale}  # fmt: skip
            return fn.apply(t, freqs, kw) if t.requires_grad else inner(t, freqs, **kw)

        ru._apply_rotary_pos_emb_bshd = planted
        done.append("rope_sin_sign")
    return done


def unmark_final_norm(model) -> list[str]:
    """Planted fault ``sp_norm_unreduced``: the final norm's weight loses its ``sequence_parallel``
    mark, so finalize_model_grads does not all-reduce it across TP (Megatron-LM #1446). Returns the
    parameters unmarked."""
    from npu_ops import faults

    if not faults.armed("sp_norm_unreduced"):
        return []
    names = [n for n, p in model.named_parameters() if n.endswith("decoder.final_layernorm.weight")]
    for n, p in model.named_parameters():
        if n in names:
            p.sequence_parallel = False
    return names
