"""Terminal rendering of a score result: the oracle line, per capture the worst parameters and
the per-layer table in backward order, then the verdict lines. Plain text, fixed-width columns."""

from __future__ import annotations

from typing import Any


def _f(x: Any, spec: str = ".2e") -> str:
    if x is None:
        return "-"
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def _num(x: Any) -> float:
    """A sort key: NaN sorts as +inf (an excess that cannot be computed is not a small one)."""
    return float("inf") if x != x else x


def render(result: dict[str, Any], *, top: int = 8, max_layers: int = 40, more_in: str = "--json / --report") -> str:
    """``oracle score``'s text; ``more_in``: where the layers past ``max_layers`` are (the command's own
    options or files: judge and demo name their report's judge.json and index.html)."""
    o = result["oracle"]
    lines = [f"oracle: {o['path']}  ({o['precision']}, loss {_f(o['loss'], '.10g')})"]
    cert = o.get("certificate")
    if cert:
        lines.append(
            f"  certified: finite-difference residual {cert['fd_rel_residual']:.1e} over {cert['directions']} directions"
        )
    if o.get("warning"):
        lines.append(f"  WARNING: {o['warning']}")
    for c in result["captures"]:
        lines.append("")
        lines.append(f"== {c['name']}  [{c['precision']}]  loss {_f(c['loss'], '.10g')}  band: {c['band_kind']}")
        if c.get("coverage"):
            lines.append(f"  coverage: {c['coverage']['text']}")
        if c.get("loss_check"):
            lines.append(f"  loss: {c['loss_check']['text']}")
        metric = "norm_dev" if c["norms_only"] else "rel_l2"
        # non-finite tensors first, in backward order (where they appear first), then by excess
        nf = {n: i for i, n in enumerate(c["verdict"].get("nonfinite_params") or [])}
        worst = sorted(c["params"], key=lambda r: (nf.get(r["name"], len(nf)), -_num(r["excess"])))[:top]
        lines.append("  worst parameters (non-finite first, then by excess over band)")
        w = max([60] + [len(r["name"]) for r in worst])  # whole names: a long one widens the column, never cut
        lines.append(f"  {'parameter':<{w}} {metric:>9} {'band':>9} {'excess':>8} {'cosine':>9} {'norm_ratio':>10}  class")
        for r in worst:
            err = abs(r["norm_ratio"] - 1) if c["norms_only"] else r["rel_l2"]
            lines.append(f"  {r['name']:<{w}} {_f(err):>9} {_f(r['band']):>9} {_f(r['excess'], '.2f'):>8} "
                         f"{_f(r.get('cosine'), '.6f'):>9} {_f(r['norm_ratio'], '.5f'):>10}  {r['class']}")  # fmt: skip
        for r in c["params"]:  # padded vocabulary rows [V, Vp): real parameters, listed apart
            pr = r.get("padded_rows")
            if pr:
                lines.append(f"  padded rows {pr['rows'][0]}..{pr['rows'][1]} of {r['name']}: rel L2 {_f(pr['rel_l2'])}, "
                             f"norm {_f(pr['norm'], '.4g')} (truth {_f(pr['ref_norm'], '.4g')})")  # fmt: skip
        lines.append("  per layer, loss end first")
        has_bound = any("bound" in r for r in c["layers"])  # judge: the analytic bound beside the band (score/bound.py)
        bh = f" {'bound':>9} {'x bound':>8}" if has_bound else ""
        lines.append(f"  {'layer':<34} {metric:>9} {'band':>9} {'excess':>8}{bh}  class")
        shown = c["layers"] if len(c["layers"]) <= max_layers else c["layers"][:max_layers]
        for r in shown:
            bc = f" {_f(r.get('bound')):>9} {_f(r.get('bound_excess'), '.2f'):>8}" if has_bound else ""
            note = f"; {r['disagrees']}" if r.get("disagrees") else ""
            lines.append(f"  {r['name']:<34} {_f(r[metric]):>9} {_f(r['band']):>9} {_f(r['excess'], '.2f'):>8}{bc}  {r['class']}{note}")
        if len(c["layers"]) > max_layers:
            lines.append(f"  ... {len(c['layers']) - max_layers} more layers in {more_in}")
    lines.append("")
    lines.append("verdict:")
    lines += ["  " + ln for ln in result["summary"].splitlines()]
    return "\n".join(lines)


