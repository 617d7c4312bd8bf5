"""Compute time as a roofline over a hardware profile."""

from __future__ import annotations

from autoshard.cost_models.hardware import Hardware


def roofline(
    flops: float, bytes_moved: float, hw: Hardware, dtype: str = "bf16", efficiency: float | None = None
) -> float:
    """Seconds for work of ``flops`` that moves ``bytes_moved`` through HBM: the slower of the
    arithmetic at ``efficiency`` x peak (default: the profile's ``matmul_efficiency``) and the
    memory traffic at the HBM bandwidth."""
    eff = hw.matmul_efficiency if efficiency is None else efficiency
    return max(flops / (hw.peak_flops(dtype) * eff), bytes_moved / (hw.hbm_gbps * 1e9))
