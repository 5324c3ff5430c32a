"""The ``oracle`` command line: parse, call the library, print, exit. No numerics here.

Exit codes (also in README.md and ``oracle --help``):
  0 success (disagreement is reported, not an error)   1 internal error
  2 usage error                                        3 input path not found
  4 bundle malformed / damaged / unsupported schema    5 bundles describe different steps
  6 output exists (pass --overwrite)                   7 recipe / model / sample problem
  8 norm log cannot be parsed as asked
"""

from __future__ import annotations

import functools
import sys
import traceback
from collections.abc import Callable
from enum import Enum
from pathlib import Path

import typer

from oracle.errors import EXIT_CODES, OracleError

EPILOG = "Exit codes: " + "; ".join(f"{k} {v}" for k, v in EXIT_CODES.items())
app = typer.Typer(
    help="Float64 ground truth for cross-hardware training precision: capture a step, replay it in "
    "float64 on CPU, score every device's gradients against it.",
    epilog=EPILOG,
    pretty_exceptions_show_locals=False,
    no_args_is_help=True,
    add_completion=False,
)


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    amp_bf16 = "amp-bf16"
    amp_fp16 = "amp-fp16"


class ReplayDtype(str, Enum):
    fp64 = "fp64"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    amp_bf16 = "amp-bf16"
    amp_fp16 = "amp-fp16"


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"
    npu = "npu"


