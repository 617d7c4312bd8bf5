"""The per-rank recompute choice: the search ranks layouts under one recompute set for every
pipeline rank, then refines its winner with each rank choosing its own set jointly with the
stage partition (``Planner.refine``). The refinement never makes a plan slower, and where memory
is tight only on the ranks holding the most micro-batches, it lets the others save more."""

from dataclasses import replace

import pytest

from autoshard.planner import Problem, parse_force
from autoshard.planner.search import Planner

from conftest import captured, extended_profile


def _planner(gb: float, force: str) -> Planner:
    _, cost = captured("llama3", "tiny", 64)
    hw = extended_profile(extends="cpu", hbm_gb=gb, memory_reserve_gb=0)
    return Planner(Problem(cost, hw, 2, 64, 8, "bf16", parse_force(force)), alternatives=1)


def test_the_refined_plan_is_quicker_than_one_set_for_every_rank():
    """The tiny LLaMA on 1.5 MB per device, PP2 1F1B (tests/test_stage_recompute.py): one set
    for both ranks must recompute on both; per rank, the last saves everything."""
    planner = _planner(0.0015, "pp=2,tp=1,dp=1,mbs=1,schedule=1f1b")
    refined = planner.run().best
    assert len(set(refined.rank_recompute)) == 2
    most = max(refined.rank_recompute, key=len)
    uniform = planner.tree.evaluator.evaluate(replace(refined.candidate, recompute=most))
    assert uniform.feasible and len(set(uniform.rank_recompute)) == 1
    assert refined.step_time_s < uniform.step_time_s


@pytest.mark.parametrize("gb", [0.0015, 0.002, 1.0])
def test_refining_never_slows_the_plan(gb):
    planner = _planner(gb, "pp=2,tp=1,dp=1,mbs=1")
    found = planner.run().best
    again = planner.refine(found)
    assert again.step_time_s <= found.step_time_s
    uniform = planner.tree.evaluator.evaluate(found.candidate)
    assert not uniform.feasible or found.step_time_s <= uniform.step_time_s * (1 + 1e-12)
