"""What a streamed replay holds, unit by unit: the one estimate the run and ``--dry-run`` both use.

All sizes in bytes of the compute dtype (8 for float64). For one unit u seeing n tokens (text tokens
for the language model, patches for the vision tower) with boundary width w (the input width of its
first linear layer) and widest per-token intermediate i (the widest linear output inside it):

    weights_u    its parameters, materialised for its forward and again for its recomputation
    grads_u      their gradients (the same size), held until the unit's shard is written
    working_u    its recomputation's autograd working set. A decoder layer run by row chunks of
                 c rows (layers.py: the oracle and emulated members; c = min(n, max(chunk, attention chunk))), with
                 key/value width kv (k_proj's plus v_proj's outputs):
                 LAYER_WHOLE x n x w                (its input, the arriving output gradient, dx)
               + LAYER_KV x n x kv / 2              (K, V and their gradients dK, dV, whole sequence)
               + WORKING_PER_TOKEN x c x w          (one chunk's graph: norms, q/k/v, rotary, o_proj,
               + MLP_PER_TOKEN x c x i               residuals, the MLP; and their gradients)
                 A token-parallel rank's decoder layer (n its rows of the sequence's T) by row chunks
                 as well (layers.py ``_backward_split``): K, V, dK, dV span the whole sequence,
                 LAYER_KV x T x kv / 2, and besides: its rows' dq and final dk, dv (n x (q + kv), q
                 q_proj's output width) and the exchange's buffers (T x kv: gathered parts, sent and
                 received rows).
                 Any other unit (the ViT's blocks), n rows at once:
                 WORKING_PER_TOKEN x n x w          (norms, q/k/v and their norms, rotary, attention,
                                                     o_proj, residuals, and their gradients)
               + MLP_PER_TOKEN x min(n, chunk) x i  (the MLP's gate, up, activation, product, and
                                                     gradients: per token chunk where the MLP is
                                                     token-chunked, tokens.py; else per n tokens)
    embedding    (an nn.Embedding unit, embedding.py) the used rows and their gradient (at most
                 min(n, V) rows each), its output and output gradient (2 x n x w), one written chunk
    head         the chunked head/loss by vocabulary rows (head.py, headloss.py): one chunk of the
                 weight and one of its gradient, the loss rows' hidden states and their gradient,
                 and one block of logits (headloss.ROW_CHUNK x CHUNK) x 4

The constants were measured on a Qwen3 decoder layer in float64 (hidden 1024, 8 heads of 128, 2 KV
heads, MLP 3072 and 6144, 4096 and 8192 tokens, chunk 512): the peak RSS of its recomputation and
backward minus the parameters' gradients is 15.3-16.2 x n x w x 8 B plus 6 x chunk x i x 8 B.

The row-chunked layer's terms are counted, not fitted: on Qwen3-VL-8B's shapes (2 decoder layers,
the ViT and head, 2048 tokens, `benchmarks/user_step.py cut` and `benchmarks/rss_trace.py`) the
estimate was 0.96x of the measured peak, reached in a decoder layer's backward.

The reserve a run needs besides its boundary activations is the largest of these, plus the process
itself (its resident set after the model skeleton and the resident parameters). A budget below that
is refused, by the run and by the dry run alike, with the size that would do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

WORKING_PER_TOKEN = 16
MLP_PER_TOKEN = 6
HEAD_LOGIT_BLOCKS = 4
LAYER_WHOLE = 3
LAYER_KV = 4


def _linears(mod: nn.Module) -> list[nn.Linear]:
    return [m for m in mod.modules() if isinstance(m, nn.Linear)]


def unit_need(mod: nn.Module, tokens: int, size: int, chunk: int | None, chunked: bool,
              layer_chunk: int | None = None, sequence: int | None = None) -> dict[str, int]:  # fmt: skip
    """Bytes unit ``mod`` needs while it is recomputed and backpropagated (the split above);
    ``layer_chunk``: the rows per chunk where ``mod`` is a decoder layer run by row chunks, else None;
    ``sequence``: the whole sequence's length where ``tokens`` are a token-parallel rank's rows."""
    weights = sum(p.numel() for p in mod.parameters()) * size
    if isinstance(mod, nn.Embedding):
        from .embedding import CHUNK as ROWS

        used = min(tokens, mod.num_embeddings) * mod.embedding_dim * size
        return {"weights": used, "grads": used, "working": (2 * tokens + ROWS) * mod.embedding_dim * size}
    lin = _linears(mod)
    if not lin:  # a convolution (patch embedding): its input, output and their gradients
        return {
            "weights": weights,
            "grads": weights,
            "working": 4 * tokens * max((p.shape[0] for p in mod.parameters()), default=1) * size,
        }
    w = lin[0].in_features
    i = max(m.out_features for m in lin)
    if layer_chunk and tokens > layer_chunk:
        from ..attention import CHUNK as GRID

        c = min(tokens, max(layer_chunk, GRID))
        kv = sum(m.out_features for n, m in mod.named_modules() if n.endswith(("k_proj", "v_proj")))
        S = sequence or tokens
        working = LAYER_WHOLE * tokens * w + LAYER_KV * S * kv // 2 + WORKING_PER_TOKEN * c * w + MLP_PER_TOKEN * c * i
        if sequence:
            q = sum(m.out_features for n, m in mod.named_modules() if n.endswith("q_proj"))
            working += tokens * (q + kv) + S * kv
        return {"weights": weights, "grads": weights, "working": working * size}
    rows = min(tokens, chunk) if chunked and chunk else tokens
    return {"weights": weights, "grads": weights, "working": (WORKING_PER_TOKEN * tokens * w + MLP_PER_TOKEN * rows * i) * size}


def head_need(vocab: int, hidden: int, loss_tokens: int, size: int) -> int:
    from ..headloss import CHUNK, ROW_CHUNK

    block = min(ROW_CHUNK, max(loss_tokens, 1)) * min(CHUNK, vocab)
    return (2 * min(CHUNK, vocab) * hidden + 2 * loss_tokens * hidden + HEAD_LOGIT_BLOCKS * block) * size


def reserve(model: nn.Module, units: list[str], chunked: list[str], *, text_tokens: int, patches: int, loss_tokens: int,
            size: int, chunk: int | None, head: str | None, rows: list[str] = (),
            layer_chunk: int | None = None, sequence: int | None = None) -> dict[str, Any]:  # fmt: skip
    """The largest need over the units and the head: {"bytes", "by": the unit it comes from, "needs"};
    ``rows``: the units run by row chunks of ``layer_chunk`` (layers.py); ``sequence``: the whole
    sequence's length where ``text_tokens`` are a token-parallel rank's rows."""
    needs = {}
    for u in units:
        mod = model.get_submodule(u)
        tokens = patches if "visual" in u else text_tokens
        has_chunked = any(c.startswith(u + ".") for c in chunked)
        needs[u] = sum(unit_need(mod, tokens, size, chunk, has_chunked, layer_chunk if u in rows else None,
                                 sequence if u in rows else None).values())  # fmt: skip
    if head:
        w = model.get_submodule(head).weight
        needs[head] = head_need(w.shape[0], w.shape[1], loss_tokens, size)
    by = max(needs, key=needs.get) if needs else ""
    return {"bytes": needs.get(by, 0), "by": by, "needs": needs}


def refusal(budget: int, need: int, by: str) -> str:
    """The one message a budget below the fixed part gets (run and dry run)."""
    return (
        f"--max-memory {budget / 2**30:.2f} GiB is below what the largest unit ({by}) needs alongside the process "
        f"(about {need / 2**30:.2f} GiB: resident set, its weights and gradients, its recomputation); "
        f"raise it to at least {need / 2**30 * 1.1:.1f}G"
    )


def tensor_counts(cap_inputs: dict[str, dict]) -> tuple[int, int]:
    """(text tokens, image patches) of a capture's inputs, from the manifest's shapes."""
    T = next((int(torch.tensor(e["shape"]).prod()) for n, e in cap_inputs.items() if n in ("input_ids", "tokens")), 0)
    P = int(cap_inputs["pixel_values"]["shape"][0]) if "pixel_values" in cap_inputs else 0
    return T, P


def need(cap, model: nn.Module, recipe, compute: torch.dtype, token_chunk: int | None = None, *,
         ranks: int = 1) -> dict[str, Any]:  # fmt: skip
    """The reserve of a streamed replay of ``cap`` (a Bundle) on ``model`` (its skeleton): the largest
    unit's or the head's need, named; what ``replay --max-memory`` and ``--dry-run`` both check.
    Decoder layers run by row chunks in the float64 oracle and in emulated members alike (layers.py).
    ``ranks`` > 1: one rank of the token-parallel replay (--split tokens): its share of the text
    tokens (the largest rank's rows) and of the loss tokens, the vision tower whole (replicated),
    and per decoder layer the whole sequence's gathered K and V and their partial gradients
    (oracle/replay/token_split.py); a rank's decoder layers run by row chunks as well (layers.py
    ``_backward_split``); a layer whose rows fit one chunk runs whole, plus 4 x T x kv_width for
    the whole sequence's K, V and their partial gradients."""
    from .engine import partition, token_chunked
    from .layers import CHUNK as LAYER_CHUNK
    from .layers import is_decoder_layer
    from .tokens import CHUNK

    units, _, head, resident = partition(model, recipe)
    rows = [u for u in units if is_decoder_layer(model.get_submodule(u))]  # the oracle's and an emulation's alike (layers.py)
    tensors = cap.manifest["tensors"].get("inputs", {})
    T, P = tensor_counts(tensors)
    n_loss = 0
    if "labels" in tensors:
        n_loss = int((cap.load("inputs", "labels") != -100).sum())
    size = compute.itemsize
    T_all = T
    if ranks > 1:
        from ...parallel.token_parallel import Layout

        T = max(Layout(T, ranks, 0).counts)
        n_loss = -(-n_loss // ranks)
    layer_chunk = min(token_chunk or CHUNK, LAYER_CHUNK)
    out = reserve(model, units, token_chunked(model, recipe, units), text_tokens=T, patches=P, loss_tokens=n_loss,
                  size=size, chunk=token_chunk or CHUNK, head=head, rows=rows, layer_chunk=layer_chunk,
                  sequence=T_all if ranks > 1 else None)  # fmt: skip
    if ranks > 1:
        for u in units:
            kv = [m.out_features for n, m in model.get_submodule(u).named_modules() if n.endswith(("k_proj", "v_proj"))]
            if "visual" not in u and kv and not (u in rows and T > layer_chunk):  # a layer held whole on the rank
                out["needs"][u] += 2 * T_all * sum(kv) * size  # K, V whole, and their partial gradients
        out["by"] = max(out["needs"], key=out["needs"].get)
        out["bytes"] = out["needs"][out["by"]]
    out["resident"] = sum(model.get_parameter(n).numel() for n in resident) * size
    out["units"] = units
    return out
