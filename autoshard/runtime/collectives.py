"""Autograd-aware tensor-parallel collectives (Megatron's f and g and their sequence-parallel
forms), the vocabulary-parallel embedding and the vocabulary-parallel cross-entropy.

``torch.distributed.nn.functional.all_reduce`` all-reduces in both directions, which is neither f
(identity forward, all-reduce backward) nor g (all-reduce forward, identity backward), so these are
small ``autograd.Function``s over the plain collectives. All take the tensor-parallel group from
``autoshard.runtime.groups`` and are the identity on a group of one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from autoshard.runtime import phase
from autoshard.runtime.checkpoint import collective
from autoshard.runtime.groups import tp_group, tp_rank, tp_size

# torch 2.13 renamed the tensor forms; older releases (pyproject allows torch>=2.6) have only these
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter_from = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# Each collective runs through ``checkpoint.collective``: a selective checkpoint's recomputation
# skips those whose outputs nothing it remakes needs, on every rank of the group alike.


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    collective(lambda: dist.all_reduce(x, group=tp_group()), x)
    return x


def _all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((tp_size() * x.size(0), *x.shape[1:]))
    collective(lambda: _gather_into(out, x, group=tp_group()), out)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int) -> torch.Tensor:
    x = x.movedim(dim, 0).contiguous()
    if x.size(0) % tp_size():
        raise RuntimeError(f"reduce-scatter over tp={tp_size()}: dimension {dim} of size {x.size(0)} does not divide")
    out = x.new_empty((x.size(0) // tp_size(), *x.shape[1:]))
    collective(lambda: _scatter_from(out, x, group=tp_group()), out)
    return out.movedim(0, dim).contiguous()


def _split(x: torch.Tensor, dim: int) -> torch.Tensor:
    size = x.size(dim) // tp_size()
    return x.narrow(dim, tp_rank() * size, size).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone())


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad):
        return grad


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):
        ctx.dim = dim
        out = _all_gather(x, dim)
        _GATHERED[out.untyped_storage()] = _Gathered(x, dim, out.shape)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):
        ctx.dim = dim
        return _reduce_scatter(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):
        ctx.dim = dim
        return _split(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim), None


def _as_computed(x: torch.Tensor) -> torch.Tensor:
    """``x`` in autocast's dtype where autocast is on: what enters a tensor-parallel region feeds
    its column-parallel products, which autocast would cast to that dtype anyway, so it is
    gathered (and its gradient reduced) at that size, as Megatron's bf16 layers do, rather than in
    the fp32 a norm leaves under autocast."""
    kind = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(kind):
        return x.to(torch.get_autocast_dtype(kind))
    return x


# Sequence parallelism keeps what a TP region's products save of its gathered input as the shard,
# and gathers it again in backward (Megatron's sequence parallelism; Korthikanti et al. count the
# memory so): ``regather_saved`` wraps each chunk's forward in saved-tensor hooks that store a
# tensor on a gathered storage as its shard and gather it again when backward unpacks it, once
# for all the products that saved it (the Q, K and V projections read one gathered input).
_GATHERED = WeakIdKeyDictionary()  # storage of an all-gathered tensor -> its _Gathered


class _Gathered:
    """An all-gathered tensor's shard, and the tensor gathered again while backward needs it."""

    def __init__(self, shard: torch.Tensor, dim: int, shape: torch.Size):
        self.shard, self.dim, self.shape = shard, dim, shape
        self.pending = 0  # saved tensors of it not yet unpacked
        self.full: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if phase.in_input_pass():
            # autograd unpacks a product's saved input also where it computes only the input's
            # gradient, which does not read it (the weight pass will, and gathers it then)
            return self.shard.new_empty(self.shape)
        if self.full is None:
            self.full = _all_gather(self.shard, self.dim)
        full = self.full
        self.pending -= 1
        if self.pending <= 0:
            self.full = None
        return full


def _pack(t: torch.Tensor):
    # Anything else is kept as a detached alias: kept as itself, an op's saved output would hold
    # its own grad_fn, a cycle through the autograd graph that nothing collects where the graph
    # is kept and never run to its end (a split backward's input pass keeps it for the weight
    # pass, which runs only the weights' part): the layers' activations held to the step's end.
    try:
        gathered = _GATHERED.get(t.untyped_storage())
    except (RuntimeError, NotImplementedError):  # a tensor without a storage of its own
        return t.detach()
    if gathered is None:
        return t.detach()
    gathered.pending += 1
    return gathered, tuple(t.shape), t.stride(), t.storage_offset()


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    gathered, shape, stride, offset = packed
    return gathered.get().as_strided(shape, stride, offset)


