"""``oracle judge``: from two runs' capture folders (and their grad-norm logs) to one report.

Stages, each reused when its inputs are unchanged (``stages.py``):
    merge-A, merge-B   Megatron/MindSpeed rank folders merged (``integrations/megatron/merge.py``);
                       a single capture bundle is used as it is
    (same step)        B's inputs and weights against A's (value_sha256 of every tensor), before any
                       replay: another step is refused (exit 5), as ``oracle score`` refuses it
    truth              A replayed once in float64 (streamed within --max-memory, resumable)
    band-PREC          an emulated ensemble of each distinct capture precision (each run's own band)
    rank-view          where a run's merged capture holds gradients the framework left per rank (ms-swift's
                       ViT under SP): each rank's own truth and band (integrations/megatron/perrank.py), so
                       that score judges those gradients per rank, as ordinary rows of the verdict
    score              both runs against the truth, each with the band of its own precision
    local-X, explain-X where run X recorded module boundaries: its local replay, scored, and
                       ``explain`` of its top culprit
    logs               the truth's rank view (Megatron captures) against the runs' grad-norm logs
    report             the four answers (``answers.py``) as text, JSON and HTML (``report/judge.py``)
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..bundle.store import Bundle, check_not_input
from ..errors import BundleError, InputNotFound, MismatchError, OracleError, UsageError, problem_lines
from ..precision import CAPTURE_NAMES, EMULATION, emulation
from ..replay.options import ReplayOptions
from ..report.judge import write_judge_report
from ..score.scorer import check_same_step
from ..score.tolerance import BAND_MEMBERS
from . import answers as answers_mod
from . import eta, workfolder
from .stages import Progress, Stages, duration, manifest_fingerprint

ENSEMBLE = BAND_MEMBERS  # score/tolerance.py: why 2
RULE = "calibrated-5"  # the threshold's rule (score/calibrate.py, its direction and loss thresholds; the loss's logit slope): a score stage of another rule is redone
LOCAL_ROWS = "inputs-5"  # what a local replay's rows hold (replay/local.py: input rows, entry rows per recorded stack with their writers, residual branches, the forward output as one factor): a local stage of another is redone
# The token-parallel truth's CPU-seconds efficiency on 2 ranks (python benchmarks/token_parallel.py --max-memory 8G):
# 0.60-0.79 over earlier sessions at 2k-16k tokens; 0.77 at 4096 and 0.81 / 0.84 at 8192 tokens once rank 0 added the
# partial gradients as they arrived (2026-12-05; wall 0.68 and 0.75-0.78 on 2 shared cores). Kept at 0.7: across
# hosts the K/V exchanges cross a network, and each rank's fixed costs (start-up, its whole partial gradient set) stay.
TOKEN_PARALLEL_EFFICIENCY = 0.7
# The token-parallel truth's partial gradients (each rank's is the whole model's gradient set) are added onto rank 0
# by a binomial tree (replay/streaming/partials.py): rank 0 takes ceil(log2 hosts) sets one after another (the other
# pairs of a round add theirs at the same time), at rank 0's own rate per received byte (read off the wire, added to
# its sum, written, hashed where final): 0.45-0.46 GB/s (`python benchmarks/partial_sums.py --gb 1 --ranks 3`, 2
# cores; 0.16 GB/s by the earlier write-then-sum path); 0.22 GB/s in the 2-rank step of benchmarks/token_parallel.py,
# whose sender shares those 2 cores. A 10 Gb/s link (1.25 GB/s) is not what bounds it.
RANK0_SUM_BYTES_PER_S = 0.45e9
# The score stage reads about 3 x the truth's float64 gradients (the truth, the captures' float32 main_grad, the band
# members') and runs its parameters and their 2^20-element chunks on every core (score/pool.py). Measured (Qwen3 text
# hidden 1024 x 4 layers, 4096 tokens: a float64 truth, two float32 captures, a bf16 band of 2; 2.65 GB read; the
# score's parameter loop, `python benchmarks/score_threads.py`): 0.25 GB/s of CPU time on one worker, 0.68 of 2x that on 2
# (2 cores: the same speed as the serial loop it replaced, whose reading and hashing ran on one core whatever the cores).
# On a server the dry run counts SCORE_THREADS_PRICED workers at that efficiency (not measured past 2 cores here: the
# chunks' float64 passes are memory-bound, so no more are counted) and no faster than one NVMe drive reads
# (SCORE_DISK_BYTES_PER_S, stated, not measured: the truth's gradients were written just before, partly cached).
SCORE_CORE_BYTES_PER_S = 0.25e9
SCORE_POOL_EFFICIENCY = 0.7
SCORE_THREADS_PRICED = 8
SCORE_DISK_BYTES_PER_S = 2e9


def score_seconds(nbytes: float, cores: int) -> float:
    """The score's time over ``nbytes`` of gradients on ``cores`` cores (the constants above)."""
    workers = min(cores, SCORE_THREADS_PRICED)
    rate = SCORE_CORE_BYTES_PER_S * (1.0 if workers == 1 else workers * SCORE_POOL_EFFICIENCY)
    return max(nbytes / rate, nbytes / SCORE_DISK_BYTES_PER_S)
BOUNDARIES = "replica-through-1"  # what merge maps of the recorded modules (megatron/boundaries.py: vision blocks, sub-modules through a fused norm): a merge stage of another is redone


def elsewhere(est: dict[str, dict[str, Any]], here: int, cores: int, hosts: int = 1) -> float:
    """The dry run's total on ``hosts`` machines of ``cores`` cores each, from this machine's estimate.
    A replay stage's GEMM part scales with the cores, the float64 GEMM being compute-bound on every core:
    on the server it is ``gemm_core_seconds`` (its GEMMs on one core of this machine, priced on the CPU-time
    probe ``plan.core_rates``, which a busy machine does not slow) over the server's cores. A stage
    estimated without that probe scales its wall-clock GEMM time here (``here`` threads) instead. The rest
    (building, reading, writing, the score and the report) is kept as measured here: it does not shrink
    with cores, so the figure is conservative there and optimistic only if a server's per-core GEMM rate is
    below this machine's.
    Over several hosts the replays run under torchrun and are given to the judge (--truth, --band;
    docs/distributed.md), at the same time on disjoint hosts: ``hosts_plan`` says how many take the band
    members and what the replays cost then. Other stages spread over every core, as the truth's GEMMs."""
    total = 0.0
    for name, e in est.items():
        if "score_bytes" in e:  # the score's pool on the server's cores (score_seconds), its fixed costs as here
            total += e["seconds"] - score_seconds(e["score_bytes"], e["score_workers"]) + score_seconds(e["score_bytes"], cores)
            continue
        if hosts > 1 and (name == "truth" or e.get("members")):
            continue  # hosts_plan below
        gemm = e.get("gemm_seconds", 0.0)
        parallel = cores * hosts * (TOKEN_PARALLEL_EFFICIENCY if hosts > 1 else 1.0)
        total += e["seconds"] - gemm + e.get("gemm_core_seconds", gemm * here) / parallel
    if hosts > 1:
        total += hosts_plan(est, here, cores, hosts)[0]
    return total


def server_gemms(est: dict[str, dict[str, Any]], cores: int) -> tuple[float, float]:
    """(the replays' GEMM seconds on one host of ``cores`` cores at this machine's per-core rate, as ``elsewhere``
    counts them; the same FLOPs at one core's probe rate, ``floor_core_seconds``, over those cores). The second is
    what no faster replay goes below on such cores (every GEMM at the probe's rate, nothing else costing): the
    part of the server's figure that more cores or faster ones shrink and code does not."""
    at = floor = 0.0
    for e in est.values():
        if "gemm_core_seconds" in e:
            at += e["gemm_core_seconds"] / cores
            floor += e.get("floor_core_seconds", e["gemm_core_seconds"]) / cores
    return at, floor


