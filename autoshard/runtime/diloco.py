"""DiLoCo islands in the training program (Douillard et al., arXiv 2311.08105; ``Plan.islands``).

The plan's ``dp`` data-parallel ranks split into ``count`` islands by the dp coordinate's outer
part: the device mesh gets an ``island`` dimension just outside ``dp`` (``build_mesh``), so each
island is the plan at ``dp/count`` (``inner_plan``: synchronous DP/ZeRO, gradient reductions and
the loss over the island's ranks only) reading its own ``1/count`` of every global batch. Every
``sync_every`` steps ``OuterStep`` runs over the island group (the ranks at the same place in
every island): the outer gradient of each tensor this rank's optimizer steps is its change since
the last sync, averaged over the islands in one all-reduce; an outer Nesterov SGD step moves the
synced copy, and every island starts again from it. The inner optimizer keeps its state.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from autoshard.ir.plan import Islands, Plan
from autoshard.runtime import fake, groups
from autoshard.runtime.program import Ranks, _flatten


def islands_of(plan: Plan) -> Islands | None:
    """The plan's islands, None for one."""
    return plan.islands if plan.islands is not None and plan.islands.count > 1 else None


def inner_plan(plan: Plan) -> Plan:
    """What one island runs: the plan with ``dp``, the GPUs and the global batch divided by the
    islands."""
    k = plan.islands.count
    mesh = dataclasses.replace(plan.mesh, dp=plan.mesh.dp // k)
    return dataclasses.replace(plan, mesh=mesh, gpus=plan.gpus // k, global_batch=plan.global_batch // k)


def build_mesh(plan: Plan, device_type: str):
    """The plan's device mesh with its dp dimension split into (``island``, ``dp``): the same
    global ranks as ``program.build_mesh`` lays out, dp coordinate ``island * dp/count + dp``.
    Sets the groups (dp: inside the island) and returns (mesh, this rank's ``Ranks`` inside its
    island, its island, the island group, the group of its whole island)."""
    from torch.distributed.device_mesh import init_device_mesh

    m, k = plan.mesh, plan.islands.count
    names, shape = [], []
    for a in reversed(m.order):  # outermost first, as init_device_mesh lays ranks out
        if a == "dp":
            names.append("island")
            shape.append(k)
        names.append(a)
        shape.append(m.dp // k if a == "dp" else getattr(m, a))
    with fake.real():
        mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
        coords = {a: mesh.get_local_rank(a) for a in names}
        island_group = mesh["island"].get_group()
        whole = _flatten(mesh, tuple(a for a in names if a != "island"), "island_world").get_group()
    ranks = Ranks(
        dist.get_world_size(), dist.get_rank(), coords["tp"], coords["pp"], coords["dp"], coords["cp"],
        m.tp, m.pp, m.dp // k,
    )  # fmt: skip
    groups.set_groups(
        tp=mesh["tp"].get_group() if m.tp > 1 else None,
        pp=mesh["pp"].get_group(),
        dp=mesh["dp"].get_group(),
        cp=mesh["cp"].get_group() if m.cp > 1 else None,
    )
    return mesh, ranks, coords["island"], island_group, whole


class OuterStep:
    """The outer optimizer over ``targets`` (the tensors this rank's inner optimizer steps, in
    place): the synced copy of each and its Nesterov momentum (fp32), and the bytes this rank has
    handed to the island all-reduce (``sent_bytes``)."""

    def __init__(self, islands: Islands, targets: list[torch.Tensor], group):
        self.islands, self.targets, self.group = islands, targets, group
        self.synced = [t.detach().float().clone() for t in targets]
        self.momentum = [torch.zeros_like(s) for s in self.synced]
        self.sent_bytes = 0

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (0-based) ends with a sync."""
        return (step + 1) % self.islands.sync_every == 0

    @torch.no_grad()
    def __call__(self) -> None:
        """Average the islands' changes since the last sync and step the synced copy: PyTorch's
        SGD with ``nesterov=True``, dampening 0: ``m = mu*m + g``, ``x -= lr*(g + mu*m)``."""
        if not self.targets:
            return
        flat = torch.cat([(s - t.float()).reshape(-1) for s, t in zip(self.synced, self.targets)])
        dist.all_reduce(flat, group=self.group)
        self.sent_bytes += flat.numel() * flat.element_size()
        flat.div_(self.islands.count)
        lr, mu = self.islands.outer_lr, self.islands.outer_momentum
        for s, m, t, g in zip(self.synced, self.momentum, self.targets, flat.split([s.numel() for s in self.synced])):
            g = g.view_as(s)
            m.mul_(mu).add_(g)
            s.sub_(g.add(m, alpha=mu), alpha=lr)
            t.copy_(s)


def targets(entries) -> list[torch.Tensor]:
    """What the outer step syncs of a rank's ``state.Entry`` list: each trained parameter's
    tensor the inner optimizer steps (the fp32 master, ZeRO-1's rows, an FSDP shard, or the
    parameter)."""
    return [e.held.local for e in entries if isinstance(e.param, nn.Parameter)]
