"""Wall time of capture's phases, for ``benchmarks/plan.py``: a regression in capture time shows
in the phase that caused it. Collecting is off unless a caller asks (:func:`collect`); then each
:func:`phase` adds its seconds to the caller's table."""

from __future__ import annotations

import contextlib
import time

_table: dict[str, float] | None = None


@contextlib.contextmanager
def collect():
    """Collect the phases run inside the block: yields ``{phase: seconds}``, filled as they run."""
    global _table
    outer, _table = _table, {}
    try:
        yield _table
    finally:
        _table = outer


@contextlib.contextmanager
def phase(name: str):
    """Time the block as ``name`` (summed over repeats) where someone collects; else nothing."""
    table = _table
    if table is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        table[name] = table.get(name, 0.0) + time.perf_counter() - start
