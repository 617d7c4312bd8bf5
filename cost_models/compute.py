"""Compute time over a hardware profile: a roofline, GEMMs with wave quantisation, flash attention."""

from __future__ import annotations

import math

from autoshard.cost_models.hardware import Hardware


def roofline(
    flops: float, bytes_moved: float, hw: Hardware, dtype: str = "bf16", efficiency: float | None = None
) -> float:
    """Seconds for work of ``flops`` that moves ``bytes_moved`` through HBM: the slower of the
    arithmetic at ``efficiency`` x peak (default: the profile's ``matmul_efficiency``) and the
    memory traffic at the HBM bandwidth."""
    eff = hw.matmul_efficiency if efficiency is None else efficiency
    return max(flops / (hw.peak_flops(dtype) * eff), bytes_moved / (hw.hbm_gbps * 1e9))


TILE = 128  # GEMM output tile edge
FLASH_BACKWARD = 2.5  # backward / forward time of flash attention (recomputes QK^T)


def gemm_time(batch: float, m: float, n: float, k: float, hw: Hardware, fp8: bool) -> float:
    """Seconds for ``batch`` GEMMs of (m x k) @ (k x n): a roofline at the profile's matmul
    efficiency, with wave quantisation (128x128 output tiles run in waves of one tile per SM, and
    the last wave and the ragged edge tiles leave SMs idle)."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    flops = 2.0 * batch * m * n * k
    tiles = batch * math.ceil(m / TILE) * math.ceil(n / TILE)
    waves = math.ceil(tiles / hw.sm_count)
    quant = (batch * m * n) / (waves * hw.sm_count * TILE * TILE)
    peak = hw.peak_flops("fp8" if fp8 else "bf16") * (hw.matmul_efficiency_fp8 if fp8 else hw.matmul_efficiency)
    elem = 1 if fp8 else 2
    traffic = batch * ((m * k + k * n) * elem + m * n * 2)
    return max(flops / (peak * quant), traffic / (hw.hbm_gbps * 1e9))


def gemm_floor(batch: float, m: float, n: float, k: float, hw: Hardware, fp8: bool) -> float:
    """A lower bound on ``gemm_time`` for every ``m``, and proportional to it: the arithmetic at
    the best wave quantisation any ``m`` allows (the ragged edge tiles along ``n`` stay), no HBM
    term. ``waves * sm_count`` is at least the tile count, so the quantisation factor of
    ``gemm_time`` never exceeds ``n / (ceil(n / TILE) * TILE)``."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    edge = n / (math.ceil(n / TILE) * TILE)
    peak = hw.peak_flops("fp8" if fp8 else "bf16") * (hw.matmul_efficiency_fp8 if fp8 else hw.matmul_efficiency)
    return 2.0 * batch * m * n * k / (peak * edge)


def attention_time(flops: float, keys: float, hw: Hardware, backward: bool = False, scores: float = 0.0) -> float:
    """Flash attention forward time, or with ``backward`` its backward's. Its speed grows with the
    key length each kernel call sees: FlashAttention-3 on H100 (head dim 128) runs at 72% of its
    long-sequence speed at 512 keys, 87% at 1K and 96% at 2K (Shah et al. 2024, Fig. 5), which
    keys / (keys + 180) matches (the profile's ``attention_half_length``; the backward's own,
    ``attention_backward_half_length``, where its kernel differs, as CPU ones do). The backward's
    matmuls run ``attention_backward`` times the forward's time. Besides the matmuls, the
    softmax works once per score (``scores``: query x key pairs after the mask) at the
    profile's ``attention_score_ns`` (``attention_backward_score_ns``): what makes a small head
    dimension slower per FLOP (FlashAttention-3's exponentials; a CPU kernel's per-score work)."""
    if flops <= 0:
        return 0.0
    half, per_score = hw.attention_half_length, hw.attention_score_ns
    if backward:
        per_score = hw.attention_backward_score_ns
        if hw.attention_backward_half_length is not None:
            half = hw.attention_backward_half_length
    matmuls = flops / (hw.peak_flops("bf16") * hw.attention_efficiency)
    if backward:
        matmuls *= hw.attention_backward
    return (matmuls + scores * per_score * 1e-9) * (keys + half) / keys
