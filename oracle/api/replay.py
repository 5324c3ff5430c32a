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
    if opts.nproc > 1 and not opts.dry_run:
        from ..bundle.store import check_output
        from ..replay.ranks import launch_ranks

        check_output(opts.out, opts.overwrite)  # the launcher claims --out for its ranks (atomic.claim), dropped at its exit
        return launch_ranks(opts)
    import torch

    torch.set_num_threads(opts.cpu_threads())
    if opts.dry_run:
        return _dry_run(opts, echo)
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


def _dry_run(opts: ReplayOptions, echo: Echo) -> int:
    from ..bundle.store import Bundle
    from ..replay.streaming import plan

    ranks = opts.nproc if opts.nproc > 1 else int(os.environ.get("WORLD_SIZE", "1"))  # per rank where the tokens are split
    budget = opts.budget
    p = plan.plan(Bundle(opts.capture), opts.dtype, streamed=budget is not None, budget=budget,
                  ranks=ranks if opts.split == "tokens" and opts.dtype == "fp64" else 1)  # fmt: skip
    echo(plan.render(p))
    if opts.ensemble > 1 and opts.dtype != "fp64":  # render prices one member
        echo(plan.render_band(p, opts.ensemble, max(1, min(opts.nproc, opts.ensemble))))
    if not p["fits"]:
        raise UsageError(p["refusal"])  # exactly what the run would refuse
    return 0
