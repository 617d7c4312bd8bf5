"""Exact evaluation of a fully specified candidate: its stage partition (CP-SAT, ``partition``),
step time, MFU, and the time and memory breakdowns a plan reports."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autoshard.cost_models.comm import Where, data_parallel
from autoshard.cost_models.hardware import Hardware
from autoshard.cost_models.layers import LayerCost
from autoshard.ir.schedules import SCHEDULES, Schedule
from autoshard.planner import partition
from autoshard.planner.candidates import Candidate
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


class Evaluator:
    def __init__(self, costs: CandidateCosts):
        self.costs = costs
        self.p = costs.p
        self.model_flops = 3 * self.p.cost.flops_forward(1, self.p.seq) * self.p.global_batch

    def evaluate(self, c: Candidate, fixed_stages: tuple[int, ...] | None = None) -> Evaluation:
        """The best stage partition of ``c`` (or the one ``fixed_stages`` gives) and what the cost
        model predicts for it; infeasible, with the reason, where no split fits in memory."""
        costs, hw = self.costs, self.p.hw
        m = costs.microbatches(c)
        where_key, where = costs.where(c, True)
        sched = SCHEDULES[c.schedule]
        w = costs.work(c, where_key, where, sched.overlaps_ep)
        q = self._quantities(c, w, where, sched.overlaps_ep)
        in_flight = costs.in_flight(sched, c.v, c.pp, m)
        q.occupancy = list(costs.occupancy(sched, c.v, c.pp, m))
        q.boundary = costs.chunk_output(c)
        q.rank_buffers = costs.rank_buffers(c, sched)
        part = partition.solve(costs.kinds, q, c.pp, c.v, lambda ch: sched.chunk_rank(ch, c.pp), m, fixed_stages)
        if part is None:
            acts = sum(n * k.activation_bytes for n, k in zip(costs.kind_counts, w.kinds))
            states = sum(n * (s + g) for n, s, g in zip(costs.kind_counts, q.state, q.grad))
            states += q.pre["state"] + q.post["state"] + q.pre["grad"] + q.post["grad"]
            need = (acts * max(in_flight) + states) / c.pp + q.buffers
            return Evaluation(
                c,
                False,
                reason=f"does not fit: needs about {need / 1e9:.0f} GB per GPU, {hw.usable_bytes / 1e9:.0f} GB usable",
            )
        bubble = sched.bubble(c.pp, m, c.v, w.f / c.pp, w.b / c.pp, w.w / c.pp)
        breakdown = self._breakdown(c, sched, w, part, bubble, m, where)
        # the tied copies' gradients are summed after the last backward, before the step
        tied = costs.tied_sync(c, sched, where, c.zero)
        breakdown["comm_s"]["pp"]["total"] += tied
        breakdown["comm_s"]["pp"]["exposed"] += tied
        # pipeline sends and data-parallel traffic hidden behind compute slow that compute down
        # (the layers' hidden TP/CP/EP traffic is already in their times)
        hidden = sum(breakdown["comm_s"][a]["total"] - breakdown["comm_s"][a]["exposed"] for a in ("pp", "dp"))
        step = m * part.t_max + bubble + part.dp_exposed + tied + hw.overlap_slowdown * max(0.0, hidden)
        breakdown["overlap_s"] += hw.overlap_slowdown * max(0.0, hidden)
        ev = Evaluation(c, True, step, part.stage_layers, optimal=part.optimal)
        ev.memory_ranks = part.memory
        ev.breakdown = breakdown
        ev.memory = self._memory_breakdown(c, sched, part, w)
        ev.mfu = self.model_flops / (step * self.p.gpus * hw.peak_flops("bf16"))
        return ev

    def _quantities(self, c: Candidate, w: Work, where: dict[str, Where], overlap: bool) -> partition.Quantities:
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
        )

    def _breakdown(self, c: Candidate, sched: Schedule, w: Work, part, bubble: float, m: int, where) -> dict:
        counts = self.costs.kind_counts
        overlap = sched.overlaps_ep

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
            ep_exposed -= m * sum(n * k.ep_hidden for n, k in zip(counts, w.kinds)) / c.pp
        pp_total = m * c.v * w.p2p if c.pp > 1 else 0.0
        sends = c.v * w.p2p / 2 if c.pp > 1 else 0.0
        pp_exposed = bubble - sched.bubble(c.pp, m, c.v, w.f / c.pp - sends, w.b / c.pp - sends, w.w / c.pp)
        # the steady-state sends the program does not hide (``Hardware.overlap``): in the slowest
        # rank's time (``Quantities.p2p``), counted here rather than as imbalance
        steady = m * c.v * (1 - self.p.hw.overlap_share("pp")) * w.p2p if c.pp > 1 else 0.0
        pp_exposed += steady
        d = data_parallel(w.params_dense / c.pp, w.params_expert / c.pp, c.zero, where["dpcp"], where["edp"], self.p.hw)
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
        units = sum(counts) + 2  # FSDP2's: a layer each, the embedding and the head
        fsdp = m * units * self.costs.fsdp_time(c) / c.pp
        optimizer = (
            sum(n * self.costs.optimizer_time(c, k) for n, k in zip(counts, w.kinds))
            + self.costs.optimizer_time(c, w.pre)
            + self.costs.optimizer_time(c, w.post)
        ) / c.pp
        return {
            "compute_s": per_rank("f") + per_rank("b") + per_rank("w") + fsdp,
            "optimizer_s": optimizer,
            "overlap_s": layers_overlap,
            "recompute_s": per_rank("recompute"),
            "bubble_s": bubble,
            "imbalance_s": m * part.t_max - m * w.total / c.pp - steady - optimizer - fsdp,
            "comm_s": {
                "tp": {"total": per_rank("tp_total"), "exposed": per_rank("tp")},
                "cp": {"total": per_rank("cp_total"), "exposed": per_rank("cp")},
                "ep": {"total": ep_total, "exposed": ep_exposed},
                "pp": {"total": pp_total, "exposed": max(0.0, pp_exposed)},
                "dp": {"total": dp_total, "exposed": part.dp_exposed},
            },
            "links": {a: ("nvlink" if where[a].domains == 1 else "network") for a in ("tp", "cp", "pp", "ep", "dpcp")},
        }

    def _memory_breakdown(self, c: Candidate, sched: Schedule, part, w: Work) -> dict:
        """The busiest rank's memory by part (``promises.rank_memory_parts``), the rest of its
        total counted as buffers."""
        worst = max(range(len(part.memory)), key=lambda r: part.memory[r])
        parts = rank_memory_parts(self.costs, c, sched, w, part.stage_layers, worst)
        total = part.memory[worst]
        return {"rank": worst, **parts, "buffers": max(0.0, total - sum(parts.values())), "total": total}
