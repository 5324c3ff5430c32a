"""The four questions of a cross-device comparison, answered in words from the stages' results.

1. bug or honest noise?  per run, its own verdict against the band of its own precision
   (``score``: excess = rel_l2 / band per layer, beyond when excess > margin); beside it, per layer,
   the analytic round-off bound k C^n u (``score/bound.py``: rel_l2 <= bound, no margin), and where
   the two part (beyond the bound but within the band, or the reverse) it is said; the band rules;
2. which run is farther from the truth?  per layer, the run with the larger rel_l2 loses it
   (``score``'s comparison; a tie or a non-finite layer is won by nobody);
3. where is it born?  with module boundaries: the local replay's culprit (module, forward or
   backward: the error born in that module alone against an honest run of the same module).
   Without: end to end, the first layer beyond noise walking from the loss end (``onset``), and in
   it the parameter of largest excess (what a module inherits is diluted by the layers between, so
   the module where it is born stands out most; a streamed oracle's backward order is per unit,
   so the order inside a layer cannot decide); its owning module is named. The direction
   end to end: a forward fault changes the loss, so a loss within its band
   (|L_captured - L_replayed| / |L_replayed| <= margin x expected) and an onset below the loss
   end read as a backward fault; a loss beyond its band as a forward one.
   Framework misbehaviour, where the data shows it: a global scale c = <g,t>/<g,g> that explains
   the error (a loss convention or normalisation mismatch; c close to the loss-token count N or
   1/N: a sum against a mean), the loss check, and beyond-noise parameters that are all partial
   sums before finalize (norm weights under SP, q/k layernorm under TP: an unreduced partial sum).
4. which op class?  ``explain``'s ranking for the culprit (the share of the device's error each op
   class reproduces, run alone in the capture's format). Without boundaries only the gradient's
   signature at the onset: a direction within noise (sin angle = sqrt(1 - cos^2) <= margin x band)
   and a norm off by more than that is a scale, |norm_ratio - 1| > margin x band, which no op's
   rounding produces: a scaling or reduction op (a loss or gradient scale, a sum counted twice).
Everything not concluded is said, in ``not_concluded``.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..integrations.normlog import kind_of
from ..score import bound as bound_mod

SCHEMA_VERSION = 1
_PROJ = re.compile(r"(_proj|linear_fc1|linear_fc2|linear_qkv|linear_proj|qkv|fc1|fc2|proj)$")


def module_of(param: str) -> str:
    """The module a parameter belongs to, one level up from a projection: ``model.layers.1.mlp``
    for ``model.layers.1.mlp.down_proj.weight``; ``model.norm`` for ``model.norm.weight``."""
    owner = param.rsplit(".", 1)[0] if param.endswith((".weight", ".bias")) else param
    parent, _, last = owner.rpartition(".")
    return parent if parent and _PROJ.search(last) else owner


def _param_row(c: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((p for p in c["params"] if p["name"] == name), None)


def stray_params(c: dict[str, Any]) -> list[dict[str, Any]]:
    """Parameters beyond their own band in a run whose layers all stay within theirs (the verdict is per
    layer: a layer aggregates its parameters, so a fault confined to a few of them can stay inside it; a
    planted 5 % scale of one layer's MLP gradient in bf16: those weights 3.2-3.4x, the layer 1.00x).
    Largest excess first; gradients the framework left unreduced are not among them unless judged per rank
    (an ordinary row then: each rank against its own truth and band, score/framework.py)."""
    if c["verdict"]["class"] != "within_noise":
        return []
    left_out = set(_unreduced(c)) - {p["name"] for p in c.get("params", []) if p.get("judged") == "per rank"}
    rows = [p for p in c.get("params", []) if p.get("class") == "beyond_noise" and p["name"] not in left_out]
    return sorted(rows, key=lambda p: -p["excess"])


def _stray_text(rows: list[dict[str, Any]]) -> str:
    top = rows[0]
    more = f" and {len(rows) - 1} more" if len(rows) > 1 else ""
    return (f"{len(rows)} parameter(s) beyond their own band inside layers within theirs ({top['name']} "
            f"{top['excess']:.2f}x{more}): no verdict at the layer level; a fault confined to them, or their own "
            "noise -- judge again with more members (--ensemble 8) to tell")


def noise(score: dict[str, Any]) -> dict[str, Any]:
    rows, said = [], []
    for c in score["captures"]:
        v = c["verdict"]
        honest = v["class"] == "within_noise"
        stray = stray_params(c)
        rows.append({"run": c["name"], "precision": c["precision"], "class": v["class"], "honest": honest,
                     "band": c["band_kind"], "excess": v["excess"], "text": v["text"], "stray": [p["name"] for p in stray]})  # fmt: skip
        said.append(f"{c['name']}: {'honest noise' if honest else 'NOT honest noise'} against its own band "
                    f"({c['band_kind']}, worst {v['excess']:.2f}x)" + (f", but {_stray_text(stray)}" if stray else ""))  # fmt: skip
    faulty = [r["run"] for r in rows if not r["honest"]]
    text = "; ".join(said)
    return {"per_run": rows, "faulty": faulty, "text": text, "band": band_meaning(score)}


def band_meaning(score: dict[str, Any]) -> dict[str, Any]:
    """What "within the band" means, stated with the numbers of this judge. The band of a parameter or a
    layer is the LARGEST of K emulated members' rel L2 against the truth (score/scorer.py), and a run is
    beyond noise above ``margin`` x that. The members and an honest run are exchangeable draws of the same
    rounding, so an honest run exceeds the largest of K members with probability 1/(K+1); the margin (3)
    covers that draw and the emulation's own fidelity (real autocast vs emulated, median ratio 0.9,
    score/tolerance.py). How far apart the members are (``spread``: the smallest member over the largest,
    the lowest over the layers) says how much a larger K would widen the band: the members of a layer's
    rel L2 sum many independent roundings, so they lie close (bf16: the smallest of 4 >= 0.7 of the largest
    at every layer, and the larger of the first 2 the largest of all 4; fp32 members, which move whole
    ulps, spread wider: benchmarks/band_cost.py), and K = 2 gives about the band K = 4 does at half the
    cost (score/tolerance.py ``BAND_MEMBERS``)."""
    runs = []
    for c in score["captures"]:
        members = [r.get("members") or [] for r in c["layers"]]
        k = max((len(m) for m in members), default=0)
        spread = min((min(m) / max(m) for m in members if m and max(m) > 0), default=None)
        runs.append({"run": c["name"], "members": k, "spread": spread})
    margin = score.get("margin")
    lines = []
    for r in runs:
        if r["members"] == 0:
            lines.append(f"{r['run']}: no emulated band; the tolerance table's expected error for its precision stands in")
            continue
        spread = (f"; its smallest member is >= {r['spread']:.2f} of its largest at every layer"
                  if r["spread"] is not None else "")  # fmt: skip
        lines.append(f"{r['run']}: band = the largest of {r['members']} emulated members' rel L2 per parameter and layer "
                     f"(an honest run exceeds it with probability ~1/{r['members'] + 1}); beyond noise above "
                     f"{margin:g}x it{spread}")  # fmt: skip
    return {"per_run": runs, "margin": margin, "lines": lines}


def farther(score: dict[str, Any]) -> dict[str, Any]:
    cmp = score.get("comparison")
    if not cmp or not cmp["per_layer"]:
        return {"run": None, "layers_won": {}, "per_layer": [], "text": "one run only: nothing to compare"}
    names = list(cmp["layers_won"])
    n = len(cmp["per_layer"])
    lost = {nm: sum(1 for r in cmp["per_layer"] if r["closest"] not in (None, nm)) for nm in names}
    worst = max(lost, key=lost.get)
    run = worst if list(lost.values()).count(lost[worst]) == 1 else None
    text = f"{run} is farther from the truth in {lost[run]}/{n} layers" if run else "neither run is farther overall (a tie)"
    text += " (" + ", ".join(f"{nm} closer in {cmp['layers_won'][nm]}" for nm in names) + ")"
    return {"run": run, "layers_lost": lost, "layers_won": cmp["layers_won"], "per_layer": cmp["per_layer"], "text": text}


def _framework(c: dict[str, Any], margin: float) -> list[str]:
    out = []
    gs = c["verdict"].get("global_scale")
    if gs and gs["explains"]:
        msg = f"a global scale explains the error: c = {gs['c']:.6g} (after scaling rel L2 {gs['residual_after_scaling']:.2e})"
        n = (c.get("num_tokens") or 0) or None
        if n and (abs(gs["c"] / n - 1) < 0.05 or abs(gs["c"] * n - 1) < 0.05):
            msg += f"; c is about {'N' if gs['c'] > 1 else '1/N'} (N = {n} loss tokens): a summed loss against a mean"
        out.append("loss convention / normalisation mismatch: " + msg)
    lc = c.get("loss_check")
    if lc and lc["beyond"]:
        out.append(lc["text"])
    beyond = [p["name"] for p in c["params"] if p["class"] == "beyond_noise"]
    if beyond and all(kind_of(n)[1] for n in beyond):
        out.append(f"every parameter beyond noise ({len(beyond)}) is a partial sum before finalize "
                   f"({', '.join(sorted({kind_of(n)[0] for n in beyond}))}): an unreduced or twice-reduced partial sum")  # fmt: skip
    return out


def _unreduced(c: dict[str, Any]) -> list[str]:
    return sorted(r["name"] for r in ((c.get("framework") or {}).get("params") or []))


def framework(score: dict[str, Any]) -> dict[str, Any]:
    """Gradients the framework never reduced across TP (score.framework), split into those found in
    every run (the framework's behaviour, on every device alike) and those found in one run only
    (that run's framework or configuration differs: e.g. a norm weight that lost its sequence-parallel
    mark, Megatron-LM #1446). Either way a framework finding, not a device error."""
    per = {c["name"]: _unreduced(c) for c in score["captures"]}
    shared = sorted(set.intersection(*(set(v) for v in per.values()))) if per else []
    only = {n: [p for p in v if p not in shared] for n, v in per.items()}
    parts = [f"in {n} only: {len(v)} gradient(s) never reduced across TP ranks ({', '.join(v[:4])}"
             f"{f' and {len(v) - 4} more' if len(v) > 4 else ''})" for n, v in only.items() if v]  # fmt: skip
    if shared:
        parts.append(f"in {' and '.join(per) if len(per) > 1 else 'the run'} alike: {len(shared)} gradient(s) never "
                     "reduced across TP ranks")  # fmt: skip
    return {"shared": shared, "only": only, "text": "framework finding " + "; ".join(parts) if parts else ""}


def born(score: dict[str, Any], local: dict[str, dict[str, Any]], margin: float) -> dict[str, Any]:
    rows = []
    for c in score["captures"]:
        name, v = c["name"], c["verdict"]
        fw = _framework(c, margin) + ([c["framework"]["text"]] if c.get("framework") else [])
        lv = (local.get(name) or {}).get("verdict")
        lc = c.get("loss_check")
        if lv and lv.get("culprit"):
            rows.append({"run": name, "module": lv["culprit"], "direction": lv["direction"], "source": "local replay",
                         "evidence": lv["text"], "framework": fw})  # fmt: skip
            continue
        on = v.get("onset")
        if v["class"] == "within_noise" or not on:
            rows.append({"run": name, "module": None, "direction": None, "source": None, "framework": fw,
                         "evidence": "nothing to localise: within its noise band" if v["class"] == "within_noise"
                         else v["text"]})  # fmt: skip
            continue
        layer = next(r for r in c["layers"] if r["name"] == on["layer"])
        module = module_of(layer["worst_param"])
        at_loss_end = on["layer"] == c["layers"][0]["name"]
        below = c["layers"][1] if len(c["layers"]) > 1 else None  # the next layer along the backward
        confined = None
        if lc and lc["beyond"]:
            direction, why = "forward", f"the loss differs from the truth's by {lc['rel']:.2e} (band {lc['band']:.1e})"
        elif lc and at_loss_end and below is not None and below["class"] == "within_noise":
            # a wrong forward at the loss end (the logits) or a wrong input gradient there moves every gradient
            # below it; an error that stays in the layer's own weight gradient is made where that is computed
            direction, confined = "backward", on["layer"]
            why = (f"the loss agrees with the truth ({lc['rel']:.2e} <= band {lc['band']:.1e}) and the next layer along "
                   f"the backward, {below['name']}, is within noise: the error stays in {on['layer']}'s own weight "
                   "gradient (a wrong forward or input gradient there would move the gradients below it), so it is made "
                   "where that weight gradient is computed or accumulated")  # fmt: skip
        elif lc and not at_loss_end:
            direction = "backward"
            why = (f"the loss agrees with the truth ({lc['rel']:.2e} <= band {lc['band']:.1e}) and the layers "
                   f"nearer the loss end are within noise")  # fmt: skip
        else:
            direction = None
            why = "no recorded loss to tell forward from backward" if not lc else "the onset is at the loss end"
        worst = _param_row(c, layer["worst_param"]) or {"excess": math.nan}
        evidence = (f"end to end: first out of band along the backward at {on['layer']} ({on['excess']:.1f}x its band), "
                    f"largest there in {layer['worst_param']} ({worst['excess']:.1f}x); {on['stays_out']}/{on['after']} "
                    f"layers after stay out; {why}")  # fmt: skip
        if lv:
            evidence += (f"; the local replay names no culprit ({lv['text']}): the error is made between recorded modules "
                         "(a hand-off), which only the end-to-end onset places")  # fmt: skip
        rows.append({"run": name, "module": module, "direction": direction, "source": "end to end", "evidence": evidence,
                     "onset_param": layer["worst_param"], "framework": fw, "confined": confined})  # fmt: skip
    parts = []
    for r in rows:
        if r["module"]:
            parts.append(f"{r['run']}: born in {r['module']} ({r['direction'] or 'direction unknown'}; {r['source']})")
    # each framework finding is spelled out once, on its run's own line below this summary
    fw = [r["run"] for r in rows if r["framework"]]
    if fw:
        parts.append(f"framework finding in {' and '.join(fw)} (below)")
    return {"per_run": rows, "text": "; ".join(parts) or "no error to localise"}


CAPTURE_LAYERS = ("capture both runs again with module boundaries (ORACLE_CAPTURE_MODULES=layers beside ORACLE_CAPTURE; "
                  "oracle capture --modules for a bundle), so that a local replay places the module and explain ranks "
                  "the op classes")  # fmt: skip


def _accumulated(n: int) -> tuple[str, str]:
    """(why, settle) for a step of ``n`` > 1 micro-batches: merge maps no module boundaries of such a step
    (microbatches.py), and an error made where main_grad accumulates the micro-batches (a fused weight-
    gradient accumulate: wgrad_gemm_accum_fp32, npu_matmul_add_fp32) exists only there: one micro-batch tells."""
    return (f"a step of {n} micro-batches: their module boundaries are not mapped (each micro-batch's call met the "
            "modules), so no local replay; an error made where main_grad accumulates the micro-batches (a fused "
            "weight-gradient accumulate such as npu_matmul_add_fp32) is a candidate no replay of the step can place",
            "capture a call of ONE micro-batch of the same data on both clusters (ORACLE_CAPTURE_MODULES=layers "
            "beside ORACLE_CAPTURE): an error that is gone there is born in the accumulation across micro-batches; one "
            "that stays is placed by the local replay and explain")  # fmt: skip


def _sub_modules(module: str) -> str:
    """A module-selection regex (searched in the model chunk's mcore names) for ``module``'s children:
    ``model.language_model.layers.3`` -> ``decoder\\.layers\\.3\\..*``; another module, its name
    without the leading ``model.`` (``model.visual.blocks.1`` -> ``visual\\.blocks\\.1\\..*``)."""
    m = re.search(r"layers\.(\d+)$", module)
    return rf"decoder\.layers\.{m.group(1)}\..*" if m else re.escape(module.removeprefix("model.")) + r"\..*"


# A decoder layer's backward reaches its parameters in this order (HF names below the layer); each
# stage names the op class that computes the gradient reaching that stage's parameters from the
# stage before. A backward fault inside the layer leaves every stage before it within noise (its
# inputs, the gradient from above and the forward's activations, are exact) and every stage from
# it on beyond: the first stage beyond noise names the op class. Forward faults change the loss
# and are not read this way.
_LAYER_PATH = [
    ("mlp.down_proj", "matmul", "the MLP output projection's weight-gradient GEMM or its accumulation"),
    ("mlp.gate_proj|mlp.up_proj", "activation", "the SwiGLU backward between down_proj and gate/up_proj"),
    ("post_attention_layernorm", "normalisation", "the post-attention RMSNorm's backward"),
    ("self_attn.o_proj", "matmul", "the attention output projection's weight-gradient GEMM or its accumulation"),
    ("self_attn.v_proj", "attention", "the attention core's backward (dV = P^T dO, dS = P (dP - rowsum(dO O)))"),
    ("self_attn.q_norm|self_attn.k_norm", "rotary",
     "the rotary embedding's backward between the attention core and the q/k RMSNorm (V, which has no rotary, is within noise)"),
    ("self_attn.q_proj|self_attn.k_proj", "normalisation", "the q/k RMSNorm's input-gradient"),
    ("input_layernorm", "normalisation", "the input RMSNorm's backward"),
]  # fmt: skip


def _path_class(c: dict[str, Any], module: str) -> dict[str, Any] | None:
    """The op class from where along ``module``'s (a decoder layer's) backward its parameters leave
    their band (``_LAYER_PATH``); None when the layer's parameters do not show a first stage."""
    rows = {p["name"][len(module) + 1:].rsplit(".", 1)[0]: p for p in c["params"] if p["name"].startswith(module + ".")}
    seen = []
    for names, cls, where in _LAYER_PATH:
        got = [rows[n] for n in names.split("|") if n in rows]
        if not got:
            return None
        bad = [p for p in got if p["class"] == "beyond_noise"]
        if bad:
            w = max(bad, key=lambda p: p["excess"])
            clean = ", ".join(seen) or "none"
            return {"class": cls, "text": f"{module}'s backward leaves its band first at {w['name']} ({w['excess']:.1f}x its "
                                          f"band) while the gradients it reaches before are within noise ({clean}): "
                                          f"the error is born in {where}"}  # fmt: skip
        seen += [n.split(".")[-1] for n in names.split("|")]
    return None


def _plain_scale(p: dict[str, Any], margin: float) -> bool:
    """A gradient whose direction is within noise (sin of its angle to the truth's within margin x band)
    while its norm is not: a scale."""
    sin = math.sqrt(max(0.0, 1.0 - min(1.0, p["cosine"]) ** 2))
    return sin <= margin * p["band"] < abs(p["norm_ratio"] - 1.0)


def op_class(score: dict[str, Any], explained: dict[str, dict[str, Any]], born_rows: list[dict[str, Any]],
             margin: float, microbatches: dict[str, int] | None = None) -> dict[str, Any]:  # fmt: skip
    """``microbatches``: each run's micro-batches per call (a run of several gets the accumulation's reason)."""
    rows = []
    by_name = {c["name"]: c for c in score["captures"]}
    for b in born_rows:
        if not b["module"]:
            continue
        ex = explained.get(b["run"])
        if ex:
            top = ex["classes"][0]
            row = {"run": b["run"], "class": ex["top"] if top["share_only"] >= 0.5 else None, "share": top["share_only"],
                   "source": "explain", "text": ex["text"]}  # fmt: skip
            path = _path_class(by_name[b["run"]], b["module"]) if b.get("direction") == "backward" else None
            if row["class"] is None and path:
                row.update({"class": path["class"], "source": "explain, then the gradient path",
                            "text": f"no op class's rounding reproduces the error (best {ex['top']}, {top['share_only']:.0%}): "
                                    f"a wrong result, not a precision; {path['text']}"})  # fmt: skip
            if row["class"] is None:
                row["short"] = "no op class's rounding reproduces the error: a wrong result, not a precision"
                row["why"] = (f"no op class's rounding reproduces half of the error in {b['module']} (best: {ex['top']}, "
                              f"{top['share_only']:.0%} in {ex.get('format', 'the capture format')}): not one op class "
                              "computed in too low a precision but a wrong result (a mask, a sign, an index, a missing "
                              "term), which rounding cannot reproduce")  # fmt: skip
                row["settle"] = (f"capture {b['module']}'s sub-modules too (ORACLE_CAPTURE_MODULES="
                                 f"'{_sub_modules(b['module'])}') so that the local replay names the one (attention core, "
                                 "rotary, norm, MLP) whose backward is wrong")  # fmt: skip
                row["text"] = f"undetermined: {row['why']}; to settle it, {row['settle']} ({ex['text']})"
            rows.append(row)
            continue
        c = by_name[b["run"]]
        p = _param_row(c, b.get("onset_param") or "")
        n_mb = (microbatches or {}).get(b["run"], 1)
        if n_mb > 1 and (p is None or p.get("cosine") is None or not _plain_scale(p, margin)):
            why, settle = _accumulated(n_mb)
            if b.get("confined"):
                why += (f"; the error stays in {b['confined']}'s weight gradient (born, 3.): its weight-gradient GEMM or "
                        "main_grad's accumulation")  # fmt: skip
            rows.append({"run": b["run"], "class": None, "share": None, "source": "gradient signature", "why": why,
                         "settle": settle, "short": f"{n_mb} micro-batches: no local replay",
                         "text": f"undetermined: {why}; to settle it, {settle}"})  # fmt: skip
            continue
        if p is None or p.get("cosine") is None:
            why, settle = "no module boundaries were captured (explain needs them)", CAPTURE_LAYERS
            rows.append({"run": b["run"], "class": None, "share": None, "source": None, "why": why, "settle": settle,
                         "short": "no module boundaries captured",
                         "text": f"undetermined: {why}; to settle it, {settle}"})  # fmt: skip
            continue
        if _plain_scale(p, margin):
            rows.append({"run": b["run"], "class": "scaling", "share": None, "source": "gradient signature",
                         "text": f"a scale, not rounding: {p['name']} is {p['norm_ratio']:.6g}x the truth's gradient with "
                                 f"its direction within noise (cosine {p['cosine']:.9f}); no op's rounding scales a gradient: "
                                 "a scaling or reduction op (a loss or gradient scale, a sum counted twice); the op-level "
                                 "attribution (explain) needs module boundaries"})  # fmt: skip
        else:
            why = (f"no module boundaries were captured and the gradient's signature is not a plain scale ({p['name']}: "
                   f"cosine {p['cosine']:.6f}, norm ratio {p['norm_ratio']:.6g})")  # fmt: skip
            rows.append({"run": b["run"], "class": None, "share": None, "source": "gradient signature", "why": why,
                         "settle": CAPTURE_LAYERS, "short": "no module boundaries captured, not a plain scale",
                         "text": f"undetermined: {why}; to settle it, {CAPTURE_LAYERS}"})  # fmt: skip
    return {
        "per_run": rows,
        "text": "; ".join(f"{r['run']}: {r['class'] or 'undetermined'}" for r in rows) or "no error to explain",
    }


def not_concluded(score, local, runs, logs) -> list[str]:
    out = []
    for r in runs:
        if not r["modules"] and r.get("microbatches", 1) > 1:
            out.append(f"{r['name']}: a step of {r['microbatches']} micro-batches: merge maps module boundaries for one "
                       "micro-batch only, so where the error is born is read end to end and the op class from the "
                       "gradient's signature only; " + _accumulated(r["microbatches"])[1])  # fmt: skip
        elif not r["modules"]:
            how = ("capture both runs again with ORACLE_CAPTURE_MODULES=layers set beside ORACLE_CAPTURE"
                   if r.get("input_kind") == "megatron rank folder" or r.get("megatron") else "capture both with --modules (e.g. --modules all)")
            out.append(f"{r['name']}: no module boundaries were captured, so where the error is born is read end to end "
                       "(onset along the backward), not from a local replay, and the op class from the gradient's signature "
                       f"only; {how}")  # fmt: skip
    for c in score["captures"]:
        if c.get("unverified"):
            out.append(f"{c['name']}: same step not verified for its {' and '.join(c['unverified'])}")
    if score["oracle"].get("warning"):
        out.append("oracle: " + score["oracle"]["warning"])
    if not logs:
        out.append("no grad-norm logs given: the runs' own printed norms were not checked against the truth (give each run's "
                   "log as --log-a and --log-b)")
    out.append(
        "the noise band is emulated rounding of the capture's precision, not a vendor's kernel choices "
        f"(the margin, {score['margin']:g}x, covers those)"
    )
    return out


def headline(noise_a: dict, born_a: dict, ops: dict, fw: dict | None = None) -> str:
    faulty = noise_a["faulty"]
    tail = f"; {fw['text']}" if fw and fw.get("text") else ""
    if not faulty:
        stray = [f"{r['run']} has {len(r['stray'])} parameter(s) beyond their own band (see 1.)" for r in noise_a["per_run"] if r.get("stray")]
        return ("answer: both runs are honest noise of their own precision; no device bug is shown by this step"
                + (" at the layer level, but " + " and ".join(stray) if stray else "") + tail)  # fmt: skip
    parts = []
    for run in faulty:
        b = next((r for r in born_a["per_run"] if r["run"] == run), {})
        o = next((r for r in ops["per_run"] if r["run"] == run), {})
        where = f"born in {b['module']} ({b.get('direction') or 'direction unknown'})" if b.get("module") else "not localised"
        cls = o.get("class") or (f"undetermined ({o['short']}; see 4.)" if o.get("short") else "undetermined")
        parts.append(f"{run} is faulty (beyond its own noise band); {where}; op class: {cls}")
    return "answer: " + "; ".join(parts) + tail


def build(
    score: dict[str, Any], runs: list[dict[str, Any]], *, local: dict, explained: dict, logs: dict | None
) -> dict[str, Any]:
    m = score["margin"]
    for c in score["captures"]:  # the loss-token count, for the convention check
        run = next(r for r in runs if r["name"] == c["name"])
        c.setdefault("num_tokens", run.get("num_tokens"))
    a1, a2 = noise(score), farther(score)
    a3 = born(score, local, m)
    a4 = op_class(score, explained, a3["per_run"], m, {r["name"]: r.get("microbatches", 1) for r in runs})
    a1b = bound_mod.annotate(score, {c["name"]: c.get("num_tokens") for c in score["captures"]})
    fw = framework(score)
    return {
        "schema_version": SCHEMA_VERSION, "kind": "oracle-judge", "headline": headline(a1, a3, a4, fw), "runs": runs,
        "answers": {"noise": a1, "bound": a1b, "farther": a2, "born": a3, "op_class": a4, "framework": fw},
        "not_concluded": not_concluded(score, local, runs, logs), "logs": logs,
        "score": score, "local": local, "explain": explained,
    }  # fmt: skip
