"""``oracle score --report DIR``: a page people look at and paste into a bug report.

Writes ``errors.png`` (relative error per layer in backward order for every capture, log scale,
with each capture's noise band shaded), ``params.csv`` (every parameter's metrics), ``score.json``
(the full result) and ``index.html`` (a self-contained page: verdicts, the plot inlined as base64,
the per-layer tables). matplotlib is imported only here, with the non-interactive Agg backend.
"""

from __future__ import annotations

import base64
import csv
import html
import io
from pathlib import Path
from typing import Any

from ..bundle.atomic_file import write_file, write_json

CSV_FIELDS = ["capture", "precision", "name", "layer", "rel_l2", "cosine", "norm_ratio", "max_abs",
              "frac_rel_gt_1e-3", "nonfinite", "band", "excess", "class"]  # fmt: skip


def plot_png(result: dict[str, Any]) -> bytes:
    """The error-per-layer figure of ``result`` as PNG bytes (written by the caller, atomically)."""
    buf = io.BytesIO()
    plot(result, buf)
    return buf.getvalue()


def plot(result: dict[str, Any], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = result["layer_order"]
    fig, ax = plt.subplots(figsize=(max(8, 0.35 * len(order) + 3), 5))
    xs = {lab: i for i, lab in enumerate(order)}
    for k, c in enumerate(result["captures"]):
        metric = "norm_dev" if c["norms_only"] else "rel_l2"
        rows = [r for r in c["layers"] if r["name"] in xs]
        x = [xs[r["name"]] for r in rows]
        color = f"C{k}"
        ax.fill_between(x, [r["band_low"] for r in rows], [r["band"] for r in rows], color=color, alpha=0.3,
                        label=f"{c['name']}: noise band ({c['band_kind']})")  # fmt: skip
        t = (c.get("threshold") or {}).get("value") or result["margin"]  # the run's threshold (calibrate.py)
        ax.fill_between(x, [r["band"] for r in rows], [r["band"] * t for r in rows], color=color,
                        alpha=0.1, label=f"{c['name']}: up to band x threshold ({t:.2g})")  # fmt: skip
        ax.plot(x, [max(r[metric], 1e-18) for r in rows], "o-", color=color, label=f"{c['name']} ({c['precision']})")
        if rows and all("bound" in r for r in rows):  # judge: the analytic bound k C^n u (score/bound.py)
            ax.plot(x, [r["bound"] for r in rows], ":", color=color, lw=1.5, label=f"{c['name']}: analytic bound k C^n u")
        on = c["verdict"].get("onset")
        if on:
            ax.axvline(xs[on["layer"]], color=color, ls="--", lw=1)
    ax.set_yscale("log")
    ax.set_xticks(range(len(order)))
    ax.set_xticklabels(order, rotation=70, ha="right", fontsize=8)
    ax.set_ylabel("relative L2 error vs float64 oracle")
    ax.set_xlabel("layer, in backward order (loss end first)")
    ax.set_title("gradient error per layer against the noise band")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def _json_and_csv(result: dict[str, Any], out_dir: str | Path, csv_name: str, fields: list[str], rows) -> Path:
    """The report folder with ``score.json`` (strict JSON) and one CSV of ``rows``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(result, out / "score.json")
    f = io.StringIO(newline="")
    w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow(r)
    write_file(out / csv_name, f.getvalue())
    return out


def layer_table(c: dict[str, Any]) -> str:
    """One capture's per-layer table (loss end first) as HTML: the metric, band, excess, class, worst parameter."""
    e = html.escape
    metric = "norm_dev" if c["norms_only"] else "rel_l2"
    has_bound = any("bound" in r for r in c["layers"])  # judge: the analytic bound beside the band (score/bound.py)
    bh = "<th>analytic bound</th><th>x bound</th>" if has_bound else ""
    rows = [f"<table><tr><th>layer</th><th>{metric}</th><th>band</th><th>excess</th>{bh}<th>class</th><th>worst parameter</th></tr>"]
    for r in c["layers"]:
        bc = f"<td>{r['bound']:.3e}</td><td>{r['bound_excess']:.2f}</td>" if has_bound else ""
        cls = r["class"] + (f"; {r['disagrees']}" if r.get("disagrees") else "")
        rows.append(f"<tr class='{r['class']}'><td>{e(r['name'])}</td><td>{r[metric]:.3e}</td><td>{r['band']:.3e}</td>"
                    f"<td>{r['excess']:.2f}</td>{bc}<td>{e(cls)}</td><td>{e(r['worst_param'])}</td></tr>")  # fmt: skip
    return "\n".join([*rows, "</table>"])


def write_report(result: dict[str, Any], out_dir: str | Path) -> Path:
    rows = ({"capture": c["name"], "precision": c["precision"], **r} for c in result["captures"] for r in c["params"])
    out = _json_and_csv(result, out_dir, "params.csv", CSV_FIELDS, rows)
    raw = plot_png(result)
    write_file(out / "errors.png", raw)
    png = base64.b64encode(raw).decode()
    e = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>oracle score</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;font-size:13px}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}td:first-child{text-align:left}"
        ".beyond_noise{background:#fdd}.non_finite{background:#f99}.within_noise{background:#efe}pre{background:#f6f6f6;padding:1em}</style>",
        "</head><body><h1>oracle: gradients against the float64 truth</h1>",
        f"<p>oracle <code>{e(result['oracle']['path'])}</code>, loss {result['oracle']['loss']}</p>",
        f"<pre>{e(result['summary'])}</pre>",
        f"<img alt='relative error per layer' src='data:image/png;base64,{png}' style='max-width:100%'>",
        "<p>Files: <a href='score.json'>score.json</a>, <a href='params.csv'>params.csv</a>, <a href='errors.png'>errors.png</a></p>",
    ]
    for c in result["captures"]:
        parts.append(f"<h2>{e(c['name'])} ({e(c['precision'])})</h2><p>{e(c['verdict']['text'])}</p>")
        parts.append(layer_table(c))
    parts.append("</body></html>")
    return write_file(out / "index.html", "\n".join(parts))


