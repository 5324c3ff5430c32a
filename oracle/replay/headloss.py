"""The LM head and its cross-entropy by vocabulary chunks: the N x V logits never exist in full.

What is computed, in which dtype
  ``head_loss(hidden (N, H), weight (V, H), labels (N,))`` = sum over rows n with
  labels[n] != ignore_index of  w_n * (logsumexp_v(hidden[n] . weight[v]) - hidden[n] . weight[labels[n]]),
  divided by the number of those rows for ``reduction="mean"`` (w_n = 1 unless ``token_weight``).
  Labels are already aligned with the rows (label n is the token row n predicts): the caller
  shifts them (``causal_lm_head_loss`` does the shift ``causal_lm_loss`` does).
  Logits are produced in the dtype of hidden and weight (float64 in the oracle, float32 in
  emulated replays); as oracle/replay/loss.py does, float16/bfloat16 logits are upcast to float32 before
  the log-sum-exp (one chunk at a time), and their gradient is cast back.

Forward, per block of rows R and vocabulary chunk C = [v0, v1), chunks in order:
    Z   = hidden[R] weight[C]^T                      (|R| x |C|, the only logits that exist)
    m'  = max(m, rowmax Z);  s = s * exp(m - m') + rowsum exp(Z - m');  m = m'
    t   = Z[r, labels[r]] where the label falls in C
  lse = m + log s; loss = sum_r w_r (lse_r - t_r). Only lse (one value per row) is saved.
Backward, recomputing each chunk's Z (g = the loss's incoming gradient):
    dZ = g w_r (exp(Z - lse) - onehot(labels))      (|R| x |C|)
    grad_hidden[R] += dZ weight[C];  grad_weight[C] += dZ^T hidden[R]
  grad_weight[C] is final when chunk C's row blocks are done (the vocabulary loop is outermost),
  so it is written chunk by chunk; rows with an ignored label take no compute and get zero.

Difference from the full-logits loss (F.cross_entropy on hidden @ weight^T): the same terms
summed in another order (the log-sum-exp over chunks, the gradient sums over chunks), so the loss
and gradients equal it to a few ulp of the dtype, not bitwise; measured in float64 ~1e-16
relative (tests/unit/test_headloss.py asserts <= 1e-13).

Tensor parallel (oracle/parallel/tensor_parallel.py): a head weight split by vocabulary rows over the ranks
(a DTensor) is computed shard by shard, each rank its own rows; the per-row running max and sum
are combined over the ranks (all-reduce max, then the rescaled sums) exactly as chunks are, the
target logit comes from the rank holding it, and the gradient of hidden is summed over the ranks.

Memory: O(rows x chunk) for one logit block (default 4096 x 4096: 128 MiB in float64) plus
O(N) row statistics; the backward's gradients are the size of hidden and weight. In an exact
replay (the float64 oracle: ``_exact``) the logit block and the
per-block products dZ weight[C], dZ^T hidden[R] are written into buffers allocated once per call
and the elementwise steps run in place: the same ops on the same values in the same order (bitwise
the same loss and gradients), without a fresh 128 MiB allocation per op, which the kernel faults
and zeroes 4 KiB at a time (measured on benchmark b's head: ~70 ms of a ~75 ms subtraction).
Emulated replays keep the out-of-place ops: the logit GEMMs and the gradient GEMMs rounded by their
PrecisionMode, the cross-entropy's steps between them run as the device's float32 kernel (``device_ce``).

Weight by rows (``RowSource``, the streaming replay): the weight is never whole. ``rows(v0, v1)``
gives chunk C's rows (read from the capture and upcast where they are needed: once in the forward,
once in the backward) and ``grad(v0, v1, g)`` takes grad_weight[C] as soon as it is final (written
to the oracle by chunks). The same ops in the same order as with a weight tensor: bitwise equal.
Memory: one chunk of the weight and of its gradient instead of both whole (2 x 4.6 GiB for
Qwen3-VL-8B's head in float64).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..capture.packing import IGNORE
from ..errors import RecipeError
from ..precision.mode import emulating, kernel_io, outside
from .attention import exact

CHUNK = 4096
ROW_CHUNK = 4096
_LOW = (torch.float16, torch.bfloat16)


class HeadLossInputError(RecipeError):
    """Hidden states, head weight or labels that do not fit together."""


class RowSource:
    """A (V, H) head weight read and its gradient written by vocabulary rows (see the docstring)."""

    shape: torch.Size
    dtype: torch.dtype
    ndim = 2

    def rows(self, v0: int, v1: int) -> torch.Tensor:
        raise NotImplementedError

    def grad(self, v0: int, v1: int, g: torch.Tensor) -> None:
        raise NotImplementedError

    def done(self) -> None:
        """Every chunk's gradient was given."""


