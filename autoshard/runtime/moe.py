"""Mixture-of-experts runtime: grouped GEMM, expert-parallel dispatch and combine, load balancing.

Emitted stage code calls these on tensors, so each takes and returns tensors and reads its process
group from ``autoshard.runtime.groups``; with no EP group (one process, or one rank's graph in a
test) dispatch and combine do the single-device computation (capacity drops included) with no
communication.

Token layout. A rank's routed rows ``[S, H]`` are sorted by global expert id; ``offs`` (int32
``[E]``) holds the cumulative counts (expert ``g`` owns rows ``offs[g-1]:offs[g]``), the form
``torch._grouped_mm`` reads. EP rank ``r`` holds experts ``[r*E/ep, (r+1)*E/ep)``. Dispatch sends
each rank the rows of its experts (token counts exchanged first, so splits may be uneven, zeros
included) and reorders what arrives from source-major to local-expert-major; combine is the exact
inverse. Both are differentiable: the token all-to-alls are
``all_to_all_single_autograd`` (its backward is the reverse all-to-all).

Load balancing is DeepSeek-V3's auxiliary-loss-free method: ``record_load`` counts each layer's
selected experts in forward, ``update_biases`` (once per optimizer step) sums the counts over
every rank routing the layer and nudges each routing bias by ``gamma * sign(mean - load)``.

Timing (benchmarks/moe.py): with ``AUTOSHARD_MOE_TIMING=1`` in the environment when this module is
imported, dispatch, combine and their buffer forms add their wall time, forward and backward, to
``timings()``; unset, they are the plain functions (nothing is paid).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from fractions import Fraction

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor, all_to_all_single_autograd, wait_tensor

from autoshard.runtime import fake
from autoshard.runtime import fp8 as blockwise
from autoshard.runtime.checkpoint import collective, kept_whole
from autoshard.runtime.groups import ep_group, ep_size, route_group, tp_group, tp_rank, tp_size
from autoshard.runtime.phase import unrecorded

# where torch._grouped_mm has a kernel (device type -> dtypes); elsewhere a loop over groups runs
_GROUPED_MM_DTYPES = {"cpu": {torch.float32, torch.bfloat16, torch.float16}, "cuda": {torch.bfloat16}}

_dropped = 0  # rows dropped by capacity since the last dropped_tokens(reset=True), this rank
_loads: dict[str, torch.Tensor] = {}  # layer name -> tokens routed to each expert since the last update


# --- grouped GEMM ---------------------------------------------------------------------------------


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: ``_grouped_mm``'s backward rejects an
    expanded one (the gradient of a ``.sum()``) with "Invalid strides/sizes"."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _aligned(t: torch.Tensor) -> bool:
    """``_grouped_mm`` needs 16-byte aligned data and 16-byte multiples for every non-unit stride
    (a fake tensor has no data: its allocation would be aligned)."""
    size = t.element_size()
    return (fake.is_fake(t) or t.data_ptr() % 16 == 0) and all(s * size % 16 == 0 for s in t.stride() if s != 1)


def grouped_mm_runs(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``grouped_mm(a, b, offs)`` takes ``torch._grouped_mm`` (else the loop over groups)."""
    device = "cuda" if fake.is_fake(a) else a.device.type  # a fake tensor stands for the GPU program
    dtypes = _GROUPED_MM_DTYPES.get(device, set())
    inner = b.stride(-1) == 1 or b.stride(-2) == 1
    return hasattr(torch, "_grouped_mm") and a.dtype == b.dtype in dtypes and inner and _aligned(a) and _aligned(b)


