"""``oracle judge``'s report: the four answers in words first, then the tables and the plot.

Writes into the report folder ``judge.txt`` (what the terminal shows), ``judge.json`` (the whole
document, schema in docs/judge.md), ``errors.png`` (``files.plot``:
rel L2 per layer in backward order against each run's band) and ``index.html`` (self-contained: the
plot inlined as base64; an in-page hook writes any script error into ``#js-errors`` so a browser
check can read it from the DOM). Files are written to a temporary sibling and renamed into place.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from ..bundle.atomic_file import write_file
from ..bundle.jsonio import dumps
from ..errors import OutputError
from .files import layer_table, plot_png
from .text import render, render_explain, render_local

QUESTIONS = [
    ("noise", "1. Bug or honest noise (each run against the band of its own precision)?"),
    ("farther", "2. Which run is farther from the truth, layer by layer?"),
    ("born", "3. Where is the error born (module, forward or backward), and does the framework misbehave?"),
    ("op_class", "4. Which op class explains it?"),
]


def _per_run_lines(key: str, a: dict[str, Any]) -> list[str]:
    out = []
    for r in a.get("per_run", []):
        if key == "noise":
            out.append(f"   {r['text']}")
        elif key == "born":
            where = f"{r['module']} ({r['direction'] or 'direction unknown'}): " if r["module"] else ""
            out.append(f"   {r['run']}: {where}{r['evidence']}")
            out += [f"   {r['run']} framework: {f}" for f in r["framework"]]
        elif key == "op_class":
            if r["class"] is None and r.get("why"):  # why not, and what capture would settle it
                out.append(f"   {r['run']}: undetermined ({r['source'] or 'no evidence'}): {r['why']}")
                out.append(f"   {r['run']}: to settle it, {r['settle']}")
            else:
                out.append(f"   {r['run']}: {r['class'] or 'undetermined'} ({r['source'] or 'no evidence'}): {r['text']}")
    return out


def _own_text(key: str, answer: dict[str, Any]) -> str | None:
    """An answer's own line, or None where its per-run lines say it whole: answer 1's text is those runs' texts
    joined (answers.noise), printed once, run by run."""
    return None if key == "noise" and answer.get("per_run") else answer["text"]


def bound_lines(b: dict[str, Any]) -> list[str]:
    """The analytic bound's answer under question 1: its constants, per run where it stands, where it and the band part."""
    out = []
    for r in b["per_run"]:
        k = r["constants"]
        out.append(f"analytic round-off bound k C^n u ({k['precision']}: u = {k['u_text']}, k = {k['k']:.3g}, C = {k['C']:g}, "
                   f"L = {k['L']}): {r['text']}")  # fmt: skip
        out += r["lines"]
    return out


MORE_IN_REPORT = "the report's judge.json and index.html"  # judge and demo have no --json / --report: the report has all


def render_answers(doc: dict[str, Any]) -> str:
    """The headline, the four answers and what was not concluded: the report's first part."""
    a = doc["answers"]
    lines = [doc["headline"], ""]
    for key, q in QUESTIONS:
        lines.append(q)
        lines += [f"   {t}" for t in [_own_text(key, a[key])] if t is not None]
        lines += _per_run_lines(key, a[key])
        if key == "noise" and a[key].get("band"):
            lines += [f"   {x}" for x in a[key]["band"]["lines"]]
        if key == "noise" and a.get("bound"):
            lines += [f"   {x}" for x in bound_lines(a["bound"])]
    lines += ["", "not concluded:"] + [f"   - {x}" for x in doc["not_concluded"]]
    return "\n".join(lines)


def render_judge(doc: dict[str, Any]) -> str:
    lines = [render_answers(doc)]
    lines += ["", "-- evidence --", render(doc["score"], top=8, more_in=MORE_IN_REPORT)]
    for name, loc in (doc.get("local") or {}).items():
        lines += ["", f"-- {name}: local replay --", render_local(loc)]
    for name, ex in (doc.get("explain") or {}).items():
        lines += ["", f"-- {name}: explain --", render_explain(ex)]
    logs = doc.get("logs")
    if logs:
        labels = logs["labels"]
        w = max([64] + [len(r["name"]) for r in logs["params"]])  # whole names, never cut
        lines += ["", f"-- grad-norm logs against the truth ({logs['where']}) --",
                  f"  {'parameter':<{w}} {'truth':>11} " + " ".join(f"{lab:>11}" for lab in labels) + "  closer"]  # fmt: skip
        for r in logs["params"]:
            vals = " ".join(f"{r['logs'][lab]:>11.5g}" if r["logs"][lab] is not None else f"{'-':>11}" for lab in labels)
            lines.append(f"  {r['name']:<{w}} {r['oracle']:>11.5g} {vals}  {r['closer'] or '-'}")
        lines.append("  closer to the truth: " + ", ".join(f"{k} on {v} parameter(s)" for k, v in logs["wins"].items()))
    return "\n".join(lines)


