"""``torch_npu.npu_fusion_attention`` (FlashAttention-score) in plain torch, forward and backward.

Signature as torch_npu's: ``(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647, next_tockens=2147483647,
inner_precise=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
gen_mask_parallel=True, sync=False)``; returns ``(attention_out, softmax_max, softmax_sum,
softmax_out, seed, offset, numels)``.

Layouts: BSH (B, S, N*D), SBH (S, B, N*D), BSND, BNSD, and TND (T, N, D): packed samples, whose
cumulative ends are ``actual_seq_qlen`` / ``actual_seq_kvlen`` (a leading 0, as MindSpeed passes
``cu_seqlens.tolist()``, is an empty first sample; a pad singleton is a 1-token sample; the last end
must be T). Key/value may have fewer heads than ``head_num`` (GQA: N a multiple of N_kv).

Which key j a query i sees (i, j counted within a sample in TND, within a row otherwise);
``atten_mask`` True/1 = masked out:
- sparse_mode 0 (default): i - pre_tockens <= j <= i + next_tockens, and not atten_mask[i, j];
- 1 (all mask): not atten_mask[i, j];
- 2 (left-up causal): j <= i;  3 (right-down causal): j <= i + (S_kv - S_q);
- 4 (band, right-down aligned): i + d - pre_tockens <= j <= i + d + next_tockens, d = S_kv - S_q.
(modes 2-4 take their shape from the mode; the compressed 2048x2048 mask they are given is not read.)
Modes 5-8, pse, padding_mask, prefix and keep_prob < 1 (dropout) raise: nothing on the user's step
uses them.

Numerics: S = scale * Q K^T in the compute dtype (fp32, fp64 for fp64 inputs); P = softmax over the
keys a query sees (a query that sees none gets P = 0, output 0); O = P V rounded once to q's dtype.
softmax_max / softmax_sum (the row max and the sum of exp(S - max)) are fp32 of shape (T, N, 8) in
TND, (B, N, S_q, 8) otherwise, each value repeated 8 times as the NPU stores them. Backward
recomputes P in the compute dtype: dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)),
dQ = scale dS K, dK = scale dS^T Q (summed over a K/V head's query group).
"""

from __future__ import annotations

import torch

from . import faults

_BIG = 2147483647


def _segments(cum, total, what):
    cum = [int(c) for c in (cum.tolist() if torch.is_tensor(cum) else cum)]
    if not cum or cum[-1] != total or any(b < a for a, b in zip([0] + cum, cum)):
        raise ValueError(f"npu_fusion_attention: {what} {cum} must be non-decreasing cumulative sample ends "
                         f"ending at the token count {total}")  # fmt: skip
    starts = [0] + cum[:-1]
    return list(zip(starts, cum))


def _sample_allowed(sq, skv, mode, pre, nxt, mask, device):
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(skv, device=device)[None, :]
    if mode == 0:
        ok = (j >= i - pre) & (j <= i + nxt)
        if mask is not None:
            ok = ok & ~mask[..., :sq, :skv].bool()
    elif mode == 1:
        if mask is None:
            raise ValueError("npu_fusion_attention: sparse_mode 1 (all mask) needs atten_mask")
        ok = ~mask[..., :sq, :skv].bool()
    elif mode == 2:
        ok = j <= i
    elif mode == 3:
        ok = j <= i + (skv - sq)
    elif mode == 4:
        d = skv - sq
        ok = (j >= i + d - pre) & (j <= i + d + nxt)
    else:
        raise NotImplementedError(f"npu_fusion_attention stand-in: sparse_mode {mode} is not implemented "
                                  "(0-4 are; the user's step uses 0 or 2/3)")  # fmt: skip
    return ok


def _to_bnsd(t, layout):
    """(B, S, N, D) | (B, N, S, D) | (T, N, D) -> (B, N, S, D); TND as one row of T tokens."""
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BNSD":
        return t
    return t.transpose(0, 1).unsqueeze(0)  # TND (T, N, D) -> (1, N, T, D)


def _from_bnsd(o, layout):
    if layout == "BSND":
        return o.transpose(1, 2)
    if layout == "BNSD":
        return o
    return o.squeeze(0).transpose(0, 1)  # (1, N, T, D) -> TND (T, N, D)


