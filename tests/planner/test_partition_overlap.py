"""The stage partition prices data-parallel traffic by the profile's DP overlap share: exposed =
what the window leaves + (1 - share) x what it hides, in both of its solvers (CP-SAT for given or
mixed splits, the closed form for layers all alike)."""

import random

import pytest

from autoshard.ir.schedules import SCHEDULES
from autoshard.planner import partition
from tests.planner.test_partition import _quantities


def _expected(q: partition.Quantities, layers: int, share: float) -> float:
    """One rank holding every layer: each once-per-step transfer against its window."""
    out = 0.0
    for key, window, lat in (("dp_time", "bwd", q.dp_latency[0]), ("dp_gather", "fwd", q.dp_latency[1])):
        traffic = layers * getattr(q, key)[0] + q.pre[key] + q.post[key] + lat
        hidden_by = layers * getattr(q, window)[0] + q.pre[window] + q.post[window]
        out += (1 - share) * traffic + share * max(0.0, traffic - hidden_by)
    return out


@pytest.mark.parametrize("share", [0.0, 0.35, 1.0])
@pytest.mark.parametrize("solver", ["cp-sat", "closed-form"])
def test_dp_exposure_follows_the_share(share, solver):
    q = _quantities(1, random.Random(3))
    layers = 6
    q.occupancy = list(SCHEDULES["1f1b"].occupancy(1, 4, 1))
    q.dp_share = share
    fixed = (layers,) if solver == "cp-sat" else None
    got = partition.solve([0] * layers, q, 1, 1, lambda c: 0, 4, fixed)
    assert got.dp_exposed == pytest.approx(_expected(q, layers, share), abs=3e-6)
    if share < 1:  # the window hides some of it, which the share takes back
        assert got.dp_exposed > _expected(q, layers, 1.0) + 1e-5
