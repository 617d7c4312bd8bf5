"""The search's memo tables: one named table per kind of quantity, each saying what its key is.

One ``Memo`` serves a problem's whole search: the per-mesh searches for the alternatives share it
(their pins differ only in the mesh, which every key names), and the forked helper process
inherits it. Some keys name a memoised object by ``id``: a ``Work`` (from ``work``) or an
in-flight tuple (from ``in_flight`` or ``schedule_shapes``); those objects live as long as the
memo does, so their ids are never reused.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _table() -> dict:
    return field(default_factory=dict)


@dataclass
class Memo:
    places: dict = _table()
    """(tp, pp, cp, ep, dp, axis order or None for the best case) -> (layout key, {axis: Where})."""
    work: dict = _table()
    """(tp, pp, cp, ep, dp, mbs, fp8, attention, recompute set, the TP, CP, EP and PP placements,
    EP overlapped) -> Work."""
    work_layers: dict = _table()
    """``work``'s key but ``v`` -> its layers and totals but the pipeline sends (``_work_layers``)."""
    in_flight: dict = _table()
    """(schedule, v, pp, micro-batches) -> per-rank micro-batches in flight (a tuple, the one
    ``in_flight_values`` holds for its value)."""
    in_flight_grads: dict = _table()
    """(schedule, v, pp, micro-batches) -> per-rank micro-batches in flight at a moment every
    chunk has its gradients (``CandidateCosts.in_flight_with_grads``; a tuple as above)."""
    least_grads: dict = _table()
    """(pp, micro-batches) -> the per-rank least of ``in_flight_grads`` over the schedules."""
    in_flight_values: dict = _table()
    """in-flight tuple -> itself: one object per value, so equal counts have one identity."""
    schedule_shapes: dict = _table()
    """(pp, micro-batches) -> ([(schedule row, v, in-flight tuple)], per-rank least in flight)."""
    least_bubble: dict = _table()
    """(pp, micro-batches) -> [(schedule row, v)], each schedule with its most virtual stages."""
    quick: dict = _table()
    """(tp, cp, ep, mbs, fp8, attention) -> the sums ``quick_bound`` needs: (time, least
    activation bytes, head's activation bytes, forward, input-gradient, weight-gradient time)."""
    open_schedule: dict = _table()
    """(ids of the Works by EP overlap, pp, micro-batches, "all" | "fitting" | "bubble") -> the
    least m x t_max + bubble (or bubble alone) over the schedules still open."""
    most_virtual: dict = _table()
    """id of a memoised list of schedule shapes (``schedule_shapes``, ``fitting_shapes``) -> each
    schedule's shape in it with the most virtual stages."""
    open_least: dict = _table()
    """level-2 candidate -> m x its slowest rank's least time over whole layers (``Bounds.schedule_floor``)."""
    fitting_shapes: dict = _table()
    """(tp, pp, cp, ep, dp, mbs, fp8, attention, recompute set, ZeRO stages, micro-batches) -> (the
    schedule shapes that run with that recompute set and pass the memory bound under some stage,
    those stages, the per-rank least in-flight counts over those shapes at the peak and with every
    chunk's gradients): ``Bounds._fitting_shapes`` (memory does not depend on the axis order, so
    every order's node shares them)."""
    shape_arrays: dict = _table()
    """(id of a memoised list of schedule shapes, pp, micro-batches, recompute set, dp x cp) -> the
    shapes that run with that set and their in-flight counts as arrays (``Bounds._shape_arrays``)."""
    dp_traffic: dict = _table()
    """(tp, pp, cp, ep, dp, zero, layout key) -> data-parallel seconds (after backward, before
    forward, per micro-batch) of all the layers."""
    dp_bound: dict = _table()
    """(id(Work), zero, layout key, micro-batches) -> the exposed data-parallel bound."""
    memory_layout: dict = _table()
    """(tp, pp, cp, ep, dp, mbs, fp8, attention, recompute set, zero, gradients made lazily) ->
    (per-block (count, activation bytes, state bytes), their averages, buffers, all states): the
    memory bound's profile."""
    buffers: dict = _table()
    """(id(Work), zero) -> ``CandidateCosts.buffers``: (bytes every rank needs besides states and
    activations, the extra on the head's rank)."""
    memory: dict = _table()
    """``memory_layout`` key + (id(in-flight tuple),) -> the memory lower bound."""
    tmax: dict = _table()
    """(id(Work), zero, (first, last) rank, id(in-flight tuple), EP overlapped) -> the t_max bound."""
    caps: dict = _table()
    """(tp, pp, cp, ep, dp, mbs, fp8, attention, recompute set, zero, (first, last) rank, id(in-flight
    tuple), id(in-flight tuple with gradients)) -> the most layers each rank can hold
    (``Bounds._caps``; None where no split fits)."""
    node_bound: dict = _table()
    """(candidate, level) -> its lower bound (``Bounds.bound``): the per-mesh searches for the
    alternatives meet many of the nodes the main search bounded."""
    leaf: dict = _table()
    """(candidate, fixed stage layers) -> its ``Evaluation`` (CP-SAT's partition): likewise the
    leaves of a neighbouring mesh the main search already evaluated."""
    recompute_keep: dict = _table()
    """(mbs, tp, cp, fp8) -> the recompute sets not dominated in (time, memory) by another."""
