"""The ``oracle`` command line: parse, call the library, print, exit. No numerics here.

Exit codes: ``oracle.errors.EXIT_CODES`` is the one table (``oracle --help`` prints it, README.md
repeats it and a test checks that the two agree). Closed choices are Enums derived from the tables
they come from (precision names from ``oracle/precision/__init__.py``); typer refuses anything else with a
usage error (exit 2), as it does unknown options and missing arguments.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated

try:
    import typer
except ImportError:  # the capture-only install (training environment): no CLI there but the doctor; else exit 2
    if sys.argv[1:2] == ["doctor"]:  # `oracle doctor` as the README's Commands table says: the same check, no typer needed
        from oracle.integrations.megatron.doctor import main as _doctor_main

        sys.exit(_doctor_main(sys.argv[2:], prog="oracle doctor"))
    print(
        "oracle: this environment has the capture side only (oracle.Capture, the Megatron hook, ORACLE_CAPTURE); "
        'the command line runs on the CPU host: pip install "oracle-fp64[host]"; here, `oracle doctor` runs',
        file=sys.stderr,
    )
    sys.exit(2)

from oracle import precision as precisions
from oracle.api.guard import INTERRUPTED, guarded
from oracle.errors import EXIT_CODES, UsageError
from oracle.score.tolerance import BAND_MEMBERS

try:  # typer >= 0.25 labels every flag `<bool>` in --help: a flag takes no value, so it gets no type label
    from typer.core import TyperOption

    if hasattr(TyperOption, "display_type_rich"):
        _type_label = TyperOption.display_type_rich
        TyperOption.display_type_rich = lambda self, ctx: None if getattr(self, "is_flag", False) else _type_label(self, ctx)
except ImportError:  # pragma: no cover - older typer: no labels to remove
    pass

EPILOG = "Exit codes: " + "; ".join(f"{k} {v}" for k, v in EXIT_CODES.items())
app = typer.Typer(
    help="Float64 ground truth for cross-hardware training precision: capture a step, replay it in "
    "float64 on CPU, score every device's gradients against it.",
    epilog=EPILOG,
    pretty_exceptions_show_locals=False,
    no_args_is_help=True,
    add_completion=False,
)


def _choices(name: str, values) -> type[Enum]:
    return Enum(name, {v.replace("-", "_"): v for v in values}, type=str)


Precision = _choices("Precision", precisions.CAPTURE_NAMES)
ReplayDtype = _choices("ReplayDtype", precisions.REPLAY_NAMES)
RunPrecision = _choices("RunPrecision", precisions.IMPORT_NAMES)
Device = _choices("Device", ("cpu", "cuda", "npu"))
Reduction = _choices("Reduction", ("mean", "sum"))
Stage = _choices("Stage", ("pre-finalize", "post-finalize"))

Out = Annotated[Path, typer.Option("--out", help="Bundle directory to write.")]
Overwrite = Annotated[bool, typer.Option(help="Replace an existing bundle at --out (only a bundle is ever replaced).")]
ReplayOverwrite = Annotated[bool, typer.Option(help="Replace an existing bundle at --out (only a bundle is ever replaced) and a streamed work folder of this step beside it made by another command; another step's work folder is kept (exit 6).")]
JsonOut = Annotated[Path | None, typer.Option("--json", help="Write the full result as JSON (non-finite numbers as null).")]
Report = Annotated[Path | None, typer.Option(help="Write PNG, CSV, JSON and an HTML page here.")]
def _finite_margin(value: float) -> float:
    """An infinite (or NaN) margin would pass every parameter unchecked: refused as a usage error."""
    if value is not None and (value != value or value in (float("inf"), float("-inf"))):
        raise typer.BadParameter(f"{value} is not a finite number (a margin of inf would pass everything)")
    return value


Margin = Annotated[
    float | None,
    typer.Option(min=1.0, callback=_finite_margin,
                 help="Excess over the band above which a parameter, layer or module is beyond noise (finite, >= 1); "
                      "default: calibrated on each run's emulated members (1 % family-wise false alarms; docs/limits.md)."),
]  # fmt: skip
Tol = Annotated[list[str] | None, typer.Option("--tol", help="Override the tolerance table: PRECISION:expected=VALUE or PRECISION:floor=VALUE.")]  # fmt: skip
Names = Annotated[list[str] | None, typer.Option("--name", help="Display names, in order.")]
Pattern = Annotated[str | None, typer.Option(help="Logs: regex with (?P<name>..) and (?P<value>..) groups.")]
Occurrence = Annotated[int | None, typer.Option(help="Logs: take the K-th print of each name (0-based).")]
LogStep = Annotated[str | None, typer.Option(help="Logs: keep lines whose (?P<step>..) group equals this.")]
LogRank = Annotated[str | None, typer.Option(help="Logs: keep lines whose (?P<rank>..) group equals this.")]


def user_errors(fn: Callable) -> Callable:
    """What went wrong -> one message on stderr and its exit code (oracle/api/guard.py, the one mapping)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        exits: list[typer.Exit] = []

        def call() -> None:
            try:
                fn(*args, **kwargs)
            except typer.Exit as e:  # a command's own exit code, not an error
                exits.append(e)

        rc = guarded(call, lambda s: typer.echo(s, err=True))
        if exits:
            raise exits[0]
        if rc:
            raise typer.Exit(code=rc)

    return wrapper


