"""Collective times by the link a mesh axis lands on.

A mesh axis of ``size`` ranks whose neighbours are ``stride`` GPUs apart (the product of the
axes inside it) puts ``m`` of its ranks in each NVLink domain and spans ``k = size / m`` domains.
Inside one domain everything runs on NVLink. Across domains NCCL runs one ring per NIC, so each
rank's share of the inter-node traffic goes over its own NIC: the time is the slower of the
network part (1/m of the data per rank) and the NVLink part ((m-1)/m of it).

Formulas, for B bytes (the full tensor on each rank) and n ranks:
  all-reduce       2(n-1)/n * B          (ring: reduce-scatter then all-gather)
  all-gather       (n-1)/n * B           (B = the gathered size)
  reduce-scatter   (n-1)/n * B           (B = the size before scattering)
  all-to-all       (n-1)/n * B           (B = what one rank sends), split by where the peers are
  p2p              B
each plus a per-step latency (one step per ring hop). Bandwidths are the profile's link rates
times its ``link_efficiency`` (what NCCL achieves of the nominal rate); inside one domain a
profile's measured figures for a collective (``Hardware.collectives``, written by ``autoshard
calibrate``: the bytes these formulas count per second, and the per-step latency) replace them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np

from autoshard.cost_models.hardware import Hardware
from autoshard.cost_models.memory import GRAD_REDUCE_BYTES

PARAM_GATHER_BYTES = 2  # bf16 parameters


@dataclass(frozen=True)
class Placement:
    """Where the ranks of one mesh axis sit."""

    size: int
    stride: int = 1

    def per_domain(self, hw: Hardware) -> int:
        if self.stride >= hw.nvlink_domain:
            return 1
        return max(1, min(self.size, hw.nvlink_domain // self.stride))

    def domains(self, hw: Hardware) -> int:
        return -(-self.size // self.per_domain(hw))

    def link(self, hw: Hardware) -> str:
        return "nvlink" if self.domains(hw) == 1 else "network"


@dataclass(frozen=True, eq=False)
class Where:
    """How a group of ranks sits on the NVLink domains: a ``Placement`` given by its layout, not
    its stride, so that it also describes groups that are not one strided axis (dp x cp, the
    expert groups).

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

    def placement(self) -> Placement:
        return _placement(self.size, self.per_domain, self.domains)


@cache
def _placement(size: int, per_domain: int, domains: int) -> Placement:
    return _Laid(size, per_domain, domains)