def _grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, ends))])


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of ``a`` ``[S, K]`` grouped by ``offs`` (cumulative counts ``[G]``, ``offs[-1] == S``)
    times their group's matrix of ``b`` ``[G, K, N]``: ``[S, N]``, differentiable in ``a`` and ``b``.
    ``torch._grouped_mm`` where it has a kernel (``grouped_mm_runs``), a per-group loop elsewhere."""
    # autocast has no rule for grouped GEMMs: as for mm (the meta device, where capture propagates
    # shapes, has no autocast to ask)
    if a.device.type != "meta" and torch.is_autocast_enabled(a.device.type):
        dtype = torch.get_autocast_dtype(a.device.type)
        a, b = a.to(dtype), b.to(dtype)
    a = a.contiguous()
    if isinstance(a.size(0), torch.SymInt):  # capture's shape propagation, rows in symbolic b and s:
        return a @ b[0]  # a grouped GEMM's shape and autograd links (there are no values to group)
    offs = fake.offsets(offs, a.size(0))
    if grouped_mm_runs(a, b):
        return _ContiguousGrad.apply(torch._grouped_mm(a, b, offs.to(torch.int32)))
    return _grouped_mm_loop(a, b, offs)


# --- opt-in timing of dispatch and combine ---------------------------------------------------------

_TIMING = os.environ.get("AUTOSHARD_MOE_TIMING") == "1"  # read once, at import
_seconds: dict[str, float] = {}  # "dispatch", "combine backward", ... -> wall seconds since the last reset


class _BackwardClock(torch.autograd.Function):
    """Identity marking one end of a timed region for the backward pass: the gradient reaching the
    region's output starts ``clock``, the gradient leaving its input adds the elapsed time to
    ``name``. (Backward runs nodes newest first, so other work seldom runs in between.)"""

    @staticmethod
    def forward(ctx, x, name, clock, starts):
        ctx.name, ctx.clock, ctx.starts = name, clock, starts
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        now = time.perf_counter()
        if ctx.starts:
            ctx.clock.append(now)
        elif ctx.clock:
            _seconds[ctx.name] = _seconds.get(ctx.name, 0.0) + now - ctx.clock.pop()
        return grad, None, None, None


def _timed(fn):
    """``fn`` unchanged unless timing is on; then ``fn`` whose forward wall time (its all-to-all
    waited for) and the backward of its first argument to its first result add up in ``timings()``."""
    if not _TIMING:
        return fn
    name = fn.__name__

    @functools.wraps(fn)
    def timed(x, *args, **kwargs):
        clock: list[float] = []
        tracked = torch.is_grad_enabled() and x.requires_grad
        if tracked:
            x = _BackwardClock.apply(x, f"{name} backward", clock, False)
        start = time.perf_counter()
        out = fn(x, *args, **kwargs)
        first = out[0] if isinstance(out, tuple) else out
        if isinstance(first, AsyncCollectiveTensor):
            wait_tensor(first.elem)  # the collective's time belongs here, not to the first reader
        _seconds[name] = _seconds.get(name, 0.0) + time.perf_counter() - start
        if tracked:
            first = _BackwardClock.apply(first, f"{name} backward", clock, True)
            out = (first, *out[1:]) if isinstance(out, tuple) else first
        return out

    return timed


def timings(reset: bool = False) -> dict[str, float]:
    """Wall seconds this rank spent in each timed function (``"dispatch"``, ``"combine backward"``,
    ...) since the last reset; empty unless ``AUTOSHARD_MOE_TIMING=1``. ``reset=True`` (once per
    step) starts the sums again after reading them."""
    out = dict(_seconds)
    if reset:
        _seconds.clear()
    return out


# --- dropless (or capacity-bounded) dispatch and combine over the EP group --------------------------


def _total(offs: torch.Tensor) -> int:
    """The rows grouped by cumulative counts ``offs`` (real ones: ``fake.offsets``)."""
    with fake.real():
        return int(offs[-1])


def _counts(offs: torch.Tensor) -> torch.Tensor:
    """Rows per expert (int64 ``[E]``) from cumulative counts."""
    offs = offs.long()
    return torch.diff(offs, prepend=offs.new_zeros(1))


def capacity(rows: int, experts: int, capacity_factor: float | Fraction) -> int:
    """Rows one rank may send one expert: ``ceil(capacity_factor * rows / experts)``, exactly (a
    float factor is read as written: 1.1 is 11/10)."""
    return math.ceil(Fraction(str(capacity_factor)) * rows / experts)


_capacity_factor: float | Fraction | None = None  # the program's setting (train.py --capacity-factor)


def set_capacity_factor(capacity_factor: float | Fraction | None) -> None:
    """What ``dispatch`` and ``combine`` use when called without one (as emitted stage code
    calls them): ``None``, the default, drops nothing."""
    global _capacity_factor
    _capacity_factor = capacity_factor


def _kept(offs: torch.Tensor, capacity_factor: float | Fraction | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows kept per expert (int64 ``[E]``) and the indices of the kept rows (``None``: all kept).
    Under a capacity each expert keeps its first ``capacity(...)`` rows."""
    counts = _counts(offs)
    capacity_factor = _capacity_factor if capacity_factor is None else capacity_factor
    if capacity_factor is None:
        return counts, None
    rows = int(offs[-1])
    limit = capacity(rows, counts.numel(), capacity_factor)
    expert = torch.repeat_interleave(torch.arange(counts.numel(), device=offs.device), counts, output_size=rows)
    position = torch.arange(rows, device=offs.device) - (offs.long() - counts)[expert]
    return counts.clamp(max=limit), torch.nonzero(position < limit).squeeze(1)