@app.command()
@user_errors
def judge(
    runs: Annotated[list[Path] | None, typer.Argument(help="Run A's and run B's capture folders: Megatron rank folders (DIR/pre as ORACLE_CAPTURE writes them) or capture bundles. Leave both out for the logs-only answer (--log-a, --log-b).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Work folder: every stage's output (reused when its inputs are unchanged) and report/.")] = None,
    recipe: Annotated[str | None, typer.Option(help="Recipe whose names rank folders are merged to (qwen3, qwen3-vl).")] = None,
    name: Names = None,
    log_a: Annotated[Path | None, typer.Option("--log-a", help="Run A's grad-norm log.")] = None,
    log_b: Annotated[Path | None, typer.Option("--log-b", help="Run B's grad-norm log.")] = None,
    max_memory: Annotated[str | None, typer.Option(help="Stream the replays within this memory (16G); resumable.")] = None,
    ensemble: Annotated[int, typer.Option(min=1, help="Members of each run's emulated noise band.")] = BAND_MEMBERS,
    members: Annotated[int, typer.Option(min=1, help="Local replay: emulated members per module.")] = 2,
    margin: Margin = None,
    dp_rank: Annotated[int | None, typer.Option(min=0, help="Merge: DP rank whose batch (all its micro-batches) is the step.")] = None,
    nproc: Annotated[int, typer.Option(min=1, help="Replays spread over N local processes (as `oracle replay --nproc`).")] = 1,
    threads: Annotated[int | None, typer.Option(min=1, help="CPU threads per replay process: with --nproc each rank's (the stages the judge runs itself keep every core).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print each stage's time, FLOPs, memory and disk, then exit (needs no --out).")] = False,
    num_layers: Annotated[int | None, typer.Option(help="The logs alone: the model's decoder layers for the round-off bound (default: as many as the logs name).")] = None,
    truth: Annotated[Path | None, typer.Option("--truth", help="The float64 truth replayed elsewhere (over hosts: torchrun -m oracle replay CAP --out T --split tokens): taken as the truth stage once checked to be this step's.")] = None,
    band: Annotated[list[Path] | None, typer.Option("--band", help="A noise band replayed elsewhere (torchrun -m oracle replay CAP --out B --dtype P --ensemble K), one per precision; checked likewise.")] = None,
) -> None:  # fmt: skip
    """From two runs' capture folders (and their grad-norm logs) to one report: bug or noise, which run, where born, which op. The runs may be left out: with only --log-a and --log-b it answers from the logs alone (what they show, what they cannot, how to capture).

    Example: oracle judge /shared/h20-step/pre /shared/910b-step/pre --recipe qwen3-vl --name H20 --name 910B --max-memory 48G --out judge/

    Example: oracle judge --log-a h20_rank0.log --log-b 910b_rank0.log --name H20 --name 910B
    """
    from oracle.api.judge import JudgeOptions
    from oracle.api.judge import judge as api_judge

    opts = JudgeOptions(runs=tuple(runs or ()), out=out, recipe=recipe, names=name, log_a=log_a, log_b=log_b,
                        max_memory=max_memory, ensemble=ensemble, members=members, margin=margin, dp_rank=dp_rank,
                        nproc=nproc, threads=threads, dry_run=dry_run, num_layers=num_layers, truth=truth, bands=tuple(band or ()))  # fmt: skip
    api_judge(opts, echo=typer.echo, progress=lambda s: typer.echo(s, err=True))


