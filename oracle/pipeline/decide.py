"""The judge's verdict: one decision per run from all its evidence. The first line, answer 1 (bug or
noise), answer 3 (where born) and the JSON render this decision; none of them decides on its own.

Evidence read, per run (the keys, so that other evidence can be merged in as rows of the same kinds):
  score document (score/scorer.py), ``captures[*]``:
    ``threshold``                 {value, rule, text}: T, calibrated on the run's members (score/calibrate.py)
    ``params[*]``                 name, layer, band, excess, class; cosine, norm_ratio, norm, ref_norm (the
                                  scale test); a row added by another stage (rank-view) is judged like any
    ``layers[*]``                 name, band, excess, class, worst_param (backward order, loss end first)
    ``verdict``                   class (non_finite, incomplete, oracle_non_finite), global_scale {c, explains}
    ``loss_check``                beyond, rel, band
    ``left_out``                  [{name, reason}]: gradients held but out of the verdict (the framework left
                                  them unreduced, no sum makes them whole, and no per-rank stage judged them)
  local document (score/local.py), per run: ``culprits`` (with its own calibrated threshold),
    ``modules[*]``                module, direction, ratio, class; entry rows (``entry``: what a recorded
                                  stack's first block receives from unrecorded modules) beyond are calls too
  ``runs[*]``                     name, num_tokens, rank_num_tokens (loss tokens per DP rank, merge.py)

The rule: a run is faulty when any of its units is beyond T (a parameter, a layer: excess > T; a module
of its local replay: ratio > its T), or any gradient is non-finite, after the framework's own findings
are taken out:
  scale          c = <g,t>/<g,g> over all gradients explains the error (rel L2 > T x band, and within
                 T x band after scaling) and a convention of the step makes c (a loss-token count ratio,
                 a small fraction, a power of two): a loss convention or token normalisation, not the
                 device; the units are judged again on c g (rel L2 of c g - t from each row's norms and
                 cosine). A c no convention makes stays the run's (``scale``): a scale at the loss end
  partial sums   every parameter beyond T is a partial sum before finalize (SP norms, q/k norms under TP:
                 integrations/normlog.kind_of): an unreduced (or twice reduced) partial sum
  left out       gradients the framework left unreduced that neither one copy nor the sum makes whole
                 (score/framework.py): named, with the reason, never silently dropped
An honest run states its detection limit: per layer T x band, the smallest error it would have called.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from ..integrations.normlog import kind_of

WITHIN, BEYOND, NONFINITE = "within_noise", "beyond_noise", "non_finite"
RATIO_MATCH = 0.01  # c "matches" a token-count ratio, fraction or power of two within 1 % (honest runs: c 1.0008-1.0009)


def _t(c: dict[str, Any]) -> float:
    return float((c.get("threshold") or {}).get("value") or 3.0)


def _tl(c: dict[str, Any]) -> float:
    """The layers' own threshold (scorer: each family calibrated on its own members), else the parameters'."""
    return float((c.get("layer_threshold") or {}).get("value") or _t(c))


def rescaled(p: dict[str, Any], c: float) -> float | None:
    """rel L2 of c g - t from the row's norms and cosine: sqrt(c^2|g|^2 - 2c<g,t> + |t|^2) / |t|."""
    n, r, cos = p.get("norm"), p.get("ref_norm"), p.get("cosine")
    if n is None or r is None or cos is None or not r:
        return None
    return math.sqrt(max(c * c * n * n - 2 * c * cos * n * r + r * r, 0.0)) / r


def token_ratio(c: float, counts: dict[str, int]) -> str | None:
    """The ratio of two loss-token counts (or N, 1/N) that ``c`` matches within RATIO_MATCH, in words."""
    cands = []
    items = [(k, v) for k, v in counts.items() if v]
    for ka, a in items:
        cands += [(a, f"N = {a} ({ka})"), (1 / a, f"1/N, N = {a} ({ka})")]
        for kb, b in items:
            if a != b:
                cands.append((a / b, f"{a}/{b} ({ka} over {kb})"))
    best = min(cands, key=lambda x: abs(c / x[0] - 1), default=None)
    return best[1] if best and abs(c / best[0] - 1) <= RATIO_MATCH else None


