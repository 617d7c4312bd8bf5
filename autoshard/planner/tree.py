"""The search tree and its best-first branch and bound.

The tree: family (TP, CP, EP, FP8, attention variant) -> root (pipeline depth and DP, micro-batch
size) -> axis order -> recompute set -> pipeline schedule and virtual stages -> ZeRO stage -> stage
partition (CP-SAT, ``partition.py``). A family's roots are made only when its floor (a per-sequence
bound, ``Bounds.family_floor``) reaches the top of the heap: most families never do.
Every node carries a lower bound on the step time of every plan below it (``bounds.py``).

Nodes are expanded best bound first (deepest first among equal bounds); a node's own bound is
computed lazily, when it reaches the top of the heap. A search over a share of the families stops
when the best bound left cannot beat its best plan, so it returns the optimum of its share for the
cost model.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import replace

from autoshard import progress
from autoshard.cost_models.layers import POST
from autoshard.planner.bounds import Bounds
from autoshard.planner.candidates import Candidate, divisors, family_options, meshes, orders, runnable, schedules
from autoshard.planner.costs import CandidateCosts
from autoshard.planner.evaluate import Evaluation, Evaluator, undominated_sets

LEVELS = 5  # root, axis order, recompute set, schedule, ZeRO stage; leaves below
# nodes between progress updates: a node costs milliseconds (its bounds, CP-SAT at the leaves), so
# a terminal sees a few updates a second and the loop pays one check per node
PROGRESS_EVERY = 16
# until a plan is found, the first DIVES nodes expanded at level DIVE_FROM (recompute set chosen)
# each send a dive to a leaf (``Tree._dive``), evaluating at most DIVE_LEAVES leaves
DIVE_FROM, DIVES, DIVE_LEAVES = 2, 3, 4


class Tree:
    """One problem's search tree: its nodes, their bounds (``bounds``) and the exact evaluation of
    its leaves (``evaluator``), all over one set of memoised ``costs``."""

    def __init__(self, costs: CandidateCosts):
        self.costs = costs
        self.p = costs.p
        self.bounds = Bounds(costs)
        self.evaluator = Evaluator(costs)

    def families(self) -> dict[tuple, list[tuple[int, int]]]:
        """The roots grouped by (tp, cp, ep, fp8, attention), each with its (pp, dp) splits: the
        level above the roots, bounded by ``family_floor`` for all its micro-batch sizes at once."""
        out: dict[tuple, list[tuple[int, int]]] = {}
        for tp, pp, cp, ep, dp in meshes(self.p):
            for fp8, attn in family_options(self.p, cp):
                out.setdefault((tp, cp, ep, fp8, attn), []).append((pp, dp))
        return out

    def roots(self, family: tuple | None = None, splits: list[tuple[int, int]] | None = None):
        """Every (mesh, micro-batch size, FP8, attention) of one family, or of all of them."""
        if family is None:
            for fam, fam_splits in self.families().items():
                yield from self.roots(fam, fam_splits)
            return
        pins = self.p.forced
        tp, cp, ep, fp8, attn = family
        # the head's rank keeps at least one micro-batch of the loss's tensors (linear in mbs)
        per_sequence = self.costs.layers.activation(POST, 1, tp, cp, self.costs.all_categories)
        for pp, dp in splits:
            per_rank = self.p.global_batch // dp
            largest = self.p.hw.usable_bytes // per_sequence if per_sequence > 0 else per_rank
            for mbs in divisors(per_rank):
                if mbs > largest:
                    break
                m = per_rank // mbs
                if pins.get("mbs", mbs) != mbs or pins.get("microbatches", m) != m:
                    continue
                yield Candidate(tp, pp, cp, ep, dp, mbs, fp8, attn, frozenset())

    def children(self, c: Candidate, level: int):
        costs = self.costs
        if level == 0:
            seen = set()
            for order in orders(c, self.p):
                child = replace(c, order=order)
                layout = costs.where(child, True)[0]
                if layout not in seen:  # orders that put every axis on the same links cost the same
                    seen.add(layout)
                    yield child
        elif level == 1:
            yield from self._undominated_recompute(c)
        elif level == 2:
            for name, v in schedules(self.p, c.pp, costs.microbatches(c)):
                if runnable(name, c.pp, c.recompute, costs.model_categories, 0, c.dp * c.cp):
                    yield replace(c, schedule=name, v=v)
        elif level == 3:
            for z in costs.zero_options(c):
                if runnable(c.schedule, c.pp, c.recompute, costs.model_categories, z, c.dp * c.cp):
                    yield replace(c, zero=z)

    def _undominated_recompute(self, c: Candidate):
        """Recompute sets not dominated by another (``evaluate.undominated_sets``); each is the
        cheapest set a pipeline rank below uses (``evaluate.stage_choices``)."""
        for rc in undominated_sets(self.costs, c):
            yield replace(c, recompute=rc)

    def branch_and_bound(self, share: tuple[int, int] = (0, 1)):
        """Best first over the families whose rank by floor is ``share[0]`` modulo ``share[1]``
        (dealt out like cards, so every share holds good families and prunes early): (best or
        None, infeasible leaves, nodes, leaves). Long because its loop is one piece: families
        opened, nodes bounded lazily, expanded, a dive sent, leaves evaluated, each step reading
        the heap and the incumbent the others change."""
        bounds = self.bounds
        heap: list = []
        tick = itertools.count()
        families = self.families()
        floors = [(bounds.family_floor(family), next(tick), family) for family in families]
        index, shares = share
        for rank, (floor, order, family) in enumerate(sorted(floors, key=lambda x: x[:2])):
            if rank % shares == index:  # level -1: roots made only when the family's floor is reached
                heap.append((floor, 0, order, -1, family))
        heapq.heapify(heap)
        best: Evaluation | None = None
        infeasible: list[Evaluation] = []
        does_not_fit: set[Candidate] = set()
        nodes = leaves = dives = 0
        fixed = self.p.forced.get("stage_layers")
        while heap:
            lb, needs_bound, _, level, c = heapq.heappop(heap)
            if best is not None and lb >= best.step_time_s:
                break
            if level < 0:
                for root in self.roots(c, families[c]):
                    quick = bounds.quick_bound(root)
                    if quick < math.inf:
                        heapq.heappush(heap, (quick, 1, next(tick), 0, root))  # fully bounded when popped
                continue
            if needs_bound:  # pushed with its parent's bound: bound it now
                own = self._bound(c, level, math.inf if best is None else best.step_time_s)
                if own < math.inf and (best is None or own < best.step_time_s):
                    heapq.heappush(heap, (own, 0, next(tick), level, c))
                continue
            nodes += 1
            if best is None and level == DIVE_FROM and dives < DIVES:
                # a plan early, so that the bounds to come can stop at it (``Bounds.bound``'s cut)
                dives += 1
                found = self._dive(c, level, fixed, [DIVE_LEAVES], infeasible, does_not_fit)
                leaves += found[1]
                best = found[0]
            if not nodes % PROGRESS_EVERY:  # the bound popped rises: the gap to ``best`` closes
                progress.update(nodes=nodes, bound_s=lb, best_s=best.step_time_s if best else None)
            if level < LEVELS - 1:
                for child in self.children(c, level):
                    if level in (1, 3) and not bounds.may_fit(child, level + 1):
                        continue
                    # a schedule's floor is infinite where no ZeRO stage fits under it
                    floor = max(lb, bounds.schedule_floor(c, child)) if level == 2 else lb
                    if best is None or floor < best.step_time_s:
                        heapq.heappush(heap, (floor, 1, next(tick), level + 1, child))
                continue
            if fixed is not None and len(fixed) != c.pp * c.v:
                continue
            memory_key = replace(c, order=())  # memory does not depend on the axis order
            if memory_key in does_not_fit:
                continue
            leaves += 1
            ev = self._evaluate(c, fixed)
            if not ev.feasible:
                does_not_fit.add(memory_key)
                infeasible.append(ev)
            elif best is None or ev.step_time_s < best.step_time_s:
                best = ev
        return best, infeasible, nodes, leaves

    def _dive(self, c: Candidate, level: int, fixed, budget: list, infeasible: list, does_not_fit: set) -> tuple:
        """(the first plan that fits found below ``c`` going down by the least bound first, or
        None; leaves evaluated), evaluating at most ``budget[0]`` leaves. Its plan is a plan of the
        share like any other: it only gives the search an incumbent before the heap reaches one."""
        if level == LEVELS - 1:
            memory_key = replace(c, order=())
            if (fixed is not None and len(fixed) != c.pp * c.v) or memory_key in does_not_fit:
                return None, 0
            budget[0] -= 1
            ev = self._evaluate(c, fixed)
            if not ev.feasible:
                does_not_fit.add(memory_key)
                infeasible.append(ev)
                return None, 1
            return ev, 1
        kids = [k for k in self.children(c, level) if level not in (1, 3) or self.bounds.may_fit(k, level + 1)]
        ranked = sorted((self._bound(k, level + 1, math.inf), i) for i, k in enumerate(kids))
        evaluated = 0
        for value, i in ranked:
            if value == math.inf or budget[0] <= 0:
                break
            found, n = self._dive(kids[i], level + 1, fixed, budget, infeasible, does_not_fit)
            evaluated += n
            if found is not None:
                return found, evaluated
        return None, evaluated

    def _bound(self, c: Candidate, level: int, incumbent: float) -> float:
        """``Bounds.bound``, memoised for the whole search (the per-mesh searches share the memo):
        a partial bound (cut at an incumbent) is computed again where it no longer cuts."""
        table = self.costs.memo.node_bound
        key = (c, level)
        value, whole = table.get(key, (None, False))
        if value is None or not whole and value < incumbent:
            value, whole = table[key] = self.bounds.bound(c, level, incumbent)
        return value

    def _evaluate(self, c: Candidate, fixed) -> Evaluation:
        """``Evaluator.evaluate``, memoised likewise (it depends on the candidate and the fixed
        stages alone: the per-mesh searches differ from the main one only in the mesh pins)."""
        table = self.costs.memo.leaf
        key = (c, None if fixed is None else tuple(fixed))
        if key not in table:
            table[key] = self.evaluator.evaluate(c, fixed)
        return table[key]
