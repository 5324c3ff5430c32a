"""``oracle replay`` as a library call: ``replay(ReplayOptions(...))`` does what the command does,
prints what it prints (through ``echo``) and returns its exit code.

Thread policy (bitwise repeatability depends on it): ``torch.set_num_threads(opts.cpu_threads())``,
every core unless ``threads`` is given; under ``nproc`` > 1 each rank gets the cores divided among
the ranks (oracle/parallel/launch.py). A library caller thus gets exactly the command's numbers.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..errors import UsageError
from ..replay.options import ReplayOptions

Echo = Callable[[str], None]


def replay(opts: ReplayOptions, echo: Echo = print) -> int:
    """Replay ``opts.capture`` as ``opts`` says; 0 on success (errors raise OracleError, as everywhere)."""
    if opts.processes() > 1 and not opts.dry_run:
        from ..bundle.store import check_output
        from ..replay.ranks import launch_ranks

        _check_tensor_split(opts)
        if opts.local:  # said once here, not by each rank
            from ..bundle.store import Bundle
            from ..replay.local import recorded_modules

            recorded_modules(Bundle(opts.capture))
        check_output(opts.out, opts.overwrite)  # the launcher claims --out for its ranks (atomic.claim), dropped at its exit
        return launch_ranks(opts)
    import torch

    if opts.dry_run:
        return _dry_run(opts, echo)
    torch.set_num_threads(opts.cpu_threads())
    from ..parallel import distributed

    if opts.local:
        from ..bundle.store import Bundle
        from ..replay.local import replay_local

        replay_local(opts.capture, opts.out, modules=opts.modules, members=opts.members, workers=opts.workers,
                     overwrite=opts.overwrite)  # fmt: skip
        if distributed.is_main():
            echo(f"replayed {len(Bundle(opts.out).get('local'))} modules locally from {opts.capture} -> {opts.out}")
        return 0
    from ..replay.run import replay as do_replay

    budget = opts.budget
    do_replay(opts.capture, opts.out, dtype=opts.dtype, ensemble=opts.ensemble, verify=opts.verify_mode,
              directions=opts.directions, overwrite=opts.overwrite, progress=opts.ensemble > 1 or budget is not None,
              max_memory=budget, split=opts.split, replace_work=opts.replace_work)  # fmt: skip
    if distributed.is_main():
        from ..report.text import render_replay

        echo(render_replay(opts.capture, opts.out, opts.dtype))
    return 0


def _check_tensor_split(opts: ReplayOptions) -> None:
    """A float64 replay split by tensors over --nproc ranks needs heads and MLP columns that divide by them:
    refused here, once, before its ranks start (or a dry run prices it)."""
    if opts.dtype == "fp64" and opts.split == "tensor" and opts.processes() > 1 and not opts.local:
        from ..bundle.shapes import meta_model
        from ..bundle.store import Bundle
        from ..parallel.tensor_parallel import check_divisible
        from ..replay.setup import recipe_of

        cap = Bundle(opts.capture)
        check_divisible(meta_model(recipe_of(cap), cap.manifest["recipe"]["config"]), opts.processes())


def _dry_run(opts: ReplayOptions, echo: Echo) -> int:
    import torch

    from ..bundle.store import Bundle
    from ..parallel.launch import per_rank_threads
    from ..replay.options import cores
    from ..replay.streaming import plan

    _check_tensor_split(opts)
    local = opts.processes()  # --nproc's ranks share this machine: the probe runs on the threads they use together
    torch.set_num_threads(min(cores(), local * per_rank_threads(local, opts.threads)) if local > 1 else opts.cpu_threads())
    ranks = local if local > 1 else int(os.environ.get("WORLD_SIZE", "1"))  # per rank where the tokens are split
    budget = opts.budget
    tokens = opts.split == "tokens" and opts.dtype == "fp64"
    p = plan.plan(Bundle(opts.capture), opts.dtype, streamed=budget is not None, budget=budget, ranks=ranks if tokens else 1)
    if opts.dtype == "fp64" and local > 1:  # the ranks' GEMMs share this machine's cores: one process's time, not 1/ranks of it
        p["estimated_seconds"] *= local if tokens else 1
        p["shared"] = local
    echo(plan.render(p))
    if opts.ensemble > 1 and opts.dtype != "fp64":  # render prices one member
        echo(plan.render_band(p, opts.ensemble, opts.processes(), opts.nproc))
    if not p["fits"]:
        raise UsageError(p["refusal"])  # exactly what the run would refuse
    return 0