def hosts_plan(est: dict[str, dict[str, Any]], here: int, cores: int, hosts: int) -> tuple[float, int]:
    """(seconds, m): the replays of ``est`` over ``hosts`` hosts of ``cores`` cores, the band members on ``m``
    of them while the truth splits by tokens over the other ``hosts - m`` (m = 0: the truth on every host,
    then the members), m chosen for the shortest time. The truth on h hosts: its fixed costs as here, its
    GEMMs over h x cores at ``TOKEN_PARALLEL_EFFICIENCY``, plus rank 0's share of adding the ranks' partial
    gradients (a binomial tree: ceil(log2 h) sets of its ``gradients`` bytes at ``RANK0_SUM_BYTES_PER_S``).
    A band member runs whole on one host (torchrun deals a band's members to its ranks round-robin,
    replay/run.py): its fixed costs (``member_fixed``, else its share of its stage's) plus its GEMMs over one
    host's cores; the members (of every band) go longest first to the least loaded of their hosts."""
    truth = None if (est.get("truth") or {}).get("given") else est.get("truth")  # a truth given (--truth) runs nowhere
    members: list[float] = []
    for e in est.values():
        if e.get("members"):
            k, gemm = e["members"], e.get("gemm_seconds", 0.0)
            fixed = e.get("member_fixed", (e["seconds"] - gemm) / k)  # alone on its host: none of it overlaps
            members += [fixed + e.get("gemm_core_seconds", gemm * here) / k / cores] * k

    def truth_on(h: int) -> float:
        if not truth:
            return 0.0
        gemm = truth.get("gemm_seconds", 0.0)
        core = truth.get("gemm_core_seconds", gemm * here)
        if h == 1:
            return truth["seconds"] - gemm + core / cores
        return (truth["seconds"] - gemm + core / (cores * h * TOKEN_PARALLEL_EFFICIENCY)
                + (h - 1).bit_length() * truth.get("gradients", 0) / RANK0_SUM_BYTES_PER_S)  # fmt: skip

    def makespan(m: int) -> float:
        loads = [0.0] * m
        for t in sorted(members, reverse=True):
            loads[loads.index(min(loads))] += t
        return max(loads, default=0.0)

    options = [(truth_on(hosts) + makespan(hosts), 0)]  # one after the other, each on every host
    options += [(max(truth_on(hosts - m), makespan(m)), m) for m in range(1, hosts if truth else hosts + 1) if members]
    return min(options)


class StageFailed(OracleError):
    """A stage run as a subprocess (``--nproc``) failed; it exits with that subprocess's code."""

    def __init__(self, msg: str, code: int):
        super().__init__(msg)
        self.exit_code = code


LOG_SUFFIXES = (".log", ".txt", ".out", ".err")


# A training process without oracle's start-up hook (oracle installed elsewhere, an old-style editable
# install) ignores ORACLE_CAPTURE without a word: the first place the miss shows is here, an absent or
# empty folder, so these messages say where to check.
NO_CAPTURE_HINT = ("; if ORACLE_CAPTURE was to write it, the training environment may lack oracle's start-up hook "
                   "(a process without it captures nothing and says nothing): run `python -m oracle doctor DIR` there")  # fmt: skip


def resolve_run(path: str | Path, label: str) -> tuple[str, Path]:
    """("capture", bundle) for a capture bundle, ("ranks", folder) for Megatron rank bundles."""
    p = Path(path)
    if not p.exists():
        raise InputNotFound(f"run {label}: {p} does not exist{NO_CAPTURE_HINT}")
    if (p / "manifest.json").is_file():
        b = Bundle(p)
        if (b.get("megatron") or {}).get("coords") is not None:
            return "ranks", p
        return "capture", p
    if p.name == "manifest.json" and p.is_file():
        raise UsageError(f"run {label}: {p} is a bundle's manifest file: give the bundle's folder, {p.parent}")
    if not p.is_dir():
        raise UsageError(f"run {label}: {p} is a file, neither a capture bundle nor a folder of rank bundles. {_what_file(p)}")
    subs = sorted(d for d in p.iterdir() if d.is_dir())
    if any((d / "manifest.json").is_file() for d in subs):
        return "ranks", p
    nested = [d.name for d in subs if any((e / "manifest.json").is_file() for e in d.iterdir() if e.is_dir())]
    if nested:
        pick = "pre" if "pre" in nested else nested[0]
        why = (" (pre: the gradients before finalize_model_grads, as the norms are printed; post: after it)"
               if {"pre", "post"} <= set(nested) else "")  # fmt: skip
        raise UsageError(f"run {label}: {p} holds several capture folders ({', '.join(nested)}); give one of them, "
                         f"e.g. {p / pick}{why}")  # fmt: skip
    raise UsageError(f"run {label}: {p} holds no capture bundle (manifest.json) and no rank bundles{NO_CAPTURE_HINT}")


def _what_file(p: Path) -> str:
    """What a file given as a run is, and what to give instead (a file of a bundle, of a judge's report or
    work folder, a --sample file, a grad-norm log): the file's place and first bytes, never its whole read."""
    try:
        with open(p, "rb") as f:
            head = f.read(4096)
    except OSError:
        head = b""
    if (p.parent / "manifest.json").is_file():
        return f"It is a file of the capture bundle {p.parent}: give the bundle's folder, {p.parent}"
    if p.name in ("judge.json", "judge.txt", "index.html", "errors.png", "score.json", "params.csv") or b'"oracle-judge"' in head:
        return ("It is a file of a report (oracle judge's or oracle score's), not a run: give the capture folders "
                "the report was made from")  # fmt: skip
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        return "It is a JSON-lines file (samples?): samples are captured with oracle capture --sample FILE.jsonl --out DIR"
    if suffix == ".safetensors":
        return "It is a tensor file; a capture bundle is the folder holding it and its manifest.json"
    text = bool(head) and b"\0" not in head
    if suffix == ".log" or (text and b"norm" in head.lower()):
        return ("It looks like a grad-norm log: give the logs as --log-a A.log --log-b B.log (with no runs, the "
                "logs-only answer)")  # fmt: skip
    kinds = {".json": "a JSON file", ".html": "an HTML page", ".csv": "a table"}
    what = kinds.get(suffix, "a text file without a gradient norm" if text else "not a capture")
    return f"It is {what}: give a capture bundle (a folder with manifest.json) or the folder of a run's rank bundles"


def check_log(path: str | Path, flag: str) -> Path:
    """A grad-norm log given as ``flag``: an existing file (a folder is named as one, with its logs)."""
    p = Path(path)
    if p.is_dir():
        logs = sorted(q.name for q in p.iterdir() if q.is_file() and q.suffix.lower() in LOG_SUFFIXES)[:4]
        inside = f" (it holds {', '.join(logs)})" if logs else ""
        raise UsageError(f"{flag} {p} is a folder: give the grad-norm log file itself{inside}")
    if not p.is_file():
        raise InputNotFound(f"{flag} {p} does not exist")
    return p


