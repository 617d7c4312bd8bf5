"""GEMM and attention times: the floor the search bounds with stays below the time it bounds, and
wave quantisation charges the idle SMs of a partial wave."""

import itertools

import pytest

from autoshard.cost_models import hardware
from autoshard.cost_models.compute import TILE, attention_time, gemm_floor, gemm_time


@pytest.fixture(scope="module")
def h100():
    return hardware.load("h100")


@pytest.mark.parametrize("fp8", [False, True])
def test_gemm_floor_is_below_gemm_time_and_proportional_to_m(h100, fp8):
    for batch, m, n, k in itertools.product((1, 8), (1, 100, 4096, 65536), (128, 1000, 16384), (64, 8192)):
        floor = gemm_floor(batch, m, n, k, h100, fp8)
        assert 0 < floor <= gemm_time(batch, m, n, k, h100, fp8) * (1 + 1e-12)
        assert gemm_floor(batch, 2 * m, n, k, h100, fp8) == pytest.approx(2 * floor)


def test_a_partial_wave_costs_a_whole_wave(h100):
    # a compute-bound GEMM of 12 x 11 output tiles fills H100's 132 SMs once; one more row of
    # tiles needs a second wave, which runs mostly idle
    assert h100.sm_count == 12 * 11
    one_wave = gemm_time(1, 12 * TILE, 11 * TILE, 8192, h100, False)
    two_waves = gemm_time(1, 12 * TILE + 1, 11 * TILE, 8192, h100, False)
    assert two_waves == pytest.approx(2 * one_wave, rel=2e-3)


def test_short_sequences_slow_attention_down(h100):
    flops = 1e12
    at_long = flops / (h100.peak_flops("bf16") * h100.attention_efficiency)
    assert attention_time(flops, 180, h100) == pytest.approx(2 * at_long)
    assert attention_time(flops, 1e9, h100) == pytest.approx(at_long, rel=1e-6)
    assert attention_time(0, 512, h100) == 0.0
