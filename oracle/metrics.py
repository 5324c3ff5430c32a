"""Per-tensor error metrics of a gradient g against the float64 truth t.

Both are upcast to float64 here (the scorer's only upcast point); with d = g - t:

    rel_l2      = ||d||_2 / ||t||_2          (0 if both are zero, inf if only t is zero)
    cosine      = <g, t> / (||g||_2 ||t||_2)  (1 if both are zero, 0 if exactly one is)
    norm_ratio  = ||g||_2 / ||t||_2
    max_abs     = max_i |d_i|
    frac_rel_gt_1e-3 = #{i : |d_i| > 1e-3 |t_i|} / n   msprobe's "one-thousandth" column, inverted:
                                                      the share of elements off by more than 0.1 %
    nonfinite   = #{i : g_i is NaN or +-Inf}; when > 0, the other metrics are computed on the
                  finite elements only and the class is ``non_finite`` (never silently cleaned)

The sums kept alongside (``err_sq``, ``ref_sq``, ``dot``, ``self_sq``) let layers and the whole
model be aggregated exactly: rel_l2(layer) = sqrt(sum err_sq) / sqrt(sum ref_sq).

Every sum here is the same float64 value at any thread count (``ROW``), so a report scored from the same
bundles is bitwise the same on machines of any core count (the same instruction set: the vectorised order
within a row is the CPU's).

Memory: a tensor is measured ``CHUNK`` elements at a time, each chunk's sums added in Python floats
(float64). In one pass the upcasts, d and the products needed 5.1x the tensor's float64 size beyond its
inputs (``python benchmarks/score_memory.py``): 24 GiB for Qwen3-VL-8B's embedding gradient (622 M
elements), above the 16 GiB the rest of the judge fits in. By chunks the temporaries are four reused
float64 chunks per thread (``_chunk``) whatever the tensor. A tensor of at most ``CHUNK`` elements is one chunk: the same operations as one
pass, bitwise; a larger one's sums are the chunks' sums added (float64, relative change ~1e-16).
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import Executor, Future

import torch


def safe_ratio(num: float, den: float, *, both_zero: float = 0.0) -> float:
    """num / den, with the zero-truth case defined once: ``both_zero`` if both are 0, inf if only den is."""
    if den == 0.0:
        return both_zero if num == 0.0 else math.inf
    return num / den


def rel_l2(dev: list[torch.Tensor] | torch.Tensor, ref: list[torch.Tensor] | torch.Tensor) -> float:
    """Joint relative L2 error of tensors against their truths, in float64:
    sqrt(sum_i ||d_i - r_i||^2) / sqrt(sum_i ||r_i||^2); 0 if both are zero, inf if only the truth is.
    NaN/Inf in ``dev`` make the result NaN: callers that must localise them count them first.
    The same value at any thread count (``sum_sq``)."""
    dev = [dev] if isinstance(dev, torch.Tensor) else list(dev)
    ref = [ref] if isinstance(ref, torch.Tensor) else list(ref)
    if len(dev) != len(ref):
        raise ValueError(f"{len(dev)} tensors against {len(ref)} truths")
    err = sum(sum_sq(d, r) for d, r in zip(dev, ref))
    den = sum(sum_sq(r) for r in ref)
    return safe_ratio(math.sqrt(err), math.sqrt(den))


# Elements per pass: 8 MiB float64 temporaries (about 17 of them per chunk, 6 alive at once, before ``_SCRATCH``). At 2^22 (32 MiB) each
# temporary sat just above glibc's largest dynamic mmap threshold (32 MiB), so every one was a fresh mmap, page-faulted
# and unmapped: a call on 2^26 float32/float64 pairs took 2.34 s (2.71 s of it system time, 1.7 M minor faults) against
# 0.79 s at 2^20 (0.23 s system, 0.14 M faults), the same values to the last ulp or two (the chunks' partial sums are
# added in another grouping); 0.70 s with |d| taken once and the counts by count_nonzero (bitwise the same values).
# A one-off timing: 3 calls each of tensor_metrics on torch.randn(2^26) and a perturbed float32 copy, 2 cores.
CHUNK = 1 << 20


_SCRATCH = threading.local()  # each thread's four float64 chunks: the temporaries of ``_chunk``, reused
# A sum's row: torch sums a whole tensor by splitting it among its intra-op threads, so its grouping (the last bits)
# moved with the machine's core count; a (rows, ROW) view summed along its rows is split by rows instead (each row
# summed whole on one thread, its vectorised order fixed), and the rows' sums, fewer than torch's grain of 32768,
# are added on one thread: the same float64 value at 1, 2, 3 or 4 threads (tests/unit/test_metrics.py).
ROW = 8192


def _sum(x: torch.Tensor) -> float:
    """``float(x.sum())`` of a contiguous 1-D float64 tensor of at most CHUNK elements, the same at any thread
    count (ROW above)."""
    n = x.numel()
    m = n - n % ROW
    s = float(x[:m].view(-1, ROW).sum(1).sum()) if m else 0.0
    return s + float(x[m:].sum()) if m < n else s


def _scratch(n: int) -> torch.Tensor:
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.shape[1] < n:
        buf = _SCRATCH.buf = torch.empty(4, max(n, CHUNK), dtype=torch.float64)
    return buf


def sum_sq(x: torch.Tensor, y: torch.Tensor | None = None) -> float:
    """sum((x - y)^2), or sum(x^2) without ``y``, in float64 (upcast here), by CHUNK elements added in order:
    the same value at any thread count, no float64 copy of the whole tensor."""
    return _by_chunks(x, y, square=True)


def dot(x: torch.Tensor, y: torch.Tensor) -> float:
    """sum(x * y) in float64 (upcast here), by CHUNK elements added in order, as ``sum_sq``."""
    return _by_chunks(x, y, square=False)


def norm(x: torch.Tensor) -> float:
    """||x||_2 in float64, as ``sum_sq``."""
    return math.sqrt(sum_sq(x))


def _by_chunks(x: torch.Tensor, y: torch.Tensor | None, *, square: bool) -> float:
    x = x.detach().reshape(-1)
    if y is not None:
        y = y.detach().reshape(-1)
        if y.shape != x.shape:
            raise ValueError(f"shape {tuple(x.shape)} vs {tuple(y.shape)}")
    total = 0.0
    for i in range(0, x.numel(), CHUNK):
        n = min(CHUNK, x.numel() - i)
        buf = _scratch(n)
        a = buf[0, :n].copy_(x[i : i + n])  # the upcast point; y's piece is widened exactly by type promotion
        if y is not None:
            a = a.sub_(y[i : i + n]) if square else a.mul_(y[i : i + n])
        total += _sum(torch.mul(a, a, out=buf[1, :n]) if square else a)
    return total


def _chunk(g: torch.Tensor, t: torch.Tensor) -> tuple[float, float, float, float, float, int, int, int]:
    """One chunk's sums (err_sq, ref_sq, self_sq, dot), max |d|, count off by 1e-3, kept and non-finite counts.
    Its float64 temporaries live in the calling thread's scratch (fresh 8 MiB temporaries on several threads
    were returned to the system and faulted in again: a third more system time on 2 threads)."""
    n = g.numel()
    buf = _scratch(n)
    gc = buf[0, :n].copy_(g)  # the upcast point
    tc = buf[1, :n].copy_(t)
    finite = torch.isfinite(gc)
    bad = n - int(torch.count_nonzero(finite))
    if bad:
        gc, tc = gc[finite], tc[finite]
    k = gc.numel()
    d = torch.sub(gc, tc, out=buf[2, :k])
    sq = buf[3, :k]
    err = _sum(torch.mul(d, d, out=sq))
    ref = _sum(torch.mul(tc, tc, out=sq))
    slf = _sum(torch.mul(gc, gc, out=sq))
    dt = _sum(torch.mul(gc, tc, out=sq))
    ad = torch.abs(d, out=sq)  # |d| once, for the max and the count
    mx = float(ad.max()) if k else 0.0
    off = int(torch.count_nonzero(ad > torch.abs(tc, out=buf[0, :k]).mul_(1e-3)))
    return err, ref, slf, dt, mx, off, k, bad


def tensor_metrics(g: torch.Tensor, t: torch.Tensor, pool: Executor | None = None) -> dict[str, float]:
    """The metrics above of ``g`` against ``t``. With ``pool`` the chunks run on its threads; their values are
    added in the chunks' order either way, so the result is the same (score/pool.py)."""
    return finish(start(g, t, pool))