def _block_transpose(counts: torch.Tensor) -> torch.Tensor:
    """Rows laid out in blocks of ``counts[i, j]`` rows, ``i``-major, as indices that reorder them
    ``j``-major: ``rows[_block_transpose(counts)]``. ``_block_transpose(counts.t())`` undoes it."""
    lengths = counts.t().reshape(-1)
    flat = counts.reshape(-1)
    old_start = (flat.cumsum(0) - flat).view_as(counts).t().reshape(-1)
    new_start = lengths.cumsum(0) - lengths
    total = int(flat.sum())
    shift = torch.repeat_interleave(old_start - new_start, lengths, output_size=total)
    return torch.arange(total, device=counts.device) + shift


_counting = True  # False while a forward runs that is not one of the step's (see uncounted)


@contextlib.contextmanager
def uncounted():
    """Forwards run inside are not counted (loads, capacity drops): torch's pipelining runs each
    stage once on its first step to learn the shapes it sends, on copies of the inputs or on
    empty tensors."""
    global _counting
    before, _counting = _counting, False
    try:
        yield
    finally:
        _counting = before


def _recomputing() -> bool:
    """True while autograd runs a backward pass (forward code running then is an
    activation-checkpointed region recomputing, whose counts were taken in the forward), or
    inside ``uncounted``."""
    return torch._C._current_graph_task_id() != -1 or not _counting


def _all_to_all(rows: torch.Tensor, out_splits, in_splits, group, fp8: bool) -> torch.Tensor:
    """Rows ``[S, ...]`` exchanged over ``group`` (``out_splits`` rows received from each rank,
    ``in_splits`` sent to each; None: equal parts along dim 0). ``fp8``: each row quantised in
    1x128 tiles along its last dimension (``autoshard.runtime.fp8``), its E4M3 bytes and scales
    sent (about half the bytes of bf16), and dequantised on arrival."""

    shape, rows = rows.shape, rows.contiguous()
    flat = rows.view(-1, shape[-1])
    n_out = sum(out_splits) if out_splits is not None else flat.size(0)

    def exchange(out, x):  # skipped in a selective recomputation where nothing needs ``out``
        collective(lambda: dist.all_to_all_single(out, x, out_splits, in_splits, group=group), out)

    if not fp8:
        out = torch.empty(n_out, flat.size(1), dtype=rows.dtype, device=rows.device)
        exchange(out, flat)
    else:
        q, s = blockwise._q_rows(flat)
        q_out = torch.empty(n_out, flat.size(1), dtype=torch.uint8, device=rows.device)
        s_out = torch.empty(n_out, s.size(1), dtype=s.dtype, device=rows.device)
        exchange(q_out, q.contiguous().view(torch.uint8))
        exchange(s_out, s.contiguous())
        out = torch.ops.autoshard.fp8_dequantize_rows(q_out.view(q.dtype), s_out, rows.dtype)
    return out.view(shape) if out_splits is None else out.view(n_out, *shape[1:])


class _Fp8AllToAll(torch.autograd.Function):
    """An all-to-all of rows with one of its two directions in FP8 (DeepSeek-V3's low-precision
    MoE communication): ``forward_fp8`` for the dispatch, whose rows the experts' first FP8 GEMM
    quantises again in the same 1x128 tiles, so sending them in FP8 costs nothing that GEMM
    keeps; ``backward_fp8`` for the combine, whose gradient reaches the experts' last GEMM (its
    output gradient) in FP8. The other direction goes in the compute precision."""

    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, group, forward_fp8, backward_fp8):
        ctx.splits, ctx.group, ctx.fp8 = (out_splits, in_splits), group, backward_fp8
        return _all_to_all(rows, out_splits, in_splits, group, forward_fp8)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group, ctx.fp8), None, None, None, None, None


