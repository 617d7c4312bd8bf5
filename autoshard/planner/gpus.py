"""How many GPUs a problem needs: what the error names when nothing fits."""

from __future__ import annotations

import math
from dataclasses import replace

from autoshard.errors import AutoshardError
from autoshard.planner.candidates import Problem, check_problem
from autoshard.planner.costs import CandidateCosts
from autoshard.planner.tree import LEVELS, Tree


def smallest_gpus_that_fit(problem: Problem) -> int | None:
    """The least multiple (2x, 4x, ... 64x) of the GPU count on which some plan fits: for each
    root, its first axis order with everything recomputed at the highest ZeRO stage, under every
    schedule."""
    for factor in (2, 4, 8, 16, 32, 64):
        bigger = replace(problem, gpus=problem.gpus * factor, forced={})
        try:
            check_problem(bigger)
        except AutoshardError:
            continue
        tree = Tree(CandidateCosts(bigger))
        for root in tree.roots():
            ordered = replace(next(tree.children(root, 0)), recompute=tree.costs.all_categories)
            for sched in tree.children(ordered, 2):
                leaf = replace(sched, zero=max(tree.costs.zero_options(sched)))
                if tree.bounds.bound(leaf, LEVELS - 1)[0] < math.inf and tree.evaluator.evaluate(leaf).feasible:
                    return bigger.gpus
    return None
