"""The user's step: Qwen3-VL-8B SFT, 65536 tokens packed from 4 samples with one image each (issue 19).

    python benchmarks/user_step.py plan                     # 36 layers, 65536 tokens: the dry run at 16G
    python benchmarks/user_step.py cut [--tokens N] [--side S] [--dtype D]  # 2 decoder layers, full ViT and head, at 16G
    python benchmarks/user_step.py judge                    # 36 layers, 65536 tokens: oracle judge's dry run at 16G
    python benchmarks/user_step.py judge --busy 1           # the same, then again with one core kept busy: the servers' figures side by side
    options: --dir DIR (bundles; default a temporary directory), --config (Qwen3-VL-8B config.json)

plan  writes a capture with Qwen3-VL-8B's shapes whose weights file is sparse (a valid safetensors
      header, its data a hole: no disk, never read), and runs ``oracle replay --dry-run --max-memory 16G``
      in a child process: does it fit, peak memory, disk while running (target < 200 GiB).
judge writes that capture twice (``H20``, ``910B``: the same step, as judge requires) and runs
      ``oracle judge H20 910B --dry-run --max-memory 16G`` in a child process: each stage's time, memory
      and disk, the band's time over the truth's, the totals here, on one 64-core server and on 4 hosts.
cut   writes a capture with seeded random bf16 weights (2 decoder layers: 2.2 B parameters, 4.4 GB) and
      runs the dry run and the streamed float64 replay at ``--max-memory 16G``, each in its own process:
      measured peak RSS (the child's VmHWM: its ru_maxrss would carry this script's own RSS) vs the dry run's estimate (target within 10 %), bytes written vs
      estimated, wall time; then extrapolates by the dry run's FLOP counts to 36 layers at 65536 tokens,
      here (at the FLOP rate the run reached) and on one 64-core server (this machine's float64 GEMM
      probe per core x 64, at the same fraction of the probe). ``--dtype bf16`` (or amp-bf16) runs one
      band member instead of the truth: its peak within the same 16G, its time against the dry run's
      price (float32 probe x EMULATED_EFFICIENCY); ``--dir`` reuses a capture an earlier cut wrote.
Samples: random text ids, one ``side`` x ``side`` image each (448: 784 patches, 196 image tokens),
labels on each sample's last quarter; mRoPE positions from transformers' own ``get_rope_index``,
packed by the recipe (restarting text row, ``cu_seqlens``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from streaming import run, sparse_file, vl8b_config, write_capture  # noqa: E402

from oracle.bundle.store import Bundle, BundleWriter  # noqa: E402
from oracle.capture.api import versions  # noqa: E402
from oracle.recipe import get  # noqa: E402
from oracle.replay.streaming.materialize import skeleton  # noqa: E402

BUDGET = 16 << 30
G = 2**30


def sample_inputs(cfg: dict, length: int, side: int, seed: int) -> dict[str, torch.Tensor]:
    """One sample of ``length`` tokens: 100 text tokens, one image, text; loss on the last quarter."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    grid = torch.tensor([[1, side // 16, side // 16]])
    n_img = int(grid.prod()) // 4
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(1000, 100000, (1, length - n_img - 2), generator=g)
    ids = torch.cat([text[:, :100], torch.tensor([[cfg["vision_start_token_id"]] + [cfg["image_token_id"]] * n_img
                                                  + [cfg["vision_end_token_id"]]]), text[:, 100:]], 1)  # fmt: skip
    labels = torch.full_like(ids, -100)
    labels[0, -length // 4 :] = ids[0, -length // 4 :]
    c = Qwen3VLConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        m = Qwen3VLModel(c)
    pos, _ = m.get_rope_index(ids, mm_token_type_ids=(ids == cfg["image_token_id"]).int(), image_grid_thw=grid)
    pixels = torch.randn(int(grid.prod()), 3 * 2 * 16 * 16, generator=g)
    return {"input_ids": ids, "labels": labels, "position_ids": pos.contiguous(), "pixel_values": pixels, "image_grid_thw": grid}


def packed_inputs(cfg: dict, tokens: int, side: int) -> dict[str, torch.Tensor]:
    parts = [sample_inputs(cfg, tokens // 4, side, seed=10 + k) for k in range(4)]
    return get("qwen3-vl").pack_inputs(parts)


def write_sparse_capture(path: Path, cfg: dict, inputs: dict[str, torch.Tensor]) -> Path:
    """A capture whose weights (bf16) and float32 gradients (main_grad's dtype) are each a valid safetensors
    header over a hole: a capture holds its gradients (the bundle schema refuses one without), the dry runs
    never read them."""
    model = skeleton(get("qwen3-vl"), cfg, torch.float32)
    with BundleWriter(path, "capture", overwrite=True) as w:
        w.manifest.update(recipe={"name": "qwen3-vl", "config": cfg}, precision="bf16", device={"type": "cuda"},
                          versions=versions(), loss={"value": None, "reduction": "mean", "num_tokens": None},
                          metadata={"model": "Qwen3-VL-8B shapes, sparse weights (benchmark)"})  # fmt: skip
        w.add("inputs", inputs)
        for group, dtype, size in (("weights", "bfloat16", 2), ("grads", "float32", 4)):
            f = w._tmp / f"{group}.safetensors"
            w.adopt(group, f, sparse_file(f, model, dtype, size), move=True)
    return path


DRY = r"""
import json, sys
from oracle.bundle.store import Bundle
from oracle.replay.streaming.plan import plan
print("@@", json.dumps(plan(Bundle(sys.argv[1]), sys.argv[3], budget=int(sys.argv[2]))))
"""


def dry_run(cap: Path, budget: int = BUDGET, dtype: str = "fp64") -> dict:
    """The dry run in its own process (its resident set is a replay process's, not this script's)."""
    r = subprocess.run([sys.executable, "-c", DRY, str(cap), str(budget), dtype], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    return json.loads([x for x in r.stdout.splitlines() if x.startswith("@@")][-1][3:])


def show(p: dict) -> None:
    m, d = p["memory"], p["disk"]
    print(f"   dry run: {p['tokens']} tokens in {len(p['samples'])} samples, {p['patches']} patches, {p['loss_tokens']} loss tokens, "
          f"{p['parameters'] / 1e9:.2f} B parameters, {p['total_flops']:.2e} FLOPs")  # fmt: skip
    print(f"   memory: peak estimate {m['peak_estimate'] / G:.2f} GiB ({'fits' if p['fits'] else 'does NOT fit'} 16 GiB): "
          f"process {m['process'] / G:.2f}, largest need {m['reserve'] / G:.2f} ({m['reserve_by']}), boundary activations "
          f"{m['activations'] / G:.2f} of which {m['activations_in_memory'] / G:.2f} in memory")  # fmt: skip
    print(f"   disk: spilled {d['spilled_activations'] / G:.1f} GiB + journal {d['resume_journal'] / G:.1f} GiB written "
          f"+ gradients {d['gradients'] / G:.1f} GiB = {d['written'] / G:.1f} GiB written over the run; at most "
          f"{d['held_peak'] / G:.1f} GiB held at once (target < 200 GiB while running: "
          f"{'met' if d['held_peak'] < 200 * G else 'NOT met'})")  # fmt: skip
    if not p["fits"]:
        print(f"   refusal: {p['refusal']}")


def bench_plan(d: Path, cfg_path: Path | None) -> dict:
    cfg = vl8b_config(36) if cfg_path is None else _config(cfg_path, 36)
    t = time.perf_counter()
    cap = write_sparse_capture(d / "plan-cap", cfg, packed_inputs(cfg, 65536, 448))
    print(f"plan. Qwen3-VL-8B, 36 layers, 27-block ViT, 65536 tokens from 4 packed samples, one 448x448 image each "
          f"(sparse weights, written in {time.perf_counter() - t:.0f} s)")  # fmt: skip
    p = dry_run(cap)
    show(p)
    return p


def _duration_s(text: str) -> float:
    """'1 h 30 min' / '36 min' / '12 s' / '2 d 3 h' (stages.duration) -> seconds."""
    units = {"d": 86400, "h": 3600, "min": 60, "s": 1}
    parts = text.split()
    return sum(float(v) * units[u] for v, u in zip(parts[::2], parts[1::2]) if u in units)


def bench_judge(d: Path, cfg_path: Path | None, busy: int = 0) -> int:
    """The judge's dry run; with ``busy`` > 0 again while that many spinning processes keep cores busy:
    the servers' figures (priced on one core's CPU-time GEMM rate, plan.core_rates) side by side."""
    cfg = vl8b_config(36) if cfg_path is None else _config(cfg_path, 36)
    inputs = packed_inputs(cfg, 65536, 448)
    for name in ("H20", "910B"):
        write_sparse_capture(d / name, cfg, inputs)
    cmd = [sys.executable, "-m", "oracle", "judge", "H20", "910B", "--dry-run", "--max-memory", "16G", "--out", "judged"]
    print("judge. Qwen3-VL-8B, 36 layers, 27-block ViT, 65536 tokens from 4 packed samples; " + " ".join(["oracle", *cmd[3:]]))
    figures, rc = {}, 0
    for spinners in sorted({0, busy}):
        spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners)]
        try:
            r = subprocess.run(cmd, cwd=d, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        finally:
            for q in spin:
                q.kill()
                q.wait()
        print(f"--- {spinners} core(s) kept busy by spinning processes, load average {os.getloadavg()[0]:.1f} after:")
        print(r.stdout + r.stderr)
        print(f"   exit {r.returncode}")
        rc = rc or r.returncode
        lines = {ln.split(":")[0].strip(): ln.split("about ", 1)[1].split(" (")[0] for ln in r.stdout.splitlines() if ": about " in ln}
        figures[spinners] = {k: _duration_s(v) for k, v in lines.items()}
    if busy:
        for where in figures[0]:
            quiet, loaded = figures[0][where], figures[busy].get(where, float("nan"))
            print(f"   {where}: {quiet / 3600:.2f} h quiet, {loaded / 3600:.2f} h with {busy} core(s) busy = {loaded / quiet:.2f}x")
    return rc


def _config(path: Path, layers: int) -> dict:
    cfg = {
        k: v
        for k, v in json.loads(path.read_text()).items()
        if not k.startswith("_") and k not in ("architectures", "torch_dtype")
    }
    cfg["text_config"] = {**cfg["text_config"], "num_hidden_layers": layers}
    return cfg


def bench_cut(d: Path, tokens: int, side: int, cfg_path: Path | None, dtype: str = "fp64") -> None:
    """``dtype`` fp64: the truth; bf16 / amp-bf16: one band member (the round-to-nearest one, what
    ``judge``'s band runs first; every member has its memory), priced on the float32 probe."""
    from oracle.replay.streaming.plan import EMULATED_EFFICIENCY, gemm_rate

    cfg = vl8b_config(2) if cfg_path is None else _config(cfg_path, 2)
    inputs = packed_inputs(cfg, tokens, side)
    cap = d / "cut-cap"
    t = time.perf_counter()
    if not (cap / "manifest.json").exists():  # a capture of an earlier run of the cut is reused (the same seeds)
        cap = write_capture(cap, "qwen3-vl", cfg, inputs)
    print(f"cut. Qwen3-VL-8B shapes, 2 decoder layers, 27-block ViT, head; {tokens} tokens from 4 packed samples, one "
          f"{side}x{side} image each; --dtype {dtype} --max-memory 16G (capture ready in {time.perf_counter() - t:.0f} s)")  # fmt: skip
    p = dry_run(cap, dtype=dtype)
    show(p)
    out = d / f"cut-{dtype}"
    s = run(["replay", str(cap), "--out", str(out), "--dtype", dtype, "--max-memory", "16G", "--overwrite"])
    st = Bundle(out).get("streaming")
    est, peak = p["memory"]["peak_estimate"], s["peak_rss"]
    print(f"   streamed: {s['seconds']:.0f} s wall, peak RSS (VmHWM) {peak / G:.2f} GiB (budget held: {peak <= BUDGET}); "
          f"dry-run estimate {est / G:.2f} GiB = {est / peak:.2f}x of measured (target 0.9-1.1x)")  # fmt: skip
    print(f"   disk: written {st['disk_written'] / G:.2f} GiB, estimated {p['disk']['written'] / G:.2f} GiB = "
          f"{p['disk']['written'] / st['disk_written']:.2f}x (target 0.9-1.1x)")  # fmt: skip
    if dtype != "fp64":
        rate = gemm_rate(reps=15, dtype=torch.float32)  # best of 15: one slowed product misreads a short probe
        reached = p["total_flops"] / s["seconds"]
        print(f"   FLOP rate reached {reached / 1e9:.1f} GFLOP/s = {reached / rate:.2f}x of the float32 GEMM probe "
              f"({rate / 1e9:.1f} GFLOP/s; the dry run prices members at {EMULATED_EFFICIENCY}x): dry-run time "
              f"{p['estimated_seconds']:.0f} s of GEMMs + {p['parameter_seconds']:.0f} s per-parameter work = "
              f"{(p['estimated_seconds'] + p['parameter_seconds']) / s['seconds']:.2f}x of measured")  # fmt: skip
        return
    rate = gemm_rate(reps=15)
    reached = p["total_flops"] / s["seconds"]
    full = dry_run(write_sparse_capture(d / "plan-cap", vl8b_config(36) if cfg_path is None else _config(cfg_path, 36),
                                        packed_inputs(cfg, 65536, 448)))  # fmt: skip
    here = full["total_flops"] / reached
    cores = torch.get_num_threads()
    server = full["total_flops"] / (rate / cores * 64 * reached / rate)
    print(f"   FLOP rate reached {reached / 1e9:.1f} GFLOP/s = {reached / rate:.2f}x of the float64 GEMM probe "
          f"({rate / 1e9:.1f} GFLOP/s on {cores} threads; target >= 0.7x; the dry run's time assumes {p['efficiency']:.2f}x); "
          f"dry-run time {p['estimated_seconds']:.0f} s of GEMMs + {p['parameter_seconds']:.0f} s per-parameter work = "
          f"{(p['estimated_seconds'] + p['parameter_seconds']) / s['seconds']:.2f}x of measured")  # fmt: skip
    print(f"   extrapolated (FLOPs of the 36-layer, 65536-token step: {full['total_flops']:.2e}): {here / 3600:.1f} h here; "
          f"{server / 3600:.2f} h on one 64-core server (probe per core x 64, same fraction of it); its memory: "
          f"{full['memory']['peak_estimate'] / G:.1f} GiB estimated ({'fits' if full['fits'] else 'does not fit'} 16 GiB)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=["plan", "cut", "judge"])
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--side", type=int, default=448)
    ap.add_argument("--config", type=Path, default=None)
    ap.add_argument("--busy", type=int, default=0, help="judge only: rerun the dry run with this many cores kept busy")
    ap.add_argument("--dtype", default="fp64", help="cut only: fp64 (the truth) or a band member's bf16 / amp-bf16")
    a = ap.parse_args()
    ctx = tempfile.TemporaryDirectory() if a.dir is None else None
    d = Path(ctx.name) if ctx else a.dir
    d.mkdir(parents=True, exist_ok=True)
    if a.which == "plan":
        bench_plan(d, a.config)
    elif a.which == "judge":
        bench_judge(d, a.config, a.busy)
    else:
        bench_cut(d, a.tokens, a.side, a.config, a.dtype)
    if ctx:
        ctx.cleanup()


if __name__ == "__main__":
    main()
