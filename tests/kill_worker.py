"""SIGKILL a capture, a replay and a merge at random points; run by tests/integration/test_reliability.py.

    python tests/kill_worker.py ROOT SEED

One process imports torch once, then forks a child per attempt (OMP_NUM_THREADS=1 is set by the
caller, so forking after torch ran is safe). Each child writes with ``overwrite=True`` over a
complete bundle; the parent kills it with SIGKILL after a random delay in [0, 1.3 x the
uninterrupted duration] (odd attempts) or 0-20 ms after its temporary directory appears (even
attempts, so that kills land inside the write itself). After every kill the bundle at the name must open
and verify (old or new, never lost, never half-written). Then a fresh name is written under kills
(nothing or a complete bundle), a rerun must succeed, and no temporary may remain. Last, two
children write one new name at once: exactly one succeeds, the other gets OutputExists.
Prints one JSON line of counts.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py

from helpers import tiny_rank_module  # noqa: E402

from oracle import recipe as recipes  # noqa: E402
from oracle.bundle import atomic  # noqa: E402
from oracle.bundle.store import Bundle  # noqa: E402
from oracle.capture.steps import capture_recipe_step  # noqa: E402
from oracle.errors import OutputExists  # noqa: E402
from oracle.integrations.megatron.hook import capture_rank  # noqa: E402
from oracle.integrations.megatron.merge import merge_ranks  # noqa: E402
from oracle.replay.run import replay  # noqa: E402

HF = {"model_type": "qwen3", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 0,
      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "rms_norm_eps": 1e-6,
      "tie_word_embeddings": False}  # fmt: skip


def verify(path: Path) -> None:
    b = Bundle(path)
    for g in b.groups():
        b.load_group(g)


def fake_rank(root: Path) -> Path:
    """A TP1 Megatron rank capture of embedding, final norm and output layer (no Megatron needed)."""
    m = tiny_rank_module(0)
    coords = {"rank": 0, "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "dp_rank": 0, "dp_size": 1}
    return capture_rank(m, root / "ranks", stage="post-finalize", batch={"input_ids": torch.arange(8).view(1, 8)},
                        loss=1.0, num_tokens=8, coords=coords)  # fmt: skip


def temps(out: Path) -> list[str]:
    return [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def child(fn, out: Path, hold_write: float = 0.0) -> int:
    """Run ``fn(out)`` in a forked child. ``hold_write``: the child pauses this long with its bundle
    written but not yet published, so that a kill aimed at the write lands inside it however fast
    this machine writes a tiny bundle (instrumentation of the child only, not of the writer)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        if hold_write:
            publish = atomic.publish

            def slow_publish(*a, **k):
                time.sleep(hold_write)
                return publish(*a, **k)

            atomic.publish = slow_publish
        try:
            fn(out)
        except OutputExists:
            code = 6
        except BaseException:
            code = 1
        os._exit(code)
    return pid


def attempt(fn, out: Path, rng: random.Random, duration: float, in_write: bool) -> str:
    pid = child(fn, out, hold_write=0.2 if in_write else 0.0)
    if not in_write:
        time.sleep(rng.uniform(0, 1.3 * duration))
    else:  # wait for the temporary directory, then kill within the write
        t0 = time.perf_counter()
        while not any(f"-{pid}-" in n for n in temps(out)) and time.perf_counter() - t0 < 3 * duration:
            time.sleep(0.001)
        time.sleep(rng.uniform(0, 0.02))
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status)
    left = any(f"-{pid}-" in n for n in temps(out))
    return "finished" if not killed else ("killed in write" if left else "killed")


def main(root: Path, seed: int) -> None:
    torch.set_num_threads(1)
    rng = random.Random(seed)
    src = recipes.for_model("tiny-qwen3-vl").load("tiny-qwen3-vl")
    sample = src.recipe.default_sample()
    cap0 = root / "cap0"
    capture_recipe_step(src, sample, str(cap0))
    rank = fake_rank(root)
    ops = {
        "capture": lambda out: capture_recipe_step(src, sample, str(out), overwrite=True),
        "replay": lambda out: replay(cap0, out, verify="off", overwrite=True),
        "merge": lambda out: merge_ranks([rank], out, recipe="qwen3", hf_config=HF, overwrite=True),
    }
    report: dict[str, dict[str, int]] = {}
    for kind, fn in ops.items():
        counts: dict[str, int] = {}
        out = root / kind
        t0 = time.perf_counter()
        fn(out)  # the complete bundle every kill must leave readable
        duration = time.perf_counter() - t0
        for k in range({"capture": 4, "replay": 4, "merge": 6}[kind]):
            what = attempt(fn, out, rng, duration, in_write=k % 2 == 0)
            counts[what] = counts.get(what, 0) + 1
            verify(out)  # old or new, complete: raises otherwise
        fresh = root / f"{kind}-fresh"
        attempt(fn, fresh, rng, duration, in_write=True)
        if fresh.exists():
            verify(fresh)
        fn(fresh)  # the rerun succeeds (and cleans the dead writers' temporaries)
        verify(fresh)
        fn(out)
        counts["temporaries left"] = len(temps(out)) + len(temps(fresh))
        report[kind] = counts
    # two writers at once, one new name, no --overwrite
    both = root / "both"
    pids = [child(lambda o: capture_recipe_step(src, sample, str(o)), both) for _ in range(2)]
    codes = sorted(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids)
    verify(both)
    report["concurrent"] = {"exit codes": codes, "temporaries left": len(temps(both))}  # type: ignore[dict-item]
    print(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