def _counts(c: dict[str, Any], run: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, int]:
    out = {f"{r['name']}'s loss tokens": r.get("num_tokens") for r in runs}
    out[f"{c['name']}'s loss tokens"] = c.get("num_tokens") or run.get("num_tokens")
    for i, n in enumerate(run.get("rank_num_tokens") or []):
        out[f"DP rank {i}'s loss tokens"] = n
    return {k: int(v) for k, v in out.items() if v}


def _convention(c: float, counts: dict[str, int]) -> str | None:
    """What a framework convention would make ``c``, in words, or None: a ratio of loss-token counts (or N, 1/N),
    a small fraction (a mean against a sum over ranks or micro-batches), a power of two (a loss scale)."""
    match = token_ratio(c, counts)
    if match:
        return f"the token-count ratio {match}: a loss normalised by another token count"
    frac = Fraction(c).limit_denominator(8)
    if frac not in (0, 1) and abs(c / float(frac) - 1) <= RATIO_MATCH:
        return f"{frac}: a factor counted once too often or too few (a sum against a mean over ranks or micro-batches)"
    k = round(math.log2(c)) if c > 0 else 0
    if k and abs(k) <= 24 and abs(c / 2.0**k - 1) <= RATIO_MATCH:
        return f"2^{k}: a loss scale applied or removed once too often"
    return None


def _per_unit(c: dict[str, Any], scale: float) -> bool:
    """c g explains the error unit by unit: some unit is beyond T as scored and none is after scaling (each row's
    rel L2 of c g - t from its norms and cosine, ``_judged``). The scorer's test compares the model's overall rel L2
    with T x the largest layer band, which a small scale passes under (x1.03 at the loss end: 33 parameters
    beyond, 4.4x; overall 0.026 against 3 x 0.012)."""
    units = [*c.get("params", []), *c.get("layers", [])]
    if not any(u.get("class") == BEYOND for u in units) or any(u.get("class") == NONFINITE for u in units):
        return False
    params, layers = _judged(c, scale)
    return not any(u.get("class") == BEYOND for u in [*params, *layers])