@app.command()
@user_errors
def capture(
    out: Out,
    model: Annotated[str, typer.Option(help="Embedded model name, or a local Hugging Face model directory.")] = "tiny-qwen3-vl",
    sample: Annotated[Path | None, typer.Option(help="ms-swift style .jsonl; default: the recipe's embedded sample.")] = None,
    index: Annotated[str, typer.Option(help="Line of --sample to use (0-based), or several (0,3,7) packed into one sequence.")] = "0",
    pack: Annotated[int | None, typer.Option(min=1, help="Pack N samples of --sample from --index on into one sequence (per-sample attention and positions).")] = None,
    device: Annotated[Device, typer.Option(help="Device the step runs on.")] = Device.cpu,
    precision: Annotated[Precision, typer.Option(help="Precision policy of the step.")] = Precision.fp32,
    loss_reduction: Annotated[Reduction, typer.Option(help="'mean' over loss tokens, or 'sum' (Megatron per-token loss).")] = Reduction.mean,
    seed: Annotated[int, typer.Option(help="Seed set before the step.")] = 0,
    modules: Annotated[str | None, typer.Option(help="Record module boundaries: presets (all, layers, sublayers, vit, mergers, embeddings, head; comma-separated) or a regex.")] = None,
    budget_mb: Annotated[float | None, typer.Option(help="Disk budget for module boundaries, MiB.")] = None,
    overwrite: Overwrite = False,
) -> None:  # fmt: skip
    """Take one training step of one sample and write a capture bundle.

    Example: oracle capture --out h20.bundle --model /models/Qwen3-VL-8B-Instruct --sample train.jsonl --index 0 --device cuda --precision bf16
    """
    from oracle.api.capture import CaptureOptions
    from oracle.api.capture import capture as api_capture

    opts = CaptureOptions(out=out, model=model, sample=sample, index=index, pack=pack, device=device.value,
                          precision=precision.value, loss_reduction=loss_reduction.value, seed=seed, modules=modules,
                          budget_mb=budget_mb, overwrite=overwrite)  # fmt: skip
    api_capture(opts, echo=typer.echo)


@app.command()
@user_errors
def replay(
    capture: Annotated[Path, typer.Argument(help="Capture bundle to replay.")],
    out: Annotated[Path | None, typer.Option("--out", help="Bundle directory to write (not needed with --dry-run).")] = None,
    dtype: Annotated[ReplayDtype, typer.Option(help="fp64: the oracle; others: an emulated run (noise band).")] = ReplayDtype.fp64,
    ensemble: Annotated[int, typer.Option(min=1, help="Emulated runs only: members (1 round-to-nearest + K-1 jittered).")] = 1,
    verify: Annotated[bool | None, typer.Option("--verify/--no-verify", help="Finite-difference certificate (default: when cheap).")] = None,
    directions: Annotated[int, typer.Option(min=1, help="Random directions for --verify.")] = 3,
    local: Annotated[bool, typer.Option("--local", help="Teacher-forced per-module replay (needs a capture with --modules).")] = False,
    modules: Annotated[str | None, typer.Option(help="--local: regex selecting recorded modules.")] = None,
    workers: Annotated[int, typer.Option(min=1, help="--local: parallel processes.")] = 1,
    members: Annotated[int, typer.Option(min=1, help="--local: emulated members for the expected local error.")] = 2,
    max_memory: Annotated[str | None, typer.Option(help="Stream the replay within this memory (16G, 512M): weights per unit from the capture, activations spilled to disk past it; resumable.")] = None,
    threads: Annotated[int | None, typer.Option(min=1, help="CPU threads (default: all cores). Resume and bitwise repeatability need the same count.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print FLOPs, estimated time, peak memory and disk, then exit; exit 2 where --max-memory is below what the run needs.")] = False,
    nproc: Annotated[int, typer.Option(min=1, help="Spread over N local processes (ensemble members, --local modules); many machines: torchrun -m oracle replay.")] = 1,
    split: Annotated[str, typer.Option(help="How several ranks share the fp64 oracle: tensor (heads, MLP, vocabulary) or tokens (the sequence).")] = "tensor",
    overwrite: ReplayOverwrite = False,
) -> None:  # fmt: skip
    """Recompute the captured step on CPU in float64 (the oracle) or an emulated low precision.

    Example: oracle replay h20.bundle --out truth.bundle --max-memory 48G

    Example: oracle replay h20.bundle --out band.bundle --dtype bf16 --ensemble 4
    """
    from oracle.api import ReplayOptions
    from oracle.api import replay as api_replay

    opts = ReplayOptions(capture=capture, out=out, dtype=dtype.value, ensemble=ensemble, verify=verify, directions=directions,
                         local=local, modules=modules, workers=workers, members=members, max_memory=max_memory,
                         threads=threads, dry_run=dry_run, nproc=nproc, split=split, overwrite=overwrite)  # fmt: skip
    if opts.max_memory is not None and opts.nproc == 1 and not opts.dry_run and _PROGRAM:  # never exec a host process
        from oracle.replay.streaming import pages

        pages.restart(sys.orig_argv)  # this process again, malloc on huge pages (returns where not wanted)
    rc = api_replay(opts, echo=typer.echo)
    if rc:
        raise typer.Exit(code=rc)