def _rows(weight, v0: int, v1: int) -> torch.Tensor:
    return weight.rows(v0, v1) if isinstance(weight, RowSource) else weight[v0:v1]


def _logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    z = h @ w.T  # (rows, chunk) in the input dtype
    return z.float() if z.dtype in _LOW else z  # the loss convention: low-precision logits upcast to float32


@contextlib.contextmanager
def device_ce():
    """The cross-entropy's steps as a device runs them in an emulated replay: one fused float32 kernel
    (Megatron's vocab-parallel cross-entropy and transformers' loss upcast the logits, ``.float()``)
    that reads the bf16 logits and writes the float32 loss, the softmax's running max, sum and
    log-sum-exp unrounded inside; its gradient of the logits is written once in the low format
    (``kernel_io``). Yields the emulating mode (None in the oracle, where this is a no-op). Rounding
    every step instead (the mode's default) put each row's log-sum-exp a bf16 ulp off (about 1 % of
    every probability of the row) and the loss itself in bf16: a member's loss 5.6e-4..5.1e-3 from the
    truth on the tiny Qwen3-VL where honest devices are 4e-6..1.3e-4, so no loss band could be measured
    from the members (now 4e-6..8e-6: tests/unit/test_score.py)."""
    mode = emulating()
    if mode is None:
        yield None
        return
    with outside():
        yield mode


def _exact(hidden: torch.Tensor, weight) -> bool:
    """Buffers and in-place steps are used: the float64 oracle only (plain float64 tensors, no
    PrecisionMode that rounds: attention.exact). Emulated replays compute in float32 under a mode that
    rounds and jitters every op's result, and keep their out-of-place ops exactly as before."""
    w_ok = isinstance(weight, RowSource) or type(weight) is torch.Tensor or type(weight) is torch.nn.Parameter
    plain = type(hidden) in (torch.Tensor, torch.nn.Parameter) and w_ok and hidden.dtype == torch.float64
    return plain and exact()


class _Buffers:
    """The call's reusable blocks: views of the front of one allocation per role."""

    def __init__(self, like: torch.Tensor):
        self.like, self.bufs = like, {}

    def get(self, role: str, rows: int, cols: int) -> torch.Tensor:
        buf = self.bufs.get(role)
        if buf is None or buf.numel() < rows * cols:
            buf = self.bufs[role] = self.like.new_empty(rows * cols)
        return buf[: rows * cols].view(rows, cols)


def _mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b, out=out)  # a @ b, the same GEMM, into ``out``


