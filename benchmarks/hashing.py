"""A gradient's two manifest hashes: on one thread one after the other, against ``store.entry_hashes``
(a helper thread upcasts each slice and hashes its stored bytes while this one hashes the upcast values), side
by side.

    python benchmarks/hashing.py [--mib 512] [--rounds 5]

Every gradient a replay writes gets both hashes (oracle/bundle/store.py): a float64 truth hashes its bytes
twice, a float32 band member its bytes and then the float64 upcast (twice as many bytes). Printed per dtype
(float64: the truth's; float32: a member's): the best of ``--rounds`` of each way, taken in turn (the machine
is shared: the ratio is the result, not the times), their ratio, and that the digests agree. On 2 cores the
threaded way can reach about 0.5x for float64 (two equal halves) and a little over 0.5x for float32 (the
value hash, two thirds of the bytes, against the upcast and the stored bytes' hash), where the second core is free.
"""

from __future__ import annotations

import argparse
import time

import torch

from oracle.bundle.store import entry_hashes, tensor_sha256, value_sha256


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512, help="size of the gradient hashed, MiB")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"hashing. one {args.mib} MiB gradient, best of {args.rounds}, the two ways in turn; "
          f"torch threads {torch.get_num_threads()}")  # fmt: skip
    for dtype in (torch.float64, torch.float32):
        t = torch.randn(args.mib * 2**20 // dtype.itemsize, dtype=dtype)
        ways = {"serial": lambda t=t: {"sha256": tensor_sha256(t), "value_sha256": value_sha256(t)},
                "threaded": lambda t=t: entry_hashes(t)}  # fmt: skip
        best = {"serial": float("inf"), "threaded": float("inf")}
        got = {}
        for r in range(args.rounds):
            for name, fn in list(ways.items())[:: 1 if r % 2 == 0 else -1]:
                s = time.perf_counter()
                got[name] = fn()
                best[name] = min(best[name], time.perf_counter() - s)
        same = "same digests" if got["serial"] == got["threaded"] else "DIGESTS DIFFER"
        print(f"  {str(dtype).removeprefix('torch.'):8s} one thread {best['serial']:6.3f} s  two threads {best['threaded']:6.3f} s"
              f"  ratio {best['threaded'] / best['serial']:.2f}x  ({same})")  # fmt: skip


if __name__ == "__main__":
    main()
