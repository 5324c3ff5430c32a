"""``oracle score`` and ``oracle explain`` as library calls: the result printed through ``echo``,
written as JSON and a report where asked (both paths checked before the work), and returned."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BundleError, UsageError, problem_lines

Echo = Callable[[str], None]


def write_outputs(result: dict[str, Any], json_out: str | None, report: str | None, write_report: Callable, echo: Echo) -> None:
    """``--json`` (the result, non-finite numbers as null) and ``--report`` (``write_report(result, dir)``)."""
    from ..bundle.atomic_file import write_json
    from ..report.outputs import writing

    if json_out:
        with writing("--json", Path(json_out)):
            write_json(result, Path(json_out))
        echo(f"json: {json_out}")
    if report:
        with writing("--report", Path(report)):
            echo(f"report: {write_report(result, Path(report))}")


def _check_outputs(json_out: str | None, report: str | None, inputs=()) -> None:
    from ..report.outputs import check_dir, check_file

    check_file(Path(json_out) if json_out else None, "--json", inputs)
    check_dir(Path(report) if report else None, "--report", inputs)


def _path(v):
    return None if v is None else os.fspath(v)


@dataclass(frozen=True)
class ScoreOptions:
    oracle: str
    captures: tuple[str, ...] = ()  #: none where ``oracle`` is a local replay (scored alone)
    band: tuple[str, ...] = ()
    json_out: str | None = None
    report: str | None = None
    margin: float | None = None  # None: the threshold calibrated on the members (score/calibrate.py)
    tol: tuple[str, ...] = ()  #: PRECISION:expected=VALUE or PRECISION:floor=VALUE
    names: tuple[str, ...] | None = None
    top: int = 8
    force_band: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "oracle", os.fspath(self.oracle))
        for f in ("captures", "band", "tol"):
            object.__setattr__(self, f, tuple(os.fspath(p) if isinstance(p, os.PathLike) else p for p in getattr(self, f) or ()))
        object.__setattr__(self, "names", tuple(self.names) if self.names else None)
        object.__setattr__(self, "json_out", _path(self.json_out))
        object.__setattr__(self, "report", _path(self.report))
        if self.names and len(self.names) != len(self.captures):
            raise UsageError(f"--name given {len(self.names)} times for {len(self.captures)} captures")


def score(opts: ScoreOptions, echo: Echo = print) -> dict[str, Any]:
    """A local replay scored alone, or captures against the oracle; the verdicts printed, the result returned."""
    from ..bundle.store import Bundle
    from ..report import files, text
    from ..score.tolerance import parse_overrides

    _check_outputs(opts.json_out, opts.report, (opts.oracle, *opts.captures, *opts.band))
    overrides = parse_overrides(list(opts.tol))
    first = Bundle(opts.oracle)
    lacking: list[str] = []
    if first.kind == "local":
        if opts.captures:
            raise UsageError("a local replay is scored alone: give no captures")
        from ..score.local import score_local

        result = score_local(first, margin=opts.margin, tol_overrides=overrides, band_paths=list(opts.band))
        echo(text.render_local(result))
        write = files.write_local_report
    else:
        if not opts.captures:
            raise UsageError("give at least one capture to score against the oracle")
        from ..score.scorer import score as do_score

        result = do_score(opts.oracle, list(opts.captures), band_paths=list(opts.band), margin=opts.margin,
                          tol_overrides=overrides, names=list(opts.names) if opts.names else None,
                          force_band=opts.force_band)  # fmt: skip
        lacking = _lacking(result)
        if lacking:
            echo(f"INCOMPLETE: {'; '.join(lacking)}")
        echo(text.render(result, top=opts.top))
        write = files.write_report
    write_outputs(result, opts.json_out, opts.report, write, echo)
    if lacking:
        raise BundleError(f"{len(lacking)} capture manifest field(s) the verdict needs are not stated:"
                          f"{problem_lines(lacking, 8)}\ntheir verdict is INCOMPLETE (the report says what was checked), never a finding; "
                          "capture the step again: every capture of this tool states recipe, precision and loss")  # fmt: skip
    return result


def _lacking(result: dict[str, Any]) -> list[str]:
    """What each capture's manifest leaves unsaid (scorer ``manifest_missing``), as 'NAME: its manifest ...':
    the report's first line then says INCOMPLETE and the command exits 4 after writing its outputs (issue 41:
    exit 0 with the verdict's class INCOMPLETE only in the verdict section)."""
    return [f"{c['name']}: its manifest {m}" for c in result["captures"] for m in c.get("manifest_missing") or []]


def explain(capture, module: str, fmt: str | None = None, json_out=None, report=None, echo: Echo = print) -> dict[str, Any]:
    """Which op class reproduces the device's error in ``module``; printed, written where asked, returned."""
    from ..report.files import write_explain_report
    from ..report.text import render_explain
    from ..score.explain import explain as do_explain

    json_out, report = _path(json_out), _path(report)
    _check_outputs(json_out, report, (capture,))
    res = do_explain(capture, module, fmt=fmt)
    echo(render_explain(res))
    write_outputs(res, json_out, report, write_explain_report, echo)
    return res
