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
        where_key, where = costs.where(c, level >= 1)
        zeros = (c.zero,) if level >= 4 else tuple(costs.zero_options(c))
        if level < 3:
            return self._schedule_open(c, level, m, where_key, where, zeros, incumbent)
        sched, w, t_avg, rest = self._scheduled(c, zeros)
        if m * t_avg + rest >= incumbent:
            return m * t_avg + rest, False
        m_flight = costs.in_flight(sched, c.v, c.pp, m)
        if self.memory_bound(c, zeros, w, m_flight, lazy=c.v > 1) > self.p.hw.usable_bytes:
            return math.inf, True
        t_max = self.tmax_bound(c, w, _ends(sched, c.v, c.pp), zeros, m_flight, sched.overlaps_ep)
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
        if self.memory_bound(c, zeros, w0, least, rc) > usable:
            return math.inf, True
        if level < 2:
            return cheap, True
        layout = (c.tp, c.pp, c.cp, c.ep, c.dp, c.mbs, c.fp8, c.attention, c.recompute, zeros, m)
        fitting = self.memo.fitting_shapes.get(layout)
        if fitting is None:
            fitting = self.memo.fitting_shapes[layout] = [
                (sched, v, flight)
                for sched, v, flight in shapes
                if runnable(sched.name, c.pp, c.recompute, costs.model_categories, 0, c.dp * c.cp)
                and self.memory_bound(c, zeros, w0, flight, rc, lazy=v > 1) <= usable
            ]
        if not fitting:
            return math.inf, True
        # the slowest rank over whole layers, for the fewest micro-batches any schedule keeps in
        # flight on each rank and either placement of the embedding and head, with the
        # overlapped (quicker) layers: below every schedule's ``tmax_bound``
        ends = {_ends(sched, v, c.pp) for sched, v, _ in fitting}
        t_least = min(self.tmax_bound(c, works[True], e, zeros, least, True) for e in ends)
        if t_least == math.inf:
            return math.inf, True
        best = self._open_time(c, m, works, fitting, "fitting")
        least_bubble = self._open_time(c, m, works, fitting, "bubble")
        self.memo.open_least[c] = m * t_least
        return max(best, m * t_least + least_bubble) + dp, True

    def schedule_floor(self, parent: Candidate, c: Candidate) -> float:
        """A cheap lower bound on ``bound(c, 3)`` for a child ``c`` of the level-2 node ``parent``
        (its schedule and virtual stages just chosen): the parent's slowest rank over whole
        layers (for the fewest micro-batches in flight, so below ``c``'s) and ``c``'s cheap terms
        (``_scheduled``). Children are queued with it, so those it puts above the best plan are
        never bounded in full."""
        _, _, t_avg, rest = self._scheduled(c, tuple(self.costs.zero_options(c)))
        return max(self.memo.open_least.get(parent, 0.0), self.costs.microbatches(c) * t_avg) + rest

    def _open_time(self, c: Candidate, m: int, works: dict, shapes: list, what: str) -> float:
        """The least over ``shapes`` of m x the average rank + the fill/drain, or (``what``
        "bubble") of the fill/drain alone; memoised per ``what`` (the shapes are all the
        schedules, or those fitting the Works' recompute set)."""
        key = (tuple(id(w) for w in works.values()), c.pp, m, what)
        best = self.memo.open_schedule.get(key)
        if best is None:
            best = math.inf
            for sched, v, _ in shapes:
                w, overlap = works[sched.overlaps_ep], sched.overlaps_ep
                bubble = sched.bubble(c.pp, m, v, w.f / c.pp, w.b / c.pp, w.w / c.pp)
                t_max = 0.0 if what == "bubble" else max(w.total / c.pp, w.pre.time(overlap), w.post.time(overlap))
                best = min(best, m * t_max + bubble)
            self.memo.open_schedule[key] = best
        return best

    def may_fit(self, c: Candidate, level: int) -> bool:
        """The memory test of ``bound`` alone, for a node just made at ``level`` 2 (recompute set
        chosen) or 3 (schedule chosen): children that fail it are never queued."""
        costs = self.costs
        m = costs.microbatches(c)
        where_key, where = costs.where(c, True)
        zeros = tuple(costs.zero_options(c))
        w0 = costs.work(c, where_key, where, True, frozenset())
        if level == 3:
            flight, lazy = costs.in_flight(SCHEDULES[c.schedule], c.v, c.pp, m), c.v > 1
        else:
            flight, lazy = costs.schedule_shapes(c.pp, m)[1], True
        return self.memory_bound(c, zeros, w0, flight, c.recompute, lazy) <= self.p.hw.usable_bytes

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
    ) -> float:
        """A lower bound on the busiest rank's memory over every stage partition and every ZeRO
        stage in ``zeros``, with ``w``'s activations or, given ``recompute``, the activations that
        recompute set keeps (model states and buffers do not depend on it). ``lazy``: the
        schedule may run several chunks per rank, so a chunk's gradients may not exist yet at
        the rank's activation peak (``Schedule.occupancy``); the bound is then the larger of the
        activations at the peak beside the states without gradients, and all states with none."""
        return min(self._memory_bound(c, z, w, in_flight, recompute, lazy) for z in _least_memory_stages(zeros))

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
        layout = (c.tp, c.pp, c.cp, c.ep, c.dp, c.mbs, c.fp8, c.attention, rc, zero, lazy)
        key = (*layout, id(in_flight))
        value = self.memo.memory.get(key)
        if value is not None:
            return value
        profile = self.memo.memory_layout.get(layout)
        if profile is None:  # the per-layer memory, shared by every schedule's in-flight counts
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
        items, act_avg, st_avg, buffers, states = profile
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

    def tmax_bound(self, c: Candidate, w: Work, ends: tuple[int, int], zeros: tuple, in_flight, overlap) -> float:
        """Lower bound on the slowest rank's time per micro-batch over all partitions and every
        ZeRO stage in ``zeros``, with whole layers and each rank's memory limit (inf when no split
        fits), the embedding on rank ``ends[0]`` and the head on ``ends[1]``."""
        return min(self._tmax_bound(c, w, ends, z, in_flight, overlap) for z in _least_memory_stages(zeros))

    def _tmax_bound(self, c: Candidate, w: Work, ends: tuple[int, int], zero: int, in_flight, overlap) -> float:
        """``tmax_bound`` at one ZeRO stage. Every layer is given the smallest time and memory of
        any layer kind, which can only lower the bound; the ranks holding the embedding and the
        head take its time besides (``_least_time``). ``in_flight`` is a memoised tuple (its identity keys the memo). A
        rank's gradients may not exist yet at its activation peak (``memory_bound``), so its
        layers are capped both by their activations beside the states without gradients and by
        all their states alone."""
        key = (id(w), zero, ends, id(in_flight), overlap)
        table = self.memo.tmax
        if key in table:
            return table[key]
        per, pre_state, post_state = self.costs.states(c, w, zero, grads=False)
        per_all, pre_all, post_all = self.costs.states(c, w, zero)
        buffers, post_buffers = self.costs.buffers(c, w, zero)
        layers = self.p.num_layers
        first, last = ends
        t_min = min(k.time(overlap) for k in w.kinds)
        a_min = min(k.activation_bytes for k in w.kinds)
        s_min, s_all = min(per), min(per_all)
        caps, fixed_time = [], []
        value = None
        for r in range(c.pp):
            fixed, everything, t_fixed = buffers, buffers, 0.0
            if r == first:
                fixed += w.pre.activation_bytes * in_flight[r] + pre_state
                everything += pre_all
                t_fixed += w.pre.time(overlap)
            if r == last:
                fixed += w.post.activation_bytes * in_flight[r] + post_state + post_buffers
                everything += post_all + post_buffers
                t_fixed += w.post.time(overlap)
            room, room_all = self.p.hw.usable_bytes - fixed, self.p.hw.usable_bytes - everything
            if min(room, room_all) < 0:
                value = math.inf
                break
            unit = a_min * in_flight[r] + s_min
            cap = layers if unit <= 0 else min(layers, int(room // unit))
            caps.append(cap if s_all <= 0 else min(cap, int(room_all // s_all)))
            fixed_time.append(t_fixed)
        if value is None:
            if sum(caps) < layers:
                value = math.inf
            else:
                least = _least_time(caps, fixed_time, layers, t_min) if t_min > 0 else 0.0
                value = max(w.total / c.pp, least, w.pre.time(overlap), w.post.time(overlap))
        table[key] = value
        return value


def _least_cover(caps: list[int], lead: list[int], layers: int) -> int:
    """The least k with sum_r min(cap_r, max(0, k - lead_r)) >= ``layers`` (the caller checks
    that sum_r cap_r reaches it), by bisection. Only the ranks holding the embedding or the head
    have a lead, so the others' sum, sum_r min(cap_r, k), comes from their sorted caps and prefix
    sums: O(log pp) per probe instead of a pass over every rank."""
    plain = sorted(cap for cap, d in zip(caps, lead) if d == 0)
    others = [(cap, d) for cap, d in zip(caps, lead) if d > 0]
    prefix = list(itertools.accumulate(plain, initial=0))
    lo, hi = 0, layers + max(lead)
    while lo < hi:
        mid = (lo + hi) // 2
        i = bisect.bisect_left(plain, mid)  # the caps below mid count whole, the rest mid each
        held = prefix[i] + mid * (len(plain) - i) + sum(min(cap, max(0, mid - d)) for cap, d in others)
        if held >= layers:
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
    the least of those that holds every layer, else k t. Rounding errs low (a lower bound)."""
    lead = [max(0, math.ceil(f / t - 1e-9)) for f in fixed]
    k = _least_cover(caps, lead, layers)
    best = k * t
    for d, f in zip(lead, fixed):
        n = k - d  # this rank holds n layers at n t + f, inside ((k-1) t, k t]
        if f <= 0 or n < 0 or n * t + f >= best:
            continue
        held = sum(min(cap, max(0, n + math.floor((f - g) / t + 1e-9))) for cap, g in zip(caps, fixed))
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
