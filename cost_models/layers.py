"""What one layer costs: per-layer time and memory for one micro-batch on one GPU, under given
parallel degrees and placements.

All times are seconds on one GPU; all memory is bytes on one GPU. Every term comes from the
analysed graph (``cost_models.analyze``) and the hardware profile; nothing here knows which model or
machine it is looking at, nor what a plan is.

Modelling choices (each can be checked against the formula it names):
- GEMMs: roofline per GEMM at its local (sharded) shape, at the profile's matmul efficiency, with
  wave quantisation (``compute.gemm_time``). Backward = input gradient (same FLOPs) + weight
  gradient (same FLOPs).
- Attention core: FLOPs at ``attention_efficiency`` of the bf16 peak; flash backward reruns the
  forward's QK^T, so it costs 2.5x the forward (``compute.attention_time``; the profile's
  ``attention_backward`` and ``attention_backward_half_length``, where a machine's kernel differs:
  CPU attention's backward is slower, most of all on short sequences).
- Everything else is memory-bound: bytes moved / HBM bandwidth (at the profile's
  ``pointwise_efficiency``); backward moves about twice as much.
- Per-op host time (the profile's ``op_overhead_us``, 0 on GPUs, where launches run ahead of the
  device): each traced op of a layer costs it once forward and twice backward
  (``LayerCosts.op_overhead``).
- Recomputation reruns the closure of the dropped tensors' producers (``BlockCost.recompute_flops``),
  and of those of the tensors kept as FP8 copies (``ModelCost.fp8_saved``); where the host shows,
  each traced op of a recomputed layer adds the profile's ``checkpoint_op_overhead_us`` (the
  checkpoint's policy sees every op of its forward and replay).
- TP with sequence parallelism: all-gather before and reduce-scatter after each TP region in forward
  and the mirror in backward, plus a second all-gather of each region's input in backward for the
  weight gradient (the input is saved sharded, as Korthikanti et al. count memory). Forward
  collectives and the row layers' backward gather are on the critical path; the column layers'
  backward re-gather and gradient reduce-scatter overlap the input- and weight-gradient GEMMs
  (Megatron-LM's asynchronous overlap), exposing only what is longer than those GEMMs.
- CP ring: K/V blocks move around the ring while the previous block is computed; only the part of
  each step's transfer longer than its compute is exposed. Backward the block travels with its
  gradients, accumulated and sent in fp32, and those take one more step home, exposed
  (``runtime.ring_attention``). All-gather K/V: exposed.
- EP: all-to-all dispatch and combine, forward and backward, over the expert-parallel group
  folded from a stage's tp x cp x dp ranks; each rank sends its 1/tp of the routed tokens (x
  top-k x hidden) and its experts take tokens from ep ranks. With SP that is the rank's own
  slice of the sequence (the router runs on it) and nothing else crosses TP around the experts;
  without SP it is the rank's share of every expert's rows, and the shares are put back together
  by an all-reduce of the routed rows over TP, forward and backward. Shared experts are dense
  MLPs (column and row), priced as those. Hidden behind the other micro-batch's compute only by
  a schedule that overlaps it (``Schedule.overlaps_ep``: DualPipeV, whose F&B chunks pair one
  micro-batch's forward with another's backward).
- PP: one activation send per stage boundary per micro-batch each way (bsh/t with SP).
- What the program really hides: the profile's ``overlap`` shares (``Hardware.overlap_share``,
  measured by ``autoshard calibrate``) say per kind (tp, cp, ep) how much of what the overlaps
  above hide the emitted program hides on that machine; the rest is exposed (exposed + (1 -
  share) x hidden), and only what stays hidden slows compute.
- Hidden is not free: while a collective runs beside compute, its kernels take SMs and HBM
  bandwidth from the GEMMs, so every second of communication hidden behind compute costs
  ``overlap_slowdown`` seconds of compute (the hardware profile; Lee et al. 2025, arXiv 2507.03114,
  measured 18.9% average compute slowdown under overlap on H100/A100/MI250; DeepSeek-V3 gives 20 of
  132 SMs to communication).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from autoshard.cost_models import comm
from autoshard.cost_models.analyze import BlockCost, ModelCost
from autoshard.cost_models.comm import Where
from autoshard.cost_models.compute import FLASH_BACKWARD, attention_time, gemm_floor, gemm_time
from autoshard.cost_models.hardware import Hardware
from autoshard.ir.fp8 import SAVED_BYTES as FP8_SAVED_BYTES

TILE_ELEMS = 128 * 128  # elements of a weight's FP8 scaling block

PRE, POST = -1, -2  # block indices of the embedding and of the output head with the loss


def kv_gathers(recompute: frozenset) -> int:
    """All-gathers of K/V per micro-batch under the all-gather CP variant: one in the forward, and
    in a checkpointed layer (``recompute`` not empty) one more when its backward replays the
    forward to remake what the attention's backward reads (the attention saves its inputs, the
    gathered K/V, and a checkpoint keeps no saved input: a selective checkpoint caches ops'
    outputs, and the gather's output is no kept kind)."""
    return 2 if recompute else 1


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
    held_bytes: float = 0.0  # held from a split backward's input pass to its weight pass (``held_for_weights``)
    ep_replay: float = 0.0  # part of ``ep`` a recomputation spends exchanging tokens again (``replayed_payload``)
    ep_share: float = 1.0  # share of the overlappable EP all-to-all the program hides (``Hardware.overlap``)

    @property
    def compute(self) -> float:
        return self.f + self.b + self.w

    def interference(self, overlap_ep: bool) -> float:
        """Compute time lost to the communication this layer hides: the hidden TP and CP traffic,
        and the EP all-to-all where the schedule overlaps it."""
        hidden = (self.tp_total - self.tp) + (self.cp_total - self.cp)
        if overlap_ep:
            hidden += self.ep_hidden
        return self.slowdown * hidden

    @property
    def ep_hidden(self) -> float:
        """The EP all-to-all a schedule that overlaps it hides: as much as compute covers, times
        the share the program really hides (``ep_share``)."""
        return self.ep_share * min(self.compute, self.ep)

    @property
    def ep_unhidden(self) -> float:
        """The part of the all-to-all an overlapping schedule would hide that the program does not."""
        return min(self.compute, self.ep) - self.ep_hidden

    def time(self, overlap_ep: bool) -> float:
        """Per micro-batch critical-path time of this layer."""
        if overlap_ep:
            both = max(self.compute, self.ep) if self.ep_share == 1 else self.compute + self.ep - self.ep_hidden
            return both + self.tp + self.cp + self.interference(True)
        return self.compute + self.ep + self.tp + self.cp + self.interference(False)