def log_labels(paths: list[Path], names: list[str] | None, flags: tuple[str, str] = ("--log-a", "--log-b")) -> tuple[str, str]:
    """Display names of two logs: ``--name`` twice, else the files' names, else their folders' (two
    ``rank0.log`` of two runs), else A and B. The same file twice is refused."""
    if Path(paths[0]).resolve() == Path(paths[1]).resolve():
        raise UsageError(f"{flags[0]} and {flags[1]} are the same file ({paths[0]}): give each run's own log")
    if names:
        if len(names) != 2 or names[0] == names[1]:
            raise UsageError(f"give two distinct --name values, one per log (got {', '.join(names)})")
        return names[0], names[1]
    for level in (lambda q: q.stem, lambda q: q.resolve().parent.name):
        got = (level(Path(paths[0])), level(Path(paths[1])))
        if got[0] != got[1] and all(got):
            return got
    return "A", "B"


def check_recipe(recipe: str | None, inputs: list[tuple[str, Path]]) -> None:
    """``--recipe`` names a known recipe (a typo is an error, also where bundles carry their own),
    and the recipe of any capture bundle given."""
    if recipe is None:
        return
    from .. import recipe as recipes

    recipes.get(recipe)  # RecipeError (exit 7): no recipe named ...; known recipes: ...
    for (kind, p), label in zip(inputs, "AB"):
        own = ((Bundle(p).get("recipe") or {}).get("name")) if kind == "capture" else None
        if own and own != recipe:
            raise UsageError(f"--recipe {recipe}, but run {label} ({p}) is a {own} capture: drop --recipe (a capture "
                             "bundle carries its recipe; --recipe names rank folders' merge)")  # fmt: skip


def run_names(paths: list[Path], names: list[str] | None) -> list[str]:
    if names:
        if len(names) != 2 or names[0] == names[1]:
            raise UsageError("give two distinct --name values, one per run")
        return list(names)
    for level in range(3):
        got = [p.resolve().parents[level - 1].name if level else p.resolve().name for p in paths]
        if got[0] != got[1] and all(got) and not any(g in ("pre", "post") for g in got):
            return got
    return ["A", "B"]


def _size(b: float) -> str:
    return next(f"{b / 2**k:.2f} {u}" for k, u in ((30, "GiB"), (20, "MiB"), (10, "KiB"), (0, "B")) if b >= 2**k or k == 0)


def _ranks(opts, what: str, echo: Callable[[str], None]) -> None:
    """Run a replay stage on ``opts.nproc`` ranks; their stdout goes to the progress stream (the
    judge's stdout is the report), their stderr (progress bars, errors) passes through."""
    from ..replay.ranks import launch_ranks

    rc = launch_ranks(opts, echo=lambda line: echo(f"  {line}"))
    if rc:
        raise StageFailed(f"{what} stopped (exit {rc}) on {opts.processes()} ranks; rerun `oracle judge` to resume", rc)


def _n(k: int, word: str) -> str:
    """``k`` ``word``, plural but for one."""
    return f"{k} {word}{'' if k == 1 else 's'}"


def _a(word: str) -> str:
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def given_check(path: Path, cap: Bundle, dtype: str, members: int = 1) -> str | None:
    """The check a bundle given for a replay stage (``oracle judge --truth T --band B``) must pass: None where
    it is what that stage would make, else why not; one replayed from another step raises MismatchError (exit 5,
    as any two bundles of different steps). Over several hosts the replays run there, each with
    torchrun (the truth ``oracle replay CAP --out T --split tokens``, a band ``oracle replay CAP --out B
    --dtype P --ensemble K``: members spread over the ranks), then ``oracle judge ... --truth T --band B``
    on one host takes them and runs the rest. What that stage would make: the kind it makes, replayed in
    ``dtype`` from this step (the same inputs' and weights' values: ``Bundle.fingerprint``); a band with
    ``members`` members made by this emulation (``precision.EMULATION``: what an older one computed differs).
    How it was spread (ranks, threads, streamed or not) is not asked: the float64 truth is the same within
    1e-12 either way, a band's members are as honest at any thread count (precision/mode.py: its sums
    follow the threads)."""
    try:
        b = Bundle(path)
    except OracleError as e:
        return f"not a bundle: {str(e).splitlines()[0]}"
    kind = "oracle" if dtype == "fp64" else "emulation"
    if b.kind != kind or b.get("precision") != dtype:
        return f"it is {_a(b.kind)} bundle in {b.get('precision')}, where this stage makes {_a(kind)} bundle in {dtype}"
    if b.fingerprint() != cap.fingerprint():
        raise MismatchError(f"{path}: replayed from another step (its inputs or weights differ from {cap.path}'s); give "
                            f"the replay of {cap.path} or leave it out")  # fmt: skip
    if dtype != "fp64":
        if int(b.get("members", 1)) != members:
            return f"{b.get('members', 1)} member(s), where this judge's band has {members} (--ensemble)"
        made = (b.get("emulation") or {}).get("version")
        if made != EMULATION:
            return f"made by emulation {made!r}, not this oracle's {EMULATION!r}"
    return None


def check_complete(caps: list[Bundle], names: list[str]) -> None:
    """A run whose capture manifest leaves unsaid what the verdict needs (``recipe``, ``precision``,
    ``loss``: manifest.missing_fields) cannot be judged: BundleError (exit 4) naming the run and each
    missing field. ``oracle score`` of such a capture says INCOMPLETE; a judge would have answered
    from what was never captured (issue 41: "capB is faulty" where capB's manifest lacked ``loss``)."""
    from ..bundle.manifest import missing_fields

    problems = [f"{n} ({c.path}): its manifest {m}" for c, n in zip(caps, names) for m in missing_fields(c.manifest)]
    if problems:
        raise BundleError(f"oracle judge cannot judge a capture that lacks what the verdict needs:{problem_lines(problems, 8)}\n"
                          "capture the step again (every capture of this tool states recipe, precision and loss, null "
                          "where not known); `oracle score` shows what such a capture covers")  # fmt: skip


def replayable(caps: list[Bundle]) -> int:
    """Which run the truth is replayed from: A, unless A holds no inputs and B does."""
    return 1 if not caps[0].names("inputs") and caps[1].names("inputs") else 0


