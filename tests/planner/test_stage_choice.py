"""The per-rank recompute choice in the search: a leaf whose choice is skipped for the incumbent
alone says so, and is searched again for a worse incumbent (the per-mesh searches share the memo)."""

import itertools
import math
import random

import pytest

from autoshard.planner import Problem, parse_force
from autoshard.planner.bounds import _choice_cover, _least_cover
from autoshard.planner.search import Planner

from conftest import captured, extended_profile


def _brute_cover(ranks, fixed_t, layers):
    """The least T at which the layers every rank can hold under its best set (in time and
    memory) cover ``layers``, over every candidate value fixed_t[r] + n t_s."""
    best = math.inf
    for r, (t_s, cap) in itertools.chain.from_iterable(((r, o) for o in opts) for r, opts in enumerate(ranks)):
        for n in range(cap + 1):
            t = fixed_t[r] + n * t_s
            held = sum(
                max(min(c, math.floor((t - f) / ts + 1e-9)) if t >= f else 0 for ts, c in opts)
                for opts, f in zip(ranks, fixed_t)
            )
            if held >= layers:
                best = min(best, t)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_least_cover_is_the_least_time_the_ranks_hold_every_layer_by(seed):
    """The t_max bound's count of the layers the ranks hold, each under its best recompute set
    (quicker sets keep more and fit fewer layers), against every candidate time."""
    rng = random.Random(seed)
    ranks = []
    for _ in range(rng.randint(1, 5)):
        times = sorted(rng.uniform(1e-3, 2e-3) for _ in range(rng.randint(1, 3)))
        ranks.append([(t, rng.randint(0, 6)) for t in times])
    fixed_t = [rng.choice([0.0, rng.uniform(0, 3e-3)]) for _ in ranks]
    layers = rng.randint(1, 14)
    want = _brute_cover(ranks, fixed_t, layers)
    times = [t for opts in ranks for t, _ in opts]  # each rank's sets as its own indices
    first = [sum(len(opts) for opts in ranks[:r]) for r in range(len(ranks))]
    indexed = [[(first[r] + i, cap) for i, (_, cap) in enumerate(opts)] for r, opts in enumerate(ranks)]
    got = _least_cover(indexed, times, fixed_t, layers)
    assert got == pytest.approx(want, rel=1e-9) if want < math.inf else got == math.inf


@pytest.mark.parametrize("seed", range(60))
def test_choice_cover_bounds_the_least_cover_and_is_exact_where_memory_binds(seed):
    """The t_max bound with per-rank sets: never above the least cover (a lower bound), and the
    least cover itself wherever the quickest set's caps bind (its shortcut applies only where
    they do not)."""
    rng = random.Random(seed)
    pp, sets = rng.randint(1, 5), rng.randint(2, 3)
    times = sorted(rng.uniform(1e-3, 2e-3) for _ in range(sets))
    ranks = []
    for _ in range(pp):
        caps = sorted(rng.randint(0, 8) for _ in range(sets))  # slower sets keep less: fit more
        ranks.append([(s, cap) for s, cap in enumerate(caps) if rng.random() < 0.85] or [(sets - 1, caps[-1])])
    fixed_t = [rng.choice([0.0, rng.uniform(0, 3e-3)]) for _ in range(pp)]
    layers = rng.randint(1, 16)
    exact = _least_cover(ranks, times, fixed_t, layers)
    got = _choice_cover(ranks, times, fixed_t, layers)
    assert got <= exact * (1 + 1e-12) or exact == math.inf and got == math.inf
    first = [[cap for s, cap in opts if s == 0] for opts in ranks]
    if not all(first) or sum(min(c[0], layers) for c in first) < layers:
        assert got == pytest.approx(exact, rel=1e-9) if exact < math.inf else got == math.inf


@pytest.fixture(scope="module")
def tight():
    """The tiny LLaMA on 1.5 MB per device, PP2 1F1B: only the first rank recomputing fits well
    (tests/test_stage_recompute.py)."""
    _, cost = captured("llama3", "tiny", 64)
    hw = extended_profile(extends="cpu", hbm_gb=0.0015, memory_reserve_gb=0)
    pins = parse_force("pp=2,tp=1,dp=1,mbs=1,schedule=1f1b")
    planner = Planner(Problem(cost, hw, 2, 64, 8, "bf16", pins), alternatives=1)
    return planner, planner.run().best


def test_a_leaf_cut_for_the_incumbent_says_so_and_is_searched_again(tight):
    planner, best = tight
    assert len(set(best.rank_recompute)) == 2  # the ranks' choice decides this plan
    c, tree = best.candidate, planner.tree
    full = tree.evaluator.evaluate(c)
    assert full.cut == math.inf and full.step_time_s == pytest.approx(best.step_time_s, rel=1e-12)
    low = best.step_time_s * 0.5  # an incumbent nothing here can beat
    cut = tree.evaluator.evaluate(c, None, low)
    assert cut.cut == low and (not cut.feasible or cut.step_time_s >= low)
    tree.costs.memo.leaf.clear()
    assert tree._evaluate(c, None, low).cut == low
    again = tree._evaluate(c, None, math.inf)  # a worse incumbent: the memoised cut does not hold
    assert again.cut == math.inf and again.rank_recompute == full.rank_recompute
