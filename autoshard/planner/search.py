"""The search: the optimal plan of a problem, and the best plan of each neighbouring mesh.

Branch and bound (``tree.py``) over lower bounds (``bounds.py``), CP-SAT at the leaves
(``evaluate.py``, ``partition.py``), all over one problem's memoised candidate costs
(``costs.py``, ``memo.py``). The families are dealt by floor into two shares searched
independently, in two processes where there are two cores (``parallel.py``). Each share stops when
the best bound left cannot beat its best plan, so the better of the two shares' plans is optimal
for the cost model; the runners-up are the best plans of the neighbouring meshes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autoshard import progress
from autoshard.errors import AutoshardError
from autoshard.ir.plan import AXES, Mesh
from autoshard.planner.candidates import Candidate, Problem, check_problem, meshes
from autoshard.planner.costs import CandidateCosts
from autoshard.planner.evaluate import Evaluation, stage_choices, undominated_sets
from autoshard.planner.gpus import smallest_gpus_that_fit
from autoshard.planner.parallel import Helper
from autoshard.planner.tree import Tree

SHARES = 2  # independent searches the families are dealt into (one per process)
# the least share of the step time per-rank recompute sets must save to be kept: one set for
# every rank is simpler to read and to run, and a smaller gain is below the cost model's resolution
REFINE_GAIN = 1e-4


@dataclass
class SearchResult:
    best: Evaluation
    ranked: list[Evaluation]  # best plan per distinct mesh, best first
    infeasible: list[Evaluation]
    nodes: int
    leaves: int


class Planner:
    def __init__(self, problem: Problem, alternatives: int = 4):
        self.p = problem
        self.k = alternatives
        self.tree = Tree(CandidateCosts(problem))

    def run(self) -> SearchResult:
        """The optimal plan; then, for each neighbouring mesh (one of TP, PP, CP, EP doubled or
        halved, DP absorbing the change), the best plan of that mesh: the alternatives a person
        weighs against the choice.

        The families are dealt into ``SHARES`` independent searches and the neighbouring meshes
        likewise; with a second core (and ``fork``) one share runs in a forked helper. Each share
        is searched the same way on any machine, so the plan does not depend on the core count."""
        check_problem(self.p)
        with Helper(self) as helper:
            parts = helper.map(_search_share, [(i, SHARES) for i in range(SHARES)])
            best, infeasible, nodes, leaves = None, [], 0, 0
            for part_best, part_infeasible, part_nodes, part_leaves in parts:
                if part_best is not None and (best is None or part_best.step_time_s < best.step_time_s):
                    best = part_best
                infeasible += part_infeasible
                nodes, leaves = nodes + part_nodes, leaves + part_leaves
            if best is None:
                raise AutoshardError(self._nothing_fits(infeasible))
            with progress.stage("per-rank recompute"):
                best = self.refine(best, helper)
            ranked = [best]
            if self.k > 1:
                valid = set(meshes(replace(self.p, forced={})))
                around = [
                    mesh
                    for mesh in _neighbours(best.candidate, self.p.gpus)
                    if mesh in valid and all(self.p.forced.get(k, v) == v for k, v in zip(AXES, mesh))
                ]
                dealt = [around[i::SHARES] for i in range(SHARES)]
                with progress.stage("neighbouring meshes"):
                    found = dict(zip([m for share in dealt for m in share], sum(helper.map(_search_meshes, dealt), [])))
                for mesh in around:
                    alt, n, lv = found[mesh]
                    nodes, leaves = nodes + n, leaves + lv
                    if alt is None:
                        infeasible.append(
                            Evaluation(_root_of(mesh), False, reason="does not fit in memory with any setting")
                        )
                    else:
                        ranked.append(alt)
                ranked = [ranked[0]] + sorted(ranked[1:], key=lambda e: e.step_time_s)
        return SearchResult(best, ranked, infeasible, nodes, leaves)

    def refine(self, best: Evaluation, helper: Helper | None = None) -> Evaluation:
        """``best`` or a quicker plan of its layout (mesh, order, schedule, ZeRO stage,
        micro-batch) where pipeline ranks recompute different sets, each chosen jointly with the
        stage partition (``Evaluator.evaluate(per_rank=True)``). A rank holding fewer in-flight
        micro-batches than the first may keep more than the one set every rank can afford, so
        each set that recomputes no more than ``best``'s is tried as the least any rank
        recomputes. The search ranks layouts under one set for all ranks (its bounds are for
        that), so a layout it ranked behind ``best`` could gain more from per-rank sets than
        ``best`` did: the refinement improves the plan found, it does not search again.

        The sets are evaluated in ``SHARES`` parts (in two processes where ``helper`` has two),
        each against ``best`` as found, then taken in order as if one after another: an
        evaluation only skips work it proves cannot beat its incumbent (``Evaluator._per_rank``),
        and what it finds then is no better than that incumbent, so a better one met earlier in
        the order changes nothing but the work."""
        c, tree = best.candidate, self.tree
        if c.pp == 1:
            return best
        sets = [
            rc
            for rc in undominated_sets(tree.costs, c)
            # not where some block recomputes more under ``rc`` than under ``best``'s set
            if c.recompute in stage_choices(tree.costs, replace(c, recompute=rc), c.schedule, c.zero)
        ]
        dealt = [(best, sets[i::SHARES]) for i in range(SHARES)]
        parts = helper.map(_refine_sets, dealt) if helper is not None else [_refine_sets(self, d) for d in dealt]
        found = {rc: ev for (_, share), evs in zip(dealt, parts) for rc, ev in zip(share, evs)}
        for rc in sets:
            ev = found[rc]
            if ev.feasible and ev.step_time_s < best.step_time_s * (1 - REFINE_GAIN):
                best = ev
        return best

    def _refine(self, best: Evaluation, rc: frozenset) -> Evaluation:
        """``best``'s layout with ``rc`` the least any rank recomputes, each rank choosing its set."""
        base = replace(best.candidate, recompute=rc)
        return self.tree.evaluator.evaluate(base, self.p.forced.get("stage_layers"), best.step_time_s, per_rank=True)

    def best_of_mesh(self, mesh: tuple) -> tuple:
        """(the best plan of ``mesh`` or None, nodes, leaves), the other pins kept."""
        pins = dict(zip(AXES, mesh)) | {k: v for k, v in self.p.forced.items() if k not in AXES}
        # share the memoised costs and bounds: the pins differ only in the mesh, which none of the
        # memo keys leaves out
        sub = Tree(CandidateCosts(replace(self.p, forced=pins), share=self.tree.costs))
        with progress.stage(Mesh(**dict(zip(AXES, mesh))).product_form()):
            alt, _, nodes, leaves = sub.branch_and_bound()
        return alt, nodes, leaves

    def _nothing_fits(self, infeasible: list[Evaluation]) -> str:
        pins = dict(self.p.forced)
        if pins:
            why = infeasible[0].reason if infeasible else "no candidate fits in memory"
            return f"no plan satisfies --force {_pins_text(pins)}: {why}; relax a pin or add GPUs"
        more = smallest_gpus_that_fit(self.p)
        hint = f"the smallest GPU count that fits is {more}" if more else "no GPU count up to 64x this many fits"
        return (
            f"nothing fits on {self.p.gpus} x {self.p.hw.name} ({self.p.hw.usable_bytes / 1e9:.0f} GB usable each): "
            f"{hint}; or shorten --seq-len / lower --global-batch"
        )