def start(g: torch.Tensor, t: torch.Tensor, pool: Executor | None = None) -> list:
    """The chunks of ``tensor_metrics``: their values, or with ``pool`` their futures (``finish`` adds them)."""
    g = g.detach().reshape(-1)
    t = t.detach().reshape(-1)
    if g.shape != t.shape:
        raise ValueError(f"shape {tuple(g.shape)} vs truth {tuple(t.shape)}")
    starts = range(0, max(g.numel(), 1), CHUNK)
    if pool is None or len(starts) == 1:
        return [_chunk(g[i : i + CHUNK], t[i : i + CHUNK]) for i in starts]
    return [pool.submit(_chunk, g[i : i + CHUNK], t[i : i + CHUNK]) for i in starts]


def finish(parts: list) -> dict[str, float]:
    """The metrics from ``start``'s chunks (waiting for those still running)."""
    parts = [p.result() if isinstance(p, Future) else p for p in parts]
    err_sq = ref_sq = self_sq = dot = max_abs = 0.0
    nonfinite = kept = off = 0
    for e, r, sq, dt, mx, o, k, bad in parts:  # in order: the same float64 additions whatever ran them
        err_sq += e
        ref_sq += r
        self_sq += sq
        dot += dt
        max_abs = max(max_abs, mx)
        off += o
        kept += k
        nonfinite += bad
    ref_n, self_n = math.sqrt(ref_sq), math.sqrt(self_sq)
    if ref_n == 0.0 and self_n == 0.0:
        cosine = 1.0
    elif ref_n == 0.0 or self_n == 0.0:
        cosine = 0.0
    else:
        cosine = dot / (ref_n * self_n)
    return {
        "rel_l2": safe_ratio(math.sqrt(err_sq), ref_n),
        "cosine": cosine,
        "norm_ratio": safe_ratio(self_n, ref_n, both_zero=1.0),
        "max_abs": max_abs,
        "frac_rel_gt_1e-3": off / max(kept, 1),
        "nonfinite": nonfinite,
        "norm": self_n,
        "ref_norm": ref_n,
        "err_sq": err_sq,
        "ref_sq": ref_sq,
        "self_sq": self_sq,
        "dot": dot,
    }


