"""Exact attention by chunks: softmax(q k^T * scale + mask) v in O(T x chunk) memory.

Two kernels compute it, on one grid of query chunks. Where no rounding PrecisionMode is active (the float64
truth, a streamed member's fused core run outside its mode) and torch's CPU flash kernel takes the heads:
that kernel per query chunk (attention_flash.py; 1.24x this module's loop in float64, 1.37x in float32).
Elsewhere (an emulated replay rounding op by op, a torch that cannot group heads): the loop below, whose
docstring follows.

What is computed, in which dtype
  Every operation runs in the dtype of q, k, v (float64 in the oracle, float32 in emulated
  replays, where PrecisionMode rounds each op as it would any other). Nothing is cast: there is
  no float32 softmax here (transformers' eager attention casts to float32; this does not).
  The mask is structural only: causal or not, and block-diagonal over packed samples given by
  ``cu_seqlens`` = [0, l1, l1+l2, ..., T]. Query i of sample s sees keys j of sample s with
  j <= i (causal) or all of them (not causal). Key chunks that a query chunk cannot see (above
  the diagonal, other samples) are never computed, so the cost follows the real work.

Forward (FlashAttention-2 recurrence), per sample, per query chunk Q_i, over key chunks K_j:
    S   = (Q_i * scale) K_j^T                       (masked entries -> -inf)
    m'  = max(m, rowmax S);  P = exp(S - m')
    l   = l * exp(m - m') + rowsum P
    acc = acc * exp(m - m') + P V_j;  m = m'
    out = acc / l;  lse = m + log(l)                (only lse is kept for the backward)
Backward, recomputing S chunk by chunk from q, k, v and lse (nothing T x T is stored):
    P = exp(S - lse);  Dlt_i = rowsum(dO_i * O_i)
    dV_j += P^T dO_i;  dP = dO_i V_j^T;  dS = P * (dP - Dlt_i)
    dQ_i += dS K_j (times scale once at the end);  dK_j += dS^T (Q_i * scale)
GEMM forms: every product whose result is narrow (head dim D columns: P V, dV = P^T dO, dQ = dS K,
dK = dS^T Q) is computed as its transpose, D rows wide (V^T P^T, dO^T P, K^T dS^T, Q^T dS), and read
back transposed: the same products and sums, a layout the BLAS runs 1.4-2x faster on float64 (MKL on
2 cores at D = 64 and 128, ``python benchmarks/attention_gemm.py``), since it then streams
the wide block once instead of writing a D-column strip per pass. The forward keeps its accumulator
transposed for that (acc^T, D x rows). Not bitwise the earlier layout (the BLAS blocks the sums
differently), within the bound below.
GQA: q is laid out once as (B, Hkv, T, H/Hkv, D), so a chunk of queries of the H/Hkv heads that
share a key/value head is one (chunk_q * H/Hkv, D) matrix against that head's K_j, V_j: the
repeated k/v of transformers' repeat_kv never exist, and no block is copied.

Difference from unchunked attention: the same sums in another order, and the softmax
normalisation applied once at the end instead of to every probability. Each output element is
within a few ulp of the dtype times (sum |p v| / |sum p v|) of eager attention in the same
dtype; measured against eager float64: ~1e-16 relative (tests/unit/test_attention.py asserts
<= 1e-13 for outputs and gradients). Not bitwise.

Memory: one (B, Hkv, chunk_q * H/Hkv, chunk_k) score block at a time (two in the backward: P
and dS), plus O(T x H x D) accumulators; the backward adds dQ, dK, dV (the size of q, k, v).
With chunk 512 and 32 query heads a float64 score block is 64 MiB. The blocks are written into
buffers allocated once per call (``_into``: the same batched GEMM torch.matmul runs, with an
``out``): a new 64 MiB block per key chunk would be a fresh mmap, faulted and zeroed by the kernel
4 KiB at a time, for every key chunk of every query chunk.

transformers: ``register()`` adds ``NAME`` ("oracle_chunked") to ``AttentionInterface`` and to
``AttentionMaskInterface`` (a mask function that builds no mask: it checks the pattern asked
for is causal or bidirectional, optionally per packed sample, and returns None). Set
``model.config._attn_implementation`` and its sub-configs to ``NAME`` (``use(model)`` does it).
Sample boundaries of a packed text sequence come from, in order: ``cu_seq_lens_q`` /
``cu_seqlens`` keyword arguments; the ``packed(cu_seqlens)`` context (causal calls only: the
ViT's per-image calls are not causal and never take it); the ``position_ids`` keyword
(2-D text positions) by transformers' own rule (a new sample starts where a position is not
the previous one plus 1), the rule its mask builder uses to detect packing. Inside ``rows_call(fn)``
causal calls go to ``fn`` instead (a decoder layer run by row chunks, streaming/layers.py).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
from collections.abc import Sequence

import torch

from ..errors import RecipeError
from ..precision.mode import as_stored, emulating
from . import attention_flash
from .fused_gqa import FusedGQA

NAME = "oracle_chunked"
FUSED = "oracle_fused"  # an emulated streamed replay's attention: transformers' sdpa, its decoder layers by row chunks
CHUNK = 512


class AttentionLayoutError(RecipeError):
    """Attention inputs this implementation cannot compute exactly (a mask tensor, padding,
    a KV cache, sample boundaries that do not cover the sequence)."""


# -- the kernel ---------------------------------------------------------------------------


def _segments(cu: list[int], causal: bool, T: int, S: int) -> list[tuple[int, int, int, int]]:
    """(query start, query end, key start, key end) of each sample."""
    if len(cu) > 2 or causal:
        return [(cu[s], cu[s + 1], cu[s], cu[s + 1]) for s in range(len(cu) - 1) if cu[s + 1] > cu[s]]
    return [(0, T, 0, S)]


def _blocks(seg, causal: bool, cq: int, ck: int, rows: tuple[int, int] | None = None):
    """Yield (i0, i1, [(j0, j1, needs_mask), ...]) for one sample: the key chunks each query chunk sees.
    ``rows`` = (a, b): only queries a <= i < b exist (a token-parallel rank's rows); the query chunk
    grid stays the whole sample's, clipped to them."""
    q0, q1, k0, k1 = seg
    for i0 in range(q0, q1, cq):
        i1 = min(i0 + cq, q1)
        if rows is not None:
            i0, i1 = max(i0, rows[0]), min(i1, rows[1])
            if i0 >= i1:
                continue
        kend = i1 if causal else k1  # causal: keys up to the last query of the chunk
        ks = []
        for j0 in range(k0, kend, ck):
            j1 = min(j0 + ck, kend)
            ks.append((j0, j1, causal and j1 - 1 > i0))  # some key after some query: mask
        yield i0, i1, ks


def _query_chunks(cu: list[int], causal: bool, T: int, S: int, cq: int, rows) -> list[tuple[int, int, int, int]]:
    """(i0, i1, k0, k1) per query chunk of every sample, on ``_blocks``' grid: the keys it sees are k0..k1 (causal:
    k1 = i1). The flash kernel's calls (attention_flash.py)."""
    segs = _segments(cu, causal, S if rows else T, S)
    return [(i0, i1, ks[0][0], ks[-1][1]) for seg in segs for i0, i1, ks in _blocks(seg, causal, cq, cq, rows)]


def _flash(q: torch.Tensor, k: torch.Tensor) -> bool:
    """This call runs torch's flash kernel (attention_flash.py): no rounding mode between its steps (``exact``)
    and a kernel that takes these heads. Under an emulating mode the loop below runs, rounded op by op."""
    return exact() and attention_flash.usable(q, k)


def _causal_fill_(s: torch.Tensor, g: int, i0: int, i1: int, j0: int, j1: int, value: float) -> torch.Tensor:
    """In place: entries of a (B, Hkv, tq*g, sk) block whose key comes after its query -> value."""
    qi = torch.arange(i0, i1, device=s.device).view(-1, 1, 1)  # (tq, 1, 1)
    kj = torch.arange(j0, j1, device=s.device).view(1, 1, -1)  # (1, 1, sk)
    s.view(*s.shape[:2], i1 - i0, g, j1 - j0).masked_fill_(kj > qi, value)  # rows are (query, head of the group)
    return s


def exact() -> bool:
    """No rounding PrecisionMode is active (the float64 oracle, or no mode): writing a block into a
    buffer (``out=``) or in place gives the same bits as the out-of-place op. An emulated replay's mode
    rounds (and jitters) every op's result; an op writing into ``out=`` would escape that, so there
    the ops stay out of place."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    mode = _get_current_dispatch_mode()
    return mode is None or getattr(mode, "round_to", None) is None


def _buffer(q: torch.Tensor, Hkv: int, rows: int, cols: int) -> torch.Tensor:
    """Room for the largest (B, Hkv, rows, cols) score block of a call, allocated once."""
    return q.new_empty(q.shape[0] * Hkv * rows * cols)


def _into(buf: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (B, Hkv, n, D) @ b (B, Hkv, D, sk) written into the front of ``buf``, returned as a
    (B, Hkv, n, sk) view: the batched GEMM torch.matmul folds these operands into (bitwise the same
    product), with no new block allocated. ``buf`` None (an emulated replay, ``exact``): torch.matmul."""
    if buf is None:
        return torch.matmul(a, b)
    B, Hkv, n, _ = a.shape
    out = buf[: B * Hkv * n * b.shape[-1]].view(B, Hkv, n, b.shape[-1])
    torch.bmm(a.flatten(0, 1), b.flatten(0, 1), out=out.view(B * Hkv, n, b.shape[-1]))
    return out


def _grouped(q: torch.Tensor, Hkv: int) -> torch.Tensor:
    """(B, H, T, D) -> (B, Hkv, T, g, D), contiguous: a chunk of queries of all g heads sharing a kv
    head is then one (tq*g, D) matrix against that head's keys (no repeated k/v, no copy per block)."""
    B, H, T, D = q.shape
    return q.view(B, Hkv, H // Hkv, T, D).permute(0, 1, 3, 2, 4).contiguous()


def _ungrouped(x: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, T, g, D) -> (B, H, T, D): head h = kv head h // g, as transformers' repeat_kv."""
    B, Hkv, T, g, D = x.shape
    return x.permute(0, 1, 3, 2, 4).reshape(B, Hkv * g, T, D)


def _forward(q, k, v, cu, causal, scale, cq, ck, q0=0):
    """``q0``: q holds the queries q0 .. q0+T-1 of a sequence of S keys (0 for the whole sequence)."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rows = None if q0 == 0 and T == S else (q0, q0 + T)
    if _flash(q, k):
        return attention_flash.forward(q, k, v, _query_chunks(cu, causal, T, S, cq, rows), causal, scale, q0)
    g = H // Hkv
    qg = _grouped(q, Hkv) * scale  # (B, Hkv, T, g, D), a new tensor (never scale q in place): S = (q * scale) k^T
    out = torch.zeros(B, Hkv, T, g, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((B, Hkv, T, g), -math.inf, dtype=q.dtype, device=q.device)
    sbuf = _buffer(q, Hkv, min(cq, T) * g, min(ck, S)) if q.dtype == torch.float64 and exact() else None
    for seg in _segments(cu, causal, S if rows else T, S):
        for i0, i1, ks in _blocks(seg, causal, cq, ck, rows):
            a, b = i0 - q0, i1 - q0  # the chunk's rows in q
            qi = qg[:, :, a:b].reshape(B, Hkv, (i1 - i0) * g, D)  # (B, Hkv, tq*g, D), a view
            m = torch.full(qi.shape[:-1], -math.inf, dtype=q.dtype, device=q.device)  # (B, Hkv, tq*g)
            lsum = torch.zeros_like(m)
            accT = torch.zeros(B, Hkv, v.shape[-1], qi.shape[2], dtype=q.dtype, device=q.device)  # acc^T (B, Hkv, Dv, tq*g)
            for j0, j1, needs_mask in ks:
                s = _into(sbuf, qi, k[:, :, j0:j1].transpose(-1, -2))  # (B, Hkv, tq*g, sk)
                if needs_mask:
                    _causal_fill_(s, g, i0, i1, j0, j1, -math.inf)
                m_new = torch.maximum(m, s.amax(-1))  # finite: every row sees its first key
                p = s.sub_(m_new.unsqueeze(-1)).exp_()  # P = exp(S - m'), in place of S
                alpha = torch.exp(m - m_new)
                lsum = lsum.mul_(alpha).add_(p.sum(-1))
                accT = accT.mul_(alpha.unsqueeze(-2)).add_(torch.matmul(v[:, :, j0:j1].transpose(-1, -2), p.transpose(-1, -2)))  # (P V)^T
                m = m_new
            out[:, :, a:b] = (accT / lsum.unsqueeze(-2)).transpose(-1, -2).reshape(B, Hkv, i1 - i0, g, -1)
            lse[:, :, a:b] = (m + torch.log(lsum)).view(B, Hkv, i1 - i0, g)
    return _ungrouped(out), lse  # (B, H, T, Dv), (B, Hkv, T, g)


def _backward(dout, q, k, v, out, lse, cu, causal, scale, cq, ck, q0=0, dk=None, dv=None):
    """``q0`` as in _forward: dq for q's rows, dk and dv for all S keys (these rows' share of them).
    ``dk``, ``dv`` (the shape of k, v): accumulators the share is added into (new zeros when None).
    Query chunks are visited last to first, so a key's gradient is summed from its latest query
    chunk down: the order a caller visiting row chunks last to first (streaming/layers.py) repeats."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rows = None if q0 == 0 and T == S else (q0, q0 + T)
    if lse.ndim == 3:  # (B, H, T): the flash kernel's forward (``_flash``); its backward
        chunks = _query_chunks(cu, causal, T, S, cq, rows)
        return attention_flash.backward(dout, q, k, v, out, lse, chunks, causal, scale, q0, dk, dv)
    g = H // Hkv
    qg, dog = _grouped(q, Hkv) * scale, _grouped(dout, Hkv)  # (B, Hkv, T, g, D); q * scale as in the forward
    delta = (dog * _grouped(out, Hkv)).sum(-1)  # (B, Hkv, T, g): rowsum(dO * O)
    dq = torch.zeros_like(qg)
    dk = torch.zeros_like(k) if dk is None else dk  # dS^T (q * scale): already scaled
    dv = torch.zeros_like(v) if dv is None else dv
    fast = q.dtype == torch.float64 and exact()
    pbuf = _buffer(q, Hkv, min(cq, T) * g, min(ck, S)) if fast else None
    dsbuf = _buffer(q, Hkv, min(cq, T) * g, min(ck, S)) if fast else None
    for seg in _segments(cu, causal, S if rows else T, S):
        for i0, i1, ks in reversed(list(_blocks(seg, causal, cq, ck, rows))):
            n, a, b = (i1 - i0) * g, i0 - q0, i1 - q0
            qi, doi = qg[:, :, a:b].reshape(B, Hkv, n, D), dog[:, :, a:b].reshape(B, Hkv, n, -1)  # (B, Hkv, tq*g, D)
            li, di = lse[:, :, a:b].reshape(B, Hkv, n, 1), delta[:, :, a:b].reshape(B, Hkv, n, 1)
            dqi = dq[:, :, a:b].view(B, Hkv, n, D)
            for j0, j1, needs_mask in ks:
                kj, vj = k[:, :, j0:j1], v[:, :, j0:j1]  # (B, Hkv, sk, D)
                p = _into(pbuf, qi, kj.transpose(-1, -2)).sub_(li).exp_()  # (B, Hkv, tq*g, sk)
                if needs_mask:
                    _causal_fill_(p, g, i0, i1, j0, j1, 0.0)
                dv[:, :, j0:j1] += torch.matmul(doi.transpose(-1, -2), p).transpose(-1, -2)  # (dO^T P)^T: sums over queries and the g heads
                ds = _into(dsbuf, doi, vj.transpose(-1, -2)).sub_(di).mul_(p)  # dS = P * (dP - Dlt)
                dqi += torch.matmul(kj.transpose(-1, -2), ds.transpose(-1, -2)).transpose(-1, -2)  # (K^T dS^T)^T
                dk[:, :, j0:j1] += torch.matmul(qi.transpose(-1, -2), ds).transpose(-1, -2)  # (Q^T dS)^T
    return _ungrouped(dq.mul_(scale)), dk, dv


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, causal, scale, cq, ck):
        out, lse = _forward(q, k, v, cu, causal, scale, cq, ck)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (cu, causal, scale, cq, ck)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def _validate_cu(cu_seqlens, T: int) -> list[int]:
    cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise AttentionLayoutError(
            f"cu_seqlens {cu[:8]}{'...' if len(cu) > 8 else ''} must start at 0, never decrease and end at the "
            f"sequence length {T}; pass the cumulative sample lengths [0, l1, l1+l2, ..., {T}]"
        )
    return cu


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    scale: float | None = None,
    chunk_q: int = CHUNK,
    chunk_k: int = CHUNK,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for q (B, H, T, D), k and v (B, Hkv, S, D) -> (B, H, T, Dv).

    ``cu_seqlens`` (packed samples, requires S == T) applies to every batch row."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise AttentionLayoutError(f"q, k, v must be (B, H, T, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, T, D = q.shape
    if k.shape[:2] != v.shape[:2] or k.shape[2] != v.shape[2] or k.shape[0] != B or k.shape[3] != D:
        raise AttentionLayoutError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not fit q {tuple(q.shape)}")
    if H % k.shape[1]:
        raise AttentionLayoutError(f"{H} query heads are not a multiple of {k.shape[1]} key/value heads")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise AttentionLayoutError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if chunk_q < 1 or chunk_k < 1:
        raise AttentionLayoutError(f"chunk sizes must be positive; got {chunk_q}, {chunk_k}")
    S = k.shape[2]
    if (causal or cu_seqlens is not None) and S != T:
        raise AttentionLayoutError(
            f"causal or packed attention needs as many keys as queries (no KV cache); got {S} keys, {T} queries"
        )
    cu = _validate_cu(cu_seqlens, T) if cu_seqlens is not None else [0, T]
    scale = D**-0.5 if scale is None else float(scale)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _ChunkedAttention.apply(q, k, v, cu, bool(causal), scale, int(chunk_q), int(chunk_k))


# -- transformers integration ---------------------------------------------------------------

_state = threading.local()


@contextlib.contextmanager
def packed(cu_seqlens: torch.Tensor | Sequence[int]):
    """Within this block, causal calls of the registered attention treat the sequence as packed
    samples with these boundaries (``[0, l1, l1+l2, ..., T]``); non-causal calls (the ViT) ignore it."""
    cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    with _swapped("cu", cu):
        yield


@contextlib.contextmanager
def rows_call(fn):
    """Within this block, causal calls of the registered attention go to ``fn(query, key, value,
    scale, chunk) -> (B, H, t, Dv)`` (a decoder layer run by row chunks, streaming/layers.py, which
    knows the chunk's rows and the whole sequence's keys); the mask checks above still apply."""
    with _swapped("rows", fn):
        yield


@contextlib.contextmanager
def _swapped(attr: str, value):
    """``_state.<attr>`` set to ``value`` within the block, the previous value back after it."""
    prev = getattr(_state, attr, None)
    setattr(_state, attr, value)
    try:
        yield
    finally:
        setattr(_state, attr, prev)


def softmax_scale(query: torch.Tensor, scaling) -> float:
    """The softmax scale: ``scaling``, or head_dim^-1/2 (chunked_attention's default)."""
    return query.shape[-1] ** -0.5 if scaling is None else float(scaling)


def packed_from_position_ids(position_ids: torch.Tensor) -> list[int] | None:
    """Sample boundaries of a (1, T) text position row by transformers' rule (a sample starts
    where a position is not the previous plus one); None when it is a single sample."""
    pos = position_ids.reshape(-1)
    starts = (torch.nonzero(pos[1:] != pos[:-1] + 1).reshape(-1) + 1).tolist()
    if not starts:
        return None
    return [0, *starts, pos.numel()]


def _boundaries(query: torch.Tensor, causal: bool, kwargs: dict) -> list[int] | None:
    T = query.shape[2]
    for key in ("cu_seq_lens_q", "cu_seqlens"):
        if kwargs.get(key) is not None:
            return _validate_cu(kwargs[key], T)
    from_ctx = getattr(_state, "cu", None) if causal else None
    pos = kwargs.get("position_ids")
    from_pos = None
    if causal and isinstance(pos, torch.Tensor) and pos.ndim == 2 and pos.shape[-1] == T:
        if pos.shape[0] != 1 and not (pos == pos[:1]).all():
            raise AttentionLayoutError("position_ids differ across the batch; pack one sequence per call (batch 1)")
        from_pos = packed_from_position_ids(pos[0])
    if from_ctx is not None:
        from_ctx = _validate_cu(from_ctx, T)
        if from_pos is not None and from_pos != from_ctx:
            raise AttentionLayoutError(
                f"the packed() boundaries {from_ctx} disagree with those the position_ids imply {from_pos}; "
                "restart positions at each sample boundary, or fix the boundaries"
            )
        return from_ctx
    return from_pos


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None, **kwargs):
    """transformers' attention-function signature: query (B, H, T, D) -> ((B, T, H, D), None)."""
    if attention_mask is not None:
        raise AttentionLayoutError(
            f"{NAME} takes no attention-mask tensor (got {tuple(attention_mask.shape)}): register() its mask "
            "function, pass no padding mask, and give packed samples as cu_seqlens or position_ids"
        )
    if dropout and module.training:
        raise AttentionLayoutError(f"{NAME} computes no dropout (got p={dropout}); a replayed step has none")
    for unsupported in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise AttentionLayoutError(f"{NAME} does not implement {unsupported}={kwargs[unsupported]!r}")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    chunk = int(getattr(module, "oracle_attention_chunk", CHUNK))
    rows = getattr(_state, "rows", None)
    if rows is not None and causal:  # a decoder layer run by row chunks (streaming/layers.py) takes the call
        return rows(query, key, value, softmax_scale(query, scaling), chunk).transpose(1, 2).contiguous(), None
    cu = _boundaries(query, causal, kwargs)
    out = chunked_attention(query, key, value, causal=causal, cu_seqlens=cu, scale=scaling, chunk_q=chunk, chunk_k=chunk)
    return out.transpose(1, 2).contiguous(), None  # (B, T, H, D)


