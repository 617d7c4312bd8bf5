"""Fewer garbage collections while autoshard builds what lives until it ends.

Importing torch and sympy, tracing a model and annotating its graph make hundreds of thousands
of objects that stay alive (modules, fx nodes, sympy expressions) and little cyclic garbage.
CPython's collector runs a young-generation pass every 700 net allocations and, as the young
survive, older passes over everything tracked: on the example models that was an eighth to a fifth of
the CPU time of ``autoshard compile --plan-only`` (imports, trace and search alike), spent
finding almost nothing. :func:`fewer_collections` raises the young generation's threshold while
its block runs and puts the caller's setting back after, so a program that imports autoshard
keeps its own collector settings; garbage is still collected, in larger batches.

Standard library only: the command line uses it before it imports torch.
"""

from __future__ import annotations

import contextlib
import gc

YOUNG_THRESHOLD = 20_000  # net allocations between young collections (CPython's default: 700)


@contextlib.contextmanager
def fewer_collections():
    """Collect the young generation every ``YOUNG_THRESHOLD`` allocations inside the block (a
    higher threshold already set is kept; a collector switched off stays off)."""
    old = gc.get_threshold()
    if old[0] == 0 or old[0] >= YOUNG_THRESHOLD:
        yield
        return
    gc.set_threshold(YOUNG_THRESHOLD, *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)
