"""Structural errors, each with its own class and CLI exit code.

A numerical disagreement is never an error: it is data in a score report. These classes are for
inputs we cannot work with at all (missing files, damaged bundles, bundles of different steps, ...).
The CLI maps each class to the exit code below; README.md documents the same table.
"""

from __future__ import annotations

import errno


class OracleError(Exception):
    """Base class: a user-facing problem with a message that names the object and the fix."""

    exit_code = 1


class UsageError(OracleError):
    """Options that contradict each other or a value outside its choices (typer's own usage errors
    exit 2 as well)."""

    exit_code = 2


class InputNotFound(OracleError):
    exit_code = 3


class BundleError(OracleError):
    """A bundle that is malformed, damaged (hash mismatch) or of an unsupported schema."""

    exit_code = 4


class MismatchError(OracleError):
    """Bundles that do not describe the same step (different inputs or weights), or rank captures of
    different runs (stage, loss convention, run config, weights)."""

    exit_code = 5


class OutputExists(OracleError):
    """An output that exists, or a streaming work folder ``.OUT.partial`` that is not this run's (left untouched)."""

    exit_code = 6


class RecipeError(OracleError):
    """Unknown recipe, or a model/sample the recipe cannot build or prepare."""

    exit_code = 7


class LogParseError(OracleError):
    """A norm log that cannot be read as the user asked (no matching lines, ambiguous duplicates)."""

    exit_code = 8


class OutputError(OracleError):
    """An output that cannot be written: permission, disk full, read-only file system."""

    exit_code = 9


class NotReplayable(OracleError):
    """A capture without inputs (msprobe imports and their merges, norm logs): it can be scored
    against an oracle of the same step, never replayed into one."""

    exit_code = 10


class RankError(OracleError):
    """A rank of a distributed replay died or stopped answering; the run was stopped (resumable)."""

    exit_code = 11


EXIT_CODES = {
    0: "success (done; a disagreement found is reported, not an error)",
    1: "internal error (a bug: please report it with the last frames printed)",
    UsageError.exit_code: "usage error (unknown option, missing argument, contradicting options)",
    InputNotFound.exit_code: "an input path does not exist or cannot be read",
    BundleError.exit_code: "a bundle is malformed, damaged (hash mismatch) or of an unsupported schema",
    MismatchError.exit_code: "bundles describe different steps (inputs or weights differ), or rank captures are not one run",
    OutputExists.exit_code: "the output directory exists (capture, replay, merge, import-log, import-msprobe: pass --overwrite to replace it; judge and demo keep --out as their own work folder, resumed, or refuse another untouched), or a work folder beside it is not this run's",
    RecipeError.exit_code: "unknown recipe, or a model directory / sample the recipe cannot use",
    LogParseError.exit_code: "a norm log could not be parsed as asked",
    OutputError.exit_code: "an output cannot be written (permission, disk full, read-only file system)",
    NotReplayable.exit_code: "the bundle holds no inputs; it can only be scored against an oracle of the same step",
    RankError.exit_code: "a rank of a distributed replay died or stopped answering (the run stopped; rerun to resume)",
    12: "oracle doctor: not ready to capture (the start-up hook will not fire, megatron-core is missing, no capture folder named, it cannot be written or hold the capture, or ORACLE_CAPTURE_STEP / ORACLE_CAPTURE_MODULES is malformed)",
    130: "interrupted (Ctrl-C); the same command resumes where its stages and streamed replays left off",
}


def problem_lines(problems: list[str], limit: int) -> str:
    """The offenders of one error message, one per indented line: the first ``limit``, then how many more."""
    more = f"\n  ... and {len(problems) - limit} more" if len(problems) > limit else ""
    return "\n  " + "\n  ".join(problems[:limit]) + more


_OUTPUT_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG}


def from_os_error(e: OSError) -> OracleError:
    """An OSError that reached the CLI as the user-facing error it is: a full or read-only disk is an
    output problem (9); anything else (missing, not permitted, not a directory) a path problem (3)."""
    where = f"{e.filename}: " if e.filename else ""
    cls = OutputError if e.errno in _OUTPUT_ERRNOS else InputNotFound
    return cls(f"{where}{e.strerror or e}")
