"""What one candidate costs: per-layer time and memory per micro-batch, the pipeline schedule's
bubble and in-flight micro-batches, data-parallel communication, per-GPU memory.

All times are seconds on one GPU; all memory is bytes on one GPU. Every term comes from the
analysed graph (``cost_models.analyze``) and the hardware profile; nothing here knows which model or
machine it is looking at.

Modelling choices (each can be checked against the formula it names):
- GEMMs: roofline per GEMM at its local (sharded) shape, at the profile's matmul efficiency, with
  wave quantisation: 128x128 output tiles run in waves of one tile per SM, and the last wave (and
  the ragged edge tiles) leave SMs idle.
  Backward = input gradient (same FLOPs) + weight gradient (same FLOPs).
- Attention core: FLOPs at ``attention_efficiency`` of the bf16 peak; flash backward reruns the
  forward's QK^T, so it costs 2.5x the forward.
- Everything else is memory-bound: bytes moved / HBM bandwidth; backward moves about twice as much.
- Recomputation reruns the closure of the dropped tensors' producers (``BlockCost.recompute_flops``).
- TP with sequence parallelism: all-gather before and reduce-scatter after each TP region in forward
  and the mirror in backward, plus a second all-gather of each region's input in backward for the
  weight gradient (the input is saved sharded, as Korthikanti et al. count memory). Forward
  collectives and the row layers' backward gather are on the critical path; the column layers'
  backward re-gather and gradient reduce-scatter overlap the input- and weight-gradient GEMMs
  (Megatron-LM's asynchronous overlap), exposing only what is longer than those GEMMs.
- CP ring: K/V blocks move around the ring while the previous block is computed; only the part of
  each step's transfer longer than its compute is exposed. All-gather K/V: exposed.
- EP: all-to-all dispatch and combine, forward and backward; hidden behind the other micro-batch's
  compute only by DualPipeV, whose F&B chunks pair one micro-batch's forward with another's backward.
- PP: one activation send per stage boundary per micro-batch each way (bsh/t with SP); sends are
  asynchronous and overlap compute in the steady state, but lie on the fill/drain path.
- Hidden is not free: while a collective runs beside compute, its kernels take SMs and HBM
  bandwidth from the GEMMs, so every second of communication hidden behind compute costs
  ``overlap_slowdown`` seconds of compute (the hardware profile; Lee et al. 2025, arXiv 2507.03114,
  measured 18.9% average compute slowdown under overlap on H100/A100/MI250; DeepSeek-V3 gives 20 of
  132 SMs to communication). Applied to hidden TP, CP, EP, PP and DP traffic alike.
- DP: gradients all-reduced (ZeRO-0) or reduce-scattered (ZeRO-1) in fp32 once per step, overlapped
  with the last micro-batch's backward; parameters all-gathered in bf16 after the step, overlapped
  with the first forward. ZeRO-2 keeps only a gradient shard, so it reduce-scatters after every
  micro-batch; ZeRO-3 also re-gathers the parameters for every micro-batch's forward and backward
  (1.5x the volume per micro-batch); both overlapped with that micro-batch's compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache, lru_cache

from autoshard.cost_models import comm
from autoshard.cost_models.analyze import BlockCost
from autoshard.cost_models.hardware import Hardware
from autoshard.cost_models.memory import model_state_bytes
from autoshard.planner.candidates import Candidate, Problem

TILE = 128
FLASH_BACKWARD = 2.5  # backward / forward time of flash attention (recomputes QK^T)
GRAD_REDUCE_BYTES = 4  # fp32 gradient reduction
PARAM_GATHER_BYTES = 2  # bf16 parameters


# ---------------------------------------------------------------------------------------------
# placements


def _strides(c: Candidate, order: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    sizes = {"tp": c.tp, "cp": c.cp, "pp": c.pp, "dp": c.dp}
    out, stride = {}, 1
    for a in order:
        out[a] = (sizes[a], stride)
        stride *= sizes[a]
    return out


@dataclass(frozen=True, eq=False)
class Where:
    """How a group of ranks sits on the NVLink domains: what ``comm`` needs.

    Made only by ``_grid``, which keeps one object per value: identity equality
    and hashing are value equality, and cheap (these sit in the search's hottest memo keys)."""

    size: int
    per_domain: int
    domains: int

    @classmethod
    def grid(cls, axes: tuple[tuple[int, int], ...], domain: int, take: int | None = None, every: int = 1) -> Where:
        """The group spanned by ``axes`` ((size, stride) pairs, innermost first), keeping the
        first ``take`` ranks, every ``every``-th."""
        return _grid(axes, domain, take, every)

    @classmethod
    def best(cls, size: int, hw: Hardware) -> Where:
        """Consecutive ranks: the fastest any order can give this axis (a lower bound)."""
        return _grid(((size, 1),), hw.nvlink_domain, None, 1)

    def placement(self) -> comm.Placement:
        return _placement(self.size, self.per_domain, self.domains)


@cache
def _placement(size: int, per_domain: int, domains: int) -> comm.Placement:
    return _Placement(size, per_domain, domains)


@cache
def _grid(axes, domain, take, every) -> Where:
    ranks = [0]
    for size, stride in axes:
        ranks = [r + i * stride for i in range(size) for r in ranks]
    ranks = ranks[::every][:take]
    counts: dict[int, int] = {}
    for r in ranks:
        counts[r // domain] = counts.get(r // domain, 0) + 1
    value = (len(ranks), max(counts.values()), len(counts))
    if value not in _WHERE:
        _WHERE[value] = Where(*value)
    return _WHERE[value]


_WHERE: dict[tuple[int, int, int], Where] = {}  # one object per value


class _Placement(comm.Placement):
    """A Placement with its domain layout given directly."""

    def __init__(self, size: int, per_domain: int, domains: int):
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "stride", 1)
        object.__setattr__(self, "_m", per_domain)
        object.__setattr__(self, "_k", domains)

    def per_domain(self, hw: Hardware) -> int:
        return self._m

    def domains(self, hw: Hardware) -> int:
        return self._k


def placements(c: Candidate, order: tuple[str, ...] | None, hw: Hardware) -> dict[str, Where]:
    """Where each axis lands; ``order=None`` gives every axis its best case (for lower bounds).

    The expert-parallel group is the first ``ep`` of a stage's dp x cp ranks, taken in the order
    those axes are laid out; expert data parallelism is every ``ep``-th of them."""
    d = hw.nvlink_domain
    if order is None:
        best = {a: Where.best(getattr(c, a), hw) for a in ("tp", "cp", "pp", "dp", "ep")}
        return best | {"dpcp": Where.best(c.dp * c.cp, hw), "edp": Where.best(max(1, c.dp * c.cp // c.ep), hw)}
    st = _strides(c, order)
    out = {a: Where.grid((st[a],), d) for a in ("tp", "cp", "pp", "dp")}
    stage = tuple(sorted((st["cp"], st["dp"]), key=lambda x: x[1]))
    out["dpcp"] = Where.grid(stage, d)
    out["ep"] = Where.grid(stage, d, take=c.ep)
    out["edp"] = Where.grid(stage, d, every=c.ep)
    return out


# ---------------------------------------------------------------------------------------------
# per-layer costs


@dataclass(frozen=True)
class LayerCost:
    """One layer (or the embedding/output block) for one micro-batch on one GPU."""

    f: float  # forward compute
    b: float  # backward input-gradient compute (incl. attention backward and recompute)
    w: float  # backward weight-gradient compute
    recompute: float  # part of b spent recomputing
    tp: float  # TP collectives (forward + backward), exposed
    cp: float  # CP traffic exposed (forward + backward)
    ep: float  # EP all-to-all time (forward + backward)
    p2p: float  # one boundary send each way
    activation_bytes: float
    params_dense: float  # parameters this GPU holds (TP/EP applied, before ZeRO)
    params_expert: float
    transient_bytes: float  # largest short-lived buffer (gathered K/V, dispatch buffers, logits grad)
    flops_model: float  # model FLOPs (forward + 2x backward, no recompute) for MFU
    tp_total: float = 0.0  # TP collectives including the ones hidden behind GEMMs
    cp_total: float = 0.0  # CP traffic including the ring steps hidden behind attention
    slowdown: float = 0.0  # compute lost per second of communication it hides (hardware profile)

    @property
    def compute(self) -> float:
        return self.f + self.b + self.w

    def interference(self, overlap_ep: bool) -> float:
        """Compute time lost to the communication this layer hides: the hidden TP and CP traffic,
        and the EP all-to-all where the schedule overlaps it."""
        hidden = (self.tp_total - self.tp) + (self.cp_total - self.cp)
        if overlap_ep:
            hidden += min(self.compute, self.ep)
        return self.slowdown * hidden

    def time(self, overlap_ep: bool) -> float:
        """Per micro-batch critical-path time of this layer."""
        if overlap_ep:
            return max(self.compute, self.ep) + self.tp + self.cp + self.interference(True)
        return self.compute + self.ep + self.tp + self.cp + self.interference(False)


ATTENTION_HALF_LENGTH = 180  # tokens at which a flash kernel runs at half its long-sequence speed


def attention_time(flops: float, keys: float, hw: Hardware) -> float:
    """Flash attention forward time. Its speed grows with the key length each kernel call sees:
    FlashAttention-3 on H100 (head dim 128) runs at 72% of its long-sequence speed at 512 keys,
    87% at 1K and 96% at 2K (Shah et al. 2024, Fig. 5), which keys / (keys + 180) matches."""
    if flops <= 0:
        return 0.0
    return flops / (hw.peak_flops("bf16") * hw.attention_efficiency * keys / (keys + ATTENTION_HALF_LENGTH))


def gemm_time(batch: float, m: float, n: float, k: float, hw: Hardware, fp8: bool) -> float:
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    flops = 2.0 * batch * m * n * k
    tiles = batch * math.ceil(m / TILE) * math.ceil(n / TILE)
    waves = math.ceil(tiles / hw.sm_count)
    quant = (batch * m * n) / (waves * hw.sm_count * TILE * TILE)
    peak = hw.peak_flops("fp8" if fp8 else "bf16") * (hw.matmul_efficiency_fp8 if fp8 else hw.matmul_efficiency)
    elem = 1 if fp8 else 2
    traffic = batch * ((m * k + k * n) * elem + m * n * 2)
    return max(flops / (peak * quant), traffic / (hw.hbm_gbps * 1e9))


def gemm_floor(batch: float, m: float, n: float, k: float, hw: Hardware, fp8: bool) -> float:
    """A lower bound on ``gemm_time`` for every ``m``, and proportional to it: the arithmetic at
    the best wave quantisation any ``m`` allows (the ragged edge tiles along ``n`` stay), no HBM
    term. ``waves * sm_count`` is at least the tile count, so the quantisation factor of
    ``gemm_time`` never exceeds ``n / (ceil(n / TILE) * TILE)``."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    edge = n / (math.ceil(n / TILE) * TILE)
    peak = hw.peak_flops("fp8" if fp8 else "bf16") * (hw.matmul_efficiency_fp8 if fp8 else hw.matmul_efficiency)
    return 2.0 * batch * m * n * k / (peak * edge)


class LayerCosts:
    """Memoised per-layer costs of a problem.

    ``floor=True`` gives a lower bound on every time instead, one proportional to the micro-batch
    size: GEMMs by ``gemm_floor`` and collectives without their per-step latency (what is left of
    each is linear in the bytes, and every other term is linear in the tokens already). The
    search uses it to bound all micro-batch sizes of a mesh at once."""

    def __init__(self, problem: Problem, floor: bool = False):
        self.p = problem
        self.hw = replace(problem.hw, nvlink_latency_us=0.0, network_latency_us=0.0) if floor else problem.hw
        self._gemm = gemm_floor if floor else gemm_time
        self.sp = problem.forced.get("sp", True)  # sequence parallelism with TP unless pinned off
        self._layers: dict = {}

    @cache  # noqa: B019 - one instance per planning run
    def activation(self, block: int, mbs: int, tp: int, cp: int, recompute: frozenset) -> float:
        """Bytes one copy of ``block`` keeps for backward for one micro-batch."""
        return self._block(block).activation_bytes(
            mbs, self.p.seq / cp, tp=tp, sp=tp > 1 and self.sp, recompute=recompute
        )

    @cache  # noqa: B019
    def _gemms(self, block: int, mbs: int, tp: int, cp: int, fp8: bool, ep: int, experts: bool) -> tuple:
        """(forward time, column-parallel part) of the block's dense GEMMs (``experts`` False) or
        of its routed-expert GEMMs (True, the only ones EP changes)."""
        blk = self._block(block)
        hw, sl, sp = self.hw, self.p.seq / cp, tp > 1 and self.sp
        total = column = 0.0
        for g, mfn in zip(blk.gemms, blk._compiled["gemm_m"]):
            if g.experts != experts:
                continue
            m = float(mfn(mbs, sl))
            n, k, batch = g.n, g.k, g.batch
            if g.experts:
                # Experts keep whole weights (expert TP = 1); SP splits the tokens among TP ranks.
                # With EP each rank holds batch/ep experts, each receiving tokens from ep ranks.
                m = (m / tp if sp else m) * ep
                batch = batch / ep
            elif g.role in ("column", "vocab"):
                n = n / tp
            elif g.role == "row":
                k = k / tp
            use_fp8 = fp8 and g.role != "vocab" and "fp8" in hw.peak_tflops
            t = self._gemm(batch, m, n, k, hw, use_fp8)
            if use_fp8:  # quantise activations (read 2 B, write 1 B) forward and gradients backward
                t += 3 * batch * m * k / (hw.hbm_gbps * 1e9)
            total += t
            if g.role == "column" and not g.experts:
                column += t
        return total, column

    @cache  # noqa: B019
    def _rest(self, block: int, mbs: int, tp: int, cp: int) -> tuple:
        """(attention forward time, memory-bound forward time, forward FLOPs, model FLOPs)."""
        blk = self._block(block)
        hw, s = self.hw, self.p.seq
        sl, sp = s / cp, tp > 1 and self.sp
        attn = attention_time(blk.eval("flops_attention", mbs, s) / (tp * cp), s / cp, hw)
        pw_tp = blk.eval("bytes_pointwise_tp", mbs, sl)
        pw_rep = blk.eval("bytes_pointwise", mbs, sl) - pw_tp
        pointwise = (pw_tp / tp + pw_rep / (tp if sp else 1)) / (hw.hbm_gbps * 1e9)
        return attn, pointwise, blk.eval("flops", mbs, sl), 3 * (blk.eval("flops", mbs, s) / (tp * cp))

    @cache  # noqa: B019
    def compute(self, block: int, mbs: int, tp: int, cp: int, fp8: bool, recompute: frozenset, ep: int = 1) -> tuple:
        """(f, b, w, recompute_s, act_bytes, flops_model, column_gemm_s) of one copy of ``block``;
        column_gemm_s is the forward time of its column-parallel GEMMs (the backward's input- and
        weight-gradient GEMMs of those layers take as long each)."""
        blk = self._block(block)
        dense, column = self._gemms(block, mbs, tp, cp, fp8, 1, False)
        routed = self._gemms(block, mbs, tp, cp, fp8, ep, True)[0] if blk.params_experts else 0.0
        f_gemm = dense + routed
        attn, pointwise, fwd_flops, model_flops = self._rest(block, mbs, tp, cp)
        f = f_gemm + attn + pointwise
        extra = blk.recompute_fn(recompute)(mbs, self.p.seq / cp) if recompute else 0.0
        rc = f * (extra / fwd_flops) if fwd_flops else 0.0
        b = f_gemm + FLASH_BACKWARD * attn + 2 * pointwise + rc
        w = f_gemm
        act = self.activation(block, mbs, tp, cp, recompute)
        return f, b, w, rc, act, model_flops, column

    def _block(self, block: int) -> BlockCost:
        cost = self.p.cost
        if block == -1:
            return cost.pre
        if block == -2:
            return cost.post
        return cost.blocks[block]

    @cache  # noqa: B019
    def p2p(self, block: int, mbs: int, tp: int, cp: int, where_pp: Where) -> float:
        """One activation send each way across a pipeline boundary after ``block``."""
        if where_pp.size <= 1:
            return 0.0
        hw = self.hw
        boundary = 2 * self._block(block).eval("boundary", mbs, self.p.seq / cp) / (tp if tp > 1 else 1)
        span = 1 if where_pp.domains == 1 else hw.nvlink_domain
        return 2 * comm.p2p(boundary, span, hw)

    @cache  # noqa: B019
    def comm(
        self,
        block: int,
        mbs: int,
        tp: int,
        cp: int,
        ep: int,
        attention: str,
        fp8: bool,
        where_tp: Where,
        where_cp: Where,
        where_ep: Where,
    ) -> tuple:
        """(tp_exposed, tp_behind_gemms, cp_exposed, ep, transient_bytes) of one copy of ``block``.
        ``tp_behind_gemms`` is (re-gather, reduce-scatter) of the column groups' backward, which
        run while the input- and weight-gradient GEMMs compute (Megatron's overlap)."""
        blk = self._block(block)
        hw, s = self.hw, self.p.seq
        sl = s / cp
        sp = tp > 1 and self.sp
        t_tp = t_ep = regather = scatter = 0.0
        transient = 0.0
        for coll, elems_fn in blk._compiled["collectives"]:
            nbytes = 2 * float(elems_fn(mbs, sl))
            if coll.axis == "tp" and tp > 1:
                if sp:
                    one = comm.all_gather(nbytes, where_tp.placement(), hw)
                    if coll.backward:  # a column group: gather its input forward, and backward
                        # gather it again for the weight gradient (it is saved sharded, as
                        # Korthikanti et al. count memory) and reduce-scatter its gradient
                        t_tp += one
                        regather += one
                        scatter += one
                    else:  # a row: reduce-scatter forward, gather the output gradient backward
                        t_tp += 2 * one
                else:
                    t_tp += comm.all_reduce(nbytes, where_tp.placement(), hw)
            elif coll.axis == "ep" and ep > 1:
                local = nbytes / (tp if sp else 1)
                dispatch = local / 2 if fp8 else local  # DeepSeek-V3 dispatches in FP8, combines in bf16
                t_ep += comm.all_to_all(dispatch, where_ep.placement(), hw) + comm.all_to_all(
                    local, where_ep.placement(), hw
                )
                transient = max(transient, 2 * local)
        t_cp = cp_total = 0.0
        if cp > 1:
            kv_bytes = 2 * blk.eval("kv_elems", mbs, sl)
            attn_f = attention_time(blk.eval("flops_attention", mbs, s) / (tp * cp), s / cp, hw)
            if attention == "ring":
                step = comm.p2p(kv_bytes / (tp if sp else 1), 1 if where_cp.domains == 1 else hw.nvlink_domain, hw)
                fwd = (cp - 1) * max(0.0, step - attn_f / cp)
                bwd = (cp - 1) * max(0.0, 2 * step - FLASH_BACKWARD * attn_f / cp)
                t_cp = fwd + bwd
                cp_total = 3 * (cp - 1) * step
                transient = max(transient, 2 * kv_bytes)
            else:  # all-gather K/V forward, reduce-scatter their gradients backward
                full = kv_bytes * cp / (tp if sp else 1)
                t_cp = comm.all_gather(full, where_cp.placement(), hw) + comm.reduce_scatter(
                    2 * full, where_cp.placement(), hw
                )
                cp_total = t_cp
                transient = max(transient, 2 * full)
        return t_tp, (regather, scatter), (t_cp, cp_total), t_ep, transient

    def params(self, block: int, tp: int, ep: int) -> tuple[float, float]:
        """(dense, expert) parameters one GPU holds of one copy of ``block``."""
        blk = self._block(block)
        expert = blk.params_experts
        dense_tp = blk.params_tp - expert
        dense = dense_tp / tp + (blk.params - blk.params_tp)
        return dense, expert / ep

    def layer(self, block: int, c: Candidate, where: dict[str, Where]) -> LayerCost:
        key = (
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
        cached = self._layers.get(key)
        if cached is None:
            cached = self._layers[key] = self._layer(block, c, where)
        return cached

    def _layer(self, block: int, c: Candidate, where: dict[str, Where]) -> LayerCost:
        f, b, w, rc, act, flops, column = self.compute(block, c.mbs, c.tp, c.cp, c.fp8, c.recompute, c.ep)
        t_tp, (regather, scatter), (t_cp, cp_total), t_ep, transient = self.comm(
            block, c.mbs, c.tp, c.cp, c.ep, c.attention, c.fp8, where["tp"], where["cp"], where["ep"]
        )
        p2p = self.p2p(block, c.mbs, c.tp, c.cp, where["pp"])
        dense, expert = self.params(block, c.tp, c.ep)
        if block == -2:  # the logits' gradient lives next to the saved log-probabilities
            blk = self._block(block)
            transient = max(transient, blk.activation_bytes(c.mbs, self.p.seq / c.cp, tp=c.tp, sp=c.tp > 1 and self.sp))
        # the re-gather hides behind the input-gradient GEMMs, the gradient's reduce-scatter
        # behind the weight-gradient GEMMs; what is longer than they are shows
        exposed = t_tp + max(0.0, regather - column) + max(0.0, scatter - column)
        return LayerCost(
            f,
            b,
            w,
            rc,
            exposed,
            t_cp,
            t_ep,
            p2p,
            act,
            dense,
            expert,
            transient,
            flops,
            t_tp + regather + scatter,
            cp_total,
            self.hw.overlap_slowdown,
        )


# ---------------------------------------------------------------------------------------------
# schedules


@dataclass(frozen=True)
class ScheduleShape:
    """How a schedule turns per-micro-batch stage times into a step time, and how many
    micro-batches each rank holds activations for."""

    name: str
    v: int

    def chunk_rank(self, chunk: int, pp: int) -> int:
        if self.name in ("zbv", "dualpipev"):  # V shape: chunk i and 2p-1-i on rank i
            return chunk if chunk < pp else 2 * pp - 1 - chunk
        return chunk % pp

    def in_flight(self, rank: int, pp: int, m: int) -> float:
        """Micro-batches whose activations rank ``rank`` holds at its peak, in units of one
        micro-batch through all of the rank's chunks."""
        v = self.v
        if self.name == "1f1b":
            return min(m, pp - rank)
        if self.name in ("interleaved", "zero-bubble"):  # Megatron's warm-up count, plus one
            chunks = min(m * v, 2 * (pp - rank - 1) + (v - 1) * pp + 1)
            return chunks / v
        if self.name == "zbv":
            return min(m, pp)
        return min(m, pp + 1)  # dualpipev

    def bubble(self, pp: int, m: int, f: float, b: float, w: float, fb: float) -> float:
        """Pipeline fill/drain time, from per-rank per-micro-batch averages of forward ``f``,
        input-gradient ``b``, weight-gradient ``w`` and overlapped forward+backward ``fb``.
        With enough micro-batches: 1F1B (p-1)(F+B+W); interleaved /v (Narayanan et al.);
        zero-bubble, ZB-V and DualPipeV (p-1)(F+B-W)/v (ZB-H1, Qi et al.; see below). With fewer
        micro-batches than stages no schedule can keep
        every rank busy: a micro-batch still crosses all p ranks, so each missing micro-batch adds
        the share of a rank's time that interleaving cannot hide."""
        if pp == 1:
            return 0.0
        v = self.v
        t = f + b + w
        if self.name == "1f1b":
            return (pp - 1) * t
        # Zero-bubble schedules get ZB-H1's (p-1)(F+B-W): the lower ZB-H2, ZB-V and DualPipe
        # bubbles need "optimizer post-validation" to skip the step-end synchronisation (Qi et al.
        # lose ~8% without it), and torch.distributed.pipelining synchronises at every step.
        # DualPipeV's gain is its overlap of one micro-batch's communication with another's compute.
        fill = (pp - 1) * (t if self.name == "interleaved" else max(0.0, f + b - w)) / v
        return fill + max(0, pp - m) * max(0.0, t - fill / max(1, pp - 1))

    @property
    def overlaps_ep(self) -> bool:
        return self.name == "dualpipev"


# ---------------------------------------------------------------------------------------------
# data parallelism


def dp_comm(params_dense: float, params_expert: float, c: Candidate, where: dict[str, Where], hw: Hardware) -> dict:
    """Per-step data-parallel communication of one GPU holding these parameters:
    ``after_backward`` (gradient reduction), ``before_forward`` (parameter gather),
    ``per_microbatch`` (ZeRO-3's re-gathers and reductions)."""
    out = {"after_backward": 0.0, "before_forward": 0.0, "per_microbatch": 0.0}
    for params, key in ((params_dense, "dpcp"), (params_expert, "edp")):
        group = where[key]
        if group.size <= 1 or params <= 0:
            continue
        place = group.placement()
        grads = params * GRAD_REDUCE_BYTES
        weights = params * PARAM_GATHER_BYTES
        if c.zero == 0:
            out["after_backward"] += comm.all_reduce(grads, place, hw)
        elif c.zero == 1:  # gradients accumulate unsharded, reduced once
            out["after_backward"] += comm.reduce_scatter(grads, place, hw)
            out["before_forward"] += comm.all_gather(weights, place, hw)
        elif c.zero == 2:  # only a shard of the gradients is kept: reduce after every micro-batch
            out["per_microbatch"] += comm.reduce_scatter(grads, place, hw)
            out["before_forward"] += comm.all_gather(weights, place, hw)
        else:  # ZeRO-3: parameters re-gathered for forward and backward of every micro-batch
            out["per_microbatch"] += 2 * comm.all_gather(weights, place, hw) + comm.reduce_scatter(grads, place, hw)
    return out


def state_bytes(params_dense: float, params_expert: float, c: Candidate) -> dict[str, float]:
    """Model states per GPU: bf16 weights, fp32 gradients (accumulated over micro-batches and
    reduced in fp32), fp32 master weights and Adam moments; ZeRO shards over the dp x cp ranks
    (dense layers) or the expert-data-parallel ranks (routed experts)."""
    return _states(params_dense, params_expert, c.zero, c.dp * c.cp, c.ep)


@lru_cache(maxsize=65536)
def _states(params_dense: float, params_expert: float, zero: int, dpcp: int, ep: int) -> dict[str, float]:
    dense = model_state_bytes(params_dense, zero, dpcp, GRAD_REDUCE_BYTES)
    expert = model_state_bytes(params_expert, zero, max(1, dpcp // ep), GRAD_REDUCE_BYTES)
    return {k: dense[k] + expert[k] for k in dense}


def state_total(params_dense: float, params_expert: float, zero: int, dpcp: int, ep: int) -> float:
    return _states(params_dense, params_expert, zero, dpcp, ep)["total"]
