"""The process groups an emitted stage's code communicates over.

Stage code is the same on every rank (``copy_to_tp(x)``, not ``copy_to_tp(x, group=...)``), so the
groups live here: the training program sets them once from its device mesh. With no group set
(one process, or tests of a single rank's graph), every collective is the identity of a size-1
group.
"""

from __future__ import annotations

import torch.distributed as dist

# ep: this rank's expert-parallel group; edp: the ranks holding the same experts (expert data
# parallel); route: every rank that routes the same MoE layers (the stage's tp x cp x dp ranks)
_GROUPS: dict[str, dist.ProcessGroup | None] = {
    "tp": None,
    "pp": None,
    "dp": None,
    "cp": None,
    "ep": None,
    "edp": None,
    "route": None,
}


def set_groups(**groups: dist.ProcessGroup | None) -> None:
    """``set_groups(tp=mesh["tp"].get_group())``; ``None`` clears a group."""
    for name, group in groups.items():
        if name not in _GROUPS:
            raise ValueError(f"unknown process-group axis {name!r}; known: {', '.join(_GROUPS)}")
        _GROUPS[name] = group


def tp_group() -> dist.ProcessGroup | None:
    return _GROUPS["tp"]


def tp_size() -> int:
    group = _GROUPS["tp"]
    return 1 if group is None else dist.get_world_size(group)


def tp_rank() -> int:
    group = _GROUPS["tp"]
    return 0 if group is None else dist.get_rank(group)


def pp_group() -> dist.ProcessGroup | None:
    return _GROUPS["pp"]


def dp_group() -> dist.ProcessGroup | None:
    return _GROUPS["dp"]


def cp_group() -> dist.ProcessGroup | None:
    return _GROUPS["cp"]


def ep_group() -> dist.ProcessGroup | None:
    return _GROUPS["ep"]


def ep_size() -> int:
    group = _GROUPS["ep"]
    return 1 if group is None else dist.get_world_size(group)


def ep_rank() -> int:
    group = _GROUPS["ep"]
    return 0 if group is None else dist.get_rank(group)


def edp_group() -> dist.ProcessGroup | None:
    return _GROUPS["edp"]


def route_group() -> dist.ProcessGroup | None:
    return _GROUPS["route"]