class LayerCosts:
    """Memoised per-layer costs of one analysed model at sequence length ``seq`` on ``hw``, with
    sequence parallelism alongside TP where ``sp``.

    ``floor=True`` gives a lower bound on every time instead, one proportional to the micro-batch
    size: GEMMs by ``gemm_floor`` and collectives without their per-step latency (what is left of
    each is linear in the bytes, and every other term is linear in the tokens already). The
    search uses it to bound all micro-batch sizes of a mesh at once."""

    def __init__(self, cost: ModelCost, seq: int, hw: Hardware, sp: bool, floor: bool = False):
        self.cost = cost
        self.seq = seq
        self.hw = hw.without_latency() if floor else hw
        self._gemm = gemm_floor if floor else gemm_time
        self.sp = sp
        self._layers: dict = {}
        self._params: dict = {}  # (block, tp, ep) -> ``params``

    def block(self, block: int) -> BlockCost:
        """The analysed block: a layer kind's index, ``PRE`` or ``POST``."""
        if block == PRE:
            return self.cost.pre
        if block == POST:
            return self.cost.post
        return self.cost.blocks[block]

    @cache  # noqa: B019 - one instance per planning run
    def activation(self, block: int, mbs: int, tp: int, cp: int, recompute: frozenset, fp8: tuple = ()) -> float:
        """Bytes one copy of ``block`` keeps for backward for one micro-batch, with the matmuls of
        the ``fp8`` kinds keeping FP8 copies of their inputs."""
        saved = self.fp8_saved(recompute, fp8, tp)
        return self.block(block).activation_bytes(
            mbs, self.seq / cp, tp=tp, sp=tp > 1 and self.sp, recompute=recompute, fp8=self._fp8(fp8), fp8_saved=saved
        )

    @cache  # noqa: B019
    def gathered_kv_kept(self, block: int, mbs: int, tp: int, cp: int, attention: str, recompute: frozenset) -> float:
        """Bytes the all-gather CP variant keeps per micro-batch beyond the local K/V the saved
        tensors count: without recomputation the attention keeps the gathered K/V (``cp`` shards)
        for its backward; a checkpointed layer keeps none of them and gathers again
        (``kv_gathers``)."""
        if cp == 1 or attention == "ring" or recompute:
            return 0.0
        return self.gathered_kv(block, mbs, tp, cp) * (cp - 1) / cp

    def gathered_kv(self, block: int, mbs: int, tp: int, cp: int) -> float:
        """Bytes of the K/V one GPU all-gathers over CP for one micro-batch (``cp`` shards; TP
        splits them where sequence parallelism is on)."""
        sp = tp > 1 and self.sp
        return 2 * self.block(block).eval("kv_elems", mbs, self.seq / cp) * cp / (tp if sp else 1)

    @cache  # noqa: B019
    def held_for_weights(self, block: int, mbs: int, tp: int, cp: int) -> float:
        """Bytes one copy of ``block`` holds for one micro-batch from a split backward's
        input-gradient pass to its deferred weight-gradient pass (ZB1P, ZB-V, DualPipeV) beside
        its activations: the gradients of its weighted matmuls' outputs, which torch's input pass
        keeps for the weight pass, in the compute precision at this rank's shard (a column's
        outputs 1/tp, a row's whole, the routed rows 1/tp), and those of the other ops that read
        a weight (a norm's scale: its output, at the residual stream's split)."""
        blk = self.block(block)
        grads = 0.0
        for g, mfn in zip(blk.gemms, blk._compiled["gemm_m"]):
            split = tp if g.experts or g.role == "vocab" else g.out_split(tp) if g.role == "column" else 1
            grads += 2 * float(mfn(mbs, self.seq / cp)) * g.n * g.batch / split
        sp = tp > 1 and self.sp
        for t in blk.weighted_outputs:
            grads += t.bytes(mbs, self.seq / cp) / t.split(tp, sp)
        return grads

    @cache  # noqa: B019
    def fp8_saved(self, recompute: frozenset, fp8: tuple, tp: int) -> frozenset:
        """The kept categories selective recomputation keeps as FP8 copies (``ModelCost.fp8_saved``)."""
        return self.cost.fp8_saved(recompute, self._fp8(fp8), tp=tp, sp=tp > 1 and self.sp)

    def _fp8(self, fp8: tuple) -> tuple:
        """The FP8 kinds this machine runs in FP8 (none without FP8 tensor cores)."""
        return fp8 if "fp8" in self.hw.peak_tflops else ()

    @cache  # noqa: B019
    def _gemms(self, block: int, mbs: int, tp: int, cp: int, fp8: tuple, ep: int, experts: bool) -> tuple:
        """(forward time, column-parallel part, input-gradient pass, weight-gradient pass) of the
        block's dense GEMMs (``experts`` False) or of its routed-expert GEMMs (True, the only ones
        EP changes); each pass's quantisation traffic included where the GEMM runs in FP8."""
        blk = self.block(block)
        hw, sl = self.hw, self.seq / cp
        total = column = dgrad = wgrad = 0.0
        for g, mfn in zip(blk.gemms, blk._compiled["gemm_m"]):
            if g.experts != experts:
                continue
            m = float(mfn(mbs, sl))
            n, k, batch = g.n, g.k, g.batch
            if g.experts:
                # Experts keep whole weights (expert TP = 1). The routed tokens are split among
                # the TP ranks: SP splits them, and without it the expert-parallel pass gives each
                # TP rank its share of every expert's rows (with or without EP; ``comm``). Each
                # rank holds batch/ep experts, each receiving tokens from ep ranks.
                m = m / tp * ep
                batch = batch / ep
            elif g.role in ("column", "vocab"):
                n = n / g.out_split(tp)
            elif g.role == "row":
                k = k / tp
            use_fp8 = g.kind in self._fp8(fp8)
            t = self._gemm(batch, m, n, k, hw, use_fp8)
            q_f = q_b = q_w = 0.0
            if use_fp8:
                # quantisation traffic (autoshard.runtime.fp8), bytes read + written per element:
                # forward, the input's 1x128 tiles (bf16 in, e4m3 out: 3) and the weight's
                # tiles; input gradient, the output gradient's 1x128 tiles; weight gradient, the
                # output gradient's 128x1 tiles and the saved FP8 input re-tiled. The weight's
                # 128x128 blocks are quantised once per step (kept: ``fp8_weight_bytes``), which is
                # left out here as negligible against a step's micro-batches.
                bw = hw.hbm_gbps * 1e9
                q_f = batch * 3 * m * k / bw
                q_b = batch * 3 * m * n / bw
                q_w = batch * (3 * m * n + 3 * m * k) / bw
            total += t + q_f
            dgrad += t + q_b
            wgrad += t + q_w
            if g.role == "column" and not g.experts:
                column += t + q_f
        return total, column, dgrad, wgrad

    @cache  # noqa: B019
    def fp8_weight_bytes(self, block: int, tp: int, ep: int, fp8: tuple) -> float:
        """Bytes of the FP8 copies of ``block``'s weights that run in FP8 (``fp8`` kinds) on one
        GPU, kept for a whole step (``autoshard.runtime.fp8``): 1 byte per element and one fp32
        scale per 128x128 block, at the TP and EP shard's size."""
        total = 0.0
        for g in self.block(block).gemms:
            if g.kind not in self._fp8(fp8):
                continue
            split = ep if g.experts else g.weight_split(tp)
            total += g.n * g.k * g.batch / split
        return total * (1 + 4 / TILE_ELEMS)

    def _attention_flops(self, blk, mbs: int, tp: int, cp: int) -> float:
        """Forward FLOPs of ``blk``'s attention core on one GPU: CP divides all of it, TP the part
        it splits by heads (an attention TP leaves whole runs whole on every TP rank)."""
        whole = blk.eval("flops_attention_whole", mbs, self.seq)
        return (blk.eval("flops_attention", mbs, self.seq) - whole) / (tp * cp) + whole / cp

    @cache  # noqa: B019
    def _rest(self, block: int, mbs: int, tp: int, cp: int) -> tuple:
        """(attention forward time, memory-bound forward time, forward FLOPs, model FLOPs)."""
        blk = self.block(block)
        hw, s = self.hw, self.seq
        sl, sp = s / cp, tp > 1 and self.sp
        attn = self._attention(block, mbs, tp, cp)
        pw_tp = blk.eval("bytes_pointwise_tp", mbs, sl)
        pw_rep = blk.eval("bytes_pointwise", mbs, sl) - pw_tp
        pointwise = (pw_tp / tp + pw_rep / (tp if sp else 1)) / (hw.hbm_gbps * 1e9 * hw.pointwise_efficiency)
        return attn, pointwise, blk.eval("flops", mbs, sl), 3 * (blk.eval("flops", mbs, s) / (tp * cp))

    def _attention(self, block: int, mbs: int, tp: int, cp: int, backward: bool = False) -> float:
        """Forward (or backward) time of ``block``'s attention core on one GPU."""
        blk = self.block(block)
        flops = self._attention_flops(blk, mbs, tp, cp)
        scores = flops * blk.scores_per_attention_flop
        return attention_time(flops, self.seq / cp, self.hw, backward=backward, scores=scores)

    def _attention_backward(self, block: int, mbs: int, tp: int, cp: int) -> float:
        """Backward time of ``block``'s attention core on one GPU."""
        return self._attention(block, mbs, tp, cp, backward=True)

    @cache  # noqa: B019
    def compute(self, block: int, mbs: int, tp: int, cp: int, fp8: tuple, recompute: frozenset, ep: int = 1) -> tuple:
        """(f, b, w, recompute_s, act_bytes, flops_model, column_gemm_s) of one copy of ``block``;
        column_gemm_s is the forward time of its column-parallel GEMMs (the backward's input- and
        weight-gradient GEMMs of those layers take as long each)."""
        blk = self.block(block)
        dense, column, dense_b, dense_w = self._gemms(block, mbs, tp, cp, fp8, 1, False)
        routed = self._gemms(block, mbs, tp, cp, fp8, ep, True) if blk.params_experts else (0.0,) * 4
        f_gemm = dense + routed[0]
        attn, pointwise, fwd_flops, model_flops = self._rest(block, mbs, tp, cp)
        ops = self.op_overhead(block)
        f = f_gemm + attn + pointwise + ops
        # the producers of what is kept as FP8 copies rerun too (their outputs are not kept)
        rerun = recompute | self.fp8_saved(recompute, fp8, tp)
        extra = blk.recompute_fn(rerun)(mbs, self.seq / cp) if recompute else 0.0
        rc = f * (extra / fwd_flops) if fwd_flops else 0.0
        if recompute and self._selective(block, recompute, rerun != recompute, tp > 1 or cp > 1 or ep > 1):
            rc += self._ops(block) * self.hw.checkpoint_op_overhead_us * 1e-6  # the policy's host time
        attn_b = self._attention_backward(block, mbs, tp, cp)
        b = dense_b + routed[2] + attn_b + 2 * pointwise + 2 * ops + rc
        w = dense_w + routed[3]
        act = self.activation(block, mbs, tp, cp, recompute, fp8)
        return f, b, w, rc, act, model_flops, column

    @cache  # noqa: B019
    def op_overhead(self, block: int) -> float:
        """Forward seconds of host time per op (the profile's ``op_overhead_us``) over the
        block's traced operations, whatever their size; the backward runs about two ops per
        forward op. TP and CP leave the count as it is: each rank runs every op on its shard."""
        if not self.hw.op_overhead_us:
            return 0.0
        return self._ops(block) * self.hw.op_overhead_us * 1e-6

    def _selective(self, block: int, recompute: frozenset, fp8_kept: bool, collectives: bool) -> bool:
        """Whether a layer recomputing ``recompute`` runs under the selective checkpoint's policy,
        which sees every op of its forward and replay: where it keeps some of its own outputs (a
        category it has and does not recompute, FP8 copies) or its collectives'. A layer keeping
        nothing runs under plain checkpointing (``runtime.checkpoint.Checkpoint``)."""
        return fp8_kept or collectives or bool(set(self.block(block).categories) - recompute)

    def _ops(self, block: int) -> int:
        """The block's traced operations."""
        return self.block(block).traced_ops

    @cache  # noqa: B019
    def p2p(self, block: int, mbs: int, tp: int, cp: int, where_pp: Where) -> float:
        """One activation send each way across a pipeline boundary after ``block``."""
        if where_pp.size <= 1:
            return 0.0
        hw = self.hw
        boundary = self.boundary_bytes(block, mbs, tp, cp)
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
        fp8: tuple,
        where_tp: Where,
        where_cp: Where,
        where_ep: Where,
        recompute: frozenset = frozenset(),
    ) -> tuple:
        """(tp_exposed, tp_behind_gemms, cp_exposed, ep, transient_bytes, ep_replayed) of one copy of
        ``block``: ``ep_replayed`` is the part of ``ep`` its recomputation exchanges again.
        ``tp_behind_gemms`` is (re-gather, reduce-scatter) of the column groups' backward, which
        run while the input- and weight-gradient GEMMs compute (Megatron's overlap). Under
        recomputation (``recompute`` not empty) the all-gather CP variant gathers K/V twice
        (``kv_gathers``); the bounds price none, a floor."""
        blk = self.block(block)
        sent = [(coll, 2 * float(elems_fn(mbs, self.seq / cp))) for coll, elems_fn in blk._compiled["collectives"]]
        t_tp, regather, scatter = self._tp_exchanges(sent, tp, where_tp)
        replays = blk.replayed_exchanges(recompute)
        t_ep, ep_replay, ep_transient = self._ep_exchanges(sent, replays, tp, ep, fp8, where_ep)
        t_cp, cp_total, cp_transient = self._cp_exchanges(block, mbs, tp, cp, attention, where_cp, recompute)
        transient = max(ep_transient, cp_transient)
        return t_tp, (regather, scatter), (t_cp, cp_total), t_ep + ep_replay, transient, ep_replay

    def _tp_exchanges(self, sent: list[tuple], tp: int, where_tp: Where) -> tuple[float, float, float]:
        """(exposed, re-gather, reduce-scatter) seconds of the TP collectives among ``sent``
        ((collective, bytes) of one copy of a block); the last two are the column groups'
        backward, which ``comm`` says run behind the gradient GEMMs."""
        hw = self.hw
        sp = tp > 1 and self.sp
        wait = hw.blocking_wait_us * 1e-6  # each blocking collective, where ranks are time-sliced
        t_tp = regather = scatter = routed = 0.0
        for coll, nbytes in sent:
            routed += nbytes if coll.kind == "all_to_all" else 0.0
            if coll.axis == "tp" and tp > 1:
                if sp:
                    one = comm.all_gather(nbytes, where_tp.placement(), hw) + wait
                    if coll.backward:  # a column group: gather its input forward, and backward
                        # gather it again for the weight gradient (it is saved sharded, as
                        # Korthikanti et al. count memory) and reduce-scatter its gradient
                        t_tp += one
                        regather += one
                        scatter += one
                    else:  # a row: reduce-scatter forward, gather the output gradient backward
                        t_tp += 2 * one
                else:
                    t_tp += comm.all_reduce(nbytes, where_tp.placement(), hw) + wait
        if tp > 1 and not sp and routed:
            # Without SP the routed rows (tokens x top-k) are the same on every TP rank: the
            # expert-parallel pass gives each rank its share of every expert's rows and puts the
            # shares back together by an all-reduce of the rows (zeros outside a rank's share);
            # backward, the rows' gradient is all-reduced the same way (copy_to_tp before the share)
            t_tp += 2 * (comm.all_reduce(routed, where_tp.placement(), hw) + wait)
        return t_tp, regather, scatter

    def _ep_exchanges(
        self, sent: list[tuple], replays: tuple, tp: int, ep: int, fp8: tuple, where_ep: Where
    ) -> tuple[float, float, float]:
        """(seconds, the part of them a recomputation exchanges again, transient bytes) of the
        expert-parallel all-to-alls among ``sent``: dispatch and combine, forward and backward;
        ``replays`` says per exchange whose dispatch and combine are replayed."""
        t_ep = ep_replay = transient = 0.0
        ep_seen = 0
        wait = self.hw.blocking_wait_us * 1e-6  # each all-to-all, where ranks are time-sliced
        for coll, nbytes in sent:
            if coll.axis == "ep" and ep > 1:
                again, combine_again = replays[ep_seen]
                ep_seen += 1
                place = where_ep.placement()
                if coll.kind == "weights":  # this rank's rows of the stack: weights forward, gradients back
                    one = comm.all_to_all(nbytes / ep, place, self.hw) + wait
                    t_ep += 2 * one
                    ep_replay += one * again
                    transient = max(transient, nbytes / ep)
                    continue
                dispatch, local = self._exchange(nbytes, tp, fp8)
                there = comm.all_to_all(dispatch, place, self.hw) + wait
                back = comm.all_to_all(local, place, self.hw) + wait
                t_ep += 2 * (there + back)
                ep_replay += there * again + back * combine_again
                transient = max(transient, 2 * local)
        return t_ep, ep_replay, transient

    def _cp_exchanges(
        self, block: int, mbs: int, tp: int, cp: int, attention: str, where_cp: Where, recompute: frozenset
    ) -> tuple[float, float, float]:
        """(exposed seconds, total seconds, transient bytes) of the K/V exchanges of context
        parallelism for one copy of ``block``."""
        if cp == 1:
            return 0.0, 0.0, 0.0
        blk, hw, s = self.block(block), self.hw, self.seq
        sp = tp > 1 and self.sp
        kv_bytes = 2 * blk.eval("kv_elems", mbs, s / cp)
        attn_f = self._attention(block, mbs, tp, cp)
        if attention == "ring":
            # forward: cp - 1 steps of the K/V block, each behind a block's attention; backward:
            # the block and its gradients (accumulated, and sent, in fp32: twice its bytes)
            # cp - 1 steps behind a block's backward, then the gradients alone home, exposed
            span = 1 if where_cp.domains == 1 else hw.nvlink_domain
            kvb = kv_bytes / (tp if sp else 1)
            step = comm.p2p(kvb, span, hw)
            fwd = (cp - 1) * max(0.0, step - attn_f / cp)
            both, home = comm.p2p(3 * kvb, span, hw), comm.p2p(2 * kvb, span, hw)
            bwd = (cp - 1) * max(0.0, both - self._attention_backward(block, mbs, tp, cp) / cp) + home
            total = (cp - 1) * (step + both) + home
            # what the program does not hide of the hidden part is exposed too
            exposed = fwd + bwd + (1 - hw.overlap_share("cp")) * (total - fwd - bwd)
            return exposed, total, 2 * kv_bytes
        # all-gather K/V forward (``kv_gathers``), reduce-scatter their gradients (same dtype) backward
        full = self.gathered_kv(block, mbs, tp, cp)
        t_cp = kv_gathers(recompute) * comm.all_gather(full, where_cp.placement(), hw) + comm.reduce_scatter(
            full, where_cp.placement(), hw
        )
        return t_cp, t_cp, 2 * full

    def _exchange(self, nbytes: float, tp: int, fp8: tuple) -> tuple[float, float]:
        """(dispatch, combine) bytes one GPU sends for an expert-parallel exchange of ``nbytes``
        routed rows (tokens x top-k x hidden in the compute precision): one dispatch, each TP
        rank its share, and its combine, the same size, forward; backward, the combine's
        gradient goes the dispatch's way and the dispatch's gradient the combine's. With the
        experts' matmuls in FP8 both transfers toward the experts go in FP8 (1 byte and a 4-byte
        scale per 128 instead of 2 bytes), both toward the routing ranks in bf16 (DeepSeek-V3,
        arXiv 2412.19437 section 3.3.2; autoshard.runtime.moe)."""
        local = nbytes / tp
        return (local * FP8_SAVED_BYTES / 2 if "experts" in self._fp8(fp8) else local), local

    @cache  # noqa: B019
    def matmul_flops(self, block: int, mbs: int, tp: int, cp: int, recompute: frozenset) -> tuple:
        """(forward, backward, recompute) matmul-class FLOPs one GPU runs for one copy of ``block``
        and one micro-batch (what a FLOP counter counts): the products at this rank's share (TP
        divides the sharded ones and the routed rows, TP x CP the attention core it splits (CP
        alone one it leaves whole), the sequence its CP shard); backward twice the forward, the
        attention core's 2.5 times (the flash kernel recomputes the scores); recomputation its
        rerun products, the producers of the FP8 copies kept included."""
        blk = self.block(block)
        s, sl = self.seq, self.seq / cp

        def local(fns) -> float:
            attn, split, whole, attn_whole = fns
            core = float(attn(mbs, s)) / (tp * cp) + float(attn_whole(mbs, s)) / cp
            return core + float(split(mbs, sl)) / tp + float(whole(mbs, sl))

        fns = blk._compiled["matmul"]
        attn = float(fns[0](mbs, s)) / (tp * cp) + float(fns[3](mbs, s)) / cp
        forward = local(fns)
        backward = 2 * (forward - attn) + FLASH_BACKWARD * attn
        rerun = local(blk.recompute_matmul_fns(recompute)) if recompute else 0.0
        return forward, backward, rerun

    @cache  # noqa: B019
    def payload(
        self,
        block: int,
        mbs: int,
        tp: int,
        cp: int,
        ep: int,
        attention: str,
        fp8: tuple,
        recompute: frozenset = frozenset(),
    ) -> tuple[tuple[str, str, float], ...]:
        """The collectives one copy of ``block`` runs per micro-batch, forward and backward, on one
        GPU, as (axis, kind, bytes handed over): an all-reduce's buffer, an all-gather's gathered
        size, a reduce-scatter's size before scattering, an all-to-all's or a send's bytes sent.
        The same transfers ``comm`` prices."""
        blk = self.block(block)
        sl = self.seq / cp
        sp = tp > 1 and self.sp
        out: dict[tuple[str, str], float] = {}

        def add(axis: str, kind: str, nbytes: float) -> None:
            out[(axis, kind)] = out.get((axis, kind), 0.0) + nbytes

        routed = 0.0
        for coll, elems_fn in blk._compiled["collectives"]:
            nbytes = 2 * float(elems_fn(mbs, sl))
            routed += nbytes if coll.kind == "all_to_all" else 0.0
            if coll.axis == "tp" and tp > 1:
                if sp and coll.backward:  # a column group: gather forward, again backward, scatter its gradient
                    add("tp", "all_gather", 2 * nbytes)
                    add("tp", "reduce_scatter", nbytes)
                elif sp:  # a row: scatter forward, gather the output gradient backward
                    add("tp", "reduce_scatter", nbytes)
                    add("tp", "all_gather", nbytes)
                else:
                    add("tp", "all_reduce", nbytes)
            elif coll.axis == "ep" and ep > 1 and coll.kind == "weights":
                add("ep", "all_to_all", 2 * nbytes / ep)
            elif coll.axis == "ep" and ep > 1:
                dispatch, local = self._exchange(nbytes, tp, fp8)
                add("ep", "all_to_all", 2 * (dispatch + local))
        if tp > 1 and not sp and routed:
            add("tp", "all_reduce", 2 * routed)
        if cp > 1:
            kv_bytes = 2 * blk.eval("kv_elems", mbs, sl)
            if attention == "ring":  # K/V forward; K/V with their fp32 gradients backward, then those home
                add("cp", "send", (4 * cp - 2) * kv_bytes / (tp if sp else 1))
            else:
                full = self.gathered_kv(block, mbs, tp, cp)
                add("cp", "all_gather", kv_gathers(recompute) * full)
                add("cp", "reduce_scatter", full)
        for axis, kind, nbytes in self.replayed_payload(block, mbs, tp, cp, ep, fp8, recompute):
            add(axis, kind, nbytes)
        return tuple((axis, kind, n) for (axis, kind), n in out.items())

    def replayed_payload(
        self, block: int, mbs: int, tp: int, cp: int, ep: int, fp8: tuple, recompute: frozenset
    ) -> tuple[tuple[str, str, float], ...]:
        """The transfers one recomputation of ``block`` runs again (``payload``'s form): the
        expert-parallel exchanges whose outputs the rerun ops read
        (``BlockCost.replayed_exchanges``). ``payload`` counts one recomputation; a split
        backward's weight pass runs another."""
        if ep == 1 or not recompute:
            return ()
        blk = self.block(block)
        sl = self.seq / cp
        total = 0.0
        exchanges = [(c, f) for c, f in blk._compiled["collectives"] if c.axis == "ep"]
        for (coll, elems_fn), (again, combine_again) in zip(exchanges, blk.replayed_exchanges(recompute)):
            if coll.kind == "weights":
                total += 2 * float(elems_fn(mbs, sl)) / ep * again
                continue
            dispatch, local = self._exchange(2 * float(elems_fn(mbs, sl)), tp, fp8)
            total += dispatch * again + local * combine_again
        return (("ep", "all_to_all", total),) if total else ()

    def boundary_bytes(self, block: int, mbs: int, tp: int, cp: int) -> float:
        """Bytes of the activation a pipeline boundary after ``block`` sends, one micro-batch."""
        return 2 * self.block(block).eval("boundary", mbs, self.seq / cp) / (tp if tp > 1 else 1)

    def largest_param(self, block: int, tp: int, ep: int) -> float:
        """Elements of the largest parameter one GPU holds of ``block`` (at its TP or EP shard): its
        gradient's transient in backward is the largest (the compute-precision gradient, and its
        fp32 copy accumulated into the fp32 gradient)."""
        blk = self.block(block)
        weights = [g.n * g.k * g.batch / ep if g.experts else g.n * g.k / g.weight_split(tp) for g in blk.gemms]
        if not blk.gemms:  # an embedding: its table, split over TP where it is vocabulary-parallel
            weights.append(blk.params_tp / tp + (blk.params - blk.params_tp))
        return max(weights, default=0.0)

    def params(self, block: int, tp: int, ep: int) -> tuple[float, float]:
        """(dense, expert) parameters one GPU holds of one copy of ``block``."""
        key = (block, tp, ep)
        if key not in self._params:
            self._params[key] = self._params_of(block, tp, ep)
        return self._params[key]

    def _params_of(self, block: int, tp: int, ep: int) -> tuple[float, float]:
        blk = self.block(block)
        expert = blk.params_experts
        dense_tp = blk.params_tp - expert
        dense = dense_tp / tp + (blk.params - blk.params_tp)
        # key/value heads fewer than tp: their weights are whole on every rank, not 1/tp
        dense += sum(g.n * g.k * (1 - 1 / tp) for g in blk.gemms if g.weight_split(tp) == 1 and g.heads)
        return dense, expert / ep

    def layer(
        self,
        block: int,
        mbs: int,
        tp: int,
        cp: int,
        ep: int,
        fp8: tuple,
        recompute: frozenset,
        attention: str,
        where_tp: Where,
        where_cp: Where,
        where_ep: Where,
        where_pp: Where,
    ) -> LayerCost:
        """Everything one copy of ``block`` costs for one micro-batch of ``mbs`` sequences."""
        key = (block, mbs, tp, cp, ep, fp8, recompute, attention, where_tp, where_cp, where_ep, where_pp)
        cached = self._layers.get(key)
        if cached is None:
            cached = self._layers[key] = self._layer(*key)
        return cached

    def _layer(self, block, mbs, tp, cp, ep, fp8, recompute, attention, where_tp, where_cp, where_ep, where_pp):
        f, b, w, rc, act, flops, column = self.compute(block, mbs, tp, cp, fp8, recompute, ep)
        t_tp, (regather, scatter), (t_cp, cp_total), t_ep, transient, ep_replay = self.comm(
            block, mbs, tp, cp, ep, attention, fp8, where_tp, where_cp, where_ep, recompute
        )
        act += self.gathered_kv_kept(block, mbs, tp, cp, attention, recompute)
        p2p = self.p2p(block, mbs, tp, cp, where_pp)
        dense, expert = self.params(block, tp, ep)
        if block == POST:  # the logits' gradient lives next to the saved log-probabilities
            blk = self.block(block)
            transient = max(transient, blk.activation_bytes(mbs, self.seq / cp, tp=tp, sp=tp > 1 and self.sp))
        # the re-gather hides behind the input-gradient GEMMs, the gradient's reduce-scatter
        # behind the weight-gradient GEMMs; what is longer than they are shows, and what the
        # program does not hide of the rest
        shows = max(0.0, regather - column), max(0.0, scatter - column)
        hidden = regather - shows[0] + scatter - shows[1]
        exposed = t_tp + shows[0] + shows[1] + (1 - self.hw.overlap_share("tp")) * hidden
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
            self.held_for_weights(block, mbs, tp, cp),
            ep_replay,
            self.hw.overlap_share("ep"),
        )