def aggregate(rows: list[dict[str, float]]) -> dict[str, float]:
    """Exact layer/model aggregate of tensor rows (sums of squares, not averages of ratios)."""
    err = sum(r["err_sq"] for r in rows)
    ref = sum(r["ref_sq"] for r in rows)
    slf = sum(r["self_sq"] for r in rows)
    dot = sum(r["dot"] for r in rows)
    return {
        "rel_l2": safe_ratio(math.sqrt(err), math.sqrt(ref)),
        "norm_ratio": safe_ratio(math.sqrt(slf), math.sqrt(ref), both_zero=1.0),
        "cosine": dot / math.sqrt(slf * ref) if slf > 0 and ref > 0 else float(slf == ref),
        "nonfinite": sum(int(r["nonfinite"]) for r in rows),
        "err_sq": err, "ref_sq": ref, "self_sq": slf, "dot": dot,
    }  # fmt: skip


def global_scale(agg: dict[str, float]) -> tuple[float, float]:
    """c minimising ||c g - t||_2 over everything, and the relative residual ||c g - t|| / ||t||.

    c = <g, t> / <g, g>;  ||c g - t||^2 = ||t||^2 - <g, t>^2 / <g, g>.
    """
    if agg["self_sq"] == 0.0 or agg["ref_sq"] == 0.0:
        return 1.0, agg["rel_l2"]
    c = agg["dot"] / agg["self_sq"]
    resid_sq = max(agg["ref_sq"] - agg["dot"] ** 2 / agg["self_sq"], 0.0)
    return c, math.sqrt(resid_sq / agg["ref_sq"])