class Judge:
    def __init__(self, run_a: str | Path, run_b: str | Path, *, out: str | Path, recipe: str | None = None,
                 names: list[str] | None = None, logs: list[str | Path] = (), max_memory: str | None = None,
                 ensemble: int = ENSEMBLE, members: int = 2, margin: float | None = None, nproc: int = 1, threads: int | None = None,
                 dp_rank: int | None = None, echo: Callable[[str], None] | None = None, truth: str | Path | None = None,
                 bands: list[str | Path] = ()):  # fmt: skip
        self.inputs = [resolve_run(run_a, "A"), resolve_run(run_b, "B")]
        if os.path.samefile(self.inputs[0][1], self.inputs[1][1]):
            raise UsageError(f"runs A and B are the same folder ({run_a}): judge compares two runs; give the other run's "
                             "capture as the second")  # fmt: skip
        self.names = run_names([p for _, p in self.inputs], names)
        if logs and len(logs) != 2:
            raise UsageError(f"give two --log files, one per run (got {len(logs)})")
        for lg, flag in zip(logs, ("--log-a", "--log-b")):
            check_log(lg, flag)
        if logs:
            log_labels([Path(lg) for lg in logs], None)  # the same file twice is refused
        check_recipe(recipe, self.inputs)
        if any(k == "ranks" for k, _ in self.inputs) and not recipe:
            raise UsageError("rank folders are merged through a recipe's names: give --recipe (qwen3 or qwen3-vl)")
        self.out, self.recipe, self.logs = Path(out), recipe, [Path(lg) for lg in logs]
        self.max_memory, self.ensemble, self.members, self.margin = max_memory, ensemble, members, margin
        self.nproc, self.threads, self.dp_rank, self.echo = nproc, threads, dp_rank, echo
        self.layouts: list[dict[str, Any]] = []  # per-rank judgements the merged captures need (rank_layouts)
        # replay stages made elsewhere (torchrun over hosts), checked against the step before any stage (given())
        self.truth_given, self.bands_given = (Path(truth) if truth else None), [Path(b) for b in bands]
        for flag, p in [("--truth", self.truth_given)] + [("--band", b) for b in self.bands_given]:
            if p is not None and not (p / "manifest.json").is_file():
                raise InputNotFound(f"{flag} {p}: no bundle there (no manifest.json); give the folder `oracle replay --out` wrote")
        from ..replay.streaming.engine import parse_size

        self.budget = parse_size(max_memory) if max_memory else None

    def _echo(self, s: str) -> None:
        (self.echo or (lambda x: print(x, file=sys.stderr, flush=True)))(s)

    # -- stage bodies ------------------------------------------------------------------------
    def _merge(self, kind: str, path: Path, out: Path, overwrite: bool) -> Path:
        if kind == "capture":
            return path
        from ..integrations.megatron.merge import merge_ranks

        return merge_ranks([path], out, recipe=self.recipe, dp_rank=self.dp_rank, overwrite=overwrite)

    def _replay(self, cap: Path, out: Path, overwrite: bool, dtype: str, ensemble: int = 1) -> None:
        """A stage's replay into ``out`` inside the judge's own folder: its streamed work folder, if one of ours
        is left there for other inputs (a killed run before a capture changed), is the judge's to replace
        (``replace_work="any-ours"``, a narrower power than a user's --overwrite: streaming/workdir.py)."""
        # The float64 truth runs in this one process on every core, --nproc or not: split by tokens over ranks of one
        # host it is slower (the ranks' exchanges and rank 0's sum of their partial gradients): the hidden-1024 x
        # 4-layer Qwen3 step at 4096 tokens, --max-memory 8G, 2 cores, two pairs: 41.2 / 41.6 s in one process of 2
        # threads, 50.2 / 47.5 s split over 2 ranks of 1 thread; split by tensors (in memory) it has no certificate
        # and needs heads that divide by --nproc. Over several hosts the token split is what uses them: run it there
        # with torchrun and give it to the judge (--truth; given_check()). A band's members go to the ranks whole.
        if self._spread() > 1 and dtype != "fp64":
            opts = ReplayOptions(capture=cap, out=out, dtype=dtype, ensemble=ensemble, max_memory=self.max_memory,
                                 nproc=self.nproc, threads=self.threads, overwrite=True, replace_work="any-ours")  # fmt: skip
            _ranks(opts, f"replay {dtype}", self._echo)
            return
        from ..replay.run import replay

        self._threads()
        replay(cap, out, dtype=dtype, ensemble=ensemble, overwrite=overwrite, progress=True, max_memory=self.budget,
               verify="auto" if self.budget is None else "off", replace_work="any-ours")  # fmt: skip

    def given(self, cap: Bundle, precs: list[str]) -> dict[str, Path]:
        """The replay stages given with --truth / --band, by stage name, each checked to be what that stage would
        make of ``cap`` (``given_check``): a bundle that is not is refused before any stage (UsageError, exit 2;
        another step's: MismatchError, exit 5)."""
        out: dict[str, Path] = {}
        if self.truth_given is not None:
            why = given_check(self.truth_given, cap, "fp64")
            if why:
                raise UsageError(f"--truth {self.truth_given}: {why}; give the float64 replay of {cap.path} "
                                 "(oracle replay CAP --out T, --split tokens over hosts) or leave --truth out")  # fmt: skip
            out["truth"] = self.truth_given
        for b in self.bands_given:
            given = Bundle(b)
            prec = given.get("precision")
            stage = f"band-{prec}"
            if given.kind != "emulation":
                raise UsageError(f"--band {b}: it is {_a(given.kind)} bundle, not a noise "
                                 f"band (oracle replay CAP --out B --dtype P --ensemble {self.ensemble} makes one)")  # fmt: skip
            if prec not in precs:
                raise UsageError(f"--band {b}: a band in {prec}, where this judge's runs need {', '.join(precs) or 'none'}")
            if stage in out:
                raise UsageError(f"--band {b}: a second band in {prec} (the first: {out[stage]}); give one per precision")
            why = given_check(b, cap, prec, self.ensemble)
            if why:
                raise UsageError(f"--band {b}: {why}; give the bundle of `oracle replay {cap.path} --out B --dtype {prec} "
                                 f"--ensemble {self.ensemble}` or leave --band out")  # fmt: skip
            out[stage] = b
        return out

    def _local(self, cap: Path, out: Path, overwrite: bool) -> None:
        if self.nproc > 1:
            opts = ReplayOptions(capture=cap, out=out, local=True, members=self.members, nproc=self.nproc,
                                 threads=self.threads, overwrite=True)  # fmt: skip
            _ranks(opts, "local replay", self._echo)
            return
        from ..replay.local import replay_local

        self._threads()
        replay_local(cap, out, members=self.members, overwrite=overwrite, progress=True)

    def own_threads(self) -> int | None:
        """The threads of what this process runs itself (a streamed truth, a local replay, the score): --threads
        without --nproc. With --nproc N, --threads is each of the N rank processes' (a band's members at once on
        the same cores) and the stages run here keep every core: one process on one thread would leave the
        others idle (a truth given --nproc 2 --threads 1 ran on half of 2 cores)."""
        return self.threads if self.nproc <= 1 else None

    def _threads(self) -> None:
        """``own_threads`` for a replay in this process (as `oracle replay --threads` sets it; a rank of --nproc
        gets --threads from the launcher): the emulation's sums follow the thread count (precision/mode.py)."""
        if self.own_threads():
            import torch

            torch.set_num_threads(self.own_threads())

    def score_workers(self) -> int:
        """The score's threads (score/pool.py): ``own_threads`` where given, else this process's cores."""
        from ..replay.options import cores

        return self.own_threads() or cores()

    def _spread(self) -> int:
        """How many processes share a band's members (``--nproc``)."""
        return max(1, min(self.nproc, self.ensemble))

    # -- the plan ----------------------------------------------------------------------------
    def has_modules(self) -> list[bool]:
        """Whether each run recorded module boundaries: a capture bundle says; a rank folder's first
        rank bundle says (``ORACLE_CAPTURE_MODULES`` / ``capture_rank(modules=)``; what merge can map
        of them is replayed, megatron/boundaries.py)."""
        out = []
        for k, p in self.inputs:
            if k == "capture":
                out.append(bool(Bundle(p).get("modules")))
                continue
            first = next((q for q in sorted(Path(p).iterdir()) if (q / "manifest.json").is_file()), None)
            out.append(first is not None and bool(Bundle(first).get("modules")))
        return out

    @staticmethod
    def rank_layouts(caps: list[Bundle]) -> list[dict[str, Any]]:
        """The rank-view stages: one per distinct layout (TP, SP, stage, loss convention) among the runs whose
        merged capture holds gradients the framework left per rank (perrank.layout_of), their names united."""
        from ..integrations.megatron.perrank import layout_of

        out: dict[tuple, dict[str, Any]] = {}
        for c in caps:
            lay = layout_of(c)
            if lay is not None:
                key = (lay["tp"], lay["sequence_parallel"], lay["stage"], lay["per_token_loss"])
                have = out.setdefault(key, {**lay, "names": []})
                have["names"] = sorted(set(have["names"]) | set(lay["names"]))
        return list(out.values())

    def rank_stage(self, i: int) -> str:
        return "rank-view" if len(self.layouts) == 1 else f"rank-view-{i + 1}"

    def stage_names(self, precisions: list[str]) -> list[str]:
        names = [f"merge-{n}" for (k, _), n in zip(self.inputs, self.names) if k == "ranks"] + ["truth"]
        names += [f"band-{p}" for p in precisions] + [self.rank_stage(i) for i in range(len(self.layouts))] + ["score"]
        for mods, n in zip(self.has_modules(), self.names):
            if mods:
                names += [f"local-{n}", f"local-score-{n}", f"explain-{n}"]
        names += (["logs"] if self.logs else []) + ["report"]
        return names

    @staticmethod
    def precisions(caps: list[Bundle]) -> list[str]:
        out = []
        for c in caps:  # a capture that does not say its precision gets no band (its verdict: incomplete)
            p = c.get("precision")
            if p in CAPTURE_NAMES and p not in out:
                out.append(p)
        return out

    def estimates(self, caps: list[Bundle], given: dict[str, Path] | None = None) -> dict[str, dict[str, float]]:
        """Per stage: seconds, flops, peak memory and disk (bytes), from the replay planner and a probe of
        this machine now (``eta.py``) on the threads this process's stages run on (``own_threads``); a stage
        ``given`` (--truth, --band: made elsewhere) costs nothing here."""
        import torch

        keep = torch.get_num_threads()
        if self.own_threads():
            torch.set_num_threads(self.own_threads())
        try:
            return self._estimates(caps, given)
        finally:
            torch.set_num_threads(keep)

    def _estimates(self, caps: list[Bundle], given: dict[str, Path] | None) -> dict[str, dict[str, float]]:
        import torch

        from ..integrations.megatron.merge import memory_need as merge_memory
        from ..parallel.launch import per_rank_threads
        from ..replay.streaming.engine import rss_bytes
        from ..replay.streaming.plan import band_wall, core_rates, gemm_rates, plan
        from ..score.scorer import memory_need as score_memory

        est: dict[str, dict[str, float]] = {}
        for (k, p), n in zip(self.inputs, self.names):
            if k == "ranks":
                size = sum(f.stat().st_size for f in p.rglob("*.safetensors"))
                est[f"merge-{n}"] = {"seconds": size / 200e6, "flops": 0, "memory": rss_bytes() + merge_memory([p]), "disk": size}
        cap, streamed = caps[replayable(caps)], self.budget is not None
        base = plan(cap, "fp64", streamed=streamed, budget=self.budget)  # pays the imports: not the probe
        precs = self.precisions(caps)
        t0 = time.perf_counter()  # the probe (eta.py): the planner's wall time on this capture, now
        plans = {prec: plan(cap, prec, streamed=streamed, budget=self.budget) for prec in precs} or {"fp64": plan(cap, "fp64", streamed=streamed, budget=self.budget)}
        probe = self.probe_s = (time.perf_counter() - t0) / len(plans)
        # The GEMM times again from one interleaved probe of both dtypes (plan.gemm_rates): each plan's own
        # probe ran at another moment, and a load between them moved the band's price against the truth's
        # 0.47-1.55x in five dry runs of the 8B step with one core kept busy.
        compute = {d: emulation(d)[0] for d in ("fp64", *precs)}  # the dtype each pass's GEMMs run in
        rates = self.rates = gemm_rates(tuple(dict.fromkeys(compute.values())))
        # The servers' figures from one core's CPU-time rate (plan.core_rates): a busy core here slows the
        # wall-clock probe above 2-3x (the 8B dry run priced 1.5 h quiet, 29.7-38 h loaded), not this one.
        cores = self.core_rates = core_rates(tuple(dict.fromkeys(compute.values())))
        gemm_s = lambda q: q["estimated_seconds"] * q["gemm_flops_per_s"] / rates[compute[q["dtype"]]]  # noqa: E731
        core_s = lambda q: gemm_s(q) * rates[compute[q["dtype"]]] / cores[compute[q["dtype"]]]  # noqa: E731 -- one core's GEMM seconds
        disk = lambda q: q["disk"]["gradients"] + q["disk"]["spilled_activations"] + q["disk"]["resume_journal"]  # noqa: E731
        # a pass's per-parameter work (plan.PARAMETER_SECONDS) is a fixed cost: not in gemm_seconds, not shrunk by cores
        # every FLOP at one core's probe rate: what no faster replay goes below on cores like these (server_gemms)
        floor = lambda q: q["total_flops"] / cores[compute[q["dtype"]]]  # noqa: E731
        est["truth"] = {"seconds": eta.truth_seconds(gemm_s(base), base["attention_calls"], probe) + base["parameter_seconds"], "flops": base["total_flops"],
                        "gradients": base["disk"]["gradients"],
                        "gemm_seconds": gemm_s(base), "gemm_core_seconds": core_s(base), "floor_core_seconds": floor(base),
                        "memory": base["memory"]["peak_estimate"], "disk": disk(base), "refusal": base["refusal"],
                        "fixed": base["memory"]["fixed"], "by": base["memory"]["reserve_by"]}  # fmt: skip
        for prec in precs:
            q = plans[prec]
            member = eta.member_seconds(prec, gemm_s(q), q["attention_calls"], probe) + q["parameter_seconds"]
            fixed = member - gemm_s(q)  # one member's costs beside its GEMMs: probes' worth, per-parameter work
            # --nproc: the members' processes share this machine's cores, so their GEMMs do not overlap (the same
            # FLOPs on the same cores); what overlaps is the rest, mostly one thread or the disk (weights read,
            # gradients written and hashed). Measured on the 8B cut at 2048 tokens, a bf16 band of 2, one after the
            # other on 2 cores: `--ensemble 2` 216.5 s, `--ensemble 2 --nproc 2 --threads 1` 192.6 s (0.89x; priced
            # 0.5x before, as if each process had the machine to itself). The rank stages below are the serial sum.
            # each rank on --threads (per_rank_threads): fewer than its share of the probe's threads slows its GEMMs
            spread = self._spread()
            slower = torch.get_num_threads() / per_rank_threads(spread, self.threads) if spread > 1 else None
            wall, gemm_wall = band_wall(self.ensemble, spread, gemm_s(q), fixed, slower=slower)
            est[f"band-{prec}"] = {"seconds": wall, "flops": q["total_flops"] * self.ensemble,
                                   "gemm_seconds": gemm_wall, "gemm_core_seconds": core_s(q) * self.ensemble,
                                   "floor_core_seconds": floor(q) * self.ensemble,
                                   "members": self.ensemble, "member_gemm": gemm_s(q), "member_fixed": fixed,
                                   "memory": q["memory"]["peak_estimate"], "disk": q["disk"]["gradients"] * self.ensemble,
                                   "refusal": q["refusal"], "fixed": q["memory"]["fixed"], "by": q["memory"]["reserve_by"]}  # fmt: skip
        for i, lay in enumerate(self.layouts):  # TP x (the truth + every band member), in memory
            serial = est["truth"]["seconds"] + sum(self.ensemble * (est[f"band-{p}"]["member_gemm"] + est[f"band-{p}"]["member_fixed"])
                                                   for p in precs)  # fmt: skip
            gemm = est["truth"]["gemm_seconds"] + sum(self.ensemble * est[f"band-{p}"]["member_gemm"] for p in precs)
            core = est["truth"]["gemm_core_seconds"] + sum(est[f"band-{p}"]["gemm_core_seconds"] for p in precs)
            low = est["truth"]["floor_core_seconds"] + sum(est[f"band-{p}"]["floor_core_seconds"] for p in precs)
            est[self.rank_stage(i)] = {"seconds": lay["tp"] * serial, "gemm_seconds": lay["tp"] * gemm, "gemm_core_seconds": lay["tp"] * core,
                         "floor_core_seconds": lay["tp"] * low,
                         "flops": lay["tp"] * (base["total_flops"] + sum(plans[p]["total_flops"] * self.ensemble for p in precs)),
                         "memory": base["memory"]["peak_estimate"], "disk": 0}  # fmt: skip
        grads = base["disk"]["gradients"]
        est["score"] = {
            "seconds": score_seconds(3 * grads, self.score_workers()) + eta.SCORE_PROBES * probe,  # the truth, the captures, the bands
            "score_bytes": 3 * grads, "score_workers": self.score_workers(),
            "flops": 0,
            "memory": rss_bytes() + score_memory(caps, workers=self.score_workers()),  # scorer.memory_need
            "disk": 0,
        }
        for c, n in zip(caps, self.names):
            if c.get("modules"):  # each module once in fp64, ``members`` times emulated, its device run
                f = base["total_flops"] * (2 + self.members) / 4
                est[f"local-{n}"] = {"seconds": f / rates[compute["fp64"]] / 0.3 + (1 + self.members) * eta.MEMBER_PROBES_OTHER * probe, "flops": f,
                                     "memory": base["memory"]["peak_estimate"], "disk": grads}  # fmt: skip
                est[f"local-score-{n}"] = {"seconds": 1, "flops": 0, "memory": 0, "disk": 0}
                # explain: one module, 2 runs per op class (10 classes) + 2, in float64
                est[f"explain-{n}"] = {"seconds": 22 * gemm_s(base) / max(base["units"], 1) / 4,
                                       "flops": 0, "memory": base["memory"]["peak_estimate"], "disk": 0}  # fmt: skip
        if self.logs:
            est["logs"] = {
                "seconds": gemm_s(base) / 4,
                "flops": 0,
                "memory": base["memory"]["peak_estimate"],
                "disk": 0,
            }
        est["report"] = {"seconds": eta.REPORT_PROBES * probe, "flops": 0, "memory": 0, "disk": 1 << 20}
        for s in given or {}:
            est[s] = {"seconds": 0.0, "flops": 0, "memory": 0, "disk": 0, "given": str(given[s])}
        return est

    @staticmethod
    def refusals(est: dict[str, dict[str, Any]]) -> list[str]:
        """The replay stages that would not fit --max-memory (the planner's own refusal, what that
        stage's replay would exit 2 with), each named: one rule for the dry run and the run."""
        over = {s: e for s, e in est.items() if e.get("refusal")}
        if not over:
            return []
        need = max(e["fixed"] for e in over.values())
        stages = ", ".join(f"{s} (about {e['fixed'] / 2**30:.2f} GiB: its largest unit {e['by']} with the process)" for s, e in over.items())
        return [f"{len(over)} stage(s) would not fit --max-memory: {stages}; raise it to at least {need / 2**30 * 1.1:.1f}G "
                "(the same margin as oracle replay --max-memory)"]  # fmt: skip

    def dry_run(self) -> tuple[str, list[str]]:
        """(the stage table, the refusals): a stage above --max-memory is marked in the table and named
        in the refusals (the caller exits 2, as the run would before its first replay)."""
        with tempfile.TemporaryDirectory(prefix=".oracle-judge-dry-") as tmp:
            caps = [Bundle(self._merge(k, p, Path(tmp) / n, False)) for (k, p), n in zip(self.inputs, self.names)]
            src = replayable(caps)
            check_same_step(caps[src], caps[1 - src], self.names[1 - src])
            self.layouts = self.rank_layouts(caps)
            given = self.given(caps[src], self.precisions(caps))
            est = self.estimates(caps, given)
            order = self.stage_names(self.precisions(caps))
        refused = self.refusals(est)
        over = [s for s in order if est.get(s, {}).get("refusal")]
        within = (f", streamed within --max-memory {self.max_memory}" if not over
                  else f", --max-memory {self.max_memory}: {', '.join(over)} ABOVE it") if self.max_memory else ""  # fmt: skip
        lines = [f"dry run: oracle judge {self.names[0]} vs {self.names[1]}: {len(order)} stages" + within
                 + (f", --nproc {self.nproc}" if self.nproc > 1 else ""),
                 f"  {'stage':<24} {'time':>10} {'GFLOP':>10} {'peak memory':>12} {'disk':>10}"]  # fmt: skip
        for s in order:
            e = est.get(s, {"seconds": 0, "flops": 0, "memory": 0, "disk": 0})
            if e.get("given"):
                lines.append(f"  {s:<24} {'given':>10} {'':>10} {'':>12} {'':>10}  {e['given']}")
                continue
            lines.append(f"  {s:<24} {duration(e['seconds']):>10} {e['flops'] / 1e9:>10.2f} {_size(e['memory']):>12} {_size(e['disk']):>10}"
                         + ("  ABOVE --max-memory" if e.get("refusal") else ""))  # fmt: skip
        tot = sum(e["seconds"] for e in est.values())
        lines.append(f"  total about {duration(tot)} here; peak memory {_size(max(e['memory'] for e in est.values()))}; "
                     f"disk {_size(sum(e['disk'] for e in est.values()))} (estimates from float64 and float32 GEMM probes and the planner's time on this machine, now)")  # fmt: skip
        bands = [s for s in order if s.startswith("band-") and not est.get(s, {}).get("given")]
        if bands and est.get("truth", {}).get("seconds"):
            t = est["truth"]["seconds"]
            lines.append("  the noise band next to the truth: " + ", ".join(
                f"{s} {est[s]['seconds'] / t:.2f}x ({_n(self.ensemble, 'member')} in float32, {self._spread()} process(es)"
                + (f": one per member, of --nproc {self.nproc}" if self.nproc > self.ensemble else "") + ")" for s in bands))
        import torch

        here, f64 = self.own_threads() or torch.get_num_threads(), torch.float64  # the probes' threads (estimates)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        lines.append(f"  GEMM probe now: float64 {self.rates[f64] / 1e9:.1f} GFLOP/s on {_n(here, 'thread')} by the wall clock (the times "
                     f"here; load average {load:.1f} on {os.cpu_count()} cores), {self.core_rates[f64] / 1e9:.1f} GFLOP/s per core by "
                     "CPU time (the times below: a busy machine slows the first, not the second)")  # fmt: skip
        for cores, hosts in ((64, 1), (64, 8)):
            t = elsewhere(est, here, cores, hosts)
            where = f"on one {cores}-core server" if hosts == 1 else (f"on {hosts} hosts of {cores} cores (the replays under torchrun, "
                                                                      "given to the judge: --truth, --band)")  # fmt: skip
            if hosts == 1:
                at, floor = server_gemms(est, cores)
                lines.append(f"  {where}: about {duration(t)} (the replays' GEMMs {duration(at)} on {cores} cores like this machine's, at "
                             f"the fraction of the per-core probe they reach here, no less than {duration(floor)} at 100 % of it; their fixed costs "
                             f"and the other stages {duration(t - at)} as here)")  # fmt: skip
                continue
            lines.append(f"  {where}: about {duration(t)} (the replays' GEMMs at this machine's per-core rate on {cores * hosts} cores"
                         + self._hosts_split(est, here, cores, hosts) + ", their fixed costs and the other stages as here)")  # fmt: skip
        return "\n".join(lines), refused

    @staticmethod
    def _hosts_split(est: dict[str, dict[str, Any]], here: int, cores: int, hosts: int) -> str:
        """How ``hosts_plan`` shares the hosts between the replays, in words for the dry run."""
        m = hosts_plan(est, here, cores, hosts)[1]
        k = sum(e.get("members", 0) for e in est.values())
        truth = "truth" in est and not est["truth"].get("given")
        th = hosts - m
        parts = []
        if truth and th > 1:
            parts.append(f"the truth split by tokens over {th} hosts at efficiency {TOKEN_PARALLEL_EFFICIENCY}, rank 0 adding "
                         f"{(th - 1).bit_length()} partial gradient set(s)")  # fmt: skip
        elif truth:
            parts.append("the truth in one process on one host")
        if k:
            used = min(k, m or hosts)
            idle = f" ({m - used} idle: the truth over more would add a round of partial sums)" if truth and m > used else ""
            parts.append(f"{'while ' if m and truth else 'then ' if truth else ''}the {k} band member(s) run whole, one per host"
                         f"{' at a time' if k > used else ''}, on {used} {'other ' if truth and m else ''}host(s){idle}")  # fmt: skip
        return ("; " + " ".join(parts)) if parts else ""

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """The stages; a judge stopped before any stage wrote anything (a refusal: another step,
        exit 5) leaves no ``--out`` folder behind that it created. An ``--out`` that is, lies inside or holds a
        run or a log is refused first (exit 6; issue 41: ``--out capB/j`` wrote into run B)."""
        check_not_input(self.out, [p for _, p in self.inputs] + self.logs + ([self.truth_given] if self.truth_given else [])
                        + self.bands_given)  # fmt: skip
        created = not self.out.exists()
        try:
            return self._run()
        except BaseException:
            if created and self.out.is_dir() and all(p.name == workfolder.MARK for p in self.out.iterdir()):
                shutil.rmtree(self.out, ignore_errors=True)
            raise

    def _run(self) -> dict[str, Any]:
        workfolder.open_out(self.out)
        # the bands' precisions are known before merging: a merge keeps its ranks' precision
        precs = []
        for k, p in self.inputs:
            b = (
                Bundle(p)
                if k == "capture"
                else Bundle(next(iter(sorted(x for x in p.iterdir() if (x / "manifest.json").is_file())), p))
            )
            precs.append(b)
        order = self.stage_names(self.precisions(precs))
        progress = self.progress = Progress(len(order), echo=self.echo)  # its ``timed``: benchmarks/judge_eta.py
        st = Stages(self.out, progress)
        caps_p = []
        for (k, p), n in zip(self.inputs, self.names):
            if k == "ranks":
                caps_p.append(st.bundle(f"merge-{n}", f"merge the rank bundles of {p}",
                                        {"recipe": self.recipe, "dp_rank": self.dp_rank, "boundaries": BOUNDARIES}, [p],
                                        lambda out, ow, k=k, p=p: self._merge(k, p, out, ow)))  # fmt: skip
            else:
                caps_p.append(p)
        caps = [Bundle(p) for p in caps_p]
        check_complete(caps, self.names)  # before any replay: no verdict on what was never captured
        src = replayable(caps)  # the run whose capture holds the inputs (an msprobe import holds none)
        check_same_step(caps[src], caps[1 - src], self.names[1 - src])  # before any replay: exit 5 on another step
        self.layouts = self.rank_layouts(caps)
        if self.stage_names(self.precisions(caps)) != order:
            order = self.stage_names(self.precisions(caps))
            progress.total = len(order)
        given = self.given(caps[src], self.precisions(caps))
        progress.estimates = self.estimates(caps, given)
        refused = self.refusals(progress.estimates)
        if refused:  # before any replay: hours of truth are not spent on a judge whose band cannot run
            raise UsageError("oracle judge: " + "; ".join(refused) + " (oracle judge ... --dry-run shows every stage)")
        progress.left = {k: v["seconds"] for k, v in progress.estimates.items() if k in order and k not in st.reused and k not in given}
        budget = {"max_memory": self.budget}

        def stage(name: str, flag: str, run: Callable[[], Path]) -> Path:
            if name in given:
                progress.given(name, given[name], flag)
                return given[name]
            return run()

        truth = stage("truth", "--truth", lambda: st.bundle("truth", f"replay {self.names[src]} in float64" + (f" within {self.max_memory}" if self.max_memory else ""),
                          {**budget, "threads": self.threads, "nproc": self.nproc}, [caps_p[src]],
                          lambda out, ow: self._replay(caps_p[src], out, ow, "fp64")))  # fmt: skip
        bands = []
        for prec in self.precisions(caps):
            bands.append(stage(f"band-{prec}", "--band", lambda prec=prec: st.bundle(
                f"band-{prec}", f"emulate {self.ensemble} honest {prec} runs (noise band)",
                {**budget, "ensemble": self.ensemble, "threads": self.threads, "nproc": self.nproc, "emulation": EMULATION},
                [caps_p[src]], lambda out, ow: self._replay(caps_p[src], out, ow, prec, self.ensemble))))  # fmt: skip
        views = []
        for i, lay in enumerate(self.layouts):
            from ..integrations.megatron.perrank import project

            views.append(st.bundle(self.rank_stage(i), f"each TP rank's own truth and band for {len(lay['names'])} gradient(s) "
                                   f"the framework left per rank (TP {lay['tp']}, SP)", {"layout": lay},
                                   [truth, caps_p[src], *bands],
                                   lambda out, ow, lay=lay: project(truth, caps_p[src], bands, out, lay, overwrite=ow)))  # fmt: skip
        from ..score.scorer import score as do_score

        result = st.document("score", "score both runs against the truth, each with its own band", {"margin": self.margin, "rule": RULE},
                             [truth, *caps_p, *bands, *views],
                             lambda: do_score(truth, caps_p, band_paths=bands, margin=self.margin, names=self.names,
                                              per_rank=views, workers=self.score_workers()))  # fmt: skip
        local, explained = {}, {}
        for c, cp, n in zip(caps, caps_p, self.names):
            if not c.get("modules"):
                continue
            lb = st.bundle(f"local-{n}", f"replay {n}'s recorded modules alone", {"members": self.members, "nproc": self.nproc, "rows": LOCAL_ROWS},
                           [cp], lambda out, ow, cp=cp: self._local(cp, out, ow))  # fmt: skip
            from ..score.local import input_row, score_local

            local[n] = st.document(f"local-score-{n}", f"score {n}'s local replay", {"margin": self.margin, "rule": RULE}, [lb],
                                   lambda lb=lb: score_local(lb, margin=self.margin))  # fmt: skip
            culprit = local[n]["verdict"].get("culprit")
            if culprit and input_row(culprit):  # an input made outside the recorded modules: no op of it ran
                progress.skip(f"explain-{n}", f"{culprit} is an input made outside the recorded modules: no op class to rank")
            elif culprit:
                explained[n] = st.document(f"explain-{n}", f"which op class explains {culprit}", {"module": culprit}, [cp],
                                           lambda cp=cp, culprit=culprit: explain_culprit(cp, culprit))  # fmt: skip
            else:
                progress.skip(f"explain-{n}", "no module beyond its band: nothing to explain")
        logs = None
        if self.logs:
            logs = st.document("logs", "the truth's rank view against the runs' grad-norm logs", {"names": self.names},
                               [truth, *self.logs], lambda: logs_against_truth(truth, self.logs, self.names))  # fmt: skip
        runs = []
        for (k, p), cp, c, n in zip(self.inputs, caps_p, caps, self.names):
            runs.append({"name": n, "input": str(p), "input_kind": "megatron rank folder" if k == "ranks" else "capture bundle",
                         "capture": str(cp), "megatron": bool(c.get("megatron")), "precision": c.get("precision"), "modules": bool(c.get("modules")),
                         "num_tokens": (c.get("loss") or {}).get("num_tokens"),
                         "rank_num_tokens": (c.get("loss") or {}).get("rank_num_tokens"), "fingerprint": manifest_fingerprint(cp),
                         "microbatches": len((c.get("megatron") or {}).get("microbatches") or []) or 1})  # fmt: skip
        t0 = progress.start("report", "write the report (text, JSON, HTML)")
        doc = answers_mod.build(result, runs, local=local, explained=explained, logs=logs)
        doc["stages"] = order
        doc["report_files"] = write_judge_report(doc, self.out / "report")
        progress.end("report", t0, reused=False)
        return doc


