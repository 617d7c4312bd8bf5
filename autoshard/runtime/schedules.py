"""The pipeline schedules, one row each: the single statement of what a schedule is.

The planner prices a schedule from its row (bubble, micro-batches in flight, which rank holds
which chunk), the passes and the emitted program place chunks by the same row, and the runtime
builds the row's ``torch.distributed.pipelining`` class. Nothing else in autoshard spells out a
schedule's facts. Depends on nothing but the standard library (the runtime must not import the
planner, the passes or codegen).

A row's facts:

``v_shape``         chunk ``i`` and ``2p-1-i`` on rank ``i`` (ZB-V, DualPipeV); otherwise chunks
                    go round robin (chunk ``c`` on rank ``c % p``).
``split_backward``  backward runs as an input-gradient pass and a later weight-gradient pass.
``fixed_v``         the virtual stages per rank the schedule is defined for (``None``: any ``v >= 2``
                    for interleaved schedules; 1F1B takes ``v = 1``).
``overlaps_ep``     one micro-batch's expert all-to-all runs under another's compute (DualPipeV).
``torch_class``     the ``torch.distributed.pipelining.schedules`` class that runs it with one
                    chunk per rank (``single_class``) or several (``multi_class``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    name: str
    v_shape: bool
    split_backward: bool
    fixed_v: int | None
    overlaps_ep: bool
    single_class: str | None  # one chunk per rank
    multi_class: str  # several chunks per rank
    summary: str

    def chunk_rank(self, chunk: int, pp: int) -> int:
        """The pipeline rank that holds ``chunk``."""
        if self.v_shape:
            return chunk if chunk < pp else 2 * pp - 1 - chunk
        return chunk % pp

    def chunks_of_rank(self, rank: int, pp: int, v: int) -> list[int]:
        """The chunks (virtual stages) pipeline rank ``rank`` holds, in model order."""
        return sorted(c for c in range(pp * v) if self.chunk_rank(c, pp) == rank)

    def torch_class(self, v: int) -> str:
        return self.single_class if v == 1 and self.single_class else self.multi_class

    def runs_with(self, pp: int, microbatches: int, v: int) -> str | None:
        """Why torch's implementation cannot run ``microbatches`` micro-batches through ``pp``
        ranks of ``v`` chunks each, or ``None`` if it can."""
        m = microbatches
        if self.fixed_v is not None and v != self.fixed_v:
            return f"{self.name} has {self.fixed_v} chunk(s) per rank, not {v}"
        if self.name == "1f1b":
            return None if m >= pp or pp == 1 else f"1F1B needs at least {pp} micro-batches (one per stage)"
        if self.name in ("interleaved", "zero-bubble"):
            if v < 2:
                return f"{self.name} needs at least 2 chunks per rank"
            rounds = max(1, m // pp)
            return None if m % rounds == 0 else f"{m} micro-batches are not whole rounds of {pp}"
        if self.name == "dualpipev" and (m < 2 * pp or pp % 2 or m % 2):
            return "DualPipeV needs an even number of stages and an even number of at least 2p micro-batches"
        return None

    def in_flight(self, rank: int, pp: int, m: int, v: int) -> float:
        """Micro-batches whose activations rank ``rank`` holds at its peak, in units of one
        micro-batch through all of the rank's chunks: the most (chunk, micro-batch) forwards whose
        backward has not yet finished (its weight-gradient pass, where the backward is split: the
        input pass keeps the graph for it, saved tensors and all), over the action order torch's
        class for the row runs (``tests/runtime/test_schedules.py`` walks those orders).
        Interleaved 1F1B holds ``v - 1`` rounds plus twice the distance to the last rank; ZB1P,
        which defers each weight pass, ``v - 1`` rounds plus ``pp`` on every rank. A round is
        ``m`` split into ``max(1, m // pp)`` equal parts."""
        per_round = m // max(1, m // pp)
        if self.name == "1f1b":
            return min(m, pp - rank)
        if self.name == "interleaved":
            return min(m * v, (v - 1) * per_round + 2 * (pp - rank - 1) + 1) / v
        if self.name == "zero-bubble":
            return min(m * v, (v - 1) * per_round + pp) / v
        if self.name == "zbv":
            return min(2 * pp, 2 * m, m + 1 + rank) / 2
        return (2 * min(m, pp) + 1) / 2  # dualpipev: one more forward inside its overlapped F&B steps

    def weight_pending(self, rank: int, pp: int, m: int, v: int) -> float:
        """Micro-batches (in the same units) whose input-gradient pass has run and weight-gradient
        pass not yet, at most: a split backward keeps for those the gradients of the weighted
        matmuls' outputs (torch's ``stage_backward_input`` keeps them, for
        ``stage_backward_weight``). ZB1P defers each weight pass by the rank's
        distance from the first; ZB-V by twice that (for the second chunk of its V), DualPipeV by
        it. None without a split backward. An upper bound for ZB-V when ``m < 2 pp``."""
        if not self.split_backward:
            return 0.0
        if self.name == "zero-bubble":
            return min(m * v, rank + 1) / v
        if self.name == "zbv":
            return min(2 * rank + 1, 2 * max(0, m - pp) + 1) / 2
        return min(m, rank + 1) / 2  # dualpipev

    def bubble(self, pp: int, m: int, v: int, f: float, b: float, w: float) -> float:
        """Pipeline fill/drain time, from per-rank per-micro-batch averages of forward ``f``,
        input-gradient ``b`` and weight-gradient ``w``.

        With enough micro-batches: 1F1B (p-1)(F+B+W); interleaved /v (Narayanan et al.);
        zero-bubble, ZB-V and DualPipeV (p-1)(F+B-W)/v (ZB-H1, Qi et al.): the lower ZB-H2, ZB-V
        and DualPipe bubbles need "optimizer post-validation" to skip the step-end
        synchronisation (Qi et al. lose ~8% without it), and torch.distributed.pipelining
        synchronises at every step; DualPipeV's gain is its overlap of one micro-batch's
        communication with another's compute. With fewer micro-batches than stages no schedule
        keeps every rank busy: a micro-batch still crosses all p ranks, so each missing
        micro-batch adds the share of a rank's time that interleaving cannot hide."""
        if pp == 1:
            return 0.0
        t = f + b + w
        if self.name == "1f1b":
            return (pp - 1) * t
        fill = (pp - 1) * (t if not self.split_backward else max(0.0, f + b - w)) / v
        return fill + max(0, pp - m) * max(0.0, t - fill / max(1, pp - 1))


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule(
            "1f1b", False, False, 1, False, "Schedule1F1B", "ScheduleInterleaved1F1B", "one forward, one backward"
        ),
        Schedule(
            "interleaved", False, False, None, False, None, "ScheduleInterleaved1F1B", "1F1B over v chunks per rank"
        ),
        Schedule(
            "zero-bubble",
            False,
            True,
            None,
            False,
            None,
            "ScheduleInterleavedZeroBubble",
            "interleaved, weight gradients deferred into the bubble",
        ),
        Schedule("zbv", True, True, 2, False, None, "ScheduleZBVZeroBubble", "zero-bubble over a V of two chunks"),
        Schedule(
            "dualpipev",
            True,
            True,
            2,
            True,
            None,
            "ScheduleDualPipeV",
            "V of two chunks, forward and backward of two micro-batches overlapped",
        ),
    )
}
NAMES: tuple[str, ...] = tuple(SCHEDULES)
SPLIT_BACKWARD: frozenset[str] = frozenset(n for n, s in SCHEDULES.items() if s.split_backward)


def schedule(name: str) -> Schedule:
    """The row of schedule ``name``."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(NAMES)}") from None


def torch_schedule(name: str, v: int):
    """The ``torch.distributed.pipelining`` class that runs schedule ``name`` with ``v`` chunks
    per rank."""
    from torch.distributed.pipelining import schedules as torch_schedules

    return getattr(torch_schedules, schedule(name).torch_class(v))


__all__ = ["Schedule", "SCHEDULES", "NAMES", "SPLIT_BACKWARD", "schedule", "torch_schedule"]