def _scale_finding(c: dict[str, Any], run: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Every gradient off by one factor c (the scorer's global scale explains the error). The framework's when
    a convention makes c (``_convention``): the units are then judged on c g. Otherwise no count of the step
    explains it and the finding is the run's own (``framework`` False): a scale at the loss end (the loss's
    gradient, the head's backward, the logits), judged as scored and placed there (answers.born)."""
    gs = (c.get("verdict") or {}).get("global_scale")
    if not gs or gs.get("c") is None or not (gs.get("explains") or _per_unit(c, gs["c"])):
        return None
    why = _convention(gs["c"], _counts(c, run, runs))
    text = (f"every gradient of {c['name']} is off by one factor: c = {gs['c']:.6g} maps it onto the truth (rel L2 "
            f"{gs['rel_l2']:.2e}, after scaling {gs['residual_after_scaling']:.2e})")  # fmt: skip
    if why:
        text += f"; c matches {why}" if why.startswith("the token") else f"; c is {why}"
    else:
        text += ("; no loss-token count, rank or micro-batch count or loss scale makes it: not a framework convention but "
                 "a scale at the loss end (the loss's gradient, the head's backward or the logits)")  # fmt: skip
    return {"kind": "scale", "c": gs["c"], "matches": why, "framework": bool(why), "text": text}


def _judged(c: dict[str, Any], scale: float | None) -> tuple[list[dict], list[dict]]:
    """(params, layers) as judged: the rows as scored, or judged again on c g where a scale was found."""
    params, layers = [dict(p) for p in c.get("params", [])], [dict(r) for r in c.get("layers", [])]
    if scale is None:
        return params, layers
    t = _t(c)
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    for p in params:
        e = rescaled(p, scale)
        if e is None:
            continue
        p["excess"] = e / p["band"] if p["band"] else math.inf
        p["class"] = NONFINITE if p.get("nonfinite") else (BEYOND if p["excess"] > t else WITHIN)
        num[p["layer"]] = num.get(p["layer"], 0.0) + (e * p["ref_norm"]) ** 2
        den[p["layer"]] = den.get(p["layer"], 0.0) + p["ref_norm"] ** 2
    for r in layers:
        if den.get(r["name"]):
            r["excess"] = math.sqrt(num[r["name"]] / den[r["name"]]) / r["band"] if r["band"] else math.inf
            r["class"] = NONFINITE if r.get("class") == NONFINITE else (BEYOND if r["excess"] > _tl(c) else WITHIN)
    return params, layers


def decide_run(c: dict[str, Any], local: dict[str, Any] | None, run: dict[str, Any] | None = None,
               runs: list[dict[str, Any]] = ()) -> dict[str, Any]:  # fmt: skip
    run = run or {"name": c["name"]}
    v = c.get("verdict") or {}
    t = _t(c)
    findings = []
    scale = _scale_finding(c, run, list(runs) or [run])
    if scale and scale["framework"]:
        findings.append(scale)
    params, layers = _judged(c, scale["c"] if scale and scale["framework"] else None)
    beyond = [p for p in params if p.get("class") == BEYOND]
    partial = [p["name"] for p in beyond if kind_of(p["name"])[1]]
    if len(beyond) >= 2 and len(partial) == len(beyond):  # one norm weight alone may be the device's
        kinds = sorted({kind_of(n)[0] for n in partial})
        findings.append({"kind": "partial_sums", "params": partial,
                         "text": f"every gradient of {c['name']} beyond noise ({len(partial)}) is a partial sum before "
                                 f"finalize ({', '.join(kinds)}): never reduced (or reduced twice) across the ranks"})  # fmt: skip
        beyond = []
    out_layers = {p.get("layer") for p in params if p.get("class") == BEYOND} - {p.get("layer") for p in beyond}
    beyond += [p for p in params if p.get("class") == NONFINITE]  # where non-finite values are, always the device's
    calls = [{"kind": "param", "name": p["name"], "layer": p.get("layer"), "excess": p["excess"]} for p in beyond]
    calls += [{"kind": "layer", "name": r["name"], "layer": r["name"], "excess": r["excess"]} for r in layers
              if r.get("class") == BEYOND and r["name"] not in out_layers]  # fmt: skip
    loc = local or {}
    mods = {m["module"]: m for m in loc.get("modules", [])}
    for name in loc.get("culprits") or []:
        m = mods.get(name, {})
        calls.append({"kind": "local", "name": name, "layer": None, "excess": m.get("ratio"),
                      "direction": m.get("direction")})  # fmt: skip
    # an entry row beyond its threshold (replay/local.py: the hidden states a recorded stack's first block
    # receives from unrecorded modules, against the float64 replay's, calibrated like every local row): a
    # forward error made outside the recorded modules, a call of its own (answers.born places it)
    for m in loc.get("modules", []):
        if m.get("entry") and m.get("beyond"):
            calls.append({"kind": "entry", "name": m["module"], "layer": None, "excess": m.get("ratio"),
                          "direction": "forward", "input_of": m.get("input_of")})  # fmt: skip
    nonfinite = v.get("nonfinite_params") or []
    left_out = [{"name": x["name"], "why": x["reason"]} for x in c.get("left_out") or []]  # the scorer's, with its reason
    if v.get("class") == "oracle_non_finite":
        cls = "oracle_non_finite"
    elif nonfinite:
        cls = NONFINITE
    elif calls:
        cls = BEYOND
    elif v.get("class") == "incomplete":
        cls = "incomplete"
    else:
        cls = WITHIN
    order = {r["name"]: i for i, r in enumerate(layers)}
    e2e = sorted((x for x in calls if x["kind"] not in ("local", "entry")), key=lambda x: (order.get(x["layer"], len(order)), -x["excess"]))
    onset = None
    if e2e:
        lay = e2e[0]["layer"]
        inside = [p for p in beyond if p.get("layer") == lay]
        row = next((r for r in layers if r["name"] == lay), {})
        worst = max(inside, key=lambda p: p["excess"]) if inside else {"name": row.get("worst_param"), "excess": row.get("excess")}
        after = layers[order.get(lay, 0) + 1:]
        peak = max([row, *after], key=lambda r: r.get("excess", 0.0))
        onset = {"layer": lay, "param": worst["name"], "param_excess": worst["excess"], "excess": row.get("excess"),
                 "stays_out": sum(r.get("class") == BEYOND for r in after), "after": len(after),
                 "peak_layer": peak.get("name"), "peak_excess": peak.get("excess")}  # fmt: skip
    limits = [{"layer": r["name"], "band": r["band"], "limit": _tl(c) * r["band"]} for r in c.get("layers", []) if r.get("band")]
    worst_unit = max([*params, *layers], key=lambda u: u.get("excess") or 0.0, default=None)
    return {
        "run": c["name"], "precision": c.get("precision"), "class": cls, "honest": cls == WITHIN,
        "threshold": c.get("threshold") or {"value": t, "rule": "margin"}, "local_threshold": loc.get("threshold"),
        "calls": calls, "onset": onset, "framework": findings, "left_out": left_out, "nonfinite": nonfinite,
        "scale": scale if scale and not scale["framework"] else None,  # the run's own uniform scale (answers.born)
        "limits": limits, "worst": worst_unit and {"name": worst_unit["name"], "excess": worst_unit.get("excess")},
        "params": params, "layers": layers,
    }  # fmt: skip


def decide(score: dict[str, Any], local: dict[str, dict[str, Any]] | None = None,
           runs: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    """The decision for every run of ``score`` (``local``: run name -> its scored local replay)."""
    runs = runs or [{"name": c["name"], "num_tokens": c.get("num_tokens")} for c in score["captures"]]
    by = {r["name"]: r for r in runs}
    per = [decide_run(c, (local or {}).get(c["name"]), by.get(c["name"]), runs) for c in score["captures"]]
    return {"per_run": per, "faulty": [d["run"] for d in per if not d["honest"]]}


def call_text(d: dict[str, Any], shown: int = 3) -> str:
    """What was called, largest first, in words."""
    calls = sorted(d["calls"], key=lambda x: -(x["excess"] if x["excess"] is not None else math.inf))
    words = []
    for x in calls[:shown]:
        ex = "non-finite" if x["excess"] is None or not math.isfinite(x["excess"]) else f"{x['excess']:.2f}x"
        what = {"param": "", "layer": "layer ", "local": "local replay: ", "entry": "local replay, entering: "}[x["kind"]]
        words.append(f"{what}{x['name']} {ex}" + (f" ({x['direction']})" if x.get("direction") else ""))
    more = f" and {len(calls) - shown} more" if len(calls) > shown else ""
    return ", ".join(words) + more


def limit_text(d: dict[str, Any]) -> str:
    """An honest run's detection limit in words: the smallest error it would have called, per layer."""
    lim = [x for x in d["limits"] if x["limit"] and math.isfinite(x["limit"])]
    if not lim:
        return ""
    lo, hi = min(lim, key=lambda x: x["limit"]), max(lim, key=lambda x: x["limit"])
    return (f"honest down to {d['threshold']['value']:.2f}x its band: it would have called a rel L2 error from "
            f"{lo['limit']:.2e} ({lo['layer']}) to {hi['limit']:.2e} ({hi['layer']})")  # fmt: skip
