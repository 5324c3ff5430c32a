import json

import pytest
from helpers import rewrite_grads
from typer.testing import CliRunner

from cli import app

runner = CliRunner()


def _ok(args):
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r


def test_capture_replay_score_through_the_cli(tmp_path, band):
    _ok(["capture", "--out", tmp_path / "amp", "--precision", "amp-bf16"])
    r = _ok(["capture", "--out", tmp_path / "fp32"])
    assert "captured qwen3-vl (embedded:tiny-qwen3-vl) on cpu in fp32" in r.output
    r = _ok(["replay", tmp_path / "fp32", "--dtype", "fp64", "--out", tmp_path / "oracle"])
    assert "certificate: finite-difference residual" in r.output
    r = _ok(["score", tmp_path / "oracle", tmp_path / "amp", tmp_path / "fp32", "--band", band("amp-bf16"), "--band", band("fp32"),
             "--json", tmp_path / "s.json", "--report", tmp_path / "rep", "--name", "A", "--name", "B"])  # fmt: skip
    assert "verdict:" in r.output and "A (amp-bf16): within noise" in r.output and "B (fp32)" in r.output
    s = json.loads((tmp_path / "s.json").read_text())
    assert set(s) >= {"oracle", "captures"} and s["oracle"]["certificate"]["fd_rel_residual"] < 1e-6
    cap = s["captures"][0]
    assert set(cap) >= {"name", "path", "precision", "params", "layers", "verdict"}
    assert set(cap["params"][0]) >= {"name", "rel_l2", "cosine", "norm_ratio", "max_abs", "nonfinite", "excess", "class"}
    assert set(cap["verdict"]) >= {"class", "excess", "onset", "global_scale"}
    for f in ("index.html", "errors.png", "params.csv", "score.json"):
        assert (tmp_path / "rep" / f).stat().st_size > 100
    assert "data:image/png;base64," in (tmp_path / "rep" / "index.html").read_text()


@pytest.mark.parametrize(
    "args,code,message",
    [
        (["score", "{tmp}/missing", "{tmp}/missing2"], 3, "does not exist"),
        (["replay", "{tmp}/missing", "--out", "{tmp}/o"], 3, "does not exist"),
        (["capture", "--out", "{tmp}/c", "--model", "no-such-model"], 7, "neither an embedded model"),
        (["capture", "--out", "{tmp}/c", "--sample", "{tmp}/none.jsonl"], 3, "sample file"),
        (["capture", "--out", "{tmp}/c", "--loss-reduction", "avg"], 2, "--loss-reduction"),
        (["capture", "--out", "{tmp}/c", "--precision", "fp64"], 2, "--precision"),
        (["capture", "--out", "{tmp}/c", "--device", "cuda"], 7, "no CUDA device"),
        (["replay", "{tmp}/missing", "--out", "{tmp}/o", "--dtype", "fp8"], 2, "--dtype"),
        (["replay", "{tmp}/missing", "--out", "{tmp}/o", "--ensemble", "0"], 2, "--ensemble"),
        (["import-log", "{tmp}/l.log", "--out", "{tmp}/o", "--precision", "fp12"], 2, "--precision"),
        (["compare-logs", "{tmp}/a.log"], 2, "exactly two"),
        (["score", "{tmp}/missing", "--tol", "bf16:wrong=1"], 2, "--tol"),
        (["score", "{tmp}/missing", "--tol", "fp9:floor=1e-3"], 2, "unknown precision 'fp9'"),
        (["score", "{tmp}/missing", "--tol", "fp32:floor=-1"], 2, "positive"),
        (["score", "{tmp}/missing", "--margin", "-3"], 2, "--margin"),
        (["score", "{tmp}/missing", "--margin", "1e400"], 2, "not a finite number"),
        (["score", "{tmp}/missing", "--margin", "nan"], 2, "--margin"),
    ],
)
def test_user_mistakes_get_a_message_and_an_exit_code_not_a_traceback(tmp_path, args, code, message, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a host with CUDA
    (tmp_path / "a.log").write_text("x")
    r = runner.invoke(app, [a.format(tmp=tmp_path) for a in args])
    assert r.exit_code == code, r.output
    assert message in r.output and "Traceback" not in r.output


def test_mismatched_and_existing_bundles(tmp_path, fp32_capture, oracle_bundle, source, sample):
    from oracle.capture.steps import capture_recipe_step

    other = dict(sample, messages=[*sample["messages"][:-1], {"role": "assistant", "content": "No."}])
    capture_recipe_step(source, other, str(tmp_path / "other"))
    r = runner.invoke(app, ["score", oracle_bundle, str(tmp_path / "other")])
    assert r.exit_code == 5 and "inputs/input_ids: values differ" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["replay", fp32_capture, "--out", oracle_bundle])
    assert r.exit_code == 6 and "--overwrite" in r.output
    r = runner.invoke(app, ["score", fp32_capture, fp32_capture])
    assert r.exit_code == 4 and "needs an oracle" in r.output


def test_damaged_capture_is_refused(tmp_path, fp32_capture, oracle_bundle):
    bad = rewrite_grads(fp32_capture, str(tmp_path / "bad"), lambda n, g: g)
    f = tmp_path / "bad" / "grads.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x55
    f.write_bytes(bytes(raw))
    r = runner.invoke(app, ["score", oracle_bundle, bad])
    assert r.exit_code == 4 and "damaged" in r.output and "Traceback" not in r.output


def test_help_documents_exit_codes():
    """`oracle --help` and every command's --help end with the exit codes (the doctor's its own: 12 not ready)."""
    import typer.main

    r = runner.invoke(app, ["--help"])
    flat = " ".join(r.output.replace("│", " ").split())  # the words, wherever the terminal's width wrapped them
    assert r.exit_code == 0 and "Exit codes" in flat and "different steps" in flat, flat[-600:]
    for name in typer.main.get_command(app).commands:
        r = runner.invoke(app, [name, "--help"], terminal_width=2000)
        flat = " ".join(r.output.replace("│", " ").split())
        assert r.exit_code == 0 and "Exit codes: 0 " in flat and "2 usage error" in flat, (name, flat[-300:])
        assert ("12 not ready" in flat) == (name == "doctor"), name


def test_readme_exit_code_table_is_the_codes_table():
    """README's exit-code table lists exactly oracle.errors.EXIT_CODES, in order, with the same words."""
    import re
    from pathlib import Path

    from oracle.errors import EXIT_CODES

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| (.+?) \|$", section, flags=re.M)
    assert [(int(c), m) for c, m in rows] == list(EXIT_CODES.items())
