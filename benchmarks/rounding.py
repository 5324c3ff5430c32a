"""A band member's bfloat16 rounding: the C kernel (oracle/precision/rounding.py) against torch's eager
conversions, side by side in one run.

    python benchmarks/rounding.py

Printed:
  - per size (2^14 .. 2^23 float32 elements, 8 tensors of that size rounded in place in turn, best of 5):
    the kernel's time and the eager round trip's ``x.copy_(x.to(bfloat16))``, and their ratio; where the
    ratio stays near 1 or above is below ``rounding.MIN_ELEMENTS`` / where threads do not pay;
  - a member's rounding as the replay calls it (``PrecisionMode._round`` of an op's fresh 4096 x 12288 result,
    Qwen3-VL-8B's MLP width at 4096 tokens), round to nearest and jittered, with the kernel and without it
    (``ORACLE_ROUNDING=eager`` semantics, the same process), and a float32 ``mul_`` of the same tensor (one
    pass over memory, the floor), all bitwise checked against each other.
Ratios are the result (this machine is shared and noisy), not absolute times.
"""

from __future__ import annotations

import time

import torch

from oracle.precision import rounding
from oracle.precision.mode import PrecisionMode


def best(fn, tensors: list[torch.Tensor], rounds: int = 5, reps: int = 10) -> float:
    t_best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            for y in tensors:
                fn(y)
        t_best = min(t_best, (time.perf_counter() - t) / reps / len(tensors))
    return t_best


def member_round(x0: torch.Tensor, seed: int | None, kernel: bool) -> tuple[float, torch.Tensor]:
    saved = rounding._lib[:]
    if not kernel:
        rounding._lib[:] = [None]
    try:
        mode = PrecisionMode(torch.float32, torch.bfloat16, jitter_seed=seed)
        t_best, out = float("inf"), None
        for _ in range(7):
            out = None  # the last result freed first: the clone reuses its memory (no page faults in what is timed)
            x = x0.clone()
            t = time.perf_counter()
            out = mode._round(x, fresh=True)
            t_best = min(t_best, time.perf_counter() - t)
            mode = PrecisionMode(torch.float32, torch.bfloat16, jitter_seed=seed)  # the same draws each time
        return t_best, out
    finally:
        rounding._lib[:] = saved


def main() -> None:
    x0 = torch.randn(4096, 12288, generator=torch.Generator().manual_seed(0))
    if not rounding.usable(x0, torch.bfloat16):
        print(f"the kernel is not used here: {rounding.state()['why']}")
        return
    print(f"rounding to bfloat16 on {torch.get_num_threads()} threads: {rounding.state()}")
    print(f"{'elements':>10s} {'kernel us':>10s} {'eager us':>10s} {'kernel/eager':>13s}")
    flat = x0.view(-1)
    for p in range(14, 24):
        n = 1 << p
        ys = [flat[i * n : (i + 1) * n].clone() for i in range(min(8, flat.numel() // n))]
        k = best(lambda y: rounding.nearest(y, y), ys)
        e = best(lambda y: y.copy_(y.to(torch.bfloat16)), ys)
        print(f"{'2^' + str(p):>10s} {k * 1e6:10.0f} {e * 1e6:10.0f} {k / e:13.2f}")
    floor = best(lambda y: y.mul_(1.0), [x0.clone()], rounds=7, reps=1)
    print(f"\na member's rounding of a fresh 4096 x 12288 result (PrecisionMode._round); a float32 mul_: {floor * 1e3:.1f} ms")
    for seed, name in ((None, "round to nearest"), (7, "jittered")):
        tk, ok = member_round(x0, seed, True)
        te, oe = member_round(x0, seed, False)
        same = torch.equal(ok.view(torch.int32), oe.view(torch.int32))
        print(f"  {name:17s} kernel {tk * 1e3:6.1f} ms, eager {te * 1e3:6.1f} ms = {tk / te:.2f}x; "
              f"{tk / floor:.2f} mul_ passes; bitwise the same: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