def _search_share(planner: Planner, share: tuple[int, int]):
    return planner.tree.branch_and_bound(share)


def _refine_sets(planner: Planner, part: tuple) -> list[Evaluation]:
    best, sets = part
    return [planner._refine(best, rc) for rc in sets]


def _search_meshes(planner: Planner, mesh_list: list[tuple]) -> list[tuple]:
    return [planner.best_of_mesh(mesh) for mesh in mesh_list]


def _neighbours(c: Candidate, gpus: int):
    """Meshes one step from ``c``: one of TP, PP, CP, EP doubled or halved (DP takes up the GPUs)."""
    for axis in ("tp", "pp", "cp", "ep"):
        for up in (True, False):
            mesh = {"tp": c.tp, "pp": c.pp, "cp": c.cp, "ep": c.ep}
            if up:
                mesh[axis] *= 2
            elif mesh[axis] % 2 == 0:
                mesh[axis] //= 2
            else:
                continue
            inner = mesh["tp"] * mesh["pp"] * mesh["cp"]
            if gpus % inner:
                continue
            yield (mesh["tp"], mesh["pp"], mesh["cp"], mesh["ep"], gpus // inner)


def _root_of(mesh: tuple) -> Candidate:
    tp, pp, cp, ep, dp = mesh
    return Candidate(tp, pp, cp, ep, dp, 1, (), "flash" if cp == 1 else "ring", frozenset())


def _pins_text(pins: dict) -> str:
    def text(v):
        if isinstance(v, bool):
            return "on" if v else "off"
        if isinstance(v, frozenset):
            return "+".join(sorted(v)) or "none"
        if isinstance(v, tuple):
            return "-".join(map(str, v))
        return str(v)

    return ",".join(f"{k}={text(v)}" for k, v in pins.items())


__all__ = ["Planner", "SearchResult", "Evaluation", "smallest_gpus_that_fit"]
