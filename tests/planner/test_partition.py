"""The stage partition: the exact enumeration and CP-SAT against brute force on small instances."""

import itertools
import random
from dataclasses import replace

import pytest

from autoshard.ir.schedules import SCHEDULES
from autoshard.planner import partition


def _quantities(kinds: int, rng: random.Random, capacity: float = 1e12) -> partition.Quantities:
    def per_kind(lo, hi):
        return [rng.uniform(lo, hi) for _ in range(kinds)]

    zero = {k: 0.0 for k in partition.KEYS}
    return partition.Quantities(
        time=per_kind(1e-3, 5e-3),
        fwd=per_kind(3e-4, 1e-3),
        bwd=per_kind(6e-4, 2e-3),
        act=per_kind(1e8, 5e8),
        held=per_kind(2e7, 2e8),
        state=per_kind(1e8, 1e9),
        grad=per_kind(5e7, 5e8),
        dp_time=per_kind(0, 2e-3),
        dp_gather=per_kind(0, 1e-3),
        dp_micro=[0.0] * kinds,
        pre={**zero, "time": 2e-3, "fwd": 5e-4, "bwd": 1e-3, "act": 1e8, "state": 5e8, "grad": 2e8},
        post={**zero, "time": 3e-3, "fwd": 1e-3, "bwd": 2e-3, "act": 3e8, "state": 5e8, "grad": 2e8},
        p2p=0.0,
        dp_latency=(1e-4, 5e-5, 0.0),
        buffers=1e8,
        post_buffers=2e8,
        capacity=capacity,
    )


