"""The analytic round-off bound: how large honest rounding error can be at each layer, without a replay.

The model (TTrace, arXiv 2506.09280, Thm 5.3): an honest run's relative gradient error at a layer
that the backward reaches after passing n layers is at most about

    bound(n) = k * C^n * u,        u = 2^-t, the unit round-off of the working precision

with t the significand bits including the implicit one: bf16 t = 8 (u = 2^-8 = 3.9e-3), fp16
t = 11 (2^-11 = 4.9e-4), fp32 t = 24 (2^-24 = 6.0e-8). This is the convention of
oracle/precision (``unit_roundoff``): half the machine epsilon. NVIDIA's evo2 tests, which quote the
same bound with eps = 2^-7 (bf16 machine epsilon) and k = 4-5, use twice our u: their k is half of ours.

n, the layers passed: TTrace numbers layers l = 1..L from the input and writes C^(L+1-l); here
decoder layer i (0-based) of an L-layer model has n = L - i (the last layer n = 1, layer 0 n = L),
the input embedding n = L + 1 and whatever the backward reaches after it (a vision tower's merger,
its blocks from last to first) one more each; the head and the final norm, before any layer,
n = 0 (``exponents``).

k, one layer's own error in units of u. A layer's weight gradient dW = X^T dY is one GEMM whose
operands and result are rounded to the working format; with fp32 accumulation inside the kernel
(every device here) each rounding contributes a relative error of at most u per element, and
about u/sqrt(3) rms (uniform round-to-nearest error), independent between rounding points, so m
points add like a random walk: sqrt(m/3) u. A transformer layer's gradient depends on about
m = 20-40 rounded ops (the forward that made X: norm, four to six GEMMs, rotary, softmax,
activation; the backward that made dY: their transposes): sqrt(m/3) = 2.6-3.7. The accumulation
itself, a dot product of length n_acc in fp32, adds about sqrt(n_acc) * 2^-24 (Higham & Mary's
probabilistic bound, not the worst case n_acc * 2^-24): at 65536 tokens 1.5e-5, 0.4 % of one bf16
u, so it is left out of k for bf16/fp16 and added for fp32 (``k_for``), where it dominates.
K below is that count rounded up to what this project measures (calibration, below).

C, the growth per layer. The error a layer's backward receives is the error of dY, which passed
every layer between it and the loss; each adds its own rounding and multiplies what it receives by
its Jacobian's amplification (the residual stream and the norms keep that near 1). Geometric growth
with C a few % above 1 is TTrace's model; evo2's tests use C = 1.03 at L = 32.

Calibration, measured here (``python benchmarks/bound_calibration.py --layers 4 12 36``: the
embedded tiny Qwen3, hidden 64, 4 query / 2 KV heads, seeded random weights, its default sample,
with 4, 12 and 36 decoder layers; 4 emulated members per precision; each layer's rel L2 against
the float64 truth, in u). The largest member per layer, pure bf16 (every op rounded, the widest
honest bf16 run):
    L = 4:  2.2 u at the head, 2.9 u at the last layer, 4.3 u at layer 0, 4.4 u at the embedding
    L = 12: 2.4 u at the head, 2.5 u at the last layer, 6.7 u at layer 0, 6.8 u at the embedding
    L = 36: 3.6 u at the head, 4.1 u at the last layer, 5.0 u at layer 0, 5.3 u at the embedding
amp-bf16 (autocast) stays within 1.2-2.7 u at every depth, and the real (CPU) bf16 captures within
1.5-3.4 u. fp32: the real captures reach 10.4 u (0.95x the bound before the accumulation term; the
emulated fp32 members move values by a whole ulp on purpose, precision/mode.py, and reach 26 u). The growth fitted through the decoder layers' largest members is 1.13 (L = 4), 1.10
(L = 12) and 1.00 (L = 36): the error grows over the first ~10 layers the backward passes and then
stops growing (no geometric growth over 36 layers on these models). So:
    K = 8: the largest honest layer measured is 6.8 u; 8 u covers it with room for a wider ensemble
       (and is evo2's k = 4 in their eps = 2^-7: the same number);
    C = 1.03: the published value. The tiny models' envelope needs less (with K = 8 no growth at
       all would cover every member: C = 1.00); 1.03 keeps every measured member within 0.61x of
       the bound, and a bound that errs large makes "beyond the bound" the stronger statement.
Neither constant is a fit of an 8B model with trained weights and 64k tokens; at 36 layers in bf16
the bound is 3.2 % at the last layer and 9.1 % at layer 0 (TTrace / evo2: "a few %" and "~10 %").

What the bound is for: a second opinion beside the measured band (``annotate``: a layer beyond
the bound but within the band, or the reverse, is said), and the only opinion where no capture
exists (``logs_verdict``: two runs' grad-norm logs).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

from .. import precision as precisions

K = 8.0  # one layer's error in u: the largest honest layer measured is 6.8 u (calibration above)
C = 1.03  # growth per layer: TTrace's / evo2's value; the tiny models measure <= 1.01 over 36 layers
U_ACCUMULATE = 2.0**-24  # every kernel here accumulates in fp32

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")


def unit_roundoff(precision: str | None) -> float:
    """u = 2^-t of a precision name (a run of unknown precision is held to bf16's, as the scorer does)."""
    return precisions.get(precision or precisions.UNKNOWN.name).unit_roundoff


def k_for(precision: str | None, n_acc: int | None = None) -> float:
    """k in units of the precision's u: K, plus the fp32 accumulation sqrt(n_acc) * 2^-24 / u when
    the accumulation length is known (negligible for bf16/fp16: at most 0.4 % of K at 65536 tokens)."""
    acc = math.sqrt(n_acc) * U_ACCUMULATE / unit_roundoff(precision) if n_acc else 0.0
    return K + acc


def bound(n: int, precision: str | None, *, n_acc: int | None = None, k: float | None = None, c: float = C) -> float:
    """k * C^n * u: the largest relative gradient error an honest run reaches n layers into the backward."""
    return (k_for(precision, n_acc) if k is None else k) * c**n * unit_roundoff(precision)


def depth_of(labels: Iterable[str]) -> int:
    """L: the decoder layers the labels name (largest index + 1); 0 when none is named."""
    idx = [int(m[1]) for lab in labels if (m := _LAYER.search(lab))]
    return max(idx) + 1 if idx else 0


def exponents(labels_backward: list[str], depth: int) -> dict[str, int]:
    """n per layer label, the labels in backward order (loss end first): decoder layer i -> depth - i;
    before any decoder layer (head, final norm) 0; after layer 0 (embedding, a vision tower) one more
    per label; a label between decoder layers takes the previous one's n."""
    out, n, seen_first = {}, 0, False
    for lab in labels_backward:
        m = _LAYER.search(lab)
        if m:
            n = depth - int(m[1])
            seen_first = seen_first or int(m[1]) == 0
        elif seen_first:
            n += 1
        out[lab] = n
    return out


def depth_needed(error: float, precision: str | None, *, n_acc: int | None = None) -> int:
    """The fewest layers passed at which the bound reaches ``error``: n with k C^n u >= error."""
    base = k_for(precision, n_acc) * unit_roundoff(precision)
    if error <= base:
        return 0
    return math.ceil(math.log(error / base) / math.log(C))


def _fmt_u(precision: str | None) -> str:
    return f"2^{round(math.log2(unit_roundoff(precision)))}"


def constants(precision: str | None, depth: int, n_acc: int | None = None) -> dict[str, Any]:
    """The numbers a report states beside the bound."""
    return {"precision": precision, "u": unit_roundoff(precision), "u_text": _fmt_u(precision), "k": k_for(precision, n_acc),
            "C": C, "L": depth, "n_acc": n_acc, "formula": "k * C^n * u"}  # fmt: skip


# -- beside the measured band (oracle judge) ----------------------------------------------------
BEYOND_BOUND_WITHIN_BAND = "beyond the bound, within the band"
WITHIN_BOUND_BEYOND_BAND = "within the bound, beyond the band"


def annotate(score: dict[str, Any], num_tokens: dict[str, int | None] | None = None) -> dict[str, Any]:
    """Put the bound beside the band in every layer row of ``score`` (in place: ``bound``, ``bound_n``,
    ``bound_excess`` = error / bound, ``bound_class`` within / beyond, ``disagrees`` when the bound and
    the band's class say different things) and return the answer: per run, where the two disagree.

    The error compared is the layer's rel L2 (a norm-only capture's |norm ratio - 1|, a lower bound of
    it, so "beyond" stays proven); the band's side is the scorer's class (error <= margin x band);
    the bound has no margin (it is an envelope already). A non-finite layer is beyond both.
    The verdict stays the band's: it is measured on this very step; the bound is a model whose
    constants come from tiny models, and a disagreement says where the two part."""
    order = score.get("layer_order") or []
    depth = depth_of(order)
    ns = exponents(order, depth)
    rows = []
    for c in score["captures"]:
        n_acc = (num_tokens or {}).get(c["name"])
        key = "norm_dev" if c["norms_only"] else "rel_l2"
        beyond, disagree = [], []
        for r in c["layers"]:
            n = ns.get(r["name"], depth)
            b = bound(n, c["precision"], n_acc=n_acc)
            err = r[key]
            nonfinite = r["class"] == "non_finite" or not math.isfinite(err)
            over = nonfinite or err > b
            r.update(bound=b, bound_n=n, bound_excess=(err / b) if math.isfinite(err) else math.inf,
                     bound_class="beyond" if over else "within")  # fmt: skip
            in_band = r["class"] == "within_noise"
            r["disagrees"] = (BEYOND_BOUND_WITHIN_BAND if over and in_band else
                              WITHIN_BOUND_BEYOND_BAND if not over and not in_band and not nonfinite else None)  # fmt: skip
            if over:
                beyond.append(r)
            if r["disagrees"]:
                disagree.append(r)
        rows.append(_run_answer(c, beyond, disagree, constants(c["precision"], depth, n_acc),
                                    (c.get("threshold") or {}).get("value") or score["margin"]))
    text = "; ".join(r["text"] for r in rows)
    return {"per_run": rows, "depth": depth, "text": text}


def _where(r: dict[str, Any], key: str) -> str:
    return (f"{r['name']} (n = {r['bound_n']}: {key} {r[key]:.2e} against the bound {r['bound']:.2e}, "
            f"{r['bound_excess']:.2f}x; its band {r['band']:.2e}, {r['excess']:.2f}x)")  # fmt: skip


def _run_answer(c: dict[str, Any], beyond: list, disagree: list, k: dict[str, Any], margin: float) -> dict[str, Any]:
    name, layers = c["name"], c["layers"]
    key = "norm_dev" if c["norms_only"] else "rel_l2"
    worst = max(layers, key=lambda r: r["bound_excess"]) if layers else None
    head = f"{name}: "
    if not layers:
        text = head + "no layer to set against the bound"
    elif not beyond:
        text = head + f"within the analytic bound at every layer (worst {worst['bound_excess']:.2f}x of it at {worst['name']})"
    else:
        text = head + (f"beyond the analytic bound at {len(beyond)}/{len(layers)} layers, first along the backward at "
                       f"{beyond[0]['name']} ({beyond[0]['bound_excess']:.1f}x)")  # fmt: skip
    lines = []
    for kind in (BEYOND_BOUND_WITHIN_BAND, WITHIN_BOUND_BEYOND_BAND):
        rs = [r for r in disagree if r["disagrees"] == kind]
        if not rs:
            continue
        names = ", ".join(r["name"] for r in rs[:4]) + (f", ... ({len(rs) - 4} more)" if len(rs) > 4 else "")
        if kind == BEYOND_BOUND_WITHIN_BAND and rs[0]["band"] > rs[0]["bound"]:
            why = ("the emulated band of this step is wider there than the round-off model allows: honest by the band "
                   "(the verdict), larger than k C^n u; the bound's constants come from tiny models")  # fmt: skip
        elif kind == BEYOND_BOUND_WITHIN_BAND:  # the band itself under the bound: the margin let the error through
            why = (f"within the margin ({margin:g}x) of the emulated band, which is itself under the bound there: honest "
                   "by the band (the verdict) only through the margin; a smaller --margin would call it beyond noise")  # fmt: skip
        else:
            why = ("an error honest rounding could make by the bound's count, but larger than this step's emulated "
                   f"members reach (x margin {margin:g}): the band, measured on this step, rules")  # fmt: skip
        lines.append(f"{name}: {kind} at {names}; first {_where(rs[0], key)}: {why}")
    if not disagree and layers:
        text += "; the bound and the band agree at every layer"
    return {"run": name, "constants": k, "beyond": [r["name"] for r in beyond],
            "disagree": [{"layer": r["name"], "kind": r["disagrees"], "error": r[key], "bound": r["bound"], "band": r["band"],
                          "n": r["bound_n"]} for r in disagree],
            "text": text, "lines": lines}  # fmt: skip


# -- two runs' grad-norm logs, no capture (oracle judge --log-a --log-b) ---------------------------
def proven_error(ratio: float) -> float:
    """The relative error against the truth that at least one of two runs must have, given the ratio
    r = ||g_B|| / ||g_A|| of their gradient norms (over one layer's parameters):

        |r - 1| = | ||g_B|| - ||g_A|| | / ||g_A|| <= ||g_B - g_A|| / ||g_A||      (triangle inequality)

    so |r - 1| is a lower bound of the relative difference between the runs, i.e. of B's relative
    error taking A as the reference. Against the truth t, with e_X = ||g_X - t|| / ||t||:
    ||g_X|| / ||t|| lies in [1 - e_X, 1 + e_X], so r <= (1 + e_B) / (1 - e_A); if both e_A, e_B <= e
    then r <= (1 + e) / (1 - e) and, the same way, r >= (1 - e) / (1 + e). Hence

        max(e_A, e_B) >= |r - 1| / (1 + r)      (about |r - 1| / 2 for r near 1)

    at least one run is that far from the truth, whichever is right. Two honest runs, each within the
    bound b, have |r - 1| <= 2b / (1 - b): the two statements are the same test."""
    if not (math.isfinite(ratio) and ratio > 0):
        return math.inf
    return abs(ratio - 1.0) / (1.0 + ratio)


def logs_verdict(layers: list[dict[str, Any]], *, precision: str = "bf16", depth: int | None = None,
                 params: list[dict[str, Any]] = ()) -> dict[str, Any]:  # fmt: skip
    """The bound against what two norm logs prove, per layer (``normlog.compare``'s layer rows, backward
    order: ``layer``, ``ratio``). ``depth``: the model's decoder layers; default the logs' own count
    (a log of one pipeline stage or an excerpt names fewer: the bound is then lower than the model's,
    which is why the verdict also says from which depth on honest noise could reach the measurement)."""
    labels = [r["layer"] for r in layers]
    named = depth_of(labels)
    L = depth or named
    ns = exponents(labels, L)
    k = constants(precision, L)
    partial = {}
    for p in params:  # pre-finalize partial sums (norm weights under SP): their norms follow each run's chunking
        partial[p["layer"]] = partial.get(p["layer"], 0) + bool(p.get("partial_sum"))
    rows = []
    for r in layers:
        n = ns[r["layer"]]
        b = bound(n, precision)
        e = proven_error(r["ratio"])
        rows.append({"layer": r["layer"], "n": n, "ratio": r["ratio"], "diff": abs(r["ratio"] - 1.0), "proven": e,
                     "bound": b, "pair_bound": 2 * b / (1 - b), "beyond": e > b,
                     "depth_needed": depth_needed(e, precision) if math.isfinite(e) else None,
                     "partial_sums": partial.get(r["layer"], 0)})  # fmt: skip
    inp = rows[-1] if rows else None  # the input end: the embedding in a decoder's log
    src = (f"L = {L} decoder layers, " + ("given" if depth else "as many as the logs name: a log of one pipeline stage "
           "or an excerpt names fewer than the model has, and a deeper model's bound is larger (--num-layers)"))  # fmt: skip
    lines = [f"analytic round-off bound ({precision}, u = {k['u_text']} = {k['u']:.2e}, k = {k['k']:g}, C = {C:g}; {src}): "
             "an honest run's relative gradient error n layers into the backward is at most b = k C^n u"]  # fmt: skip
    if L:
        b1, b0 = bound(1, precision), bound(L, precision)
        lines.append(f"b = {b1:.1%} at the last decoder layer (n = 1), {b0:.1%} at layer 0 (n = {L})"
                     + (f", {inp['bound']:.1%} at {inp['layer']} (n = {inp['n']})" if inp and inp["n"] > L else "")
                     + f"; two honest runs' norms then differ by at most 2b/(1-b): {2 * b1 / (1 - b1):.1%}, "
                     + f"{2 * b0 / (1 - b0):.1%}" + (f", {inp['pair_bound']:.1%}" if inp and inp["n"] > L else ""))  # fmt: skip
    verdict = None
    if inp:
        beyond = inp["beyond"]
        need = inp["depth_needed"]
        at_depth = need - (inp["n"] - L) if need is not None else None  # the model depth whose n here reaches it
        verdict = (f"{inp['layer']}: the norms differ by |r-1| = {inp['diff']:.1%} (r = {inp['ratio']:.4f}), so at least one "
                   f"run is at least |r-1|/(1+r) = {inp['proven']:.1%} off the truth there, "
                   f"{inp['proven'] / inp['bound']:.1f}x the bound {inp['bound']:.1%}: "
                   + ("BEYOND honest round-off for this depth" if beyond else "within honest round-off for this depth")
                   + (f"; honest noise reaches it only in a model of at least {at_depth} decoder layers" if beyond and at_depth
                      else ""))  # fmt: skip
        if inp["partial_sums"]:
            verdict += (f" (its ratio includes {inp['partial_sums']} pre-finalize partial sum(s), whose norms depend on "
                        "how each run chunked the sequence)")  # fmt: skip
        lines.append(verdict)
    out_of = [r["layer"] for r in rows if r["beyond"]]
    if out_of:
        lines.append(f"beyond the bound: {len(out_of)}/{len(rows)} layers ({', '.join(out_of)})")
    if any(r["partial_sums"] for r in rows):
        lines.append("a layer's ratio includes its norm weights, which a pre-finalize print under sequence parallel holds as "
                     "per-rank partial sums: a ratio there may be chunking, not arithmetic; a layer without them "
                     "(the embedding, a TP shard) is free of that")  # fmt: skip
    return {"constants": k, "named_depth": named, "rows": rows, "verdict": verdict,
            "beyond": bool(inp and inp["beyond"]), "lines": lines}  # fmt: skip
