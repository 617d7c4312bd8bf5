"""Exact evaluation of a fully specified candidate: its stage partition (CP-SAT, ``partition``),
step time, MFU, and the time and memory breakdowns a plan reports."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from autoshard.cost_models.comm import Where, data_parallel
from autoshard.cost_models.hardware import Hardware
from autoshard.cost_models.layers import LayerCost
from autoshard.ir.schedules import SCHEDULES, Schedule
from autoshard.planner import partition
from autoshard.planner.candidates import Candidate, runnable
from autoshard.planner.costs import CandidateCosts, Work
from autoshard.planner.promises import rank_memory_parts


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
    # per pipeline rank: the recompute set its layers use (the partition's choice); empty for
    # an infeasible candidate
    rank_recompute: list[frozenset] = field(default_factory=list)
    # inf, or the incumbent step time below which this is not searched: the ranks' recompute
    # choice was skipped as nothing it finds beats that (``Evaluator._per_rank``); where the
    # one set does not fit either, infeasible without proof that nothing fits
    cut: float = math.inf


def _dp_linear(layer: LayerCost, zero: int, where: dict[str, Where], hw: Hardware) -> tuple[float, float, float]:
    """Data-parallel seconds for this layer's parameters. Gradient reduction and parameter
    gathering once per step are bucketed over the whole stage (their latency is paid once, in
    ``_latency``); ZeRO-2/3 per-micro-batch collectives run per layer, latency included."""
    dense, expert = where["dpcp"], where["edp"]
    full = data_parallel(layer.params_dense, layer.params_expert, zero, dense, expert, hw)
    tiny = data_parallel(1e-9, 1e-9 if layer.params_expert else 0, zero, dense, expert, hw)
    return (
        max(0.0, full["after_backward"] - tiny["after_backward"]),
        max(0.0, full["before_forward"] - tiny["before_forward"]),
        full["per_microbatch"],
    )


def _latency(zero: int, where: dict[str, Where], hw: Hardware, w: Work) -> tuple[float, float, float]:
    """Latency of the once-per-step data-parallel collectives (independent of their size): after
    the backward and before the forward; per-micro-batch ones carry theirs per layer."""
    tiny = data_parallel(1e-9, 1e-9 if w.params_expert else 0, zero, where["dpcp"], where["edp"], hw)
    return tiny["after_backward"], tiny["before_forward"], 0.0


def undominated_sets(costs: CandidateCosts, c: Candidate) -> list[frozenset]:
    """Recompute sets not dominated by another (no less recompute time and no less memory for
    every block), cheapest first: a dominated set can never be part of a strictly better plan."""
    key = (c.mbs, c.tp, c.cp, c.fp8)
    table = costs.memo.recompute_keep
    if key not in table:
        scored = {}
        for rc in costs.recompute_sets:
            scored.setdefault(_set_costs(costs, c, rc), rc)  # equal costs: keep the first (smallest) set
        vecs = sorted(scored)
        keep = []
        for i, vec in enumerate(vecs):
            if not any(all(o <= x for o, x in zip(other, vec)) for other in vecs[:i]):
                keep.append(scored[vec])
        table[key] = keep
    return table[key]


def _set_costs(costs: CandidateCosts, c: Candidate, rc: frozenset) -> tuple:
    """Per block of ``c``'s layers: (recompute seconds, bytes kept) under ``rc``."""
    layers = costs.layers
    return tuple(x for b in costs.blocks for x in layers.compute(b, c.mbs, c.tp, c.cp, c.fp8, rc)[3:5])


def stage_choices(costs: CandidateCosts, c: Candidate, schedule: str | None = None, zero: int | None = None) -> list:
    """The recompute sets a pipeline rank of ``c`` may use: ``c.recompute`` first, then each
    undominated set that recomputes at least as long in every block (and so keeps no more),
    which the schedule and ZeRO stage (``c``'s unless given; None: any) run with. ``c.recompute``
    is so the cheapest set any rank uses. One pipeline rank: no choice."""
    base = c.recompute
    if c.pp == 1:
        return [base]
    key = ("stage", c.mbs, c.tp, c.cp, c.fp8, c.pp, c.dp * c.cp, base, schedule, zero)
    table = costs.memo.recompute_keep
    if key not in table:
        floor = _set_costs(costs, c, base)[0::2]
        out = [base]
        for rc in undominated_sets(costs, c):
            more = all(x >= f for x, f in zip(_set_costs(costs, c, rc)[0::2], floor))
            runs = schedule is None or runnable(schedule, c.pp, rc, costs.model_categories, zero or 0, c.dp * c.cp)
            if rc != base and more and runs:
                out.append(rc)
        table[key] = out
    return table[key]


