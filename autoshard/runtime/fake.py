"""What differs when one rank of a program runs on fake tensors (``autoshard verify --at-scale``).

Under ``torch._subclasses.FakeTensorMode`` every tensor has a shape, a dtype and a device but no
data, and the "fake" process-group backend completes every collective without peers, so one
process can run any rank of a 16,384-rank program at its real shapes and allocate nothing. The
program is the same; only what needs values changes, and this module is where it does:

- the device mesh and the rank maps are built of real tensors (``real()``): they are indices,
  and ``DeviceMesh`` reads them;
- a value the program would log (the loss, the gradient norm) is NaN (``value``);
- the pipeline's stages are given their boundary shapes at construction (torch's stages then
  skip the exchange of shapes with their neighbours, which have no fake twin to answer);
- routing is taken as balanced (``autoshard.runtime.moe``): every expert receives its mean share
  of the rows, the load the planner assumes.
"""

from __future__ import annotations

import math

import torch
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils.weak import WeakIdKeyDictionary


def active() -> bool:
    """Whether a ``FakeTensorMode`` is in effect (tensors made now are fake)."""
    return active_fake_mode() is not None


def is_fake(t) -> bool:
    return isinstance(t, FakeTensor)


def real():
    """A context in which tensors are real even under a ``FakeTensorMode`` (the no-op otherwise)."""
    return unset_fake_temporarily()


def value(t: torch.Tensor) -> float:
    """``float(t)``, or NaN where ``t`` has no data (a fake tensor)."""
    return math.nan if is_fake(t) else float(t)


def static_pipeline(schedule, stages) -> None:
    """Start ``schedule`` (a ``torch.distributed.pipelining`` schedule over ``stages``, each given
    its boundary shapes) without the vote its stages take at the first step on whether every
    stage knows its shapes: the vote reads a value off a tensor its neighbour sends, which a fake
    process group never delivers. Every stage knows its shapes here, so the vote's answer is
    "static"."""
    from torch.distributed.pipelining._utils import InferenceMode

    def vote(stages_here, has_backward, p2p_done):
        for stage in stages_here:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = vote


_BALANCED = WeakIdKeyDictionary()  # a fake offs tensor -> the real offsets taken for it


def offsets(offs: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """Cumulative rows per expert (``offs``, as the MoE runtime reads them) where they have values;
    for fake ones, balanced routing's as a real tensor: ``rows`` spread evenly over the experts
    (the first ``rows % experts`` one more). The same fake ``offs`` always gives the same answer,
    so the dispatch, the combine and the TP shares of one layer agree; ``rows`` is needed only
    the first time."""
    if not is_fake(offs):
        return offs
    if offs not in _BALANCED:
        if rows is None:
            raise ValueError("balanced routing on fake tensors: the first use of these offsets must give the rows")
        experts = offs.numel()
        with real():
            counts = torch.full((experts,), rows // experts, dtype=torch.long)
            counts[: rows % experts] += 1
            _BALANCED[offs] = counts.cumsum(0).to(offs.dtype)
    return _BALANCED[offs]