@cache
def _grid(axes, domain, take, every) -> Where:
    # the group's ranks, innermost axis fastest, as arrays: a group can hold every one of 16,384
    # ranks, and the search lays out a few thousand groups
    ranks = np.zeros(1, dtype=np.int64)
    for size, stride in axes:
        ranks = (np.arange(size, dtype=np.int64)[:, None] * stride + ranks[None, :]).ravel()
    ranks = ranks[::every][:take]
    counts = np.bincount(ranks // domain)
    counts = counts[counts > 0]
    value = (len(ranks), int(counts.max()), len(counts))
    if value not in _WHERE:
        _WHERE[value] = Where(*value)
    return _WHERE[value]


_WHERE: dict[tuple[int, int, int], Where] = {}  # one object per value


class _Laid(Placement):
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


def _ring(volume: float, steps: int, where: Placement, hw: Hardware, kind: str) -> float:
    if where.size <= 1 or volume <= 0:
        return 0.0
    m = where.per_domain(hw)
    nvlink, network = _bandwidths(hw, kind)
    if where.domains(hw) == 1:
        return volume / nvlink + steps * hw.link_latency_us(kind) * 1e-6
    bandwidth_time = max(volume / m / network, volume * (m - 1) / m / nvlink)
    return bandwidth_time + steps * hw.network_latency_us * 1e-6


def _bandwidths(hw: Hardware, kind: str) -> tuple[float, float]:
    """Achievable bytes/s per GPU per direction of a ``kind`` collective inside a domain and
    across the network."""
    return hw.link_rate(kind), hw.network_gbps * 1e9 * hw.link_efficiency


def all_reduce(nbytes: float, where: Placement, hw: Hardware) -> float:
    n = where.size
    return _ring(2 * (n - 1) / n * nbytes, 2 * (n - 1), where, hw, "all_reduce") if n > 1 else 0.0


def all_gather(nbytes: float, where: Placement, hw: Hardware) -> float:
    n = where.size
    return _ring((n - 1) / n * nbytes, n - 1, where, hw, "all_gather") if n > 1 else 0.0


def reduce_scatter(nbytes: float, where: Placement, hw: Hardware) -> float:
    n = where.size
    return _ring((n - 1) / n * nbytes, n - 1, where, hw, "reduce_scatter") if n > 1 else 0.0


def all_to_all(nbytes: float, where: Placement, hw: Hardware) -> float:
    n = where.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    m = where.per_domain(hw)
    nvlink, network = _bandwidths(hw, "all_to_all")
    inside = (m - 1) / n * nbytes / nvlink
    outside = (n - m) / n * nbytes / network
    latency = hw.link_latency_us("all_to_all") if m == n else hw.network_latency_us
    return max(inside, outside) + (n - 1) * latency * 1e-6


def bucket_bytes(grad_bytes: float, zero: int, where: Where, hw: Hardware, least: float, most: float) -> int:
    """Bytes per gradient bucket of a data-parallel reduction of ``grad_bytes`` (ZeRO-0: all-reduce,
    ZeRO-1: reduce-scatter) over ``where``, between ``least`` and ``most``. What a step shows of it
    is at least the last bucket's transfer (nothing is left to hide it behind) plus every
    bucket's latency where the link's latency does not hide: k buckets of b = G / k bytes cost
    about k x latency + b / bandwidth, least at b = sqrt(G x latency x bandwidth). A link with
    a large latency per collective (processes on shared CPU cores) wants few large buckets, a
    fast one many small ones."""
    reduce = all_reduce if zero == 0 else reduce_scatter
    place = where.placement()
    latency = reduce(1.0, place, hw)
    if latency <= 0 or grad_bytes <= 0:
        return int(most)
    per_byte = max(1e-30, (reduce(grad_bytes, place, hw) - latency) / grad_bytes)
    return int(min(most, max(least, math.sqrt(grad_bytes * latency / per_byte))))


def p2p(nbytes: float, span: int, hw: Hardware) -> float:
    """Send ``nbytes`` to a neighbour; ``span`` GPUs separate the two ends' groups (the stride of
    the pipeline axis). A pipeline that leaves one NVLink domain has its slowest hop on the
    network."""
    if nbytes <= 0:
        return 0.0
    nvlink, network = _bandwidths(hw, "send")
    if span < hw.nvlink_domain:
        return nbytes / nvlink + hw.link_latency_us("send") * 1e-6
    return nbytes / network + hw.network_latency_us * 1e-6


def pipeline_ends_all_reduce(nbytes: float, pp: Where, hw: Hardware) -> float:
    """All-reduce of ``nbytes`` between the first and the last rank of a pipeline laid out as
    ``pp`` (the gradient of a parameter both ends hold, such as an embedding tied to the head):
    two ranks, on NVLink where the pipeline stays in one domain, else on the network."""
    inside = pp.domains == 1
    return all_reduce(nbytes, _placement(2, 2 if inside else 1, 1 if inside else 2), hw)


# What data parallelism moves at each ZeRO stage: (when, collective, bytes per parameter, times).
# Gradients are all-reduced (ZeRO-0) or reduce-scattered (ZeRO-1) in fp32 once per step;
# parameters all-gathered in bf16 after the step. ZeRO-2 keeps only a gradient shard, so it
# reduce-scatters after every micro-batch; ZeRO-3 also re-gathers the parameters for every
# micro-batch's forward and backward.
DP_TRANSFERS = {
    0: (("after_backward", "all_reduce", GRAD_REDUCE_BYTES, 1),),
    1: (
        ("after_backward", "reduce_scatter", GRAD_REDUCE_BYTES, 1),
        ("before_forward", "all_gather", PARAM_GATHER_BYTES, 1),
    ),
    2: (
        ("per_microbatch", "reduce_scatter", GRAD_REDUCE_BYTES, 1),
        ("before_forward", "all_gather", PARAM_GATHER_BYTES, 1),
    ),
    3: (
        ("per_microbatch", "all_gather", PARAM_GATHER_BYTES, 2),
        ("per_microbatch", "reduce_scatter", GRAD_REDUCE_BYTES, 1),
    ),
}
_KIND_TIME = {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter}


def data_parallel(
    params_dense: float, params_expert: float, zero: int, dense: Where, expert: Where, hw: Hardware
) -> dict:
    """Per-step data-parallel communication of one GPU holding these parameters, the dense ones
    reduced over the ``dense`` group (dp x cp) and the routed experts' over ``expert``, the
    expert-data-parallel group (the ranks of a stage's tp x cp x dp that hold the same experts,
    ``tp*cp*dp/ep`` of them; with TP in it, its members hold the experts' gradients from
    different TP ranks' tokens, so the sum runs over it all): ``after_backward`` (gradient
    reduction), ``before_forward`` (parameter gather), ``per_microbatch`` (ZeRO-2/3's reductions
    and re-gathers), as ``DP_TRANSFERS`` lists them."""
    out = {"after_backward": 0.0, "before_forward": 0.0, "per_microbatch": 0.0}
    for params, group in ((params_dense, dense), (params_expert, expert)):
        if group.size <= 1 or params <= 0:
            continue
        place = group.placement()
        for when, kind, per_param, times in DP_TRANSFERS[zero]:
            out[when] += times * _KIND_TIME[kind](params * per_param, place, hw)
    return out


def data_parallel_payload(params: float, zero: int, group_size: int, microbatches: int) -> list[tuple[str, float]]:
    """(collective, bytes handed over per step) of the data-parallel traffic of ``params``
    parameters replicated over ``group_size`` ranks, as ``DP_TRANSFERS`` lists it."""
    if group_size <= 1 or params <= 0:
        return []
    return [
        (kind, times * params * per_param * (microbatches if when == "per_microbatch" else 1))
        for when, kind, per_param, times in DP_TRANSFERS[zero]
    ]


def wire_bytes(kind: str, nbytes: float, ranks: int) -> float:
    """Bytes one rank sends for a collective handed ``nbytes`` (as ``data_parallel_payload`` and
    ``LayerCosts.payload`` count them) over ``ranks`` ranks, on a ring: what its time is made of,
    and what makes an all-reduce and a reduce-scatter with an all-gather comparable."""
    if kind in ("send",):
        return nbytes
    if ranks <= 1 or kind == "recv":
        return 0.0
    share = (ranks - 1) / ranks
    return 2 * share * nbytes if kind == "all_reduce" else share * nbytes
