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
times its ``link_efficiency`` (what NCCL achieves of the nominal rate).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.cost_models.hardware import Hardware


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


def _ring(volume: float, steps: int, where: Placement, hw: Hardware) -> float:
    if where.size <= 1 or volume <= 0:
        return 0.0
    m = where.per_domain(hw)
    nvlink, network = _bandwidths(hw)
    if where.domains(hw) == 1:
        return volume / nvlink + steps * hw.nvlink_latency_us * 1e-6
    bandwidth_time = max(volume / m / network, volume * (m - 1) / m / nvlink)
    return bandwidth_time + steps * hw.network_latency_us * 1e-6


def _bandwidths(hw: Hardware) -> tuple[float, float]:
    """Achievable NVLink and network bytes/s per GPU per direction."""
    return hw.nvlink_gbps * 1e9 * hw.link_efficiency, hw.network_gbps * 1e9 * hw.link_efficiency


def all_reduce(nbytes: float, where: Placement, hw: Hardware) -> float:
    n = where.size
    return _ring(2 * (n - 1) / n * nbytes, 2 * (n - 1), where, hw) if n > 1 else 0.0


def all_gather(nbytes: float, where: Placement, hw: Hardware) -> float:
    n = where.size
    return _ring((n - 1) / n * nbytes, n - 1, where, hw) if n > 1 else 0.0


reduce_scatter = all_gather


def all_to_all(nbytes: float, where: Placement, hw: Hardware) -> float:
    n = where.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    m = where.per_domain(hw)
    nvlink, network = _bandwidths(hw)
    inside = (m - 1) / n * nbytes / nvlink
    outside = (n - m) / n * nbytes / network
    latency = hw.nvlink_latency_us if m == n else hw.network_latency_us
    return max(inside, outside) + (n - 1) * latency * 1e-6


def p2p(nbytes: float, span: int, hw: Hardware) -> float:
    """Send ``nbytes`` to a neighbour; ``span`` GPUs separate the two ends' groups (the stride of
    the pipeline axis). A pipeline that leaves one NVLink domain has its slowest hop on the
    network."""
    if nbytes <= 0:
        return 0.0
    nvlink, network = _bandwidths(hw)
    if span < hw.nvlink_domain:
        return nbytes / nvlink + hw.nvlink_latency_us * 1e-6
    return nbytes / network + hw.network_latency_us * 1e-6
