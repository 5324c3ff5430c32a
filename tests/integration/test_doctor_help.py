"""`oracle doctor --help` (typer, the CPU host) and `python -m oracle doctor --help` (argparse, the training
environment) say the same: the same options with the same help texts, the same examples."""

from __future__ import annotations

import os
import subprocess
import sys

from typer.testing import CliRunner

from cli import app

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _flat(s: str) -> str:
    return " ".join(s.replace("│", " ").split())


def test_both_doctor_helps_list_the_same_options_help_texts_and_examples(tmp_path):
    """Every option of the typer command, with its help text, and both examples, appear in both helps."""
    typer_help = _flat(CliRunner().invoke(app, ["doctor", "--help"], terminal_width=400).stdout)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "oracle", "doctor", "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    plain = _flat(r.stdout)
    import typer.main

    cmd = typer.main.get_command(app).commands["doctor"]
    for p in cmd.params:
        if p.param_type_name == "option":
            assert p.opts[0] in plain and _flat(p.help) in plain and _flat(p.help) in typer_help, p.opts
        else:
            assert "[DIR]" in plain and "[DIR]" in typer_help and _flat(p.help) in plain
    for cmd_line in ("ORACLE_CAPTURE=/shared/h20-step {} doctor", "{} doctor /shared/h20-step --hf-config config.json --tp 8 --tokens 65536"):
        assert cmd_line.format("oracle") in typer_help and cmd_line.format("python -m oracle") in plain, (typer_help, plain)


def test_the_console_script_runs_doctor_where_typer_is_missing(tmp_path):
    """`oracle doctor` (the console script's entry, oracle.cli.app:main) in an environment without typer, as the
    training environment is: the doctor runs under its own name (exit 0 for --help, 2 for a bad value); any other
    command says the command line needs the host install (exit 2) and that `oracle doctor` runs here."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    entry = "import sys; sys.modules['typer'] = None; sys.argv = ['oracle', *sys.argv[1:]]; from oracle.cli.app import main; main()"

    def oracle(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", entry, *argv], capture_output=True, text=True, env=env, cwd=tmp_path)

    r = oracle("doctor", "--help")
    assert r.returncode == 0 and r.stdout.startswith("Usage: oracle doctor [OPTIONS] [DIR]\n"), r.stdout + r.stderr
    r = oracle("doctor", "--tp", "eight")
    assert r.returncode == 2 and "Try 'oracle doctor --help' for help." in r.stderr and "Traceback" not in r.stderr
    r = oracle("judge", "--help")
    assert r.returncode == 2 and 'pip install "oracle-fp64[host]"; here, `oracle doctor` runs' in r.stderr, r.stderr
