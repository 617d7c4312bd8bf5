"""Data-parallel gradient reduction overlapped with the step's last backward (ZeRO-0 and ZeRO-1).

The cost model hides a step's gradient reduction behind the last backward of each rank's
micro-batches (``planner.partition``'s exposure: the reduction's time less that backward's). The
program does that: each parameter's gradient is final once the last backward that adds to it has
accumulated into it (its ``register_post_accumulate_grad_hook`` during the step's last
micro-batch, or after a split backward's last weight pass, which adds into ``.grad`` itself); the
parameters go in buckets, and a bucket's collective starts (``async_op=True``) as soon as its last
gradient is final, while the backward goes on. Before the gradients are read (clipping, the
optimizer step) ``finish`` makes the late ones final and waits for every bucket.

Why not ``DistributedDataParallel``: the program's chunks are run by
``torch.distributed.pipelining`` schedules whose split backward fills the weights' gradients
outside autograd's accumulation (DDP's hooks would fire on the input pass or not at all), ZeRO-1
reduce-scatters into the rows of sharded fp32 masters rather than all-reducing, the stacked expert
weights reduce over the expert-data-parallel group while the rest reduce over dp x cp, and a
sequence-parallel chunk's partial gradients and a tied embedding's copies must first be summed over
the TP group and the pipeline ranks (DDP would reduce them before that). One class serves all:

    reduction = BucketedReduction(params, group, divide=dp)   # ZeRO-0: all-reduce
    reduction = BucketedReduction(params, group, dp, sharded=zero1_optimizer)   # ZeRO-1
    reduction.arm()               # the next backward is the last one of the step
    loss.backward()               # buckets start as their gradients become final
    reduction.finish()            # the rest, then wait: gradients reduced (or the masters')

Buckets follow the order gradients become final: the reverse of the parameters' order (a
backward runs the model backwards) at first; after the first step every rank takes the order
group rank 0 observed (DDP rebuilds its buckets so), and buckets are always started in bucket
order, so every rank issues the same collectives in the same order. The first bucket is small
(``FIRST_BUCKET_BYTES``), so the first reduction starts early, as DDP's is; the others hold at
most a ``MIN_BUCKETS``-th of the gradients (and ``BUCKET_BYTES``): what is left to reduce once the
backward is done is the last bucket, so a small model's gradients in one or two buckets of
DDP's size would leave most of their reduction exposed. A plan names its own bucket size
(``Plan.dp_bucket_bytes``): from the cost model's latency and bandwidth of the collective, where
every bucket's latency shows (processes sharing CPU cores) it takes fewer, larger buckets.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from autoshard.runtime import fake
from autoshard.runtime.zero import BUCKET_BYTES, ShardedAdamW

FIRST_BUCKET_BYTES = 2**20
MIN_BUCKETS = 8


def _grad_dtype(p: nn.Parameter) -> torch.dtype:
    return getattr(p, "grad_dtype", None) or p.dtype


def _grad_bytes(p: nn.Parameter) -> int:
    return p.numel() * _grad_dtype(p).itemsize


def bucket_cap(params: list[nn.Parameter]) -> int:
    """Bytes a bucket after the first holds at most: a ``MIN_BUCKETS``-th of the gradients,
    between ``FIRST_BUCKET_BYTES`` and ``BUCKET_BYTES``."""
    return int(min(BUCKET_BYTES, max(FIRST_BUCKET_BYTES, sum(map(_grad_bytes, params)) / MIN_BUCKETS)))


def plan_buckets(params: list[nn.Parameter], first: int = FIRST_BUCKET_BYTES, cap: int = BUCKET_BYTES) -> list[list]:
    """``params`` in consecutive buckets of one gradient dtype each, the first of at most
    ``first`` bytes, the others of at most ``cap`` (a larger parameter alone)."""
    out, size, limit = [[]], 0, first
    for p in params:
        n = _grad_bytes(p)
        if out[-1] and (size + n > limit or _grad_dtype(out[-1][0]) != _grad_dtype(p)):
            out.append([])
            size, limit = 0, cap
        out[-1].append(p)
        size += n
    return [b for b in out if b]


class BucketedReduction:
    """Sum the gradients of ``params`` over ``group`` and divide them by ``divide`` (all-reduced
    in place; with ``sharded``, ZeRO-1's optimizer, reduce-scattered onto its masters' rows), each
    bucket started once its gradients are final (see the module docstring). ``late`` parameters
    are reduced at ``finish`` only (their gradients change after the backward: a sequence-parallel
    partial sum, a tied copy). ``scale``: what an early gradient is divided by once final, before
    its reduction (the micro-batch count a pipeline schedule's ``scale_grads`` divides by, which
    then must leave ``early`` to this)."""

    def __init__(
        self, params, group, divide: int = 1, sharded: ShardedAdamW | None = None, late=(), scale: int = 1, cap: int = 0
    ):
        self.params = list(params)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.group, self.divide, self.sharded, self.scale = group, divide, sharded, scale
        self.cap = cap  # bytes per bucket after the first (the plan's ``dp_bucket_bytes``); 0: ``bucket_cap``
        self.size = dist.get_world_size(group) if group is not None else 1
        self.sent_bytes = 0  # handed to the all-reduce so far (the step log's ``dp_bytes``)
        late_ids = {id(p) for p in late}
        self.early = {id(p) for p in self.params if id(p) not in late_ids} if self.size > 1 else set()
        self.observed: list[int] | None = []  # indices in the order they became final (first step only)
        self.armed: set[int] = set()  # final once the backward running now has accumulated into them
        self.done: set[int] = set()  # final this step
        self.launched: list[tuple] = []  # handles, in launch order
        self._set_buckets(list(reversed(self.params)))
        self.hooks = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params if id(p) in self.early]

    def _set_buckets(self, ordered: list[nn.Parameter]) -> None:
        cap = self.cap or bucket_cap(ordered)
        self.buckets = plan_buckets(ordered, cap=cap) if self.sharded is None else self._rows_buckets(ordered, cap)
        self.bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.flats: dict[int, torch.Tensor] = {}  # first parameter's id -> its bucket's flat gradients
        self._reset()

    def _reset(self) -> None:
        self.waiting = [len(b) for b in self.buckets]  # parameters of each bucket not final yet
        self.next = 0  # the next bucket to start
        self.armed.clear()
        self.done.clear()

    def _rows_buckets(self, ordered: list[nn.Parameter], cap: int) -> list[list]:
        head = plan_buckets(ordered)[0] if ordered else []  # ZeRO-1: a small first bucket too
        return [head, *self.sharded._buckets(4, ordered[len(head) :], cap)] if head else []

    def arm(self, params=None) -> None:
        """The next backward is the step's last one for ``params`` (default: all): their
        gradients are final once it has accumulated into them."""
        for p in self.params if params is None else params:
            if id(p) in self.early and id(p) not in self.done:
                self.armed.add(id(p))

    def _hook(self, p: nn.Parameter) -> None:
        if id(p) in self.armed:
            self.ready([p])

    def ready(self, params) -> None:
        """``params``' gradients are final (those not armed are skipped): start every bucket, in
        order, whose gradients all are."""
        for p in params:
            if id(p) in self.armed:
                self._final(p)
        self._start()

    def _final(self, p: nn.Parameter) -> None:
        self.armed.discard(id(p))
        self.done.add(id(p))
        if p.grad is None:
            p.grad = torch.zeros_like(p, dtype=_grad_dtype(p))
        elif self.scale != 1 and id(p) in self.early:
            p.grad.div_(self.scale)
        if self.observed is not None:
            self.observed.append(self.index[id(p)])
        self.waiting[self.bucket_of[id(p)]] -= 1

    def _start(self) -> None:
        while self.next < len(self.buckets) and not self.waiting[self.next]:
            self.launched.append(self._launch(self.buckets[self.next]))
            self.next += 1

    def _launch(self, bucket: list[nn.Parameter]) -> tuple:
        if self.sharded is not None:
            return self.sharded.launch_reduce(bucket)
        grads = [p.grad for p in bucket]
        if self.size == 1:  # nothing to sum: each gradient is only divided
            return None, None, bucket
        single = len(grads) == 1 and grads[0].is_contiguous()
        flat = grads[0] if single else self._flat(bucket, grads)
        self.sent_bytes += flat.numel() * flat.element_size()
        return dist.all_reduce(flat, group=self.group, async_op=True), flat, bucket

    def _flat(self, bucket: list[nn.Parameter], grads: list[torch.Tensor]) -> torch.Tensor:
        """The bucket's gradients copied into one flat tensor. On CPUs the bucket's own, kept
        from step to step as DDP keeps its buckets: a fresh one of megabytes is paged in anew
        each step (about 2 ms per 20 MB on one core, against 0.7 ms for the copy alone), where
        a GPU's caching allocator hands back the block it had (and memory is what the plan
        counts: no bucket held through the next forward). A new one where the gradients still
        lie in it (they were not set to None since)."""
        pieces = [g.reshape(-1) for g in grads]
        if grads[0].device.type != "cpu":
            return torch.cat(pieces)
        flat = self.flats.get(id(bucket[0]))
        storage = None if flat is None else flat.untyped_storage().data_ptr()
        if flat is None or any(g.untyped_storage().data_ptr() == storage for g in grads):
            flat = self.flats[id(bucket[0])] = torch.cat(pieces)
            return flat
        return torch.cat(pieces, out=flat)

    def finish(self) -> None:
        """Make every gradient not final yet final, wait for every bucket and divide by
        ``divide``: the gradients are reduced (under ZeRO-1: the masters')."""
        for p in reversed(self.params):
            if id(p) not in self.done:
                self.armed.add(id(p))
                self._final(p)
        self._start()
        for handle in self.launched:
            self._complete(handle)
        self.launched = []
        self._rebuild()
        self._reset()

    def _complete(self, handle: tuple) -> None:
        if self.sharded is not None:
            self.sharded.finish_reduce(handle, self.divide)
            return
        work, flat, bucket = handle
        if work is None:
            if self.divide != 1:
                for p in bucket:
                    p.grad.div_(self.divide)
            return
        work.wait()
        if self.divide != 1:
            flat.div_(self.divide)
        if flat is not bucket[0].grad:  # the parameters take their pieces of the sum (no copy back)
            offset = 0
            for p in bucket:
                n = p.grad.numel()
                p.grad = flat[offset : offset + n].view_as(p.grad)
                offset += n

    def _rebuild(self) -> None:
        """After the first step: buckets in the order group rank 0 saw the gradients become
        final (broadcast, so that every rank's buckets and collectives agree); then fixed."""
        observed, self.observed = self.observed, None
        if observed is None or not self.params:
            return
        if self.size > 1 and not fake.active():  # (a fake group delivers nothing: each keeps its own)
            order = torch.tensor(observed, dtype=torch.long, device=self.params[0].device)
            dist.broadcast(order, src=dist.get_global_rank(self.group, 0), group=self.group)
            observed = order.tolist()
        self._set_buckets([self.params[i] for i in observed])

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
