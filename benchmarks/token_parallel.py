"""Token-parallel float64 replay (issue 19 item 4): 2 ranks against 1 process, side by side in one run.

    python benchmarks/token_parallel.py [--tokens 4096] [--hidden 1024] [--layers 4] [--vocab 32000] [--dir DIR]
                                        [--max-memory 8G]

The work is the float64 oracle of one Qwen3 text step (hidden 1024, 16 heads / 8 KV heads of 64,
MLP 3072, 4 layers; one causal sample, the loss on its second half), compute-bound: 1 process of
1 thread, then ``--split tokens --nproc 2`` with 1 thread per rank, twice (bitwise repeatability).
Times are whole-command wall times (process start, rendezvous, the gradient transfer to rank 0 and
the bundle write included). CPU seconds are those of all processes of the command: on a shared
machine the wall-time ratio measures the contention as much as the replay, while
CPU(1 process) / CPU(2 ranks) is the parallel efficiency on the work itself. Target >= 0.8 both.
The control: two whole single processes started together (no split): each one's CPU over one alone's is
what two busy cores cost this machine (shared caches, memory bandwidth), whatever runs on them; the split's
own efficiency is then the control's wall (or CPU) per process over the 2 ranks' wall (or CPU per rank).
The issue's shape is 16384 tokens; the default is 4096 so that the three runs take minutes on a
2-core machine (``--tokens 16384`` for the full one). ``--max-memory SIZE``: all three runs streamed
(the single process within SIZE, each rank within SIZE), so the peak RSS per rank against the one
process's shows the split of the activations (the streamed replay holds no whole float64 model).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from streaming import QWEN3_D, text_inputs, write_capture  # noqa: E402

from oracle.bundle.store import Bundle  # noqa: E402

# runs the command and prints the largest resident set of its processes (ranks included: the launcher
# waits for them, so their peak reaches it) as the last line of stderr
PEAK = ("import resource, subprocess, sys; c = subprocess.run(sys.argv[1:]).returncode; "
        "print('peak', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(c)")  # fmt: skip


def timed(args: list[str]) -> tuple[float, float, float, float]:
    """Wall seconds, CPU seconds (user + sys) of the command and all its processes, the load average
    after, and the peak RSS (GiB) of its largest process."""
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-c", PEAK, sys.executable, "-m", "oracle", *args], cwd=ROOT, capture_output=True, text=True
    )
    if r.returncode != 0:
        raise SystemExit(f"oracle {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak = int(r.stderr.strip().splitlines()[-1].split()[1]) / 2**20  # KiB -> GiB
    return wall, after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime, os.getloadavg()[0], peak


def side_by_side(args: list[list[str]]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (all processes) of several oracle commands started together."""
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "oracle", *a], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for a in args]  # fmt: skip
    for a, pr in zip(args, procs):
        err = pr.communicate()[1]
        if pr.returncode != 0:
            raise SystemExit(f"oracle {' '.join(a)} failed ({pr.returncode}):\n{err[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter() - t, after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--max-memory", default=None, help="stream every run within this budget (per rank)")
    a = ap.parse_args()
    cfg = {**QWEN3_D, "hidden_size": a.hidden, "intermediate_size": 3 * a.hidden, "num_hidden_layers": a.layers,
           "num_attention_heads": a.hidden // 64, "num_key_value_heads": a.hidden // 128, "vocab_size": a.vocab}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        d = a.dir or Path(tmp)
        cap = write_capture(d / "cap", "qwen3", cfg, text_inputs(a.vocab, [a.tokens]))
        common = ["replay", str(cap), "--dtype", "fp64", "--no-verify", "--threads", "1", "--overwrite"]
        if a.max_memory:
            common = [*common, "--max-memory", a.max_memory]
        load0 = os.getloadavg()[0]
        t1, c1, l1, m1 = timed([*common, "--out", str(d / "one")])
        t2, c2, l2, m2 = timed([*common, "--out", str(d / "two"), "--split", "tokens", "--nproc", "2"])
        t3, c3, l3, _ = timed([*common, "--out", str(d / "two-again"), "--split", "tokens", "--nproc", "2"])
        # the control: two whole single processes at once, no split. What each then needs over one alone is the
        # machine's (two cores sharing caches and memory bandwidth), not the split's
        t_pair, c_pair = side_by_side([[*common, "--out", str(d / f"pair{i}")] for i in (0, 1)])
        one, two, again = Bundle(d / "one"), Bundle(d / "two"), Bundle(d / "two-again")
        g1 = one.load_group("grads")
        rel = max(float((two.load("grads", n) - g).norm() / g.norm()) for n, g in g1.items() if g.norm() > 0)
        loss_rel = abs(two.get("loss")["value"] - one.get("loss")["value"]) / abs(one.get("loss")["value"])
        bitwise = all(torch.equal(two.load("grads", n), again.load("grads", n)) for n in g1) and (
            two.get("loss")["value"] == again.get("loss")["value"])  # fmt: skip
        print(f"token-parallel: Qwen3 text hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}, {a.tokens} tokens (one causal "
              f"sample), float64 oracle{', streamed within ' + a.max_memory + ' per process' if a.max_memory else ', in memory'}, "
              f"1 thread per process; {os.cpu_count()} cores, load average {load0:.1f} before")  # fmt: skip
        print(f"  1 process       : {t1:7.2f} s wall, {c1:7.2f} s CPU, peak RSS {m1:.2f} GiB (load average {l1:.1f} after)")
        print(f"  2 ranks (tokens): {t2:7.2f} s wall, {c2:7.2f} s CPU, peak RSS {m2:.2f} GiB per rank (load average {l2:.1f} after; "
              "--split tokens --nproc 2)")  # fmt: skip
        print(f"  2 ranks again   : {t3:7.2f} s wall, {c3:7.2f} s CPU (load average {l3:.1f} after)")
        print(f"  peak RSS per rank / 1 process: {m2 / m1:.2f} (the whole process: interpreter, one unit's weights and")
        print("    gradients, the gathered K/V are not split)")
        if a.max_memory:  # the streamed runs' own accounts: boundary activations and the fixed part, per rank
            s1, tp = one.get("streaming"), two.get("token_parallel")
            act1 = s1["activations_in_memory_peak"] + s1["activations_spilled"]
            print(f"  boundary activations per rank / 1 process: {', '.join(f'{x / act1:.2f}' for x in tp['activations'])} "
                  f"(target about 1/2 = 0.50); 1 process {act1 / 2**30:.2f} GiB")  # fmt: skip
            fixed1 = s1["fixed_estimate"]
            print(f"  process + largest unit's need per rank / 1 process: "
                  f"{', '.join(f'{x / fixed1:.2f}' for x in tp['fixed_estimate'])}")  # fmt: skip
        print(f"  2 single processes at once (no split, the control): {t_pair:7.2f} s wall, {c_pair:7.2f} s CPU = "
              f"{c_pair / (2 * c1):.2f}x one alone's CPU each: what two busy cores cost here")  # fmt: skip
        print(
            f"  speed-up {t1 / t2:.2f}x; parallel efficiency wall {t1 / (2 * t2):.2f}, CPU seconds {c1 / c2:.2f} (target >= 0.8); "
            f"the split's own, against the control: wall {t_pair / (2 * t2):.2f}, CPU seconds {c_pair / (2 * c2):.2f}"
        )
        print(f"  agreement with 1 process: max relative gradient difference {rel:.1e}, loss {loss_rel:.1e} (bound 1e-12); "
              f"two 2-rank runs bitwise equal: {bitwise}")  # fmt: skip


if __name__ == "__main__":
    main()