def explain_culprit(capture: Path, module: str) -> dict[str, Any]:
    """``explain`` in the capture's own format; where no class explains most (>= 50 %) of the error
    and the capture is held wider than bf16, again with the classes in bf16 (an op run in a lower
    precision than the capture's: the commonest wrong choice), keeping the better-explained one."""
    from ..score.explain import explain

    first = explain(capture, module)
    if first["classes"][0]["share_only"] >= 0.5 or first["format"] in ("bf16", "fp16"):
        return first
    low = explain(capture, module, fmt="bf16")
    return low if low["classes"][0]["share_only"] > first["classes"][0]["share_only"] else first


def logs_against_truth(truth: Path, logs: list[Path], names: list[str]) -> dict[str, Any]:
    """Each log's printed norms against the truth: on the rank the log was printed on (the rank view
    of a Megatron oracle, TP rank 0 / stage 0), else the merged parameters."""
    from ..integrations import normlog
    from ..integrations.megatron.rankview import log_rows, rank_view

    parsed = [normlog.parse(p) for p in logs]
    b = Bundle(truth)
    if b.get("megatron"):
        view = rank_view(truth, rank=0)
        where = "TP rank 0, stage 0 (the rank view of the truth)"
    else:
        view = {n: t for n, t in b.iter_group("grads")}
        where = "the whole parameters"
    rows = log_rows(view, parsed, names)
    rows["where"] = where
    rows["compare"] = normlog.compare(parsed[0], parsed[1], tuple(names))
    return rows


