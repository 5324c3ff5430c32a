"""Peak memory and time of chunked float64 attention next to eager attention, side by side in one run.

    python benchmarks/attention_memory.py [--lengths 512,1024,2048] [--heads 4] [--kv-heads 2] [--chunk 256]

For each sequence length T: causal attention forward + backward in float64, (1, H, T, 64) queries,
once by eager attention (scores, softmax and their gradients: T x T per head) and once by
oracle.replay.attention.chunked_attention. Each run is a fresh child process; its peak is the growth of
its maximum resident set size (ru_maxrss) over the inputs alone. Printed: both peaks, their ratio
(chunked / eager: the target is well below 1 and falling with T), and both times.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def child(impl: str, T: int, H: int, Hkv: int, chunk: int) -> None:
    import torch

    from oracle.replay.attention import chunked_attention

    torch.manual_seed(0)
    q = torch.randn(1, H, T, 64, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, Hkv, T, 64, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, Hkv, T, 64, dtype=torch.float64, requires_grad=True)
    go = torch.randn(1, H, T, 64, dtype=torch.float64)
    w = [t[:, :, : 2 * chunk].detach().requires_grad_() for t in (q, k, v)]  # warm up: kernels, GEMM buffers
    chunked_attention(*w, causal=True, chunk_q=chunk, chunk_k=chunk).sum().backward()
    (w[0] @ w[1].repeat_interleave(H // Hkv, 1).transpose(-1, -2)).softmax(-1).sum().backward()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t = time.perf_counter()
    if impl == "eager":
        g = H // Hkv
        kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # (1, H, T, 64)
        s = (q @ kr.transpose(-1, -2)) * 64**-0.5  # (1, H, T, T)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.softmax(s, -1) @ vr
    else:
        out = chunked_attention(q, k, v, causal=True, chunk_q=chunk, chunk_k=chunk)
    out.backward(go)
    dt = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    print(json.dumps({"peak_mib": peak / 1024, "seconds": dt}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,1024,2048")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--child", nargs=2, metavar=("IMPL", "T"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], int(a.child[1]), a.heads, a.kv_heads, a.chunk)
        return
    print(f"causal float64 attention, fwd+bwd, H={a.heads} Hkv={a.kv_heads} D=64 chunk={a.chunk}")
    print(
        f"{'T':>6} {'eager MiB':>10} {'chunked MiB':>12} {'ratio':>7} {'eager s':>8} {'chunked s':>10}  (target: ratio well below 1)"
    )
    for T in (int(x) for x in a.lengths.split(",")):
        res = {}
        for impl in ("eager", "chunked"):
            cmd = [sys.executable, __file__, "--child", impl, str(T), "--heads", str(a.heads),
                   "--kv-heads", str(a.kv_heads), "--chunk", str(a.chunk)]  # fmt: skip
            res[impl] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        e, c = res["eager"], res["chunked"]
        ratio = c["peak_mib"] / e["peak_mib"] if e["peak_mib"] > 0 else float("nan")
        print(f"{T:>6} {e['peak_mib']:>10.1f} {c['peak_mib']:>12.1f} {ratio:>7.3f} {e['seconds']:>8.2f} {c['seconds']:>10.2f}")


if __name__ == "__main__":
    main()
