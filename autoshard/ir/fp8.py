"""The FP8 format autoshard trains with (DeepSeek-V3's blockwise scaling): E4M3 values with one
fp32 scale per 1x128 tile of an activation's rows and per 128x128 block of a weight. The
runtime's emulation, the Triton kernels and the cost model's byte counts all read it here."""

from __future__ import annotations

import torch

TILE = 128  # elements per scaling group along a dimension (1x128 tiles, 128x128 blocks)
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
EPS = 1e-12  # least amax: a group of zeros gets scale EPS / 448 (its values stay 0)
SAVED_BYTES = 1 + 4 / TILE  # bytes per element of a kept FP8 copy: the E4M3 value and its share of a scale


def tile_starts(rows: int, offs: torch.Tensor | None) -> list[int]:
    """First row of every 128x1 tile over ``rows`` rows grouped by ``offs`` (cumulative counts;
    None: one group): tiles restart at each group, so none mixes two experts' tokens."""
    ends = [rows] if offs is None else [int(e) for e in offs.tolist()]
    starts, begin = [], 0
    for end in ends:
        starts.extend(range(begin, end, TILE))
        begin = end
    return starts
