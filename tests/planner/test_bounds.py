"""Pieces of the search's lower bounds checked against their definitions."""

import math
import random

import pytest

from autoshard.planner.bounds import _least_cover, _least_time


def _by_definition(caps, lead, layers):
    k = 0
    while sum(min(cap, max(0, k - d)) for cap, d in zip(caps, lead)) < layers:
        k += 1
    return k


@pytest.mark.parametrize("seed", range(200))
def test_least_cover_is_the_least_k_that_holds_every_layer(seed):
    """The t_max bound's count: the least k by which the ranks (each holding at most its memory
    cap, the embedding's and head's ranks starting ``lead`` layers late) hold every layer."""
    rng = random.Random(seed)
    pp = rng.randint(1, 40)
    caps = [rng.randint(0, 12) for _ in range(pp)]
    lead = [rng.choice([0, 0, 0, rng.randint(0, 6)]) for _ in range(pp)]
    caps[0] = max(caps[0], 1)  # some split fits (else the caller returns inf before counting)
    layers = rng.randint(1, sum(caps))
    assert _least_cover(caps, lead, layers) == _by_definition(caps, lead, layers)


@pytest.mark.parametrize("seed", range(200))
def test_least_time_is_the_least_slowest_rank_over_whole_layers(seed):
    """The t_max bound itself: over every split of the layers (whole, each rank within its cap,
    the embedding's and head's ranks taking their time besides), the least slowest rank, found by
    trying every time any rank can end at."""
    rng = random.Random(seed)
    pp = rng.randint(1, 12)
    t = rng.choice([1.0, 0.37, 2.5])
    caps = [rng.randint(0, 9) for _ in range(pp)]
    fixed = [0.0] * pp
    for r in rng.sample(range(pp), min(pp, rng.randint(0, 2))):
        fixed[r] += rng.choice([0.0, 0.2, 0.5, 1.0, 1.7, 3.3]) * t
    caps[0] = max(caps[0], 1)
    layers = rng.randint(1, sum(caps))

    def fits(T):
        return sum(min(cap, max(0, math.floor((T - f) / t + 1e-9))) for cap, f in zip(caps, fixed)) >= layers

    ends = sorted(n * t + f for f in set(fixed) for n in range(layers + 1))
    expected = next(T for T in ends if fits(T))
    assert _least_time(caps, fixed, layers, t) == pytest.approx(expected)
