"""The schedule table's micro-batches in flight, per rank and chunk by chunk (held in full, and
waiting for a deferred weight-gradient pass), are those of the action orders torch's classes run:
walked here for every shape the planner may choose, small enough to enumerate."""

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

from autoshard.ir.schedules import SCHEDULES


class _Stage:
    """What torch's schedule classes read of a stage to lay out their actions."""

    def __init__(self, index: int, stages: int, ranks: int):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, ranks, 0
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.submod = torch.nn.Linear(1, 1)
        self.stage_index_to_group_rank = {}
        self.has_backward = True


def _orders(name: str, pp: int, m: int, v: int) -> dict:
    row = SCHEDULES[name]
    cls = getattr(torch_schedules, row.torch_class(v))
    stages = [_Stage(c, pp * v, pp) for c in row.chunks_of_rank(0, pp, v)]
    single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
    return cls(stages[0] if single else stages, m, loss_fn=lambda out, target: out.sum()).pipeline_order


def _peak(actions) -> int:
    """The most (chunk, micro-batch) forwards run whose full backward, or weight-gradient pass,
    has not."""
    f = w = held = 0
    for a in actions:
        name = getattr(getattr(a, "computation_type", None), "name", None)
        if name == "OVERLAP_F_B":  # one micro-batch's forward beside another's full backward
            held = max(held, f + 1 - w)
            continue
        f += name == "FORWARD"
        w += name in ("BACKWARD_WEIGHT", "FULL_BACKWARD")
        held = max(held, f - w)
    return held


SHAPES = [
    (name, pp, m, v)
    for name, row in SCHEDULES.items()
    for pp in (2, 3, 4, 8)
    for m in range(1, 3 * pp + 1)
    for v in ((1,) if name == "1f1b" else (2,) if row.fixed_v == 2 else (2, 3, 4))
    if row.runs_with(pp, m, v) is None
]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_in_flight_is_what_torchs_schedule_holds(name):
    checked = 0
    for _, pp, m, v in [s for s in SHAPES if s[0] == name]:
        try:
            orders = _orders(name, pp, m, v)
        except (ValueError, RuntimeError):  # a shape torch's class refuses: the runtime never meets it
            continue
        for rank in range(pp):
            held = _peak(orders[rank])
            row = SCHEDULES[name]
            assert held / v == pytest.approx(row.in_flight(rank, pp, m, v)), (name, pp, m, v, rank)
        checked += 1
    assert checked >= 5


def _every_moment(actions, chunks: list[int]) -> set:
    """(held, waiting, gradients made) per chunk after every action of a rank's order and as
    each weight pass or full backward starts (its gradients made, its micro-batch still held),
    brute force (an overlapped forward-backward pair: its forward, then its backward)."""
    f, i, w, g = ({c: 0 for c in chunks} for _ in range(4))
    out = set()

    def note():
        out.add(
            tuple(
                tuple(x[c] for c in chunks)
                for x in ({c: f[c] - w[c] for c in chunks}, {c: i[c] - w[c] for c in chunks}, g)
            )
        )

    for a in actions:
        if a is None:
            continue
        parts = a.sub_actions if a.computation_type.name == "OVERLAP_F_B" else (a,)
        for part in sorted(parts, key=lambda x: x.computation_type.name != "FORWARD"):
            s, name = part.stage_index, part.computation_type.name
            if name in ("BACKWARD_WEIGHT", "FULL_BACKWARD"):
                g[s] = 1
                note()
            f[s] += name == "FORWARD"
            i[s] += name in ("BACKWARD_INPUT", "FULL_BACKWARD")
            w[s] += name in ("BACKWARD_WEIGHT", "FULL_BACKWARD")
            note()
    return out


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_occupancy_is_every_peak_of_torch_orders_per_chunk(name):
    """``occupancy`` (built without torch's constructor, from the per-rank order or, for the
    interleaved schedules, its own walk) keeps exactly the moments of the full orders no other
    moment exceeds on every chunk, and its totals are the in-flight and pending counts."""
    from autoshard.ir.schedules import _frontier

    row, checked = SCHEDULES[name], 0
    for sched, pp, m, v in SHAPES:
        if sched != name:
            continue
        try:
            orders = _orders(name, pp, m, v)
        except (ValueError, RuntimeError):
            continue
        occupancy = row.occupancy(pp, m, v)
        for rank in range(pp):
            chunks = row.chunks_of_rank(rank, pp, v)
            assert occupancy[rank] == _frontier(_every_moment(orders[rank], chunks)), (name, pp, m, v, rank)
            held = max(sum(hs) for hs, _, _ in occupancy[rank])
            assert held / v == pytest.approx(row.in_flight(rank, pp, m, v)), (name, pp, m, v, rank)
            # some moment finds every chunk of the rank holding ``least_held`` micro-batches (the
            # planner's bounds count on it on the ranks of uneven chunks)
            least = row.least_held(rank, pp, m, v)
            assert 1 <= least <= row.in_flight(rank, pp, m, v), (name, pp, m, v, rank)
            assert max(min(hs) for hs, _, _ in occupancy[rank]) >= least, (name, pp, m, v, rank)
            # ``held_with_grads`` is a moment of torch's order at which every chunk's gradients
            # exist (the bounds add all of a rank's states to its activations then)
            with_grads = row.held_with_grads(rank, pp, m, v)
            if with_grads is not None:
                moments = _every_moment(orders[rank], chunks)
                assert any(hs == with_grads and all(gs) for hs, _, gs in moments), (name, pp, m, v, rank)
        checked += 1
    assert checked >= 5