def user_errors(fn: Callable) -> Callable:
    """OracleError -> message on stderr and its exit code; anything else -> exit 1, no locals."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OracleError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(code=e.exit_code) from None
        except typer.Exit:
            raise
        except Exception as e:  # a bug: say so, show where, never dump tensors
            typer.echo(f"internal error: {type(e).__name__}: {e}", err=True)
            typer.echo("".join(traceback.format_exception(e, limit=-3)), err=True)
            raise typer.Exit(code=1) from None

    return wrapper


def _check_device(device: str) -> None:
    import torch

    from oracle.errors import RecipeError

    if device == "cuda" and not torch.cuda.is_available():
        raise RecipeError("--device cuda: no CUDA device is visible to torch")
    if device == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            raise RecipeError("--device npu: torch_npu is not installed") from None


@app.command()
@user_errors
def capture(
    out: Path = typer.Option(..., "--out", help="Bundle directory to write."),
    model: str = typer.Option("tiny-qwen3-vl", help="Embedded model name, or a local Hugging Face model directory."),
    sample: Path | None = typer.Option(None, help="ms-swift style .jsonl; default: the embedded sample."),
    index: int = typer.Option(0, help="Line of --sample to use."),
    device: Device = typer.Option(Device.cpu, help="Device the step runs on."),
    precision: Precision = typer.Option(Precision.fp32, help="Precision policy of the step."),
    loss_reduction: str = typer.Option("mean", help="'mean' over loss tokens, or 'sum' (Megatron per-token loss)."),
    seed: int = typer.Option(0, help="Seed set before the step."),
    modules: str | None = typer.Option(
        None,
        help="Record module boundaries: presets (all, layers, sublayers, vit, mergers, embeddings, head; comma-separated) or a regex.",
    ),
    budget_mb: float | None = typer.Option(None, help="Disk budget for module boundaries, MiB."),
    overwrite: bool = typer.Option(False, help="Replace an existing bundle at --out."),
) -> None:
    """Take one training step of one sample and write a capture bundle."""
    from oracle import recipe
    from oracle.errors import RecipeError
    from oracle.samples import read_sample
    from oracle.steps import capture_recipe_step

    if loss_reduction not in ("mean", "sum"):
        raise RecipeError("--loss-reduction must be 'mean' or 'sum'")
    _check_device(device.value)
    r = recipe.for_model(model)
    src = r.load(model)
    smp = read_sample(str(sample), index) if sample else r.default_sample()
    capture_recipe_step(src, smp, str(out), precision=precision.value, device=device.value,
                        reduction=loss_reduction, seed=seed, overwrite=overwrite, modules=modules,
                        module_budget_mb=budget_mb, echo=typer.echo)  # fmt: skip
    from oracle.bundle import Bundle

    b = Bundle(out)
    typer.echo(f"captured {r.name} ({src.origin}) on {device.value} in {precision.value}: loss "
               f"{b.get('loss')['value']:.8g} over {b.get('loss')['num_tokens']} tokens, "
               f"{len(b.names('grads'))} gradients -> {out}")  # fmt: skip


@app.command()
@user_errors
def replay(
    capture: Path = typer.Argument(..., help="Capture bundle to replay."),
    out: Path = typer.Option(..., "--out", help="Bundle directory to write."),
    dtype: ReplayDtype = typer.Option(ReplayDtype.fp64, help="fp64: the oracle; others: an emulated run (noise band)."),
    ensemble: int = typer.Option(1, help="Emulated runs only: members (1 round-to-nearest + K-1 jittered)."),
    verify: bool | None = typer.Option(None, "--verify/--no-verify", help="Finite-difference certificate (default: when cheap)."),
    directions: int = typer.Option(3, help="Random directions for --verify."),
    local: bool = typer.Option(False, "--local", help="Teacher-forced per-module replay (needs a capture with --modules)."),
    modules: str | None = typer.Option(None, help="--local: regex selecting recorded modules."),
    workers: int = typer.Option(1, help="--local: parallel processes."),
    members: int = typer.Option(2, help="--local: emulated members for the expected local error."),
    overwrite: bool = typer.Option(False, help="Replace an existing bundle at --out."),
) -> None:
    """Recompute the captured step on CPU in float64 (the oracle) or an emulated low precision."""
    from oracle.bundle import Bundle
    from oracle.replay import replay as do_replay

    if local:
        from oracle.errors import RecipeError
        from oracle.local import replay_local

        if dtype.value != "fp64":
            raise RecipeError("--local replays each module in fp64 (and emulates the capture's precision itself)")
        replay_local(capture, out, modules=modules, members=members, workers=workers, overwrite=overwrite)
        typer.echo(f"replayed {len(Bundle(out).get('local'))} modules locally from {capture} -> {out}")
        return

    mode = "auto" if verify is None else ("on" if verify else "off")
    do_replay(capture, out, dtype=dtype.value, ensemble=ensemble, verify=mode, directions=directions,
              overwrite=overwrite, progress=ensemble > 1)  # fmt: skip
    b = Bundle(out)
    msg = f"replayed {capture} in {dtype.value}: loss {b.get('loss')['value']:.12g} ({b.get('seconds')} s) -> {out}"
    cert = b.get("certificate")
    if cert:
        msg += f"\n  certificate: finite-difference residual {cert['fd_rel_residual']:.1e} over {cert['directions']} directions"
    if b.get("numerics"):
        msg += f"\n  float64 throughout: {b.get('numerics')['promotions']} lower-precision casts in the model code promoted"
    typer.echo(msg)


@app.command()
@user_errors
def score(
    oracle: Path = typer.Argument(..., help="Oracle bundle (from `oracle replay --dtype fp64`)."),
    captures: list[Path] | None = typer.Argument(None, help="Capture bundles to score."),
    band: list[Path] = typer.Option([], "--band", help="Emulation bundle(s) giving the noise band."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the full result as JSON."),
    report: Path | None = typer.Option(None, "--report", help="Write PNG, CSV, JSON and an HTML page here."),
    margin: float = typer.Option(3.0, help="Excess over the band above which a layer is beyond noise."),
    tol: list[str] = typer.Option([], "--tol", help="Override the tolerance table: PRECISION:expected=VALUE."),
    name: list[str] = typer.Option([], "--name", help="Display names for the captures, in order."),
    top: int = typer.Option(8, help="Worst parameters shown per capture."),
    pattern: str | None = typer.Option(None, help="Logs: regex with (?P<name>..) and (?P<value>..) groups."),
    occurrence: int | None = typer.Option(None, help="Logs: take the K-th print of each name (0-based)."),
    step: str | None = typer.Option(None, help="Logs: keep lines whose (?P<step>..) group equals this."),
    rank: str | None = typer.Option(None, help="Logs: keep lines whose (?P<rank>..) group equals this."),
) -> None:
    """Score captures against the oracle, per parameter and per layer, with a verdict.

    Given two gradient-norm log files instead (no oracle), compare them side by side.
    """
    from oracle.errors import RecipeError

    captures = captures or []
    if oracle.is_file():
        return _score_logs([oracle, *captures], name, json_out, pattern, occurrence, step, rank)
    from oracle.bundle import Bundle

    first = Bundle(oracle)
    if first.kind == "local":
        return _score_local(first, margin, json_out)
    if not captures:
        raise RecipeError("give at least one capture to score against the oracle")
    from oracle.render import render
    from oracle.report import _clean, write_json, write_report
    from oracle.score import score as do_score
    from oracle.tolerance import parse_overrides

    if name and len(name) != len(captures):
        raise RecipeError(f"--name given {len(name)} times for {len(captures)} captures")
    overrides = parse_overrides(tol)
    result = do_score(oracle, captures, band_paths=band, margin=margin, tol_overrides=overrides, names=name or None)
    typer.echo(render(result, top=top))
    if json_out:
        write_json(_clean(result), json_out)
        typer.echo(f"json: {json_out}")
    if report:
        typer.echo(f"report: {write_report(result, report)}")


def _score_local(bundle, margin, json_out) -> None:
    import json

    from oracle.local import render_local, score_local

    res = score_local(bundle, margin=margin)
    typer.echo(render_local(res))
    if json_out:
        json_out.write_text(json.dumps(res, indent=1, default=str))
        typer.echo(f"json: {json_out}")


def _score_logs(paths, names, json_out, pattern, occurrence, step, rank) -> None:
    import json

    from oracle import normlog
    from oracle.errors import LogParseError

    if len(paths) != 2:
        raise LogParseError(f"comparing norm logs takes exactly two files, got {len(paths)}")
    labels = tuple(names) if names else tuple(p.stem for p in paths)
    if len(labels) != 2 or labels[0] == labels[1]:
        raise LogParseError("give two distinct --name values for the two logs")
    logs = [normlog.parse(p, pattern=pattern, occurrence=occurrence, step=step, rank=rank) for p in paths]
    result = normlog.compare(logs[0], logs[1], labels)
    typer.echo(normlog.render_compare(result))
    if json_out:
        json_out.write_text(json.dumps(result, indent=1))
        typer.echo(f"json: {json_out}")


@app.command("import-log")
@user_errors
def import_log(
    log: Path = typer.Argument(..., help="Gradient-norm log."),
    out: Path = typer.Option(..., "--out", help="Norm-only bundle to write."),
    precision: str = typer.Option("unknown", help="Precision the logged run used (selects the tolerance)."),
    pattern: str | None = typer.Option(None, help="Regex with (?P<name>..) and (?P<value>..) groups."),
    occurrence: int | None = typer.Option(None, help="Take the K-th print of each name (0-based)."),
    step: str | None = typer.Option(None, help="Keep lines whose (?P<step>..) group equals this."),
    rank: str | None = typer.Option(None, help="Keep lines whose (?P<rank>..) group equals this."),
    overwrite: bool = typer.Option(False, help="Replace an existing bundle at --out."),
) -> None:
    """Turn a gradient-norm log into a norm-only capture bundle that `oracle score` accepts."""
    from oracle import normlog

    parsed = normlog.parse(log, pattern=pattern, occurrence=occurrence, step=step, rank=rank)
    normlog.write_norm_bundle(parsed, out, precision=precision, overwrite=overwrite)
    typer.echo(f"imported {len(parsed.norms)} gradient norms from {log} -> {out}")


@app.command()
@user_errors
def merge(
    ranks: list[Path] = typer.Argument(..., help="Rank bundles written by oracle.megatron.capture_rank, or folders of them."),
    out: Path = typer.Option(..., "--out", help="Merged capture bundle to write."),
    recipe: str = typer.Option(..., help="Recipe whose HF names to map to (qwen3, qwen3-vl)."),
    hf_config: Path = typer.Option(..., help="The model's Hugging Face config.json."),
    overwrite: bool = typer.Option(False, help="Replace an existing bundle at --out."),
) -> None:
    """Merge per-rank Megatron / MindSpeed captures (TP shards, partial sums) into one capture."""
    from oracle.megatron.merge import merge_ranks
    from oracle.recipe import load_hf_config

    merge_ranks(ranks, out, recipe=recipe, hf_config=load_hf_config(hf_config), overwrite=overwrite)
    from oracle.bundle import Bundle

    b = Bundle(out)
    meg = b.get("megatron")
    typer.echo(f"merged {len(meg['merged_from'])} TP rank(s) ({meg['stage']}) into {len(b.names('grads'))} HF gradients -> {out}")
    for wmsg in meg["warnings"]:
        typer.echo(f"  warning: {wmsg}")


@app.command("rank-view")
@user_errors
def rank_view_cmd(
    oracle: Path = typer.Argument(..., help="Oracle of a merged Megatron capture."),
    tp: int = typer.Option(..., help="Tensor-parallel size of the run to view."),
    rank: int = typer.Option(0, help="TP rank."),
    sp: bool = typer.Option(False, "--sp/--no-sp", help="Sequence parallel on."),
    stage: str = typer.Option("pre-finalize", help="pre-finalize or post-finalize."),
    per_token_loss: bool = typer.Option(
        True,
        "--per-token-loss/--no-per-token-loss",
        help="calculate_per_token_loss (ms-swift's default): pre-finalize grads are of the loss SUM.",
    ),
    seq_len_padded: int | None = typer.Option(None, help="Padded sequence length the run used (default: next multiple of TP)."),
    compare: list[Path] = typer.Option([], "--compare", help="Rank bundles of that rank to compare with the view."),
    logs: list[Path] = typer.Option([], "--log", help="Gradient-norm logs printed on that rank: which is closer to the truth."),
    name: list[str] = typer.Option([], "--name", help="Display names for the logs."),
    occurrence: int | None = typer.Option(None, help="Logs: take the K-th print of each name (0-based)."),
) -> None:
    """What one Megatron rank should have held, from the oracle; compared with rank captures or norm logs."""
    from oracle.errors import RecipeError
    from oracle.megatron.rankview import compare_logs, compare_rank, rank_view

    if stage not in ("pre-finalize", "post-finalize"):
        raise RecipeError("--stage must be pre-finalize or post-finalize")
    view = rank_view(
        oracle,
        tp_size=tp,
        rank=rank,
        sequence_parallel=sp,
        stage=stage,
        calculate_per_token_loss=per_token_loss,
        seq_len_padded=seq_len_padded,
    )
    typer.echo(f"rank view: TP={tp}{' SP' if sp else ''} rank {rank} {stage}: {len(view)} gradients")
    for b in compare:
        errs = compare_rank(view, b)
        worst = max(errs, key=errs.get)
        typer.echo(f"  {b}: {len(errs)} gradients, max rel L2 {errs[worst]:.2e} ({worst})")
    if logs:
        from oracle import normlog

        parsed = [normlog.parse(p, occurrence=occurrence) for p in logs]
        labels = name or [p.stem for p in logs]
        typer.echo(compare_logs(view, parsed, labels))


@app.command("import-msprobe")
@user_errors
def import_msprobe(
    dump: Path = typer.Argument(..., help="msprobe dump directory (DUMP, DUMP/step0 or DUMP/step0/rank0)."),
    out: Path = typer.Option(..., "--out", help="Capture (or norm-only) bundle to write."),
    step: int | None = typer.Option(None, help="Which step{N} of the dump."),
    rank: int | None = typer.Option(None, help="Which rank{N} of the dump."),
    precision: str = typer.Option("unknown", help="Precision the dumped run used."),
    megatron_tp: int | None = typer.Option(
        None, help="The dump is a Megatron rank of this TP size: write a rank bundle for `oracle merge`."
    ),
    sp: bool = typer.Option(False, "--sp/--no-sp", help="Megatron: sequence parallel was on."),
    stage: str = typer.Option("pre-finalize", help="Megatron: when the gradients were dumped."),
    overwrite: bool = typer.Option(False, help="Replace an existing bundle at --out."),
) -> None:
    """Turn an msprobe dump's parameter gradients into a capture (tensors) or norm-only bundle (statistics)."""
    from oracle.bundle import Bundle
    from oracle.msprobe import import_dump

    import_dump(dump, out, step=step, rank=rank, precision=precision, megatron_tp=megatron_tp,
                megatron_rank=rank, sequence_parallel=sp, stage=stage, overwrite=overwrite)  # fmt: skip
    b = Bundle(out)
    what = f"{len(b.names('grads'))} gradient tensors" if b.kind == "capture" else f"{len(b.get('norms'))} gradient norms"
    typer.echo(f"imported {what} from {dump} -> {out}")


