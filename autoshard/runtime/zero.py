"""ZeRO-1 as a distributed optimizer shards it: every parameter split by rows over the ranks of
its data-parallel group, each rank keeping the fp32 master and the AdamW moments of its rows only.
A parameter's rows are taken along the dimension that gives the largest rank the least (dimension
0 for a weight the group divides; for a stack of experts with fewer local experts than ranks, the
stack's rows: one local expert of Mixtral 8x22B at EP8 split over its 8 expert-data-parallel ranks
by expert would leave one rank the whole 12 bytes per element and the rest nothing).

A step: the full gradients (fp32, accumulated over the micro-batches on every rank) are
reduce-scattered, so each rank receives the sum over the group of its rows; AdamW steps the rows'
masters; the updated rows, in the parameters' precision, are all-gathered back into every rank's
full parameters. That is Megatron's distributed optimizer (by rows of each parameter rather than
by ranges of one flat buffer) and what the cost model counts for ZeRO-1: 12 bytes per parameter
divided over the group, a reduce-scatter of fp32 gradients and an all-gather of the weights.
``torch.distributed.optim.ZeroRedundancyOptimizer`` cannot do this job: it gives each parameter
whole to one rank, so with more ranks than large parameters one rank holds a whole 0.2B-element
weight's 12 bytes each and the rest hold nothing (LLaMA-3 405B's pipeline stages hold 36 parameters
for 128 data-parallel ranks).

Reductions and gathers go in buckets of at most ``program.BUCKET_BYTES`` (one parameter whose rows
the group divides exactly goes alone, with no copy).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from autoshard.runtime.collectives import _gather_into, _scatter_from  # the tensor forms, by torch's names

BUCKET_BYTES = 64 * 2**20


def split_dim(shape: tuple[int, ...], size: int) -> int:
    """The dimension a tensor of ``shape`` is split along over ``size`` ranks: the one whose split
    leaves the largest rank the fewest elements (the first such)."""
    numel = math.prod(shape)
    share = lambda d: math.ceil(shape[d] / size) * (numel // shape[d]) if shape[d] else 0  # noqa: E731
    return min(range(len(shape)), key=lambda d: (share(d), d)) if shape else 0


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` as (outer, rows, elements per row) with the rows along ``dim`` (a scalar: one row)."""
    if not t.dim():
        return t.reshape(1, 1, 1)
    return t.reshape(math.prod(t.shape[:dim]), t.shape[dim], -1)


