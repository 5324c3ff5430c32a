"""The messages a new user meets first, each pointing at the fix (issue: the user's recipe, followable
as written): logs given as runs, a folder given as a log, the same log twice, a --recipe typo with
bundles, the capture root instead of its pre/ folder, Ctrl-C, merge's and every command's --help."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data"
H20, NPU = DATA / "h20_rank0_grad_norms.log", DATA / "910b_rank0_grad_norms.log"


def _err(args: list[str]):
    res = CliRunner().invoke(app, args)
    assert "Traceback" not in res.output
    return res


def test_logs_given_as_runs_point_to_log_a_and_log_b(tmp_path):
    """Two logs as positional runs, with or without --out: exit 2 naming --log-a/--log-b, not "give --out"."""
    for extra in ([], ["--out", str(tmp_path / "w")]):
        res = _err(["judge", str(H20), str(NPU), *extra])
        assert res.exit_code == 2, res.output
        assert f"run A: {H20} is a file, neither a capture bundle nor a folder of rank bundles" in res.stderr
        assert "looks like a grad-norm log: give the logs as --log-a A.log --log-b B.log" in res.stderr
        assert "--out" not in res.stderr
    res = _err(["judge", str(H20)])  # one log alone: the same hint
    assert res.exit_code == 2 and "--log-a A.log" in res.stderr


def test_a_folder_given_as_a_log_is_named_as_a_folder(tmp_path):
    """--log-b DIR: exit 2, "is a folder", the logs inside listed; not "does not exist"."""
    d = tmp_path / "910b-logs"
    d.mkdir()
    (d / "rank0.log").write_text(NPU.read_text())
    res = _err(["judge", "--log-a", str(H20), "--log-b", str(d)])
    assert res.exit_code == 2, res.output
    assert f"--log-b {d} is a folder: give the grad-norm log file itself (it holds rank0.log)" in res.stderr
    res = _err(["judge", "--log-a", str(H20), "--log-b", str(tmp_path / "missing.log")])
    assert res.exit_code == 3 and "--log-b" in res.stderr and "does not exist" in res.stderr


def test_an_absent_or_empty_run_folder_points_at_the_start_up_hook(fp32_capture, tmp_path):
    """A run folder ORACLE_CAPTURE never wrote (a training process without oracle's start-up hook captures
    nothing and says nothing): absent, exit 3; empty, exit 2; each names the run and says to run
    `oracle doctor` in the training environment."""
    res = _err(["judge", str(tmp_path / "h20" / "pre"), str(fp32_capture), "--out", str(tmp_path / "j")])
    assert res.exit_code == 3 and f"run A: {tmp_path / 'h20' / 'pre'} does not exist" in res.stderr, res.output
    assert "start-up hook" in res.stderr and "python -m oracle doctor DIR" in res.stderr
    (tmp_path / "empty").mkdir()
    res = _err(["judge", str(fp32_capture), str(tmp_path / "empty"), "--out", str(tmp_path / "j")])
    assert res.exit_code == 2 and "run B: " in res.stderr and "holds no capture bundle (manifest.json) and no rank bundles" in res.stderr
    assert "python -m oracle doctor DIR" in res.stderr and not (tmp_path / "j").exists()


def test_a_run_judged_against_itself_and_a_manifest_given_as_a_run_are_refused(fp32_capture, tmp_path):
    """`oracle judge A A` (however spelled) would tie with itself: exit 2 naming it; a bundle's manifest.json given
    as a run is named as one, with its folder to give (not "a grad-norm log"); nothing written."""
    res = _err(["judge", str(fp32_capture), str(fp32_capture) + "/", "--out", str(tmp_path / "j")])
    assert res.exit_code == 2, res.output
    assert f"runs A and B are the same folder ({fp32_capture}): judge compares two runs" in res.stderr
    res = _err(["judge", str(Path(fp32_capture) / "manifest.json"), str(fp32_capture), "--out", str(tmp_path / "j")])
    assert res.exit_code == 2, res.output
    assert f"run A: {Path(fp32_capture) / 'manifest.json'} is a bundle's manifest file: give the bundle's folder, {fp32_capture}" in res.stderr
    assert "grad-norm log" not in res.stderr and not (tmp_path / "j").exists()


def test_a_file_given_as_a_run_is_named_for_what_it_is(fp32_capture, tmp_path):
    """A bundle's tensor file, a judge report's judge.json, a --sample .jsonl, a text without norms given as a run:
    exit 2 naming what it is and what to give (none called a grad-norm log); replay names the bundle of a file in it."""
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "judge.json").write_text('{"schema_version": 1, "kind": "oracle-judge"}')
    (tmp_path / "train.jsonl").write_text('{"messages": []}\n')
    (tmp_path / "notes.txt").write_text("to do: capture both runs\n")
    said = {
        Path(fp32_capture) / "grads.safetensors": f"It is a file of the capture bundle {fp32_capture}: give the bundle's folder, {fp32_capture}",
        tmp_path / "report" / "judge.json": "It is a file of a report (oracle judge's or oracle score's), not a run",
        tmp_path / "train.jsonl": "It is a JSON-lines file (samples?): samples are captured with oracle capture --sample FILE.jsonl",
        tmp_path / "notes.txt": "It is a text file without a gradient norm: give a capture bundle (a folder with manifest.json)",
    }
    for path, what in said.items():
        res = _err(["judge", str(path), str(fp32_capture), "--out", str(tmp_path / "j")])
        assert res.exit_code == 2, res.output
        assert f"run A: {path} is a file, neither a capture bundle nor a folder of rank bundles. {what}" in res.stderr
        assert "grad-norm log" not in res.stderr and not (tmp_path / "j").exists()
    res = _err(["replay", str(Path(fp32_capture) / "manifest.json"), "--out", str(tmp_path / "r")])
    assert res.exit_code == 4, res.output
    assert f"it is a file of the bundle {fp32_capture}; give that folder" in res.stderr


def test_capture_index_without_a_sample_is_a_usage_error(tmp_path):
    """--index 1 without --sample (the embedded sample is one): exit 2 saying to give --sample; nothing written."""
    res = _err(["capture", "--out", str(tmp_path / "c"), "--index", "1"])
    assert res.exit_code == 2, res.output
    assert "--index 1 picks a line of --sample; without --sample the recipe's one embedded sample is captured" in res.stderr
    assert not (tmp_path / "c").exists()


def test_the_same_log_twice_is_named_and_two_rank0_logs_get_their_folders_names(tmp_path):
    """The same file twice: "are the same file", exit 2. Two runs' rank0.log: named by their folders, the answer given."""
    res = _err(["judge", "--log-a", str(H20), "--log-b", str(H20)])
    assert res.exit_code == 2 and "--log-a and --log-b are the same file" in res.stderr, res.output
    res = _err(["compare-logs", str(H20), str(H20)])
    assert res.exit_code == 2 and "the first log and the second log are the same file" in res.stderr, res.output
    for run, src in (("h20", H20), ("910b", NPU)):
        (tmp_path / run).mkdir()
        (tmp_path / run / "rank0.log").write_text(src.read_text())
    res = _err(["judge", "--log-a", str(tmp_path / "h20" / "rank0.log"), "--log-b", str(tmp_path / "910b" / "rank0.log")])
    assert res.exit_code == 0, res.output
    assert "from the logs alone (h20 vs 910b, no capture)" in res.stdout
    res = _err(["compare-logs", str(tmp_path / "h20" / "rank0.log"), str(tmp_path / "910b" / "rank0.log")])
    assert res.exit_code == 0 and "910b/h20" in res.stdout, res.output


