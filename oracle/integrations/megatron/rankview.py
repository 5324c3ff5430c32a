"""The oracle seen from one Megatron rank: what TP rank r of pipeline stage s held at a given
stage of the step, in float64.

    view = rank_view("truth.bundle", rank=0)      # TP, SP, stage, loss convention: as recorded
    view["module.module.language_model.decoder.layers.0.mlp.linear_fc1.weight"]   # rank 0's shard

The layout (TP size, sequence parallel, pipeline stages, stage, loss convention, padded
vocabulary) is the one the merged capture recorded; arguments override it, and each override
that disagrees with the record is reported in ``warnings`` (a view at another TP is another
step: the vocabulary pads differently and the partial sums cover other chunks).

Sharded tensors: rank r's rows/columns of the oracle's full gradient (layout.shard_of; the
vocabulary is the run's padded one, rank r holding rows [r Vp/TP, (r+1) Vp/TP)). Replicated
gradients that are partial sums before finalize (layout.partial_sum) are recomputed from
per-token contributions: the oracle's step is replayed in float64 with each norm module's input
and incoming gradient kept (hooks removed when the replay returns); then for rank r

    partial_r = d/dw [ sum over r's part of <g_out, norm_w(x)> ]   via autograd with g_out masked

where r's part is its sequence chunk (sequence-parallel norms: padded positions
[r*S_pad/TP, (r+1)*S_pad/TP), S_pad = S rounded up to a multiple of TP unless given) or its heads
(q/k layernorm: query heads [r*np/TP, ...) for q, KV heads [r*ng/TP, ...) for k). Any norm is
handled the same way, whatever its formula.

Replicated transformers modules whose gradients the framework never reduced (merge's
``unreduced``: ms-swift slices Qwen3-VL's deepstack features per SP rank) are projected as rank
r's own partial truth: the float64 step replayed once more with the injected features' gradient
restricted to r's sequence chunk (``injected_partials``), like for like with what r held.

Scaling: with calculate_per_token_loss a pre-finalize gradient is of the SUM of token losses and
post-finalize of the MEAN; the oracle's own reduction is converted with its token count.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ...bundle.store import Bundle
from ...errors import BundleError, UsageError
from ...metrics import norm, rel_l2
from ...precision.mode import PrecisionMode
from ...replay.run import run_step
from ...replay.setup import recipe_of
from .layout import Heads, padded_vocab, shard_of
from .names import strip_wrappers

_SUFFIX = ".weight"
STAGES = ("pre-finalize", "post-finalize")


def _norm_partials(oracle: Bundle, modules: dict[str, str], *, tp: int, seq_pad: int | None) -> dict[str, list[torch.Tensor]]:
    """module name -> [partial gradient of its weight for rank r, r < tp]; mode 'tokens' or 'heads'."""
    kept: dict[str, dict] = {}
    handles: list[Any] = []

    def fwd(m, args, out, mod_name):
        kept[mod_name] = {"x": args[0].detach(), "module": m}
        out.register_hook(lambda g: kept[mod_name].__setitem__("g", g.detach()))  # dies with the graph

    def instrument(model):
        for mod_name in modules:
            handles.append(model.get_submodule(mod_name).register_forward_hook(lambda m, a, o, n=mod_name: fwd(m, a, o, n)))

    try:
        run_step(oracle, "fp64", instrument=instrument)
    finally:
        for h in handles:
            h.remove()
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


def injected_partials(oracle: Bundle, names: list[str], *, tp: int, rank: int, seq_pad: int | None,
                      dtype: str = "fp64", jitter_seed: int | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """HF name -> rank ``rank``'s own gradient of a replicated parameter whose injected features the
    framework sliced per SP rank (replicas.py): the step replayed (``dtype``: float64, or an emulated
    band member with its ``jitter_seed``, as ``replay --ensemble`` runs it) with those features'
    gradient restricted to the rank's sequence chunk (positions [r S_pad/TP, (r+1) S_pad/TP)), the
    main path whole (recipe.restrict_injected). {} when the recipe injects nothing."""
    recipe = recipe_of(oracle)
    applied: list[bool] = []

    def instrument(model):
        tokens = next(t for n, t in oracle.iter_group("inputs") if n in ("input_ids", "tokens"))
        b, t = tokens.shape
        chunk = (seq_pad or math.ceil(t / tp) * tp) // tp
        keep = torch.zeros(b, t, dtype=torch.bool)
        keep[:, rank * chunk : min((rank + 1) * chunk, t)] = True  # (B, T): this rank's chunk
        applied.append(recipe.restrict_injected(model, keep))

    model, _, _, _ = run_step(oracle, dtype, jitter_seed=jitter_seed, instrument=instrument)
    if not applied or not applied[0]:
        return {}
    params = dict(model.named_parameters())
    return {n: params[n].grad.detach() for n in names if n in params and params[n].grad is not None}


def recorded_layout(oracle: Bundle, **flags: Any) -> tuple[dict[str, Any], list[str]]:
    """The layout the oracle's merged capture recorded, with ``flags`` (not None) overriding it;
    -> (layout, a warning per override that disagrees with the record)."""
    meg = oracle.get("megatron")
    if oracle.kind != "oracle" or not meg:
        raise BundleError(f"{oracle.path} is not an oracle of a merged Megatron capture (oracle merge, then oracle replay)")
    rec = {"tp_size": meg.get("tp_size"), "sequence_parallel": meg.get("sequence_parallel"), "stage": meg.get("stage"),
           "calculate_per_token_loss": meg.get("calculate_per_token_loss"), "pp_size": meg.get("pp_size", 1)}  # fmt: skip
    out, warnings = dict(rec), []
    for k, v in flags.items():
        if v is None:
            continue
        if rec.get(k) is not None and rec[k] != v:
            warnings.append(
                f"{k} = {v!r} overrides the recorded {rec[k]!r}: the view is of another layout than the step that ran"
            )
        out[k] = v
    if out["tp_size"] is None:
        raise BundleError(f"{oracle.path} records no TP size; pass --tp")
    if out["stage"] not in STAGES:
        raise BundleError(f"stage {out['stage']!r}: expected one of {', '.join(STAGES)}")
    if out["calculate_per_token_loss"] is None:
        out["calculate_per_token_loss"] = True
    return out, warnings


def loss_scale(oracle: Bundle, lay: dict[str, Any]) -> float:
    """The factor from the oracle's loss reduction to the one a rank held at ``lay``'s stage: the SUM
    of token losses before finalize with calculate_per_token_loss, else the MEAN."""
    meg = oracle.get("megatron") or {}
    loss = oracle.get("loss") or {}
    n_tok = loss.get("num_tokens") or meg.get("num_tokens")
    want = "sum" if lay["calculate_per_token_loss"] and lay["stage"] == "pre-finalize" else "mean"
    if loss.get("reduction") == want:
        return 1.0
    if not n_tok:
        raise BundleError(f"{oracle.path} records no token count: cannot turn its {loss.get('reduction')} loss into a {want}")
    return float(n_tok) if want == "sum" else 1.0 / float(n_tok)


def rank_view(
    oracle_path: str | Path, *, rank: int = 0, pp_rank: int = 0, tp_size: int | None = None,
    sequence_parallel: bool | None = None, stage: str | None = None, calculate_per_token_loss: bool | None = None,
    seq_len_padded: int | None = None, warnings: list[str] | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """mcore name (as that rank names it) -> what that rank held, float64. Layout as recorded unless given."""
    oracle = Bundle(oracle_path)
    lay, notes = recorded_layout(oracle, tp_size=tp_size, sequence_parallel=sequence_parallel, stage=stage,
                                 calculate_per_token_loss=calculate_per_token_loss)  # fmt: skip
    if warnings is not None:
        warnings += notes
    meg = oracle.get("megatron")
    tp, sp, stage_ = lay["tp_size"], bool(lay["sequence_parallel"]), lay["stage"]
    if not 0 <= rank < tp:
        raise UsageError(f"--rank {rank} is outside TP size {tp}: choose 0..{tp - 1}")
    if not 0 <= pp_rank < lay["pp_size"]:
        raise UsageError(f"--pp-rank {pp_rank} is outside PP size {lay['pp_size']}: choose 0..{lay['pp_size'] - 1}")
    heads = Heads.from_config(meg["config"])
    heads.check(tp)
    vocab = meg.get("vocab") or {}
    vocab_rows = None
    if tp != meg.get("tp_size") and vocab.get("true"):
        vocab_rows = padded_vocab(vocab["true"], tp, vocab.get("divisible_by") or 128)
    scale = loss_scale(oracle, lay)
    grads = {n: oracle.load("grads", n) for n in oracle.names("grads")}
    entries = {m.get("local", g): m for g, m in meg["mapping"].items() if m.get("pp_rank", 0) == pp_rank}
    partial_modules: dict[str, str] = {}
    if stage_ == "pre-finalize" and tp > 1:
        for m in entries.values():
            how = m.get("partial_before_finalize")
            if m["kind"] == "norm" and how and (how == "heads" or sp):
                partial_modules[m["hf"][0].removesuffix(_SUFFIX)] = how
    partials = _norm_partials(oracle, partial_modules, tp=tp, seq_pad=seq_len_padded) if partial_modules else {}
    injected: dict[str, torch.Tensor] = {}
    if meg.get("unreduced") and tp > 1 and sp:  # the framework left per-rank partial gradients (replicas.py)
        replicas = [m["hf"][0] for m in entries.values() if m["kind"] == "replica"]
        injected = injected_partials(oracle, replicas, tp=tp, rank=rank, seq_pad=seq_len_padded)
    view: dict[str, torch.Tensor] = {}
    for mname, m in entries.items():
        hf = m["hf"]
        if hf[0] in injected:
            t = injected[hf[0]]
        elif hf[0].removesuffix(_SUFFIX) in partials:
            t = partials[hf[0].removesuffix(_SUFFIX)][rank]
        elif all(n in grads for n in hf):
            try:
                t = shard_of(m["kind"], [grads[n] for n in hf], tp=tp, rank=rank, heads=heads, dim=m.get("dim", 0),
                             vocab_rows=vocab_rows)  # fmt: skip
            except (BundleError, RuntimeError) as e:
                raise BundleError(f"{mname} (from {', '.join(hf)}): {e}") from None
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
            if g.shape != t.shape:
                raise BundleError(f"{b.path}: grads/{n} has shape {tuple(g.shape)} but the view of that rank has {tuple(t.shape)}; "
                                  "the capture is of another layout (TP size, stage or padded vocabulary)")  # fmt: skip
            ok = torch.isfinite(t)
            out[n] = rel_l2(g[ok], t[ok])
    return out


def log_rows(view: dict[str, torch.Tensor], logs, labels) -> dict[str, Any]:
    """Per parameter: the truth's norm on this rank (finite elements), each log's norm and its
    deviation |n_log / n_truth - 1|, and which log is closer; ``wins`` counts them per log."""
    truth = {strip_wrappers(n): norm(t[torch.isfinite(t)]) for n, t in view.items()}
    rows, wins = [], {lab: 0 for lab in labels}
    for name in sorted(truth, key=lambda n: (n.count("layers"), n)):
        vals = [next((v for k, v in log.norms.items() if strip_wrappers(k) == name), None) for log in logs]
        if all(v is None for v in vals):
            continue
        devs = {lab: abs(v / truth[name] - 1) for lab, v in zip(labels, vals) if v is not None and truth[name] > 0}
        best = min(devs, key=devs.get) if devs else None
        if best in wins:
            wins[best] += 1
        rows.append({"name": name, "oracle": truth[name], "logs": dict(zip(labels, vals)), "deviation": devs, "closer": best})
    return {"labels": list(labels), "params": rows, "wins": wins}


def compare_logs(view: dict[str, torch.Tensor], logs, labels) -> str:
    """Per parameter: the truth's norm on this rank, each log's norm, and which log is closer."""
    r = log_rows(view, logs, labels)
    w = max([64] + [len(row["name"]) for row in r["params"]])  # whole names, never cut
    lines = [f"  {'parameter':<{w}} {'oracle':>11} " + " ".join(f"{lab:>11}" for lab in labels) + "  closer"]
    for row in r["params"]:
        vals = [row["logs"][lab] for lab in labels]
        lines.append(f"  {row['name']:<{w}} {row['oracle']:>11.5g} " + " ".join(f"{v:>11.5g}" if v is not None else f"{'-':>11}" for v in vals)
                     + f"  {row['closer'] or '-'}")  # fmt: skip
    lines.append("closer to the truth: " + ", ".join(f"{k} on {v} parameter(s)" for k, v in r["wins"].items()))
    return "\n".join(lines)


__all__ = ["rank_view", "recorded_layout", "injected_partials", "loss_scale", "compare_rank", "compare_logs", "log_rows"]