CAPTURE_COMMANDS = """\
On each cluster, the training command as it is, one variable more. First install oracle-fp64 in the
training environment from a wheel of the checkout (`pip wheel --no-deps . -w dist/`, then `pip install
--no-index --no-deps dist/oracle_fp64-*.whl`: it adds only itself) and run `python -m oracle doctor DIR`
there (exit 0: the capture will fire). Every rank writes its view of the step, before (pre/) and after
(post/) finalize_model_grads; the norms were printed before it. Capture the same step on both: the same
weights, seed and data order (ORACLE_CAPTURE_STEP=N for a later step than the first).

    # {a} (megatron-core 0.12.1)
    ORACLE_CAPTURE=/shared/{da}-step swift megatron sft --model Qwen/Qwen3-VL-8B-Instruct --seed 42 --data_seed 42 ...   # your flags unchanged
    # {b} (MindSpeed)
    ORACLE_CAPTURE=/shared/{db}-step swift megatron sft --model Qwen/Qwen3-VL-8B-Instruct --seed 42 --data_seed 42 ...

(ORACLE_CAPTURE_MODULES=layers as well records the decoder layers' boundaries: the judge then replays each
layer alone and says where the error is born.) Copy both folders to one CPU host, then:

    pip install -e ".[host]"                             # in the checkout
    oracle judge /shared/{da}-step/pre /shared/{db}-step/pre --recipe qwen3-vl --name {a} --name {b} \\
        --max-memory 48G --out judge/ --dry-run            # what it will cost, stage by stage
    oracle judge /shared/{da}-step/pre /shared/{db}-step/pre --recipe qwen3-vl --name {a} --name {b} \\
        --max-memory 48G --out judge/ --log-a {log_a} --log-b {log_b}

Only for a custom training loop (not megatron-core's schedules, so ORACLE_CAPTURE sees no step): call the
hook yourself right after the last backward, before finalize_model_grads:

    from oracle.integrations.megatron.hook import capture_rank
    capture_rank(model, "/shared/{da}-step/pre", stage="pre-finalize", batch=batch, loss=loss, num_tokens=n_tokens,
                 vocab_size=tokenizer.vocab_size, packed_seq_params=packed_seq_params)
"""


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in name.lower()) or "run"