def _even(stage_layers, pp, shape) -> bool:
    """Each rank's chunks hold non-increasing counts at most one apart, in ``partition._spread``'s
    order (earlier chunks first, the embedding's and head's last)."""
    chunks = len(stage_layers)
    for r in range(pp):
        order = sorted(shape.chunks_of_rank(r, pp, len(stage_layers) // pp), key=lambda c: (c in (0, chunks - 1), c))
        sizes = [stage_layers[c] for c in order]
        if any(a < b for a, b in zip(sizes, sizes[1:])) or sizes[-1] < sizes[0] - 1:
            return False
    return True


def brute_force(kinds_list, q, pp, v, shape, m):
    """Every split of the layers into pp*v contiguous chunks that spreads each rank's layers
    evenly, scored like the solver scores it (memory chunk by chunk at every moment of the
    schedule's order that can be a peak); where ``q`` has options, under every choice of one
    per rank."""
    values = []
    for picks in itertools.product(range(1 + len(q.options)), repeat=pp):
        value = _brute_force_picks(kinds_list, [q.choices()[i] for i in picks], pp, v, shape, m)
        if value is not None:
            values.append(value)
    return min(values, default=None)


def _brute_force_picks(kinds_list, qs, pp, v, shape, m):
    """``brute_force`` with rank r under ``qs[r]``."""
    layers, chunks = len(kinds_list), pp * v
    best = None
    last = shape.chunk_rank(chunks - 1, pp)
    for cuts in itertools.combinations_with_replacement(range(layers + 1), chunks - 1):
        bounds = [0, *cuts, layers]
        stage_layers = [bounds[c + 1] - bounds[c] for c in range(chunks)]
        if not _even(stage_layers, pp, shape):
            continue
        per_rank = {r: {k: 0.0 for k in partition.KEYS} for r in range(pp)}
        for c in range(chunks):
            r = shape.chunk_rank(c, pp)
            q = qs[r]
            for layer in range(bounds[c], bounds[c + 1]):
                for key in partition.KEYS:
                    per_rank[r][key] += getattr(q, key)[kinds_list[layer]]
            for extra, here in ((q.pre, c == 0), (q.post, c == chunks - 1)):
                if here:
                    for key in partition.KEYS:
                        per_rank[r][key] += extra[key]
        fits = True
        for r in range(pp):
            q = qs[r]
            mine = shape.chunks_of_rank(r, pp, v)
            loads = {}
            for c in mine:
                act, held, grad = (
                    sum(getattr(q, key)[k] for k in kinds_list[bounds[c] : bounds[c + 1]])
                    + (q.pre[key] if c == 0 else 0)
                    + (q.post[key] if c == chunks - 1 else 0)
                    for key in ("act", "held", "grad")
                )
                loads[c] = (act + (q.boundary if c < chunks - 1 else 0), held, grad)
            activations = max(
                sum(loads[c][0] * h + loads[c][1] * p + loads[c][2] * g for c, h, p, g in zip(mine, hs, ps, gs))
                for hs, ps, gs in q.occupancy[r]
            )
            memory = activations + per_rank[r]["state"] + q.buffers + (q.post_buffers if r == last else 0)
            fits = fits and memory <= q.capacity
        if not fits:
            continue
        us = partition.US
        t_max = max(round(per_rank[r]["time"] * us) for r in range(pp))
        d_max = 0
        for r in range(pp):
            x, q = per_rank[r], qs[r]
            exposed = max(0, round(x["dp_time"] * us) + round(q.dp_latency[0] * us) - round(x["bwd"] * us))
            exposed += max(0, round(x["dp_gather"] * us) + round(q.dp_latency[1] * us) - round(x["fwd"] * us))
            d_max = max(d_max, exposed)
        value = m * t_max + d_max
        best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shape_name,v", [("1f1b", 1), ("interleaved", 2), ("zbv", 2)])
def test_all_alike_layers_match_brute_force(seed, shape_name, v):
    rng = random.Random(seed)
    q = _quantities(1, rng, capacity=rng.uniform(2e9, 8e9))
    pp, m, layers = 3, 4, 7
    shape = SCHEDULES[shape_name]
    q.occupancy = list(shape.occupancy(pp, m, v))  # a split backward's held bytes too
    q.boundary = 4e7
    got = partition.solve([0] * layers, q, pp, v, lambda c: shape.chunk_rank(c, pp), m)
    want = brute_force([0] * layers, q, pp, v, shape, m)
    if want is None:
        assert got is None
    else:
        us = partition.US
        assert round(m * got.t_max * us + got.dp_exposed * us) == pytest.approx(want, abs=m + 2)
        assert sum(got.stage_layers) == layers


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kinds", [[0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 1]], ids=["prefix", "cp-sat"])
def test_mixed_layers_match_brute_force(seed, kinds):
    rng = random.Random(100 + seed)
    q = _quantities(2, rng, capacity=rng.uniform(3e9, 8e9))
    pp, v, m = 2, 2, 3
    shape = SCHEDULES["interleaved"]
    q.occupancy = list(shape.occupancy(pp, m, v))
    q.boundary = 4e7
    got = partition.solve(kinds, q, pp, v, lambda c: shape.chunk_rank(c, pp), m)
    want = brute_force(kinds, q, pp, v, shape, m)
    if want is None:
        assert got is None
    else:
        us = partition.US
        assert round(m * got.t_max * us + got.dp_exposed * us) == pytest.approx(want, abs=m + 2)


def _with_options(q: partition.Quantities, rng: random.Random, count: int) -> partition.Quantities:
    """``q`` with ``count`` recompute-like alternatives: each layer slower and keeping fewer
    bytes (the partition weighs every choice's exposure as the first's, so the windows stay)."""
    for _ in range(count):
        slower = [rng.uniform(1.1, 1.5) for _ in q.time]
        keeps = [rng.uniform(0.2, 0.8) for _ in q.time]
        extra = [t * (f - 1) for t, f in zip(q.time, slower)]
        q.options.append(
            replace(
                q,
                time=[t + e for t, e in zip(q.time, extra)],
                act=[a * k for a, k in zip(q.act, keeps)],
                post={**q.post, "act": q.post["act"] * 0.5, "time": q.post["time"] * 1.2},
                options=[],
            )
        )
    return q


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    "kinds,shape_name,v",
    [
        ([0] * 7, "1f1b", 1),
        ([0] * 6, "interleaved", 2),
        ([0, 0, 1, 1, 1, 1], "interleaved", 2),
        ([0, 1, 1, 0, 0, 1], "interleaved", 2),
    ],
    ids=["alike", "alike-interleaved", "prefix", "cp-sat"],
)
def test_a_recompute_set_per_rank_matches_brute_force(seed, kinds, shape_name, v):
    """Each rank choosing its own recompute set: the exact paths and CP-SAT find the best
    choice and split of every one (brute force over each rank's choice and every split)."""
    rng = random.Random(200 + seed)
    q = _with_options(_quantities(2, rng, capacity=rng.uniform(2e9, 6e9)), rng, 2)
    pp, m = (3 if v == 1 else 2), 4
    shape = SCHEDULES[shape_name]
    for o in q.choices():
        o.occupancy = list(shape.occupancy(pp, m, v))
        o.boundary = 4e7
    got = partition.solve(kinds, q, pp, v, lambda c: shape.chunk_rank(c, pp), m)
    want = brute_force(kinds, q, pp, v, shape, m)
    alone = [brute_force(kinds, o, pp, v, shape, m) for o in (replace(x, options=[]) for x in q.choices())]
    if want is None:
        assert got is None
        return
    us = partition.US
    assert round(m * got.t_max * us + got.dp_exposed * us) == pytest.approx(want, abs=m + 2)
    assert want <= min(x for x in alone if x is not None) if any(x is not None for x in alone) else True
    assert len(got.rank_option) == pp and sum(got.stage_layers) == len(kinds)
    assert all(x <= o.capacity for x, o in zip(got.memory, q.choices()))


def test_ranks_holding_more_micro_batches_recompute_more():
    """1F1B: the first rank holds pp micro-batches in flight, the last one; under a memory limit
    that one set cannot meet cheaply, the first rank recomputes and the last does not."""
    rng = random.Random(7)
    q = _quantities(1, rng, capacity=1e12)
    q.time, q.bwd, q.act, q.state, q.grad = [2e-3], [1e-3], [4e8], [1e8], [5e7]
    q.pre, q.post = ({**x, "act": 0.0, "state": 0.0, "grad": 0.0} for x in (q.pre, q.post))
    q.options = [replace(q, time=[2.2e-3], bwd=[1.2e-3], act=[1e8], options=[])]
    pp, m, layers = 4, 8, 16
    shape = SCHEDULES["1f1b"]
    for o in q.choices():
        o.occupancy = list(shape.occupancy(pp, m, 1))
        o.capacity = 6.12e9  # four layers all saved fit on every rank but the first
    got = partition.solve([0] * layers, q, pp, 1, lambda c: shape.chunk_rank(c, pp), m)
    assert got.rank_option == [1, 0, 0, 0]
    q.options = []
    alone = partition.solve([0] * layers, q, pp, 1, lambda c: shape.chunk_rank(c, pp), m)
    assert alone is None or m * got.t_max + got.dp_exposed < m * alone.t_max + alone.dp_exposed


@pytest.mark.parametrize("kinds", [[0] * 9, [0, 0, 1, 1, 1, 1, 1]], ids=["alike", "prefix"])
def test_no_memory_limit_matches_a_capacity_nothing_reaches(kinds):
    """``UNLIMITED`` skips the exact paths' memory peaks; the split is the one a capacity no
    rank comes near gives (the per-rank choice's lower bound reads it)."""
    rng = random.Random(11)
    shape, pp, m = SCHEDULES["1f1b"], 3, 4
    q = _quantities(2, rng, capacity=partition.UNLIMITED)
    q.occupancy = list(shape.occupancy(pp, m, 1))
    free = partition.solve(kinds, q, pp, 1, lambda c: shape.chunk_rank(c, pp), m)
    roomy = partition.solve(kinds, replace(q, capacity=1e17), pp, 1, lambda c: shape.chunk_rank(c, pp), m)
    assert (free.stage_layers, free.t_max, free.dp_exposed) == (roomy.stage_layers, roomy.t_max, roomy.dp_exposed)
