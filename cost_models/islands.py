"""The price of DiLoCo islands (Douillard et al., arXiv 2311.08105): what crosses the link between
islands (the profile's ``wan_gbps``, ``wan_latency_ms``) per optimizer step, against synchronous
data parallelism whose gradient reduction would cross it every step.

Both are counted per GPU, on a ring over the ``count`` islands (``comm.wire_bytes``), in fp32
(the program's outer gradients and its gradient reductions are fp32):

- **outer step**: every ``sync_every`` steps each GPU all-reduces ``1/(dp/count * cp)`` of its
  tensor- and pipeline-parallel piece (``outer_params``) with the GPUs at its place in the other
  islands: at ZeRO-1/2/3 the rows its optimizer steps; at ZeRO-0, where the island's dp x cp
  ranks hold the same piece, a share of it, gathered back inside the island
  (``runtime.diloco.OuterStep``).
- **synchronous DP across islands**: a gradient reduction that crosses the link as cheaply as it
  can, hierarchically (inside an island first, then each GPU's ``1/(dp/count * cp)`` share of the
  gradient all-reduced over the islands), every step.

A profile without ``wan_gbps`` prices both on its inter-node network (``network_gbps``,
``network_latency_us``).

Where the profile says the run's GPUs span several islands (``wan_island_gpus``), ``choose``
decides from these prices whether to train them as DiLoCo islands and how often to sync.
"""

from __future__ import annotations

import dataclasses
import math

from autoshard.cost_models.comm import wire_bytes
from autoshard.cost_models.hardware import Hardware
from autoshard.ir.plan import Islands, Plan

FP32 = 4


def piece_params(plan: Plan) -> float:
    """Parameters of one GPU's tensor- and pipeline-parallel piece of the model (the mean over
    pipeline stages)."""
    return plan.model["params"] / (plan.mesh.tp * plan.mesh.pp)


def outer_params(plan: Plan, count: int) -> float:
    """Parameters each GPU all-reduces over the islands at an outer step (``runtime.diloco``)."""
    return piece_params(plan) / (plan.mesh.dp // count * plan.mesh.cp)


def link(hw: Hardware) -> tuple[float, float]:
    """(bytes/s, seconds of latency per ring step) of the link between islands."""
    if hw.wan_gbps > 0:
        return hw.wan_gbps * 1e9, hw.wan_latency_ms * 1e-3
    return hw.network_gbps * 1e9 * hw.link_efficiency, hw.network_latency_us * 1e-6


def link_text(hw: Hardware) -> str:
    """The link between islands ``link`` prices, in words."""
    if hw.wan_gbps > 0:
        return f"the profile's link between islands: {hw.wan_gbps:g} GB/s per GPU, {hw.wan_latency_ms:g} ms"
    return (
        f"the profile names no link between islands (wan_gbps): priced on its inter-node network, "
        f"{hw.network_gbps:g} GB/s per GPU"
    )


def all_reduce_s(nbytes: float, count: int, hw: Hardware) -> float:
    """A ring all-reduce of ``nbytes`` over ``count`` islands on the link between them."""
    if count <= 1:
        return 0.0
    rate, latency = link(hw)
    return 2 * (count - 1) * latency + wire_bytes("all_reduce", nbytes, count) / rate


def price(plan: Plan, hw: Hardware, asked: Islands) -> Islands:
    """``asked`` (count, sync_every, the outer optimizer) for ``plan``, with its costs."""
    count, every = asked.count, asked.sync_every
    outer = outer_params(plan, count) * FP32
    grads = piece_params(plan) / (plan.mesh.dp // count * plan.mesh.cp) * FP32
    return dataclasses.replace(
        asked,
        outer_bytes_per_step=wire_bytes("all_reduce", outer, count) / every,
        outer_s_per_step=all_reduce_s(outer, count, hw) / every,
        sync_dp_bytes_per_step=wire_bytes("all_reduce", grads, count),
        sync_dp_s_per_step=all_reduce_s(grads, count, hw),
        link=link_text(hw),
    )


# the share of the predicted step time the amortised outer step may take when compile picks H
OUTER_SHARE = 0.05


def spanned(hw: Hardware, gpus: int) -> int:
    """The islands a run on ``gpus`` GPUs spans by the profile (``wan_island_gpus``); 1: one."""
    per = hw.wan_island_gpus
    if hw.wan_gbps <= 0 or per <= 0 or gpus <= per or gpus % per:
        return 1
    return gpus // per


def choose(plan: Plan, hw: Hardware, count: int, sync_every: int | None = None) -> tuple[Islands | None, str]:
    """Whether ``plan``, spanning ``count`` islands, trains as DiLoCo islands, and why in words.
    Synchronous DP stays where its gradient reduction over the link between islands fits behind
    the step's compute (the program overlaps it with the backward); otherwise islands, syncing
    every ``sync_every`` steps, or by default the fewest steps that keep the amortised outer step
    within ``OUTER_SHARE`` of the step time."""
    sync_s = price(plan, hw, Islands(count=count)).sync_dp_s_per_step
    compute = plan.predicted.compute_s
    if sync_s <= compute:
        return None, (
            f"The run spans {count} islands of the profile's link; synchronous DP over it ({sync_s:.3g} s per step) "
            f"fits behind the step's compute ({compute:.3g} s): no DiLoCo islands."
        )
    outer = price(plan, hw, Islands(count=count, sync_every=1)).outer_s_per_step
    every = sync_every or max(1, math.ceil(outer / (OUTER_SHARE * plan.predicted.step_time_s)))
    why = (
        f"The run spans {count} islands of the profile's link; synchronous DP over it would take {sync_s:.3g} s per "
        f"step, more than the step's compute ({compute:.3g} s): DiLoCo islands, an outer step every {every} steps "
        f"({outer / every:.3g} s per step amortised"
        + (")." if sync_every else f", within {OUTER_SHARE:.0%} of the {plan.predicted.step_time_s:.3g} s step).")
    )
    return price(plan, hw, Islands(count=count, sync_every=every)), why