def judge_logs(log_a: Path, log_b: Path, names: list[str] | None, out: Path | None, *, precision: str = "bf16",
               num_layers: int | None = None) -> dict[str, Any]:  # fmt: skip
    """The logs alone (no capture): what they show, whether the gap is beyond honest round-off by the
    analytic bound (``score/bound.py``: ``precision`` the runs' working precision, ``num_layers`` the
    model's decoder layers, default as many as the logs name), what they cannot tell, and how to capture."""
    from ..integrations import normlog
    from ..score import bound as bound_mod

    for lg, flag in ((log_a, "--log-a"), (log_b, "--log-b")):
        check_log(lg, flag)
    labels = log_labels([Path(log_a), Path(log_b)], names)
    if num_layers is not None and num_layers < 1:
        raise UsageError(f"--num-layers {num_layers}: the model's decoder layers, at least 1")
    cmp = normlog.compare(normlog.parse(log_a), normlog.parse(log_b), labels)
    bnd = bound_mod.logs_verdict(cmp["layers"], precision=precision, depth=num_layers, params=cmp["params"])
    if num_layers is not None and num_layers < bnd["named_depth"]:
        raise UsageError(f"--num-layers {num_layers}: the logs name {bnd['named_depth']} decoder layers; give at least that")
    shows = [ln for ln in cmp["summary"].splitlines() if not ln.startswith("What this cannot tell")]
    cannot = [
        "which run is right: a norm ratio says the runs disagree, not which one is off the truth",
        "whether each run alone is honest noise of its precision: the bound above says whether the gap between them can "
        "be; which run makes it needs the truth, and a noise band measured on the same step is sharper than the bound",
        "where the error is born (module, forward or backward) and which op class explains it: that needs the "
        "gradients themselves, replayed in float64",
    ]
    doc = {"schema_version": answers_mod.SCHEMA_VERSION, "kind": "oracle-judge-logs", "names": list(labels),
           "shows": shows, "bound": bnd, "cannot_conclude": cannot,
           "capture_commands": CAPTURE_COMMANDS.format(a=labels[0], b=labels[1], da=_slug(labels[0]), db=_slug(labels[1]), log_a=log_a, log_b=log_b), "compare": cmp,
           # the side-by-side summary without its "cannot tell ... whether the gap exceeds honest noise": the bound
           # above answers that, and what the logs cannot tell is listed once, in cannot_conclude
           "compare_text": normlog.render_compare(dict(cmp, summary="\n".join(shows)))}  # fmt: skip
    if out is not None:
        from ..bundle.atomic_file import write_json

        try:
            Path(out).mkdir(parents=True, exist_ok=True)
            write_json(doc, Path(out) / "judge.json")
        except OSError as e:
            from ..errors import OutputError

            raise OutputError(f"cannot write {out}/judge.json: {e.strerror or e}") from None
    return doc
