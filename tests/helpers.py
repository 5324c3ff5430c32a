"""Test helpers: the command line run in process (`invoke`) or as a process (`run_oracle`), a free
port, rewriting a bundle's gradients (planting errors after the fact), the packed tiny captures
several files share, a token-parallel oracle's checks (within the bound, bitwise), a launcher's
rank by pid, a streamed replay's budget derived from the process it runs in."""

from __future__ import annotations

import functools
import multiprocessing
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from oracle.bundle.store import Bundle, BundleWriter
from oracle.parallel.launch import free_port  # noqa: F401  (the one free-port helper of the tests)

ROOT = Path(__file__).resolve().parents[1]
ORACLE = [sys.executable, "-m", "oracle"]  # the command line as torchrun and --nproc start it
# How long a test waits for a moment in another process (a journal entry, a rank started, an exit) before it
# calls it a hang: a guard, never a speed bound. What is waited for comes in seconds on a quiet machine; at
# load 12 on 2 cores it took minutes (issue 42), so no pass depends on the machine's speed.
HANG_S = 900
# What a test's helper processes import once, in their fork server (fork_server()); a name that fails to import
# there is left to the child. Only imports: no intra-op thread pool started, no process group, no model.
PRELOAD = ["torch", "transformers", "megatron.core", "megatron.core.models.gpt", "megatron.core.distributed",
           "megatron.core.pipeline_parallel", "oracle.recipe", "oracle.integrations.megatron.hook", "megatron_peer"]  # fmt: skip