@app.command()
@user_errors
def demo(
    dir: Path = typer.Option(Path("oracle-demo"), "--dir", help="Where the demo's bundles and report go."),
    ensemble: int = typer.Option(4, help="Members of the emulated noise band."),
) -> None:
    """The main job on the embedded tiny Qwen3-VL: capture amp-bf16 and fp32, replay fp64, score."""
    from oracle.demo import run_demo

    typer.echo(run_demo(dir, ensemble=ensemble, echo=typer.echo))


from typing import Annotated  # noqa: E402  (the explain command below is written in typer's Annotated style)


@app.command()
@user_errors
def explain(
    capture: Annotated[Path, typer.Argument(help="Capture bundle recorded with --modules.")],
    module: Annotated[str, typer.Option("--module", help="Recorded module to explain (as `oracle score LOCAL` names it).")],
    fmt: Annotated[
        str | None, typer.Option("--as", help="Format the op classes run in (fp32, bf16, fp16); default: the capture's.")
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the result as JSON.")] = None,
    report: Annotated[Path | None, typer.Option("--report", help="Write explain.json and an HTML page here.")] = None,
) -> None:
    """Which op class (matmul, attention, softmax, normalisation, ...) reproduces the device's error in one module."""
    from oracle.explain import explain as do_explain
    from oracle.render import render_explain
    from oracle.report import _clean, write_explain_report, write_json

    res = do_explain(capture, module, fmt=fmt)
    typer.echo(render_explain(res))
    if json_out:
        write_json(_clean(res), json_out)
        typer.echo(f"json: {json_out}")
    if report:
        typer.echo(f"report: {write_explain_report(res, report)}")


def main() -> None:  # console script entry point
    app()


if __name__ == "__main__":
    sys.exit(main())
