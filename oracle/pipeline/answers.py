"""The four questions of a cross-device comparison, answered in words from the stages' results.

1. bug or honest noise?  per run, the one decision (``decide.py``: every parameter, layer and locally
   replayed module against the threshold calibrated on its members, ``score/calibrate.py``, after the
   framework's own findings); the first line and answer 3 render the same decision; beside it, per layer,
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

from ..score import bound as bound_mod
from ..score import calibrate
from ..score.calibrate import FIDELITY
from ..score.local import input_row
from . import decide as decide_mod

NONFINITE = decide_mod.NONFINITE

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


def noise(score: dict[str, Any], decision: dict[str, Any] | None = None) -> dict[str, Any]:
    """Answer 1, rendered from the decision (decide.py): per run, honest or not, what was called against
    which threshold, the framework's findings, what was left out, and down to what an honest run is honest."""
    decision = decision or decide_mod.decide(score)
    rows, said = [], []
    for c, d in zip(score["captures"], decision["per_run"]):
        thr = d["threshold"]
        rows.append({"run": d["run"], "precision": c["precision"], "class": d["class"], "honest": d["honest"],
                     "band": c.get("band_kind"), "excess": (d["worst"] or {}).get("excess"), "threshold": thr["value"],
                     "rule": thr.get("rule"), "called": [x["name"] for x in d["calls"]],
                     "limits": d["limits"], "text": run_text(d, c.get("band_kind")),
                     "score_text": c["verdict"].get("text", "")})  # fmt: skip
        said.append(rows[-1]["text"])
    faulty = decision["faulty"]
    return {"per_run": rows, "faulty": faulty, "text": "; ".join(said), "band": band_meaning(score)}


def run_text(d: dict[str, Any], band_kind: str | None) -> str:
    """One run's answer 1 in words (the decision's, never the scorer's own line)."""
    thr = d["threshold"]
    against = f"against its own band ({band_kind or 'its band'}; threshold {thr['value']:.2f}x: {thr.get('rule', 'margin')})"
    worst = d["worst"] or {}
    head = f"{d['run']}: "
    if d["class"] == "oracle_non_finite":
        return head + "cannot be judged: the oracle's own gradients are non-finite"
    if d["class"] == NONFINITE:
        return head + f"NOT honest noise: non-finite gradients in {len(d['nonfinite'])} parameter(s), first {d['nonfinite'][0]}"
    if d["class"] == "incomplete":
        return head + f"incomplete: the capture lacks gradients the oracle has ({d['run']}'s coverage, below); of what it holds, none beyond {against}"
    if d["calls"]:
        text = head + f"NOT honest noise {against}: {decide_mod.call_text(d)}"
    else:
        text = head + f"honest noise {against}, worst {worst.get('excess') or 0:.2f}x ({worst.get('name')})"
        lim = decide_mod.limit_text(d)
        text += f"; {lim}" if lim else ""
    for f in d["framework"]:
        text += f"; framework finding, not the device: {f['text']}"
    if d["left_out"]:
        text += f"; {len(d['left_out'])} gradient(s) left out of the verdict: {_names(d['left_out'])} ({d['left_out'][0]['why']})"
    return text


def _names(rows: list[dict[str, Any]], shown: int = 3) -> str:
    more = f" and {len(rows) - shown} more" if len(rows) > shown else ""
    return ", ".join(r["name"] for r in rows[:shown]) + more


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
    for r, c in zip(runs, score["captures"]):
        thr = c.get("threshold") or {"value": margin, "text": f"--margin {margin:g}"}
        r["threshold"] = thr["value"]
        if r["members"] == 0:
            lines.append(f"{r['run']}: no emulated band; the tolerance table's expected error for its precision stands in; "
                         f"beyond noise above {thr['text']}")  # fmt: skip
            continue
        spread = (f"; its smallest member is >= {r['spread']:.2f} of its largest at every layer"
                  if r["spread"] is not None else "")  # fmt: skip
        lines.append(f"{r['run']}: band = the largest of {r['members']} emulated members' rel L2 per parameter and layer "
                     f"(an honest run exceeds it with probability ~1/{r['members'] + 1}); beyond noise above "
                     f"{thr['text']}{spread}")  # fmt: skip
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


