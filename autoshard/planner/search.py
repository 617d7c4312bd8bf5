"""Branch and bound over the search space, CP-SAT at the leaves.

The tree: family (TP, CP, EP, FP8, attention variant) -> root (pipeline depth and DP, micro-batch
size) -> axis order -> recompute set -> pipeline schedule and virtual stages -> ZeRO stage -> stage
partition (CP-SAT, ``partition.py``). A family's roots are made only when its floor (a per-sequence
bound, ``family_floor``) reaches the top of the heap: most families never do.
Every node carries a lower bound on the step time of every plan below it. Choices not yet made are
minimised over where that is cheap (schedule, ZeRO stage) and relaxed where it is not:

- before the axis order is fixed, every axis is priced at the fastest placement any order can
  give it (its ranks consecutive);
- until the recompute set is chosen: nothing recomputed for time, everything for memory;
- until the schedule is chosen: the cheapest over the schedules of each one's fill/drain and EP
  exposure (only DualPipeV hides the all-to-all); once the recompute set is known, only over the
  schedules it runs with and fits under, before, for memory, the fewest in-flight micro-batches
  any schedule keeps on each rank;
- until the ZeRO stage is chosen: for memory, the least of the highest stage (smallest model
  states) and the highest below ZeRO-3 (whose gathered layers add buffers);
- the slowest rank is at least the average rank, and, once the schedule is known, at least what
  whole layers allow under every rank's memory limit (``tmax_bound``);
- exposed data-parallel time on the busiest rank is at least its average over ranks;
- a memory lower bound (``memory_bound``) prunes nodes that cannot fit.

Nodes are expanded best bound first (deepest first among equal bounds); a node's own bound is
computed lazily, when it reaches the top of the heap. The families are dealt by floor into two
shares searched independently, in two processes where there are two cores (``run``). A share
stops when the best bound left cannot beat its best plan, so the better of the two shares' plans
is optimal for the cost model; the runners-up are the best plans of the neighbouring meshes.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from functools import lru_cache

from autoshard.errors import AutoshardError
from autoshard.planner import partition
from autoshard.planner.candidates import (
    Candidate,
    Problem,
    check_problem,
    divisors,
    family_options,
    meshes,
    orders,
    recompute_options,
    runnable,
    schedules,
)
from autoshard.planner.costs import (
    LayerCost,
    LayerCosts,
    ScheduleShape,
    dp_comm,
    placements,
    state_bytes,
    state_total,
)

PRE, POST = -1, -2
LEVELS = 5  # root, axis order, recompute set, schedule, ZeRO stage; leaves below


@dataclass
class Evaluation:
    """A fully specified plan and what the cost model predicts for it."""

    candidate: Candidate
    feasible: bool
    step_time_s: float = math.inf
    stage_layers: list[int] = field(default_factory=list)
    breakdown: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)  # the busiest rank
    memory_ranks: list[float] = field(default_factory=list)
    mfu: float = 0.0
    reason: str = ""  # why infeasible
    optimal: bool = True


@dataclass
class SearchResult:
    best: Evaluation
    ranked: list[Evaluation]  # best plan per distinct mesh, best first
    infeasible: list[Evaluation]
    nodes: int
    leaves: int


@dataclass
class Work:
    """Per-micro-batch totals of one candidate (all layers, embedding and head), one GPU."""

    kinds: list[LayerCost]
    pre: LayerCost
    post: LayerCost
    total: float  # critical-path time of everything
    f: float
    b: float
    w: float
    act: float
    params_dense: float
    params_expert: float
    p2p: float
    recompute: frozenset = frozenset()  # what the layers recompute
    states: dict = field(default_factory=dict)  # zero -> per-kind state bytes, cached


@lru_cache(maxsize=4096)
def _shape(name: str, v: int) -> ScheduleShape:
    return ScheduleShape(name, v)


def _least_memory_stages(zeros: tuple[int, ...]) -> tuple[int, ...]:
    """The ZeRO stages among ``zeros`` that can need the least memory: model states shrink as the
    stage rises and buffers are the same below ZeRO-3, whose gathered layers add to them; so the
    highest stage, and the highest one below 3."""
    below = [z for z in zeros if z < 3]
    return tuple({max(zeros), *(below and [max(below)])})


def _ends(shape: ScheduleShape, pp: int) -> tuple[int, int]:
    """The ranks holding the first and the last chunk (embedding and head)."""
    return shape.chunk_rank(0, pp), shape.chunk_rank(pp * shape.v - 1, pp)


class Planner:
    def __init__(self, problem: Problem, alternatives: int = 4):
        self.p = problem
        self.k = alternatives
        self.costs = LayerCosts(problem)
        self._floor_costs = LayerCosts(problem, floor=True)
        self.kinds = problem.layer_kinds
        self.kind_counts = [blk.count for blk in problem.cost.blocks]
        self.model_flops = 3 * problem.cost.flops_forward(1, problem.seq) * problem.global_batch
        self.recompute_sets = recompute_options(problem)
        self.all_categories = frozenset().union(*self.recompute_sets)
        self.model_categories = problem.categories
        self._work: dict = {}
        self._places: dict = {}
        self._cache: dict = {}

    # -- per-candidate quantities --------------------------------------------------------------

    def microbatches(self, c: Candidate) -> int:
        return self.p.global_batch // (c.dp * c.mbs)

    def where(self, c: Candidate, exact_order: bool):
        key = (c.tp, c.pp, c.cp, c.ep, c.dp, c.order if exact_order else None)
        if key not in self._places:
            where = placements(c, c.order if exact_order else None, self.p.hw)
            self._places[key] = (tuple(sorted(where.items())), where)
        return self._places[key]

    def work(self, c: Candidate, where_key, where, overlap: bool, recompute: frozenset | None = None) -> Work:
        rc = c.recompute if recompute is None else recompute
        key = (c.tp, c.pp, c.cp, c.ep, c.dp, c.mbs, c.fp8, c.attention, rc, where_key, overlap)
        w = self._work.get(key)
        if w is None:
            c2 = c if rc == c.recompute else replace(c, recompute=rc)
            kinds = [self.costs.layer(i, c2, where) for i in range(len(self.p.cost.blocks))]
            pre, post = self.costs.layer(PRE, c2, where), self.costs.layer(POST, c2, where)
            counts = self.kind_counts

            def tot(attr):
                return (
                    sum(n * getattr(k, attr) for n, k in zip(counts, kinds)) + getattr(pre, attr) + getattr(post, attr)
                )

            total = sum(n * k.time(overlap) for n, k in zip(counts, kinds)) + pre.time(overlap) + post.time(overlap)
            # communication on the fill/drain path: half in forward, half in backward. A rank's
            # pipeline sends (one per virtual stage) lie on it too; in the steady state they are
            # asynchronous and overlap the next micro-batch's compute (LLaMA-3 section 3.3.2).
            sends = c.v * c.pp * max(k.p2p for k in kinds)
            half = (tot("tp") + tot("cp") + (0 if overlap else tot("ep")) + sends) / 2
            w = Work(
                kinds,
                pre,
                post,
                total,
                tot("f") + half,
                tot("b") + half,
                tot("w"),
                tot("activation_bytes"),
                tot("params_dense"),
                tot("params_expert"),
                max(k.p2p for k in kinds),
                rc,
            )
            self._work[key] = w
        return w

    def states(self, c: Candidate, w: Work, zero: int) -> tuple[list[float], float, float]:
        """(per-kind, embedding, head) model-state bytes at this ZeRO stage."""
        if zero not in w.states:
            dpcp = c.dp * c.cp
            per = [state_total(k.params_dense, k.params_expert, zero, dpcp, c.ep) for k in w.kinds]
            pre = state_total(w.pre.params_dense, w.pre.params_expert, zero, dpcp, c.ep)
            post = state_total(w.post.params_dense, w.post.params_expert, zero, dpcp, c.ep)
            w.states[zero] = (per, pre, post)
        return w.states[zero]

    def buffers(self, c: Candidate, w: Work, zero: int) -> tuple[float, float]:
        """Bytes every rank needs besides model states and saved activations: the largest transient
        (gathered K/V, expert dispatch buffers, ZeRO-3's gathered layer and its prefetch) and the
        pipeline's send/receive buffers; then the extra on the rank holding the output head."""
        transient = max([k.transient_bytes for k in w.kinds] + [w.pre.transient_bytes])
        if zero == 3:
            transient += 2 * max(k.params_dense + k.params_expert for k in w.kinds) * 2
        boundary = (
            2
            * self.costs._block(0).eval("boundary", c.mbs, self.p.seq / c.cp)
            / (c.tp if c.tp > 1 and self.costs.sp else 1)
        )
        return transient + (4 * boundary if c.pp > 1 else 0.0), w.post.transient_bytes

    # -- bounds -----------------------------------------------------------------------------------

    def bound(self, c: Candidate, level: int) -> float:
        """Lower bound on the step time of any plan below this node (inf: none can fit).

        Levels: 0 root, 1 axis order, 2 recompute set, 3 schedule, 4 ZeRO stage."""
        m = self.microbatches(c)
        where_key, where = self.where(c, level >= 1)
        zeros = (c.zero,) if level >= 4 else tuple(self.zero_options(c))
        if level < 3:
            # Overlapping EP traffic (as DualPipeV does) only ever lowers a layer's time, so the
            # overlapped costs bound every schedule from below.
            shapes, least = self.schedule_shapes(c.pp, m)
            if not shapes:
                return math.inf
            # memory first: it needs only the activations, not the layers' times
            w0 = self.work(c, where_key, where, True, frozenset())
            rc = c.recompute if level >= 2 else self.all_categories
            if self.memory_bound(c, zeros, w0, least, rc) > self.p.hw.usable_bytes:
                return math.inf
            works = {True: w0 if level < 2 else self.work(c, where_key, where, True)}
            if c.ep > 1 and any(not shape.overlaps_ep for shape, _ in shapes):
                # schedules that do not overlap the all-to-all pay it in full
                works[False] = self.work(c, where_key, where, False, None if level >= 2 else frozenset())
            else:
                works[False] = works[True]
            if level == 2:  # only the schedules this recompute set runs with, and fits under
                shapes = [
                    (shape, flight)
                    for shape, flight in shapes
                    if runnable(shape.name, c.pp, c.recompute, self.model_categories, 0, c.dp * c.cp)
                    and self.memory_bound(c, zeros, w0, flight, rc) <= self.p.hw.usable_bytes
                ]
                if not shapes:
                    return math.inf
        else:
            works = {
                _shape(c.schedule, c.v).overlaps_ep: self.work(c, where_key, where, _shape(c.schedule, c.v).overlaps_ep)
            }
        dp = min(self.dp_bound(c, z, w, where_key, where, m) for z in zeros for w in works.values())
        if level < 3:
            # schedule still open: the cheapest fill/drain over schedules, the average rank, and a
            # memory test with the fewest in-flight micro-batches any schedule has on each rank
            key = ("pipe", tuple(id(w) for w in works.values()), c.pp, m, level == 2)
            best = self._cache.get(key)
            if best is None:
                best = math.inf
                for shape, _ in shapes:
                    w, overlap = works[shape.overlaps_ep], shape.overlaps_ep
                    bubble = shape.bubble(c.pp, m, w.f / c.pp, w.b / c.pp, w.w / c.pp, w.total / c.pp)
                    t_max = max(w.total / c.pp, w.pre.time(overlap), w.post.time(overlap))
                    best = min(best, m * t_max + bubble)
                self._cache[key] = best
            return best + dp
        shape = _shape(c.schedule, c.v)
        w = works[shape.overlaps_ep]
        m_flight = self.in_flight(shape, c.pp, m)
        bubble = shape.bubble(c.pp, m, w.f / c.pp, w.b / c.pp, w.w / c.pp, w.total / c.pp)
        if self.memory_bound(c, zeros, w, m_flight) > self.p.hw.usable_bytes:
            return math.inf
        t_max = self.tmax_bound(c, w, _ends(shape, c.pp), zeros, m_flight, shape.overlaps_ep)
        if t_max == math.inf:
            return math.inf
        return m * t_max + bubble + dp

    def may_fit(self, c: Candidate, level: int) -> bool:
        """The memory test of ``bound`` alone, for a node just made at ``level`` 2 (recompute set
        chosen) or 3 (schedule chosen): children that fail it are never queued."""
        m = self.microbatches(c)
        where_key, where = self.where(c, True)
        zeros = tuple(self.zero_options(c))
        w0 = self.work(c, where_key, where, True, frozenset())
        shape = _shape(c.schedule, c.v) if level == 3 else None
        flight = self.in_flight(shape, c.pp, m) if shape else self.schedule_shapes(c.pp, m)[1]
        return self.memory_bound(c, zeros, w0, flight, c.recompute) <= self.p.hw.usable_bytes

    def in_flight(self, shape: ScheduleShape, pp: int, m: int) -> tuple:
        key = ("flight", shape, pp, m)
        if key not in self._cache:
            self._cache[key] = tuple(shape.in_flight(r, pp, m) for r in range(pp))
        return self._cache[key]

    def schedule_shapes(self, pp: int, m: int):
        """The schedules valid for (pp, m) with their in-flight counts, and the per-rank least."""
        key = ("shapes", pp, m)
        if key not in self._cache:
            shapes = [(_shape(n, v), None) for n, v in schedules(self.p, pp, m)]
            shapes = [(sh, self.in_flight(sh, pp, m)) for sh, _ in shapes]
            least = tuple(map(min, *[f for _, f in shapes])) if len(shapes) > 1 else (shapes[0][1] if shapes else ())
            self._cache[key] = (shapes, least)
        return self._cache[key]

    def quick_bound(self, c: Candidate) -> float:
        """A cheap root bound: compute and TP/CP/EP traffic at their best placements (EP hidden as
        far as compute can hide it, the hidden traffic slowing compute), nothing recomputed, a
        perfect split over the pipeline ranks, the smallest fill/drain of any schedule (from
        compute alone); and a memory test that every rank keeps at least its share of the
        layers' inputs, everything else recomputed, and the head's rank its loss tensors."""
        key = ("quick", c.tp, c.cp, c.ep, c.mbs, c.fp8, c.attention)
        if key not in self._cache:
            blocks = [*range(len(self.p.cost.blocks)), PRE, POST]
            counts = [*self.kind_counts, 1, 1]
            where = self.where(c, False)[1]
            compute = least = fs = bs = ws = 0.0
            for block, n in zip(blocks, counts):
                layer = self.costs.layer(block, c, where)  # c is a root: nothing recomputed
                compute += n * layer.time(True)
                fs, bs, ws = fs + n * layer.f, bs + n * layer.b, ws + n * layer.w
                least += n * self.costs.activation(block, c.mbs, c.tp, c.cp, self.all_categories)
            post_act = self.costs.activation(POST, c.mbs, c.tp, c.cp, self.all_categories)
            self._cache[key] = (compute, least, post_act, fs, bs, ws)
        compute, least, post_act, fs, bs, ws = self._cache[key]
        if least / c.pp > self.p.hw.usable_bytes or post_act > self.p.hw.usable_bytes:
            return math.inf
        m = self.microbatches(c)
        shapes = self.least_bubble_shapes(c.pp, m)
        if not shapes:
            return math.inf
        bubble = min(sh.bubble(c.pp, m, fs / c.pp, bs / c.pp, ws / c.pp, compute / c.pp) for sh in shapes)
        return m * compute / c.pp + bubble

    def least_bubble_shapes(self, pp: int, m: int) -> list[ScheduleShape]:
        """Per schedule family, its shape with the most virtual stages: a bubble shrinks as v grows."""
        key = ("least-bubble", pp, m)
        if key not in self._cache:
            best: dict[str, ScheduleShape] = {}
            for shape, _ in self.schedule_shapes(pp, m)[0]:
                if shape.name not in best or shape.v > best[shape.name].v:
                    best[shape.name] = shape
            self._cache[key] = list(best.values())
        return self._cache[key]

    def zero_options(self, c: Candidate) -> list[int]:
        zs = (0, 1, 2, 3) if c.dp * c.cp > 1 else (0,)
        return [z for z in zs if self.p.forced.get("zero", z) == z]

    def dp_bound(self, c: Candidate, zero: int, w: Work, where_key, where, m: int) -> float:
        """Data-parallel time exposed on the busiest rank is at least its average over ranks."""
        key = ("dp", id(w), zero, where_key, m)
        if key not in self._cache:
            # the traffic depends on the parameters only, not on what is recomputed
            traffic_key = ("dp-traffic", c.tp, c.pp, c.cp, c.ep, c.dp, zero, where_key)
            if traffic_key not in self._cache:
                cz = replace(c, zero=zero)
                d = dp_comm(w.params_dense, w.params_expert, cz, where, self.p.hw)
                micro = 0.0
                if d["per_microbatch"] > 0:  # ZeRO-2/3 collectives run layer by layer, latency each
                    blocks = [(n, k) for n, k in zip(self.kind_counts, w.kinds)] + [(1, w.pre), (1, w.post)]
                    micro = sum(
                        n * dp_comm(k.params_dense, k.params_expert, cz, where, self.p.hw)["per_microbatch"]
                        for n, k in blocks
                    )
                self._cache[traffic_key] = (d["after_backward"], d["before_forward"], micro)
            after, before, micro = self._cache[traffic_key]
            avg = max(0.0, after - w.b - w.w) + max(0.0, before - w.f)
            if micro > 0:
                avg += m * max(0.0, micro - w.total)
            self._cache[key] = avg / c.pp
        return self._cache[key]

    def memory_bound(
        self, c: Candidate, zeros: tuple[int, ...], w: Work, in_flight: tuple, recompute: frozenset | None = None
    ) -> float:
        """A lower bound on the busiest rank's memory over every stage partition and every ZeRO
        stage in ``zeros``, with ``w``'s activations or, given ``recompute``, the activations that
        recompute set keeps (model states and buffers do not depend on it)."""
        return min(self._memory_bound(c, z, w, in_flight, recompute) for z in _least_memory_stages(zeros))

    def _memory_bound(self, c: Candidate, zero: int, w: Work, in_flight: tuple, recompute: frozenset | None) -> float:
        """``memory_bound`` at one ZeRO stage.

        For weights l_r >= 0 summing to one, max_r mem_r >= sum_r l_r mem_r, and the right side
        is smallest when each layer sits on the rank where l_r x (its memory there) is least. The
        weights are the ones that would balance identical average layers exactly."""
        # memory does not depend on the axis order, so neither does the key; the in-flight
        # tuples are memoised (``in_flight``, ``schedule_shapes``), so their identity names them
        rc = w.recompute if recompute is None else recompute
        layout = ("mem", c.tp, c.pp, c.cp, c.ep, c.dp, c.mbs, c.fp8, c.attention, rc, zero)
        key = (*layout, id(in_flight))
        value = self._cache.get(key)
        if value is not None:
            return value
        profile = self._cache.get(layout)
        if profile is None:  # the per-layer memory, shared by every schedule's in-flight counts
            per, pre, post = self.states(c, w, zero)
            if recompute is None:
                acts = [k.activation_bytes for k in w.kinds] + [w.pre.activation_bytes, w.post.activation_bytes]
            else:
                blocks = [*range(len(self.p.cost.blocks)), PRE, POST]
                acts = [self.costs.activation(b, c.mbs, c.tp, c.cp, recompute) for b in blocks]
            items = [(n, a, st) for n, a, st in zip(self.kind_counts, acts, per)]
            items += [(1, acts[-2], pre), (1, acts[-1], post)]
            layers = sum(n for n, _, _ in items)
            act_avg = sum(n * a for n, a, _ in items) / layers
            st_avg = sum(n * st for n, _, st in items) / layers
            profile = self._cache[layout] = (items, act_avg, st_avg, self.buffers(c, w, zero)[0])
        items, act_avg, st_avg, buffers = profile
        total = sum(1.0 / max(act_avg * i + st_avg, 1e-9) for i in in_flight)
        # l_r x (a i_r + st) = (a i_r + st) / (act_avg i_r + st_avg) / total is monotone in i_r
        # (a ratio of linear functions), so its least over the ranks is at the fewest or the most
        # in-flight micro-batches
        ends = (min(in_flight), max(in_flight))
        bound = sum(n * min((a * i + st) / max(act_avg * i + st_avg, 1e-9) for i in ends) / total for n, a, st in items)
        value = bound + buffers
        self._cache[key] = value
        return value

    def tmax_bound(self, c: Candidate, w: Work, ends: tuple[int, int], zeros: tuple, in_flight, overlap) -> float:
        """Lower bound on the slowest rank's time per micro-batch over all partitions and every
        ZeRO stage in ``zeros``, with whole layers and each rank's memory limit (inf when no split
        fits), the embedding on rank ``ends[0]`` and the head on ``ends[1]``."""
        return min(self._tmax_bound(c, w, ends, z, in_flight, overlap) for z in _least_memory_stages(zeros))

    def _tmax_bound(self, c: Candidate, w: Work, ends: tuple[int, int], zero: int, in_flight, overlap) -> float:
        """``tmax_bound`` at one ZeRO stage. Every layer is given the smallest time and memory of
        any layer kind, and the embedding/head time is rounded down to whole layers, which can
        only lower the bound. ``in_flight`` is a memoised tuple (its identity keys the memo)."""
        key = ("tmax", id(w), zero, ends, id(in_flight), overlap)
        if key in self._cache:
            return self._cache[key]
        per, pre_state, post_state = self.states(c, w, zero)
        buffers, post_buffers = self.buffers(c, w, zero)
        layers = self.p.num_layers
        first, last = ends
        t_min = min(k.time(overlap) for k in w.kinds)
        a_min = min(k.activation_bytes for k in w.kinds)
        s_min = min(per)
        caps, lead = [], []
        value = None
        for r in range(c.pp):
            fixed, t_fixed = buffers, 0.0
            if r == first:
                fixed += w.pre.activation_bytes * in_flight[r] + pre_state
                t_fixed += w.pre.time(overlap)
            if r == last:
                fixed += w.post.activation_bytes * in_flight[r] + post_state + post_buffers
                t_fixed += w.post.time(overlap)
            room = self.p.hw.usable_bytes - fixed
            if room < 0:
                value = math.inf
                break
            unit = a_min * in_flight[r] + s_min
            caps.append(layers if unit <= 0 else min(layers, int(room // unit)))
            lead.append(int(t_fixed // t_min) if t_min > 0 else 0)
        if value is None:
            if sum(caps) < layers:
                value = math.inf
            else:
                lo, hi = 0, layers + max(lead)
                while lo < hi:  # least k with sum_r min(cap_r, k - lead_r) >= layers
                    mid = (lo + hi) // 2
                    if sum(min(cap, max(0, mid - d)) for cap, d in zip(caps, lead)) >= layers:
                        hi = mid
                    else:
                        lo = mid + 1
                value = max(w.total / c.pp, lo * t_min, w.pre.time(overlap), w.post.time(overlap))
        self._cache[key] = value
        return value

    # -- exact evaluation ---------------------------------------------------------------------------

    def evaluate(self, c: Candidate, fixed_stages: tuple[int, ...] | None = None) -> Evaluation:
        p, hw = self.p, self.p.hw
        m = self.microbatches(c)
        where_key, where = self.where(c, True)
        shape = _shape(c.schedule, c.v)
        overlap = shape.overlaps_ep
        w = self.work(c, where_key, where, overlap)
        per_state, pre_state, post_state = self.states(c, w, c.zero)

        def entry(layer: LayerCost, state: float) -> dict:
            after, before, micro = _dp_linear(layer, c, where, hw)
            return {
                "time": layer.time(overlap),
                "fwd": layer.f,
                "bwd": layer.b + layer.w,
                "act": layer.activation_bytes,
                "state": state,
                "dp_time": after,
                "dp_gather": before,
                "dp_micro": micro,
            }

        entries = [entry(k, st) for k, st in zip(w.kinds, per_state)]
        buffers, post_buffers = self.buffers(c, w, c.zero)
        q = partition.Quantities(
            time=[e["time"] for e in entries],
            fwd=[e["fwd"] for e in entries],
            bwd=[e["bwd"] for e in entries],
            act=[e["act"] for e in entries],
            state=[e["state"] for e in entries],
            dp_time=[e["dp_time"] for e in entries],
            dp_gather=[e["dp_gather"] for e in entries],
            dp_micro=[e["dp_micro"] for e in entries],
            pre=entry(w.pre, pre_state),
            post=entry(w.post, post_state),
            p2p=0.0,  # pipeline sends overlap compute in the steady state; fill/drain counts them
            dp_latency=_latency(c, where, hw, w),
            buffers=buffers,
            post_buffers=post_buffers,
            capacity=hw.usable_bytes,
        )
        in_flight = [shape.in_flight(r, c.pp, m) for r in range(c.pp)]
        part = partition.solve(
            self.kinds, q, c.pp, c.v, lambda ch: shape.chunk_rank(ch, c.pp), in_flight, m, fixed_stages
        )
        if part is None:
            acts = sum(n * k.activation_bytes for n, k in zip(self.kind_counts, w.kinds))
            states = sum(n * s for n, s in zip(self.kind_counts, per_state)) + pre_state + post_state
            need = (acts * max(in_flight) + states) / c.pp + buffers
            return Evaluation(
                c,
                False,
                reason=f"does not fit: needs about {need / 1e9:.0f} GB per GPU, {hw.usable_bytes / 1e9:.0f} GB usable",
            )
        bubble = shape.bubble(c.pp, m, w.f / c.pp, w.b / c.pp, w.w / c.pp, w.total / c.pp)
        breakdown = self._breakdown(c, w, part, bubble, m, where)
        # pipeline sends and data-parallel traffic hidden behind compute slow that compute down
        # (the layers' hidden TP/CP/EP traffic is already in their times)
        hidden = sum(breakdown["comm_s"][a]["total"] - breakdown["comm_s"][a]["exposed"] for a in ("pp", "dp"))
        step = m * part.t_max + bubble + part.dp_exposed + hw.overlap_slowdown * max(0.0, hidden)
        breakdown["overlap_s"] += hw.overlap_slowdown * max(0.0, hidden)
        ev = Evaluation(c, True, step, part.stage_layers, optimal=part.optimal)
        ev.memory_ranks = part.memory
        ev.breakdown = breakdown
        ev.memory = self._memory_breakdown(c, part, in_flight, w)
        ev.mfu = self.model_flops / (step * p.gpus * hw.peak_flops("bf16"))
        return ev

    def _breakdown(self, c: Candidate, w: Work, part, bubble: float, m: int, where) -> dict:
        counts = self.kind_counts
        overlap = _shape(c.schedule, c.v).overlaps_ep

        def per_rank(attr):
            tot = (
                sum(n * getattr(k, attr) for n, k in zip(counts, w.kinds))
                + getattr(w.pre, attr)
                + getattr(w.post, attr)
            )
            return m * tot / c.pp

        ep_total = per_rank("ep")
        ep_exposed = ep_total
        if overlap:
            ep_exposed -= m * sum(n * min(k.ep, k.compute) for n, k in zip(counts, w.kinds)) / c.pp
        pp_total = m * c.v * w.p2p if c.pp > 1 else 0.0
        shape = _shape(c.schedule, c.v)
        sends = c.v * w.p2p / 2 if c.pp > 1 else 0.0
        pp_exposed = bubble - shape.bubble(c.pp, m, w.f / c.pp - sends, w.b / c.pp - sends, w.w / c.pp, w.total / c.pp)
        d = dp_comm(w.params_dense / c.pp, w.params_expert / c.pp, c, where, self.p.hw)
        dp_total = d["after_backward"] + d["before_forward"] + m * d["per_microbatch"]
        layers_overlap = (
            m
            * (
                sum(n * k.interference(overlap) for n, k in zip(counts, w.kinds))
                + w.pre.interference(overlap)
                + w.post.interference(overlap)
            )
            / c.pp
        )
        return {
            "compute_s": per_rank("f") + per_rank("b") + per_rank("w"),
            "overlap_s": layers_overlap,
            "recompute_s": per_rank("recompute"),
            "bubble_s": bubble,
            "imbalance_s": m * part.t_max - m * w.total / c.pp,
            "comm_s": {
                "tp": {"total": per_rank("tp_total"), "exposed": per_rank("tp")},
                "cp": {"total": per_rank("cp_total"), "exposed": per_rank("cp")},
                "ep": {"total": ep_total, "exposed": ep_exposed},
                "pp": {"total": pp_total, "exposed": max(0.0, pp_exposed)},
                "dp": {"total": dp_total, "exposed": part.dp_exposed},
            },
            "links": {a: ("nvlink" if where[a].domains == 1 else "network") for a in ("tp", "cp", "pp", "ep", "dpcp")},
        }

    def _memory_breakdown(self, c: Candidate, part, in_flight, w: Work) -> dict:
        worst = max(range(len(part.memory)), key=lambda r: part.memory[r])
        shape = _shape(c.schedule, c.v)
        cuts = [0]
        for n in part.stage_layers:
            cuts.append(cuts[-1] + n)
        chunks = len(part.stage_layers)
        dense = expert = act = 0.0
        for ch in range(chunks):
            if shape.chunk_rank(ch, c.pp) != worst:
                continue
            for layer in range(cuts[ch], cuts[ch + 1]):
                k = w.kinds[self.kinds[layer]]
                dense, expert, act = dense + k.params_dense, expert + k.params_expert, act + k.activation_bytes
            for extra, here in ((w.pre, ch == 0), (w.post, ch == chunks - 1)):
                if here:
                    dense += extra.params_dense
                    expert += extra.params_expert
                    act += extra.activation_bytes
        states = state_bytes(dense, expert, c)
        activations = act * in_flight[worst]
        return {
            "rank": worst,
            "params": states["params"],
            "grads": states["grads"],
            "optimizer": states["optimizer"],
            "activations": activations,
            "buffers": max(0.0, part.memory[worst] - states["total"] - activations),
            "total": part.memory[worst],
        }

    # -- the search ---------------------------------------------------------------------------------

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
        per_sequence = self.costs.activation(POST, 1, tp, cp, self.all_categories)
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

    def family_floor(self, family: tuple) -> float:
        """A lower bound on ``quick_bound`` of every root in ``family``, whatever its pipeline
        depth and micro-batch size.

        ``quick_bound`` is m x (per-micro-batch time) / pp plus a bubble >= 0, and m x mbs x pp x dp
        = global batch x tp x cp / gpus, so per-sequence time bounds it. Per block that time is
        max(C, E) + s x min(C, E) + T + [exposed + s x hidden] of the backward re-gather, the
        gradient reduce-scatter and the CP traffic (C compute, E all-to-all, T forward TP traffic,
        s the overlap slowdown). Each bracket is at least min(s, 1) x its traffic, and the whole is
        nondecreasing in C, E, T and the traffic, so the floor costs (``LayerCosts(floor=True)``,
        proportional to mbs and below the real ones) evaluated at one sequence bound it."""
        tp, cp, ep, fp8, attn = family
        c = Candidate(tp, 1, cp, ep, 1, 1, fp8, attn, frozenset())
        where = self.where(c, False)[1]
        floor = self._floor_costs
        s = self.p.hw.overlap_slowdown
        total = 0.0
        for block, n in zip([*range(len(self.p.cost.blocks)), PRE, POST], [*self.kind_counts, 1, 1]):
            f, b, w, _, _, _, _ = floor.compute(block, 1, tp, cp, fp8, frozenset(), ep)
            t_tp, (regather, scatter), (_, cp_total), t_ep, _ = floor.comm(
                block, 1, tp, cp, ep, attn, fp8, where["tp"], where["cp"], where["ep"]
            )
            compute = f + b + w
            total += n * (
                max(compute, t_ep) + s * min(compute, t_ep) + t_tp + min(s, 1.0) * (regather + scatter + cp_total)
            )
        return self.p.global_batch * tp * cp / self.p.gpus * total

    def children(self, c: Candidate, level: int):
        if level == 0:
            seen = set()
            for order in orders(c, self.p):
                child = replace(c, order=order)
                layout = self.where(child, True)[0]
                if layout not in seen:  # orders that put every axis on the same links cost the same
                    seen.add(layout)
                    yield child
        elif level == 1:
            yield from self._undominated_recompute(c)
        elif level == 2:
            for name, v in schedules(self.p, c.pp, self.microbatches(c)):
                if runnable(name, c.pp, c.recompute, self.model_categories, 0, c.dp * c.cp):
                    yield replace(c, schedule=name, v=v)
        elif level == 3:
            for z in self.zero_options(c):
                if runnable(c.schedule, c.pp, c.recompute, self.model_categories, z, c.dp * c.cp):
                    yield replace(c, zero=z)

    def _undominated_recompute(self, c: Candidate):
        """Recompute sets not dominated by another (no less recompute time and no less memory
        for every block): a dominated set can never be part of a strictly better plan."""
        key = ("pareto", c.mbs, c.tp, c.cp, c.fp8)
        if key not in self._cache:
            scored = {}
            for rc in self.recompute_sets:
                vec = tuple(
                    x
                    for block in [*range(len(self.p.cost.blocks)), PRE, POST]
                    for x in self.costs.compute(block, c.mbs, c.tp, c.cp, c.fp8, rc)[3:5]
                )
                scored.setdefault(vec, rc)  # equal costs: keep the first (smallest) set
            vecs = sorted(scored)
            keep = []
            for i, vec in enumerate(vecs):
                if not any(all(o <= x for o, x in zip(other, vec)) for other in vecs[:i]):
                    keep.append(scored[vec])
            self._cache[key] = keep
        for rc in self._cache[key]:
            yield replace(c, recompute=rc)

    def run(self) -> SearchResult:
        """The optimal plan; then, for each neighbouring mesh (one of TP, PP, CP, EP doubled or
        halved, DP absorbing the change), the best plan of that mesh: the alternatives a person
        weighs against the choice.

        The families are dealt into ``SHARES`` independent searches and the neighbouring meshes
        likewise; with a second core (and ``fork``) one share runs in a forked worker. Each share
        is searched the same way on any machine, so the plan does not depend on the core count."""
        check_problem(self.p)
        with _Helper(self) as helper:
            parts = helper.map(_search_share, [(i, SHARES) for i in range(SHARES)])
            best, infeasible, nodes, leaves = None, [], 0, 0
            for part_best, part_infeasible, part_nodes, part_leaves in parts:
                if part_best is not None and (best is None or part_best.step_time_s < best.step_time_s):
                    best = part_best
                infeasible += part_infeasible
                nodes, leaves = nodes + part_nodes, leaves + part_leaves
            if best is None:
                raise AutoshardError(self._nothing_fits(infeasible))
            ranked = [best]
            if self.k > 1:
                valid = set(meshes(replace(self.p, forced={})))
                around = [
                    mesh
                    for mesh in _neighbours(best.candidate, self.p.gpus)
                    if mesh in valid
                    and all(self.p.forced.get(k, v) == v for k, v in zip(("tp", "pp", "cp", "ep", "dp"), mesh))
                ]
                dealt = [around[i::SHARES] for i in range(SHARES)]
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

    def _best_of_mesh(self, mesh: tuple) -> tuple:
        """(the best plan of ``mesh`` or None, nodes, leaves), the other pins kept."""
        pins = dict(zip(("tp", "pp", "cp", "ep", "dp"), mesh)) | {
            k: v for k, v in self.p.forced.items() if k not in ("tp", "pp", "cp", "ep", "dp")
        }
        sub = Planner(replace(self.p, forced=pins), alternatives=1)
        # share the memoised costs and bounds: the pins differ only in the mesh, which none of the
        # memo keys leaves out
        sub.costs, sub._floor_costs = self.costs, self._floor_costs
        sub._work, sub._places, sub._cache = self._work, self._places, self._cache
        alt, _, nodes, leaves = sub._branch_and_bound()
        return alt, nodes, leaves

    def _branch_and_bound(self, share: tuple[int, int] = (0, 1)):
        """Best first over the families whose rank by floor is ``share[0]`` modulo ``share[1]``
        (dealt out like cards, so every share holds good families and prunes early): (best or
        None, infeasible leaves, nodes, leaves)."""
        heap: list = []
        tick = itertools.count()
        families = self.families()
        floors = [(self.family_floor(family), next(tick), family) for family in families]
        index, shares = share
        for rank, (floor, order, family) in enumerate(sorted(floors, key=lambda x: x[:2])):
            if rank % shares == index:  # level -1: roots made only when the family's floor is reached
                heap.append((floor, 0, order, -1, family))
        heapq.heapify(heap)
        best: Evaluation | None = None
        infeasible: list[Evaluation] = []
        does_not_fit: set[Candidate] = set()
        nodes = leaves = 0
        fixed = self.p.forced.get("stage_layers")
        while heap:
            lb, needs_bound, _, level, c = heapq.heappop(heap)
            if best is not None and lb >= best.step_time_s:
                break
            if level < 0:
                for root in self.roots(c, families[c]):
                    quick = self.quick_bound(root)
                    if quick < math.inf:
                        heapq.heappush(heap, (quick, 1, next(tick), 0, root))  # fully bounded when popped
                continue
            if needs_bound:  # pushed with its parent's bound: bound it now
                own = self.bound(c, level)
                if own < math.inf and (best is None or own < best.step_time_s):
                    heapq.heappush(heap, (own, 0, next(tick), level, c))
                continue
            nodes += 1
            if level < LEVELS - 1:
                for child in self.children(c, level):
                    if level in (1, 2) and not self.may_fit(child, level + 1):
                        continue
                    heapq.heappush(heap, (lb, 1, next(tick), level + 1, child))
                continue
            if fixed is not None and len(fixed) != c.pp * c.v:
                continue
            memory_key = replace(c, order=())  # memory does not depend on the axis order
            if memory_key in does_not_fit:
                continue
            leaves += 1
            ev = self.evaluate(c, fixed)
            if not ev.feasible:
                does_not_fit.add(memory_key)
                infeasible.append(ev)
            elif best is None or ev.step_time_s < best.step_time_s:
                best = ev
        return best, infeasible, nodes, leaves

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


SHARES = 2  # independent searches the families are dealt into (one per core, up to two cores)
_ADOPTED: Planner | None = None  # in a forked helper: the planner it works for


def _adopt(planner: Planner) -> None:
    """The helper's initializer (its argument travels by ``fork``, not by pickle)."""
    global _ADOPTED
    _ADOPTED = planner


def _in_helper(fn, item):
    return fn(_ADOPTED, item)


def _search_share(planner: Planner, share: tuple[int, int]):
    return planner._branch_and_bound(share)


def _search_meshes(planner: Planner, mesh_list: list[tuple]) -> list[tuple]:
    return [planner._best_of_mesh(mesh) for mesh in mesh_list]


def _workers() -> int:
    """Processes the search may use: ``AUTOSHARD_WORKERS``, else the cores this process may run
    on (at most ``SHARES``); 1 off Linux (``fork`` is missing on Windows and unsafe on macOS once
    system frameworks are loaded) or where this process may not have children."""
    if not sys.platform.startswith("linux") or multiprocessing.current_process().daemon:
        return 1
    env = os.environ.get("AUTOSHARD_WORKERS")
    if env is not None:
        try:
            return max(1, int(env))
        except ValueError:
            raise AutoshardError(f"AUTOSHARD_WORKERS={env!r}: expected a whole number, e.g. 1") from None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(SHARES, cores)


class _Helper:
    """Runs the first item of a map here and the rest in one forked process (which inherits the
    planner and its memo), or everything here when there is one worker. Results come back in
    order, so the outcome is the same either way."""

    def __init__(self, planner: Planner):
        self.planner = planner
        self.pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> _Helper:
        if _workers() > 1:
            # the collector would otherwise walk (and so copy, page by page) the whole inherited
            # heap in the forked process: the captured graph, its sympy formulas, the memo
            gc.freeze()
            try:
                self.pool = ProcessPoolExecutor(
                    1, mp_context=multiprocessing.get_context("fork"), initializer=_adopt, initargs=(self.planner,)
                )
            except (OSError, ImportError):  # no POSIX semaphores here (some sandboxes): one process
                gc.unfreeze()
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            gc.unfreeze()

    def map(self, fn, items: list) -> list:
        """``[fn(planner, item) for item in items]``."""
        if self.pool is None or len(items) < 2:
            return [fn(self.planner, item) for item in items]
        try:
            away = [self.pool.submit(_in_helper, fn, item) for item in items[1:]]
        except (OSError, BrokenProcessPool):
            return [fn(self.planner, item) for item in items]
        out = [fn(self.planner, items[0])]
        for item, future in zip(items[1:], away):
            try:
                out.append(future.result())
            except BrokenProcessPool:  # the helper died (killed, out of memory): do its part here
                out.append(fn(self.planner, item))
        return out


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
    return Candidate(tp, pp, cp, ep, dp, 1, False, "flash" if cp == 1 else "ring", frozenset())


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


def _dp_linear(layer: LayerCost, c: Candidate, where, hw) -> tuple[float, float, float]:
    """Data-parallel seconds for this layer's parameters. Gradient reduction and parameter
    gathering once per step are bucketed over the whole stage (their latency is paid once, in
    ``_latency``); ZeRO-2/3 per-micro-batch collectives run per layer, latency included."""
    full = dp_comm(layer.params_dense, layer.params_expert, c, where, hw)
    tiny = dp_comm(1e-9, 1e-9 if layer.params_expert else 0, c, where, hw)
    return (
        max(0.0, full["after_backward"] - tiny["after_backward"]),
        max(0.0, full["before_forward"] - tiny["before_forward"]),
        full["per_microbatch"],
    )


def _latency(c: Candidate, where, hw, w: Work) -> tuple[float, float, float]:
    """Latency of the once-per-step data-parallel collectives (independent of their size): after
    the backward and before the forward; per-micro-batch ones carry theirs per layer."""
    tiny = dp_comm(1e-9, 1e-9 if w.params_expert else 0, c, where, hw)
    return tiny["after_backward"], tiny["before_forward"], 0.0


def smallest_gpus_that_fit(problem: Problem) -> int | None:
    """The least multiple (2x, 4x, ... 64x) of the GPU count on which some plan fits."""
    for factor in (2, 4, 8, 16, 32, 64):
        bigger = replace(problem, gpus=problem.gpus * factor, forced={})
        try:
            check_problem(bigger)
        except AutoshardError:
            continue
        planner = Planner(bigger, alternatives=1)
        for root in planner.roots():
            ordered = replace(next(planner.children(root, 0)), recompute=planner.all_categories)
            for sched in planner.children(ordered, 2):
                leaf = replace(sched, zero=max(planner.zero_options(sched)))
                if planner.bound(leaf, LEVELS - 1) < math.inf and planner.evaluate(leaf).feasible:
                    return bigger.gpus
    return None