@app.command()
@user_errors
def score(
    oracle: Annotated[Path, typer.Argument(help="Oracle bundle (from `oracle replay --dtype fp64`), or a local replay (from `oracle replay --local`).")],
    captures: Annotated[list[Path] | None, typer.Argument(help="Capture bundles to score against the oracle.")] = None,
    band: Annotated[list[Path] | None, typer.Option("--band", help="Emulation bundle(s) giving the noise band.")] = None,
    json_out: JsonOut = None,
    report: Report = None,
    margin: Margin = None,
    tol: Tol = None,
    name: Names = None,
    top: Annotated[int, typer.Option(min=0, help="Worst parameters shown per capture.")] = 8,
    force_band: Annotated[bool, typer.Option("--force-band", help="Use a --band of another precision than the capture's (the verdict then carries a warning).")] = False,
) -> None:  # fmt: skip
    """Score captures against the oracle per parameter and layer with a verdict, or score a local replay.

    Example: oracle score truth.bundle h20.bundle 910b.bundle --band band.bundle --name H20 --name 910B --report report/
    """
    from oracle.api.score import ScoreOptions
    from oracle.api.score import score as api_score

    opts = ScoreOptions(oracle=oracle, captures=tuple(captures or ()), band=tuple(band or ()), json_out=json_out,
                        report=report, margin=margin, tol=tuple(tol or ()), names=name, top=top, force_band=force_band)  # fmt: skip
    api_score(opts, echo=typer.echo)


@app.command("compare-logs")
@user_errors
def compare_logs(
    logs: Annotated[list[Path], typer.Argument(help="Two gradient-norm log files.")],
    name: Names = None,
    json_out: JsonOut = None,
    pattern: Pattern = None,
    occurrence: Occurrence = None,
    step: LogStep = None,
    rank: LogRank = None,
) -> None:
    """Compare two gradient-norm logs side by side, without an oracle (what can and cannot be concluded).

    Example: oracle compare-logs h20_rank0.log 910b_rank0.log --name H20 --name 910B
    """
    from oracle.bundle.atomic_file import write_json
    from oracle.integrations import normlog

    if len(logs) != 2:
        raise UsageError(f"compare-logs takes exactly two log files, got {len(logs)}")
    from oracle.pipeline.judge import check_log, log_labels
    from oracle.report.outputs import check_file, writing

    for p, which in zip(logs, ("first", "second")):
        check_log(p, f"the {which} log,")
    check_file(json_out, "--json", logs)
    labels = log_labels(logs, name, flags=("the first log", "the second log"))
    parsed = [normlog.parse(p, pattern=pattern, occurrence=occurrence, step=step, rank=rank) for p in logs]
    result = normlog.compare(parsed[0], parsed[1], labels)
    typer.echo(normlog.render_compare(result))
    if json_out:
        with writing("--json", json_out):
            write_json(result, json_out)
        typer.echo(f"json: {json_out}")


