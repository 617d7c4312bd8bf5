"""ZeRO-1 as a distributed optimizer shards it: every parameter split by rows over the ranks of
its data-parallel group, each rank keeping the fp32 master and the AdamW moments of its rows only.

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


def _rows(p: torch.Tensor) -> torch.Tensor:
    """``p`` as (rows, elements per row): dimension 0 is what is split (a scalar is one row)."""
    return p.reshape(p.shape[0] if p.dim() else 1, -1)


class ShardedAdamW:
    """AdamW over this rank's rows of ``params``, the rows split over ``group`` (see the module
    docstring). Used as the program's ZeRO-1 optimizer part: ``reduce_gradients`` once per step
    after the backward, then ``step``."""

    def __init__(self, params: list[nn.Parameter], group, **kwargs):
        self.params = list(params)
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.spans: dict[int, tuple[int, int, int]] = {}  # id(param) -> (rows per rank, first, end)
        self.masters: dict[int, torch.Tensor] = {}  # id(param) -> fp32 copy of this rank's rows
        with torch.no_grad():
            for p in self.params:
                rows = _rows(p).size(0)
                per = math.ceil(rows / self.size)
                lo, hi = min(rows, self.rank * per), min(rows, (self.rank + 1) * per)
                self.spans[id(p)] = (per, lo, hi)
                master = _rows(p)[lo:hi].float().clone()
                self.masters[id(p)] = master.view(hi - lo, *p.shape[1:]) if p.dim() else master.view(hi - lo)
        self.optim = torch.optim.AdamW(list(self.masters.values()), **kwargs)

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

    def rows_of(self, p: torch.Tensor) -> tuple[int, int]:
        """The rows of ``p`` this rank steps."""
        _, lo, hi = self.spans[id(p)]
        return lo, hi

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for m in self.masters.values():
            m.grad = None

    # a step

    def _buckets(self, itemsize: int) -> list[list[nn.Parameter]]:
        out, size = [[]], 0
        for p in self.params:
            per = self.spans[id(p)][0]
            n = per * _rows(p).size(1) * self.size * itemsize
            if out[-1] and size + n > BUCKET_BYTES:
                out.append([])
                size = 0
            out[-1].append(p)
            size += n
        return [b for b in out if b]

    def reduce_gradients(self, divide: int = 1) -> None:
        """Sum the full gradients over the group onto this rank's rows, divided by ``divide``: the
        masters' gradients."""
        grads = {}
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p, dtype=getattr(p, "grad_dtype", None) or p.dtype)
            grads[id(p)] = _rows(p.grad)
        for bucket in self._buckets(4):
            per = [self.spans[id(p)][0] for p in bucket]
            width = [grads[id(p)].size(1) for p in bucket]
            seg = sum(r * w for r, w in zip(per, width))
            dtype = grads[id(bucket[0])].dtype
            g0 = grads[id(bucket[0])]
            if len(bucket) == 1 and per[0] * self.size == g0.size(0) and g0.is_contiguous():
                full = g0.view(-1)  # the rows divide exactly: the gradient itself is the input
            else:
                full = g0.new_zeros(self.size * seg, dtype=dtype)
                at = 0
                for r in range(self.size):
                    for p, n, w in zip(bucket, per, width):
                        piece = grads[id(p)][r * n : (r + 1) * n]
                        full[at : at + piece.numel()].copy_(piece.reshape(-1))
                        at += n * w
            mine = full.new_empty(seg)
            if self.size > 1:
                _scatter_from(mine, full, group=self.group)
            else:
                mine.copy_(full)
            at = 0
            for p, n, w in zip(bucket, per, width):
                master = self.masters[id(p)]
                master.grad = mine[at : at + master.numel()].view_as(master).div_(divide)
                at += n * w

    @torch.no_grad()
    def step(self) -> None:
        self.optim.step()
        self.write_back()

    @torch.no_grad()
    def write_back(self) -> None:
        """Round every rank's masters into its rows and gather the rows into the full
        parameters (after a step, or after a checkpoint was loaded into the masters)."""
        for bucket in self._buckets(self.params[0].element_size() if self.params else 2):
            per = [self.spans[id(p)][0] for p in bucket]
            width = [_rows(p).size(1) for p in bucket]
            seg = sum(r * w for r, w in zip(per, width))
            p0 = bucket[0]
            exact = len(bucket) == 1 and per[0] * self.size == _rows(p0).size(0) and p0.is_contiguous()
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
                    rows = _rows(p.data)[r * n : (r + 1) * n]
                    rows.copy_(full[at : at + rows.numel()].view_as(rows))
                    at += n * w
