"""What the emitted program can run: one table, read by the search and by the emitter.

Each :class:`Limit` is one thing a plan may choose that the emitted program cannot run, with the
plan fields it reads, the test, and the reason (naming the ``--force`` or flag that avoids it).
Two kinds:

* ``TORCH_LIMITS``: what torch's runtime cannot run at all. The search never chooses these.
* ``EMIT_LIMITS``: what autoshard's emitter does not write yet. ``compile`` searches without
  them (``Problem.emit``), so it never chooses a plan it then refuses; ``--plan-only`` keeps the
  whole space the cost model prices and lists in ``plan.md`` what would keep the chosen plan
  from being emitted, and why (``Plan.not_emitted``).

The search asks with the fields it knows at each level (the mesh, then FP8 and attention, then
the schedule, ZeRO stage and recompute set); a limit is tested once every field it reads is
known. What the passes learn only from the model's graph (an op tensor parallelism cannot split)
reaches the search as ``Problem.excluded``, from ``compile``'s dry run of the passes
(``autoshard.compiler``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autoshard.ir.schedules import SPLIT_BACKWARD


@dataclass(frozen=True)
class Limit:
    name: str
    reads: tuple[str, ...]  # plan fields the test needs
    blocks: Callable[..., bool]  # the fields (by name) -> True when the program cannot run them
    reason: Callable[..., str]  # the fields -> why, and what to do instead


EMIT_LIMITS: tuple[Limit, ...] = (
    Limit(
        "expert tensor parallelism",
        ("etp",),
        lambda etp: etp > 1,
        lambda etp: (
            f"expert tensor parallelism (ETP{etp}) is not emitted: the expert-parallel pass keeps each "
            "expert's weights whole (ETP1) and shares the routed rows among TP ranks instead; use --force etp=1"
        ),
    ),
)
"""What autoshard's emitter does not write yet: ``--plan-only`` keeps these in the search."""

TORCH_LIMITS: tuple[Limit, ...] = (
    Limit(
        "ZeRO-3 under a split-backward schedule",
        ("zero", "schedule", "pp", "dpcp"),
        lambda zero, schedule, pp, dpcp: zero == 3 and pp > 1 and schedule in SPLIT_BACKWARD and dpcp > 1,
        # measured: FSDP2 resharding after forward loses the weight gradients computed in the
        # schedule's separate weight-gradient pass (autoshard verify fails); ZeRO-2 is exact
        lambda zero, schedule, pp, dpcp: (
            f"ZeRO-3 under the {schedule} schedule cannot run (FSDP2's resharding after forward loses the "
            "weight gradients of the schedule's separate weight-gradient pass); use --force zero=2 "
            "or --force schedule=interleaved"
        ),
    ),
)
"""What torch's runtime cannot run at all: the search never chooses these, ``--plan-only`` or not."""

LIMITS: tuple[Limit, ...] = EMIT_LIMITS + TORCH_LIMITS


def blocking(limits: tuple[Limit, ...] = LIMITS, **fields) -> list[str]:
    """The reasons of every limit that the known ``fields`` already decide against."""
    out = []
    for limit in limits:
        if all(k in fields for k in limit.reads):
            args = {k: fields[k] for k in limit.reads}
            if limit.blocks(**args):
                out.append(limit.reason(**args))
    return out


def allows(**fields) -> bool:
    """No limit blocks the known ``fields``."""
    return not blocking(LIMITS, **fields)


def plan_fields(plan) -> dict:
    """The fields the limits read, from an ``autoshard.ir.plan.Plan``."""
    m = plan.mesh
    return {
        "tp": m.tp,
        "pp": m.pp,
        "cp": m.cp,
        "ep": m.ep,
        "etp": getattr(m, "etp", 1),
        "dp": m.dp,
        "dpcp": m.dp * m.cp,
        "zero": plan.zero_stage,
        "schedule": plan.schedule,
        "fp8": tuple(plan.precision.get("fp8_matmuls") or ()),
        "attention": plan.attention,
        "recompute": plan.recompute,
        "every": frozenset(plan.checkpoint),
    }


def refusals(plan) -> list[str]:
    """Why the program emitter cannot run ``plan`` (empty if it can)."""
    return blocking(LIMITS, **plan_fields(plan))


__all__ = ["Limit", "LIMITS", "EMIT_LIMITS", "TORCH_LIMITS", "blocking", "allows", "plan_fields", "refusals"]
