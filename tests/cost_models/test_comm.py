"""Collective times worked by hand: 1 GB tensors, H100 (450 GB/s NVLink, 50 GB/s network, both at
the profile's 80% link efficiency: 360 and 40 GB/s achieved)."""

import pytest

from autoshard.cost_models import comm, hardware
from autoshard.cost_models.compute import roofline

GB = 1e9


@pytest.fixture(scope="module")
def h100():
    return hardware.load("h100")


def lat(hw, steps, link="nvlink"):
    return steps * (hw.nvlink_latency_us if link == "nvlink" else hw.network_latency_us) * 1e-6


def test_ring_all_reduce_inside_a_node(h100):
    # 2(N-1)/N x bytes / bandwidth: 2 * 7/8 * 1 GB / 450 GB/s
    expected = 2 * 7 / 8 * GB / 360e9 + lat(h100, 14)
    assert comm.all_reduce(GB, comm.Placement(8, 1), h100) == pytest.approx(expected)


def test_all_reduce_across_nodes_is_network_bound(h100):
    # DP outermost: one rank per node, every hop on the 50 GB/s network.
    expected = 2 * 63 / 64 * GB / 40e9 + lat(h100, 126, "network")
    assert comm.all_reduce(GB, comm.Placement(64, 8), h100) == pytest.approx(expected)
    # 16 ranks packed 8 per node: each rank's NIC carries 1/8 of the ring traffic.
    packed = comm.all_reduce(GB, comm.Placement(16, 1), h100)
    assert packed == pytest.approx(2 * 15 / 16 * GB / 8 / 40e9 + lat(h100, 30, "network"))


def test_all_gather_and_reduce_scatter_are_half_an_all_reduce(h100):
    where = comm.Placement(8, 1)
    assert comm.all_gather(GB, where, h100) == pytest.approx(7 / 8 * GB / 360e9 + lat(h100, 7))
    assert comm.reduce_scatter(GB, where, h100) == comm.all_gather(GB, where, h100)


def test_all_to_all_splits_traffic_by_link(h100):
    # 64 ranks, 8 per node: 7/64 of the data on NVLink, 56/64 on the network (the bottleneck).
    t = comm.all_to_all(GB, comm.Placement(64, 1), h100)
    assert t == pytest.approx(56 / 64 * GB / 40e9 + lat(h100, 63, "network"))


def test_p2p_link_depends_on_span(h100):
    assert comm.p2p(GB, 1, h100) == pytest.approx(GB / 360e9 + lat(h100, 1))
    assert comm.p2p(GB, 8, h100) == pytest.approx(GB / 40e9 + lat(h100, 1, "network"))


def test_single_rank_costs_nothing(h100):
    assert comm.all_reduce(GB, comm.Placement(1), h100) == 0


def test_roofline(h100):
    # 1 TFLOP of matmul at 80.3% of 989 TFLOP/s; 1 GB of pointwise traffic at 3.35 TB/s.
    assert roofline(1e12, 1e6, h100) == pytest.approx(1e12 / (989e12 * 0.803))
    assert roofline(1e6, 1e9, h100) == pytest.approx(1e9 / 3350e9)


def test_expert_gradients_are_reduced_over_the_expert_data_parallel_group(h100):
    """Dense gradients go over dp x cp, the experts' over their EDP group alone: none where every
    rank of the stage holds different experts (EDP 1), a reduce-scatter over the group otherwise."""
    dense = comm.Where.grid(((32, 2),), h100.nvlink_domain)
    alone = comm.Where.grid(((1, 1),), h100.nvlink_domain)
    pair = comm.Where.grid(((2, 64),), h100.nvlink_domain)
    assert comm.data_parallel(0.0, GB, 1, dense, alone, h100)["after_backward"] == 0.0
    reduced = comm.data_parallel(0.0, GB, 1, dense, pair, h100)["after_backward"]
    grads = GB * comm.GRAD_REDUCE_BYTES
    assert reduced == pytest.approx(comm.reduce_scatter(grads, pair.placement(), h100))
    both = comm.data_parallel(GB, GB, 1, dense, pair, h100)["after_backward"]
    assert both == pytest.approx(reduced + comm.reduce_scatter(grads, dense.placement(), h100))


def test_bucket_size_balances_latency_against_the_last_buckets_transfer(h100):
    """k buckets of G / k bytes show about k x latency + G / k / bandwidth: least at
    b = sqrt(G x latency x bandwidth), worked by hand; a slower latency wants larger buckets,
    and the size stays between the bounds given."""
    from dataclasses import replace

    where = comm.Where.grid(((8, 1),), h100.nvlink_domain)
    grads = 2e9
    latency = 2 * 7 * h100.nvlink_latency_us * 1e-6  # a ring all-reduce over 8 ranks: 14 steps
    per_byte = 2 * 7 / 8 / (h100.nvlink_gbps * 1e9 * h100.link_efficiency)
    best = (grads * latency / per_byte) ** 0.5
    assert comm.bucket_bytes(grads, 0, where, h100, 1, 1e12) == pytest.approx(best, rel=1e-6)
    slow = replace(h100, nvlink_latency_us=100 * h100.nvlink_latency_us)
    assert comm.bucket_bytes(grads, 0, where, slow, 1, 1e12) == pytest.approx(10 * best, rel=1e-6)
    assert comm.bucket_bytes(grads, 0, where, slow, 1, 2**20) == 2**20
    assert comm.bucket_bytes(1e3, 0, where, h100, 2**20, 2**26) == 2**20
