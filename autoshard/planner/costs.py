"""What one candidate costs: where its axes land, its layers' costs summed over the model, its
model states and buffers, and the micro-batches its schedule keeps in flight. The formulas are in
``cost_models`` (``layers``, ``comm``, ``memory``); this is their assembly for a ``Candidate``,
memoised in the search's ``Memo``, which the bounds and the exact evaluation share.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from autoshard.cost_models.comm import Where, pipeline_ends_all_reduce
from autoshard.cost_models.hardware import Hardware
from autoshard.cost_models.layers import POST, PRE, LayerCost, LayerCosts
from autoshard.cost_models.memory import (
    GRAD_TRANSIENT_BYTES,
    ZERO3_GATHERED_LAYERS,
    sharded_state_bytes,
    stepped_params,
)
from autoshard.ir.plan import GRID_AXES
from autoshard.ir.schedules import SCHEDULES, Schedule
from autoshard.planner.candidates import Candidate, Problem, recompute_options, schedules
from autoshard.planner.memo import Memo


def _strides(c: Candidate, order: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    sizes = {"tp": c.tp, "cp": c.cp, "pp": c.pp, "dp": c.dp}
    out, stride = {}, 1
    for a in order:
        out[a] = (sizes[a], stride)
        stride *= sizes[a]
    return out


def placements(c: Candidate, order: tuple[str, ...] | None, hw: Hardware) -> dict[str, Where]:
    """Where each axis lands; ``order=None`` gives every axis its best case (for lower bounds).

    The expert groups fold over a stage's tp x cp x dp ranks (``Mesh``): flattened in ``order``
    with pp skipped, the expert-parallel group is the first ``ep`` positions and the expert-data-
    parallel group every ``ep``-th."""
    d = hw.nvlink_domain
    if order is None:
        best = {a: Where.best(getattr(c, a), hw) for a in ("tp", "cp", "pp", "dp", "ep")}
        # (the family floor's stand-in has dp = 1, fewer ranks than ep may need; it reads no edp)
        return best | {"dpcp": Where.best(c.dp * c.cp, hw), "edp": Where.best(max(1, c.edp), hw)}
    st = _strides(c, order)
    out = {a: Where.grid((st[a],), d) for a in GRID_AXES}
    out["dpcp"] = Where.grid(tuple(st[a] for a in order if a in ("cp", "dp")), d)
    stage = tuple(st[a] for a in order if a != "pp")
    out["ep"] = Where.grid(stage, d, take=c.ep)
    out["edp"] = Where.grid(stage, d, every=c.ep)
    return out


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
    held: float  # held for deferred weight-gradient passes (split backward), per micro-batch
    params_dense: float
    params_expert: float
    p2p: float
    recompute: frozenset = frozenset()  # what the layers recompute
    states: dict = field(default_factory=dict)  # (zero, gradients counted) -> per-kind state bytes, cached


class CandidateCosts:
    """The per-candidate quantities of one problem, memoised. ``share`` (the costs of the same
    problem under other mesh pins) lends its layer costs and memo: none of the memo keys leaves
    out the mesh."""

    def __init__(self, problem: Problem, share: CandidateCosts | None = None):
        self.p = problem
        sp = problem.sequence_parallel  # with TP, unless pinned off or refused by the passes
        if share is None:
            hw = problem.hw.shared(problem.gpus)  # ranks sharing a host's cores (CPU runs)
            self.layers = LayerCosts(problem.cost, problem.seq, hw, sp)
            self.floor = LayerCosts(problem.cost, problem.seq, hw, sp, floor=True)
            self.memo = Memo()
        else:
            self.layers, self.floor, self.memo = share.layers, share.floor, share.memo
        self.kinds = problem.layer_kinds
        self.kind_counts = [blk.count for blk in problem.cost.blocks]
        self.blocks = [*range(len(problem.cost.blocks)), PRE, POST]
        self.block_counts = [*self.kind_counts, 1, 1]
        self.recompute_sets = recompute_options(problem)
        self.all_categories = frozenset().union(*self.recompute_sets)
        self.model_categories = problem.categories

    def microbatches(self, c: Candidate) -> int:
        return self.p.global_batch // (c.dp * c.mbs)

    def split_share(self, c: Candidate) -> float:
        """The share of ``c``'s backward passes its schedule splits into an input and a weight
        pass, averaged over the pipeline ranks (``Schedule.split_share``)."""
        shares = SCHEDULES[c.schedule].split_share(c.pp, self.microbatches(c), c.v)
        return sum(shares) / len(shares)

    def zero_options(self, c: Candidate) -> list[int]:
        zs = (0, 1, 2, 3) if c.dp * c.cp > 1 else (0,)
        return [z for z in zs if self.p.forced.get("zero", z) == z]

    def where(self, c: Candidate, exact_order: bool):
        """(layout key, {axis: Where}): ``c``'s placements, or every axis's best (``exact_order``
        False). Orders with the same layout key cost the same."""
        key = (c.tp, c.pp, c.cp, c.ep, c.dp, c.order if exact_order else None)
        places = self.memo.places
        if key not in places:
            where = placements(c, c.order if exact_order else None, self.p.hw)
            places[key] = (tuple(sorted(where.items())), where)
        return places[key]

    def layer(self, block: int, c: Candidate, where: dict[str, Where]) -> LayerCost:
        return self.layers.layer(
            block,
            c.mbs,
            c.tp,
            c.cp,
            c.ep,
            c.fp8,
            c.recompute,
            c.attention,
            where["tp"],
            where["cp"],
            where["ep"],
            where["pp"],
        )

    def work(self, c: Candidate, where_key, where, overlap: bool, recompute: frozenset | None = None) -> Work:
        """The totals of ``c`` with the EP all-to-all overlapped or not, recomputing ``recompute``
        (default: ``c.recompute``)."""
        rc = c.recompute if recompute is None else recompute
        # the layers read only these placements: layouts that differ in the data-parallel groups
        # alone share one Work (``c.v`` counts the sends on the fill/drain path below)
        places = (where["tp"], where["cp"], where["ep"], where["pp"])
        split = self.split_share(c) if rc else 0.0
        key = (c.tp, c.pp, c.v, c.cp, c.ep, c.dp, c.mbs, c.fp8, c.attention, rc, places, overlap, split)
        w = self.memo.work.get(key)
        if w is None:
            # all but the pipeline sends is the same for every v of a split share: made once
            base_key = key[:2] + key[3:]
            base = self.memo.work_layers.get(base_key)
            if base is None:
                base = self.memo.work_layers[base_key] = self._work_layers(c, rc, where, overlap, split)
            kinds, pre, post, total, f, b, wp, hop = base
            # communication on the fill/drain path: half in forward, half in backward. A rank's
            # pipeline sends (one per virtual stage) lie on it too; in the steady state they are
            # asynchronous and overlap the next micro-batch's compute (LLaMA-3 section 3.3.2).
            p2p = max(k.p2p for k in kinds)
            half = (hop + c.v * c.pp * p2p) / 2
            w = Work(
                kinds,
                pre,
                post,
                total,
                f + half,
                b + half,
                wp,
                _tot(self.kind_counts, kinds, pre, post, "activation_bytes"),
                _tot(self.kind_counts, kinds, pre, post, "held_bytes"),
                _tot(self.kind_counts, kinds, pre, post, "params_dense"),
                _tot(self.kind_counts, kinds, pre, post, "params_expert"),
                p2p,
                rc,
            )
            self.memo.work[key] = w
        return w

    def _work_layers(self, c: Candidate, rc: frozenset, where, overlap: bool, split: float) -> tuple:
        """``work``'s layers and their totals but for the pipeline sends: (per-kind layers, the
        embedding, the head, time, forward, input-gradient, weight-gradient seconds, and the TP,
        CP and (exposed) EP seconds on the fill/drain path)."""
        c2 = c if rc == c.recompute else replace(c, recompute=rc)
        kinds = [self.layer(i, c2, where) for i in range(len(self.p.cost.blocks))]
        pre, post = self.layer(PRE, c2, where), self.layer(POST, c2, where)
        if split:  # a split backward's weight pass recomputes the layer a second time
            kinds = [_rerun_in_weight_pass(k, split) for k in kinds]
            pre, post = _rerun_in_weight_pass(pre, split), _rerun_in_weight_pass(post, split)
        copy = self.tied_copy(c)
        if copy:  # the head's chunk holds its own copy of the tied parameters
            post = replace(post, params_dense=post.params_dense + copy)
        counts = self.kind_counts
        total = sum(n * k.time(overlap) for n, k in zip(counts, kinds)) + pre.time(overlap) + post.time(overlap)
        # an overlapping schedule hides the all-to-all but for what the program does not hide
        ep = _tot(counts, kinds, pre, post, "ep" if not overlap else "ep_unhidden")
        hop = _tot(counts, kinds, pre, post, "tp") + _tot(counts, kinds, pre, post, "cp") + ep
        f, b, wp = (_tot(counts, kinds, pre, post, a) for a in ("f", "b", "w"))
        return kinds, pre, post, total, f, b, wp, hop

    def tied_copy(self, c: Candidate) -> float:
        """Parameters one GPU of the head's chunk holds as its copy of the ones tied to the
        embedding (``facts["tied"]``), TP-split as the embedding's are; none without a pipeline,
        where one chunk holds both ends."""
        tied = self.p.cost.facts.get("tied") or {}
        if c.pp == 1 or not tied.get("params"):
            return 0.0
        return tied["params_tp"] / c.tp + tied["params"] - tied["params_tp"]

    def pipeline_sends(
        self, c: Candidate, schedule: Schedule, w: Work, m: int, bubble: float
    ) -> tuple[float, float, float]:
        """(total, exposed, steady) seconds per step of the pipeline's sends on the average rank:
        every chunk's send of every micro-batch; exposed, what they add to the fill/drain
        (``bubble``, the schedule's with them) and the steady-state share the program does not
        hide (``Hardware.overlap``), which is ``steady``. None without a pipeline."""
        if c.pp == 1:
            return 0.0, 0.0, 0.0
        sends = c.v * w.p2p / 2
        steady = m * c.v * (1 - self.p.hw.overlap_share("pp")) * w.p2p
        exposed = bubble - schedule.bubble(c.pp, m, c.v, w.f / c.pp - sends, w.b / c.pp - sends, w.w / c.pp)
        return m * c.v * w.p2p, max(0.0, exposed + steady), steady

    def tied_sync(self, c: Candidate, schedule: Schedule, where: dict[str, Where], zero: int) -> float:
        """Seconds per step summing the tied copies' gradients between the ranks holding the first
        and the last chunk (one all-reduce of the gradient each holds at this ZeRO stage); none
        where one rank holds both ends (V-shaped schedules) or nothing is tied."""
        copy = self.tied_copy(c)
        last = c.pp * c.v - 1
        if not copy or schedule.chunk_rank(0, c.pp) == schedule.chunk_rank(last, c.pp):
            return 0.0
        grads = sharded_state_bytes(copy, 0.0, zero, c.dp * c.cp, c.edp)["grads"]
        return pipeline_ends_all_reduce(grads, where["pp"], self.p.hw)

    def states(self, c: Candidate, w: Work, zero: int, grads: bool = True) -> tuple[list[float], float, float]:
        """(per-kind, embedding, head) model-state bytes at this ZeRO stage, with the FP8 copies
        of the weights of FP8 matmuls the program keeps for a step; without the gradients where
        ``grads`` is false (autograd makes them at a chunk's first backward: ``Schedule.occupancy``
        says when)."""
        key = (zero, grads)
        if key not in w.states:

            def total(k: LayerCost, block: int) -> float:
                parts = sharded_state_bytes(k.params_dense, k.params_expert, zero, c.dp * c.cp, c.edp)
                states = parts["total"] - (0.0 if grads else parts["grads"])
                return states + (self.layers.fp8_weight_bytes(block, c.tp, c.ep, c.fp8) if c.fp8 else 0.0)

            kinds = [total(k, i) for i, k in enumerate(w.kinds)]
            w.states[key] = (kinds, total(w.pre, PRE), total(w.post, POST))
        return w.states[key]

    def optimizer_time(self, c: Candidate, layer: LayerCost) -> float:
        """Seconds of one copy of ``layer``'s share of the optimizer step on a rank: the
        parameters it steps (``stepped_params``) times the bytes the program's AdamW moves for
        each (``Hardware.optimizer_bytes_per_param``) over the memory bandwidth. It runs once a
        step, after the last backward, on every rank."""
        hw = self.layers.hw
        n = stepped_params(layer.params_dense, layer.params_expert, c.zero, c.dp * c.cp, c.edp)
        return n * hw.optimizer_bytes_per_param / (hw.hbm_gbps * 1e9)

    def fsdp_time(self, c: Candidate) -> float:
        """Host seconds FSDP2 spends on one unit (a layer; the embedding and the head one each)
        per micro-batch at ZeRO-2/3: its hooks gathering the parameters before the forward
        and the backward and reducing the gradients after (``Hardware.fsdp_unit_overhead_us``;
        0 on GPUs, where the host runs ahead)."""
        return self.layers.hw.fsdp_unit_overhead_us * 1e-6 if c.zero >= 2 else 0.0

    def grads(self, c: Candidate, w: Work, zero: int) -> tuple[list[float], float, float]:
        """(per-kind, embedding, head) gradient bytes at this ZeRO stage: ``states`` less
        ``states`` without them."""
        with_grads, without = self.states(c, w, zero), self.states(c, w, zero, grads=False)
        kinds = [a - b for a, b in zip(with_grads[0], without[0])]
        return kinds, with_grads[1] - without[1], with_grads[2] - without[2]

    def buffers(self, c: Candidate, w: Work, zero: int) -> tuple[float, float]:
        """Bytes every rank needs besides model states and saved activations: the largest transient
        (gathered K/V, expert dispatch buffers, ZeRO-3's gathered layers, a
        parameter's gradient as backward makes it: ``GRAD_TRANSIENT_BYTES`` per element of the
        largest parameter) and the pipeline's send/receive buffers; then the extra on the rank
        holding the output head."""
        transient = max([k.transient_bytes for k in w.kinds] + [w.pre.transient_bytes])
        if zero == 3:  # bf16 copies of the largest layer (``ZERO3_GATHERED_LAYERS``)
            transient += ZERO3_GATHERED_LAYERS * max(k.params_dense + k.params_expert for k in w.kinds) * 2
        largest = max(self.layers.largest_param(i, c.tp, c.ep) for i in range(len(w.kinds)))
        transient += GRAD_TRANSIENT_BYTES * largest
        return transient + (4 * self._boundary(c) if c.pp > 1 else 0.0), w.post.transient_bytes

    def _boundary(self, c: Candidate) -> float:
        """Bytes of the activation one chunk hands the next, one micro-batch."""
        sp = c.tp > 1 and self.layers.sp
        return 2 * self.layers.block(0).eval("boundary", c.mbs, self.p.seq / c.cp) / (c.tp if sp else 1)

    def chunk_output(self, c: Candidate) -> float:
        """Bytes a pipeline chunk keeps per micro-batch in flight besides its layers' saved
        tensors: its forward's output, kept by the stage until its backward (none without a
        pipeline)."""
        return self._boundary(c) if c.pp > 1 else 0.0

    def rank_buffers(self, c: Candidate, schedule: Schedule) -> list[float]:
        """Per pipeline rank, bytes besides ``buffers``: on the rank holding the embedding, its
        gradient's transient where that is larger than the layers' largest."""
        first = schedule.chunk_rank(0, c.pp)
        out = [0.0] * c.pp
        layers = max(self.layers.largest_param(i, c.tp, c.ep) for i in range(len(self.p.cost.blocks)))
        out[first] += GRAD_TRANSIENT_BYTES * max(0.0, self.layers.largest_param(PRE, c.tp, c.ep) - layers)
        return out

    def in_flight(self, schedule: Schedule, v: int, pp: int, m: int) -> tuple:
        """Per pipeline rank, micro-batches in flight the bounds may count on for every byte a
        rank's chunks keep per micro-batch (memoised: the tuple's identity names it in other memo
        keys). A rank's chunks hold the same layers but for one (``partition._spread``), so its
        activations are at least its total ``Schedule.in_flight`` spread evenly; not so on the
        ranks holding the embedding's or the head's chunk, which take fewer layers than the
        rank's other chunks and can hold far fewer or far more micro-batches at once (ZB1P's last
        rank: 128 on one chunk, 1 on the head's). There the count is what every chunk holds at
        once at some moment (``Schedule.least_held``)."""
        key = (schedule.name, v, pp, m)
        table = self.memo.in_flight
        if key not in table:
            ends = {schedule.chunk_rank(0, pp), schedule.chunk_rank(pp * v - 1, pp)} if v > 1 else set()
            counts = tuple(
                schedule.least_held(r, pp, m, v) if r in ends else schedule.in_flight(r, pp, m, v) for r in range(pp)
            )
            # one tuple per value: schedules keeping the same counts share the bounds memoised by it
            table[key] = self.memo.in_flight_values.setdefault(counts, counts)
        return table[key]

    def in_flight_with_grads(self, schedule: Schedule, v: int, pp: int, m: int) -> tuple:
        """Per pipeline rank, micro-batches in flight (counted as ``in_flight`` counts them) at a
        moment every chunk of the rank has its gradients (``Schedule.held_with_grads``): the
        rank's memory is then at least those activations beside all its model states. One chunk:
        ``in_flight`` (its peak comes with its gradients); zero where the row gives no such
        moment (the V-shaped schedules), which leaves the states alone. Memoised and one tuple per
        value, as ``in_flight``."""
        key = (schedule.name, v, pp, m)
        table = self.memo.in_flight_grads
        if key not in table:
            if v == 1:
                counts = self.in_flight(schedule, v, pp, m)
            else:
                ends = {schedule.chunk_rank(0, pp), schedule.chunk_rank(pp * v - 1, pp)}
                counts = []
                for r in range(pp):
                    held = schedule.held_with_grads(r, pp, m, v)
                    counts.append(0.0 if held is None else float(min(held) if r in ends else sum(held) / v))
                counts = tuple(counts)
            table[key] = self.memo.in_flight_values.setdefault(counts, counts)
        return table[key]

    def least_with_grads(self, pp: int, m: int) -> tuple:
        """Per pipeline rank, the least ``in_flight_with_grads`` over the schedules valid for (pp,
        m) (memoised, one tuple per value)."""
        key = (pp, m)
        table = self.memo.least_grads
        if key not in table:
            shapes = self.schedule_shapes(pp, m)[0]
            flights = [self.in_flight_with_grads(sched, v, pp, m) for sched, v, _ in shapes]
            least = tuple(map(min, *flights)) if len(flights) > 1 else (flights[0] if flights else ())
            table[key] = self.memo.in_flight_values.setdefault(least, least)
        return table[key]

    def occupancy(self, schedule: Schedule, v: int, pp: int, m: int) -> tuple:
        """Per pipeline rank, the schedule's micro-batches in flight chunk by chunk at each moment
        that can be its peak (``Schedule.occupancy``; only the shapes the search evaluates need
        it, the bounds use the rank totals)."""
        return schedule.occupancy(pp, m, v)

    def schedule_shapes(self, pp: int, m: int):
        """The schedules valid for (pp, m) as (row, v, in-flight counts), and the per-rank least."""
        key = (pp, m)
        table = self.memo.schedule_shapes
        if key not in table:
            shapes = [(SCHEDULES[n], v) for n, v in schedules(self.p, pp, m)]
            shapes = [(sched, v, self.in_flight(sched, v, pp, m)) for sched, v in shapes]
            least = tuple(map(min, *[f for _, _, f in shapes])) if len(shapes) > 1 else (shapes[0][2] if shapes else ())
            table[key] = (shapes, least)
        return table[key]


def _tot(counts, kinds, pre, post, attr: str) -> float:
    """The sum of ``attr`` over the layers (``counts`` of each kind), the embedding and the head."""
    return sum(n * getattr(k, attr) for n, k in zip(counts, kinds)) + getattr(pre, attr) + getattr(post, attr)


def _rerun_in_weight_pass(k: LayerCost, split: float) -> LayerCost:
    """``k`` with its recomputation run again in the weight pass of the ``split`` share of its
    backwards (each pass is its own backward call, and a checkpointed layer is remade in each,
    its replayed expert exchanges too)."""
    return replace(
        k,
        w=k.w + split * k.recompute,
        recompute=k.recompute * (1 + split),
        ep=k.ep + split * k.ep_replay,
        ep_replay=k.ep_replay * (1 + split),
    )
