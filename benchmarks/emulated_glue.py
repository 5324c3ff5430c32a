"""The glue an emulated band member runs over a whole sequence, against the float64 truth's: memory and time.

    python benchmarks/emulated_glue.py [--tokens 16384] [--hidden 4096]

Between streamed units a replay runs ordinary autograd over the whole sequence (residual adds, the final
norm, the head's input gradient scattered into it): at the user's 65536 tokens one float32 tensor is
1 GiB. This runs Qwen3-VL's final RMSNorm on a residual sum, forward and backward, in each replay's own
process (its peak resident set, VmHWM, taken above the set after the inputs are made): the float64
truth, a round-to-nearest bf16 member and a jittered one; and the two members as they ran before
oracle/precision/mode.py recorded what it rounded and rounded large tensors by blocks (both disabled by
setting its _MARK_MIN and _BLOCK beyond any tensor). Prints each one's peak in GiB and in tensors of its
own dtype, its time, and both against the truth's, measured in this one run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _status(key: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 2**20  # kB -> GiB
    raise RuntimeError(key)


def child(which: str, tokens: int, hidden: int) -> None:
    import torch
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRMSNorm

    import oracle.precision.mode as m

    if which.endswith("-before"):
        m._MARK_MIN = m._BLOCK = 1 << 62
    dt = torch.float64 if which == "truth" else torch.float32
    torch.manual_seed(0)
    norm = Qwen3VLTextRMSNorm(hidden).to(dt)
    x = torch.randn(tokens, hidden, dtype=dt).requires_grad_()
    r, g = torch.randn(tokens, hidden, dtype=dt), torch.randn(tokens, hidden, dtype=dt)
    if which == "truth":
        mode = m.PrecisionMode(torch.float64)
    else:
        mode = m.PrecisionMode(torch.float32, torch.bfloat16, jitter_seed=1 if which.startswith("jittered") else None)
    base = _status("VmRSS")
    t = time.perf_counter()
    with mode:
        norm(x + r).backward(g)
    sec = time.perf_counter() - t
    gib = tokens * hidden * dt.itemsize / 2**30
    print(json.dumps({"peak": _status("VmHWM") - base, "tensor": gib, "sec": sec}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.tokens, a.hidden)
    runs = ["truth", "rtn", "jittered", "rtn-before", "jittered-before"]
    res = {}
    for w in runs:
        out = subprocess.run([sys.executable, __file__, "--child", w, "--tokens", str(a.tokens), "--hidden", str(a.hidden)],
                             cwd=ROOT, capture_output=True, text=True, check=True)  # fmt: skip
        res[w] = json.loads(out.stdout.strip().splitlines()[-1])
    t = res["truth"]
    print(f"Qwen3-VL text RMSNorm on a residual sum, forward and backward, {a.tokens} x {a.hidden}, each in its own process")
    print(f"{'replay':<18} {'peak above inputs':>18} {'tensors':>8} {'time':>8} {'peak vs truth':>14} {'time vs truth':>14}")
    for w in runs:
        r = res[w]
        print(f"{w:<18} {r['peak']:>14.2f} GiB {r['peak'] / r['tensor']:>8.1f} {r['sec']:>7.2f}s "
              f"{r['peak'] / t['peak']:>13.2f}x {r['sec'] / t['sec']:>13.2f}x")  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
