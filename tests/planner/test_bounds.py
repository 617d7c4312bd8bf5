"""Pieces of the search's lower bounds checked against their definitions (the bounds themselves
are proved against exhaustive enumeration in ``test_search.py``)."""

import random

from autoshard.planner.bounds import _least_height


def test_least_height_is_the_least_k_whose_ranks_hold_every_layer():
    """``_least_height``: the least k with sum_r min(cap_r, max(0, k - lead_r)) >= layers, found
    by a plain scan, on random ranks with and without a lead."""
    rng = random.Random(0)
    checked = 0
    for _ in range(2000):
        pp, layers = rng.randint(1, 64), rng.randint(1, 130)
        caps = [rng.randint(0, layers) for _ in range(pp)]
        lead = [0] * pp
        for r in rng.sample(range(pp), min(pp, rng.randint(0, 3))):
            lead[r] = rng.randint(0, 5)
        if sum(caps) < layers:
            continue
        k = 0
        while sum(min(cap, max(0, k - d)) for cap, d in zip(caps, lead)) < layers:
            k += 1
        assert _least_height(caps, lead, layers) == k, (caps, lead, layers)
        checked += 1
    assert checked > 1000