# From this torch on, the CPU flash kernel takes grouped-query attention (enable_gqa=True, fewer k/v heads;
# measured: 2.13.0 and 2.14.1 run _scaled_dot_product_flash_attention_for_cpu, 2.8.0 its math path). These
# torches keep transformers' own sdpa as it is, and nothing below runs a torch op there.
FUSED_GQA_SINCE = attention_flash.GQA_SINCE  # one version rule for the fused op and the flash kernel


@functools.cache
def _fused_gqa_on_cpu() -> bool:
    """Whether this torch runs a grouped-query sdpa call on CPU as its fused kernel
    (``_scaled_dot_product_flash_attention_for_cpu``, the op PrecisionMode rounds once and explain's
    ``attention`` class names). torch 2.8 does not: it falls back to the math path (bmm, softmax, bmm), which an
    emulation rounds op by op. From ``FUSED_GQA_SINCE`` on: yes, by the version alone. Below it torch's own
    kernel choice is asked, with every mode set aside (``as_stored``): a probe run under an emulating
    PrecisionMode would round its tensors and draw the member's jitter once per process, at whatever op first
    asked, and two processes of one run would no longer agree bitwise."""
    if attention_flash._takes_gqa():
        return True
    with as_stored():
        q, k = torch.zeros(1, 2, 2, 8), torch.zeros(1, 1, 2, 8)  # (B, H, T, D): two query heads share one k/v head
        try:
            choice = torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=True)
        except (AttributeError, TypeError, RuntimeError):  # pragma: no cover - a torch without the query
            return True
    return choice != int(torch.nn.attention.SDPBackend.MATH)


def sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' "sdpa", a grouped-query call the one fused CPU op on every supported torch. From
    ``FUSED_GQA_SINCE`` on (``_fused_gqa_on_cpu``) it is transformers' own function, called as before. Below it,
    where transformers would ask for grouped-query attention (``use_gqa_in_sdpa``: no mask): under an emulating
    mode the fused kernel with the mode's rounding points at the kernel's boundary, as 2.13 has them
    (replay/fused_gqa.py); where nothing rounds, k/v repeated to the query's heads (transformers' repeat_kv):
    the same values, the one fused op."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward, use_gqa_in_sdpa

    if not _fused_gqa_on_cpu():
        g = query.shape[1] // key.shape[1]  # (B, H, T, D) against (B, Hkv, T, D)
        # transformers 5 asks (mask, key, value), 4.57 (the user's training env) (mask, key)
        ask = (attention_mask, key, value)[: len(inspect.signature(use_gqa_in_sdpa).parameters)]
        gqa = getattr(module, "num_key_value_groups", 1) > 1 and use_gqa_in_sdpa(*ask)
        if g > 1 and query.device.type == "cpu" and gqa:
            mode = emulating()
            if mode is not None and not dropout and query.shape[2] == key.shape[2]:
                causal = query.shape[2] > 1 and bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
                out = FusedGQA.apply(query, key, value, mode, causal, scaling)  # (B, H, T, D)
                return out.transpose(1, 2).contiguous(), None  # (B, T, H, D), as transformers' sdpa returns it
            key, value = repeat_kv(key, g), repeat_kv(value, g)  # (B, H, T, D)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)  # fmt: skip