def _spans(n: int, step: int):
    return [(a, min(a + step, n)) for a in range(0, n, step)]


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, token_weight, chunk, row_chunk, group=None):
        # hidden (N', H), labels (N',) and token_weight (N',) already restricted to rows with a label;
        # with a ``group`` (tensor parallel) weight is this rank's vocabulary shard and labels are
        # relative to its first id (labels of other shards fall outside [0, V) and match no chunk)
        n, V = hidden.shape[0], weight.shape[0]
        acc = torch.float32 if hidden.dtype in _LOW else hidden.dtype
        m = torch.full((n,), -torch.inf, dtype=acc, device=hidden.device)
        s = torch.zeros(n, dtype=acc, device=hidden.device)
        target = torch.zeros(n, dtype=acc, device=hidden.device)
        fast = _Buffers(hidden) if _exact(hidden, weight) else None
        for v0, v1 in _spans(V, chunk):
            w = _rows(weight, v0, v1)  # (c, H)
            for r0, r1 in _spans(n, row_chunk):
                if fast is not None:
                    z = _mm(fast.get("z", r1 - r0, v1 - v0), hidden[r0:r1], w.T)  # (r, c)
                else:
                    z = _logits(hidden[r0:r1], w)  # (r, c)
                with device_ce():
                    m_new = torch.maximum(m[r0:r1], z.amax(-1))
                if fast is not None:  # the target is read before z is overwritten in place
                    lab = labels[r0:r1]
                    rows = ((lab >= v0) & (lab < v1)).nonzero().reshape(-1)
                    target[r0 + rows] = z[rows, lab[rows] - v0]
                    s[r0:r1] = s[r0:r1] * torch.exp(m[r0:r1] - m_new) + z.sub_(m_new.unsqueeze(-1)).exp_().sum(-1)
                    m[r0:r1] = m_new
                    continue
                # emulated replays: the logits are the GEMM's result as the mode rounded it (the device's
                # bf16 logits); the cross-entropy steps are the device's fused float32 kernel (see device_ce)
                with device_ce():
                    s[r0:r1] = s[r0:r1] * torch.exp(m[r0:r1] - m_new) + torch.exp(z - m_new.unsqueeze(-1)).sum(-1)
                    m[r0:r1] = m_new
                    lab = labels[r0:r1]
                    inside = (lab >= v0) & (lab < v1)  # (r,)
                    rows = inside.nonzero().reshape(-1)
                    target[r0 + rows] = z[rows, lab[rows] - v0]
        if group is not None:  # the shards' running (max, sum) combined exactly as chunks are
            m_all = m.clone()
            dist.all_reduce(m_all, dist.ReduceOp.MAX, group)
            with device_ce():
                s = s * torch.exp(m - m_all)
            dist.all_reduce(s, dist.ReduceOp.SUM, group)
            dist.all_reduce(target, dist.ReduceOp.SUM, group)  # one shard holds each row's target, the others 0
            m = m_all
        with device_ce():
            lse = m + torch.log(s)  # (N',)
            per_row = lse - target
            loss = (per_row * token_weight).sum() if token_weight is not None else per_row.sum()
        source = weight if isinstance(weight, RowSource) else None
        ctx.save_for_backward(hidden, None if source else weight, labels, lse, token_weight)
        ctx.args = (chunk, row_chunk, group, source)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        hidden, weight, labels, lse, token_weight = ctx.saved_tensors
        chunk, row_chunk, group, source = ctx.args
        weight = source if source is not None else weight
        n, V = hidden.shape[0], weight.shape[0]
        scale = g * token_weight if token_weight is not None else g.expand(n)  # (N',) dL/dloss_row
        gh = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        gw = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        fast = _Buffers(hidden) if _exact(hidden, weight) else None
        for v0, v1 in _spans(V, chunk):
            w = _rows(weight, v0, v1)  # (c, H)
            gc = torch.zeros_like(w) if source is not None else None  # grad_weight[C], given away when final
            for r0, r1 in _spans(n, row_chunk):
                h = hidden[r0:r1]
                if fast is not None:  # the same steps in place, in the call's buffers
                    lab = labels[r0:r1]
                    rows = ((lab >= v0) & (lab < v1)).nonzero().reshape(-1)
                    dz = _mm(fast.get("z", r1 - r0, v1 - v0), h, w.T).sub_(lse[r0:r1].unsqueeze(-1)).exp_()
                    dz[rows, lab[rows] - v0] -= 1
                    dz.mul_(scale[r0:r1].unsqueeze(-1))
                    if gh is not None:
                        gh[r0:r1] += _mm(fast.get("gh", r1 - r0, h.shape[1]), dz, w)
                    if gw is not None or gc is not None:
                        dw = _mm(fast.get("gw", v1 - v0, h.shape[1]), dz.T, h)
                        if gw is not None:
                            gw[v0:v1] += dw
                        if gc is not None:
                            gc += dw
                    continue
                z = _logits(h, w)  # the GEMM, rounded by the mode as in the forward
                with device_ce() as mode:
                    dz = torch.exp(z - lse[r0:r1].unsqueeze(-1))  # (r, c): softmax probabilities
                    lab = labels[r0:r1]
                    rows = ((lab >= v0) & (lab < v1)).nonzero().reshape(-1)
                    dz[rows, lab[rows] - v0] -= 1
                    dz = kernel_io(mode, (dz * scale[r0:r1].unsqueeze(-1)).to(hidden.dtype))  # written once, low
                if gh is not None:
                    gh[r0:r1] += dz @ w
                if gw is not None:
                    gw[v0:v1] += dz.T @ h
                if gc is not None:
                    gc += dz.T @ h
            if gc is not None:
                source.grad(v0, v1, gc)
        if source is not None:
            source.done()
        if gh is not None and group is not None:
            dist.all_reduce(gh, dist.ReduceOp.SUM, group)  # hidden's gradient: the sum over the shards
        return gh, gw, None, None, None, None, None


