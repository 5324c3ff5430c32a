"""Replay a captured step on CPU: the float64 ground truth, or an emulated low-precision run.

The oracle (``dtype="fp64"``):
  1. the recipe builds the module inside ``PrecisionMode(float64)`` (precision/mode.py), so buffers such
     as rotary frequencies are computed in float64;
  2. the captured weights are upcast to float64 (exact for bf16/fp16/fp32) -- the one upcast
     boundary; the captured float inputs (pixel values) are upcast there too;
  3. forward, loss and backward run inside the mode: every float op computes in float64, casts
     that model code makes to float32 are promoted (counted in ``manifest["numerics"]``);
  4. the loss is asserted float64 before ``backward()``; gradients are written in float64.
Two replays of one capture on one machine give bitwise-identical gradients (same op order, same
thread count, no randomness).

Emulated runs (``dtype`` in bf16, fp16, amp-bf16, amp-fp16, fp32): the same step in float32
(float64 for fp32) with every operand and result of the rounded ops rounded to the target format;
see precision/mode.py for exactly what is rounded where. ``ensemble=K`` adds K-1 jittered members; their
gradient sets are the groups ``grads``, ``grads.1``, ... of one ``emulation`` bundle, which
``oracle score --band`` turns into a per-parameter noise band.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .. import precision as precisions
from ..bundle.shapes import stored_shapes
from ..bundle.store import Bundle, BundleWriter, check_not_input, check_output
from ..capture.api import versions
from ..capture.steps import build_model
from ..errors import BundleError, NotReplayable, UsageError
from ..parallel import distributed, tensor_parallel
from ..precision.mode import PrecisionMode, emulation_record
from . import fused
from .certify import finite_difference_certificate
from .inputs import check_inputs
from .loss import chunked_head
from .options import check_spread
from .setup import carry_inputs_and_weights, load_inputs, recipe_of, recorded_boundaries, use_fused, use_replay_attention

VERIFY_AUTO_MAX_PARAMS = 50_000_000  # finite differences cost 2K extra forwards: cheap below this


def run_step(
    cap: Bundle, dtype: str, jitter_seed: int | None = None, instrument=None, split=None
) -> tuple[torch.nn.Module, dict[str, torch.Tensor], float, PrecisionMode]:
    """Forward + backward of the captured step under ``dtype``; returns model (grads set), inputs, loss.
    ``instrument(model)`` runs before the forward (hooks for rank views and boundary records);
    ``split(model, inputs) -> (inputs, context)``: a token-parallel rank's rows (oracle/replay/token_split.py)."""
    recipe = recipe_of(cap)
    compute, round_to, ops = precisions.emulation(dtype)
    config = cap.manifest["recipe"]["config"]
    reduction = (cap.get("loss") or {}).get("reduction", "mean")
    build_mode = PrecisionMode(compute)
    model = build_model(
        recipe, config, lambda n: cap.load("weights", n), compute, mode=build_mode, shapes=stored_shapes(cap), init=False
    )
    inputs = load_inputs(cap, compute)
    mode = PrecisionMode(compute, round_to, ops, jitter_seed=jitter_seed, device_type=cap.capture_device())
    for n, p in model.named_parameters():  # a weight stored in a member's format is not rounded again at each use
        mode.held_in_format(p, cap.entry("weights", n)["dtype"])
    use_replay_attention(model, round_to)
    fused_path = use_fused(model, recipe, round_to)
    if instrument is not None:
        instrument(model)
    within = recorded_boundaries(inputs)  # the recorded sample boundaries (a token split takes them itself)
    if split is not None:
        inputs, within = split(model, inputs)
    torch.manual_seed(0)
    order: list[str] = []  # the order gradients are completed in: the true backward order
    hooks = [p.register_post_accumulate_grad_hook(lambda _, n=n: order.append(n)) for n, p in model.named_parameters()]
    try:
        with mode, chunked_head(), within:
            loss, _ = recipe.forward_loss(model, inputs, reduction)
            if round_to is None:
                assert loss.dtype == torch.float64, f"oracle loss is {loss.dtype}, expected float64"
            loss.backward()
    finally:
        for h in hooks:
            h.remove()
    mode.promotions += build_mode.promotions
    mode.backward_order = order
    mode.fused = fused.state() if fused_path["path"] != "unfused" else fused_path  # what ran, fallbacks included
    return model, inputs, float(loss.item()), mode