def keep_sdpa_fused() -> None:
    """Where this torch's CPU kernel cannot take grouped-query attention (``_fused_gqa_on_cpu``: torch 2.8),
    transformers' "sdpa" becomes ``sdpa_forward`` (the fused kernel under an emulating mode, k/v repeated first
    elsewhere), so a recipe's model runs its attention as the fused op on every supported torch. A torch that
    takes it (2.13, 2.14.1) keeps transformers' own function, untouched. The recipes call it when they build."""
    if _fused_gqa_on_cpu():
        return
    from transformers import AttentionInterface

    AttentionInterface.register("sdpa", sdpa_forward)


def fused_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None, **kwargs):
    """``FUSED``: an emulated replay's attention (in memory and streamed). transformers' own sdpa (one
    fused op, which the PrecisionMode rounds at its operands and output only, as a device's flash
    attention), except that
      - a causal call inside ``rows_call`` goes to the decoder layer run by row chunks
        (streaming/layers.py: the same fused kernel, emulated there by ``precision.mode.kernel_io``);
      - packed samples (``_boundaries``) are one causal sdpa call each, as a device's varlen kernel
        (flash attention's cu_seqlens, MindSpeed's TND layout) runs them: no T x T mask is ever built
        (65536 tokens: 4 GiB), and the work grows with the samples' lengths squared, not the
        sequence's (a 96-sample step through a masked sdpa computed 96x the attention the device does).
        Each call's output is rounded once by the mode; their concatenation moves no value."""
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    rows = getattr(_state, "rows", None)
    if rows is not None and causal:
        chunk = int(getattr(module, "oracle_attention_chunk", CHUNK))
        return rows(query, key, value, softmax_scale(query, scaling), chunk).transpose(1, 2).contiguous(), None
    cu = _boundaries(query, True, kwargs) if causal and attention_mask is None else None
    if cu is None or len(cu) <= 2:
        return sdpa_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                            is_causal=is_causal, **kwargs)  # fmt: skip
    # split, not slices: split's backward is one cat, a slice's a zero tensor of all T rows per sample
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    parts = zip(*(t.split(lengths, dim=2) for t in (query, key, value)))
    outs = [sdpa_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True)[0] for q, k, v in parts]
    return torch.cat(outs, dim=1), None  # (B, T, H, D)


