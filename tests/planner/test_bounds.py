"""Pieces of the search's lower bounds checked against their definitions."""

import random

import pytest

from autoshard.planner.bounds import _least_cover


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