def render_local(res: dict[str, Any]) -> str:
    """A local-replay score (score/local.py): per module the error born there and its ratio to an
    honest run of the same module, culprits (non-finite births first), the verdict."""
    w = max([52] + [len(r["module"]) for r in res["modules"]])  # whole names: the layer index is on the left
    lines = [f"local replay {res['local']} ({res['precision']}): error born in each module vs an honest run of the same module",
             f"  {'module':<{w}} {'fwd':>9} {'x':>7} {'bwd':>9} {'x':>7} {'param':>9} {'x':>7} {'inherited':>9}"]  # fmt: skip
    for r in sorted(res["modules"], key=lambda r: -_num(r["ratio"])):
        flag = f"  NON-FINITE born in its {r['born_nonfinite']}" if r.get("born_nonfinite") else ""
        lines.append(f"  {r['module']:<{w}} {_f(r.get('fwd')):>9} {_f(r.get('ratio_fwd'), '.1f'):>7} {_f(r.get('bwd')):>9} "
                     f"{_f(r.get('ratio_bwd'), '.1f'):>7} {_f(r.get('param')):>9} {_f(r.get('ratio_param'), '.1f'):>7} "
                     f"{_f(r.get('inherited')):>9}{flag}")  # fmt: skip
    lines += ["", "ranked culprits: " + (", ".join(res["culprits"]) or "none"), "verdict: " + res["verdict"]["text"]]
    return "\n".join(lines)


def render_explain(res: dict[str, Any]) -> str:
    """An op-level attribution (explain.py): classes ranked by the share of the device's error
    each reproduces when run alone in the capture's format."""
    lines = [f"explain {res['module']} in {res['capture']} ({res['precision']}; classes run in {res['format']})",
             f"  device error (relative, outputs + grad_inputs + parameter grads): {_f(res['device_rel_error'])}",
             f"  {'op class':<14} {'share_only':>10} {'scale':>8} {'share_except':>12} {'class error':>11}"]  # fmt: skip
    for r in res["classes"]:
        lines.append(f"  {r['class']:<14} {r['share_only']:>10.1%} {_f(r['scale_only'], '.2g'):>8} "
                     f"{r['share_except']:>12.1%} {_f(r['rel_only']):>11}")  # fmt: skip
    lines += ["", "verdict: " + res["text"]]
    return "\n".join(lines)


def render_replay(capture, out, dtype: str) -> str:
    """What ``oracle replay`` prints once the bundle at ``out`` is written: loss, time, the streaming
    record (peak RSS against the budget, spilled activations, resumed work), the certificate, the promotions."""
    from ..bundle.store import Bundle

    b = Bundle(out)
    msg = f"replayed {capture} in {dtype}: loss {b.get('loss')['value']:.12g} ({b.get('seconds')} s) -> {out}"
    split = b.get("token_parallel")
    if split:
        msg += f"\n  split by tokens over {split['ranks']} ranks (every gradient within {split['bound_rel']:.0e} of one process's)"
    elif (b.get("ranks") or 1) > 1:
        msg += f"\n  on {b.get('ranks')} ranks"
    if b.get("streaming"):
        st = b.get("streaming")
        msg += (
            f"\n  streamed within {st['max_memory'] / 2**30:.2f} GiB: peak RSS {st['peak_rss'] / 2**30:.2f} GiB, "
            f"activations spilled {st.get('activations_spilled', 0) / 2**30:.2f} GiB" + (" (resumed)" if st["resumed"] else "")
        )
        msg += "".join(f"\n  work folder: {note}" for note in st.get("recomputed", []))
    cert = b.get("certificate")
    if cert:
        msg += f"\n  certificate: finite-difference residual {cert['fd_rel_residual']:.1e} over {cert['directions']} directions"
    if b.get("numerics"):
        msg += f"\n  float64 throughout: {b.get('numerics')['promotions']} lower-precision casts in the model code promoted"
    return msg