def _allowed(layout, sq, skv, mode, pre, nxt, mask, qlen, kvlen, device, cross_boundary=False, causal_leak=False,
             kv_offset=False):
    """Boolean (B|1, 1, S_q, S_kv): which keys each query sees. In TND the samples' blocks on the
    diagonal, each shaped by the mode; ``cross_boundary`` (a planted fault) also lets each sample's
    first query see the previous sample's last key; ``kv_offset`` (a planted fault: each later
    sample's key window starts at the previous boundary, an index off by one into the cumulative
    ``actual_seq_kvlen``) lets every query of each later sample see the whole previous sample. Other layouts: ``causal_leak`` (a planted fault) drops the causal
    mask: every query also sees the keys after it."""
    if layout != "TND":
        m = mask
        if m is not None and m.dim() == 2:
            m = m[None, None]
        ok = _sample_allowed(sq, skv, mode, pre, nxt, m, device)
        ok = ok if ok.dim() == 4 else ok[None, None]
        if causal_leak:  # the causal mask dropped: each query also sees every key after it
            ok = torch.ones_like(ok)
        return ok
    if qlen is None or kvlen is None:
        raise ValueError("npu_fusion_attention: TND layout needs actual_seq_qlen and actual_seq_kvlen")
    qs, ks = _segments(qlen, sq, "actual_seq_qlen"), _segments(kvlen, skv, "actual_seq_kvlen")
    if len(qs) != len(ks):
        raise ValueError(f"npu_fusion_attention: actual_seq_qlen has {len(qs)} samples, actual_seq_kvlen {len(ks)}")
    m = None if mask is None else (mask if mask.dim() == 2 else mask.reshape(mask.shape[-2:]))
    ok = torch.zeros(sq, skv, dtype=torch.bool, device=device)
    prev_last_key = prev_start = None
    for (q0, q1), (k0, k1) in zip(qs, ks):
        if q1 > q0 and k1 > k0:
            ok[q0:q1, k0:k1] = _sample_allowed(q1 - q0, k1 - k0, mode, pre, nxt, m, device)
            if cross_boundary and prev_last_key is not None:
                ok[q0, prev_last_key] = True
            if kv_offset and prev_last_key is not None:
                ok[q0:q1, prev_start:k0] = True
            prev_last_key, prev_start = k1 - 1, k0
    return ok[None, None]


