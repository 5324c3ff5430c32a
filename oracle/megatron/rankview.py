"""The oracle seen from one Megatron rank: what TP rank r held at a given stage, in float64.

    view = rank_view("truth.bundle", tp_size=8, rank=0, sequence_parallel=True, stage="pre-finalize")
    view["module.module.language_model.decoder.layers.0.mlp.linear_fc1.weight"]   # rank 0's shard

Sharded tensors: rank r's rows/columns of the oracle's full gradient (layout.shard_of). Replicated
gradients that are partial sums before finalize are recomputed from per-token contributions: the
oracle's step is replayed in float64 with each norm module's input and incoming gradient kept;
then for rank r

    partial_r = d/dw [ sum over r's part of <g_out, norm_w(x)> ]   via autograd with g_out masked

where r's part is its sequence chunk (sequence-parallel norms: padded positions
[r*S_pad/TP, (r+1)*S_pad/TP), S_pad = S rounded up to a multiple of TP unless given) or its heads
(q/k layernorm: query heads [r*np/TP, ...) for q, KV heads [r*ng/TP, ...) for k). Any norm is
handled the same way, whatever its formula.

Scaling: with calculate_per_token_loss a pre-finalize gradient is of the SUM of token losses and
post-finalize of the MEAN; the oracle's own reduction is converted with its token count.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..bundle import Bundle
from ..errors import BundleError
from ..metrics import rel_l2
from ..numerics import PrecisionMode
from ..replay import run_step
from .layout import HEAD_NORM_RX, Heads, shard_of

_SUFFIX = ".weight"


def _norm_partials(
    oracle: Bundle, modules: dict[str, str], *, tp: int, heads: Heads, seq_pad: int | None
) -> dict[str, list[torch.Tensor]]:
    """module name -> [partial gradient of its weight for rank r, r < tp], mode 'tokens' or 'q'/'k' heads."""
    kept: dict[str, dict] = {}

    def instrument(model):
        for mod_name in modules:
            mod = model.get_submodule(mod_name)

            def fwd(m, args, out, mod_name=mod_name):
                kept[mod_name] = {"x": args[0].detach(), "module": m}
                out.register_hook(lambda g, mod_name=mod_name: kept[mod_name].__setitem__("g", g.detach()))

            mod.register_forward_hook(fwd)

    run_step(oracle, "fp64", instrument=instrument)
    out: dict[str, list[torch.Tensor]] = {}
    for mod_name, how in modules.items():
        k = kept[mod_name]
        x, g, m = k["x"], k["g"], k["module"]
        parts = []
        for r in range(tp):
            mask = torch.zeros_like(g)
            if how == "tokens":  # (B, T, h): rank r's chunk of the padded sequence
                t = g.shape[1]
                chunk = (seq_pad or math.ceil(t / tp) * tp) // tp
                mask[:, r * chunk : min((r + 1) * chunk, t)] = 1
            else:  # (B, T, heads, d): rank r's heads
                n = g.shape[2] // tp
                mask[:, :, r * n : (r + 1) * n] = 1
            with PrecisionMode(torch.float64):
                y = m(x)
                (w_grad,) = torch.autograd.grad(y, m.weight, g * mask)
            parts.append(w_grad.detach())
        out[mod_name] = parts
    return out


def rank_view(
    oracle_path: str | Path, *, tp_size: int, rank: int, sequence_parallel: bool, stage: str,
    calculate_per_token_loss: bool = True, seq_len_padded: int | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    oracle = Bundle(oracle_path)
    meg = oracle.get("megatron")
    if oracle.kind != "oracle" or not meg:
        raise BundleError(f"{oracle.path} is not an oracle of a merged Megatron capture (oracle merge, then oracle replay)")
    if not 0 <= rank < tp_size:
        raise BundleError(f"rank {rank} is outside TP size {tp_size}")
    heads = Heads.from_config(meg["config"])
    loss = oracle.get("loss") or {}
    n_tok = loss.get("num_tokens") or meg.get("num_tokens")
    want = "sum" if calculate_per_token_loss and stage == "pre-finalize" else "mean"
    scale = 1.0
    if loss.get("reduction") != want:
        scale = float(n_tok) if want == "sum" else 1.0 / float(n_tok)
    grads = {n: oracle.load("grads", n) for n in oracle.names("grads")}
    partial_modules: dict[str, str] = {}
    for mname, m in meg["mapping"].items():
        hf = m["hf"][0]
        if stage == "pre-finalize" and m["kind"] == "norm" and tp_size > 1:
            if HEAD_NORM_RX.search(mname):
                partial_modules[hf.removesuffix(_SUFFIX)] = "heads"
            elif sequence_parallel:
                partial_modules[hf.removesuffix(_SUFFIX)] = "tokens"
    partials = _norm_partials(oracle, partial_modules, tp=tp_size, heads=heads, seq_pad=seq_len_padded) if partial_modules else {}
    view: dict[str, torch.Tensor] = {}
    for mname, m in meg["mapping"].items():
        hf = m["hf"]
        if hf[0].removesuffix(_SUFFIX) in partials:
            t = partials[hf[0].removesuffix(_SUFFIX)][rank]
        elif all(n in grads for n in hf):
            t = shard_of(m["kind"], [grads[n] for n in hf], tp=tp_size, rank=rank, heads=heads, dim=m.get("dim", 0))
        else:
            continue
        view[mname] = t * scale
    return view


def compare_rank(view: dict[str, torch.Tensor], rank_bundle: str | Path) -> dict[str, float]:
    """Relative L2 error of one rank capture's gradients against its view, per mcore name."""
    b = Bundle(rank_bundle)
    out = {}
    for n in b.names("grads"):
        if n in view:
            g, t = b.load("grads", n).double(), view[n]
            ok = torch.isfinite(t)
            out[n] = rel_l2(g[ok], t[ok])
    return out


def compare_logs(view: dict[str, torch.Tensor], logs, labels) -> str:
    """Per parameter: the truth's norm on this rank, each log's norm, and which log is closer."""
    from .names import strip_wrappers

    truth = {strip_wrappers(n): float(t[torch.isfinite(t)].norm()) for n, t in view.items()}
    lines = [f"  {'parameter':<64} {'oracle':>11} " + " ".join(f"{lab:>11}" for lab in labels) + "  closer"]
    wins = {lab: 0 for lab in labels}
    for name in sorted(truth, key=lambda n: (n.count("layers"), n)):
        vals = [next((v for k, v in log.norms.items() if strip_wrappers(k) == name), None) for log in logs]
        if all(v is None for v in vals):
            continue
        devs = {lab: abs(v / truth[name] - 1) for lab, v in zip(labels, vals) if v is not None and truth[name] > 0}
        best = min(devs, key=devs.get) if devs else "-"
        if best in wins:
            wins[best] += 1
        lines.append(f"  {name[-64:]:<64} {truth[name]:>11.5g} " + " ".join(f"{v:>11.5g}" if v is not None else f"{'-':>11}" for v in vals)
                     + f"  {best}")  # fmt: skip
    lines.append("closer to the truth: " + ", ".join(f"{k} on {v} parameter(s)" for k, v in wins.items()))
    return "\n".join(lines)


__all__ = ["rank_view", "compare_rank", "compare_logs"]