def _framework(c: dict[str, Any], d: dict[str, Any]) -> list[str]:
    """The framework's findings for one run: the decision's (scale, partial sums), the loss check beyond its
    band, and the gradients it left unreduced (score/framework.py)."""
    out = [f["text"] for f in d["framework"]]
    lc = c.get("loss_check")
    if lc and lc["beyond"]:
        out.append(lc["text"])
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


def born(score: dict[str, Any], local: dict[str, dict[str, Any]], margin: float | None = None,
         decision: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Answer 3, from the decision: a run it calls honest has nothing to localise; a faulty one is placed by
    its local replay's culprit, else by the decision's onset end to end."""
    decision = decision or decide_mod.decide(score, local)
    rows = []
    for c, d in zip(score["captures"], decision["per_run"]):
        name = c["name"]
        fw = _framework(c, d) + ([c["framework"]["text"]] if c.get("framework") else [])
        lv = (local.get(name) or {}).get("verdict")
        lc = c.get("loss_check")
        if d["honest"] or d["class"] == "oracle_non_finite":
            why = ("nothing to localise: the decision calls it honest noise" + (" on what the framework findings leave"
                   if d["framework"] else "") if d["honest"] else "cannot be judged: the oracle is non-finite")  # fmt: skip
            rows.append({"run": name, "module": None, "direction": None, "source": None, "framework": fw, "evidence": why})
            continue
        if lv and lv.get("culprit"):
            rows.append({"run": name, "module": lv["culprit"], "direction": lv["direction"], "source": "local replay",
                         "evidence": lv["text"], "framework": fw})  # fmt: skip
            continue
        on = d["onset"]
        entered = next((x for x in d["calls"] if x["kind"] == "entry"), None)
        if not on and entered:
            module, where = _fed_by(d, entered, local.get(name))
            rows.append({"run": name, "module": module, "direction": "forward", "source": "local replay (entry)",
                         "framework": fw, "evidence": f"the hidden states entering {entered['input_of']} are "
                         f"{entered['excess']:.1f}x their band against the float64 replay's, every recorded module "
                         f"within its own: a forward error made outside the recorded modules, {where}"})  # fmt: skip
            continue
        if not on:
            rows.append({"run": name, "module": None, "direction": None, "source": None, "framework": fw,
                         "evidence": c["verdict"].get("text", "")})  # fmt: skip
            continue
        layers = d["layers"]
        layer = next(r for r in layers if r["name"] == on["layer"])
        module = module_of(on["param"] or layer["worst_param"])
        at_loss_end = on["layer"] == layers[0]["name"]
        below = layers[1] if len(layers) > 1 else None  # the next layer along the backward
        confined = None
        entry = (lv or {}).get("entry") or {}
        if entry.get("beyond") and not holder(module, local.get(name)):
            # the onset lies outside the recorded modules and what they receive from before them is wrong in the forward
            direction = "forward"
            why = (f"the hidden states entering {entry['module']} (an entry of the recorded modules) are {entry['ratio']:.1f}x their "
                   f"band against the float64 replay's (local replay): a forward error made before it")  # fmt: skip
        elif lc and lc["beyond"]:
            direction, why = "forward", f"the loss differs from the truth's by {lc['rel']:.2e} (band {lc['band']:.1e})"
        elif lc and at_loss_end and d.get("scale") and _logits_scaled(lc, d["scale"]["c"]) is not None:
            # the loss's move predicted by scaled logits, against the loss as it is: the nearer hypothesis
            fwd, why = _logits_scaled(lc, d["scale"]["c"])
            direction = "forward" if fwd else "backward"
            why = f"{d['scale']['text']}; {why}"
        elif lc and at_loss_end and d.get("scale") and lc.get("moved"):
            # one factor on every gradient and the loss moved (at the direction's level): the logits are scaled
            direction = "forward"
            why = (f"{d['scale']['text']}; the loss moved {lc['excess']:.1f}x its band (a fault at the loss end is read "
                   f"forward above {lc['direction_threshold']:.1f}x): the logits are wrong, not only their gradient")  # fmt: skip
        elif lc and at_loss_end and d.get("scale"):
            # one factor on every gradient, the loss right: what enters the backward at the loss end is scaled
            direction = "backward"
            why = (f"{d['scale']['text']}; the loss agrees with the truth ({lc['rel']:.2e}, {lc.get('excess', 0):.1f}x "
                   "its band): the gradient entering the backward at the loss end is scaled (the loss's gradient or "
                   "the head's backward); scaled logits would move the loss")  # fmt: skip
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
        fb = _forward_branch(module, local.get(name))
        fb = fb if fb and direction != "forward" else None
        if fb:
            # the locally replayed block holding the onset split its forward error along its residual branches, and
            # one branch's output is off beyond its members' (score/local.py, Branches): a forward fault there,
            # whose scaled output scales its gradients too (which alone would read as a backward fault)
            direction, module, confined = "forward", fb["module"], None
            why = fb["text"]
        evidence = (f"end to end: first out of band along the backward at {on['layer']} ({on['excess']:.1f}x its band), "
                    f"largest there in {on['param']} ({on['param_excess']:.1f}x); {on['stays_out']}/{on['after']} "
                    f"layers after stay out; {why}")  # fmt: skip
        held = None if fb else holder(module, local.get(name))  # the branch's evidence already says what the replay saw
        if held:
            evidence += (f"; {held['module']} was replayed alone and stays below its local threshold ({held['text']}): "
                         f"there its parameter gradients are one pooled unit, in which {on['param']} is diluted, so the "
                         "end-to-end onset places it")  # fmt: skip
        elif lv and not entry.get("beyond"):
            evidence += (f"; the local replay names no culprit ({lv['text']}): the error is made between recorded modules "
                         "(a hand-off), which only the end-to-end onset places")  # fmt: skip
        rows.append({"run": name, "module": module, "direction": direction, "source": "end to end", "evidence": evidence,
                     "onset_param": on["param"], "framework": fw, "confined": confined})  # fmt: skip
    parts = []
    for r in rows:
        if r["module"]:
            parts.append(f"{r['run']}: born in {r['module']} ({r['direction'] or 'direction unknown'}; {r['source']})")
    # each framework finding is spelled out once, on its run's own line below this summary
    fw = [r["run"] for r in rows if r["framework"]]
    if fw:
        parts.append(f"framework finding in {' and '.join(fw)} (below)")
    return {"per_run": rows, "text": "; ".join(parts) or "no error to localise"}


def _logits_scaled(lc: dict[str, Any], c: float) -> tuple[bool, str] | None:
    """Whether a scale of every gradient at the loss end is the logits' (forward) or the loss's gradient's /
    the head's backward (the loss stays the truth's). Gradients c times too small read as the logits f = 1/c
    times too large, which moves the loss, to first order, by (f - 1) x dL/df (scorer._logit_slope: <W, dL/dW>
    of the output layer); a backward scale moves it by nothing. The two hypotheses have the same honest noise,
    so the nearer one is the more likely: forward when |e - pred| < |e| (e the loss's signed error, relative).
    None where the prediction is within the loss's own band (nothing to tell apart: the moved rule stands) or
    there is no slope."""
    slope, replayed = lc.get("logit_slope"), lc.get("replayed")
    if slope is None or not replayed or not c or lc.get("captured") is None:
        return None
    pred = (1 / c - 1) * slope / abs(replayed)
    e = (lc["captured"] - replayed) / abs(replayed)
    if abs(pred) <= lc["loss_band"]:
        return None
    fwd = abs(e - pred) < abs(e)
    return fwd, (f"logits {1 / c:.4g}x too large would move the loss by {pred:+.2e} (relative, to first order); it moved "
                 f"by {e:+.2e} (band {lc['loss_band']:.1e}): " + ("the logits are scaled (forward)" if fwd else
                 "the loss is the truth's: the gradient entering the backward at the loss end is scaled"))  # fmt: skip


def _forward_branch(module: str, local: dict[str, Any] | None) -> dict[str, Any] | None:
    """The residual branch whose forward output is off (score/local.py ``forward_branch``) in the locally
    replayed block that holds ``module``, with the evidence in words; None without one."""
    rows = [m for m in (local or {}).get("modules", []) if m.get("forward_branch")
            and (module == m["module"] or module.startswith(m["module"] + "."))]  # fmt: skip
    if not rows:
        return None
    m = max(rows, key=lambda r: len(r["module"]))
    b = m["branches"][m["forward_branch"]]
    return {"module": m["forward_branch"], "text": (
        f"replayed alone, {m['module']}'s forward error holds {b['coef']:+.4f} x {m['forward_branch']}'s own output, "
        f"{b['ratio']:.1f}x its honest members' (read forward above {b['threshold']:.1f}x): that branch's forward output "
        "is off, and a scaled output scales its gradients with it")}  # fmt: skip


def _fed_by(d: dict[str, Any], entered: dict[str, Any], local: dict[str, Any] | None) -> tuple[str | None, str]:
    """Where a forward error seen entering a recorded stack's first block was made, outside the recorded
    modules; -> (the module or None, the place in words). The entry row's error split by the module that wrote
    each token row (replay/local.py ``_entry_sources``: Qwen3-VL's image rows the merger's, the others the
    token embedding's): the writer whose rows are furthest beyond their band. Without that split, the layers
    after the entry's along the backward (the decision's order, loss end first) up to the next layer holding a
    recorded module: the module of their largest-excess parameter."""
    row = next((m for m in (local or {}).get("modules", []) if m["module"] == entered["name"]), {})
    src = row.get("sources") or {}
    if src:
        best = max(src, key=lambda k: src[k]["ratio"])
        said = ", ".join(f"{k} {v['ratio']:.1f}x" for k, v in sorted(src.items(), key=lambda kv: -kv[1]["ratio"]))
        return best, f"in the rows each unrecorded module wrote, against their band: {said}"
    entry = entered["input_of"]
    recorded = [m["module"] for m in (local or {}).get("modules", []) if not m.get("entry") and not m.get("input_of")]
    params = d.get("params") or []

    def holds(layer: str, mods: list[str]) -> bool:
        return any(p.get("layer") == layer and any(p["name"].startswith(m + ".") for m in mods) for p in params)

    order = [r["name"] for r in d.get("layers") or []]
    at = next((i for i, lay in enumerate(order) if holds(lay, [entry])), None)
    if at is None:
        return None, f"before {entry}"
    between = []
    for lay in order[at + 1:]:
        if holds(lay, recorded):
            break
        between.append(lay)
    cands = [p for p in params if p.get("layer") in between and p.get("excess") is not None]
    if not cands:
        return None, f"before {entry}"
    worst = max(cands, key=lambda p: p["excess"])
    return module_of(worst["name"]), (f"between the recorded modules and {entry} ({', '.join(between)}); largest "
                                      f"gradient excess there {worst['name']} ({worst['excess']:.1f}x)")  # fmt: skip


def holder(module: str, local: dict[str, Any] | None) -> dict[str, Any] | None:
    """The locally replayed module that holds ``module`` (itself or its nearest ancestor), with its ratio
    against the local threshold in words; None when no replayed module holds it.

    A local replay judges a module's parameter gradients as one unit: rel L2 over all of them,
    sqrt(sum_p ||g_p - t_p||^2 / sum_p ||t_p||^2), against the same pooled members. One parameter's
    error e_p (here, end to end: gate_proj at 4.8x its band) enters that unit weighted by
    ||t_p||^2 / sum ||t||^2, so a fault in one of a layer's nine weight gradients can stay below the
    layer's T (measured: a SwiGLU backward fault at layer 0 of the packed step, 4.8x end to end, 1.66x
    locally against T 2.5x). Such a module was replayed: the error is inside it, not in a hand-off."""
    rows = [m for m in (local or {}).get("modules", []) if module == m["module"] or module.startswith(m["module"] + ".")]
    if not rows:
        return None
    m = max(rows, key=lambda r: len(r["module"]))
    t = ((local or {}).get("threshold") or {}).get("value")
    ratio = m.get("ratio")
    text = (f"largest ratio {ratio:.2f}x" if ratio is not None else "no ratio") + (f", T {t:.2f}x" if t else "")
    return {"module": m["module"], "ratio": ratio, "threshold": t, "text": text}


_VIT_BLOCK = re.compile(r"(^|\.)visual\.blocks\.\d+($|\.)")  # a vision tower's block (Megatron preset ``vit``)
CAPTURE_LAYERS = ("capture both runs again with module boundaries (ORACLE_CAPTURE_MODULES=layers beside ORACLE_CAPTURE, "
                  "layers,vit for a vision-language model; "
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


_LAYER_NAME = re.compile(r"(^|\.)layers\.\d+(\.|$)")


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
    """A gradient whose direction is within noise (sin of its angle to the truth's within T x band)
    while its norm is not: a scale."""
    if p.get("cosine") is None or p.get("norm_ratio") is None:
        return False
    sin = math.sqrt(max(0.0, 1.0 - min(1.0, p["cosine"]) ** 2))
    return sin <= margin * p["band"] < abs(p["norm_ratio"] - 1.0)


_ATTN = re.compile(r"(^|\.)(self_attn|self_attention|attn|attention)($|\.)")


def _module_scale(c: dict[str, Any], module: str, onset: str | None, t: float) -> dict[str, Any] | None:
    """The gradient(s) the error shows in, where every one of them beyond T is a plain scale of one factor."""
    rows = [p for p in c.get("params", []) if p["name"].startswith(module + ".") and p.get("class") == "beyond_noise"]
    on = _param_row(c, onset or "")
    rows = rows or ([on] if on else [])
    if not rows or not all(_plain_scale(p, t) for p in rows):
        return None
    ratios = [p["norm_ratio"] for p in rows]
    if max(ratios) / min(ratios) - 1 > 0.01:  # one factor for all of them
        return None
    return rows[0]


def _forward_scale(module: str, local: dict[str, Any] | None) -> str | None:
    """A forward output that is one factor of the truth's (replay/local.py ``fwd_scale``): what is left after
    scaling by c is within the module's honest forward error x the local fidelity, while the output as it is
    is not; in words, else None."""
    row = next((m for m in (local or {}).get("modules", []) if m["module"] == module), None)
    if not row or row.get("fwd_scale") is None or not row.get("expected_fwd"):
        return None
    band = row["expected_fwd"] * calibrate.LOCAL_FIDELITY
    if row["fwd_after_scaling"] > band or row["fwd"] <= band:
        return None
    return (f"{module}'s forward output is {row['fwd_scale']:.6g}x the truth's (rel L2 {row['fwd']:.2e}, after scaling "
            f"{row['fwd_after_scaling']:.2e}, within its honest {row['expected_fwd']:.2e} x {calibrate.LOCAL_FIDELITY:g}): a "
            "scale of the output, which no op's rounding makes")  # fmt: skip


def _settle(module: str, direction: str | None, local: dict[str, Any] | None) -> tuple[str, bool]:
    """(the capture that settles it, whether it was already made): a sub-module capture of ``module`` unless
    its sub-modules were already replayed locally; the advice names the direction at fault."""
    which = {"forward": "forward output", "backward": "backward"}.get(direction or "", "forward or backward")
    subs = [m["module"] for m in (local or {}).get("modules", []) if m["module"].startswith(module + ".")]
    if subs:
        return (f"{module}'s sub-modules were captured and replayed alone ({len(subs)}, e.g. {subs[0]}) and none is beyond "
                f"its band: the {which} error is made between them (a hand-off) or in {module}'s own glue; "
                "capture ONE micro-batch with the same selection to tell", True)  # fmt: skip
    return (f"capture {module}'s sub-modules too (ORACLE_CAPTURE_MODULES='{_sub_modules(module)}') so that the local "
            f"replay names the one (attention core, rotary, norm, MLP) whose {which} is wrong", False)  # fmt: skip


def op_class(score: dict[str, Any], explained: dict[str, dict[str, Any]], born_rows: list[dict[str, Any]],
             margin: float | None, microbatches: dict[str, int] | None = None, *, decision: dict | None = None,
             runs: list[dict[str, Any]] | None = None, local: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    """``microbatches``: each run's micro-batches per call (a run of several gets the accumulation's reason).
    ``margin``: the --margin given, else each run's own threshold (its score's calibrated T)."""
    rows = []
    by_name = {c["name"]: c for c in score["captures"]}
    recorded = {r["name"]: r.get("modules") for r in runs or []}
    for b in born_rows:
        if not b["module"]:
            continue
        c = by_name[b["run"]]
        t = margin if margin is not None else float((c.get("threshold") or {}).get("value") or 3.0)
        ex = explained.get(b["run"])
        direction = b.get("direction")
        inp = input_row(b["module"])
        if inp:  # an input made outside the recorded modules (replay/local.py ``input_rows``)
            owner, key = inp
            rows.append({"run": b["run"], "class": f"input ({key}, forward)", "share": None, "source": "local replay",
                         "text": f"a wrong input: the {key} {owner} received are not what the step's own inputs give "
                                 f"(the float64 replay computes them from the captured positions): made wrong before "
                                 f"{owner}, where they are computed (for rotary tables: the position ids or sections "
                                 "the rotary embedding used), not a precision"})  # fmt: skip
            continue
        if direction == "forward" and _ATTN.search(b["module"]) and not (ex and ex["classes"][0]["share_only"] >= 0.5):
            rows.append({"run": b["run"], "class": "attention (forward)", "share": None, "source": "signature",
                         "text": f"a forward error in attention: {b['module']} is where it is born and its forward is at fault "
                                 f"({b['source']}): a wrong mask, offset or sample boundary, not a precision (rounding "
                                 "moves no loss beyond its band)"})  # fmt: skip
            continue
        if ex:
            top = ex["classes"][0]
            row = {"run": b["run"], "class": ex["top"] if top["share_only"] >= 0.5 else None, "share": top["share_only"],
                   "source": "explain", "text": ex["text"]}  # fmt: skip
            path = _path_class(c, b["module"]) if direction == "backward" else None
            scale = _module_scale(c, b["module"], b.get("onset_param"), t) if row["class"] is None else None
            fs = _forward_scale(b["module"], (local or {}).get(b["run"])) if row["class"] is None and direction == "forward" else None
            if fs:
                path = {"class": "scaling", "text": fs, "source": "explain, then the forward output"}
            elif scale:
                path = {"class": "scaling", "text": f"{scale['name']} is {scale['norm_ratio']:.6g}x the truth's gradient with "
                                                    f"its direction within noise: a scale"}  # fmt: skip
            if row["class"] is None and path:
                row.update({"class": path["class"], "source": path.get("source", "explain, then the gradient path"),
                            "text": f"no op class's rounding reproduces the error (best {ex['top']}, {top['share_only']:.0%}): "
                                    f"a wrong result, not a precision; {path['text']}"})  # fmt: skip
            if row["class"] is None:
                row["short"] = "no op class's rounding reproduces the error: a wrong result, not a precision"
                row["why"] = (f"no op class's rounding reproduces half of the error in {b['module']} (best: {ex['top']}, "
                              f"{top['share_only']:.0%} in {ex.get('format', 'the capture format')}): not one op class "
                              "computed in too low a precision but a wrong result (a mask, a sign, an index, a missing "
                              "term), which rounding cannot reproduce")  # fmt: skip
                row["settle"], row["settled"] = _settle(b["module"], direction, (local or {}).get(b["run"]))
                row["text"] = f"undetermined: {row['why']}; to settle it, {row['settle']} ({ex['text']})"
            rows.append(row)
            continue
        p = _param_row(c, b.get("onset_param") or "")
        scale = _module_scale(c, b["module"], b.get("onset_param"), t)
        n_mb = (microbatches or {}).get(b["run"], 1)
        if n_mb > 1 and not scale:
            why, settle = _accumulated(n_mb)
            if b.get("confined"):
                why += (f"; the error stays in {b['confined']}'s weight gradient (born, 3.): its weight-gradient GEMM or "
                        "main_grad's accumulation")  # fmt: skip
            rows.append({"run": b["run"], "class": None, "share": None, "source": "gradient signature", "why": why,
                         "settle": settle, "short": f"{n_mb} micro-batches: no local replay",
                         "text": f"undetermined: {why}; to settle it, {settle}"})  # fmt: skip
            continue
        if scale:
            rows.append({"run": b["run"], "class": "scaling", "share": None, "source": "gradient signature",
                         "text": f"a scale, not rounding: {scale['name']} is {scale['norm_ratio']:.6g}x the truth's gradient "
                                 f"with its direction within noise (cosine {scale['cosine']:.9f}); no op's rounding scales a "
                                 "gradient: a scaling or reduction op (a loss or gradient scale, a sum counted twice)"})  # fmt: skip
            continue
        if b.get("source") == "local replay":
            why = f"the local replay places it in {b['module']} ({direction}) and no op class was ranked (explain did not run)"
            settle, done = _settle(b["module"], direction, (local or {}).get(b["run"]))
            rows.append({"run": b["run"], "class": None, "share": None, "source": "local replay", "why": why,
                         "settle": settle, "settled": done, "short": "explain did not run",
                         "text": f"undetermined: {why}; to settle it, {settle}"})  # fmt: skip
            continue
        settle = CAPTURE_LAYERS if direction != "forward" else CAPTURE_LAYERS.replace(
            "places the module", "places the module whose forward output is wrong")
        held = holder(b["module"], (local or {}).get(b["run"]))
        if held:  # replayed, below its local T: the advice is the capture below it, never the one already made
            why = (f"{held['module']} was replayed alone and stays below its local threshold ({held['text']}): its "
                   "parameter gradients are judged there as one pooled unit, and no op class was ranked")  # fmt: skip
            settle, done = _settle(held["module"], direction, (local or {}).get(b["run"]))
            rows.append({"run": b["run"], "class": None, "share": None, "source": "gradient signature", "why": why,
                         "settle": settle, "settled": done, "short": f"{held['module']} replayed, below its local threshold",
                         "text": f"undetermined: {why}; to settle it, {settle}"})  # fmt: skip
            continue
        if recorded.get(b["run"]):
            why = "module boundaries were recorded but none holds this module, so no local replay places it"
            megatron = next((r.get("megatron") for r in runs or [] if r["name"] == b["run"]), False)
            if megatron and _VIT_BLOCK.search(b["module"]):
                settle = ("record the vision blocks too (ORACLE_CAPTURE_MODULES=layers,vit beside ORACLE_CAPTURE): the "
                          "Megatron merge maps them as the HF blocks the framework runs whole on every TP rank, and the "
                          f"local replay then places the fault at {b['module'].split('.blocks.')[0]}.blocks.N")  # fmt: skip
            elif megatron and not _LAYER_NAME.search(b["module"]):  # the advice already taken must not come back
                settle = (f"nothing more from this capture's framework: the Megatron merge maps decoder layers, their "
                          f"sub-modules and the vision blocks (preset vit) only, so {b['module']} stays placed end to end (within the modules before the "
                          "first recorded layer); to go further, capture the sample with `oracle capture --modules` on the same "
                          "device (transformers' model: it reproduces a fault of the device's kernels, not of the "
                          "framework)")  # fmt: skip
            else:
                sel = re.escape(b["module"].removeprefix("model.")) + "$"
                settle = (f"record a selection that holds {b['module']} (ORACLE_CAPTURE_MODULES='{sel}' "
                          f"or a regex naming it, beside ORACLE_CAPTURE; `oracle capture --modules`) so that the local replay "
                          "places it")  # fmt: skip
        elif p is None or p.get("cosine") is None:
            why = "no module boundaries were captured (explain needs them)"
        else:
            why = (f"no module boundaries were captured and the gradient's signature is not a plain scale ({p['name']}: "
                   f"cosine {p['cosine']:.6f}, norm ratio {p['norm_ratio']:.6g})")  # fmt: skip
        short = ("module boundaries recorded, none replayed for it" if recorded.get(b["run"]) else "no module boundaries captured") + (
            ", not a plain scale" if p is not None and p.get("cosine") is not None else "")
        rows.append({"run": b["run"], "class": None, "share": None, "source": "gradient signature" if p else None,
                     "why": why, "settle": settle, "short": short, "text": f"undetermined: {why}; to settle it, {settle}"})  # fmt: skip
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
                   if r.get("input_kind") == "megatron rank folder" or r.get("megatron") else "capture both with `oracle capture --modules` (e.g. --modules all)")
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
        f"(the threshold's floor, the emulation's measured fidelity {FIDELITY:g}x, covers those: docs/limits.md)"
        if score.get("margin") is None else
        "the noise band is emulated rounding of the capture's precision, not a vendor's kernel choices "
        f"(the margin given, {score['margin']:g}x, covers those)"
    )
    return out


def headline(noise_a: dict, born_a: dict, ops: dict, fw: dict | None = None, decision: dict | None = None) -> str:
    """The first line, rendered from the decision: the device verdict on what remains, then the framework's
    findings (never as a device fault) and the gradients left out of the verdict, with the reason."""
    faulty = noise_a["faulty"]
    per = (decision or {}).get("per_run", [])
    tail = ""
    for d in per:
        for f in d["framework"]:
            tail += f"; framework finding in {d['run']} (not the device): {f['text']}"
    if fw and fw.get("text"):
        tail += f"; {fw['text']}"
    for d in per:
        if d["left_out"]:
            tail += (f"; {len(d['left_out'])} gradient(s) of {d['run']} left out of the verdict ({_names(d['left_out'])}): "
                     f"{d['left_out'][0]['why']}")  # fmt: skip
    remains = " on what the framework findings leave" if any(d["framework"] for d in per) else ""
    if not faulty:
        return f"answer: both runs are honest noise of their own precision{remains}; no device bug is shown by this step" + tail
    parts = []
    for run in faulty:
        b = next((r for r in born_a["per_run"] if r["run"] == run), {})
        o = next((r for r in ops["per_run"] if r["run"] == run), {})
        where = f"born in {b['module']} ({b.get('direction') or 'direction unknown'})" if b.get("module") else "not localised"
        cls = o.get("class") or (f"undetermined ({o['short']}; see 4.)" if o.get("short") else "undetermined")
        parts.append(f"{run} is faulty (beyond its own noise band); {where}; op class: {cls}")
    return "answer: " + "; ".join(parts) + tail


def one_capture(runs: list[dict[str, Any]]) -> str:
    """The headline's first words where both runs are one capture (a copy of a folder: byte-identical manifests,
    which hold every tensor's sha256, so the same gradients): one run judged against itself says so first."""
    if len(runs) != 2 or not runs[0].get("fingerprint") or runs[0]["fingerprint"] != runs[1].get("fingerprint"):
        return ""
    return (f"{runs[0]['name']} and {runs[1]['name']} are one capture (byte-identical manifests, so the same gradients): "
            "one run judged against itself, not two devices; give the other device's capture as run B; ")  # fmt: skip


