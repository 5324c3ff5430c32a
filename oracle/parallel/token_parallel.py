"""Token-parallel float64 replay: one step's tokens split over N ranks, every rank computing its
share of every layer (``oracle replay CAPTURE --dtype fp64 --split tokens --nproc N``, or torchrun).

What each rank holds and computes (oracle/replay/token_split.py runs the step):
  tokens      rank r owns 2 of the sequence's 2N near-equal contiguous blocks, r and 2N-1-r (the
              "zigzag" split of context parallelism: causal attention costs grow along the sequence,
              so an early block and a late one balance the ranks); its local sequence is those two
              blocks in order. Per-token math (embedding, norms, rotary from the recorded positions,
              q/k/v/o projections, MLP, head and loss) runs on its rows only.
  attention   its query rows against every key: keys and values are all-gathered (``gather_rows``)
              before the kernel; in the backward each rank's partial key/value gradients go back to
              the ranks that own those rows and are summed there in rank order (``scatter_sum_rows``).
              The exact chunked kernel (oracle/replay/attention.py) runs on the rank's rows with the
              whole sequence's sample boundaries (causal, packed).
  loss        each rank sums its rows' token losses; ``mean`` divides by the whole step's loss-token
              count, so the ranks' losses add up to the step's loss (gathered, summed in rank order).
  weights     in memory every rank holds the whole float64 model; after the backward each parameter's
              partial gradients are gathered to rank 0 and summed there in rank order (``reduce_grads``).
              Streamed (--max-memory, oracle/replay/streaming/driver.py): each rank materialises a
              unit's weights per unit and journals its partial shards; rank 0 adds them in rank order
              at the end (oracle/replay/streaming/partials.py): the same sums, the same bounds.
              A rank's decoder layers run by row chunks of its rows there (streaming/layers.py), so
              its working set is its rows' share plus the whole sequence's K, V and their gradients.

Numerics: every op runs in float64 under the same PrecisionMode as the single process; what
differs is the order of some sums: a weight gradient is the sum of N per-rank partial sums (each
over the rank's tokens), a key/value gradient likewise, and the loss. Hence results are within
BOUND_REL of the single process (measured ~1e-15), not bitwise; for a given N and thread count the
order is fixed (rank order, no reduction left to gloo's algorithm), so two runs are bitwise equal.

Exchanged per decoder layer (forward): K and V of every other rank's tokens, (N-1)/N x T x kv_width
values; backward: K and V again (they are not kept: memory per rank stays 1/N) and the partial
dK/dV rows for each owner. Per step: each parameter's gradient once, to rank 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

BOUND_REL = 1e-12  # per parameter, ||g_split - g|| / ||g||, and the loss: sums split over ranks (measured ~1e-15)


def blocks(T: int, ranks: int) -> list[tuple[int, int]]:
    """2N near-equal contiguous blocks of 0..T-1 (some empty when T < 2N)."""
    cuts = [round(k * T / (2 * ranks)) for k in range(2 * ranks + 1)]
    return list(zip(cuts, cuts[1:]))


def spans_of(T: int, ranks: int, r: int) -> list[tuple[int, int]]:
    """Rank r's rows of a T-token sequence: blocks r and 2N-1-r, ascending, empty ones dropped."""
    b = blocks(T, ranks)
    return [s for s in (b[r], b[2 * ranks - 1 - r]) if s[1] > s[0]]


def rows_of(T: int, ranks: int, r: int) -> torch.Tensor:
    """Rank r's token indices (ascending), int64."""
    return torch.cat([torch.arange(a, b) for a, b in spans_of(T, ranks, r)] or [torch.zeros(0, dtype=torch.long)])


class Layout:
    """Who owns which rows of a T-token sequence; all ranks build the same one."""

    def __init__(self, T: int, ranks: int, me: int):
        self.T, self.ranks, self.me = T, ranks, me
        self.rows = [rows_of(T, ranks, r) for r in range(ranks)]
        self.counts = [int(x.numel()) for x in self.rows]