def test_a_recipe_typo_with_bundles_is_an_error(fp32_capture, amp_capture, tmp_path):
    """--recipe qwen3vl with two capture bundles: exit 7 with the known recipes; another recipe than the bundles': exit 2."""
    res = _err(["judge", fp32_capture, amp_capture, "--recipe", "qwen3vl", "--out", str(tmp_path / "w")])
    assert res.exit_code == 7, res.output
    assert "no recipe named 'qwen3vl'; known recipes: qwen3, qwen3-vl" in res.stderr
    res = _err(["judge", fp32_capture, amp_capture, "--recipe", "qwen3", "--dry-run"])
    assert res.exit_code == 2 and "is a qwen3-vl capture: drop --recipe" in res.stderr, res.output
    assert not (tmp_path / "w").exists()


def test_the_capture_root_suggests_its_pre_folder(tmp_path):
    """A folder holding pre/ and post/ (what ORACLE_CAPTURE writes): the suggestion is DIR/pre, as the README's recipe."""
    root = tmp_path / "h20-step"
    for stage in ("post", "pre"):
        (root / stage / "rank00000").mkdir(parents=True)
        (root / stage / "rank00000" / "manifest.json").write_text("{}")
    res = _err(["judge", str(root), str(root), "--recipe", "qwen3-vl", "--out", str(tmp_path / "w")])
    assert res.exit_code == 2, res.output
    assert f"holds several capture folders (post, pre); give one of them, e.g. {root / 'pre'} (pre: the gradients before" in res.stderr
    readme = (REPO / "README.md").read_text()
    assert "/shared/h20-step/pre /shared/910b-step/pre" in readme