def _send(rows, out_splits, in_splits, group, fp8: bool = False, fp8_backward: bool = False) -> torch.Tensor:
    """``all_to_all_single_autograd``, or the same with a direction in FP8 (``_Fp8AllToAll``)."""
    if fp8 or fp8_backward:
        return _Fp8AllToAll.apply(rows, out_splits, in_splits, group, fp8, fp8_backward)
    return all_to_all_single_autograd(rows.contiguous(), out_splits, in_splits, group)


@_timed
def dispatch(
    rows: torch.Tensor, offs: torch.Tensor, capacity_factor: float | Fraction | None = None, fp8: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Send routed rows to the EP ranks holding their experts.

    ``rows`` ``[S, H]`` sorted by global expert, ``offs`` int32 ``[E]`` cumulative counts. Returns
    ``(local_rows, local_offs, recv_counts)``: the rows this rank's ``E/ep`` experts compute, grouped
    by local expert (``local_offs`` int32 ``[E/ep]``, for ``grouped_mm``), and ``recv_counts`` int64
    ``[ep, E/ep]`` (rows from each source rank per local expert), which ``combine`` needs.
    ``capacity_factor``: each expert keeps at most ``capacity(S, E, capacity_factor)`` of this rank's
    rows (the first ones); the rest are dropped, counted in ``dropped_tokens()``, and come back
    from ``combine`` as zeros. ``None`` (the default) drops nothing. ``fp8``: the rows go in FP8
    (the experts multiply them in FP8).
    """
    global _dropped
    ep, experts = ep_size(), offs.numel()
    if experts % ep:
        raise ValueError(f"expert parallelism over {ep} ranks does not divide {experts} experts")
    balanced = fake.is_fake(offs)  # on fake tensors: every expert gets its mean share
    offs = fake.offsets(offs, rows.size(0))
    with fake.real():  # counts are values, on fake tensors too
        send_counts, keep = _kept(offs, capacity_factor)
    if keep is not None:
        rows = rows.index_select(0, keep)
        if not _recomputing():
            with unrecorded():
                _dropped += _total(offs) - keep.numel()
    with fake.real():
        send_counts = send_counts.view(ep, experts // ep)
        if ep == 1:
            return rows, send_counts.cumsum(1).to(torch.int32).view(-1), send_counts
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=ep_group())
        if balanced:  # what a fake group never delivers: balanced, every rank sends what this one does
            recv_counts.copy_(send_counts)
        out_splits, in_splits = recv_counts.sum(1).tolist(), send_counts.sum(1).tolist()
        local_offs = recv_counts.sum(0).cumsum(0).to(torch.int32)
        order = _block_transpose(recv_counts)

    def send(rows):
        return _send(rows, out_splits, in_splits, ep_group(), fp8).index_select(0, order)

    return kept_whole("experts", send, rows), local_offs, recv_counts


@_timed
def combine(
    local_out: torch.Tensor,
    offs: torch.Tensor,
    recv_counts: torch.Tensor,
    capacity_factor: float | Fraction | None = None,
    fp8: bool = False,
) -> torch.Tensor:
    """The inverse of ``dispatch``: the experts' output rows ``[R, N]`` (local-expert-major) back to
    the ranks that routed them, in their original order: ``[S, N]``. ``offs`` and
    ``capacity_factor`` are the ones given to ``dispatch``, ``recv_counts`` the one it returned;
    dropped rows are zeros. ``fp8``: the gradient goes back to the experts in FP8 (the rows come
    in the compute precision)."""
    offs = fake.offsets(offs)
    with fake.real():
        send_counts, keep = _kept(offs, capacity_factor)
        if ep_size() > 1:
            order = _block_transpose(recv_counts.t())
            out_splits, in_splits = send_counts.view(ep_size(), -1).sum(1).tolist(), recv_counts.sum(1).tolist()
    if ep_size() > 1:

        def send(rows):
            return _send(rows.index_select(0, order), out_splits, in_splits, ep_group(), fp8_backward=fp8)

        local_out = kept_whole("experts", send, local_out)
    if keep is None:
        return local_out
    return local_out.new_zeros(_total(offs), local_out.size(1)).index_copy(0, keep, local_out)


def dropped_tokens(reset: bool = False) -> int:
    """Rows this rank's ``dispatch`` calls dropped by capacity (a backward-time recomputation is not
    counted again) since the last reset; ``reset=True`` (the trainer, once per logged step) starts
    the count again after reading it. Sum over ranks for a global figure."""
    global _dropped
    count = _dropped
    if reset:
        _dropped = 0
    return count


# --- fixed-capacity buffers ([E, C, H], GShard style) ----------------------------------------------


@_timed
def dispatch_buffer(buf: torch.Tensor, fp8: bool = False) -> torch.Tensor:
    """A fixed-capacity buffer ``[E, C, ...]`` (each expert's ``C`` slots of this rank's tokens) to
    ``[E/ep, ep*C, ...]``: this rank's experts, each with the slots of every source rank side by
    side (source order). An equal-split all-to-all along dim 0; differentiable. ``fp8``: sent in
    FP8, as ``dispatch``."""
    ep = ep_size()
    if ep == 1:
        return buf
    if buf.size(0) % ep:
        raise ValueError(f"expert parallelism over {ep} ranks does not divide {buf.size(0)} experts")
    rest = buf.shape[2:]
    received = _send(buf, None, None, ep_group(), fp8)
    by_source = received.view(ep, buf.size(0) // ep, buf.size(1), *rest)
    return by_source.transpose(0, 1).reshape(buf.size(0) // ep, ep * buf.size(1), *rest)


@_timed
def combine_buffer(out: torch.Tensor, fp8: bool = False) -> torch.Tensor:
    """The inverse of ``dispatch_buffer``: ``[E/ep, ep*C, ...]`` back to ``[E, C, ...]``;
    ``fp8``: its gradient goes back in FP8, as ``combine``'s."""
    ep = ep_size()
    if ep == 1:
        return out
    local, slots, rest = out.size(0), out.size(1) // ep, out.shape[2:]
    by_source = out.view(local, ep, slots, *rest).transpose(0, 1).reshape(ep * local, slots, *rest)
    return _send(by_source, None, None, ep_group(), fp8_backward=fp8)