def head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = IGNORE,
    reduction: str = "mean",
    chunk: int = CHUNK,
    *,
    row_chunk: int = ROW_CHUNK,
    token_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden (N, H) @ weight (V, H)^T`` against ``labels (N,)`` (already shifted:
    label n is the target of row n), by vocabulary chunks of ``chunk`` and row blocks of ``row_chunk``.

    ``reduction``: ``sum`` over rows with a label, or ``mean`` = that sum / their number (1 if none).
    ``token_weight (N,)``: optional per-row factor of the sum (Megatron's float loss mask)."""
    if reduction not in ("sum", "mean"):
        raise HeadLossInputError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise HeadLossInputError(
            f"hidden {tuple(hidden.shape)} must be (N, H) and the head weight {tuple(weight.shape)} (V, H) with the same H; "
            "flatten the batch and sequence dimensions of hidden first"
        )
    if hidden.dtype != weight.dtype or not hidden.is_floating_point():  # a RowSource states shape and dtype too
        raise HeadLossInputError(f"hidden ({hidden.dtype}) and the head weight ({weight.dtype}) must share one floating dtype")
    if labels.shape != hidden.shape[:1] or labels.is_floating_point():
        raise HeadLossInputError(f"labels {tuple(labels.shape)} {labels.dtype} must be integer class ids, one per hidden row")
    if token_weight is not None and token_weight.shape != labels.shape:
        raise HeadLossInputError(f"token_weight {tuple(token_weight.shape)} must have one value per row {tuple(labels.shape)}")
    if chunk < 1 or row_chunk < 1:
        raise HeadLossInputError(f"chunk sizes must be positive, got chunk={chunk}, row_chunk={row_chunk}")
    V = weight.shape[0]
    weight, offset, group = _vocabulary_shard(weight) if not isinstance(weight, RowSource) else (weight, 0, None)
    keep = labels != ignore_index
    bad = labels[keep & ((labels < 0) | (labels >= V))]
    if bad.numel():
        raise HeadLossInputError(
            f"labels hold {bad.numel()} ids outside the vocabulary [0, {V}) that are not ignore_index={ignore_index}, "
            f"e.g. {bad[:4].tolist()}"
        )
    rows = keep.nonzero().reshape(-1)
    tw = None if token_weight is None else token_weight[rows].to(torch.float32 if hidden.dtype in _LOW else hidden.dtype)
    total = _HeadLoss.apply(hidden[rows], weight, labels[rows] - offset, tw, int(chunk), int(row_chunk), group)
    if reduction == "mean":
        with device_ce():  # the device's mean: in float32, as its loss kernel wrote the sum
            total = total / max(int(rows.numel()), 1)
    return total


def _vocabulary_shard(weight: torch.Tensor):
    """A head weight split by vocabulary rows over a tensor-parallel mesh (a DTensor placed Shard(0),
    oracle/parallel/tensor_parallel.py) -> (this rank's rows, their first id, the mesh's group); else as is."""
    if type(weight).__name__ != "DTensor":
        return weight, 0, None
    from torch.distributed.tensor import Shard

    if tuple(weight.placements) != (Shard(0),) or weight.shape[0] % weight.device_mesh.size():
        raise HeadLossInputError(
            f"a tensor-parallel head weight must be split evenly by vocabulary rows, got {weight.placements}"
        )
    local = weight.to_local()  # differentiable: its gradient comes back as this rank's shard
    return local, weight.device_mesh.get_local_rank() * local.shape[0], weight.device_mesh.get_group()


def causal_lm_head_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, reduction: str, chunk: int = CHUNK, **kw
) -> tuple[torch.Tensor, int]:
    """``causal_lm_loss(hidden @ weight.T, labels, reduction)`` without the logits: hidden (B, T, H),
    labels (B, T) unshifted; position t predicts label t+1. Returns (loss, number of loss tokens)."""
    h = hidden[..., :-1, :].reshape(-1, hidden.shape[-1])  # (B*(T-1), H)
    y = labels[..., 1:].reshape(-1)  # (B*(T-1),)
    loss = head_loss(h, weight, y, IGNORE, reduction, chunk, **kw)
    return loss, int((y != IGNORE).sum())


def masked_token_head_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, reduction: str,
    chunk: int = CHUNK, **kw,
) -> tuple[torch.Tensor, int]:  # fmt: skip
    """``masked_token_loss(hidden @ weight.T, labels, loss_mask, reduction)`` without the logits:
    labels already aligned with positions, loss = sum_t mask_t CE_t (``sum``) or that / sum_t mask_t
    as an integer (``mean``), exactly as oracle/replay/loss.py's Megatron convention."""
    if reduction not in ("sum", "mean"):
        raise HeadLossInputError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    h = hidden.reshape(-1, hidden.shape[-1])  # (B*T, H)
    mask = loss_mask.reshape(-1)
    y = torch.where(mask != 0, labels.reshape(-1), IGNORE)  # (B*T,): rows of mask 0 take no compute
    loss = head_loss(h, weight, y, IGNORE, "sum", chunk, token_weight=mask, **kw)
    n_tokens = int(loss_mask.sum())
    if reduction == "mean":
        loss = loss / max(n_tokens, 1)
    return loss, n_tokens