def fork_server() -> str:
    """The start method of a test's helper processes (megatron-core ranks, msprobe dumps): "forkserver", whose
    server imported PRELOAD once per test process, so a child starts without paying them (a spawned rank spent
    about 6 s of CPU on torch and megatron-core's imports, some 50 per suite run: issue 42). A child sees the
    server's environment, not its caller's: pass what it needs (run_peer passes os.environ)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return "forkserver"


def invoke(*args):
    """The CLI in this process (typer's CliRunner); a user mistake never shows a traceback or exit 1."""
    from typer.testing import CliRunner

    from cli import app

    res = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in res.output and "internal error" not in res.output, res.output
    return res


def run_oracle(args, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """`python -m oracle ARGS` as its own process, from the repository root, output captured as text."""
    return subprocess.run([*ORACLE, *map(str, args)], cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, **kw)  # fmt: skip


@functools.cache
def stream_budget(capture: str, *extra: str, room_gib: float = 1.0) -> str:
    """The ``--max-memory`` of a test's streamed replay of ``capture`` (``extra``: its --dtype / --ensemble),
    derived from the process it runs in, never a constant that fits one torch build (issue 42: 1G fitted CPU
    torch 2.13 and was refused under 2.14.1+cu130, whose process is larger): the floor a dry run at 1M names
    (a fresh ``python -m oracle`` process's resident set plus the largest unit, x 1.1), plus ``room_gib``
    for the process growing through the run. The plan streams either way: the tiny model's units are
    smaller than any budget's room."""
    res = run_oracle(["replay", capture, "--dry-run", "--max-memory", "1M", *extra], timeout=HANG_S)
    floor = re.search(r"raise it to at least ([\d.]+)G", res.stdout + res.stderr)
    assert res.returncode == 2 and floor, res.stdout + res.stderr
    return f"{float(floor[1]) + room_gib:.1f}G"


def rewrite_grads(src: str, dst: str, fn: Callable[[str, torch.Tensor], torch.Tensor | None],
                  extra: dict[str, torch.Tensor] | None = None) -> str:  # fmt: skip
    """Copy bundle ``src`` to ``dst`` with every gradient g of parameter n replaced by fn(n, g)
    (dropped where fn returns None), plus the gradients in ``extra``."""
    b = Bundle(src)
    with BundleWriter(dst, b.kind) as w:
        w.manifest.update({k: v for k, v in b.manifest.items() if k not in ("tensors", "schema_version", "kind")})
        for group in b.groups():
            tensors = b.load_group(group)
            if group == "grads":
                tensors = {n: h for n, g in tensors.items() if (h := fn(n, g)) is not None} | (extra or {})
            w.add(group, tensors)
    return dst


def assert_split_within(split: Bundle, one: Bundle, ranks: int, bound: float) -> None:
    """A token-parallel oracle against the single process: every token on exactly one rank, the
    loss and every gradient within ``bound`` relative (float64 throughout), untouched rows exactly
    zero, the same backward order."""
    import pytest

    rec = split.get("token_parallel")
    assert split.kind == "oracle" and rec["ranks"] == ranks and rec["bound_rel"] == bound
    covered = sorted(i for spans in rec["rows"] for a, b in spans for i in range(a, b))
    assert covered == list(range(rec["tokens"]))  # every token on exactly one rank
    assert split.get("loss")["value"] == pytest.approx(one.get("loss")["value"], rel=bound, abs=0)
    gs, go = split.load_group("grads"), one.load_group("grads")
    assert set(gs) == set(go)
    assert all(gs[n].dtype == torch.float64 for n in gs)
    worst = {n: float((gs[n] - go[n]).norm() / go[n].norm()) for n in go if go[n].norm() > 0}
    assert max(worst.values()) <= bound, max(worst.items(), key=lambda kv: kv[1])
    assert all(torch.equal(gs[n], go[n]) for n in go if go[n].norm() == 0)  # untouched rows stay exactly zero
    assert split.get("backward_order") == one.get("backward_order")


def assert_bitwise(a: Bundle, b: Bundle) -> None:
    """Two oracles of one step bitwise equal: the same gradients' bits and the same loss."""
    ga, gb = a.load_group("grads"), b.load_group("grads")
    assert set(ga) == set(gb)
    assert [n for n in ga if not torch.equal(ga[n], gb[n])] == []
    assert a.get("loss")["value"] == b.get("loss")["value"]


def two_sample_qwen3_capture(root) -> str:
    """The tiny Qwen3 (text), two samples packed, captured in fp32 under ``root / "cap"``."""
    import copy

    from oracle import recipe as recipes
    from oracle.capture.steps import capture_recipe_step

    r = recipes.get("qwen3")
    s = r.default_sample()
    s2 = copy.deepcopy(s)
    s2["messages"][-1]["content"] = "Another answer, long enough to cross the ranks' blocks."
    return capture_recipe_step(r.load("tiny-qwen3"), [s, s2], str(root / "cap"), precision="fp32")


def packed_vl_capture(root) -> str:
    """Three samples of the tiny Qwen3-VL (one image each) packed into one sequence, captured in fp32 under ``root``."""
    import copy

    from oracle import recipe as recipes
    from oracle.capture.steps import capture_recipe_step

    r = recipes.get("qwen3-vl")
    s = r.default_sample()
    s2, s3 = copy.deepcopy(s), copy.deepcopy(s)
    s2["messages"][1]["content"], s2["messages"][2]["content"] = "Describe <image> briefly.", "Squares."
    s3["messages"][2]["content"] = "A gradient from red to green with a checkerboard on top of it."
    cap = capture_recipe_step(r.load("tiny-qwen3-vl"), [s, s2, s3], str(root / "cap"), precision="fp32")
    assert len(Bundle(cap).get("packing")["cu_seqlens"]) == 4
    return cap


def env_of(pid: int) -> dict[str, str]:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in env if b"=" in x)


def rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the launcher's child whose RANK is exactly ``rank`` (Linux /proc; LOCAL_RANK does not count)."""
    try:
        children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    except OSError:
        return None
    for c in children:
        try:
            if env_of(int(c)).get("RANK") == str(rank):
                return int(c)
        except OSError:
            continue
    return None


def killed_at_barrier(folder, rank: int, tag: str) -> dict[str, str]:
    """Variables under which rank ``rank`` of a launched run SIGKILLs itself right after it passed
    ``distributed.barrier(tag)`` (every rank reached it; what follows is the step's exchanges): a
    ``sitecustomize`` in ``folder`` put first on PYTHONPATH (the launcher keeps PYTHONPATH for its ranks).
    A point every run reaches, never a race with the test's polling (CI at load: the rank once finished
    before a polling test could kill it)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import os\n"
        f"if os.environ.get('RANK') == {str(rank)!r}:\n"
        "    import signal\n"
        "    from oracle.parallel import distributed\n"
        "    _barrier = distributed.barrier\n"
        "    def barrier(tag, _barrier=_barrier):\n"
        "        _barrier(tag)\n"
        f"        if tag == {tag!r}:\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n"
        "    distributed.barrier = barrier\n"
    )
    return {"PYTHONPATH": os.pathsep.join([str(folder), *filter(None, [os.environ.get("PYTHONPATH")])])}


def packed_text_capture(root, name: str = "packed") -> tuple[str, list[dict], object]:
    """Three samples of the tiny Qwen3 packed into one sequence, captured in fp32 with the loss summed
    under ``root / name``; with the samples and the source (to capture them alone)."""
    import json

    from oracle import recipe as recipes
    from oracle.capture.steps import capture_recipe_step

    src = recipes.get("qwen3").load("tiny-qwen3")
    lines = (Path(__file__).parent.parent / "replays" / "qwen3" / "sample.jsonl").read_text().splitlines()
    samples = [json.loads(x) for x in lines[:3]]
    return capture_recipe_step(src, samples, str(root / name), reduction="sum"), samples, src


def tiny_rank_module(seed: int = 0) -> torch.nn.Module:
    """A Megatron-named TP1 rank's parameters without Megatron: embedding, final norm and output layer
    (vocabulary 32, hidden 16), each with a random gradient, for capture_rank."""
    torch.manual_seed(seed)
    m = torch.nn.Module()
    for dotted, value in (("embedding.word_embeddings", torch.randn(32, 16)), ("decoder.final_layernorm", torch.ones(16)),
                          ("output_layer", torch.randn(32, 16))):  # fmt: skip
        parent = m
        for part in dotted.split("."):
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.weight = torch.nn.Parameter(value)
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    return m


def command_options() -> dict[str, set[str]]:
    """Every command of the app -> every spelling of its options (``--verify``, ``--no-verify``)."""
    import typer.main

    from oracle.cli.app import app

    group = typer.main.get_command(app)
    return {name: {o for p in cmd.params for o in [*p.opts, *p.secondary_opts]} | {"--help"} for name, cmd in group.commands.items()}


def options_not_on_their_command(text: str, *commands: str) -> list[str]:
    """Each ``--option`` a command's output names, against the command it belongs to: the last command name
    before it in its clause (``capture both with --modules``), else the commands that printed it. The ones
    that command lacks, with their line (empty: every hint names a real option)."""
    import re

    opts = command_options()
    bad = []
    for line in text.splitlines():
        for m in re.finditer(r"(?<![\w-])--[a-z][a-z0-9-]*", line):
            clause = re.split(r"[;:]", line[: m.start()])[-1]
            named = [w for w in re.findall(r"[a-z][a-z-]*", clause) if w in opts]
            owners = named[-1:] or list(commands)
            if not any(m.group() in opts[o] for o in owners):
                bad.append(f"{'/'.join(owners)} has no {m.group()}: {line.strip()}")
    return bad