def build(
    score: dict[str, Any], runs: list[dict[str, Any]], *, local: dict, explained: dict, logs: dict | None
) -> dict[str, Any]:
    for c in score["captures"]:  # the loss-token count, for the convention check
        run = next(r for r in runs if r["name"] == c["name"])
        c.setdefault("num_tokens", run.get("num_tokens"))
    decision = decide_mod.decide(score, local, runs)
    a1, a2 = noise(score, decision), farther(score)
    a3 = born(score, local, decision=decision)
    a4 = op_class(score, explained, a3["per_run"], score.get("margin"), {r["name"]: r.get("microbatches", 1) for r in runs},
                  decision=decision, runs=runs, local=local)  # fmt: skip
    a1b = bound_mod.annotate(score, {c["name"]: c.get("num_tokens") for c in score["captures"]})
    fw = framework(score)
    return {
        "schema_version": SCHEMA_VERSION, "kind": "oracle-judge", "headline": headline(a1, a3, a4, fw, decision).replace("answer: ", "answer: " + one_capture(runs), 1),
        "runs": runs, "decision": _public(decision),
        "answers": {"noise": a1, "bound": a1b, "farther": a2, "born": a3, "op_class": a4, "framework": fw},
        "not_concluded": not_concluded(score, local, runs, logs), "logs": logs,
        "score": score, "local": local, "explain": explained,
    }  # fmt: skip


def _public(decision: dict[str, Any]) -> dict[str, Any]:
    """The decision for the JSON: everything but the re-judged rows (the score document holds the rows)."""
    keep = lambda d: {k: v for k, v in d.items() if k not in ("params", "layers")}  # noqa: E731
    return {"faulty": decision["faulty"], "per_run": [keep(d) for d in decision["per_run"]]}