def _probs(s, ok):
    s = s.masked_fill(~ok, float("-inf"))
    mx = s.amax(dim=-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    e = torch.exp(s - mx) * ok
    sm = e.sum(dim=-1, keepdim=True)
    p = torch.where(sm > 0, e / torch.where(sm > 0, sm, torch.ones_like(sm)), torch.zeros_like(e))
    return p, mx, sm


def _expand_kv(t, n):
    return t.repeat_interleave(n // t.shape[1], dim=1) if t.shape[1] != n else t


class _FusionAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ok, scale, layout, rebuild):
        from . import compute_dtype

        c = compute_dtype(q, k, v)
        qb, kb, vb = (_to_bnsd(t, layout).to(c) for t in (q, k, v))  # (B, N|N_kv, S, D)
        n = qb.shape[1]
        kx, vx = _expand_kv(kb, n), _expand_kv(vb, n)
        s = scale * qb @ kx.transpose(-1, -2)  # (B, N, Sq, Skv)
        p, mx, sm = _probs(s, ok)
        o = p @ vx  # (B, N, Sq, D)
        ctx.save_for_backward(q, k, v, o)
        ctx.meta = (ok, scale, layout, rebuild)
        mx, sm = mx.float(), sm.float()
        ctx.mark_non_differentiable(mx, sm)
        return _from_bnsd(o, layout).to(q.dtype), mx, sm

    @staticmethod
    def backward(ctx, dout, _dmax, _dsum):
        from . import compute_dtype

        q, k, v, o = ctx.saved_tensors
        ok, scale, layout, rebuild = ctx.meta
        if layout == "TND":
            if faults.hit("attention_cross_boundary"):
                ok = rebuild(cross=True)
            if faults.hit("attention_kv_offset"):
                ok = rebuild(offset=True)
        elif faults.hit("attention_causal_leak"):
            ok = rebuild(leak=True)
        c = compute_dtype(q, k, v)
        qb, kb, vb, do = (_to_bnsd(t, layout).to(c) for t in (q, k, v, dout))
        n, nkv = qb.shape[1], kb.shape[1]
        kx, vx = _expand_kv(kb, n), _expand_kv(vb, n)
        p, _, _ = _probs(scale * qb @ kx.transpose(-1, -2), ok)  # (B, N, Sq, Skv)
        dv = p.transpose(-1, -2) @ do
        dp = do @ vx.transpose(-1, -2)
        ds = p * (dp - (do * o).sum(dim=-1, keepdim=True))
        dq = scale * ds @ kx
        dk = scale * ds.transpose(-1, -2) @ qb
        if nkv != n:  # each K/V head's gradient is the sum over its query group
            dk = dk.reshape(dk.shape[0], nkv, n // nkv, *dk.shape[2:]).sum(2)
            dv = dv.reshape(dv.shape[0], nkv, n // nkv, *dv.shape[2:]).sum(2)
        return (_from_bnsd(dq, layout).to(q.dtype), _from_bnsd(dk, layout).to(k.dtype),
                _from_bnsd(dv, layout).to(v.dtype), None, None, None, None)  # fmt: skip


TND_SEQ_QLEN: list = []  # actual_seq_qlen of each TND call in this process


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1.0, keep_prob=1.0, pre_tockens=_BIG, next_tockens=_BIG, inner_precise=0, prefix=None,
                         actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                         sync=False):  # fmt: skip
    from . import CALLS

    for name, val in (("pse", pse), ("padding_mask", padding_mask), ("prefix", prefix)):
        if val is not None:
            raise NotImplementedError(f"npu_fusion_attention stand-in: {name} is not implemented (unused on the user's step)")
    if keep_prob != 1.0:
        raise NotImplementedError(f"npu_fusion_attention stand-in: keep_prob={keep_prob} (dropout) is not implemented")
    layout = input_layout.upper()
    n = int(head_num)
    if layout in ("BSH", "SBH"):  # through BSND, so that K/V carry their own head count (GQA)
        d = query.shape[-1] // n
        qn, kn, vn = (t.reshape(*t.shape[:-1], t.shape[-1] // d, d) for t in (query, key, value))  # (.., .., N, D)
        if layout == "SBH":
            qn, kn, vn = (t.transpose(0, 1) for t in (qn, kn, vn))  # (B, S, N, D)
        out = npu_fusion_attention(qn, kn, vn, n, "BSND", atten_mask=atten_mask, scale=scale, pre_tockens=pre_tockens,
                                   next_tockens=next_tockens, sparse_mode=sparse_mode)  # fmt: skip
        o = out[0].transpose(0, 1) if layout == "SBH" else out[0]
        return (o.reshape(*o.shape[:-2], n * d), *out[1:])
    CALLS["npu_fusion_attention"] += 1  # once per call: BSH/SBH came through BSND above
    if layout == "TND":  # which packed boundaries the caller passed (a step's report shows them)
        TND_SEQ_QLEN.append([int(x) for x in actual_seq_qlen] if actual_seq_qlen is not None else None)
    if layout not in ("BSND", "BNSD", "TND"):
        raise ValueError(f"npu_fusion_attention: input_layout {input_layout!r} is not one of BSH, SBH, BSND, BNSD, TND")
    if query.shape[-2 if layout != "BNSD" else 1] != n:
        raise ValueError(f"npu_fusion_attention: head_num {n} does not match the query's {tuple(query.shape)} ({layout})")
    sq, skv = _to_bnsd(query, layout).shape[2], _to_bnsd(key, layout).shape[2]

    def build(cross=False, leak=False, offset=False):
        return _allowed(layout, sq, skv, int(sparse_mode), int(pre_tockens), int(next_tockens), atten_mask,
                        actual_seq_qlen, actual_seq_kvlen, query.device, cross_boundary=cross, causal_leak=leak,
                        kv_offset=offset)  # fmt: skip

    out, mx, sm = _FusionAttention.apply(query, key, value, build(), float(scale), layout, build)
    if layout == "TND":  # stats (1, N, T, 1) -> (T, N, 1)
        mx, sm = (t.squeeze(0).transpose(0, 1) for t in (mx, sm))
    return out, mx.expand(*mx.shape[:-1], 8).contiguous(), sm.expand(*sm.shape[:-1], 8).contiguous(), \
        query.new_empty(0), 0, 0, 0