def _probe_pattern(mask_function, n: int, causal: bool) -> None:
    """Check in O(n) probes that ``mask_function`` is causal (or bidirectional) within samples
    and blocks across them, the only patterns attention_forward computes."""
    if n < 2:
        return
    z = torch.zeros((), dtype=torch.long)
    i = torch.arange(1, n)
    # a sample starts at i where position i cannot see i-1 (its causal neighbour)
    starts = [0, *(i[~mask_function(z, z, i, i - 1).bool()]).tolist(), n]
    sample = torch.zeros(n, dtype=torch.long)
    for s, (a, b) in enumerate(zip(starts, starts[1:])):
        sample[a:b] = s
    gen = torch.Generator().manual_seed(0)
    qi = torch.cat([torch.arange(n), torch.randint(0, n, (4096,), generator=gen)])
    kj = torch.cat([torch.arange(n).flip(0), torch.randint(0, n, (4096,), generator=gen)])
    want = sample[qi] == sample[kj]
    if causal:
        want &= kj <= qi
    got = mask_function(z, z, qi, kj).bool()
    if not torch.equal(got, want):
        raise AttentionLayoutError(
            f"{NAME}: the model asks for an attention pattern other than {'causal' if causal else 'bidirectional'} "
            "attention within packed samples (sliding window, image overlays, ...); this implementation cannot compute it"
        )