def _objective(part: partition.Partition, m: int) -> float:
    """What the stage partition minimises: m x the slowest rank's time + the exposed DP time."""
    return m * part.t_max + part.dp_exposed


class Evaluator:
    def __init__(self, costs: CandidateCosts):
        self.costs = costs
        self.p = costs.p
        self.model_flops = 3 * self.p.cost.flops_forward(1, self.p.seq) * self.p.global_batch

    def evaluate(
        self,
        c: Candidate,
        fixed_stages: tuple[int, ...] | None = None,
        incumbent: float = math.inf,
        per_rank: bool = False,
    ) -> Evaluation:
        """The best stage partition of ``c`` (or the one ``fixed_stages`` gives) and what the cost
        model predicts for it; infeasible, with the reason, where no split fits in memory. Every
        pipeline rank recomputes ``c.recompute``; with ``per_rank``, each may recompute more
        (``stage_choices``), chosen jointly with the split where it could beat ``incumbent``
        (``_per_rank``; the search's refinement of its winner, ``search.refine``)."""
        costs, hw = self.costs, self.p.hw
        m = costs.microbatches(c)
        where_key, where = costs.where(c, True)
        sched = SCHEDULES[c.schedule]
        sets = stage_choices(costs, c, c.schedule, c.zero) if per_rank else [c.recompute]
        choices = [costs.work(c, where_key, where, sched.overlaps_ep, rc) for rc in sets]
        w = choices[0]
        q = self._quantities(c, w, where, sched.overlaps_ep, sched, m)
        chunk_rank = lambda ch: sched.chunk_rank(ch, c.pp)  # noqa: E731
        part = free = None
        if len(choices) > 1:  # the split with no memory limit: the per-rank choice's lower bound
            unlimited = replace(q, capacity=partition.UNLIMITED)
            free = partition.solve(costs.kinds, unlimited, c.pp, c.v, chunk_rank, m, fixed_stages)
            if free is not None and partition.exact(costs.kinds, fixed_stages) and max(free.memory) <= q.capacity:
                part = free  # it fits: the exact paths find this very split under the limit
        if part is None:
            part = partition.solve(costs.kinds, q, c.pp, c.v, chunk_rank, m, fixed_stages)
        ev = None if part is None else self._finish(c, sched, part, choices, m, where)
        if len(choices) > 1 and part is not free:
            ev = self._per_rank(c, sched, q, part, ev, free, choices, m, where, fixed_stages, incumbent)
        if ev is None:
            in_flight = costs.in_flight(sched, c.v, c.pp, m)
            acts = sum(n * k.activation_bytes for n, k in zip(costs.kind_counts, w.kinds))
            states = sum(n * (s + g) for n, s, g in zip(costs.kind_counts, q.state, q.grad))
            states += q.pre["state"] + q.post["state"] + q.pre["grad"] + q.post["grad"]
            need = (acts * max(in_flight) + states) / c.pp + q.buffers
            return Evaluation(
                c,
                False,
                reason=f"does not fit: needs about {need / 1e9:.0f} GB per GPU, {hw.usable_bytes / 1e9:.0f} GB usable",
            )
        return ev

    def _per_rank(self, c, sched, q, part, ev, free, choices, m, where, fixed, incumbent: float) -> Evaluation | None:
        """``ev`` (one set for every rank, None where it does not fit) or the better plan with each
        rank choosing its set. The choice is searched only where memory held the split back (with
        no memory limit, ``free``, the one set would do better: else no rank gains by recomputing more, as
        the partition weighs a rank's exposure as under ``c.recompute``) and where its lower
        bound, that unlimited split's m x t_max + exposure (no rank is quicker under another
        set) plus the fill/drain and tied sync under ``c.recompute``, beats both ``ev`` and
        ``incumbent``. Skipped for ``incumbent`` alone, the answer says so (``Evaluation.cut``):
        it is then no plan of ``c``'s best, only proof that none beats ``incumbent``."""
        chunk_rank = lambda ch: sched.chunk_rank(ch, c.pp)  # noqa: E731
        if part is not None and (free is None or _objective(free, m) >= _objective(part, m) - 1e-9):
            return ev
        if free is not None and free.optimal:
            w = choices[0]
            bubble = sched.bubble(c.pp, m, c.v, w.f / c.pp, w.b / c.pp, w.w / c.pp)
            floor = _objective(free, m) + bubble + self.costs.tied_sync(c, sched, where, c.zero)
            if ev is not None and floor >= ev.step_time_s:
                return ev
            if floor >= incumbent:
                if ev is None:
                    ev = Evaluation(c, False, reason="cannot beat the plan already found")
                ev.cut = incumbent
                return ev
        q.options = [self._quantities(c, x, where, sched.overlaps_ep, sched, m) for x in choices[1:]]
        mixed = partition.solve(self.costs.kinds, q, c.pp, c.v, chunk_rank, m, fixed)
        q.options = []
        if mixed is not None and any(mixed.rank_option):
            other = self._finish(c, sched, mixed, choices, m, where)
            ev = other if ev is None or other.step_time_s < ev.step_time_s else ev
        return ev

    def _finish(self, c: Candidate, sched: Schedule, part, choices: list[Work], m: int, where) -> Evaluation:
        """The Evaluation of ``c`` under the split ``part``, each rank under its chosen set."""
        costs, hw = self.costs, self.p.hw
        works = [choices[i] for i in (part.rank_option or [0] * c.pp)]
        # the ranks' average stage, each under its own recompute set
        f, b, wp = (sum(getattr(x, a) for x in works) / c.pp**2 for a in ("f", "b", "w"))
        bubble = sched.bubble(c.pp, m, c.v, f, b, wp)
        breakdown = self._breakdown(c, sched, works, part, bubble, m, where)
        # the tied copies' gradients are summed after the last backward, before the step
        tied = costs.tied_sync(c, sched, where, c.zero)
        breakdown["comm_s"]["pp"]["total"] += tied
        breakdown["comm_s"]["pp"]["exposed"] += tied
        # pipeline sends and data-parallel traffic hidden behind compute slow that compute down
        # (the layers' hidden TP/CP/EP traffic is already in their times)
        hidden = sum(breakdown["comm_s"][a]["total"] - breakdown["comm_s"][a]["exposed"] for a in ("pp", "dp"))
        step = m * part.t_max + bubble + part.dp_exposed + tied + hw.overlap_slowdown * max(0.0, hidden)
        breakdown["overlap_s"] += hw.overlap_slowdown * max(0.0, hidden)
        if len({x.recompute for x in works}) == 1:  # every rank recomputes the same: that is the candidate's set
            c = replace(c, recompute=works[0].recompute)
        ev = Evaluation(c, True, step, part.stage_layers, optimal=part.optimal)
        ev.rank_recompute = [x.recompute for x in works]
        ev.memory_ranks = part.memory
        ev.breakdown = breakdown
        ev.memory = self._memory_breakdown(c, sched, part, works)
        ev.mfu = self.model_flops / (step * self.p.gpus * hw.peak_flops("bf16"))
        return ev

    def _quantities(
        self, c: Candidate, w: Work, where: dict[str, Where], overlap: bool, sched: Schedule, m: int
    ) -> partition.Quantities:
        """What the stage partition weighs, per layer kind and for the embedding and the head."""
        hw = self.p.hw
        per_state, pre_state, post_state = self.costs.states(c, w, c.zero, grads=False)
        per_grad, pre_grad, post_grad = self.costs.grads(c, w, c.zero)

        m = self.costs.microbatches(c)
        fsdp = self.costs.fsdp_time(c)  # FSDP2's host time per unit, per micro-batch

        def entry(layer: LayerCost, state: float, grad: float) -> dict:
            after, before, micro = _dp_linear(layer, c.zero, where, hw)
            return {
                # the optimizer step, once a step, spread over the micro-batches: a rank's step
                # time is then its micro-batches' work and its optimizer step together
                "time": layer.time(overlap) + self.costs.optimizer_time(c, layer) / m + fsdp,
                "fwd": layer.f,
                "bwd": layer.b + layer.w,
                "act": layer.activation_bytes,
                "held": layer.held_bytes,
                "state": state,
                "grad": grad,
                "dp_time": after,
                "dp_gather": before,
                "dp_micro": micro,
            }

        entries = [entry(k, st, g) for k, st, g in zip(w.kinds, per_state, per_grad)]
        buffers, post_buffers = self.costs.buffers(c, w, c.zero)
        return partition.Quantities(
            **{key: [e[key] for e in entries] for key in partition.KEYS},
            pre=entry(w.pre, pre_state, pre_grad),
            post=entry(w.post, post_state, post_grad),
            # pipeline sends overlap compute in the steady state but for what the program does not
            # hide (``Hardware.overlap``); fill/drain counts them
            p2p=(1 - hw.overlap_share("pp")) * w.p2p,
            dp_latency=_latency(c.zero, where, hw, w),
            dp_share=hw.overlap_share("dp"),
            buffers=buffers,
            post_buffers=post_buffers,
            capacity=hw.usable_bytes,
            occupancy=list(self.costs.occupancy(sched, c.v, c.pp, m)),
            boundary=self.costs.chunk_output(c),
            rank_buffers=self.costs.rank_buffers(c, sched),
        )

    def _breakdown(self, c: Candidate, sched: Schedule, works: list[Work], part, bubble: float, m: int, where) -> dict:
        """Seconds per step by kind on the average rank (``works``: each rank's ``Work``, under
        its recompute set)."""
        counts = self.costs.kind_counts
        overlap = sched.overlaps_ep
        w = works[0]

        def per_rank(attr, w=None):
            if w is None:
                return sum(per_rank(attr, x) for x in works) / len(works)
            tot = (
                sum(n * getattr(k, attr) for n, k in zip(counts, w.kinds))
                + getattr(w.pre, attr)
                + getattr(w.post, attr)
            )
            return m * tot / c.pp

        ep_total = per_rank("ep")
        ep_exposed = ep_total
        if overlap:
            hidden = [sum(n * k.ep_hidden for n, k in zip(counts, x.kinds)) for x in works]
            ep_exposed -= m * sum(hidden) / len(works) / c.pp
        # the steady-state sends the program does not hide (``Hardware.overlap``) are in the
        # slowest rank's time (``Quantities.p2p``), counted as sends rather than as imbalance
        pp_total, pp_exposed, steady = self.costs.pipeline_sends(c, sched, w, m, bubble)
        d = data_parallel(w.params_dense / c.pp, w.params_expert / c.pp, c.zero, where["dpcp"], where["edp"], self.p.hw)
        dp_total = d["after_backward"] + d["before_forward"] + m * d["per_microbatch"]
        layers_overlap, fsdp, optimizer = self._host_terms(c, works, overlap, m)
        return {
            "compute_s": per_rank("f") + per_rank("b") + per_rank("w") + fsdp,
            "optimizer_s": optimizer,
            "overlap_s": layers_overlap,
            "recompute_s": per_rank("recompute"),
            "bubble_s": bubble,
            "imbalance_s": (
                m * part.t_max - m * sum(x.total for x in works) / len(works) / c.pp - steady - optimizer - fsdp
            ),
            "comm_s": {
                "tp": {"total": per_rank("tp_total"), "exposed": per_rank("tp")},
                "cp": {"total": per_rank("cp_total"), "exposed": per_rank("cp")},
                "ep": {"total": ep_total, "exposed": ep_exposed},
                "pp": {"total": pp_total, "exposed": pp_exposed},
                "dp": {"total": dp_total, "exposed": part.dp_exposed},
            },
            "links": {a: ("nvlink" if where[a].domains == 1 else "network") for a in ("tp", "cp", "pp", "ep", "dpcp")},
        }

    def _host_terms(self, c: Candidate, works: list[Work], overlap: bool, m: int) -> tuple[float, float, float]:
        """Per step on the average rank: compute lost to communication beside it, FSDP2's host
        time per unit, and the optimizer step."""
        counts = self.costs.kind_counts
        interference = [
            sum(n * k.interference(overlap) for n, k in zip(counts, x.kinds))
            + x.pre.interference(overlap)
            + x.post.interference(overlap)
            for x in works
        ]
        layers_overlap = m * sum(interference) / len(works) / c.pp
        units = sum(counts) + 2  # FSDP2's: a layer each, the embedding and the head
        fsdp = m * units * self.costs.fsdp_time(c) / c.pp
        # the optimizer step steps the same parameters whatever a rank recomputes
        w = works[0]
        optimizer = (
            sum(n * self.costs.optimizer_time(c, k) for n, k in zip(counts, w.kinds))
            + self.costs.optimizer_time(c, w.pre)
            + self.costs.optimizer_time(c, w.post)
        ) / c.pp
        return layers_overlap, fsdp, optimizer

    def _memory_breakdown(self, c: Candidate, sched: Schedule, part, works: list[Work]) -> dict:
        """The busiest rank's memory by part (``promises.rank_memory_parts``; ``works``: each
        rank's ``Work``), the rest of its total counted as buffers."""
        worst = max(range(len(part.memory)), key=lambda r: part.memory[r])
        parts = rank_memory_parts(self.costs, c, sched, works[worst], part.stage_layers, worst)
        total = part.memory[worst]
        return {"rank": worst, **parts, "buffers": max(0.0, total - sum(parts.values())), "total": total}
