"""Where in a training step the code runs, for the runtime pieces that behave differently there:
inside a split backward's input-gradient pass (``input_gradients_only``), or out of sight of a
selective checkpoint's recording (``unrecorded``). A leaf module: the collectives, the
checkpoint policy and the FP8 matmuls all read it, and it reads none of them."""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

_input_pass = False  # a split backward's input-gradient pass is running (``input_gradients_only``)


def in_input_pass() -> bool:
    """Whether a split backward's input-gradient pass is running (``input_gradients_only``)."""
    return _input_pass


@contextlib.contextmanager
def input_gradients_only():
    """Run inside: the backward computes input gradients only (a split backward's first pass),
    so what sequence parallelism would gather again for the weight gradients is not gathered."""
    global _input_pass
    before, _input_pass = _input_pass, True
    try:
        yield
    finally:
        _input_pass = before


@contextlib.contextmanager
def unrecorded():
    """Run what a layer's forward does and its recomputation does not (bookkeeping: expert load
    counts, loss totals) out of sight of a selective checkpoint. Its cache indexes each op's
    calls by their count, so an op the recomputation does not meet again would shift the entries
    of every later call of the same op: a cached sum, or a skipped call's layout, handed to the
    wrong call."""
    if isinstance(_get_current_dispatch_mode(), torch.utils.checkpoint._CachingTorchDispatchMode):
        with _pop_mode_temporarily():
            yield
    else:
        yield