# --- load balancing --------------------------------------------------------------------------------


def record_load(indices: torch.Tensor, experts: int, layer: str) -> torch.Tensor:
    """Count the experts a layer selected (``indices`` ``[T, k]``, any shape) into its load since
    the last ``update_biases``; returns ``indices`` unchanged (so a graph keeps the call in line).
    Not counted while an activation-checkpointed region recomputes in backward."""
    if not _recomputing():
        with torch.no_grad(), unrecorded():
            flat = indices.reshape(-1).long()
            counts = torch.zeros(experts, dtype=torch.long, device=flat.device).index_add_(
                0, flat, torch.ones_like(flat)
            )
            _loads[layer] = _loads[layer] + counts if layer in _loads else counts
    return indices


def expert_loads() -> dict[str, torch.Tensor]:
    """This rank's per-expert loads recorded since the last ``update_biases`` (not summed)."""
    return dict(_loads)


def update_biases(biases: dict[str, torch.Tensor], gamma: float = 1e-3) -> dict[str, tuple[float, float]]:
    """DeepSeek-V3's auxiliary-loss-free balancing step, after the optimizer step.

    The recorded loads are summed over ``route_group()`` (every rank routing these layers, so all
    replicas take the same step; under sequence parallelism the TP ranks count their own slices,
    without it each counts the same tokens, which scales every load alike and keeps the signs),
    then each layer's routing bias (named as in ``record_load``) moves by
    ``gamma * sign(mean load - load)`` in place, and the loads are reset. Returns, per
    layer recorded or given, ``(max load, mean load)`` in routed tokens for the step's log (their
    ratio is the imbalance). Every rank of the group must pass the same layers.
    """
    names = sorted(set(biases) | set(_loads))
    if not names:
        return {}
    device = next(iter(biases.values())).device if biases else next(iter(_loads.values())).device
    loads = [_loads.pop(n) if n in _loads else torch.zeros(biases[n].numel(), dtype=torch.long) for n in names]
    flat = torch.cat([load.to(device) for load in loads])
    if route_group() is not None:
        dist.all_reduce(flat, group=route_group())
    report = {}
    with torch.no_grad():
        for name, load in zip(names, flat.split([load.numel() for load in loads])):
            mean = load.double().mean()
            if name in biases:
                biases[name].add_(torch.sign(mean - load).to(biases[name].dtype), alpha=gamma)
            report[name] = (fake.value(load.max()), fake.value(mean))
    return report


