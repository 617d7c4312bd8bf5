"""Time spent in capture's phases, for ``benchmarks/plan.py``: a regression in capture time
shows in the phase that caused it. Collecting is off unless a caller asks (:func:`collect`); then
each :func:`phase` adds its wall and CPU seconds to the caller's table. CPU seconds count this
process and its finished children (the search's helper): on a machine other work loads, they
move much less than the wall time.

Each phase is also a stage of the progress line a terminal shows (``autoshard.progress``): the
phases are where long work is, so they are named once, here."""

from __future__ import annotations

import contextlib
import os
import time

from autoshard import progress

_table: dict[str, list[float]] | None = None


def cpu_seconds() -> float:
    """User and system CPU time of this process and of its children that have exited."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@contextlib.contextmanager
def collect():
    """Collect the phases run inside the block: yields ``{phase: [wall s, cpu s]}``, filled as
    they run."""
    global _table
    outer, _table = _table, {}
    try:
        yield _table
    finally:
        _table = outer


@contextlib.contextmanager
def phase(name: str):
    """Time the block as ``name`` (summed over repeats) where someone collects, and show it as a
    progress stage where a terminal shows progress; else nothing."""
    table = _table
    with progress.stage(name):
        if table is None:
            yield
            return
        wall, cpu = time.perf_counter(), cpu_seconds()
        try:
            yield
        finally:
            spent = table.setdefault(name, [0.0, 0.0])
            spent[0] += time.perf_counter() - wall
            spent[1] += cpu_seconds() - cpu
