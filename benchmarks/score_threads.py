"""The score's parameter loop on every core (oracle/score/pool.py) against the serial loop it replaced, side by side.

    python benchmarks/score_threads.py [--tokens 4096] [--hidden 1024] [--layers 4] [--dir DIR] [--reps 2]

Builds (or reuses, ``--dir``) one step's bundles: a Qwen3 text capture (one causal sample), its float64 truth
streamed at 8G, two float32 "device" captures (the truth cast to float32; the same with 1e-3 relative noise) and a
2-member bf16 band. Then, alternating ``--reps`` times, the loop that reads every gradient (hash checked) and runs
``tensor_metrics`` on every pair:
  serial   the earlier loop: one parameter at a time, each tensor read and then measured, torch's intra-op threads
           inside each op (what `oracle score` ran before the pool; here over today's tensor_metrics, whose reused
           scratch chunks it shares);
  pool-1   score/pool.py on one worker (one thread for everything: the per-core rate the judge prices);
  pool-N   score/pool.py on N = this process's cores.
Prints each one's wall time, CPU time and rate over the bytes it reads, the ratios against ``serial`` and
pool-N's efficiency (pool-1 wall over N x pool-N wall), and checks that the whole ``score`` report is bitwise the
same at 1 and N workers.
"""

from __future__ import annotations

import argparse
import json
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

from oracle import metrics  # noqa: E402
from oracle.bundle.store import Bundle, BundleWriter  # noqa: E402
from oracle.replay.options import cores  # noqa: E402
from oracle.score import scorer  # noqa: E402


def build(d: Path, tokens: int, hidden: int, layers: int) -> None:
    """The capture, its truth, two float32 captures and a bf16 band of 2 under ``d`` (kept where they exist)."""
    cfg = {**QWEN3_D, "hidden_size": hidden, "intermediate_size": 3 * hidden, "num_hidden_layers": layers,
           "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 128, "vocab_size": 32000}  # fmt: skip
    if not (d / "cap" / "manifest.json").exists():
        write_capture(d / "cap", "qwen3", cfg, text_inputs(32000, [tokens]))
    for out, dtype in (("truth", ["--dtype", "fp64"]), ("band", ["--dtype", "bf16", "--ensemble", "2"])):
        if not (d / out / "manifest.json").exists():
            subprocess.run([sys.executable, "-m", "oracle", "replay", str(d / "cap"), *dtype, "--max-memory", "8G",
                            "--out", str(d / out), "--overwrite"], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    cap, truth = Bundle(d / "cap"), Bundle(d / "truth")
    for name, noise in (("A", 0.0), ("B", 1e-3)):
        if (d / name / "manifest.json").exists():
            continue
        gen = torch.Generator().manual_seed(7)
        with BundleWriter(d / name, "capture", overwrite=True) as w:
            for k in ("recipe", "precision", "device", "versions", "loss", "metadata"):
                if k in cap.manifest:
                    w.manifest[k] = cap.manifest[k]
            w.add("inputs", cap.load_group("inputs"))
            w.add("weights", cap.load_group("weights"))
            grads = {n: truth.load("grads", n) for n in truth.names("grads")}
            w.add("grads", {n: (t * (1 + noise * torch.randn(t.shape, generator=gen, dtype=torch.float64))).float()
                            for n, t in grads.items()})  # fmt: skip


def serial(d: Path) -> None:
    """The loop before the pool (scorer.score up to 2026-12-05): one parameter, one tensor at a time."""
    truth, band = Bundle(d / "truth"), Bundle(d / "band")
    caps = [Bundle(d / "A"), Bundle(d / "B")]
    for p in truth.names("grads"):
        t = truth.load("grads", p)
        bool(t.isfinite().all())
        [metrics.tensor_metrics(band.load(g, p), t) for g in band.member_groups() if band.has(g, p)]
        for c in caps:
            metrics.tensor_metrics(c.load("grads", p), t)


def pooled(d: Path, workers: int) -> dict:
    return scorer.score(d / "truth", [d / "A", d / "B"], band_paths=[d / "band"], workers=workers)


def timed(fn) -> tuple[float, float, object]:
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = fn()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter() - t0, r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=None)
    a = ap.parse_args()
    n = cores()
    with tempfile.TemporaryDirectory() as tmp:
        d = a.dir or Path(tmp)
        build(d, a.tokens, a.hidden, a.layers)
        nbytes = sum(f.stat().st_size for b in ("truth", "A", "B", "band") for f in (d / b).glob("grads*.safetensors"))
        runs: dict[str, list[tuple[float, float]]] = {"serial": [], "pool-1": [], f"pool-{n}": []}
        reports = {}
        for _ in range(a.reps):
            runs["serial"].append(timed(lambda: serial(d))[:2])
            for w in (1, n):
                wall, cpu, rep = timed(lambda w=w: pooled(d, w))
                runs[f"pool-{w}"].append((wall, cpu))
                reports[w] = json.dumps(rep, sort_keys=True, default=str)
        print(
            f"score loop over {nbytes / 1e9:.2f} GB of gradients (truth, 2 captures, 2 band members), "
            f"{a.reps} alternating runs, {n} cores:"
        )
        best = {k: min(v) for k, v in runs.items()}
        for k, v in runs.items():
            walls = " / ".join(f"{w:.2f}" for w, _ in v)
            print(f"  {k:<8} wall {walls} s, CPU {min(c for _, c in v):.2f} s; {nbytes / best[k][0] / 1e9:.3f} GB/s; "
                  f"{best['serial'][0] / best[k][0]:.2f}x the serial loop's speed")  # fmt: skip
        eff = best["pool-1"][0] / (n * best[f"pool-{n}"][0])
        print(f"  pool-{n} efficiency (pool-1 wall / ({n} x pool-{n} wall)): {eff:.2f}; pool-1 per core "
              f"{nbytes / best['pool-1'][1] / 1e9:.3f} GB/s of CPU time")  # fmt: skip
        print(f"  reports at 1 and {n} workers bitwise the same: {reports[1] == reports[n]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
