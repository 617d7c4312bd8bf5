"""One forked helper process for the search: ``Helper.map`` runs the first item of a map here and
the rest in the helper, which inherits the planner (and its memo) by ``fork``, not by pickle.
Results come back in order, and an item the helper cannot finish (it died, or no process could be
made) is run here, so the outcome never depends on the helper."""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from autoshard.errors import AutoshardError

PROCESSES = 2  # this one and the helper

_ADOPTED = None  # in the helper: the object it works for


def _adopt(owner) -> None:
    """The helper's initializer (its argument travels by ``fork``, not by pickle)."""
    global _ADOPTED
    _ADOPTED = owner


def _in_helper(fn, item):
    return fn(_ADOPTED, item)


def workers() -> int:
    """Processes the search may use: ``AUTOSHARD_WORKERS``, else the cores this process may run
    on (at most ``PROCESSES``); 1 off Linux (``fork`` is missing on Windows and unsafe on macOS
    once system frameworks are loaded) or where this process may not have children."""
    if not sys.platform.startswith("linux") or multiprocessing.current_process().daemon:
        return 1
    env = os.environ.get("AUTOSHARD_WORKERS")
    if env is not None:
        try:
            return max(1, int(env))
        except ValueError:
            raise AutoshardError(f"AUTOSHARD_WORKERS={env!r}: expected a whole number, e.g. 1") from None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(PROCESSES, cores)


class Helper:
    """``with Helper(owner) as helper: helper.map(fn, items)`` is ``[fn(owner, item) for item in
    items]``, the items after the first in one forked process where there is more than one
    worker."""

    def __init__(self, owner):
        self.owner = owner
        self.pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> Helper:
        if workers() > 1:
            # the collector would otherwise walk (and so copy, page by page) the whole inherited
            # heap in the forked process: the captured graph, its sympy formulas, the memo
            gc.freeze()
            try:
                self.pool = ProcessPoolExecutor(
                    1, mp_context=multiprocessing.get_context("fork"), initializer=_adopt, initargs=(self.owner,)
                )
            except (OSError, ImportError):  # no POSIX semaphores here (some sandboxes): one process
                gc.unfreeze()
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            gc.unfreeze()

    def map(self, fn, items: list) -> list:
        """``[fn(owner, item) for item in items]``."""
        if self.pool is None or len(items) < 2:
            return [fn(self.owner, item) for item in items]
        try:
            away = [self.pool.submit(_in_helper, fn, item) for item in items[1:]]
        except (OSError, BrokenProcessPool):
            return [fn(self.owner, item) for item in items]
        out = [fn(self.owner, items[0])]
        for item, future in zip(items[1:], away):
            try:
                out.append(future.result())
            except BrokenProcessPool:  # the helper died (killed, out of memory): do its part here
                out.append(fn(self.owner, item))
        return out
