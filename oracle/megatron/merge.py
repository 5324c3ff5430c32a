"""Merge per-rank Megatron captures (hook.py) into one ordinary capture bundle under HF names.

Gradients before ``finalize_model_grads`` ("pre-finalize") of replicated norm weights are
per-rank partial sums: over each rank's sequence chunk for parameters Megatron marks
``sequence_parallel``, over each rank's heads for q/k layernorm. They are summed over TP ranks
here (what finalize's all-reduce does). After finalize every rank holds the sum; rank 0's copy is
taken and the others are checked against it. Sharded tensors merge per layout.py.

Loss convention: with ``calculate_per_token_loss`` a pre-finalize gradient is d(sum of token
losses)/d(theta); finalize divides by the token count. The merged capture records reduction
``sum`` or ``mean`` accordingly, so its fp64 replay computes the same quantity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .. import recipe as recipes
from ..bundle import Bundle, BundleWriter
from ..errors import BundleError, MismatchError
from .layout import HEAD_NORM_RX, Heads, kind_of, merge_tensor
from .names import NameMap, strip_wrappers

POST_AGREEMENT = 1e-5  # post-finalize copies of a replicated gradient must agree to this (relative)


def rank_bundles(paths: list[str | Path]) -> list[Bundle]:
    """Each path is a rank bundle, or a folder of ``rank*`` bundles (hook.py's layout)."""
    out = []
    for p in map(Path, paths):
        if (p / "manifest.json").exists():
            out.append(Bundle(p))
        elif p.is_dir():
            found = sorted(q for q in p.iterdir() if q.name.startswith("rank") and (q / "manifest.json").exists())
            if not found:
                raise BundleError(f"{p} holds no rank bundle (rank*/manifest.json)")
            out += [Bundle(q) for q in found]
        else:
            out.append(Bundle(p))  # raises InputNotFound with the path
    for b in out:
        if "coords" not in (b.manifest.get("megatron") or {}):  # a merged capture has a megatron section, no coords
            raise BundleError(
                f"{b.path} is not a Megatron rank capture (no 'megatron' section with rank coordinates); write it with oracle.megatron.capture_rank"
            )
    return out


def _check_ranks(bundles: list[Bundle]) -> tuple[list[Bundle], dict[str, Any]]:
    metas = [b.manifest["megatron"] for b in bundles]
    stages = {m["stage"] for m in metas}
    if len(stages) > 1:
        raise BundleError(f"rank captures mix stages {sorted(stages)}; merge one stage at a time")
    stage = stages.pop()
    tp_sizes = {m["coords"]["tp_size"] for m in metas}
    if len(tp_sizes) > 1:
        raise BundleError(f"rank captures disagree on the TP size: {sorted(tp_sizes)}")
    tp = tp_sizes.pop()
    if any(m["coords"].get("pp_size", 1) > 1 for m in metas):
        raise BundleError("pipeline parallel captures (PP > 1) are not merged yet; capture with PP = 1")
    dp = {m["coords"].get("dp_size", 1) for m in metas}
    if stage == "pre-finalize" and max(dp) > 1:
        raise BundleError(
            "pre-finalize gradients with DP > 1 hold different samples per DP rank; capture with DP = 1 or post-finalize"
        )
    chosen = {}
    for b, m in zip(bundles, metas):
        if m["coords"].get("dp_rank", 0) == 0:
            r = m["coords"]["tp_rank"]
            if r in chosen:
                raise BundleError(f"two captures of TP rank {r}: {chosen[r].path} and {b.path}")
            chosen[r] = b
    missing = [r for r in range(tp) if r not in chosen]
    if missing:
        raise BundleError(f"TP size is {tp} but the captures of TP rank(s) {missing} are missing; pass every rank's bundle")
    ranks = [chosen[r] for r in range(tp)]
    fp = ranks[0].fingerprint()["inputs"]
    for b in ranks[1:]:
        if b.fingerprint()["inputs"] != fp:
            raise MismatchError(f"{b.path} saw another batch than {ranks[0].path}: TP ranks of one step share the batch")
    return ranks, {"stage": stage, "tp": tp, "meta": metas[0]}


def _partial(name: str, layout: dict, tp: int) -> bool:
    """Whether this replicated gradient is a per-rank partial sum before finalize."""
    return tp > 1 and (layout.get("sequence_parallel", False) or bool(HEAD_NORM_RX.search(name)))


def merge_ranks(paths: list[str | Path], out: str | Path, *, recipe: str, hf_config: dict[str, Any],
                overwrite: bool = False) -> Path:  # fmt: skip
    bundles = rank_bundles(paths)
    ranks, info = _check_ranks(bundles)
    rec = recipes.get(recipe)
    if not rec.megatron_names:
        raise BundleError(f"recipe {recipe!r} has no megatron_names table")
    names = NameMap(rec.megatron_names)
    meta = info["meta"]
    heads = Heads.from_config(meta["config"]) if meta["config"].get("num_attention_heads") else Heads.from_hf(hf_config)
    config = {**heads.as_config(), **meta["config"]}
    vocab = hf_config.get("vocab_size") or (hf_config.get("text_config") or {}).get("vocab_size")
    tp, stage = info["tp"], info["stage"]
    weights: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    mapping: dict[str, dict[str, Any]] = {}
    warnings: list[str] = []
    for mname in ranks[0].names("weights"):
        layout = meta["layout"].get(mname, {})
        kind = kind_of(strip_wrappers(mname), layout)
        hf = names.to_hf(mname)
        per_rank_w = [b.load("weights", mname) for b in ranks]
        shapes = {tuple(t.shape) for t in per_rank_w}
        if len(shapes) > 1:
            raise BundleError(f"{mname}: TP shards have different shapes {sorted(shapes)}; the rank captures do not fit together")
        dim = max(layout.get("partition_dim", 0), 0)
        merged_w = merge_tensor(kind, per_rank_w, heads=heads, vocab=vocab, dim=dim)
        if kind in ("norm", "copy") and any(not torch.equal(per_rank_w[0], t) for t in per_rank_w[1:]):
            warnings.append(f"{mname}: replicated weight differs across TP ranks; rank 0's copy is used")
        if ranks[0].has("grads", mname):
            per_rank_g = [b.load("grads", mname) for b in ranks]
            if kind in ("norm", "copy"):
                if stage == "pre-finalize" and _partial(mname, layout, tp):
                    merged_g = (torch.stack([g.double() for g in per_rank_g]).sum(0).to(per_rank_g[0].dtype),)
                else:
                    merged_g = (per_rank_g[0],)
                    ref = per_rank_g[0].double()
                    for r, g in enumerate(per_rank_g[1:], 1):
                        if float((g.double() - ref).norm()) > POST_AGREEMENT * max(float(ref.norm()), 1e-30):
                            warnings.append(
                                f"{mname}: TP rank {r}'s gradient differs from rank 0's ({stage}); rank 0's copy is used"
                            )
            else:
                merged_g = merge_tensor(kind, per_rank_g, heads=heads, vocab=vocab, dim=dim)
            for n, t in zip(hf, merged_g):
                grads[n] = t
        for n, t in zip(hf, merged_w):
            weights[n] = t
        mapping[mname] = {"hf": hf, "kind": kind, "partial_before_finalize": _partial(mname, layout, tp), "dim": dim}
    loss = dict(ranks[0].get("loss") or {})
    with BundleWriter(out, "capture", overwrite=overwrite) as w:
        w.manifest.update(
            recipe={"name": recipe, "config": hf_config}, precision=ranks[0].get("precision"), device=ranks[0].get("device"),
            versions=ranks[0].get("versions"), loss=loss, seed=None,
            megatron={"stage": stage, "tp_size": tp, "sequence_parallel": bool(meta["config"].get("sequence_parallel")),
                      "calculate_per_token_loss": meta.get("calculate_per_token_loss"), "num_tokens": meta.get("num_tokens"),
                      "config": config, "mapping": mapping, "merged_from": [str(b.path) for b in ranks],
                      "warnings": warnings},
        )  # fmt: skip
        w.add("inputs", ranks[0].load_group("inputs"))
        w.add("weights", weights)
        w.add("grads", grads)
    return Path(out)
