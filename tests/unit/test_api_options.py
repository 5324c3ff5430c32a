"""The options objects own the rules between options: a library caller is refused exactly as a CLI user."""

from __future__ import annotations

import json

import pytest
from helpers import invoke

from oracle.api.capture import CaptureOptions, sample_lines
from oracle.api.judge import JudgeOptions
from oracle.errors import UsageError
from oracle.replay.options import ReplayOptions

RULES = [
    (dict(capture="c"), "give --out"),
    (dict(capture="c", out="o", local=True, max_memory="4G"), "drop --max-memory"),
    (dict(capture="c", out="o", local=True, dtype="bf16"), "drop --dtype"),
    (dict(capture="c", local=True, dry_run=True), "drop --dry-run or --local"),
    (dict(capture="c", out="o", modules="layers"), "apply to --local replays only"),
    (dict(capture="c", out="o", workers=2), "apply to --local replays only"),
    (dict(capture="c", out="o", dtype="fp8"), "--dtype 'fp8'"),
    (dict(capture="c", out="o", split="rows"), "--split 'rows'"),
    (dict(capture="c", out="o", ensemble=0), "--ensemble 0"),
    (dict(capture="c", out="o", threads=True), "--threads True"),
    (dict(capture="c", out="o", max_memory="lots"), "--max-memory 'lots'"),
    (dict(capture="c", out="o", replace_work="all"), "replace_work 'all'"),
    # how ranks share the replay: refused by the options, so a dry run and --nproc's launcher refuse them too
    (dict(capture="c", out="o", ensemble=2), "--ensemble applies to emulated low-precision replays"),
    (dict(capture="c", dry_run=True, ensemble=2), "--ensemble applies to emulated low-precision replays"),
    (dict(capture="c", out="o", dtype="bf16", split="tokens"), "--split tokens splits the float64 oracle"),
    (dict(capture="c", out="o", nproc=2, max_memory="4G"), "the tensor-parallel float64 replay (2 ranks) runs in memory"),
    (dict(capture="c", dry_run=True, nproc=2, max_memory="4G"), "runs in memory: drop --max-memory"),
    (dict(capture="c", out="o", nproc=2, split="tokens", verify=True), "the token-parallel float64 replay (2 ranks) has no certificate"),
]


@pytest.mark.parametrize("kw,message", RULES)
def test_replay_options_refuse_what_the_command_refuses(kw, message):
    """Each compatibility rule of replay, raised by ReplayOptions itself with the message naming the option."""
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ReplayOptions(**kw)


def test_the_cli_says_the_options_message(tmp_path):
    """The CLI shows ReplayOptions' own words (exit 2), no second copy of the rule."""
    r = invoke("replay", tmp_path / "cap", "--out", tmp_path / "o", "--local", "--max-memory", "4G")
    assert r.exit_code == 2 and "drop --max-memory" in r.output


def test_replay_options_travel_as_json_and_come_back_equal():
    """for_rank is JSON-serialisable and from_dict rebuilds the same options (one process, the rank's threads)."""
    o = ReplayOptions(capture="c", out="o", dtype="amp-bf16", ensemble=3, max_memory="2G", verify=False, nproc=4, threads=8,
                      replace_work="any-ours")  # fmt: skip
    d = json.loads(json.dumps(o.for_rank(2)))
    back = ReplayOptions.from_dict(d)
    assert back.nproc == 1 and back.threads == 2 and back.budget == 2 << 30 and back.replace_work == "any-ours"
    assert (back.capture, back.dtype, back.ensemble, back.verify_mode) == ("c", "amp-bf16", 3, "off")
    with pytest.raises(UsageError, match="unknown surprise"):
        ReplayOptions.from_dict({**d, "surprise": 1})


def test_a_bands_ranks_are_no_more_than_its_members():
    """--nproc's processes: an emulated band's members go to them whole, so min(--nproc, members); a float64 replay
    (split by tensors or tokens) and a local replay use every --nproc."""
    assert ReplayOptions(capture="c", out="o", dtype="amp-bf16", ensemble=2, nproc=4).processes() == 2
    assert ReplayOptions(capture="c", out="o", dtype="bf16", ensemble=3, nproc=2).processes() == 2
    assert ReplayOptions(capture="c", out="o", dtype="bf16", nproc=2).processes() == 1
    assert ReplayOptions(capture="c", out="o", nproc=4).processes() == 4
    assert ReplayOptions(capture="c", out="o", nproc=4, split="tokens", max_memory="4G").processes() == 4
    assert ReplayOptions(capture="c", out="o", local=True, nproc=3).processes() == 3


def test_the_thread_policy_is_the_options():
    """--threads when given, else every core of this process."""
    import os

    assert ReplayOptions(capture="c", out="o", threads=3).cpu_threads() == 3
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert ReplayOptions(capture="c", out="o").cpu_threads() == cores


def test_judge_options_rules(fp32_capture, amp_capture, tmp_path):
    """No runs and no logs, one log, no --out, three runs: each refused with its reason."""
    with pytest.raises(UsageError, match="or --log-a and --log-b"):
        JudgeOptions()
    a, b = fp32_capture, amp_capture
    with pytest.raises(UsageError, match="two runs"):
        JudgeOptions(runs=(a, b, a), out=tmp_path / "o")
    with pytest.raises(UsageError, match="give --out DIR"):
        JudgeOptions(runs=(a, b))
    with pytest.raises(UsageError, match="give both --log-a and --log-b"):
        JudgeOptions(runs=(a, b), out=tmp_path / "o", log_a=tmp_path / "x.log")
    assert JudgeOptions(runs=(a, b), dry_run=True).runs == (str(a), str(b))
    assert JudgeOptions(log_a="x.log", log_b="y.log").logs_only


def test_capture_sample_lines():
    """--index N, a list, --pack K from N; negative lines, two lists and packing without --sample refused."""
    assert sample_lines("3", None) == [3]
    assert sample_lines("0,3,7", None) == [0, 3, 7]
    assert sample_lines("4", 3) == [4, 5, 6]
    for index, pack, message in (("x", None, "expected a line number"), ("0,1", 2, "not both lists"), ("-1", None, "start at 0")):
        with pytest.raises(UsageError, match=message):
            sample_lines(index, pack)
    with pytest.raises(UsageError, match="packing needs --sample"):
        CaptureOptions(out="o", index="0,1")


def test_judges_band_has_two_members_by_default_wherever_judge_is_called():
    """One default (score/tolerance.py BAND_MEMBERS, why in its comment) for the API, the pipeline and the CLI."""
    import dataclasses
    import inspect

    from oracle.cli.app import judge as judge_command
    from oracle.pipeline.judge import Judge
    from oracle.score.tolerance import BAND_MEMBERS

    assert BAND_MEMBERS == 2
    assert {f.name: f.default for f in dataclasses.fields(JudgeOptions)}["ensemble"] == 2
    assert inspect.signature(Judge.__init__).parameters["ensemble"].default == 2
    assert inspect.signature(judge_command).parameters["ensemble"].default == 2