def mask_forward(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs):
    """transformers' mask-function signature; builds no mask (returns None) after checking there is
    no padding, no cache offset, and a pattern attention_forward computes from its boundaries."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    if attention_mask is not None and not bool(attention_mask.all()):
        raise AttentionLayoutError(f"{NAME} does not take padded batches: the attention_mask has zeros; pack samples instead")
    if q_length != kv_length or int(q_offset) or int(kv_offset):
        raise AttentionLayoutError(f"{NAME} computes a training step without a KV cache (q {q_length}, kv {kv_length} tokens)")
    if mask_function is causal_mask_function or mask_function is bidirectional_mask_function or mask_function is None:
        return None
    z, i = torch.zeros((), dtype=torch.long), torch.arange(1, max(q_length, 1))
    causal = not bool(mask_function(z, z, i - 1, i).any())  # no query sees its next key
    _probe_pattern(mask_function, q_length, causal)
    return None


def register(name: str = NAME) -> str:
    """Add the attention and mask functions to transformers' registries (idempotent); returns the name.
    ``FUSED`` registers ``fused_attention_forward`` (an emulated streamed replay), any other name the
    exact kernel's ``attention_forward``; both with ``mask_forward`` (no mask tensor built)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, fused_attention_forward if name == FUSED else attention_forward)
    AttentionMaskInterface.register(name, mask_forward)
    return name


def use(model: torch.nn.Module, name: str = NAME) -> torch.nn.Module:
    """Route every attention of ``model`` (its config and sub-configs: text, vision) through ``name``.
    After ``register()``, transformers' own ``model.set_attn_implementation(NAME)`` does the same."""
    register(name)
    seen = set()
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is None or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        for c in [cfg, *(getattr(cfg, s, None) for s in getattr(cfg, "sub_configs", {}) or {})]:
            if c is not None:
                c._attn_implementation = name
    return model