@app.command("import-log")
@user_errors
def import_log(
    log: Annotated[Path, typer.Argument(help="Gradient-norm log.")],
    out: Out,
    precision: Annotated[RunPrecision, typer.Option(help="Precision the logged run used (selects the tolerance).")] = RunPrecision.unknown,
    pattern: Pattern = None,
    occurrence: Occurrence = None,
    step: LogStep = None,
    rank: LogRank = None,
    overwrite: Overwrite = False,
) -> None:  # fmt: skip
    """Turn a gradient-norm log into a norm-only capture bundle that `oracle score` accepts.

    Example: oracle import-log 910b_rank0.log --out 910b-norms.bundle --precision bf16
    """
    from oracle.integrations import normlog

    parsed = normlog.parse(log, pattern=pattern, occurrence=occurrence, step=step, rank=rank)
    normlog.write_norm_bundle(parsed, out, precision=precision.value, overwrite=overwrite)
    typer.echo(f"imported {len(parsed.norms)} gradient norms from {log} -> {out}")


@app.command()
@user_errors
def merge(
    ranks: Annotated[list[Path], typer.Argument(help="Rank bundles written by ORACLE_CAPTURE or capture_rank (oracle.integrations.megatron.hook), or folders of them.")],
    out: Out,
    recipe: Annotated[str, typer.Option(help="Recipe whose HF names to map to (qwen3, qwen3-vl).")],
    hf_config: Annotated[str | None, typer.Option(metavar="PATH", help="Override: a Hugging Face config.json (or its model folder, or a model id in the local Hugging Face / ModelScope cache) checked against the run's (ORACLE_CAPTURE records the run's own: needed only where none was recorded, msprobe imports and older hooks).")] = None,
    dp_rank: Annotated[int | None, typer.Option(min=0, help="DP rank whose batch (all its micro-batches) is the step (default: 0 before finalize, all DP ranks after).")] = None,
    labels_shift: Annotated[str | None, typer.Option(help="pre-rolled (label t is token t+1, Megatron / ms-swift) or unshifted; default: as the hook recorded it.")] = None,
    overwrite: Overwrite = False,
) -> None:  # fmt: skip
    """Merge per-rank Megatron / MindSpeed captures (TP shards, PP stages, partial sums) into one capture.

    Example: oracle merge /shared/h20-step/pre --recipe qwen3-vl --out h20.cap
    """
    from oracle.bundle.store import Bundle
    from oracle.integrations.megatron.config_source import resolve
    from oracle.integrations.megatron.merge import merge_ranks
    from oracle.recipe import load_hf_config

    config = load_hf_config(resolve(hf_config)[0]) if hf_config is not None else None
    merge_ranks(ranks, out, recipe=recipe, hf_config=config, dp_rank=dp_rank, labels_shift=labels_shift, overwrite=overwrite)
    b = Bundle(out)
    meg = b.get("megatron")
    vocab = meg["vocab"]
    typer.echo(f"merged {len(meg['merged_from'])} rank(s) (TP {meg['tp_size']}, PP {meg['pp_size']}, DP ranks {meg['dp_ranks']}, "
               f"{meg['stage']}) into {len(b.names('grads'))} HF gradients -> {out}")  # fmt: skip
    padding = "no padding" if vocab.get("padding") == "none" else f"padded; true {vocab['true'] or 'unknown'}"
    typer.echo(f"  vocabulary: {vocab['padded']} rows ({padding}), kept whole for the replay")
    if (meg.get("labels") or {}).get("labels_shift"):
        typer.echo(f"  labels: {meg['labels']['labels_shift']} ({meg['labels']['how']})")
    if meg.get("packing"):
        typer.echo(f"  {meg['packing']}")
    if not b.names("inputs"):
        typer.echo("  no inputs recorded: this capture can be scored against an oracle of the same step, not replayed")
    for wmsg in meg["warnings"]:
        typer.echo(f"  warning: {wmsg}")