def regather_saved(modules) -> None:
    """Run each module's forward so that what backward keeps of an all-gathered sequence-parallel
    tensor is its shard, gathered again when needed (a no-op without tensor parallelism)."""
    if tp_size() == 1:
        return
    for module in modules:
        forward = module.forward

        def saving_shards(*args, _forward=forward, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
                return _forward(*args, **kwargs)

        module.forward = saving_shards


def copy_to_tp(x: torch.Tensor) -> torch.Tensor:
    """Megatron's f: enter a tensor-parallel region (identity; all-reduce the gradient)."""
    return x if tp_size() == 1 else _CopyToTP.apply(_as_computed(x))


def reduce_from_tp(x: torch.Tensor) -> torch.Tensor:
    """Megatron's g: leave a tensor-parallel region (all-reduce the partial sums; identity backward)."""
    return x if tp_size() == 1 else _ReduceFromTP.apply(x)


def gather_from_sp(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Sequence parallel's entry to a TP region: all-gather the token shards (reduce-scatter backward)."""
    return x if tp_size() == 1 else _GatherFromSP.apply(_as_computed(x), dim)


def reduce_scatter_to_sp(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Sequence parallel's exit: reduce-scatter partial sums onto token shards (all-gather backward)."""
    return x if tp_size() == 1 else _ReduceScatterToSP.apply(x, dim)


def gather_tokens(x: torch.Tensor, seq: int) -> torch.Tensor:
    """``gather_from_sp`` for a tensor whose batch and sequence are flattened into rows, as
    GPT-2's Conv1D runs its matmul on ``x.view(-1, features)``: rows are (batch, this rank's
    tokens); ``seq`` is the whole sequence's length."""
    if tp_size() == 1:
        return x
    rest = x.shape[1:]
    return gather_from_sp(x.reshape(-1, seq // tp_size(), *rest), 1).reshape(-1, *rest)


def reduce_scatter_tokens(x: torch.Tensor, seq: int) -> torch.Tensor:
    """``reduce_scatter_to_sp`` for rows of flattened (batch, sequence) of length ``seq``: each rank
    keeps the rows of its tokens, batch by batch, as the rest of the sequence-parallel stream does."""
    if tp_size() == 1:
        return x
    rest = x.shape[1:]
    return reduce_scatter_to_sp(x.reshape(-1, seq, *rest), 1).reshape(-1, *rest)


def scatter_to_sp(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Keep this rank's token shard of a replicated tensor (all-gather backward)."""
    return x if tp_size() == 1 else _ScatterToSP.apply(x, dim)


def vocab_parallel_embedding(
    tokens: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None, sp_dim: int | None = None
):
    """Embedding lookup with the table's rows split over the TP group: each rank looks up the
    tokens in its vocabulary range, zeroes the rest, and the partial results are summed: all-
    reduced, or with ``sp_dim`` (sequence parallelism) reduce-scattered onto this rank's slice of
    that dimension, as Megatron's embedding does. The ``padding_idx`` row (a global id) gets no
    gradient on the rank that holds it."""
    if tp_size() == 1:
        return torch.nn.functional.embedding(tokens, weight, padding_idx)
    start = tp_rank() * weight.size(0)
    local = tokens - start
    outside = (local < 0) | (local >= weight.size(0))
    pad = padding_idx - start if padding_idx is not None and 0 <= padding_idx - start < weight.size(0) else None
    out = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight, pad)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_tp(out) if sp_dim is None else reduce_scatter_to_sp(out, sp_dim)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index):
        # logits: (N, V/tp) this rank's vocabulary slice; target: (N,) global ids
        group = tp_group()
        vocab = logits.size(-1)
        start = tp_rank() * vocab
        peak = logits.max(dim=-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        # one (N, V/tp) buffer besides the logits, made in place from the shifted logits to their
        # exponentials to the softmax kept for backward (three more at the size of the logits,
        # 2.1 GB each at LLaMA-3 70B's 16K-token CP shard, made the peak of the step)
        probs = logits - peak.unsqueeze(-1)
        local = target - start
        inside = (local >= 0) & (local < vocab) & (target != ignore_index)
        picked = probs.gather(-1, local.clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)
        picked = picked.masked_fill(~inside, 0.0)
        total = probs.exp_().sum(dim=-1)
        dist.all_reduce(total, group=group)
        dist.all_reduce(picked, group=group)
        loss = total.log() - picked
        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        ctx.save_for_backward(probs.div_(total.unsqueeze(-1)), local, inside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside, ignored = ctx.saved_tensors
        # softmax minus one at each row's target where this rank holds it (a scatter rather than
        # indexing by the mask: shapes that do not depend on the values), in place
        g = softmax.clone()
        index = local.clamp(0, g.size(-1) - 1).unsqueeze(-1)
        g.scatter_add_(-1, index, -inside.to(g.dtype).unsqueeze(-1))
        g.masked_fill_(ignored.unsqueeze(-1), 0.0)
        return g.mul_(grad.unsqueeze(-1)), None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """``F.cross_entropy`` over logits whose class dimension is split across the TP group; the
    same result on every rank of the group as the unsplit loss."""
    if tp_size() == 1:
        return torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
    flat = logits.reshape(-1, logits.size(-1))
    losses = _VocabParallelCrossEntropy.apply(flat, target.reshape(-1), ignore_index)
    if reduction == "none":
        return losses.view(target.shape)
    if reduction == "sum":
        return losses.sum()
    if reduction != "mean":
        raise ValueError(f"reduction={reduction!r}: use mean, sum or none")
    return losses.sum() / (target != ignore_index).sum()
