"""Gradient-norm logs users already hold: parse them into norm-only captures and compare two.

Default line format (the original report's Megatron debug print)::

    [DEBUG_GRAD_NORM][POST_BACKWARD_LAYER] module.module.language_model.decoder.layers.0.mlp.linear_fc2.weight norm=321.875

Any other format: a regular expression with named groups ``name`` and ``value`` and optionally
``step`` and ``rank`` (``--pattern``). Names are matched between logs by name, never by position.
A name printed more than once (several steps or ranks in one log) is an error unless a selector
says which print to take: ``step``/``rank`` (when the pattern captures them) or ``occurrence``
(the k-th print of each name, 0-based). Nothing is silently overwritten.

A user's pattern is run under a time guard (the ``regex`` engine's timeout; ``regex`` comes with
transformers): a search over one line that takes more than PATTERN_LINE_SECONDS, or a whole log
over PATTERN_TOTAL_SECONDS, stops with a LogParseError naming the line, instead of backtracking for
minutes on a pattern such as ``(a+)+b``.

Comparing two logs without an oracle (``compare``): per parameter the ratio r = n_B / n_A; per
layer the ratio of root-sum-square norms; layers ordered along the backward pass (loss end first:
output layer, final norm, decoder layers from last to first, embeddings). Parameter kinds are
compared by the mean |log r| of their members; the kinds that are partial sums at a pre-finalize
print point (norm weights under sequence parallel, q/k layernorm under tensor parallel) are named
as such, since their norms depend on how each run chunked the sequence.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import regex

from ..bundle.store import BundleWriter
from ..errors import InputNotFound, LogParseError
from ..score.layers import generic_key
from .megatron.layout import partial_sum

PATTERN_LINE_SECONDS = 1.0  # a log line is matched in microseconds by any sane pattern
PATTERN_TOTAL_SECONDS = 120.0
DEFAULT_PATTERN = r"\[DEBUG_GRAD_NORM\]\[[^\]]*\]\s+(?P<name>\S+)\s+norm=(?P<value>[-+0-9.eEnaifNI]+)"

# Parameter kinds, first match wins (labels only; which are partial sums is megatron/layout.partial_sum's rule).
KINDS = [
    (
        "norm weight (SP partial sum)",
        r"(layer_norm_weight|final_layernorm|input_layernorm|post_attention_layernorm|\.norm\.weight)",
    ),
    ("q/k layernorm (TP partial sum)", r"(q_layernorm|k_layernorm|q_norm|k_norm)"),
    ("embedding (vocab shard)", r"(word_embeddings|embed_tokens)"),
    ("output layer (vocab shard)", r"(output_layer|lm_head)"),
    ("attention matrix (TP shard)", r"(linear_qkv|linear_proj|q_proj|k_proj|v_proj|o_proj)\.weight"),
    ("MLP matrix (TP shard)", r"(linear_fc1|linear_fc2|gate_proj|up_proj|down_proj)\.weight"),
    ("vision", r"visual"),
    ("other", r"."),
]


@dataclass
class NormLog:
    path: str
    norms: dict[str, float]
    order: list[str]
    selector: dict[str, Any] = field(default_factory=dict)


def parse(path: str | Path, *, pattern: str | None = None, step: str | None = None, rank: str | None = None,
          occurrence: int | None = None) -> NormLog:  # fmt: skip
    p = Path(path)
    if not p.is_file():
        raise InputNotFound(f"norm log {p} does not exist")
    try:
        rx = regex.compile(pattern or DEFAULT_PATTERN)
    except (regex.error, re.error) as e:
        raise LogParseError(f"--pattern is not a valid regular expression ({e})") from e
    if not {"name", "value"} <= set(rx.groupindex):
        raise LogParseError("--pattern must have named groups (?P<name>...) and (?P<value>...)")
    for sel, val in (("step", step), ("rank", rank)):
        if val is not None and sel not in rx.groupindex:
            raise LogParseError(f"--{sel} given but the pattern has no (?P<{sel}>...) group")
    seen: dict[str, list[float]] = {}
    order: list[str] = []
    deadline = time.monotonic() + PATTERN_TOTAL_SECONDS
    for i, line in enumerate(p.read_text(errors="replace").splitlines()):
        left = deadline - time.monotonic()
        try:
            m = rx.search(line, timeout=max(min(PATTERN_LINE_SECONDS, left), 1e-3))
        except TimeoutError:
            budget = (
                f"{PATTERN_LINE_SECONDS:g} s on one line"
                if left > PATTERN_LINE_SECONDS
                else f"{PATTERN_TOTAL_SECONDS:g} s in all"
            )
            raise LogParseError(
                f"{p} line {i + 1}: the pattern {rx.pattern!r} took over {budget} (catastrophic backtracking, "
                "e.g. nested quantifiers such as (a+)+); simplify it, for instance with non-overlapping character classes"
            ) from None
        if not m:
            continue
        d = m.groupdict()
        if step is not None and d.get("step") != step or rank is not None and d.get("rank") != rank:
            continue
        try:
            v = float(d["value"])
        except ValueError:
            raise LogParseError(f"{p}: {d['name']} has a norm {d['value']!r} that is not a number") from None
        if d["name"] not in seen:
            order.append(d["name"])
        seen.setdefault(d["name"], []).append(v)
    if not seen:
        raise LogParseError(f"{p}: no line matches the pattern {rx.pattern!r}; pass --pattern for other formats")
    dup = {n: len(v) for n, v in seen.items() if len(v) > 1}
    if dup and occurrence is None:
        ex = ", ".join(f"{n} x{k}" for n, k in list(dup.items())[:3])
        raise LogParseError(
            f"{p}: {len(dup)} name(s) are printed more than once ({ex}); several steps or ranks are in "
            "this log: choose one with --occurrence K (the K-th print, from 0), or --step/--rank with a "
            "--pattern that captures them"
        )
    if occurrence is not None:
        short = [n for n, v in seen.items() if len(v) <= occurrence]
        if short:
            raise LogParseError(f"{p}: --occurrence {occurrence} but {short[0]} is printed only {len(seen[short[0]])} time(s)")
        norms = {n: v[occurrence] for n, v in seen.items()}
    else:
        norms = {n: v[0] for n, v in seen.items()}
    return NormLog(str(p), norms, order, {"step": step, "rank": rank, "occurrence": occurrence})


def write_norm_bundle(log: NormLog, out: str | Path, *, precision: str = "unknown", overwrite: bool = False) -> Path:
    with BundleWriter(out, "norms", overwrite=overwrite) as w:
        w.manifest.update(precision=precision, norms=log.norms, source={"log": log.path, **log.selector}, order=log.order)
    return Path(out)


# -- comparing two logs without ground truth ---------------------------------------------------
def layer_of(name: str) -> tuple[tuple[int, int], str]:
    """(backward-order key, layer label) from the name alone (mcore or HF names), oracle/score/layers.py."""
    return generic_key(name) or ((6, 0), "other")


def kind_of(name: str) -> tuple[str, bool]:
    """(kind label, whether a pre-finalize print of it under TP and SP is a per-rank partial sum)."""
    partial = partial_sum(name, tp=2, sp=True) is not None
    for label, rx in KINDS:
        if re.search(rx, name):
            return label, partial
    return "other", partial


def compare(a: NormLog, b: NormLog, names: tuple[str, str] = ("A", "B")) -> dict[str, Any]:
    common = [n for n in a.order if n in b.norms]
    only_a = [n for n in a.order if n not in b.norms]
    only_b = [n for n in b.order if n not in a.norms]
    layer = {n: layer_of(n) for n in common}  # once per name: the sort and the rows below reuse it
    ordered = [n for _, _, n in sorted((layer[n][0], i, n) for i, n in enumerate(common))]  # O(n log n)
    params = []
    for n in ordered:
        na, nb = a.norms[n], b.norms[n]
        ratio = nb / na if na else math.inf
        kind, partial = kind_of(n)
        params.append({"name": n, "layer": layer[n][1], "kind": kind, "partial_sum": partial,
                       names[0]: na, names[1]: nb, "ratio": ratio})  # fmt: skip
    layers: dict[str, dict[str, float]] = {}
    for r in params:
        acc = layers.setdefault(r["layer"], {"a_sq": 0.0, "b_sq": 0.0, "n": 0})
        acc["a_sq"] += r[names[0]] ** 2
        acc["b_sq"] += r[names[1]] ** 2
        acc["n"] += 1
    layer_rows = [{"layer": lab, "ratio": math.sqrt(v["b_sq"] / v["a_sq"]) if v["a_sq"] else math.inf, "n_params": v["n"]}
                  for lab, v in layers.items()]  # fmt: skip
    kinds: dict[str, list[float]] = {}
    partial_kinds: set[str] = set()
    for r in params:
        if math.isfinite(r["ratio"]) and r["ratio"] > 0:
            kinds.setdefault(r["kind"], []).append(abs(math.log(r["ratio"])))
            if r["partial_sum"]:
                partial_kinds.add(r["kind"])
    kind_rows = sorted(({"kind": k, "mean_abs_log_ratio": sum(v) / len(v), "n": len(v),
                         "partial_sum": k in partial_kinds} for k, v in kinds.items()),
                       key=lambda r: -r["mean_abs_log_ratio"])  # fmt: skip
    result = {"names": list(names), "logs": [a.path, b.path], "params": params, "layers": layer_rows,
              "kinds": kind_rows, "only_in": {names[0]: only_a, names[1]: only_b}}  # fmt: skip
    result["summary"] = _summary(result)
    return result


def _summary(r: dict[str, Any]) -> str:
    na, nb = r["names"]
    lines = []
    layers = r["layers"]
    if layers:
        first, last = layers[0], layers[-1]
        dev = lambda x: abs(x - 1) * 100  # noqa: E731
        lines.append(
            f"{nb}/{na} gradient-norm ratio: {first['ratio']:.3f} at {first['layer']} (loss end), "
            f"{last['ratio']:.3f} at {last['layer']} (input end); the disagreement grows from "
            f"{dev(first['ratio']):.1f} % to {dev(last['ratio']):.1f} % toward the input."
        )
        worst = max(layers, key=lambda x: abs(math.log(x["ratio"])) if x["ratio"] > 0 and math.isfinite(x["ratio"]) else math.inf)
        lines.append(f"Largest layer disagreement: {worst['layer']} (ratio {worst['ratio']:.3f}).")
    if r["kinds"]:
        top = r["kinds"][0]
        lines.append(
            f"Parameter kind that stands out: {top['kind']} (mean |log ratio| {top['mean_abs_log_ratio']:.3f} over {top['n']})"
            + (
                "; at a pre-finalize print these are per-rank partial sums over each rank's sequence chunk or heads, "
                "comparable only if both runs chunked and padded alike."
                if top["partial_sum"]
                else "."
            )  # fmt: skip
        )
    for n, only in r["only_in"].items():
        if only:
            lines.append(f"Only in {n}: {len(only)} name(s), e.g. {only[0]}.")
    lines.append(
        "What this cannot tell: which side is right, or whether the gap exceeds honest bf16 noise. Norms "
        "agree or disagree; the truth needs a float64 replay of the same step (`oracle capture` on both "
        "devices, `oracle replay --dtype fp64`, `oracle score`)."
    )
    return "\n".join(lines)


def render_compare(r: dict[str, Any]) -> str:
    na, nb = r["names"]
    prefix = _common_prefix([p["name"] for p in r["params"]])
    out = [f"{na}: {r['logs'][0]}", f"{nb}: {r['logs'][1]}", ""]
    if prefix:
        out.append(f"  (names below omit the common prefix {prefix})")
    w = max([62] + [len(p["name"]) - len(prefix) for p in r["params"]])  # whole names, never cut
    out.append(f"  {'parameter (backward order)':<{w}} {na:>12} {nb:>12} {'ratio':>8}")
    for p in r["params"]:
        short = p["name"][len(prefix) :]
        out.append(f"  {short:<{w}} {p[na]:>12.6g} {p[nb]:>12.6g} {p['ratio']:>8.4f}")
    out += ["", f"  {'layer':<24} {'ratio':>8}  params"]
    out += [f"  {lr['layer']:<24} {lr['ratio']:>8.4f}  {lr['n_params']}" for lr in r["layers"]]
    out += ["", f"  {'parameter kind':<34} {'mean |log ratio|':>16}  n"]
    out += [f"  {k['kind']:<34} {k['mean_abs_log_ratio']:>16.4f}  {k['n']}" for k in r["kinds"]]
    out += ["", "summary:"] + ["  " + ln for ln in r["summary"].splitlines()]
    return "\n".join(out)


def _common_prefix(names: list[str]) -> str:
    """The longest dotted prefix shared by every name (``module.module.language_model.``)."""
    if len(names) < 2:
        return ""
    parts = [n.split(".") for n in names]
    k = 0
    while all(len(p) > k + 1 and p[k] == parts[0][k] for p in parts):
        k += 1
    return ".".join(parts[0][:k]) + "." if k else ""