def test_ctrl_c_exits_130_with_one_line(tmp_path):
    """SIGINT inside a command (the demo, after its first capture): exit 130, one line on stderr, no traceback."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    # SIGINT's default action restored in the child: a test run started in the background by a
    # non-interactive shell (CI) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt
    p = subprocess.Popen([sys.executable, "-m", "oracle", "demo", "--dir", str(tmp_path / "demo")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    for line in p.stderr:
        if line.startswith("captured"):
            break
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1].startswith("interrupted (Ctrl-C), exit 130: rerun the same command to resume"), err


def _commands() -> list[str]:
    res = CliRunner().invoke(app, ["--help"])
    return re.findall(r"^│ (\w[\w-]+)\s", res.stdout, re.M)


def test_every_command_help_has_an_example_and_no_type_label_on_flags():
    """`oracle CMD --help`: an "Example: oracle CMD" line for every command; flags carry no <bool> label."""
    cmds = _commands()
    assert {"judge", "capture", "replay", "score", "merge", "demo", "doctor", "explain"} <= set(cmds), cmds
    for cmd in cmds:
        out = CliRunner().invoke(app, [cmd, "--help"], terminal_width=200).stdout
        assert f"Example: oracle {cmd}" in out, (cmd, out)
        assert "<bool>" not in out, (cmd, out)


def test_no_help_text_is_cut_on_an_80_column_terminal():
    """At 80 columns rich cuts a word longer than its help column with an ellipsis: no command's help text
    (the right-hand column) may hold such a word (a module path or a Megatron flag name did)."""
    for cmd in _commands():
        out = CliRunner().invoke(app, [cmd, "--help"], terminal_width=80).stdout
        cut = [ln for ln in out.splitlines() if ln.rstrip().endswith("… │")]
        assert not cut, (cmd, cut)


def test_judge_help_says_the_runs_may_be_left_out_and_merge_help_needs_no_hf_config_for_qwen3_vl():
    judge = " ".join(CliRunner().invoke(app, ["judge", "--help"], terminal_width=200).stdout.split())
    assert "Leave both out for the logs-only answer" in judge.replace("│", "").replace("  ", " ") or "may be left out" in judge
    merge = " ".join(CliRunner().invoke(app, ["merge", "--help"], terminal_width=200).stdout.replace("│", " ").split())
    assert "needed for qwen3-vl" not in merge
    assert "ORACLE_CAPTURE records the run's own" in merge


def test_stage_estimates_follow_the_machine_speed_seen_so_far(monkeypatch):
    """A stage that took 2x its estimate: the next stage's estimate and the ETA grow sqrt(2)x (eta.py), within 2x of real."""
    from oracle.pipeline import stages

    clock = iter([100.0, 120.0, 120.0, 140.0])
    monkeypatch.setattr(stages.time, "perf_counter", lambda: next(clock))
    said: list[str] = []
    p = stages.Progress(2, {"truth": {"seconds": 10.0}, "band-fp32": {"seconds": 10.0}}, echo=said.append)
    p.end("truth", p.start("truth", "replay"), reused=False)
    p.start("band-fp32", "emulate")
    assert said[0].endswith("(this stage ~10 s, ETA 20 s)"), said
    assert said[1].endswith("done in 20.0 s (estimated 10 s); ETA 14 s"), said
    assert said[2].endswith("(this stage ~14 s, ETA 14 s)"), said


