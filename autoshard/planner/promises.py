"""What a plan promises each pipeline rank for one optimizer step: its peak memory by part, the
matmul-class FLOPs it runs, and the bytes each collective hands over, by mesh dimension and kind.
These are the cost model's own quantities, summed over the layers, micro-batches and chunks the
rank holds (``plan.json``'s ``predicted.ranks``); ``autoshard verify --at-scale`` holds the
emitted program to them. Ranks of one pipeline stage differ only in which shard they hold, so one
entry per pipeline rank describes them all (routing taken as balanced).
"""

from __future__ import annotations

from collections import defaultdict
from itertools import accumulate

from autoshard.cost_models.comm import data_parallel_payload, wire_bytes
from autoshard.cost_models.layers import POST, PRE
from autoshard.cost_models.memory import sharded_state_bytes
from autoshard.ir.schedules import SCHEDULES, peak_moment

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "fp8_weights", "buffers", "total")


class _Tally:
    """Bytes handed to each (dimension, collective) and bytes sent per dimension."""

    def __init__(self):
        self.comm: dict[tuple[str, str], float] = defaultdict(float)
        self.wire: dict[str, float] = defaultdict(float)

    def send(self, dim: str, kind: str, nbytes: float, ranks: int) -> None:
        self.comm[(dim, kind)] += nbytes
        self.wire[dim] += wire_bytes(kind, nbytes, ranks)


def _rank_blocks(costs, stage_layers: list[int], mine: list[int]) -> list[tuple[int, list]]:
    """Per chunk in ``mine``: (chunk, the blocks it runs: embedding, layer kinds, head)."""
    cuts = [0]
    for n in stage_layers:
        cuts.append(cuts[-1] + n)
    chunks = len(stage_layers)
    out = []
    for ch in mine:
        blocks = ([PRE] if ch == 0 else []) + [costs.kinds[i] for i in range(cuts[ch], cuts[ch + 1])]
        out.append((ch, blocks + ([POST] if ch == chunks - 1 else [])))
    return out


def rank_memory_parts(costs, c, sched, w, stage_layers: list[int], r: int) -> dict:
    """Pipeline rank ``r``'s memory by part under a split (``w``: the candidate's ``Work``) at
    the moment of its order its memory peaks (``Schedule.occupancy``: its chunks hold different
    numbers of micro-batches at once, and a chunk's gradients exist from its first backward on):
    parameters, optimizer states and FP8 weight copies of the blocks its chunks hold, the
    gradients made by then, the layers' saved tensors then. The chunks' kept outputs and the
    buffers are the rest."""
    m = costs.microbatches(c)
    params = optimizer = fp8 = 0.0
    acts, helds, grads = [], [], []
    chunks = len(stage_layers)
    for _, blocks in _rank_blocks(costs, stage_layers, sched.chunks_of_rank(r, c.pp, c.v)):
        dense = expert = act = held = 0.0
        for block in blocks:
            k = w.pre if block == PRE else w.post if block == POST else w.kinds[block]
            dense, expert = dense + k.params_dense, expert + k.params_expert
            act, held = act + k.activation_bytes, held + k.held_bytes
            if c.fp8:
                fp8 += costs.layers.fp8_weight_bytes(block, c.tp, c.ep, c.fp8)
        states = sharded_state_bytes(dense, expert, c.zero, c.dp * c.cp, c.edp)
        params, optimizer = params + states["params"], optimizer + states["optimizer"]
        acts.append(act)
        helds.append(held)
        grads.append(states["grads"])
    points = costs.occupancy(sched, c.v, c.pp, m)[r]
    kept = [costs.chunk_output(c) if ch < chunks - 1 else 0.0 for ch in sched.chunks_of_rank(r, c.pp, c.v)]
    hs, ps, gs = peak_moment(points, [a + k for a, k in zip(acts, kept)], helds, grads)
    return {
        "params": params,
        "grads": sum(g * x for g, x in zip(gs, grads)),
        "optimizer": optimizer,
        "activations": sum(a * h for a, h in zip(acts, hs)) + sum(b * p for b, p in zip(helds, ps)),
        "fp8_weights": fp8,  # the FP8 copies of the weights of FP8 matmuls, kept for a step
    }


def rank_promises(evaluator, ev) -> list[dict]:
    """One entry per pipeline rank of the evaluated plan ``ev`` (an ``Evaluation`` of
    ``evaluator``): ``memory_bytes`` by part, ``flops`` (forward, backward, recompute, total),
    ``comm_bytes`` (dimension -> collective -> bytes handed over) and ``comm_wire_bytes``
    (dimension -> bytes sent on the wire, ``cost_models.comm.wire_bytes``)."""
    costs = evaluator.costs
    c = ev.candidate
    sched = SCHEDULES[c.schedule]
    where_key, where = costs.where(c, True)
    sets = ev.rank_recompute or [c.recompute] * c.pp  # each rank under its own recompute set
    return [
        _rank_promise(costs, c, sched, costs.work(c, where_key, where, sched.overlaps_ep, sets[r]), ev, r)
        for r in range(c.pp)
    ]


