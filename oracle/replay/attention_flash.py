"""Exact attention by query chunks through torch's CPU flash kernel: the truth's and a streamed member's core.

What runs: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, torch's own C++ FlashAttention-2
loop (blocked GEMMs with the online softmax fused between them, in the inputs' dtype with an accumulator of that
dtype or wider: float64 stays float64, float32 float32). Measured beside ``attention._forward`` / ``_backward`` (the
Python-level loop over the same blocks; one 4096-token causal sample, 32 query heads on 8 key/value heads of 128,
forward + backward, 2 cores, ``python benchmarks/attention_gemm.py flash``): float64 0.95-1.0x of the float64 GEMM
probe against 0.48x; float32 0.85x against 0.28x. The Python loop stays for calls under a rounding PrecisionMode
(op by op) and for a torch whose kernel cannot take grouped-query heads (``usable``).

The grid (the query chunks, ``attention._query_chunks``): each sample's queries in chunks of ``chunk`` rows from the
sample's start (a token-parallel rank's rows clipped to its own), the same grid whether the sample is run whole, by
row chunks of a streamed layer, or by a rank. Query chunk [i0, i1) of a causal sample starting at k0 is two kernel
calls: the prefix, keys [k0, i0), all visible (not causal); the diagonal, keys [i0, i1), causal (the kernel's
top-left alignment is this block's, square). A non-causal chunk is one call on its sample's keys. The two partial
results merge exactly (the softmax over the union):
    lse = logaddexp(lse_p, lse_d);  out = out_p * exp(lse_p - lse) + out_d * exp(lse_d - lse)
The backward calls the kernel's backward once per part (a long prefix by ``KEYS`` keys) with the MERGED out and lse:
it forms P = exp(S - lse) and Dlt = rowsum(dO * O) from them, so each call's dq, dk, dv are the exact gradients of
its keys' share of the union (dq summed over the calls, dk, dv added into the keys' accumulators). Chunks are visited last to first, so a key's
gradient is summed from its latest query chunk down, the order a caller visiting row chunks last to first
(streaming/layers.py) repeats: a streamed layer's truth is bitwise its unchunked one.

Numbers against the eager softmax(q k^T) v in float64: the kernel's sums are blocked, the normalisation applied
once; measured ~1e-15 relative on outputs and gradients (tests/unit/test_attention.py asserts <= 1e-13 against the
Python loop and against eager). The kernel's result does not depend on the thread count (it parallelises over
heads and query blocks, each sum in one thread): tested at 1 and 2 threads, bitwise.
"""

from __future__ import annotations

import torch

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
GQA_SINCE = (2, 13)  # torch's CPU flash kernel takes k, v with fewer heads than q from here (2.8 does not)
# The backward's kernel returns dk, dv for the keys it is given, new tensors added into the accumulators: a chunk's
# prefix is given KEYS keys at a time, so that temporary stays 2 x KEYS x Hkv x D (Qwen3-VL-8B: 64 MiB in float64)
# whatever the sample's length: less than the Python loop's two score blocks it replaces (2 x 64 MiB at CHUNK 512),
# which the row chunk's working set in streaming/budget.py was measured with
KEYS = 4096


def _takes_gqa() -> bool:
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= GQA_SINCE


def usable(q: torch.Tensor, k: torch.Tensor) -> bool:
    """The kernel computes this call: on CPU, q and k's heads equal or a torch that groups them."""
    return q.device.type == "cpu" and (q.shape[1] == k.shape[1] or _takes_gqa())


def _parts(i0: int, i1: int, k0: int, k1: int, causal: bool) -> list[tuple[int, int, bool]]:
    """(key start, key end, causal) of the kernel calls one query chunk [i0, i1) is (module docstring)."""
    if not causal:
        return [(k0, k1, False)]
    return ([(k0, i0, False)] if i0 > k0 else []) + [(i0, i1, True)]


def forward(q, k, v, chunks, causal: bool, scale: float, q0: int = 0):
    """q (B, H, T, D) holding queries q0.., k, v (B, Hkv, S, D); ``chunks`` [(i0, i1, k0, k1)] in sequence rows.
    -> out (B, H, T, Dv), lse (B, H, T) in q's dtype."""
    B, H, T, _ = q.shape
    out = q.new_zeros(B, H, T, v.shape[-1])
    lse = q.new_full((B, H, T), float("-inf"))
    for i0, i1, k0, k1 in chunks:
        a, b = i0 - q0, i1 - q0
        qi = q[:, :, a:b]
        o = m = None
        for j0, j1, c in _parts(i0, i1, k0, k1, causal):
            op, lp = _FWD(qi, k[:, :, j0:j1], v[:, :, j0:j1], 0.0, c, scale=scale)  # (B, H, n, Dv), (B, H, n)
            if o is None:
                o, m = op, lp
                continue
            merged = torch.logaddexp(m, lp)  # the union's logsumexp
            o = o * torch.exp(m - merged).unsqueeze(-1) + op * torch.exp(lp - merged).unsqueeze(-1)
            m = merged
        out[:, :, a:b], lse[:, :, a:b] = o, m
    return out, lse


def backward(dout, q, k, v, out, lse, chunks, causal: bool, scale: float, q0: int = 0, dk=None, dv=None):
    """Gradients of ``forward``: dq (B, H, T, D) for q's rows; this call's share of every key's dk, dv added into
    ``dk``, ``dv`` (new zeros when None). Query chunks last to first (module docstring)."""
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k) if dk is None else dk
    dv = torch.zeros_like(v) if dv is None else dv
    for i0, i1, k0, k1 in reversed(chunks):
        a, b = i0 - q0, i1 - q0
        qi, doi, oi, li = q[:, :, a:b], dout[:, :, a:b], out[:, :, a:b], lse[:, :, a:b]
        for j0, j1, c in reversed(_parts(i0, i1, k0, k1, causal)):  # the diagonal first: its keys are the latest
            for e0 in reversed(range(j0, j1, KEYS)):  # a long prefix by KEYS keys: the kernel's dk, dv of one span at a time
                e1 = min(e0 + KEYS, j1)
                gq, gk, gv = _BWD(doi, qi, k[:, :, e0:e1], v[:, :, e0:e1], oi, li, 0.0, c, scale=scale)
                dq[:, :, a:b] += gq
                dk[:, :, e0:e1] += gk
                dv[:, :, e0:e1] += gv
    return dq, dk, dv