def test_judge_estimates_count_each_packed_samples_attention_calls(fp32_capture, tmp_path):
    """A packed step's replay runs one attention kernel call per sample (text) or image (ViT) and attention
    module; on a small model their dispatch, not their FLOPs, is the time (a 96-sample tiny step: 20x the
    truth's time of one sample, benchmarks/judge_eta.py). The planner counts them, and the judge's truth and
    band estimates carry TRUTH_CALL_PROBES / the member's per-call probes for each, in probes of this machine."""
    from helpers import packed_vl_capture

    from oracle.bundle.store import Bundle
    from oracle.pipeline import eta
    from oracle.pipeline import judge as judge_mod
    from oracle.replay.streaming.plan import plan

    packed = packed_vl_capture(tmp_path)  # 3 samples, one image each
    cfg = Bundle(fp32_capture).manifest["recipe"]["config"]
    per_sample = cfg["text_config"]["num_hidden_layers"] + cfg["vision_config"]["depth"]
    one, three = (plan(Bundle(c), "fp64", streamed=False) for c in (fp32_capture, packed))
    assert (one["attention_calls"], three["attention_calls"]) == (per_sample, 3 * per_sample)
    twin = shutil.copytree(packed, tmp_path / "twin")  # the same step in another folder (one folder as both runs is refused)
    j = judge_mod.Judge(packed, twin, out=tmp_path / "j", names=["a", "b"], ensemble=2)
    est = j.estimates([Bundle(packed), Bundle(packed)])
    # the fixed costs: the probes', and each pass's per-parameter work (plan.PARAMETER_SECONDS: not a GEMM's)
    import torch

    from oracle.replay.streaming.plan import PARAMETER_SECONDS

    assert three["parameter_seconds"] == pytest.approx(three["parameters"] * PARAMETER_SECONDS[torch.float64])
    member = plan(Bundle(packed), "fp32", streamed=False)["parameter_seconds"]
    assert member == pytest.approx(three["parameters"] * PARAMETER_SECONDS[torch.float32])
    assert member < three["parameter_seconds"]
    # streamed, the token embedding's rows no input id reads are holes (embedding.write_dense): hashed, not written
    from oracle.replay.streaming.plan import HOLE_SECONDS

    streamed = plan(Bundle(packed), "fp64")
    V, H = cfg["text_config"]["vocab_size"], cfg["text_config"]["hidden_size"]
    holes = (V - torch.unique(Bundle(packed).load("inputs", "input_ids")).numel()) * H
    assert streamed["embedding_holes"] == holes > 0 and three["embedding_holes"] == 0
    assert streamed["parameter_seconds"] == pytest.approx((three["parameters"] - holes) * PARAMETER_SECONDS[torch.float64]
                                                          + holes * HOLE_SECONDS)  # fmt: skip
    fixed = est["truth"]["seconds"] - est["truth"]["gemm_seconds"] - three["parameter_seconds"]
    assert fixed / j.probe_s == pytest.approx(eta.TRUTH_PROBES + eta.TRUTH_CALL_PROBES * 3 * per_sample)
    band = est["band-fp32"]["seconds"] - est["band-fp32"]["gemm_seconds"] - 2 * member
    assert band / j.probe_s == pytest.approx(2 * (eta.MEMBER_PROBES["fp32"] + eta.MEMBER_CALL_PROBES["fp32"] * 3 * per_sample))


def test_judge_prices_the_truth_and_the_bands_from_one_interleaved_gemm_probe(fp32_capture, amp_capture, monkeypatch):
    """Each plan probes its dtype's GEMM rate at its own moment; the judge prices every pass's GEMMs from one
    probe of both dtypes in turn (plan.gemm_rates), so a load that comes and goes between two plans no longer
    moves the band's price against the truth's (8B dry runs on a quiet machine: 1.22-1.28x, was 1.00-1.43x)."""
    import torch

    from oracle.bundle.store import Bundle
    from oracle.pipeline import judge as judge_mod
    from oracle.replay.streaming import plan as plan_mod

    rates = plan_mod.gemm_rates((torch.float64, torch.float32), rounds=2)
    assert set(rates) == {torch.float64, torch.float32} and min(rates.values()) > 0
    monkeypatch.setattr(plan_mod, "gemm_rates", lambda dtypes, **k: {torch.float64: 1e9, torch.float32: 4e9})
    j = judge_mod.Judge(fp32_capture, amp_capture, out=".", ensemble=2)
    est = j.estimates([Bundle(fp32_capture), Bundle(amp_capture)])
    base, member = (plan_mod.plan(Bundle(fp32_capture), d, streamed=False) for d in ("fp64", "fp32"))
    assert est["truth"]["gemm_seconds"] == pytest.approx(base["total_flops"] / (1e9 * base["efficiency"]))
    assert est["band-fp32"]["gemm_seconds"] == pytest.approx(2 * member["total_flops"] / (4e9 * member["efficiency"]))


