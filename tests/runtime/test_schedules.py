"""The schedule table's micro-batches in flight (held in full, and waiting for a deferred
weight-gradient pass) are those of the action orders torch's classes run: walked here for every
shape the planner may choose, small enough to enumerate."""

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

from autoshard.runtime.schedules import SCHEDULES


class _Stage:
    """What torch's schedule classes read of a stage to lay out their actions."""

    def __init__(self, index: int, stages: int, ranks: int):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, ranks, 0
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.submod = torch.nn.Linear(1, 1)
        self.stage_index_to_group_rank = {}
        self.has_backward = True


def _orders(name: str, pp: int, m: int, v: int) -> dict:
    row = SCHEDULES[name]
    cls = getattr(torch_schedules, row.torch_class(v))
    stages = [_Stage(c, pp * v, pp) for c in row.chunks_of_rank(0, pp, v)]
    single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
    return cls(stages[0] if single else stages, m, loss_fn=lambda out, target: out.sum()).pipeline_order


def _peaks(actions) -> tuple[int, int]:
    """(the most (chunk, micro-batch) forwards run whose full backward, or weight-gradient pass,
    has not; the most input-gradient passes run whose weight-gradient pass has not)."""
    f = i = w = held = pending = 0
    for a in actions:
        name = getattr(getattr(a, "computation_type", None), "name", None)
        if name == "OVERLAP_F_B":  # one micro-batch's forward beside another's full backward
            held = max(held, f + 1 - w)
            continue
        if name == "FORWARD":
            f += 1
        elif name == "BACKWARD_INPUT":
            i += 1
        elif name == "BACKWARD_WEIGHT":
            w += 1
        elif name == "FULL_BACKWARD":
            i, w = i + 1, w + 1
        held, pending = max(held, f - w), max(pending, i - w)
    return held, pending


SHAPES = [
    (name, pp, m, v)
    for name, row in SCHEDULES.items()
    for pp in (2, 3, 4, 8)
    for m in range(1, 3 * pp + 1)
    for v in ((1,) if name == "1f1b" else (2,) if row.fixed_v == 2 else (2, 3, 4))
    if row.runs_with(pp, m, v) is None
]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_in_flight_is_what_torchs_schedule_holds(name):
    checked = 0
    for _, pp, m, v in [s for s in SHAPES if s[0] == name]:
        try:
            orders = _orders(name, pp, m, v)
        except (ValueError, RuntimeError):  # a shape torch's class refuses: the runtime never meets it
            continue
        for rank in range(pp):
            held, pending = _peaks(orders[rank])
            row = SCHEDULES[name]
            assert held / v == pytest.approx(row.in_flight(rank, pp, m, v)), (name, pp, m, v, rank)
            if row.name == "zbv":  # an upper bound below 2 pp micro-batches
                assert pending / v <= row.weight_pending(rank, pp, m, v) + 1e-9, (name, pp, m, v, rank)
            else:
                assert pending / v == pytest.approx(row.weight_pending(rank, pp, m, v)), (name, pp, m, v, rank)
        checked += 1
    assert checked >= 5
