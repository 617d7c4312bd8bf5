"""Lower bounds on the step time of every plan below a node of the search tree.

Choices not yet made are minimised over where that is cheap (schedule, ZeRO stage) and relaxed
where it is not:

- before the axis order is fixed, every axis is priced at the fastest placement any order can
  give it (its ranks consecutive);
- until the recompute set is chosen: nothing recomputed for time, everything for memory;
- until the schedule is chosen: the cheapest over the schedules of each one's fill/drain and EP
  exposure (only a schedule that overlaps it hides the all-to-all); once the recompute set is
  known, only over the schedules it runs with and fits under, before, for memory, the fewest
  in-flight micro-batches any schedule keeps on each rank;
- until the ZeRO stage is chosen: for memory, the least of the highest stage (smallest model
  states) and the highest below ZeRO-3 (whose gathered layers add buffers);
- the slowest rank is at least the average rank, and, once the schedule is known, at least what
  whole layers allow under every rank's memory limit (``tmax_bound``);
- exposed data-parallel time on the busiest rank is at least its average over ranks;
- a memory lower bound (``memory_bound``) prunes nodes that cannot fit.

Above the roots, ``family_floor`` bounds every root of a family at once, per sequence. Each bound
is proved by the exhaustive-enumeration tests (``tests/planner/test_search.py``).
"""

from __future__ import annotations

import bisect
import itertools
import math

from autoshard.cost_models.comm import data_parallel
from autoshard.cost_models.layers import POST
from autoshard.ir.schedules import SCHEDULES, Schedule
from autoshard.planner.candidates import Candidate, runnable
from autoshard.planner.costs import CandidateCosts, Work


def _least_memory_stages(zeros: tuple[int, ...]) -> tuple[int, ...]:
    """The ZeRO stages among ``zeros`` that can need the least memory: model states shrink as the
    stage rises and buffers are the same below ZeRO-3, whose gathered layers add to them; so the
    highest stage, and the highest one below 3."""
    below = [z for z in zeros if z < 3]
    return tuple({max(zeros), *(below and [max(below)])})


def _ends(schedule: Schedule, v: int, pp: int) -> tuple[int, int]:
    """The ranks holding the first and the last chunk (embedding and head)."""
    return schedule.chunk_rank(0, pp), schedule.chunk_rank(pp * v - 1, pp)


