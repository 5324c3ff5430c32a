"""``oracle judge`` as a library call: ``judge(JudgeOptions(...))`` answers from two runs (or their
logs alone), prints the report through ``echo`` and the stages' progress through ``progress``, and
returns the exit code. The rules between the options live in ``JudgeOptions`` and nowhere else."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import UsageError
from ..score.tolerance import BAND_MEMBERS

Echo = Callable[[str], None]


def _str(v):
    return None if v is None else os.fspath(v)


@dataclass(frozen=True)
class JudgeOptions:
    runs: tuple[str, ...] = ()  #: run A's and run B's capture folders (rank folders or bundles); none: the logs alone
    out: str | None = None
    recipe: str | None = None
    names: tuple[str, ...] | None = None
    log_a: str | None = None
    log_b: str | None = None
    max_memory: str | None = None
    ensemble: int = BAND_MEMBERS
    members: int = 2
    margin: float | None = None  # None: the threshold calibrated on the members (score/calibrate.py)
    dp_rank: int | None = None
    nproc: int = 1
    threads: int | None = None
    dry_run: bool = False
    num_layers: int | None = None  #: the logs alone: the model's decoder layers for the round-off bound
    truth: str | None = None  #: the float64 truth replayed elsewhere (torchrun over hosts), checked to be this step's
    bands: tuple[str, ...] = ()  #: noise bands replayed elsewhere, one per precision, checked likewise

    def __post_init__(self) -> None:
        object.__setattr__(self, "runs", tuple(os.fspath(r) for r in self.runs or ()))
        object.__setattr__(self, "names", tuple(self.names) if self.names else None)
        for f in ("out", "log_a", "log_b", "truth"):
            object.__setattr__(self, f, _str(getattr(self, f)))
        object.__setattr__(self, "bands", tuple(os.fspath(b) for b in self.bands or ()))
        if not self.runs:
            if not (self.log_a and self.log_b):
                raise UsageError("give the two runs' capture folders, or --log-a and --log-b (the logs alone)")
            if self.truth or self.bands:
                raise UsageError("--truth and --band are replays of the runs' step: give the two runs' capture folders with them")
            return
        from ..pipeline.judge import resolve_run

        for p, label in zip(self.runs, "AB"):
            resolve_run(p, label)  # a log given as a run is named as one, before any other complaint
        if len(self.runs) != 2:
            raise UsageError(f"judge takes two runs (A and B), got {len(self.runs)}")
        if (self.log_a is None) != (self.log_b is None):
            raise UsageError("give both --log-a and --log-b, or neither")
        if self.out is None and not self.dry_run:
            raise UsageError("give --out DIR: the work folder for the stages and the report")

    @property
    def logs_only(self) -> bool:
        return not self.runs


def judge(opts: JudgeOptions, echo: Echo = print, progress: Echo | None = None) -> int:
    """The answer (or, with ``dry_run``, each stage's cost) on ``echo``; the stages' lines on ``progress``."""
    from ..pipeline.judge import Judge, judge_logs
    from ..report.judge import render_judge, render_logs_only

    if opts.logs_only:
        echo(render_logs_only(judge_logs(opts.log_a, opts.log_b, list(opts.names or []) or None, opts.out,
                                         num_layers=opts.num_layers)))  # fmt: skip
        return 0
    j = Judge(opts.runs[0], opts.runs[1], out=opts.out or ".", recipe=opts.recipe, names=list(opts.names or []) or None,
              logs=[opts.log_a, opts.log_b] if opts.log_a else [], max_memory=opts.max_memory, ensemble=opts.ensemble,
              members=opts.members, margin=opts.margin, nproc=opts.nproc, threads=opts.threads, dp_rank=opts.dp_rank,
              echo=progress, truth=opts.truth, bands=list(opts.bands))  # fmt: skip
    if opts.dry_run:
        table, refused = j.dry_run()
        echo(table)
        if refused:  # exactly what the run would refuse before its first replay (exit 2)
            raise UsageError("oracle judge: " + "; ".join(refused))
        return 0
    doc = j.run()
    echo(render_judge(doc))
    files = doc["report_files"]
    echo(f"\nreport: {files['html']} (text {files['text']}, json {files['json']})")
    return 0