def gather_rows(x: torch.Tensor, layout: Layout, dim: int) -> torch.Tensor:
    """Every rank's rows of ``x`` (this rank's along ``dim``) put together in sequence order: the
    whole (.., T, ..) tensor on every rank. No autograd (callers differentiate by hand)."""
    xt = x.movedim(dim, 0).contiguous()  # (t, ...)
    n = max(layout.counts)
    pad = xt.new_zeros((n, *xt.shape[1:]))
    pad[: xt.shape[0]] = xt
    parts = [torch.empty_like(pad) for _ in range(layout.ranks)]
    dist.all_gather(parts, pad)  # gloo needs equal sizes: padded to the largest share
    full = xt.new_empty((layout.T, *xt.shape[1:]))
    for r, p in enumerate(parts):
        full[layout.rows[r]] = p[: layout.counts[r]]
    return full.movedim(0, dim)


def scatter_sum_rows(full: torch.Tensor, layout: Layout, dim: int) -> torch.Tensor:
    """The opposite of gather_rows for a gradient: each rank holds a partial (.., T, ..) tensor; the
    result on rank r is the sum over all ranks of their partials' rows of r, added in rank order
    0, 1, ..., N-1 (fixed, not gloo's reduction order)."""
    ft = full.movedim(dim, 0)  # (T, ...)
    send = torch.cat([ft[rows] for rows in layout.rows]).contiguous()  # rows for rank 0, then 1, ...
    t = layout.counts[layout.me]
    recv = send.new_empty((t * layout.ranks, *ft.shape[1:]))
    dist.all_to_all_single(recv, send, [t] * layout.ranks, layout.counts)
    parts = recv.view(layout.ranks, t, *ft.shape[1:])
    acc = parts[0].clone()
    for p in parts[1:]:
        acc += p
    return acc.movedim(0, dim)


def reduce_grads(named: list[tuple[str, torch.Tensor | None, torch.nn.Parameter]]) -> dict[str, torch.Tensor] | None:
    """Each parameter's partial gradients summed in rank order on rank 0 (None elsewhere).
    ``named``: (name, this rank's partial gradient or None when none of its tokens reached it, the
    parameter). A parameter no rank reached has no gradient, as in the single process."""
    me, ranks = dist.get_rank(), dist.get_world_size()
    has = torch.tensor([g is not None for _, g, _ in named], dtype=torch.uint8)
    flags = [torch.empty_like(has) for _ in range(ranks)]
    dist.all_gather(flags, has)
    out: dict[str, torch.Tensor] = {}
    for i, (name, g, p) in enumerate(named):
        if not any(bool(f[i]) for f in flags):
            continue
        mine = g if g is not None else torch.zeros_like(p, dtype=torch.float64)
        assert mine.dtype == torch.float64, f"gradient of {name} is {mine.dtype} under token parallelism, expected float64"
        mine = mine.contiguous()
        parts = [torch.empty_like(mine) for _ in range(ranks)] if me == 0 else None
        dist.gather(mine, parts, dst=0)
        if me == 0:
            acc = parts[0].clone()
            for q in parts[1:]:
                acc += q
            out[name] = acc
    return out if me == 0 else None


def sum_scalars(x: float) -> float:
    """The ranks' values gathered and added in rank order (the same float on every rank)."""
    t = torch.tensor([x], dtype=torch.float64)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return float(total)


def gather_ints(x: int) -> list[int]:
    """Every rank's integer, in rank order (the same list on every rank)."""
    t = torch.tensor([x], dtype=torch.int64)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return [int(p) for p in parts]


def gather_lists(items: list[str]) -> list[list[str]]:
    """Every rank's list of names (JSON over the store-free gloo path: bytes padded to the longest)."""
    import json

    data = torch.frombuffer(bytearray(json.dumps(items).encode()), dtype=torch.uint8)
    n = torch.tensor([data.numel()], dtype=torch.int64)
    ns = [torch.empty_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(ns, n)
    m = int(max(int(x) for x in ns))
    pad = torch.zeros(m, dtype=torch.uint8)
    pad[: data.numel()] = data
    parts = [torch.empty_like(pad) for _ in ns]
    dist.all_gather(parts, pad)
    return [json.loads(bytes(p[: int(k)].tolist()).decode()) for p, k in zip(parts, ns)]
