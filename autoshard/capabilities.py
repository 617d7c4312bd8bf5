"""What the emitted program can run: one table, read by the search and by the emitter.

Each :class:`Limit` is one thing a plan may choose that the program autoshard emits cannot run
yet, with the plan fields it reads, the test, and the reason (naming the ``--force`` or flag that
avoids it). ``compile`` searches only plans no limit blocks (``Problem.emit``), so it never
chooses a plan it then refuses; ``--plan-only`` searches the whole space and writes the reasons
that would keep the chosen plan from being emitted into ``plan.md`` (``Plan.not_emitted``).

The search asks at each level with the fields it knows (``blocked(mesh fields)`` for a mesh,
then the schedule, ZeRO stage and recompute set); a limit is tested once every field it reads is
known. The facts the emitter learns only from the model's graph (a pass that cannot split an op)
reach the search as ``Problem.excluded`` after ``compile``'s dry run of the passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autoshard.runtime.schedules import SPLIT_BACKWARD


@dataclass(frozen=True)
class Limit:
    name: str
    reads: tuple[str, ...]  # plan fields the test needs
    blocks: Callable[..., bool]  # the fields (by name) -> True when the program cannot run them
    reason: Callable[..., str]  # the fields -> why, and what to do instead


def _selective(recompute: frozenset, every: frozenset) -> bool:
    return bool(recompute) and recompute != every


LIMITS: tuple[Limit, ...] = (
    Limit(
        "expert parallelism",
        ("ep",),
        lambda ep: ep > 1,
        lambda ep: (
            f"expert parallelism (EP{ep}) is not emitted yet: the program has no all-to-all token dispatch; "
            "compile with --force ep=1, or use --plan-only to keep it in the plan"
        ),
    ),
    Limit(
        "FP8 matmuls",
        ("fp8",),
        lambda fp8: fp8,
        lambda fp8: (
            "FP8 matmuls are not emitted yet: the program has no blockwise FP8 casts; compile with "
            "--precision bf16 (or --force fp8=off), or use --plan-only to keep them in the plan"
        ),
    ),
    Limit(
        "ZeRO-3 under a split-backward schedule",
        ("zero", "schedule", "pp", "dp", "cp"),
        lambda zero, schedule, pp, dp, cp: zero == 3 and pp > 1 and schedule in SPLIT_BACKWARD and dp * cp > 1,
        # measured: FSDP2 resharding after forward loses the weight gradients computed in the
        # schedule's separate weight-gradient pass (autoshard verify fails); ZeRO-2 is exact
        lambda zero, schedule, pp, dp, cp: (
            f"ZeRO-3 under the {schedule} schedule is not emitted (FSDP2's resharding after forward loses the "
            "weight gradients of the schedule's separate weight-gradient pass); compile with --force zero=2 "
            "or --force schedule=interleaved"
        ),
    ),
    Limit(
        "selective recomputation under a split-backward schedule",
        ("recompute", "every", "schedule", "pp"),
        lambda recompute, every, schedule, pp: pp > 1 and schedule in SPLIT_BACKWARD and _selective(recompute, every),
        lambda recompute, every, schedule, pp: (
            f"selective recomputation under the {schedule} schedule is not emitted (torch's selective "
            "checkpointing allows one backward per region and the schedule splits backward in two); compile "
            "with --force recompute=full, --force recompute=none or --force schedule=interleaved"
        ),
    ),
)


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
    return not blocking(**fields)


def plan_fields(plan) -> dict:
    """The fields the limits read, from an ``autoshard.plan.Plan``."""
    m = plan.mesh
    return {
        "tp": m.tp,
        "pp": m.pp,
        "cp": m.cp,
        "ep": m.ep,
        "dp": m.dp,
        "zero": plan.zero_stage,
        "schedule": plan.schedule,
        "fp8": bool(plan.precision.get("fp8_matmuls")),
        "attention": plan.attention,
        "recompute": plan.recompute,
        "every": frozenset(plan.checkpoint),
    }


def refusals(plan) -> list[str]:
    """Why the program emitter cannot run ``plan`` (empty if it can)."""
    return blocking(**plan_fields(plan))


__all__ = ["Limit", "LIMITS", "blocking", "allows", "plan_fields", "refusals"]