LOCAL_CSV_FIELDS = ["module", "calls", "order", "fwd", "expected_fwd", "ratio_fwd", "bwd", "expected_bwd", "ratio_bwd",
                    "param", "expected_param", "ratio_param", "inherited", "ratio", "class", "direction", "born_nonfinite"]  # fmt: skip


def _sortable(x: Any) -> float:
    """A ratio as a sort key: inf (a non-finite birth) sorts first, NaN/None last."""
    return x if isinstance(x, (int, float)) and x == x else 0.0


def explain_section(res: dict[str, Any]) -> str:
    """The HTML section of one op-level attribution (explain.py)."""
    e = html.escape
    rows = "".join(
        f"<tr><td>{e(r['class'])}</td><td>{r['share_only']:.1%}</td><td>{r['scale_only']:.2g}</td>"
        f"<td>{r['share_except']:.1%}</td><td>{r['rel_only']:.3e}</td></tr>"
        for r in res["classes"]
    )
    return (f"<h2>op classes in {e(res['module'])} (run in {e(res['format'])})</h2><p>{e(res['text'])}</p>"
            "<table><tr><th>op class</th><th>share of the device's error reproduced</th><th>scale</th>"
            f"<th>share, in context</th><th>class error</th></tr>{rows}</table>")  # fmt: skip


def write_local_report(res: dict[str, Any], out_dir: str | Path, explained: list[dict[str, Any]] = ()) -> Path:
    """``oracle score LOCAL --report DIR``: ``score.json`` (non-finite numbers as null),
    ``modules.csv`` and ``index.html`` (the verdict and the per-module table, culprits first; then
    a section per op-level attribution in ``explained``, from ``oracle explain``)."""

    out = _json_and_csv(res, out_dir, "modules.csv", LOCAL_CSV_FIELDS, res["modules"])
    e = html.escape
    num = lambda x, s=".3e": "-" if not isinstance(x, (int, float)) else format(x, s)  # noqa: E731
    rank = {m: i for i, m in enumerate(res["culprits"])}
    rows = sorted(res["modules"], key=lambda r: (rank.get(r["module"], len(rank)), -_sortable(r["ratio"])))
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>oracle local score</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;font-size:13px}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}td:first-child{text-align:left}"
        ".beyond_noise{background:#fdd}.non_finite{background:#f99}.within_noise{background:#efe}pre{background:#f6f6f6;padding:1em}</style>",
        "</head><body><h1>oracle: where the error is born (teacher-forced local replay)</h1>",
        f"<p>local replay <code>{e(res['local'])}</code> ({e(str(res['precision']))})</p>",
        f"<pre>{e(res['verdict']['text'])}</pre>",
        "<p>Files: <a href='score.json'>score.json</a>, <a href='modules.csv'>modules.csv</a></p>",
        "<table><tr><th>module</th><th>fwd</th><th>x</th><th>bwd</th><th>x</th><th>param</th><th>x</th>"
        "<th>inherited</th><th>class</th><th>direction</th></tr>",
    ]
    for r in rows:
        parts.append(f"<tr class='{r['class']}'><td>{e(r['module'])}</td><td>{num(r.get('fwd'))}</td><td>{num(r.get('ratio_fwd'), '.1f')}</td>"
                     f"<td>{num(r.get('bwd'))}</td><td>{num(r.get('ratio_bwd'), '.1f')}</td><td>{num(r.get('param'))}</td>"
                     f"<td>{num(r.get('ratio_param'), '.1f')}</td><td>{num(r.get('inherited'))}</td><td>{r['class']}</td>"
                     f"<td>{r.get('direction') or ''}</td></tr>")  # fmt: skip
    parts.append("</table>")
    parts += [explain_section(x) for x in explained]
    parts.append("</body></html>")
    return write_file(out / "index.html", "\n".join(parts))


def write_explain_report(res: dict[str, Any], out_dir: str | Path) -> Path:
    """``oracle explain ... --report DIR``: ``explain.json`` and ``index.html``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(res, out / "explain.json")
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>oracle explain</title><style>body{font-family:sans-serif;"
            "margin:2em}table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:2px 6px}</style>"
            f"</head><body><h1>oracle: op-level attribution</h1>{explain_section(res)}</body></html>")  # fmt: skip
    return write_file(out / "index.html", page)
