"""The schedule table's micro-batches in flight are those of the action orders torch's classes
run: walked here for every shape the planner may choose, small enough to enumerate."""

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


def _live_peak(actions) -> int:
    """The most (chunk, micro-batch) forwards run whose full backward or weight gradient has not."""
    live = peak = 0
    for a in actions:
        kind = getattr(a, "computation_type", None)
        name = getattr(kind, "name", None)
        if name == "OVERLAP_F_B":  # one micro-batch's forward beside another's backward
            peak = max(peak, live + 1)
        elif name == "FORWARD":
            live += 1
            peak = max(peak, live)
        elif name in ("FULL_BACKWARD", "BACKWARD_WEIGHT"):
            live -= 1
    return peak


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
            assert _live_peak(orders[rank]) / v == pytest.approx(SCHEDULES[name].in_flight(rank, pp, m, v)), (
                name, pp, m, v, rank,
            )  # fmt: skip
        checked += 1
    assert checked >= 5