class Bounds:
    def __init__(self, costs: CandidateCosts):
        self.costs = costs
        self.p = costs.p
        self.memo = costs.memo

    def bound(self, c: Candidate, level: int, incumbent: float = math.inf) -> tuple[float, bool]:
        """(lower bound on the step time of any plan below this node (inf: none can fit), whether
        it is the whole bound). Below the schedule, where the cheap terms alone reach
        ``incumbent``, the rest (the memory test and the slowest rank over whole layers) is
        skipped: the node is cut all the same, and the partial bound is still a bound.

        Levels: 0 root, 1 axis order, 2 recompute set, 3 schedule, 4 ZeRO stage."""
        costs = self.costs
        m = costs.microbatches(c)
        if level < 3:
            where_key, where = costs.where(c, level >= 1)
            zeros = tuple(costs.zero_options(c))
            return self._schedule_open(c, level, m, where_key, where, zeros, incumbent)
        zeros = self.fitting_zeros(c, level)  # the memory test, one ZeRO stage at a time
        if not zeros:
            return math.inf, True
        sched, w, t_avg, rest = self._scheduled(c, zeros)
        if m * t_avg + rest >= incumbent:
            return m * t_avg + rest, False
        m_flight = costs.in_flight(sched, c.v, c.pp, m)
        grads = costs.in_flight_with_grads(sched, c.v, c.pp, m)
        t_max = self.tmax_bound(c, w, _ends(sched, c.v, c.pp), zeros, m_flight, sched.overlaps_ep, grads)
        if t_max == math.inf:
            return math.inf, True
        return m * t_max + rest, True

    def _scheduled(self, c: Candidate, zeros: tuple) -> tuple:
        """The cheap terms of ``bound`` once the schedule is chosen: (schedule, Work, the average
        rank's time per micro-batch (or the embedding's or head's, where longer), the fill/drain
        plus the data-parallel exposure with the compute hidden traffic slows and the tied
        copies' sync, least over ``zeros``)."""
        costs = self.costs
        m = costs.microbatches(c)
        where_key, where = costs.where(c, True)
        sched = SCHEDULES[c.schedule]
        w = costs.work(c, where_key, where, sched.overlaps_ep)
        bubble = sched.bubble(c.pp, m, c.v, w.f / c.pp, w.b / c.pp, w.w / c.pp)
        pp_total, pp_exposed, _ = costs.pipeline_sends(c, sched, w, m, bubble)
        dp = min(
            self.dp_bound(c, z, w, where_key, where, m, pp_total - pp_exposed) + costs.tied_sync(c, sched, where, z)
            for z in zeros
        )
        overlap = sched.overlaps_ep
        return sched, w, max(w.total / c.pp, w.pre.time(overlap), w.post.time(overlap)), bubble + dp

    def _schedule_open(
        self, c: Candidate, level: int, m: int, where_key, where, zeros: tuple, incumbent: float = math.inf
    ) -> tuple[float, bool]:
        """``bound`` above the schedule: the cheapest fill/drain over the schedules, the average
        rank, and a memory test with the fewest in-flight micro-batches any schedule has on each
        rank; once the recompute set is chosen (``level`` 2), over the schedules it runs with and
        fits under, and the slowest rank over whole layers (skipped, as in ``bound``, where the
        rest already reaches ``incumbent``)."""
        costs, usable = self.costs, self.p.hw.usable_bytes
        shapes, least = costs.schedule_shapes(c.pp, m)
        if not shapes:
            return math.inf, True
        w0 = costs.work(c, where_key, where, True, frozenset())
        rc = c.recompute if level >= 2 else costs.all_categories
        # Overlapping EP traffic (as DualPipeV does) only ever lowers a layer's time, so the
        # overlapped costs bound every schedule from below.
        works = {True: w0 if level < 2 else costs.work(c, where_key, where, True)}
        if c.ep > 1 and any(not sched.overlaps_ep for sched, _, _ in shapes):
            # schedules that do not overlap the all-to-all pay it in full
            works[False] = costs.work(c, where_key, where, False, None if level >= 2 else frozenset())
        else:
            works[False] = works[True]
        dp = min(self.dp_bound(c, z, w, where_key, where, m) for z in zeros for w in works.values())
        cheap = self._open_time(c, m, works, shapes, "all") + dp
        if level == 2 and cheap >= incumbent:
            return cheap, False
        least_grads = costs.least_with_grads(c.pp, m)
        if self.memory_bound(c, zeros, w0, least, rc, with_grads=least_grads) > usable:
            return math.inf, True
        if level < 2:
            return cheap, True
        fitting, fit_zeros, least, least_grads = self._fitting_shapes(c, m, zeros, shapes, w0)
        if not fitting:
            return math.inf, True
        # the ZeRO stages some schedule fits under, and the schedules fitting under some stage
        dp = min(self.dp_bound(c, z, w, where_key, where, m) for z in fit_zeros for w in works.values())
        best = self._open_time(c, m, works, fitting, "fitting")
        if best + dp >= incumbent:
            return best + dp, False
        # the slowest rank over whole layers, for the fewest micro-batches any fitting schedule
        # keeps in flight on each rank and either placement of the embedding and head, with the
        # overlapped (quicker) layers: below every such schedule's ``tmax_bound``
        ends = {_ends(sched, v, c.pp) for sched, v, _ in fitting}
        t_least = min(self.tmax_bound(c, works[True], e, fit_zeros, least, True, least_grads) for e in ends)
        if t_least == math.inf:
            return math.inf, True
        least_bubble = self._open_time(c, m, works, fitting, "bubble")
        self.memo.open_least[c] = m * t_least
        return max(best, m * t_least + least_bubble) + dp, True

    def _fitting_shapes(self, c: Candidate, m: int, zeros: tuple, shapes: list, w0: Work) -> tuple:
        """For a node whose recompute set is chosen: (the schedule shapes that run with it and
        pass the memory bound under some ZeRO stage of ``zeros``, those stages, and per rank the
        least in-flight micro-batches over those shapes, at the peak and while every chunk has its
        gradients). Memoised by layout: memory does not depend on the axis order."""
        layout = (c.tp, c.pp, c.cp, c.ep, c.dp, c.mbs, c.fp8, c.attention, c.recompute, zeros, m)
        found = self.memo.fitting_shapes.get(layout)
        if found is None:
            import numpy as np

            usable, values = self.p.hw.usable_bytes, self.memo.in_flight_values
            rows, peak, with_grads, lazy = self._shape_arrays(c, m, shapes)
            fits = np.zeros((len(rows), len(zeros)), dtype=bool)
            if rows:  # ``_memory_stage`` of every shape and stage: one array per stage and moment
                moments = ((True, 0), (False, 0), (False, 1))  # (lazy, flights): at the peak, then with gradients
                cases = [(z, lazy_, f) for z in zeros for lazy_, f in moments]
                bounds = self._memory_bounds(c, w0, c.recompute, cases, (peak, with_grads))
                for j in range(len(zeros)):
                    lazy_bound, eager, grads = bounds[3 * j : 3 * j + 3]
                    fits[:, j] = np.where(lazy, np.maximum(lazy_bound, grads), eager) <= usable
            some = fits.any(axis=1)
            fitting = [rows[i][:3] for i in np.flatnonzero(some)]
            fit_zeros = tuple(z for z, ok in zip(zeros, fits.any(axis=0)) if ok)
            least = tuple(peak[some].min(axis=0).tolist()) if fitting else ()
            least_grads = tuple(with_grads[some].min(axis=0).tolist()) if fitting else ()
            found = (fitting, fit_zeros, values.setdefault(least, least), values.setdefault(least_grads, least_grads))
            self.memo.fitting_shapes[layout] = found
        return found

    def _shape_arrays(self, c: Candidate, m: int, shapes: list) -> tuple:
        """The shapes of ``shapes`` that run with ``c``'s recompute set (``runnable``), with
        their per-rank in-flight counts at the peak and with every chunk's gradients as arrays
        (one row a shape) and whether each has several chunks: memoised, one per list of shapes
        and what ``runnable`` reads of ``c``."""
        key = (id(shapes), c.pp, m, c.recompute, c.dp * c.cp)
        found = self.memo.shape_arrays.get(key)
        if found is None:
            import numpy as np

            costs = self.costs
            rows = [
                (sched, v, flight, costs.in_flight_with_grads(sched, v, c.pp, m))
                for sched, v, flight in shapes
                if runnable(sched.name, c.pp, c.recompute, costs.model_categories, 0, c.dp * c.cp)
            ]
            peak, with_grads = (np.array([r[i] for r in rows], dtype=np.float64).reshape(len(rows), -1) for i in (2, 3))
            found = self.memo.shape_arrays[key] = (rows, peak, with_grads, np.array([r[1] > 1 for r in rows]))
        return found

    def schedule_floor(self, parent: Candidate, c: Candidate) -> float:
        """A cheap lower bound on ``bound(c, 3)`` for a child ``c`` of the level-2 node ``parent``
        (its schedule and virtual stages just chosen): the parent's slowest rank over whole
        layers (for the fewest micro-batches in flight, so below ``c``'s) and ``c``'s cheap terms
        (``_scheduled``). Children are queued with it, so those it puts above the best plan are
        never bounded in full."""
        zeros = self.fitting_zeros(c, 3)
        if not zeros:
            return math.inf
        _, _, t_avg, rest = self._scheduled(c, zeros)
        return max(self.memo.open_least.get(parent, 0.0), self.costs.microbatches(c) * t_avg) + rest

    def _open_time(self, c: Candidate, m: int, works: dict, shapes: list, what: str) -> float:
        """The least over ``shapes`` of m x the average rank + the fill/drain, or (``what``
        "bubble") of the fill/drain alone; memoised per ``what`` (the shapes are all the
        schedules, or those fitting the Works' recompute set)."""
        key = (tuple(id(w) for w in works.values()), c.pp, m, what)
        best = self.memo.open_schedule.get(key)
        if best is None:
            best = math.inf
            # a schedule's fill/drain shrinks as its virtual stages grow (``Schedule.bubble``)
            # and its average rank does not depend on them: its most virtual stages are its least
            for sched, v, _ in self._most_virtual(shapes):
                w, overlap = works[sched.overlaps_ep], sched.overlaps_ep
                bubble = sched.bubble(c.pp, m, v, w.f / c.pp, w.b / c.pp, w.w / c.pp)
                t_max = 0.0 if what == "bubble" else max(w.total / c.pp, w.pre.time(overlap), w.post.time(overlap))
                best = min(best, m * t_max + bubble)
            self.memo.open_schedule[key] = best
        return best

    def _most_virtual(self, shapes: list) -> list:
        """Of the memoised list ``shapes``, each schedule's shape with the most virtual stages."""
        table = self.memo.most_virtual
        found = table.get(id(shapes))
        if found is None:
            most: dict = {}
            for shape in shapes:
                if shape[0].name not in most or shape[1] > most[shape[0].name][1]:
                    most[shape[0].name] = shape
            found = table[id(shapes)] = list(most.values())
        return found

    def may_fit(self, c: Candidate, level: int) -> bool:
        """The memory test of ``bound`` alone, for a node just made at ``level`` 2 (recompute set
        chosen), 3 (schedule chosen) or 4 (ZeRO stage chosen): children that fail it are never
        queued."""
        if level >= 3:
            return bool(self.fitting_zeros(c, level))
        costs = self.costs
        m = costs.microbatches(c)
        where_key, where = costs.where(c, True)
        zeros = tuple(costs.zero_options(c))
        w0 = costs.work(c, where_key, where, True, frozenset())
        flight, grads = costs.schedule_shapes(c.pp, m)[1], costs.least_with_grads(c.pp, m)
        return self.memory_bound(c, zeros, w0, flight, c.recompute, True, grads) <= self.p.hw.usable_bytes

    def fitting_zeros(self, c: Candidate, level: int) -> tuple[int, ...]:
        """The ZeRO stages still open below a node whose schedule is chosen (``level`` 3; at 4,
        its own) that pass the memory bound with that schedule's in-flight counts, each alone:
        the time terms are then least over the stages that can fit, not over one that fits and
        another that is quick."""
        costs = self.costs
        m = costs.microbatches(c)
        where_key, where = costs.where(c, True)
        w0 = costs.work(c, where_key, where, True, frozenset())
        sched = SCHEDULES[c.schedule]
        flight, grads = costs.in_flight(sched, c.v, c.pp, m), costs.in_flight_with_grads(sched, c.v, c.pp, m)
        usable, lazy = self.p.hw.usable_bytes, c.v > 1
        zeros = (c.zero,) if level >= 4 else costs.zero_options(c)
        return tuple(z for z in zeros if self._memory_stage(c, z, w0, flight, c.recompute, lazy, grads) <= usable)

    def quick_bound(self, c: Candidate) -> float:
        """A cheap root bound: compute and TP/CP/EP traffic at their best placements (EP hidden as
        far as compute can hide it, the hidden traffic slowing compute), nothing recomputed, a
        perfect split over the pipeline ranks, the smallest fill/drain of any schedule (from
        compute alone); and a memory test that every rank keeps at least its share of the
        layers' inputs, everything else recomputed, and the head's rank its loss tensors."""
        costs = self.costs
        key = (c.tp, c.cp, c.ep, c.mbs, c.fp8, c.attention)
        quick = self.memo.quick
        if key not in quick:
            where = costs.where(c, False)[1]
            every = costs.all_categories
            compute = least = fs = bs = ws = 0.0
            for block, n in zip(costs.blocks, costs.block_counts):
                layer = costs.layer(block, c, where)  # c is a root: nothing recomputed
                compute += n * layer.time(True)
                fs, bs, ws = fs + n * layer.f, bs + n * layer.b, ws + n * layer.w
                least += n * costs.layers.activation(block, c.mbs, c.tp, c.cp, every)
            post_act = costs.layers.activation(POST, c.mbs, c.tp, c.cp, every)
            quick[key] = (compute, least, post_act, fs, bs, ws)
        compute, least, post_act, fs, bs, ws = quick[key]
        if least / c.pp > self.p.hw.usable_bytes or post_act > self.p.hw.usable_bytes:
            return math.inf
        m = costs.microbatches(c)
        shapes = self.least_bubble(c.pp, m)
        if not shapes:
            return math.inf
        bubble = min(sched.bubble(c.pp, m, v, fs / c.pp, bs / c.pp, ws / c.pp) for sched, v in shapes)
        return m * compute / c.pp + bubble

    def least_bubble(self, pp: int, m: int) -> list[tuple[Schedule, int]]:
        """Per schedule, its valid virtual-stage count with the least bubble: the most (a bubble
        shrinks as v grows)."""
        key = (pp, m)
        table = self.memo.least_bubble
        if key not in table:
            best: dict[str, tuple[Schedule, int]] = {}
            for sched, v, _ in self.costs.schedule_shapes(pp, m)[0]:
                if sched.name not in best or v > best[sched.name][1]:
                    best[sched.name] = (sched, v)
            table[key] = list(best.values())
        return table[key]

    def _buffers(self, c: Candidate, w: Work, zero: int) -> tuple[float, float]:
        """``CandidateCosts.buffers``, memoised: the memory bounds of every schedule, in-flight
        count and recompute set of a ``Work`` read the same buffers (``tmax_bound`` may too)."""
        key = (id(w), zero)
        table = self.memo.buffers
        if key not in table:
            table[key] = self.costs.buffers(c, w, zero)
        return table[key]

    def family_floor(self, family: tuple) -> float:
        """A lower bound on ``quick_bound`` of every root in ``family``, whatever its pipeline
        depth and micro-batch size.

        ``quick_bound`` is m x (per-micro-batch time) / pp plus a bubble >= 0, and m x mbs x pp x dp
        = global batch x tp x cp / gpus, so per-sequence time bounds it. Per block that time is
        C + E - e(1 - s) x min(C, E) + T + [exposed + s x hidden] of the backward re-gather, the
        gradient reduce-scatter and the CP traffic (C compute, E all-to-all, T forward TP traffic,
        s the overlap slowdown, e the share of the all-to-all the program hides; e = 1 gives
        max(C, E) + s x min(C, E)). Each bracket is at least min(s, 1) x its traffic, whatever
        share of it the program hides, and the whole is nondecreasing in C, E, T and the traffic,
        so the floor costs (``LayerCosts(floor=True)``, proportional to mbs and below the real
        ones) evaluated at one sequence bound it."""
        tp, cp, ep, fp8, attn = family
        c = Candidate(tp, 1, cp, ep, 1, 1, fp8, attn, frozenset())
        where = self.costs.where(c, False)[1]
        floor = self.costs.floor
        s, e = self.p.hw.overlap_slowdown, self.p.hw.overlap_share("ep")
        total = 0.0
        for block, n in zip(self.costs.blocks, self.costs.block_counts):
            f, b, w, _, _, _, _ = floor.compute(block, 1, tp, cp, fp8, frozenset(), ep)
            t_tp, (regather, scatter), (_, cp_total), t_ep, *_ = floor.comm(
                block, 1, tp, cp, ep, attn, fp8, where["tp"], where["cp"], where["ep"]
            )
            compute = f + b + w
            if e == 1:
                both = max(compute, t_ep) + s * min(compute, t_ep)
            else:
                both = compute + t_ep - e * (1 - s) * min(compute, t_ep)
            total += n * (both + t_tp + min(s, 1.0) * (regather + scatter + cp_total))
        return self.p.global_batch * tp * cp / self.p.gpus * total

    def dp_bound(
        self, c: Candidate, zero: int, w: Work, where_key, where, m: int, hidden_pp: float | None = None
    ) -> float:
        """Data-parallel time exposed on the busiest rank is at least its average over ranks.
        Given the pipeline sends hidden behind compute (``hidden_pp``, known once the schedule is),
        with the compute they and the hidden data-parallel traffic slow down
        (``Hardware.overlap_slowdown``): the step adds x + s max(0, H - x) for the busiest rank's
        exposure x and H the hidden sends plus the average rank's data-parallel traffic, which
        for s <= 1 grows with x (so x's lower bound bounds it) and for s > 1 is least at
        max(x, H)."""
        exposed = self._dp_exposed(c, zero, w, where_key, where, m)
        if hidden_pp is None:
            return exposed
        after, before, micro, whole = self.memo.dp_traffic[(c.tp, c.pp, c.cp, c.ep, c.dp, zero, where_key)]
        # the average rank's traffic, its latency paid once for the whole model: no more than the
        # evaluation's (``Evaluator._breakdown``, each rank's parameters with their own latency)
        hidden = hidden_pp + (whole[0] + whole[1] + m * whole[2]) / c.pp
        s = self.p.hw.overlap_slowdown
        return exposed + s * max(0.0, hidden - exposed) if s <= 1 else max(exposed, hidden)

    def _dp_exposed(self, c: Candidate, zero: int, w: Work, where_key, where, m: int) -> float:
        key = (id(w), zero, where_key, m)
        table = self.memo.dp_bound
        if key not in table:
            # the traffic depends on the parameters only, not on what is recomputed
            traffic_key = (c.tp, c.pp, c.cp, c.ep, c.dp, zero, where_key)
            traffic = self.memo.dp_traffic
            if traffic_key not in traffic:
                hw, dense, expert = self.p.hw, where["dpcp"], where["edp"]
                d = data_parallel(w.params_dense, w.params_expert, zero, dense, expert, hw)
                micro = 0.0
                if d["per_microbatch"] > 0:  # ZeRO-2/3 collectives run layer by layer, latency each
                    blocks = [(n, k) for n, k in zip(self.costs.kind_counts, w.kinds)] + [(1, w.pre), (1, w.post)]
                    micro = sum(
                        n * data_parallel(k.params_dense, k.params_expert, zero, dense, expert, hw)["per_microbatch"]
                        for n, k in blocks
                    )
                whole = (d["after_backward"], d["before_forward"], d["per_microbatch"])
                traffic[traffic_key] = (d["after_backward"], d["before_forward"], micro, whole)
            after, before, micro, _ = traffic[traffic_key]
            share = self.p.hw.overlap_share("dp")
            avg = _shown(after, w.b + w.w, share) + _shown(before, w.f, share)
            if micro > 0:
                avg += m * _shown(micro, w.total, share)
            table[key] = avg / c.pp
        return table[key]

    def memory_bound(
        self,
        c: Candidate,
        zeros: tuple[int, ...],
        w: Work,
        in_flight: tuple,
        recompute: frozenset | None = None,
        lazy: bool = True,
        with_grads: tuple | None = None,
    ) -> float:
        """A lower bound on the busiest rank's memory over every stage partition and every ZeRO
        stage in ``zeros``, with ``w``'s activations or, given ``recompute``, the activations that
        recompute set keeps (model states and buffers do not depend on it). ``lazy``: the
        schedule may run several chunks per rank, so a chunk's gradients may not exist yet at
        the rank's activation peak (``Schedule.occupancy``); the bound is then the larger of the
        activations at the peak beside the states without gradients, all states with none, and,
        given ``with_grads`` (the in-flight counts at a moment every chunk has its gradients:
        ``CandidateCosts.in_flight_with_grads``), those activations beside all states."""
        return min(
            self._memory_stage(c, z, w, in_flight, recompute, lazy, with_grads) for z in _least_memory_stages(zeros)
        )

    def _memory_stage(self, c: Candidate, zero: int, w: Work, in_flight, recompute, lazy: bool, with_grads) -> float:
        """``memory_bound`` at one ZeRO stage: both moments happen, so the rank peaks above each."""
        value = self._memory_bound(c, zero, w, in_flight, recompute, lazy)
        if lazy and with_grads is not None:
            value = max(value, self._memory_bound(c, zero, w, with_grads, recompute, False))
        return value

    def _memory_bound(
        self, c: Candidate, zero: int, w: Work, in_flight: tuple, recompute: frozenset | None, lazy: bool
    ) -> float:
        """``memory_bound`` at one ZeRO stage.

        For weights l_r >= 0 summing to one, max_r mem_r >= sum_r l_r mem_r, and the right side
        is smallest when each layer sits on the rank where l_r x (its memory there) is least. The
        weights are the ones that would balance identical average layers exactly."""
        # memory does not depend on the axis order, so neither does the key; the in-flight
        # tuples are memoised (``in_flight``, ``schedule_shapes``), so their identity names them
        rc = w.recompute if recompute is None else recompute
        key = (c.tp, c.pp, c.cp, c.ep, c.dp, c.mbs, c.fp8, c.attention, rc, zero, lazy, id(in_flight))
        value = self.memo.memory.get(key)
        if value is not None:
            return value
        items, act_avg, st_avg, buffers, states = self._memory_profile(c, zero, w, recompute, lazy)
        total = sum(1.0 / max(act_avg * i + st_avg, 1e-9) for i in in_flight)
        # l_r x (a i_r + st) = (a i_r + st) / (act_avg i_r + st_avg) / total is monotone in i_r
        # (a ratio of linear functions), so its least over the ranks is at the fewest or the most
        # in-flight micro-batches
        fewest, most = min(in_flight), max(in_flight)
        under_fewest, under_most = max(act_avg * fewest + st_avg, 1e-9), max(act_avg * most + st_avg, 1e-9)
        bound = sum(
            n * min((a * fewest + st) / under_fewest, (a * most + st) / under_most) / total for n, a, st in items
        )
        value = max(bound, states / c.pp if lazy else 0.0) + buffers
        self.memo.memory[key] = value
        return value

    def _memory_bounds(self, c: Candidate, w: Work, recompute: frozenset, cases: list, flights: tuple):
        """``_memory_bound`` of many in-flight counts at once, for each case (ZeRO stage, lazy,
        which array of ``flights``: one row of per-rank counts a shape each), as one array a
        case, computed together: a few operations on one array instead of many on small ones."""
        import numpy as np

        profiles = [self._memory_profile(c, z, w, recompute, lazy) for z, lazy, _ in cases]
        f = np.stack([flights[i] for _, _, i in cases])  # (case, shape, rank)
        act = np.array([p[1] for p in profiles])[:, None]
        st = np.array([p[2] for p in profiles])[:, None]
        total = (1.0 / np.maximum(act[:, :, None] * f + st[:, :, None], 1e-9)).sum(axis=2)
        fewest, most = f.min(axis=2), f.max(axis=2)
        under_fewest = np.maximum(act * fewest + st, 1e-9)
        under_most = np.maximum(act * most + st, 1e-9)
        counts = np.array([n for n, _, _ in profiles[0][0]], dtype=np.float64)
        a = np.array([[x for _, x, _ in p[0]] for p in profiles])[:, :, None]  # (case, block, 1)
        s = np.array([[x for _, _, x in p[0]] for p in profiles])[:, :, None]
        per_block = np.minimum(
            (a * fewest[:, None, :] + s) / under_fewest[:, None, :], (a * most[:, None, :] + s) / under_most[:, None, :]
        )
        bound = np.einsum("k,jks->js", counts, per_block) / total
        floor = np.array([p[4] / c.pp if lazy else 0.0 for p, (_, lazy, _) in zip(profiles, cases)])[:, None]
        return np.maximum(bound, floor) + np.array([p[3] for p in profiles])[:, None]

    def _memory_profile(self, c: Candidate, zero: int, w: Work, recompute: frozenset | None, lazy: bool) -> tuple:
        """The per-layer memory ``_memory_bound`` weighs, shared by every schedule's in-flight
        counts: (per block (count, activation bytes, state bytes), their averages, buffers, all
        states with gradients)."""
        rc = w.recompute if recompute is None else recompute
        layout = (c.tp, c.pp, c.cp, c.ep, c.dp, c.mbs, c.fp8, c.attention, rc, zero, lazy)
        profile = self.memo.memory_layout.get(layout)
        if profile is None:
            costs = self.costs
            per, pre, post = costs.states(c, w, zero, grads=not lazy)
            if recompute is None:
                acts = [k.activation_bytes for k in w.kinds] + [w.pre.activation_bytes, w.post.activation_bytes]
            else:
                acts = [costs.layers.activation(b, c.mbs, c.tp, c.cp, recompute, c.fp8) for b in costs.blocks]
            items = [(n, a, st) for n, a, st in zip(costs.kind_counts, acts, per)]
            items += [(1, acts[-2], pre), (1, acts[-1], post)]
            layers = sum(n for n, _, _ in items)
            act_avg = sum(n * a for n, a, _ in items) / layers
            st_avg = sum(n * st for n, _, st in items) / layers
            everything = costs.states(c, w, zero)  # with gradients: the step's end, no activations
            states = sum(n * st for n, st in zip(costs.kind_counts, everything[0])) + everything[1] + everything[2]
            profile = (items, act_avg, st_avg, self._buffers(c, w, zero)[0], states)
            self.memo.memory_layout[layout] = profile
        return profile

    def tmax_bound(
        self, c: Candidate, w: Work, ends: tuple[int, int], zeros: tuple, in_flight, overlap, with_grads=None
    ) -> float:
        """Lower bound on the slowest rank's time per micro-batch over all partitions and every
        ZeRO stage in ``zeros``, with whole layers and each rank's memory limit (inf when no split
        fits), the embedding on rank ``ends[0]`` and the head on ``ends[1]``; ``with_grads`` as in
        ``memory_bound``."""
        return min(self._tmax_bound(c, w, ends, z, in_flight, overlap, with_grads) for z in _least_memory_stages(zeros))

    def _tmax_bound(
        self, c: Candidate, w: Work, ends: tuple[int, int], zero: int, in_flight, overlap, with_grads=None
    ) -> float:
        """``tmax_bound`` at one ZeRO stage. Every layer is given the smallest time and memory of
        any layer kind, which can only lower the bound; the ranks holding the embedding and the
        head take its time besides (``_least_time``). ``in_flight`` is a memoised tuple (its identity keys the memo). A
        rank's gradients may not exist yet at its activation peak (``memory_bound``), so its
        layers are capped both by their activations beside the states without gradients and by
        all their states beside the activations held while every chunk has its gradients
        (``with_grads``; none where not given)."""
        key = (id(w), zero, ends, id(in_flight), overlap, id(with_grads))
        table = self.memo.tmax
        if key in table:
            return table[key]
        caps = self._caps(c, w, ends, zero, in_flight, with_grads)
        if caps is None:
            value = math.inf
        else:
            first, last = ends
            t_min = min(k.time(overlap) for k in w.kinds)
            fixed_time = [
                (w.pre.time(overlap) if r == first else 0.0) + (w.post.time(overlap) if r == last else 0.0)
                for r in range(c.pp)
            ]
            least = _least_time(caps, fixed_time, self.p.num_layers, t_min) if t_min > 0 else 0.0
            value = max(w.total / c.pp, least, w.pre.time(overlap), w.post.time(overlap))
        table[key] = value
        return value

    def _caps(self, c: Candidate, w: Work, ends: tuple[int, int], zero: int, in_flight, with_grads) -> list | None:
        """``_tmax_bound``'s most layers each rank can hold under its memory limit (None where
        some rank cannot hold even its fixed part, or the ranks cannot hold every layer):
        memoised by layout, since memory does not depend on the axis order or the layers' times."""
        key = (c.tp, c.pp, c.cp, c.ep, c.dp, c.mbs, c.fp8, c.attention, w.recompute, zero, ends)
        key += (id(in_flight), id(with_grads))
        table = self.memo.caps
        if key in table:
            return table[key]
        import numpy as np

        per, pre_state, post_state = self.costs.states(c, w, zero, grads=False)
        per_all, pre_all, post_all = self.costs.states(c, w, zero)
        buffers, post_buffers = self.costs.buffers(c, w, zero)
        layers, usable = self.p.num_layers, self.p.hw.usable_bytes
        first, last = ends
        a_min = min(k.activation_bytes for k in w.kinds)
        s_min, s_all = min(per), min(per_all)
        # every rank at once (numpy's float // is Python's): the ends add their own parts
        flight = np.asarray(in_flight, dtype=np.float64)
        held = np.asarray(with_grads, dtype=np.float64) if with_grads is not None else np.zeros(c.pp)
        fixed, everything = np.full(c.pp, float(buffers)), np.full(c.pp, float(buffers))
        fixed[first] += w.pre.activation_bytes * flight[first] + pre_state
        everything[first] += w.pre.activation_bytes * held[first] + pre_all
        fixed[last] += w.post.activation_bytes * flight[last] + post_state + post_buffers
        everything[last] += w.post.activation_bytes * held[last] + post_all + post_buffers
        room, room_all = usable - fixed, usable - everything
        caps: list | None = None
        if not (np.minimum(room, room_all) < 0).any():
            unit, unit_all = a_min * flight + s_min, a_min * held + s_all
            cap = np.where(unit <= 0, layers, np.minimum(layers, room // np.where(unit <= 0, 1.0, unit)))
            cap = np.where(unit_all <= 0, cap, np.minimum(cap, room_all // np.where(unit_all <= 0, 1.0, unit_all)))
            caps = cap.astype(np.int64).tolist()
        if caps is not None and sum(caps) < layers:
            caps = None
        table[key] = caps
        return caps


class _Plain:
    """sum_r min(cap_r, x) over ranks' ``caps`` for any x >= 0, in O(log ranks): from the sorted
    caps and their prefix sums (the caps below x count whole, the rest x each)."""

    def __init__(self, caps: list[int]):
        self.caps = sorted(caps)
        self.prefix = list(itertools.accumulate(self.caps, initial=0))

    def held(self, x: int) -> int:
        i = bisect.bisect_left(self.caps, x)
        return self.prefix[i] + x * (len(self.caps) - i)


def _least_cover(caps: list[int], lead: list[int], layers: int, plain: _Plain | None = None) -> int:
    """The least k with sum_r min(cap_r, max(0, k - lead_r)) >= ``layers`` (the caller checks
    that sum_r cap_r reaches it), by bisection. Only the ranks holding the embedding or the head
    have a lead, so the others' sum comes from ``_Plain``: O(log pp) per probe instead of a pass
    over every rank. Given ``plain``, ``caps`` and ``lead`` are the other ranks' alone."""
    others = list(zip(caps, lead))
    if plain is None:
        plain = _Plain([cap for cap, d in others if d == 0])
        others = [(cap, d) for cap, d in others if d > 0]
    lo, hi = 0, layers + max(lead, default=0)
    while lo < hi:
        mid = (lo + hi) // 2
        if plain.held(mid) + sum(min(cap, max(0, mid - d)) for cap, d in others) >= layers:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _least_time(caps: list[int], fixed: list[float], layers: int, t: float) -> float:
    """The least T with sum_r min(cap_r, floor((T - fixed_r) / t)) >= ``layers`` (no term below
    0): the slowest rank's time when every layer takes ``t``, rank r holds at most cap_r of them
    and takes ``fixed_r`` besides (the embedding, the head). With each fixed time rounded up to
    whole layers, ``_least_cover``'s k is the least k with k t enough, so T lies in ((k-1) t, k t],
    where only the ranks with a fixed time hold one layer more as T grows, each at n t + fixed_r:
    the least of those that holds every layer, else k t. Rounding errs low (a lower bound). The
    ranks with no fixed time all count alike (``_Plain``); only the two ends are counted apart."""
    lead = [max(0, math.ceil(f / t - 1e-9)) for f in fixed]
    plain = _Plain([cap for cap, f in zip(caps, fixed) if f == 0])
    ends = [(cap, f) for cap, f in zip(caps, fixed) if f != 0]
    k = _least_cover([cap for cap, _ in ends], [d for d, f in zip(lead, fixed) if f != 0], layers, plain)
    best = k * t
    for d, f in zip(lead, fixed):
        n = k - d  # this rank holds n layers at n t + f, inside ((k-1) t, k t]
        if f <= 0 or n < 0 or n * t + f >= best:
            continue
        held = plain.held(max(0, n + math.floor(f / t + 1e-9)))
        held += sum(min(cap, max(0, n + math.floor((f - g) / t + 1e-9))) for cap, g in ends)
        if held >= layers:
            best = n * t + f
    return best


def _shown(traffic: float, window: float, share: float) -> float:
    """Seconds of ``traffic`` exposed beside a compute ``window`` when the program hides ``share``
    of what the window would hide. Convex in (traffic, window) and proportional to both, so at
    the ranks' average it is at most the average of the ranks' (the partition's ``dp_share``)."""
    if share == 1:
        return max(0.0, traffic - window)
    return (1 - share) * traffic + share * max(0.0, traffic - window)
