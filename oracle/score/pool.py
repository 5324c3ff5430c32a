"""The score's parameters on several cores at once, within the memory one parameter at a time held.

The score's work is a loop over parameters, each independent: load the truth's gradient, each band
member's and each capture's (reading and hashing their bytes, bundle/store.py), and compute
``tensor_metrics`` of every pair. ``ordered`` runs that loop on ``workers`` threads and gives back the
results in the loop's order, so the report is built as the serial loop built it.

Why threads: torch's ops, ``readinto`` and hashlib's sha256 (on buffers above 2 KiB) release the GIL; what
holds it is tensor_metrics' Python per 2^20-element chunk, about 0.15 ms of ~18 ms a chunk takes on one
core, so up to ~100 workers do not wait on it. Each worker runs torch's ops on one thread (``one_thread``):
the parallelism is over parameters, not inside a chunk, where a 2^20-element op split over 64 threads
spends its time starting them.

Numerics: every parameter's metrics come from the same calls on the same tensors whichever thread runs
them, the chunks' sums are added in the chunks' order, and each chunk's float64 sums are grouped by rows
whatever torch's thread count (``metrics.ROW``), so a report is bitwise the same at any worker count and
on any core count (``tests/unit/test_score_pool.py``).

Memory: a parameter reserves ``need(item)`` bytes before it is loaded and frees them when its metrics are
done; parameters run together only while their reservations sum to at most ``cap`` (one runs alone
whatever its size). With ``cap`` = the largest parameter's need (``scorer.memory_need``, what the judge
budgets for its score stage), the peak stays the serial loop's: the embedding runs alone, the decoder's
matrices a dozen at a time at the 8B's shapes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


class Budget:
    """Bytes reserved by the parameters in flight, taken in the items' order: ``take(k, need)`` waits until
    item k is next and ``need`` fits under ``cap`` or nothing else is in flight. In order, so a large
    parameter is not passed by small ones until the end (the cores wait a moment while it drains the
    budget instead)."""

    def __init__(self, cap: int) -> None:
        self.cap, self.used, self.next, self.stopped = max(int(cap), 0), 0, 0, False
        self._cv = threading.Condition()

    def stop(self) -> None:
        """Wake every waiter to give up (an item before it failed and the rest are cancelled)."""
        with self._cv:
            self.stopped = True
            self._cv.notify_all()

    def take(self, k: int, need: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self.stopped or (self.next == k and (self.used == 0 or self.used + need <= self.cap)))
            if self.stopped:
                raise RuntimeError("the score stopped before this parameter")
            self.used += need
            self.next += 1
            self._cv.notify_all()

    def give(self, need: int) -> None:
        with self._cv:
            self.used -= need
            self._cv.notify_all()


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads at 1 (restored after): threads started inside run their ops on one thread
    each (the pool's workers are the parallelism; a 2^20-element op split over many threads spends its time
    starting them). The sums do not depend on it (``metrics.ROW``); before they did, and the last bits of
    the report moved with the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def ordered(fn: Callable[[T], R], items: Iterable[T], need: Callable[[T], int], cap: int, workers: int) -> Iterator[R]:
    """``fn(item)`` for every item, on ``workers`` threads within ``cap`` bytes (``need`` per item), yielded in
    the items' order. The first exception raised by ``fn`` is raised here, in order, after the items
    before it; the items not started yet are cancelled."""
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        for it in items:
            yield fn(it)
        return
    budget = Budget(cap)

    def run(k: int, it: T) -> R:
        n = need(it)
        budget.take(k, n)
        try:
            return fn(it)
        finally:
            budget.give(n)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="oracle-score") as pool:
        futures = [pool.submit(run, k, it) for k, it in enumerate(items)]
        try:
            for f in futures:
                yield f.result()
        finally:
            for f in futures:
                f.cancel()
            budget.stop()