def _summed(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts`` (no gradient) summed over ``group`` (None: as they are)."""
    if group is not None:
        with torch.no_grad():
            dist.all_reduce(counts, group=group)
    return counts


def sequence_balance_loss(
    scores: torch.Tensor, indices: torch.Tensor, experts: int, seq: int, alpha: float, group=None
) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (eq. 17-20), averaged over sequences.

    ``scores`` ``[T, E]`` the token-expert affinities (sigmoid outputs), ``indices`` ``[T, k]`` the
    selected experts, ``T`` rows of whole sequences of ``seq`` tokens in order. Per sequence
    ``f_i = E / (k * seq) * (tokens selecting i)``, ``P_i = mean_t s_{i,t} / sum_j s_{j,t}`` and the
    loss is ``alpha * sum_i f_i * P_i``; gradients reach ``scores`` through ``P`` only.

    ``group``: the rows are this rank's slice of each sequence (``seq`` tokens of it), the other
    slices on the group's ranks (sequence parallelism). ``f`` is then counted over the whole
    sequences and ``P`` summed over this rank's tokens only: this rank's term of the loss, whose
    sum over the group is the loss and whose gradient is the loss's in these scores.
    """
    k = indices.size(-1)
    whole = seq * (dist.get_world_size(group) if group is not None else 1)
    s = scores.reshape(-1, seq, experts)
    p = (s / s.sum(-1, keepdim=True)).sum(1) / whole
    picked = indices.reshape(s.size(0), seq * k)
    counts = torch.zeros(s.size(0), experts, dtype=s.dtype, device=s.device).scatter_add_(
        1, picked, torch.ones_like(picked, dtype=s.dtype)
    )
    f = _summed(counts, group) * (experts / (k * whole))
    return alpha * (f * p).sum(-1).mean()


def switch_aux_loss(probs: torch.Tensor, indices: torch.Tensor, experts: int, alpha: float, group=None) -> torch.Tensor:
    """Switch Transformer's load-balancing loss ``alpha * E * sum_i f_i * P_i``: ``f_i`` the fraction
    of routed assignments (tokens x ``k``) sent to expert ``i``, ``P_i`` the mean router
    probability of ``i`` (``probs`` ``[T, E]``, softmax outputs); ``indices`` ``[T, k]``.
    ``group``: the tokens are split over its ranks, as for ``sequence_balance_loss``: this rank's term."""
    flat = indices.reshape(-1)
    ranks = dist.get_world_size(group) if group is not None else 1
    counts = torch.zeros(experts, dtype=probs.dtype, device=probs.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=probs.dtype)
    )
    f = _summed(counts, group) / (flat.numel() * ranks)
    probs = probs.reshape(-1, experts)
    return alpha * experts * (f * probs.sum(0) / (probs.size(0) * ranks)).sum()


# --- tensor-parallel shares of the routed rows -------------------------------------------------------
# With tensor parallelism every TP rank routes the same tokens; each computes its share of every
# expert's rows (the expert-parallel pass puts ``copy_to_tp`` before the share, so the rows'
# gradient is summed over TP, and ``reduce_from_tp`` after the unshare, so every rank has all rows).