def test_frontier_keeps_exactly_the_points_no_other_covers():
    """``_frontier`` against its definition, point by point, on random moments of 1 to 4 chunks."""
    import random

    from autoshard.ir.schedules import _frontier

    def covers(a, b):
        return a != b and all(x >= y for pa, pb in zip(a, b) for x, y in zip(pa, pb))

    rng = random.Random(0)
    for _ in range(200):
        chunks = rng.randint(1, 4)
        points = {
            tuple(tuple(rng.randint(0, 3) for _ in range(chunks)) for _ in range(3)) for _ in range(rng.randint(1, 40))
        }
        expected = tuple(sorted(p for p in points if not any(covers(o, p) for o in points)))
        assert _frontier(points) == expected


def test_occupancy_at_scale_is_uneven_over_chunks():
    """The flagship shape (ZB1P, 64 ranks, 2 chunks, 128 micro-batches): the last rank's total
    stays at 128, but its first chunk alone reaches 127 while its last (the head's) holds one."""
    last = SCHEDULES["zero-bubble"].occupancy(64, 128, 2)[63]
    assert max(sum(hs) for hs, _, _ in last) == 128
    assert max(hs[0] for hs, _, _ in last) == 128 and min(hs[1] for hs, _, _ in last) == 0
    assert ((127, 1), (63, 1), (1, 1)) in last


def test_gradients_come_with_each_chunks_first_backward():
    """Meta's LLaMA-3 405B shape (interleaved, 16 ranks, 8 chunks, 16 micro-batches): the first
    rank's peak, every chunk holding its 16 micro-batches, comes as its last chunk's first
    backward starts, when only that chunk's gradients exist; once all have run one, every
    chunk's do."""
    first = SCHEDULES["interleaved"].occupancy(16, 16, 8)[0]
    assert ((16,) * 8, (0,) * 8, (0,) * 7 + (1,)) in first
    assert all(sum(gs) < 8 for hs, _, gs in first if sum(hs) == 128)
    assert any(gs == (1,) * 8 for _, _, gs in first)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_split_share_is_the_share_of_torchs_backwards_split_in_two(name):
    # each split backward is two autograd calls, and a checkpointed layer is recomputed in each:
    # the cost model counts its recomputation again for this share of the backwards
    for _, pp, m, v in [s for s in SHAPES if s[0] == name][::5]:
        order = _orders(name, pp, m, v)
        for rank, actions in order.items():
            parts = [
                p.computation_type.name
                for a in actions
                if a is not None
                for p in (a.sub_actions if a.computation_type.name == "OVERLAP_F_B" else (a,))
            ]
            split, full = parts.count("BACKWARD_INPUT"), parts.count("FULL_BACKWARD")
            share = SCHEDULES[name].split_share(pp, m, v)[rank]
            assert share == pytest.approx(split / max(1, split + full)), (name, pp, m, v, rank)


def test_frontier_of_moment_rows_equals_the_frontier_of_their_points(monkeypatch):
    """``_frontier`` of an array of moments (repeats allowed, up to 24 chunks) keeps what it
    keeps of the same moments as distinct points, also when every row hashes alike (the rows
    are then told apart by sorting them)."""
    import random

    import numpy as np

    from autoshard.ir import schedules

    rng = random.Random(1)
    for trial in range(60):
        chunks = rng.choice([1, 2, 3, 8, 24])
        rows = np.array(
            [[rng.randint(0, 2) for _ in range(3 * chunks)] for _ in range(rng.randint(1, 30))], dtype=np.int64
        )
        rows = np.vstack([rows, rows[: rng.randint(0, len(rows))]])  # repeats
        points = {(tuple(r[:chunks]), tuple(r[chunks : 2 * chunks]), tuple(r[2 * chunks :])) for r in rows.tolist()}
        if trial % 2:
            monkeypatch.setattr(schedules, "_MIX", np.zeros(3 * chunks, dtype=np.int64))  # every key the same
        assert schedules._frontier(rows) == schedules._frontier(points), trial
