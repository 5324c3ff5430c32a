"""The exact attention's float64 GEMMs in both layouts: a narrow result (D columns) against its transpose
(D rows), the form oracle/replay/attention.py's Python loop computes since issue 43; then the whole attention
through torch's CPU flash kernel (attention_flash.py) against that loop, in float64 and in float32.

    python benchmarks/attention_gemm.py [--reps 7]

One process; for each shape, every product timed best-of-``reps`` in the old form and the new one, side by
side, with the float64 GEMM probe (768^3) measured in the same run: read the ratios, not the GFLOP/s (the
machine is shared). Shapes: one (query chunk x key chunk) block of the kernel at CHUNK = 512, the g query
heads of a key/value head stacked as rows: benchmark b (Qwen3 text: head dim 64, 8 heads over 4 kv heads)
and Qwen3-VL-8B (head dim 128, 32 heads over 8 kv heads). Then the whole chunked attention, forward and
backward at 4096 tokens, causal, its GEMM FLOPs over its time against the probe, through the flash kernel (the
truth's and a streamed member's path) and through the loop (a rounding mode's path), each dtype against its own
probe; and torch's sdpa on the whole sample (one flash call, no query chunks) for scale.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from oracle.replay import attention_flash  # noqa: E402
from oracle.replay.attention import chunked_attention  # noqa: E402


def best(f, reps: int) -> float:
    f()
    t = float("inf")
    for _ in range(reps):
        s = time.perf_counter()
        f()
        t = min(t, time.perf_counter() - s)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    reps = ap.parse_args().reps
    torch.manual_seed(0)
    f64 = dict(dtype=torch.float64)
    n = 768
    a, b = torch.randn(n, n, **f64), torch.randn(n, n, **f64)
    probe = 2 * n**3 / best(lambda: a @ b, reps)
    print(f"float64 GEMM probe {probe / 1e9:.1f} GFLOP/s, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    for name, D, g, BH in (("benchmark b", 64, 2, 4), ("Qwen3-VL-8B", 128, 4, 8)):
        rows, ck = 512 * g, 512
        p, ds = torch.randn(BH, rows, ck, **f64), torch.randn(BH, rows, ck, **f64)
        v, k = torch.randn(BH, ck, D, **f64), torch.randn(BH, ck, D, **f64)
        do, q = torch.randn(BH, rows, D, **f64), torch.randn(BH, rows, D, **f64)
        flops = 2 * BH * rows * ck * D
        print(f"{name}: a block of {rows} query rows x {ck} keys, head dim {D}, {BH} kv heads")
        products = {
            "P V   (forward)": (lambda: p @ v, lambda: v.transpose(-1, -2) @ p.transpose(-1, -2)),
            "dV = P^T dO": (lambda: p.transpose(-1, -2) @ do, lambda: do.transpose(-1, -2) @ p),
            "dQ = dS K": (lambda: ds @ k, lambda: k.transpose(-1, -2) @ ds.transpose(-1, -2)),
            "dK = dS^T Q": (lambda: ds.transpose(-1, -2) @ q, lambda: q.transpose(-1, -2) @ ds),
        }
        for what, (old, new) in products.items():
            to, tn = best(old, reps), best(new, reps)
            print(f"   {what:<16} narrow {flops / to / probe:.2f}x of the probe, transposed {flops / tn / probe:.2f}x: "
                  f"time {tn / to:.2f}x")  # fmt: skip
        kernels(BH, g, D, reps)


def kernels(BH: int, g: int, D: int, reps: int, T: int = 4096) -> None:
    """chunked_attention forward + backward at T tokens, causal: the flash kernel, the loop, whole-sample sdpa."""
    blocks = sum(range(1, T // 512 + 1))  # causal: the key chunks each query chunk sees
    gemm = 7 * 2 * BH * (512 * g) * 512 * D * blocks  # 2 GEMMs forward, 5 backward (S recomputed) per block
    usable = attention_flash.usable
    for dtype in (torch.float64, torch.float32):
        n = 768
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        probe = 2 * n**3 / best(lambda: a @ b, reps)
        qq = torch.randn(1, BH * g, T, D, dtype=dtype, requires_grad=True)
        kk, vv = (torch.randn(1, BH, T, D, dtype=dtype, requires_grad=True) for _ in range(2))
        times = {}
        for name, fn, use in (
            ("flash kernel", lambda: chunked_attention(qq, kk, vv, causal=True), usable),
            ("Python loop", lambda: chunked_attention(qq, kk, vv, causal=True), lambda q, k: False),
            ("sdpa, whole sample", lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True), usable),
        ):
            attention_flash.usable = use

            def step(fn=fn):
                out = fn()
                out.backward(torch.ones_like(out))

            try:
                times[name] = best(step, max(2, reps // 3))
            finally:
                attention_flash.usable = usable
        loop = times["Python loop"]
        for name, t in times.items():
            print(f"   {str(dtype)[6:]} attention at {T} tokens, fwd + bwd, {name:<18} {t:6.2f} s, {gemm / t / probe:.2f}x of the "
                  f"{str(dtype)[6:]} probe, {loop / t:.2f}x the loop's speed")  # fmt: skip


if __name__ == "__main__":
    main()