@app.command("rank-view")
@user_errors
def rank_view_cmd(
    oracle: Annotated[Path, typer.Argument(help="Oracle of a merged Megatron capture.")],
    rank: Annotated[int, typer.Option(min=0, help="TP rank.")] = 0,
    pp_rank: Annotated[int, typer.Option(min=0, help="Pipeline stage.")] = 0,
    tp: Annotated[int | None, typer.Option(min=1, help="Override the recorded tensor-parallel size.")] = None,
    sp: Annotated[bool | None, typer.Option("--sp/--no-sp", help="Override the recorded sequence parallel.")] = None,
    stage: Annotated[Stage | None, typer.Option(help="Override the recorded stage.")] = None,
    per_token_loss: Annotated[bool | None, typer.Option("--per-token-loss/--no-per-token-loss", help="Override the recorded per-token loss flag of Megatron (with it the pre-finalize grads are of the loss SUM).")] = None,
    seq_len_padded: Annotated[int | None, typer.Option(help="Padded sequence length the run used (default: next multiple of TP).")] = None,
    compare: Annotated[list[Path] | None, typer.Option("--compare", help="Rank bundles of that rank to compare with the view.")] = None,
    logs: Annotated[list[Path] | None, typer.Option("--log", help="Gradient-norm logs printed on that rank: which is closer to the truth.")] = None,
    name: Names = None,
    occurrence: Occurrence = None,
    json_out: JsonOut = None,
) -> None:  # fmt: skip
    """What one Megatron rank held, from the oracle and its recorded layout; compared with rank captures or norm logs.

    Example: oracle rank-view truth.bundle --rank 0 --log h20_rank0.log --log 910b_rank0.log --name H20 --name 910B
    """
    from oracle.api.rankview import RankViewOptions, rank_view

    opts = RankViewOptions(oracle=oracle, rank=rank, pp_rank=pp_rank, tp=tp, sp=sp, stage=stage.value if stage else None,
                           per_token_loss=per_token_loss, seq_len_padded=seq_len_padded, compare=tuple(compare or ()),
                           logs=tuple(logs or ()), names=name, occurrence=occurrence, json_out=json_out)  # fmt: skip
    rank_view(opts, echo=typer.echo, warn=lambda s: typer.echo(s, err=True))


@app.command("import-msprobe")
@user_errors
def import_msprobe(
    dump: Annotated[Path, typer.Argument(help="msprobe dump directory (DUMP, DUMP/step0 or DUMP/step0/rank0).")],
    out: Out,
    step: Annotated[int | None, typer.Option(help="Which step{N} of the dump.")] = None,
    rank: Annotated[int | None, typer.Option(help="Which rank{N} of the dump (the global rank).")] = None,
    precision: Annotated[RunPrecision, typer.Option(help="Precision the dumped run used.")] = RunPrecision.unknown,
    megatron_tp: Annotated[int | None, typer.Option(min=1, help="The dump is a Megatron rank of this TP size: write a rank bundle for `oracle merge`.")] = None,
    megatron_dp: Annotated[int, typer.Option(min=1, help="Megatron: the run's DP size (the dump names only the global rank).")] = 1,
    megatron_pp: Annotated[int, typer.Option(min=1, help="Megatron: the run's PP size (layers assumed evenly split over stages).")] = 1,
    sp: Annotated[bool, typer.Option("--sp/--no-sp", help="Megatron: sequence parallel was on.")] = False,
    stage: Annotated[Stage, typer.Option(help="Megatron: when the gradients were dumped.")] = Stage.pre_finalize,
    overwrite: Overwrite = False,
) -> None:  # fmt: skip
    """Turn an msprobe dump's parameter gradients into a capture (tensors) or norm-only bundle (statistics).

    Example: oracle import-msprobe dump/step0/rank0 --out 910b.bundle --precision bf16
    """
    from oracle.bundle.store import Bundle
    from oracle.integrations.msprobe import import_dump

    import_dump(dump, out, step=step, rank=rank, precision=precision.value, megatron_tp=megatron_tp, megatron_rank=rank,
                megatron_dp=megatron_dp, megatron_pp=megatron_pp, sequence_parallel=sp, stage=stage.value,
                overwrite=overwrite)  # fmt: skip
    b = Bundle(out)
    what = f"{len(b.names('grads'))} gradient tensors" if b.kind == "capture" else f"{len(b.get('norms'))} gradient norms"
    typer.echo(f"imported {what} from {dump} -> {out}")
    meg = b.get("megatron")
    if meg:
        c = meg["coords"]
        typer.echo(f"  Megatron rank {c['rank']}: TP {c['tp_rank']}/{c['tp_size']}, DP {c['dp_rank']}/{c['dp_size']}, "
                   f"PP {c['pp_rank']}/{c['pp_size']}; no inputs: its merge can be scored, not replayed")  # fmt: skip


