"""The fused float64 kernels (oracle/replay/fused.py) alone: today's autograd under the oracle's mode, the same
formulas hand-fused and run eagerly (outside the mode, not compiled), and the compiled kernels.

    python benchmarks/fused_kernels.py

One process, the three timed one after the other on the same tensors (benchmark b's shapes: 4096 rows, hidden
512, MLP 1536, 8 query heads of 64); the ratios to today's are the result, the load is printed beside them.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers.models.qwen3 import modeling_qwen3 as q3  # noqa: E402

from oracle.precision.mode import PrecisionMode  # noqa: E402
from oracle.replay import fused  # noqa: E402

N, H, MLP, NH, D = 4096, 512, 1536, 8, 64


def bench(f, reps: int = 5) -> float:
    f()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t) / reps


def main() -> None:
    torch.manual_seed(0)
    f64 = torch.float64
    x, g = torch.randn(N, H, dtype=f64, requires_grad=True), torch.randn(N, H, dtype=f64)
    norm = q3.Qwen3RMSNorm(H).double()
    a, b = torch.randn(N, MLP, dtype=f64, requires_grad=True), torch.randn(N, MLP, dtype=f64, requires_grad=True)
    gh = torch.randn(N, MLP, dtype=f64)
    q = torch.randn(1, N, NH, D, dtype=f64).transpose(1, 2).requires_grad_()  # (B, H, T, D), as the attention has it
    k, gq = torch.randn(1, 4, N, D, dtype=f64), torch.randn(1, NH, N, D, dtype=f64)
    cos, sin = torch.randn(1, N, D, dtype=f64), torch.randn(1, N, D, dtype=f64)
    fused.use(torch.nn.Module(), {"transformers.models.qwen3.modeling_qwen3.apply_rotary_pos_emb": "rotary"})
    rope = q3.apply_rotary_pos_emb.oracle_original

    def today():
        with PrecisionMode(f64):
            norm(x).backward(g)
            (torch.nn.functional.silu(a) * b).backward(gh)
            rope(q, k, cos, sin)[0].backward(gq)

    def kernels():
        with PrecisionMode(f64):
            fused._RMSNorm.apply(x, norm.weight, 1e-6).backward(g)
            fused._SwiGLU.apply(a, b).backward(gh)
            fused._Rotary.apply(q, cos.unsqueeze(1), sin.unsqueeze(1)).backward(gq)

    t_today = bench(today)
    compiled = dict(fused._compiled)
    fused._compiled.update(dict.fromkeys(compiled))  # None: the same formulas, eagerly
    t_hand = bench(kernels)
    fused._compiled.update(compiled)
    t0 = time.perf_counter()
    kernels()
    first = time.perf_counter() - t0
    t_comp = bench(kernels)
    print(f"RMSNorm {N}x{H} + SwiGLU {N}x{MLP} + rotary q {NH}x{N}x{D}, forward + backward, load {os.getloadavg()[0]:.1f}: "
          f"today {t_today * 1e3:.0f} ms, hand-fused eager {t_hand * 1e3:.0f} ms ({t_hand / t_today:.2f}x), compiled "
          f"{t_comp * 1e3:.0f} ms ({t_comp / t_today:.2f}x); the compiled kernels' first call {first:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