def replay(
    capture: str | Path,
    out: str | Path,
    *,
    dtype: str = "fp64",
    ensemble: int = 1,
    verify: str = "auto",
    directions: int = 3,
    overwrite: bool = False,
    progress: bool = False,
    max_memory: int | None = None,
    activation_budget: int | None = None,
    token_chunk: int | None = None,
    split: str = "tensor",
    replace_work: str = "this-step",
) -> Path:
    """Replay ``capture`` into ``out``; with ``max_memory`` (bytes) through the streaming engine.
    ``split``: how several ranks share the float64 oracle, ``tensor`` (heads, MLP columns, vocabulary:
    oracle/parallel/tensor_parallel.py) or ``tokens`` (the sequence: oracle/parallel/token_parallel.py).
    ``replace_work``: which streamed work folder of ours beside ``out`` that is not this run's is replaced:
    ``"this-step"`` (with ``overwrite`` only: one of this step and --out made by another command) or
    ``"any-ours"`` (whatever it describes, ``overwrite`` or not: only for a caller that owns the folder
    ``out`` lies in, the judge's stages); a folder this tool did not make never is (streaming/workdir.py)."""
    precisions.get(dtype)
    if replace_work not in ("this-step", "any-ours"):
        raise UsageError(f"replace_work is 'this-step' or 'any-ours', got {replace_work!r}")
    if split not in ("tensor", "tokens"):
        raise UsageError(f"--split is 'tensor' or 'tokens', got {split!r}")
    if ensemble < 1:
        raise UsageError("--ensemble must be at least 1")
    cap = Bundle(capture)
    check_not_input(out, [capture])
    check_output(out, overwrite)  # before the replay, not after hours of it
    if cap.kind not in ("capture", "oracle"):
        raise BundleError(f"{cap.path} is a {cap.kind} bundle; replay needs a capture")
    if "inputs" not in cap.groups() or not cap.names("inputs"):
        raise NotReplayable(f"{cap.path} holds no inputs (an msprobe import or its merge): it can only be scored against "
                            "an oracle of the same step; capture the step with the Megatron hook or oracle.Capture to replay it")  # fmt: skip
    check_inputs(cap)  # the inputs boundary (oracle/replay/inputs.py): before any replay path runs
    if cap.kind == "capture" and (cap.get("loss") or {}).get("value") is None:
        why = "its manifest has no 'loss'" if "loss" not in cap.manifest else "its loss was not recorded (null)"
        print(f"note: {cap.path} records no loss ({why}): the replayed loss cannot be checked against the device's; "
              "the gradients are replayed and scored as usual", file=sys.stderr, flush=True)  # fmt: skip
    t0 = time.perf_counter()
    base = {
        "recipe": cap.get("recipe"),
        "precision": dtype,
        "device": {"type": "cpu", "torch_threads": torch.get_num_threads()},
        "versions": versions(),
        "source": {"path": str(cap.path), "kind": cap.kind, "precision": cap.get("precision"), "device": cap.capture_device()},
        "fingerprint": cap.fingerprint(),
        "captured_loss": cap.get("loss"),
    }
    if cap.get("megatron"):
        base["megatron"] = cap.get("megatron")  # the rank view needs the layout the capture came from
    ranks = distributed.world()
    check_spread(dtype, ensemble, split, ranks, max_memory is not None, verify)
    distributed.init()
    if max_memory is not None:
        if verify == "on":
            raise UsageError("--verify needs the whole model in memory; the streaming replay (--max-memory) has no certificate")
        from .streaming.driver import replay_streamed

        return replay_streamed(cap, Path(out), dtype=dtype, ensemble=ensemble, budget=max_memory, overwrite=overwrite,
                               progress=progress, base=base, t0=t0, activation_budget=activation_budget,
                               token_chunk=token_chunk, split=split, replace_work=replace_work)  # fmt: skip
    if dtype == "fp64":
        summed: list[str] = []  # tensor parallel (oracle/parallel/tensor_parallel.py): gradients summed over ranks

        def tp_split(model):
            summed.extend(tensor_parallel.parallelize(model, ranks, recipe_of(cap).tp_plan))

        by_tokens = ranks > 1 and split == "tokens"
        if by_tokens:  # oracle/replay/token_split.py: each rank its rows, gradients summed on rank 0 in rank order
            from . import token_split

            with distributed.collectives("the token-parallel step"):
                model, grads, loss, mode, split_record = token_split.run(cap, run_step)
        else:
            with distributed.collectives("the tensor-parallel step"):
                model, inputs, loss, mode = run_step(cap, dtype, instrument=tp_split if ranks > 1 else None)
                if ranks > 1:
                    grads = tensor_parallel.full_grads(model, summed)  # every rank takes part in the gathers
        if ranks > 1:
            if not distributed.is_main():
                distributed.finish()
                return Path(out)
        else:
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        n_params = sum(p.numel() for p in model.parameters())
        cert = None
        if ranks == 1 and (verify == "on" or (verify == "auto" and n_params <= VERIFY_AUTO_MAX_PARAMS)):
            recipe = recipe_of(cap)
            reduction = (cap.get("loss") or {}).get("reduction", "mean")

            def loss_fn(model=model, inputs=inputs):
                with recorded_boundaries(inputs):
                    return recipe.forward_loss(model, inputs, reduction)[0]

            cert = finite_difference_certificate(
                model, loss_fn, directions=directions, mode_factory=lambda: PrecisionMode(torch.float64)
            )
        with BundleWriter(out, "oracle", overwrite=overwrite) as w:
            w.manifest.update(base)
            w.manifest.update(
                loss={**(cap.get("loss") or {}), "value": loss},
                numerics={"compute": "float64", "promotions": mode.promotions, "fused": getattr(mode, "fused", None)},
                backward_order=mode.backward_order,
                certificate=cert,
                seconds=round(time.perf_counter() - t0, 3),
            )
            if by_tokens:
                w.manifest["token_parallel"] = split_record
            elif ranks > 1:
                w.manifest["tensor_parallel"] = {"ranks": ranks, "bound_rel": tensor_parallel.BOUND_REL,
                                                 "split": sorted({n.split(".")[-1] for n in tensor_parallel.plan_of(model, recipe_of(cap).tp_plan)}
                                                                | ({"lm_head"} if tensor_parallel.vocabulary_split(model, ranks) else set()))}  # fmt: skip
            del w.manifest["fingerprint"]  # an oracle carries the inputs and weights themselves
            carry_inputs_and_weights(cap, w)
            w.add("grads", grads)
        _settle(cap, Path(out), dtype, ensemble)
        distributed.finish()
        return Path(out)

    compute, round_to, ops = precisions.emulation(dtype)
    group_of = lambda k: "grads" if k == 0 else f"grads.{k}"  # noqa: E731
    if not distributed.is_main():  # a rank > 0: its members (k % ranks == rank) go to rank 0 as files
        with distributed.parts_dir(Path(out)) as tmp:
            parts, files = {}, []
            for k in range(ensemble):
                if distributed.mine(k):
                    model, _, loss, mode = run_step(cap, dtype, jitter_seed=precisions.member_seed(k))
                    f = tmp / f"{group_of(k)}.safetensors"
                    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
                    parts[group_of(k)] = {"k": k, "loss": loss, "entries": distributed.save_part(grads, f)}
                    files.append(f)
                    del model, grads
            distributed.send_parts("members", {"members": parts}, files)
        distributed.finish()
        return Path(out)
    with BundleWriter(out, "emulation", overwrite=overwrite) as w:
        by_k: dict[int, float] = {}
        for k in tqdm(range(ensemble), desc=f"emulating {dtype}", disable=not progress):
            if not distributed.mine(k):
                continue
            model, _, loss, mode = run_step(cap, dtype, jitter_seed=precisions.member_seed(k))
            by_k[k] = loss
            w.add(group_of(k), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
            del model
        for r in range(1, distributed.world()):  # the other ranks' members, adopted as they wrote them
            with distributed.parts_dir(Path(out)) as tmp:
                for group, part in distributed.recv_parts("members", r, tmp)["members"].items():
                    w.adopt(group, tmp / f"{group}.safetensors", part["entries"], move=True)
                    by_k[part["k"]] = part["loss"]
        losses = [by_k[k] for k in range(ensemble)]
        w.manifest.update(base)
        if distributed.world() > 1:
            w.manifest["ranks"] = distributed.world()
        w.manifest.update(
            loss={**(cap.get("loss") or {}), "value": losses[0], "members": losses},
            members=ensemble,
            emulation=emulation_record(compute, round_to, ops),
            seconds=round(time.perf_counter() - t0, 3),
        )
    _settle(cap, Path(out), dtype, ensemble)
    distributed.finish()
    return Path(out)


def _settle(cap: Bundle, out: Path, dtype: str, ensemble: int) -> None:
    """``out`` is published by an in-memory replay: a killed streamed run's work folder of this step and
    command beside it is removed, any other named (oracle/replay/streaming/workdir.py ``settle``)."""
    from .streaming import workdir
    from .streaming.driver import work_header

    for note in workdir.settle(out, work_header(cap, dtype, ensemble, out)):
        print(f"note: {note}", file=sys.stderr, flush=True)