def tp_share(rows: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This TP rank's share of each expert's rows (rows sorted by expert, ``offs`` cumulative):
    ``(rows, offs, index)``, ``index`` the rows taken, for ``tp_unshare``."""
    tp, r = tp_size(), tp_rank()
    if tp == 1:
        return rows, offs, torch.arange(rows.size(0), device=rows.device)
    offs = fake.offsets(offs, rows.size(0))
    with fake.real():  # an index of values, on fake tensors too (balanced routing's)
        counts = _counts(offs)
        lo, hi = counts * r // tp, counts * (r + 1) // tp
        starts = offs.long() - counts + lo
        mine = hi - lo
        total = int(mine.sum())
        index = torch.repeat_interleave(starts - mine.cumsum(0) + mine, mine, output_size=total)
        index = index + torch.arange(total, device=rows.device)
    return rows.index_select(0, index), mine.cumsum(0).to(torch.int32), index


def tp_unshare(out: torch.Tensor, index: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The rows of ``tp_share`` put back in place among ``offs[-1]`` rows, zeros elsewhere."""
    if tp_size() == 1:
        return out
    return out.new_zeros(_total(fake.offsets(offs)), *out.shape[1:]).index_copy(0, index, out)


def tp_share_buffer(buf: torch.Tensor) -> torch.Tensor:
    """This TP rank's slots of a fixed-capacity buffer ``[E, C, ...]``: ``[E, C/tp, ...]``."""
    tp = tp_size()
    if tp == 1:
        return buf
    if buf.size(1) % tp:
        raise ValueError(f"tensor parallelism over {tp} ranks does not divide the experts' {buf.size(1)} slots")
    slots = buf.size(1) // tp
    return buf.narrow(1, tp_rank() * slots, slots)


def tp_unshare_buffer(out: torch.Tensor) -> torch.Tensor:
    """The slots of ``tp_share_buffer`` back in place, zeros in the other ranks' slots."""
    tp = tp_size()
    if tp == 1:
        return out
    slots = out.size(1)
    index = torch.arange(tp_rank() * slots, (tp_rank() + 1) * slots, device=out.device)
    return out.new_zeros(out.size(0), tp * slots, *out.shape[2:]).index_copy(1, index, out)


# --- auxiliary balance losses, attached to the routed rows -------------------------------------------

_aux = {"kind": None, "alpha": 0.0, "scale": 1.0}  # the program's setting (train.py --aux-loss)


def set_aux_loss(kind: str | None, alpha: float = 0.0, scale: float = 1.0) -> None:
    """Add a balance loss to every MoE layer's routing: ``"sequence"`` (DeepSeek-V3's
    sequence-wise loss) or ``"switch"`` (Switch Transformer's), weighted ``alpha``; ``None`` or
    alpha 0: none (the default). ``scale`` is what the training loss of one micro-batch is scaled
    by before its backward (1/micro-batches without a pipeline schedule, which scales afterwards)."""
    if kind not in (None, "sequence", "switch"):
        raise ValueError(f"unknown balance loss {kind!r}; use sequence or switch")
    _aux.update(kind=kind, alpha=float(alpha), scale=float(scale))


_aux_total: dict[str, float] = {}  # layer -> summed balance-loss values since the last read


class _Attach(torch.autograd.Function):
    """Forward ``x`` unchanged; backward also sends ``scale`` as the gradient of ``aux``: the loss
    ``aux`` joins the training loss where the layer is, on whichever pipeline stage holds it."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=grad.dtype, device=grad.device), None


def balance_loss(
    rows: torch.Tensor,
    scores: torch.Tensor,
    indices: torch.Tensor,
    experts: int,
    seq: int,
    layer: str,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """``rows`` (the layer's routed rows) with the program's balance loss of this layer's routing
    attached (``scores`` ``[T, E]`` the router's affinities, ``indices`` ``[T, k]`` its choice,
    ``seq`` tokens per sequence); the identity when no balance loss is set. ``sequence_parallel``:
    the rows are this TP rank's slice of each sequence (``seq`` its length), and the loss attached
    is this rank's term (its sum over the TP group is the layer's loss; ``sequence_balance_loss``)."""
    kind, alpha = _aux["kind"], _aux["alpha"]
    if kind is None or alpha == 0.0 or not torch.is_grad_enabled():
        return rows
    group = tp_group() if sequence_parallel and tp_size() > 1 else None
    scores = scores.reshape(-1, experts).float()
    if kind == "sequence":
        aux = sequence_balance_loss(scores, indices.reshape(scores.size(0), -1), experts, seq, alpha, group)
    else:
        probs = scores / scores.sum(-1, keepdim=True)
        aux = switch_aux_loss(probs, indices.reshape(scores.size(0), -1), experts, alpha, group)
    if not _recomputing():
        with unrecorded():
            _aux_total[layer] = _aux_total.get(layer, 0.0) + fake.value(aux.detach())
    return _Attach.apply(rows, aux, _aux["scale"])


def balance_losses(reset: bool = True) -> dict[str, float]:
    """The balance losses this rank's layers added since the last reset (summed over micro-batches;
    under sequence parallelism this rank's terms, to be summed over the TP group)."""
    out = dict(_aux_total)
    if reset:
        _aux_total.clear()
    return out