def render_logs_only(doc: dict[str, Any]) -> str:
    lines = [f"from the logs alone ({doc['names'][0]} vs {doc['names'][1]}, no capture):", "", "what they show:"]
    lines += [f"   {s}" for s in doc["shows"]]
    b = doc.get("bound")
    if b:
        lines += ["", "against honest round-off (no capture needed):"] + [f"   {s}" for s in b["lines"]]
        lines.append(f"   {'layer':<16} {'n':>3} {'ratio r':>8} {'|r-1|':>7} {'proven':>7} {'bound':>7} {'2b/(1-b)':>8}  verdict")
        for r in b["rows"]:
            lines.append(f"   {r['layer']:<16} {r['n']:>3} {r['ratio']:>8.4f} {r['diff']:>7.1%} {r['proven']:>7.1%} {r['bound']:>7.1%} "
                         f"{r['pair_bound']:>8.1%}  {'BEYOND the bound' if r['beyond'] else 'within'}")  # fmt: skip
        lines.append("   (proven = |r-1|/(1+r): at least one run is this far from the truth; bound = k C^n u per run)")
    lines += ["", "what cannot be concluded without a capture:"] + [f"   - {s}" for s in doc["cannot_conclude"]]
    lines += ["", "capture the step on both clusters:", doc["capture_commands"], "-- the logs side by side --",
              doc["compare_text"]]  # fmt: skip
    return "\n".join(lines)


def _html(doc: dict[str, Any], png: str) -> str:
    e = html.escape
    a = doc["answers"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>oracle judge</title>",
        "<script>window.__errors=[];window.addEventListener('error',function(ev){window.__errors.push(String(ev.message));"
        "var d=document.getElementById('js-errors');if(d){d.textContent=window.__errors.join('\\n');}});</script>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;font-size:13px}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}td:first-child{text-align:left}"
        ".beyond_noise{background:#fdd}.non_finite{background:#f99}.within_noise{background:#efe}"
        ".headline{font-size:1.2em;font-weight:bold;padding:.5em;background:#fff4d6}pre{background:#f6f6f6;padding:1em}</style>",
        "</head><body><h1>oracle judge: two runs against the float64 truth</h1>",
        f"<p class='headline' id='headline'>{e(doc['headline'])}</p>",
        "<h2>The four questions</h2><ol id='answers'>",
    ]
    for key, q in QUESTIONS:
        sub = "".join(f"<li>{e(x.strip())}</li>" for x in _per_run_lines(key, a[key]))
        if key == "noise" and a[key].get("band"):
            sub += "".join(f"<li class='band'>{e(x)}</li>" for x in a[key]["band"]["lines"])
        if key == "noise" and a.get("bound"):
            sub += "".join(f"<li class='bound'>{e(x)}</li>" for x in bound_lines(a["bound"]))
        own = _own_text(key, a[key])
        parts.append(f"<li id='answer-{key}'><b>{e(q[3:])}</b>{'' if own is None else '<br>' + e(own)}<ul>{sub}</ul></li>")
    parts.append("</ol><h2>Not concluded</h2><ul>" + "".join(f"<li>{e(x)}</li>" for x in doc["not_concluded"]) + "</ul>")
    parts.append(
        "<h2>Verdicts</h2><table id='verdicts'><tr><th>run</th><th>precision</th><th>band</th><th>class</th><th>verdict</th></tr>"
    )
    for r in a["noise"]["per_run"]:
        parts.append(f"<tr class='{r['class']}'><td>{e(r['run'])}</td><td>{e(r['precision'])}</td><td>{e(r['band'])}</td>"
                     f"<td>{r['class']}</td><td style='text-align:left'>{e(r['text'])}</td></tr>")  # fmt: skip
    parts.append("</table>")
    parts.append(f"<h2>Error per layer</h2><img id='plot' alt='relative error per layer' src='data:image/png;base64,{png}' "
                 "style='max-width:100%'>")  # fmt: skip
    for c in doc["score"]["captures"]:
        parts.append(f"<h3>{e(c['name'])} ({e(c['precision'])}), per layer, loss end first</h3>")
        parts.append(layer_table(c))
    parts.append(f"<h2>Full text</h2><pre>{e(render_judge(doc))}</pre>")
    parts.append("<p>Files: <a href='judge.json'>judge.json</a>, <a href='judge.txt'>judge.txt</a>, "
                 "<a href='errors.png'>errors.png</a></p><pre id='js-errors'></pre></body></html>")  # fmt: skip
    return "\n".join(parts)


def write_judge_report(doc: dict[str, Any], out_dir: str | Path) -> dict[str, str]:
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_file(out / "errors.png", plot_png(doc["score"]))
        files = {"text": str(out / "judge.txt"), "json": str(out / "judge.json"), "html": str(out / "index.html"),
                 "plot": str(out / "errors.png")}  # fmt: skip
        doc = {**doc, "report_files": files}
        write_file(out / "judge.txt", render_judge(doc) + "\n")
        write_file(out / "judge.json", dumps(doc) + "\n")
        png = base64.b64encode((out / "errors.png").read_bytes()).decode()
        write_file(out / "index.html", _html(doc, png))
    except OSError as e:
        raise OutputError(f"cannot write the report {out}: {e.strerror or e}") from None
    return files