def _rank_promise(costs, c, sched, w, ev, r: int) -> dict:
    """Pipeline rank ``r``'s entry of ``rank_promises``."""
    m = costs.microbatches(c)
    mine = sched.chunks_of_rank(r, c.pp, c.v)
    tally = _Tally()
    flops, dense, expert = _run_chunks(costs, c, sched, w, ev.stage_layers, r, mine, tally)
    for kind, nbytes in data_parallel_payload(dense, c.zero, c.dp * c.cp, m):
        tally.send("dp", kind, nbytes, c.dp * c.cp)
    for kind, nbytes in data_parallel_payload(expert, c.zero, c.edp, m):
        tally.send("dp", kind, nbytes, c.edp)
    _send_tied_gradients(costs, c, sched, len(ev.stage_layers), r, tally)
    parts = rank_memory_parts(costs, c, sched, w, ev.stage_layers, r)
    total = ev.memory_ranks[r]
    memory = {**parts, "buffers": max(0.0, total - sum(parts.values())), "total": total}
    by_dim: dict[str, dict[str, float]] = {}
    for (dim, kind), nbytes in sorted(tally.comm.items()):
        by_dim.setdefault(dim, {})[kind] = nbytes
    return {
        "pp_rank": r,
        "chunks": mine,
        "memory_bytes": memory,
        "flops": {**flops, "total": sum(flops.values())},
        "comm_bytes": by_dim,
        "comm_wire_bytes": dict(sorted(tally.wire.items())),
    }


def _run_chunks(costs, c, sched, w, stage_layers: list[int], r: int, mine: list[int], tally: _Tally) -> tuple:
    """(FLOPs by pass, dense parameters, expert parameters) of rank ``r``'s chunks ``mine`` for
    a step; their layers' exchanges and the tensors they hand between ranks go to ``tally``."""
    layers, m = costs.layers, costs.microbatches(c)
    share = sched.split_share(c.pp, m, c.v)[r]
    dense = expert = 0.0
    flops = dict.fromkeys(("forward", "backward", "recompute"), 0.0)
    for ch, blocks in _rank_blocks(costs, stage_layers, mine):
        for block in blocks:
            k = w.pre if block == PRE else w.post if block == POST else w.kinds[block]
            dense, expert = dense + k.params_dense, expert + k.params_expert
            f, b, rerun = layers.matmul_flops(block, c.mbs, c.tp, c.cp, w.recompute)
            flops["forward"] += m * f
            flops["backward"] += m * b
            flops["recompute"] += m * rerun * (1 + share)  # again in a split backward's weight pass
            _send_exchanges(layers, c, w.recompute, block, m, share, tally)
        _send_boundaries(costs, c, sched, stage_layers, r, ch, tally)
    return flops, dense, expert


def _send_exchanges(layers, c, recompute: frozenset, block: int, m: int, share: float, tally: _Tally) -> None:
    """What ``m`` micro-batches through one copy of ``block`` hand over, and what the second
    recomputation of a split backward (``share`` of the backwards) exchanges again."""
    group = {"tp": c.tp, "cp": c.cp, "ep": c.ep, "pp": c.pp}
    for axis, kind, nbytes in layers.payload(block, c.mbs, c.tp, c.cp, c.ep, c.attention, c.fp8, recompute):
        tally.send(axis, kind, m * nbytes, group[axis])
    for axis, kind, nbytes in layers.replayed_payload(block, c.mbs, c.tp, c.cp, c.ep, c.fp8, recompute):
        tally.send(axis, kind, m * nbytes * share, group[axis])


def _send_boundaries(costs, c, sched, stage_layers: list[int], r: int, ch: int, tally: _Tally) -> None:
    """The activation chunk ``ch`` hands the next chunk and the gradient of its input it hands
    the one before, where that chunk is on another rank than ``r`` (what a chunk hands on is
    its last layer's output, the embedding's before any layer)."""
    m = costs.microbatches(c)
    cuts = [0, *accumulate(stage_layers)]
    if ch + 1 < len(stage_layers) and sched.chunk_rank(ch + 1, c.pp) != r:
        last = costs.kinds[cuts[ch + 1] - 1] if cuts[ch + 1] > 0 else PRE
        tally.send("pp", "send", m * costs.layers.boundary_bytes(last, c.mbs, c.tp, c.cp), 2)
    if ch > 0 and sched.chunk_rank(ch - 1, c.pp) != r:
        before = costs.kinds[cuts[ch] - 1] if cuts[ch] > 0 else PRE
        tally.send("pp", "send", m * costs.layers.boundary_bytes(before, c.mbs, c.tp, c.cp), 2)


def _send_tied_gradients(costs, c, sched, chunks: int, r: int, tally: _Tally) -> None:
    """The gradients of the copies of tied parameters (the embedding's in the head), summed
    between the ranks of the first and the last chunk when ``r`` is one of them."""
    ends = {sched.chunk_rank(0, c.pp), sched.chunk_rank(chunks - 1, c.pp)}
    copy = costs.tied_copy(c)
    if copy and len(ends) > 1 and r in ends:
        grads = sharded_state_bytes(copy, 0.0, c.zero, c.dp * c.cp, c.edp)["grads"]
        tally.send("pp", "all_reduce", grads, 2)
