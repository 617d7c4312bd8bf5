"""Back-of-the-envelope training cost: 6ND FLOPs (Kaplan et al. 2020), GPU time at an MFU, price,
and the memory model states need."""

from __future__ import annotations

import math

from autoshard.cost_models.hardware import Hardware
from autoshard.cost_models.memory import BYTES_PER_PARAM, model_state_bytes

HOURS_PER_YEAR = 365.25 * 24


def estimate(
    params: float,
    tokens: float,
    hw: Hardware,
    mfu: float = 0.5,
    gpus: int | None = None,
    zero: int = 3,
    dtype: str = "bf16",
) -> dict[str, float]:
    flops = 6 * params * tokens
    gpu_seconds = flops / (hw.peak_flops(dtype) * mfu)
    gpu_hours = gpu_seconds / 3600
    states = params * BYTES_PER_PARAM
    out = {
        "flops": flops,
        "model_state_bytes": states,
        "gpus_for_model_states": math.ceil(states / hw.hbm_bytes),
        "gpu_hours": gpu_hours,
        "gpu_years": gpu_hours / HOURS_PER_YEAR,
        "cost_usd": gpu_hours * hw.price_per_gpu_hour,
    }
    if gpus is not None:
        out["model_state_bytes_per_gpu"] = model_state_bytes(params, zero, gpus)["total"]
        out["wall_clock_days"] = gpu_hours / gpus / 24
    return out