@app.command()
@user_errors
def demo(
    dir: Annotated[Path, typer.Option("--dir", help="Where the demo's bundles, judge work folder and report go.")] = Path("oracle-demo"),
    ensemble: Annotated[int, typer.Option(min=1, help="Members of the emulated noise band.")] = 4,
    bug: Annotated[bool, typer.Option("--bug", help="Plant a bug in the fp32 run (its backward into one decoder layer's MLP scaled by 1.02): the report names it.")] = False,
) -> None:  # fmt: skip
    """The main job on the embedded tiny Qwen3-VL: capture amp-bf16 and fp32, then oracle judge on the two (fp64 truth, bands, score, the four answers).

    Example: oracle demo

    Example: oracle demo --bug
    """
    from oracle.pipeline.demo import run_demo

    typer.echo(run_demo(dir, ensemble=ensemble, bug=bug, echo=lambda s: typer.echo(s, err=True)))


@app.command()
@user_errors
def explain(
    capture: Annotated[Path, typer.Argument(help="Capture bundle recorded with --modules.")],
    module: Annotated[str, typer.Option("--module", help="Recorded module to explain (as `oracle score LOCAL` names it).")],
    fmt: Annotated[
        str | None, typer.Option("--as", help="Format the op classes run in (fp32, bf16, fp16); default: the capture's.")
    ] = None,
    json_out: JsonOut = None,
    report: Annotated[Path | None, typer.Option(help="Write explain.json and an HTML page here.")] = None,
) -> None:
    """Which op class (matmul, attention, softmax, normalisation, ...) reproduces the device's error in one module.

    Example: oracle explain 910b.bundle --module model.language_model.layers.2.mlp
    """
    from oracle.api.score import explain as api_explain

    api_explain(capture, module, fmt=fmt, json_out=json_out, report=report, echo=typer.echo)


from oracle.integrations.megatron import doctor as _doctor  # noqa: E402  (stdlib only: the help texts both doctors share)

_DH = _doctor.OPTION_HELP


@app.command(help=f"{_doctor.SUMMARY}\n\n{_doctor.WHERE}\n\n" + "\n\n".join(
    f"Example: {cmd.format(prog='oracle doctor')}   ({what})" for what, cmd in _doctor.EXAMPLES), epilog=_doctor.EXIT_TEXT)  # fmt: skip
@user_errors
def doctor(
    dir: Annotated[str | None, typer.Argument(metavar="DIR", help=_doctor.ARGUMENT_HELP)] = None,
    hf_config: Annotated[str | None, typer.Option(metavar="PATH", help=_DH["hf_config"])] = None,
    tp: Annotated[int, typer.Option(min=1, help=_DH["tp"])] = 1,
    pp: Annotated[int, typer.Option(min=1, help=_DH["pp"])] = 1,
    tokens: Annotated[int, typer.Option(min=1, help=_DH["tokens"])] = 4096,
    no_sp: Annotated[bool, typer.Option("--no-sp", help=_DH["no_sp"])] = False,
    images: Annotated[int, typer.Option(min=0, help=_DH["images"])] = 4,
    image_side: Annotated[int, typer.Option(min=1, help=_DH["image_side"])] = 448,
    ranks: Annotated[int, typer.Option(min=1, help=_DH["ranks"])] = 8,
) -> None:  # fmt: skip
    from oracle.integrations.megatron.doctor import diagnose

    layout = {"tp": tp, "pp": pp, "tokens": tokens, "sequence_parallel": not no_sp, "images": images, "image_side": image_side,
              "ranks": ranks}  # fmt: skip
    try:
        code, text = diagnose(dir, hf_config=hf_config, layout=layout)
    except ValueError as e:
        raise UsageError(str(e)) from None
    typer.echo(text)
    raise typer.Exit(code=code)


# Every command's --help ends with its exit codes, from the one table (oracle.errors.EXIT_CODES): the doctor's are
# its own (EXIT_TEXT, shared with `python -m oracle doctor --help`); every other command's are the table but the doctor's 12.
COMMAND_EPILOG = "Exit codes: " + "; ".join(f"{k} {v}" for k, v in EXIT_CODES.items() if k != _doctor.NOT_READY)
for _info in app.registered_commands:
    if _info.epilog is None:
        _info.epilog = COMMAND_EPILOG

_PROGRAM = False  # True when this process is the command line (main), not an app invoked inside another program


def main() -> None:  # console script entry point
    global _PROGRAM
    _PROGRAM = True  # the streamed replay may restart this process with huge pages (pages.restart)
    try:
        app()
    except KeyboardInterrupt:  # outside a command (start-up, argument parsing)
        print(INTERRUPTED, file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    sys.exit(main())
