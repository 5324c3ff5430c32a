"""A replay spread over ``nproc`` local ranks: its validated options, serialised for each rank
(``ReplayOptions.for_rank``: one process, its share of the threads), run by the launcher
(oracle/parallel/launch.py) as ``python -m oracle.api.worker``. A streamed replay's ranks start with
malloc on huge pages (streaming/pages.py)."""

from __future__ import annotations

import os
from collections.abc import Callable

from ..parallel.launch import launch, per_rank_threads
from .options import ReplayOptions
from .streaming import pages


def launch_ranks(opts: ReplayOptions, echo: Callable[[str], None] | None = None) -> int:
    """``opts`` on ``opts.processes()`` ranks; the exit code of the whole run. ``echo``: the ranks' stdout lines."""
    n = opts.processes()
    threads = per_rank_threads(n, opts.threads)
    env = pages.tunable_env(dict(os.environ)) if opts.max_memory is not None else {}
    return launch(n, {"command": "replay", "options": opts.for_rank(threads)}, threads, env=env, echo=echo)
