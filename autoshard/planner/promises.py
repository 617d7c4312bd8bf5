"""What a plan promises each pipeline rank for one optimizer step: its peak memory by part, the
matmul-class FLOPs it runs, and the bytes each collective hands over, by mesh dimension and kind.
These are the cost model's own quantities, summed over the layers, micro-batches and chunks the
rank holds (``plan.json``'s ``predicted.ranks``); ``autoshard verify --at-scale`` holds the
emitted program to them. Ranks of one pipeline stage differ only in which shard they hold, so one
entry per pipeline rank describes them all (routing taken as balanced).
"""

from __future__ import annotations

from collections import defaultdict

from autoshard.cost_models.comm import data_parallel_payload, wire_bytes
from autoshard.cost_models.layers import POST, PRE
from autoshard.cost_models.memory import sharded_state_bytes
from autoshard.runtime.schedules import SCHEDULES

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "fp8_weights", "buffers", "total")


class _Tally:
    """Bytes handed to each (dimension, collective) and bytes sent per dimension."""

    def __init__(self):
        self.comm: dict[tuple[str, str], float] = defaultdict(float)
        self.wire: dict[str, float] = defaultdict(float)

    def send(self, dim: str, kind: str, nbytes: float, ranks: int) -> None:
        self.comm[(dim, kind)] += nbytes
        self.wire[dim] += wire_bytes(kind, nbytes, ranks)


def rank_promises(evaluator, ev) -> list[dict]:
    """One entry per pipeline rank of the evaluated plan ``ev`` (an ``Evaluation`` of
    ``evaluator``): ``memory_bytes`` by part, ``flops`` (forward, backward, recompute, total),
    ``comm_bytes`` (dimension -> collective -> bytes handed over) and ``comm_wire_bytes``
    (dimension -> bytes sent on the wire, ``cost_models.comm.wire_bytes``)."""
    costs, problem = evaluator.costs, evaluator.p
    c = ev.candidate
    sched = SCHEDULES[c.schedule]
    m = costs.microbatches(c)
    where_key, where = costs.where(c, True)
    w = costs.work(c, where_key, where, sched.overlaps_ep)
    in_flight = costs.in_flight(sched, c.v, c.pp, m)
    pending = costs.pending(sched, c.v, c.pp, m)
    layers = costs.layers
    fp8 = c.fp8 if "fp8" in problem.hw.peak_tflops else ()
    cuts = [0]
    for n in ev.stage_layers:
        cuts.append(cuts[-1] + n)
    chunks = len(ev.stage_layers)
    group = {"tp": c.tp, "cp": c.cp, "ep": c.ep, "pp": c.pp}
    out = []
    for r in range(c.pp):
        dense = expert = act = held = fp8_weights = 0.0
        flops = dict.fromkeys(("forward", "backward", "recompute"), 0.0)
        tally = _Tally()
        send = tally.send
        mine = [ch for ch in range(chunks) if sched.chunk_rank(ch, c.pp) == r]
        for ch in mine:
            blocks = ([PRE] if ch == 0 else []) + [costs.kinds[i] for i in range(cuts[ch], cuts[ch + 1])]
            blocks += [POST] if ch == chunks - 1 else []
            for block in blocks:
                k = w.pre if block == PRE else w.post if block == POST else w.kinds[block]
                dense, expert, act = dense + k.params_dense, expert + k.params_expert, act + k.activation_bytes
                held += k.held_bytes
                if fp8:
                    fp8_weights += layers.fp8_weight_bytes(block, c.tp, c.ep, c.fp8)
                f, b, rerun = layers.matmul_flops(block, c.mbs, c.tp, c.cp, w.recompute)
                flops["forward"] += m * f
                flops["backward"] += m * b
                flops["recompute"] += m * rerun
                for axis, kind, nbytes in layers.payload(block, c.mbs, c.tp, c.cp, c.ep, c.attention, c.fp8):
                    send(axis, kind, m * nbytes, group[axis])
            # the activation to the next chunk, the gradient of this chunk's input to the one before
            # (what a chunk hands on is its last layer's output, the embedding's before any layer)
            if ch + 1 < chunks and sched.chunk_rank(ch + 1, c.pp) != r:
                last = costs.kinds[cuts[ch + 1] - 1] if cuts[ch + 1] > 0 else PRE
                send("pp", "send", m * layers.boundary_bytes(last, c.mbs, c.tp, c.cp), 2)
            if ch > 0 and sched.chunk_rank(ch - 1, c.pp) != r:
                before = costs.kinds[cuts[ch] - 1] if cuts[ch] > 0 else PRE
                send("pp", "send", m * layers.boundary_bytes(before, c.mbs, c.tp, c.cp), 2)
        for kind, nbytes in data_parallel_payload(dense, c.zero, c.dp * c.cp, m):
            send("dp", kind, nbytes, c.dp * c.cp)
        for kind, nbytes in data_parallel_payload(expert, c.zero, c.edp, m):
            send("dp", kind, nbytes, c.edp)
        ends = {sched.chunk_rank(0, c.pp), sched.chunk_rank(chunks - 1, c.pp)}
        copy = costs.tied_copy(c)
        if copy and len(ends) > 1 and r in ends:  # the tied copies' gradients, summed between the ends
            grads = sharded_state_bytes(copy, 0.0, c.zero, c.dp * c.cp, c.edp)["grads"]
            send("pp", "all_reduce", grads, 2)
        states = sharded_state_bytes(dense, expert, c.zero, c.dp * c.cp, c.edp)
        activations = act * in_flight[r] + held * pending[r]
        total = ev.memory_ranks[r]
        memory = {
            "params": states["params"],
            "grads": states["grads"],
            "optimizer": states["optimizer"],
            "activations": activations,
            "fp8_weights": fp8_weights,
            "buffers": max(0.0, total - states["total"] - activations - fp8_weights),
            "total": total,
        }
        by_dim: dict[str, dict[str, float]] = {}
        for (dim, kind), nbytes in sorted(tally.comm.items()):
            by_dim.setdefault(dim, {})[kind] = nbytes
        out.append(
            {
                "pp_rank": r,
                "chunks": mine,
                "memory_bytes": memory,
                "flops": {**flops, "total": sum(flops.values())},
                "comm_bytes": by_dim,
                "comm_wire_bytes": dict(sorted(tally.wire.items())),
            }
        )
    return out
