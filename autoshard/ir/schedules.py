"""The pipeline schedules, one row each: the single statement of what a schedule is.

The planner prices a schedule from its row (bubble, micro-batches in flight, which rank holds
which chunk), the passes and the emitted program place chunks by the same row, and the runtime
builds the row's ``torch.distributed.pipelining`` class. Nothing else in autoshard spells out a
schedule's facts. Depends on nothing but the standard library and, for ``occupancy``, torch's own
per-rank action orders (the runtime must not import the planner, the passes or codegen).

A row's facts:

``v_shape``         chunk ``i`` and ``2p-1-i`` on rank ``i`` (ZB-V, DualPipeV); otherwise chunks
                    go round robin (chunk ``c`` on rank ``c % p``).
``split_backward``  backward runs as an input-gradient pass and a later weight-gradient pass.
``fixed_v``         the virtual stages per rank the schedule is defined for (``None``: any ``v >= 2``
                    for interleaved schedules; 1F1B takes ``v = 1``).
``overlaps_ep``     one micro-batch's expert all-to-all runs under another's compute (DualPipeV).
``torch_class``     the ``torch.distributed.pipelining.schedules`` class that runs it with one
                    chunk per rank (``single_class``) or several (``multi_class``).
``runs``            why torch's class cannot run a (pp, micro-batches, v), or None.
``held``            the micro-batches a rank holds at its peak (``in_flight``).
``rounds``          its order fills the rank's chunks a round of micro-batches at a time
                    (interleaved 1F1B, ZB1P), which ``least_held`` and ``occupancy`` read.
``fill``            the rule of its pipeline bubble (``bubble``).

The formulas are columns too (small functions named by what they check), so nothing reads a
schedule's name to decide what it does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

# one moment of a rank's order: per chunk of the rank (model order), the forwards whose saved
# tensors are still held, the input-gradient passes still waiting for their weight pass, and
# whether the chunk's weight gradients exist yet (1 from its first weight pass or full backward on:
# autograd makes a parameter's gradient when that runs, and the step sets them to None)
Point = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


# Per-row rules: a schedule's formulas are columns of its row, looked up, never branched on by
# name. ``rank, pp, m, v`` as in the methods below; ``rounds`` is ``m`` split into
# ``max(1, m // pp)`` equal parts.


def _one_per_stage(pp: int, m: int, v: int) -> str | None:
    return None if m >= pp or pp == 1 else f"1F1B needs at least {pp} micro-batches (one per stage)"


def _whole_rounds(pp: int, m: int, v: int) -> str | None:
    if v < 2:
        return "this schedule needs at least 2 chunks per rank"
    return None if m % max(1, m // pp) == 0 else f"{m} micro-batches are not whole rounds of {pp}"


def _paired(pp: int, m: int, v: int) -> str | None:
    if m < 2 * pp or pp % 2 or m % 2:
        return "DualPipeV needs an even number of stages and an even number of at least 2p micro-batches"
    return None


def _any(pp: int, m: int, v: int) -> str | None:
    return None


def _none_split(rank: int, pp: int, m: int, v: int) -> float:
    return 0.0


def _all_split(rank: int, pp: int, m: int, v: int) -> float:
    return 1.0


def _ends_split(rank: int, pp: int, m: int, v: int) -> float:
    """DualPipeV: of a rank's 2m backwards, the ``2 pp - 1 - rank`` of its warm-up and cool-down
    are split; its steady state runs whole backwards beside forwards."""
    return min(1.0, (2 * pp - 1 - rank) / (2 * m))


def _fill_drain(pp: int, m: int, v: int, t: float, split: bool, f: float, b: float, w: float) -> float:
    """1F1B: (p-1)(F+B+W), whatever the micro-batches."""
    return (pp - 1) * t


def _fill_over_chunks(pp: int, m: int, v: int, t: float, split: bool, f: float, b: float, w: float) -> float:
    """Interleaved: /v (Narayanan et al.); split backward: (p-1)(F+B-W)/v (ZB-H1, Qi et al.). With
    fewer micro-batches than stages each missing one adds the share interleaving cannot hide."""
    fill = (pp - 1) * (t if not split else max(0.0, f + b - w)) / v
    return fill + max(0, pp - m) * max(0.0, t - fill / max(1, pp - 1))


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
    runs: Callable[[int, int, int], str | None]  # (pp, m, v) -> why torch's class cannot run it, or None
    held: Callable[[int, int, int, int, int], float]  # (rank, pp, m, v, round) -> ``in_flight``
    rounds: bool  # its order is interleaved 1F1B's, chunks filled a round at a time (``least_held``)
    fill: Callable[..., float]  # the bubble's rule (``bubble``)
    splits: Callable[[int, int, int, int], float]  # (rank, pp, m, v) -> ``split_share``

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
        if self.fixed_v is not None and v != self.fixed_v:
            return f"{self.name} has {self.fixed_v} chunk(s) per rank, not {v}"
        why = self.runs(pp, microbatches, v)
        return why.replace("this schedule", self.name) if why else None

    def in_flight(self, rank: int, pp: int, m: int, v: int) -> float:
        """Micro-batches whose activations rank ``rank`` holds at its peak, in units of one
        micro-batch through all of the rank's chunks: the most (chunk, micro-batch) forwards whose
        backward has not yet finished (its weight-gradient pass, where the backward is split: the
        input pass keeps the graph for it, saved tensors and all), over the action order torch's
        class for the row runs (``tests/runtime/test_schedules.py`` walks those orders).
        Interleaved 1F1B holds ``v - 1`` rounds plus twice the distance to the last rank; ZB1P,
        which defers each weight pass, ``v - 1`` rounds plus ``pp`` on every rank. A round is
        ``m`` split into ``max(1, m // pp)`` equal parts."""
        return self.held(rank, pp, m, v, m // max(1, m // pp))

    def least_held(self, rank: int, pp: int, m: int, v: int) -> float:
        """Micro-batches every chunk of rank ``rank`` holds at once at some moment (the most such):
        as the rank's first backward starts, nothing is freed yet. Interleaved 1F1B and ZB1P have
        run their warm-up forwards and one more, filling the rank's chunks a round at a time, the
        last chunk least; the V-shaped schedules, one at least (their second chunk's first
        forward comes before its first backward). One chunk: ``in_flight``."""
        if v == 1:
            return self.in_flight(rank, pp, m, v)
        if not self.rounds:
            return 1.0
        per_round = m // max(1, m // pp)
        ops = v * m
        warmup = min((v - 1) * per_round + (1 if self.split_backward else 2) * (pp - 1 - rank), ops)
        done = min(warmup + 1, ops)
        cycles, rest = divmod(done, per_round * v)
        return float(cycles * per_round + min(per_round, max(0, rest - (v - 1) * per_round)))

    def held_with_grads(self, rank: int, pp: int, m: int, v: int) -> tuple[int, ...] | None:
        """Per chunk of rank ``rank`` (model order), the micro-batches whose saved tensors it holds
        at the first moment every chunk has its gradients: as its first chunk's first backward
        (weight pass, where split) runs, the others' having run a round or more before. A moment of
        ``occupancy``, so the rank's peak is at least its activations then beside all its states.
        Interleaved 1F1B and ZB1P only (None for the others): backwards walk the chunks down a
        round at a time, so the first chunk's first one is backward number (v-1) rounds, and ZB1P
        runs weight pass k after input pass k + rank."""
        if v == 1 or not self.rounds:
            return None
        per_round = m // max(1, m // pp)
        ops = v * m
        warmup = min((v - 1) * per_round + (1 if self.split_backward else 2) * (pp - 1 - rank), ops)
        first = (v - 1) * per_round  # backwards (weight passes) before the first chunk's first
        lag = rank if self.split_backward else 0
        forwards = min(ops, warmup + lag + first + 1)  # the forward of that step runs before it
        cycles, rest = divmod(forwards, per_round * v)
        return tuple(
            cycles * per_round + min(per_round, max(0, rest - j * per_round)) - (per_round if j else 0)
            for j in range(v)
        )

    def occupancy(self, pp: int, m: int, v: int) -> tuple[tuple[Point, ...], ...]:
        """Per pipeline rank, the moments of its action order that can be its memory peak, chunk
        by chunk (``chunks_of_rank`` order; ``Point``): per chunk, the micro-batches whose forward
        ran and whose backward has not finished (weight pass included where it is split), those
        whose input pass ran and weight pass not yet, and whether its gradients exist. Only the
        moments no other moment exceeds on every chunk are kept, so for any non-negative bytes per
        chunk the rank's peak is the largest of ``peak`` over them. ``in_flight`` is their largest total, spread evenly
        over the chunks; the chunks themselves are not even (under ZB1P the last rank's first
        chunk holds nearly every micro-batch at once, its last chunk one)."""
        return _occupancy(self.name, pp, m, v)

    def split_share(self, pp: int, m: int, v: int) -> tuple[float, ...]:
        """Per pipeline rank, the share of its backward passes split into an input pass and a
        weight pass: two autograd calls, in each of which a checkpointed layer is recomputed
        (torch's checkpoint remakes a layer once per backward call that reads it). ZB1P and ZB-V
        split every backward; DualPipeV the ``2 pp - 1 - rank`` of its warm-up and cool-down,
        its steady state running whole backwards beside forwards (torch's orders, which
        ``tests/runtime/test_schedules.py`` counts)."""
        return _split_share(self.name, pp, m, v)

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
        return self.fill(pp, m, v, f + b + w, self.split_backward, f, b, w)


def peak(points: tuple[Point, ...], held: list[float], waiting: list[float], grads: list[float]) -> float:
    """A rank's largest bytes over its ``occupancy`` ``points``, given per chunk the bytes one
    micro-batch keeps (``held``), those it keeps only while waiting for its weight pass
    (``waiting``) and the chunk's weight gradients (``grads``)."""
    import numpy as np

    return float((point_matrix(points) @ np.array([*held, *waiting, *grads], dtype=np.float64)).max())


def peak_moment(points: tuple[Point, ...], held: list[float], waiting: list[float], grads: list[float]) -> Point:
    """The point of ``points`` at which ``peak`` is reached."""
    import numpy as np

    return points[int((point_matrix(points) @ np.array([*held, *waiting, *grads], dtype=np.float64)).argmax())]


_MATRICES: dict[int, tuple] = {}  # id(points) -> (points, their rows as one float array)


def point_matrix(points: tuple[Point, ...]):
    """``points`` as a matrix, one row per point (the planner weighs the same points for every
    split it tries: they are converted once, looked up by identity)."""
    import numpy as np

    hit = _MATRICES.get(id(points))
    if hit is None or hit[0] is not points:
        hit = _MATRICES[id(points)] = (points, np.array([hs + ps + gs for hs, ps, gs in points], dtype=np.float64))
    return hit[1]


def _frontier(points) -> tuple[Point, ...]:
    """The points no other point reaches or exceeds on every coordinate, sorted: of a set of
    ``Point``s, or of an int array with one moment a row (its chunks' counts, pending weight
    passes and gradients side by side), repeats allowed."""
    import numpy as np

    if isinstance(points, np.ndarray):
        coords, n = _distinct_rows(points), points.shape[1] // 3
    else:
        coords = np.array([hs + ps + gs for hs, ps, gs in points], dtype=np.int32)
        n = len(next(iter(points))[0])
    # first against the few largest points (by sum): most moments fall to one of them, and a point
    # beaten by one that falls is beaten by what beat that one, so the rest is exact among the
    # survivors alone
    top = coords[np.argsort(-coords.sum(axis=1), kind="stable")[:16]]
    beaten = ((top[:, None, :] >= coords[None]).all(axis=2) & (top[:, None, :] != coords[None]).any(axis=2)).any(0)
    coords = coords[~beaten]
    covers = np.ones((len(coords), len(coords)), dtype=bool)  # [j, i]: j reaches i everywhere
    for column in coords.T:  # one coordinate at a time: no points x points x coordinates array
        covers &= column[:, None] >= column[None, :]
    covers &= ~covers.T  # ... and is not the same point
    kept = {tuple(r) for r in coords[~covers.any(axis=0)].tolist()}
    return tuple(sorted((r[:n], r[n : 2 * n], r[2 * n :]) for r in kept))


_MIX = None  # random odd 64-bit multipliers: a row's hash is its dot product with them


def _distinct_rows(rows):
    """``rows`` without repeats (any order): by a 64-bit hash of each row, checked row by row
    against the one kept for its hash, and by sorting the rows themselves if two differ (a
    quarter of the time of sorting them, which ``numpy.unique`` does, at the planner's sizes)."""
    import numpy as np

    global _MIX
    if _MIX is None or len(_MIX) < rows.shape[1]:
        _MIX = np.random.default_rng(0).integers(1, 2**62, size=max(64, rows.shape[1]), dtype=np.int64) | 1
    keys = rows.astype(np.int64) @ _MIX[: rows.shape[1]]  # wraps around: a hash, not a number
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    if (rows[first][inverse.ravel()] == rows).all():
        return rows[first]
    return np.unique(rows, axis=0)


# a rank's order as events: (kind, chunk of the rank) with these kinds
FORWARD, INPUT, WEIGHT, FULL = 0, 1, 2, 3


def _moments(kinds, chunks, n: int):
    """The moments of a rank's order that can be its peak, one row each (``_frontier``'s array):
    forwards and input passes only add, so those are the moments a weight pass or a full
    backward (``kinds`` ``WEIGHT``, ``FULL``) starts, its chunk's gradients made and its
    micro-batch not yet freed, and the end. ``chunks``: each event's chunk among the rank's ``n``."""
    import numpy as np

    kinds, chunks = np.asarray(kinds), np.asarray(chunks)
    hot = np.zeros((len(kinds), n), dtype=np.int32)
    hot[np.arange(len(kinds)), chunks] = 1
    f, i, w = (hot * mask[:, None] for mask in (kinds == FORWARD, (kinds == INPUT) | (kinds == FULL), kinds >= WEIGHT))
    counts = [np.cumsum(x, axis=0) for x in (f, i, w)]
    grads = np.maximum.accumulate(w, axis=0)  # a chunk's gradients exist from its first weight pass on
    held, pending = counts[0] - counts[2], counts[1] - counts[2]
    # at a weight pass: what ran before it (held and pending by its own event's count, which
    # only a weight pass or full backward changes)
    at = kinds >= WEIGHT
    before = np.hstack([held + w, pending + w - i, grads])[at]
    end = np.hstack([held[-1:], pending[-1:], grads[-1:]])
    return np.vstack([before, end])


@lru_cache(maxsize=4096)  # a search evaluates a few hundred shapes, 64 ranks at most
def _occupancy(name: str, pp: int, m: int, v: int) -> tuple[tuple[Point, ...], ...]:
    row = SCHEDULES[name]
    if v == 1 and not row.split_backward:  # one chunk: the count is the whole story
        return tuple((((round(row.in_flight(r, pp, m, 1)),), (0,), (1,)),) for r in range(pp))
    out = []
    for r in range(pp):
        if row.rounds:
            kinds, chunks = _interleaved_events(r, pp, m, v, row.split_backward)
        else:
            kinds, chunks = _rank_events(name, r, pp, m, v)
        out.append(_frontier(_moments(kinds, chunks, v)))
    return tuple(out)


@lru_cache(maxsize=4096)
def _split_share(name: str, pp: int, m: int, v: int) -> tuple[float, ...]:
    row = SCHEDULES[name]
    return tuple(row.splits(r, pp, m, v) for r in range(pp))


def _interleaved_events(rank: int, pp: int, m: int, v: int, zero_bubble: bool):
    """The events (kinds, chunks) of the order torch's interleaved 1F1B and ZB1P classes give
    rank ``rank``, without building it (building torch's actions costs 20 ms a rank at 64
    ranks). The order: a warm-up of forwards, ``v - 1`` rounds plus two (ZB1P: one) per rank
    below the last; then one forward and one backward at a time; then the remaining backwards.
    Forwards walk the rank's chunks up a round at a time, backwards down. ZB1P runs the k-th
    weight pass right after the (k + rank)-th input pass, the last ``rank`` at the end.
    ``tests/runtime/test_schedules.py`` checks it against the torch classes' orders."""
    import numpy as np

    per_round = m // max(1, m // pp)
    ops = v * m
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), ops)

    def back(step):
        return v - 1 - ((step - warmup) // per_round) % v

    op = np.arange(ops + warmup)
    # per step up to three slots: its forward, its backward (or input pass), its weight pass
    kinds = np.full((len(op), 3), -1)
    chunks = np.zeros((len(op), 3), dtype=np.int64)
    kinds[op < ops, 0], chunks[:, 0] = FORWARD, (op // per_round) % v
    steady = op >= warmup
    kinds[steady, 1] = INPUT if zero_bubble else FULL
    chunks[steady, 1] = back(op[steady])
    if zero_bubble:  # the k-th weight pass after the (k + rank)-th input pass
        weighs = op - warmup >= rank
        kinds[weighs, 2] = WEIGHT
        chunks[weighs, 2] = back(op[weighs] - rank)
    kinds, chunks = kinds.ravel(), chunks.ravel()
    keep = kinds >= 0
    kinds, chunks = kinds[keep], chunks[keep]
    if zero_bubble:  # the weight passes left at the end
        rest = np.arange(max(0, ops - rank), ops)
        kinds = np.concatenate([kinds, np.full(len(rest), WEIGHT)])
        chunks = np.concatenate([chunks, back(warmup + rest)])
    return kinds, chunks


_KINDS = {"FORWARD": FORWARD, "BACKWARD_INPUT": INPUT, "BACKWARD_WEIGHT": WEIGHT, "FULL_BACKWARD": FULL}


@lru_cache(maxsize=4096)
def _rank_events(name: str, rank: int, pp: int, m: int, v: int) -> tuple:
    """Rank ``rank``'s order under torch's class for schedule ``name`` as events: (kinds, chunks
    of the rank). An overlapped forward-backward pair runs its forward first."""
    row = SCHEDULES[name]
    index = {c: j for j, c in enumerate(row.chunks_of_rank(rank, pp, v))}
    kinds, chunks = [], []
    kind_of: dict = {}  # torch's computation type -> our kind (an enum's ``name`` is slow to read)
    for action in _rank_order(row, rank, pp, m, v):
        what = action.computation_type
        if what not in kind_of:
            kind_of[what] = _KINDS.get(what.name, -1)  # -1: an overlapped pair
        if kind_of[what] >= 0:
            kinds.append(kind_of[what])
            chunks.append(index[action.stage_index])
            continue
        parts = action.sub_actions
        for part in [p for p in parts if p.computation_type.name == "FORWARD"] + [
            p for p in parts if p.computation_type.name != "FORWARD"
        ]:
            kinds.append(_KINDS[part.computation_type.name])
            chunks.append(index[part.stage_index])
    return tuple(kinds), tuple(chunks)


def _rank_order(row: Schedule, rank: int, pp: int, m: int, v: int) -> list:
    """Rank ``rank``'s actions as torch's class for ``row`` orders them. The class computes every
    rank's order in its constructor, then (zero bubble) simulates the whole pipeline to place
    idle slots, seconds at 64 ranks; the per-rank method alone gives the same actions (the
    idle slots change no order; ``tests/runtime/test_schedules.py`` compares the two)."""
    cls = torch_schedule(row.name, v)
    shape = object.__new__(cls)  # only the attributes the per-rank method reads
    rounds = max(1, m // pp)
    shape.pp_group_size, shape._n_microbatches, shape.n_local_stages = pp, m, v
    shape.num_stages = shape._num_stages = pp * v
    shape.number_of_rounds, shape.microbatches_per_round = rounds, m // rounds
    shape.rank = rank
    return [a for a in cls._calculate_single_rank_operations(shape, rank) if a is not None]


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule(
            "1f1b", False, False, 1, False, "Schedule1F1B", "ScheduleInterleaved1F1B", "one forward, one backward",
            runs=_one_per_stage, held=lambda r, pp, m, v, rnd: min(m, pp - r), rounds=False, fill=_fill_drain,
            splits=_none_split,
        ),
        Schedule(
            "interleaved", False, False, None, False, None, "ScheduleInterleaved1F1B", "1F1B over v chunks per rank",
            runs=_whole_rounds, held=lambda r, pp, m, v, rnd: min(m * v, (v - 1) * rnd + 2 * (pp - r - 1) + 1) / v,
            rounds=True, fill=_fill_over_chunks, splits=_none_split,
        ),
        Schedule(
            "zero-bubble", False, True, None, False, None, "ScheduleInterleavedZeroBubble",
            "interleaved, weight gradients deferred into the bubble",
            runs=_whole_rounds, held=lambda r, pp, m, v, rnd: min(m * v, (v - 1) * rnd + pp) / v,
            rounds=True, fill=_fill_over_chunks, splits=_all_split,
        ),
        Schedule(
            "zbv", True, True, 2, False, None, "ScheduleZBVZeroBubble", "zero-bubble over a V of two chunks",
            runs=_any, held=lambda r, pp, m, v, rnd: min(2 * pp, 2 * m, m + 1 + r) / 2,
            rounds=False, fill=_fill_over_chunks, splits=_all_split,
        ),
        Schedule(
            "dualpipev", True, True, 2, True, None, "ScheduleDualPipeV",
            "V of two chunks, forward and backward of two micro-batches overlapped",
            # one more forward inside its overlapped F&B steps
            runs=_paired, held=lambda r, pp, m, v, rnd: (2 * min(m, pp) + 1) / 2,
            rounds=False, fill=_fill_over_chunks, splits=_ends_split,
        ),
    )
}  # fmt: skip
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


__all__ = [
    "Point",
    "Schedule",
    "SCHEDULES",
    "peak",
    "peak_moment",
    "point_matrix",
    "NAMES",
    "SPLIT_BACKWARD",
    "schedule",
    "torch_schedule",
]