class ShardedAdamW:
    """AdamW over this rank's rows of ``params``, the rows split over ``group`` (see the module
    docstring). Used as the program's ZeRO-1 optimizer part: its gradients reduced bucket by bucket
    (``launch_reduce`` as a bucket's gradients are final, during the last backward, ``finish_reduce``
    before the step: ``reduction.BucketedReduction``; or ``reduce_gradients`` after the backward),
    then ``step``."""

    def __init__(self, params: list[nn.Parameter], group, algorithm=torch.optim.AdamW, **kwargs):
        self.params = list(params)
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.dims: dict[int, int] = {}  # id(param) -> the dimension of its rows
        self.spans: dict[int, tuple[int, int, int]] = {}  # id(param) -> (rows per rank, first, end)
        self.masters: dict[int, torch.Tensor] = {}  # id(param) -> fp32 copy of this rank's rows
        with torch.no_grad():
            for p in self.params:
                dim = self.dims[id(p)] = split_dim(tuple(p.shape), self.size)
                rows = _rows(p, dim).size(1)
                per = math.ceil(rows / self.size)
                lo, hi = min(rows, self.rank * per), min(rows, (self.rank + 1) * per)
                self.spans[id(p)] = (per, lo, hi)
                master = _rows(p, dim)[:, lo:hi].float().clone()
                shape = (*p.shape[:dim], hi - lo, *p.shape[dim + 1 :]) if p.dim() else (hi - lo,)
                self.masters[id(p)] = master.view(shape)
        # the rule stepping the rows: AdamW, or LAMB (``runtime.lamb``: prepare, whole norms, apply)
        self.optim = algorithm(list(self.masters.values()), **kwargs)

    # the optimizer's face (the program sets learning rates, checkpoints read states)

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def master(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor stepped for ``p`` (and keying its states): the fp32 copy of this rank's rows."""
        return self.masters.get(id(p), p)

    def rows_of(self, p: torch.Tensor) -> tuple[int, int, int]:
        """The rows of ``p`` this rank steps: (first, end, their dimension)."""
        _, lo, hi = self.spans[id(p)]
        return lo, hi, self.dims[id(p)]

    def _view(self, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """``t`` (``p`` or its gradient) as (outer, rows, elements per row), split as ``p`` is."""
        return _rows(t, self.dims[id(p)])

    def _width(self, p: torch.Tensor) -> int:
        """Elements of ``p`` per row of its split (over the dimensions before and after it)."""
        outer, _, inner = self._view(p, p).shape
        return outer * inner

    def _exact(self, p: torch.Tensor, t: torch.Tensor) -> bool:
        """Whether ``t``'s own storage is the collective's buffer: the ranks' rows, each a
        contiguous run of it, tile it exactly."""
        outer, rows, _ = self._view(t, p).shape
        return outer == 1 and self.spans[id(p)][0] * self.size == rows and t.is_contiguous()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for m in self.masters.values():
            m.grad = None

    # a step

    def _buckets(self, itemsize: int, params: list | None = None, cap: int = BUCKET_BYTES) -> list[list[nn.Parameter]]:
        """``params`` (default: all, in order) in consecutive groups of at most ``cap`` bytes."""
        out, size = [[]], 0
        for p in self.params if params is None else params:
            n = self.spans[id(p)][0] * self._width(p) * self.size * itemsize
            if out[-1] and size + n > cap:
                out.append([])
                size = 0
            out[-1].append(p)
            size += n
        return [b for b in out if b]

    def reduce_gradients(self, divide: int = 1) -> None:
        """Sum the full gradients over the group onto this rank's rows, divided by ``divide``: the
        masters' gradients."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p, dtype=getattr(p, "grad_dtype", None) or p.dtype)
        for bucket in self._buckets(4):
            self.finish_reduce(self.launch_reduce(bucket), divide)

    def launch_reduce(self, bucket: list[nn.Parameter]) -> tuple:
        """Start the reduce-scatter of the (final) gradients of ``bucket`` onto this rank's rows,
        asynchronously: the handle ``finish_reduce`` completes. The bucket's gradients are read
        now (copied into the collective's buffer, unless one parameter's rows tile it exactly)."""
        per = [self.spans[id(p)][0] for p in bucket]
        width = [self._width(p) for p in bucket]
        seg = sum(r * w for r, w in zip(per, width))
        grads = [self._view(p.grad, p) for p in bucket]
        p0 = bucket[0]
        if len(bucket) == 1 and self._exact(p0, p0.grad):
            full = grads[0].view(-1)  # the rows divide exactly: the gradient itself is the input
        else:
            full = grads[0].new_zeros(self.size * seg)
            at = 0
            for r in range(self.size):
                for g, n, w in zip(grads, per, width):
                    piece = g[:, r * n : (r + 1) * n]
                    full[at : at + piece.numel()].copy_(piece.reshape(-1))
                    at += n * w
        mine = full.new_empty(seg)
        work = None
        if self.size > 1:
            work = _scatter_from(mine, full, group=self.group, async_op=True)
        else:
            mine.copy_(full)
        return work, full, mine, bucket

    def finish_reduce(self, handle: tuple, divide: int = 1) -> None:
        """Wait for a ``launch_reduce`` and give the bucket's masters their gradients: the summed
        rows divided by ``divide``."""
        work, _, mine, bucket = handle  # (the full buffer is held until the collective is done)
        if work is not None:
            work.wait()
        at = 0
        for p in bucket:
            master = self.masters[id(p)]
            master.grad = mine[at : at + master.numel()].view_as(master).div_(divide)
            at += self.spans[id(p)][0] * self._width(p)

    @torch.no_grad()
    def step(self) -> None:
        self.optim.step()
        self.write_back()

    def prepare(self) -> list:
        """LAMB's first pass over this rank's rows (``runtime.lamb.Lamb.prepare``)."""
        return self.optim.prepare()

    @torch.no_grad()
    def apply(self, norms: dict) -> None:
        """LAMB's second pass over this rank's rows with the whole tensors' norms, then the rows
        gathered into the parameters."""
        self.optim.apply(norms)
        self.write_back()

    @torch.no_grad()
    def write_back(self) -> None:
        """Round every rank's masters into its rows and gather the rows into the full
        parameters (after a step, or after a checkpoint was loaded into the masters)."""
        for bucket in self._buckets(self.params[0].element_size() if self.params else 2):
            per = [self.spans[id(p)][0] for p in bucket]
            width = [self._width(p) for p in bucket]
            seg = sum(r * w for r, w in zip(per, width))
            p0 = bucket[0]
            exact = len(bucket) == 1 and self._exact(p0, p0)
            mine = p0.new_zeros(seg)
            at = 0
            for p, n, w in zip(bucket, per, width):
                master = self.masters[id(p)]
                mine[at : at + master.numel()].copy_(master.reshape(-1))
                at += n * w
            full = p0.data.view(-1) if exact else p0.new_empty(self.size * seg)
            if self.size > 1:
                _gather_into(full, mine, group=self.group)
            else:
                full.copy_(mine)
            if exact:
                continue
            at = 0
            for r in range(self.size):
                for p, n, w in zip(bucket, per, width):
                    rows = self._view(p.data, p)[:, r * n : (r + 1) * n]
                    rows.copy_(full[at : at + rows.numel()].view_as(rows))
                    at += n * w