def test_judge_estimates_hold_a_replays_fixed_cost_in_probes_of_this_machine(fp32_capture, amp_capture, monkeypatch):
    """A tiny model's replay stages are estimated at their fixed cost: TRUTH_PROBES / member_probes() times the
    planner's wall time on this capture now (a slower planner, a longer estimate), not the < 1 s of their FLOPs."""
    from oracle.bundle.store import Bundle
    from oracle.pipeline import judge as judge_mod
    from oracle.pipeline.eta import TRUTH_PROBES, member_probes

    j = judge_mod.Judge(fp32_capture, amp_capture, out=".", ensemble=2)
    caps = [Bundle(fp32_capture), Bundle(amp_capture)]
    est = j.estimates(caps)
    assert est["truth"]["seconds"] >= TRUTH_PROBES * j.probe_s > 0 and est["band-fp32"]["seconds"] >= 2 * member_probes("fp32") * j.probe_s
    assert est["score"]["seconds"] > 0 and est["report"]["seconds"] > 0
    from oracle.replay.streaming import plan as plan_mod

    slow = plan_mod.plan

    def slower(*a, **k):  # the machine got 1 s slower per planner run
        import time as _t

        _t.sleep(1.0)
        return slow(*a, **k)

    monkeypatch.setattr(plan_mod, "plan", slower)
    est2 = j.estimates(caps)
    assert j.probe_s >= 1.0 and est2["truth"]["seconds"] >= TRUTH_PROBES * 1.0 and est2["band-fp32"]["seconds"] >= 2 * member_probes("fp32")

def test_merge_hf_config_takes_a_model_id_from_the_local_cache(tmp_path, monkeypatch):
    """merge --hf-config Qwen/Qwen3-VL-8B-Instruct: looked up offline in $HF_HOME/hub; not there: exit 3 naming
    where it looked (the same resolver as oracle doctor's, tests/unit/test_doctor.py)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    res = _err(["merge", str(tmp_path / "none"), "--out", str(tmp_path / "m"), "--recipe", "qwen3-vl",
                "--hf-config", "Qwen/Qwen3-VL-8B-Instruct"])  # fmt: skip
    assert res.exit_code == 3, res.output
    assert f"looked in Qwen/Qwen3-VL-8B-Instruct, {tmp_path / 'hf' / 'hub' / 'models--Qwen--Qwen3-VL-8B-Instruct'}" in res.stderr
    snap = tmp_path / "hf" / "hub" / "models--Qwen--Qwen3-VL-8B-Instruct" / "snapshots" / "r1"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("[1]")  # found: then read as the config (a list is refused, exit 7)
    res = _err(["merge", str(tmp_path / "none"), "--out", str(tmp_path / "m"), "--recipe", "qwen3-vl",
                "--hf-config", "Qwen/Qwen3-VL-8B-Instruct"])  # fmt: skip
    assert res.exit_code == 7 and f"{snap / 'config.json'} does not hold a JSON object" in res.stderr, res.output


@pytest.mark.parametrize("pattern", ["(", "(a+)+$"])
def test_a_module_regex_that_cannot_be_used_is_exit_7(tmp_path, pattern):
    """`oracle capture --modules '('` (not a regex) and `'(a+)+$'` (backtracks): exit 7 naming the presets (issue 41:
    both were a traceback), nothing written."""
    res = _err(["capture", "--out", str(tmp_path / "c"), "--modules", pattern])
    assert res.exit_code == 7 and "--modules" in res.output and "presets" in res.output, res.output
    assert not (tmp_path / "c").exists()


def test_a_bad_capture_step_is_said_on_one_line(monkeypatch, capsys):
    """ORACLE_CAPTURE_STEP=abc: one line on stderr, from the first training call through the end of the process
    (issue 41: the exit report said it a second time)."""
    from oracle.integrations.megatron import autocapture

    monkeypatch.setenv("ORACLE_CAPTURE", "somewhere")
    monkeypatch.setenv("ORACLE_CAPTURE_STEP", "abc")
    for k, v in (("calls", 0), ("patched", True), ("written", 0), ("why", None), ("bad_step", False)):
        monkeypatch.setitem(autocapture._state, k, v)
    step = autocapture._wrap(lambda *a, **k: "result")
    assert step(forward_only=False) == "result"
    autocapture._report_at_exit()
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "ORACLE_CAPTURE_STEP" in err, err
