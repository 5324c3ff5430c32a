"""Hints name real options: every ``--option`` in the engine's messages is an option of one of our
commands or a flag of the named tool it tells the user to run; what a command prints names options of
that command (tests/integration/test_demo.py checks the demo's and the judge report's output)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers import command_options, options_not_on_their_command

ROOT = Path(__file__).resolve().parents[2]
# flags of other tools our messages tell the user to run, each with its tool
OTHER_TOOLS = {
    "--no-index": "pip", "--no-deps": "pip", "--nproc-per-node": "torchrun", "--nnodes": "torchrun",
    "--data_seed": "swift megatron sft", "--use_hf": "swift megatron sft",
    "--calculate-per-token-loss": "Megatron-LM", "--layers": "benchmarks/bound_calibration.py",
    "--version": "cc (oracle/precision/rounding.py asks the compiler its version for its cache key)",
}  # fmt: skip


def test_every_option_a_message_names_exists():
    """Each --option in a string of oracle/ is one of our commands' or a listed tool's (a made-up flag fails)."""
    ours = set().union(*command_options().values())
    unknown = []
    for path in sorted((ROOT / "oracle").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for m in re.finditer(r"(?<![\w-])--[a-z][a-z0-9_-]*", node.value):
                    if m.group() not in ours and m.group() not in OTHER_TOOLS:
                        unknown.append(f"{path.relative_to(ROOT)}: {m.group()}")
    assert not unknown, unknown


def test_a_hint_is_checked_against_the_command_it_names():
    """The checker itself: the old `... more layers in --json / --report` is refused for judge and accepted for
    score; `capture ... --modules` is checked against capture."""
    old = "  ... 3 more layers in --json / --report"
    assert options_not_on_their_command(old, "judge") == [f"judge has no --json: {old.strip()}", f"judge has no --report: {old.strip()}"]
    assert options_not_on_their_command(old, "score") == []
    assert options_not_on_their_command("capture both with `oracle capture --modules` (e.g. --modules all)", "judge") == []
    assert options_not_on_their_command("capture with --modulez", "judge") == ["capture has no --modulez: capture with --modulez"]
