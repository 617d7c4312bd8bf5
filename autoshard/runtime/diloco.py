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
from autoshard.runtime.state import split_duplicates


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
    handed to the island all-reduce (``sent_bytes``). ``share``: the ranks of this island that
    hold the same tensors (ZeRO-0's dp x cp replicas): each all-reduces its ``1/n`` of the outer
    gradient over the islands and they gather the rest from each other, inside the island, so
    that what crosses between islands is the model once per island, not once per replica."""

    def __init__(self, islands: Islands, entries: list, group, island: int, share=None):
        self.islands, self.group, self.island = islands, group, island
        self.share = share if share is not None and dist.get_world_size(share) > 1 else None
        self.entries = [e for e in entries if isinstance(e.param, nn.Parameter)]
        self.sent_bytes = 0
        self.restored = False  # the last checkpoint loaded held the outer state
        self.reset()

    @property
    def targets(self) -> list[torch.Tensor]:
        """Each trained parameter's tensor the inner optimizer steps (the fp32 master, ZeRO-1's
        rows, an FSDP shard, or the parameter)."""
        return [e.held.local for e in self.entries]

    def reset(self) -> None:
        """Sync from where the parameters stand, with no momentum (the start)."""
        self.synced = [t.detach().float().clone() for t in self.targets]
        self.momentum = [torch.zeros_like(s) for s in self.synced]

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
        flat = self._all_reduce(flat).div_(self.islands.count)
        lr, mu = self.islands.outer_lr, self.islands.outer_momentum
        for s, m, t, g in zip(self.synced, self.momentum, self.targets, flat.split([s.numel() for s in self.synced])):
            g = g.view_as(s)
            m.mul_(mu).add_(g)
            s.sub_(g.add(m, alpha=mu), alpha=lr)
            t.copy_(s)

    def _all_reduce(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` summed over the islands (this rank's share of it, then gathered in the island)."""
        if self.share is None:
            dist.all_reduce(flat, group=self.group)
            self.sent_bytes += flat.numel() * flat.element_size()
            return flat
        n, me = dist.get_world_size(self.share), dist.get_rank(self.share)
        size = -(-flat.numel() // n)
        parts = list(torch.nn.functional.pad(flat, (0, size * n - flat.numel())).split(size))
        mine = parts[me].clone()
        dist.all_reduce(mine, group=self.group)
        self.sent_bytes += mine.numel() * mine.element_size()
        dist.all_gather(parts, mine, group=self.share)
        return torch.cat(parts)[: flat.numel()]

    # -- checkpoints: island 0's parameters and inner optimizer states under their usual keys
    # (what ``autoshard export`` and a plan without islands read), each other island's under
    # ``island<i>/``; the outer state (the same in every island) under ``outer/``, from island 0

    def state(self, copy: bool) -> dict:
        """The outer state to save, in DCP form: the synced copy and the momentum of the
        counted pieces (``state.Entry.counted``), from island 0."""
        if self.island != 0:
            return {}
        out = {}
        for e, s, m in zip(self.entries, self.synced, self.momentum):
            if e.counted:
                out[f"outer/synced/{e.held.key}"] = e.held.pieces(copy, s)
                out[f"outer/momentum/{e.held.key}"] = e.held.pieces(copy, m)
        return out

    def load_passes(self, passes: list[dict], saved: dict, raw: dict) -> list[dict]:
        """DCP load passes (``state.load_targets``'s, in the usual keys) for this island of
        checkpoint keys ``raw`` (``saved``: as ``own_keys`` reads them): its own ``island<i>/``
        keys where it has them (else island 0's: a checkpoint written by fewer islands or none),
        and the outer state where it has it (else the outer step starts from the loaded
        parameters: ``restored`` is false)."""
        prefix = f"island{self.island}/"
        passes = [{(prefix + k if prefix + k in raw else k): v for k, v in p.items()} for p in passes]
        wanted: dict[str, list] = {}
        for e, s, m in zip(self.entries, self.synced, self.momentum):
            if f"outer/synced/{e.held.key}" in saved:
                wanted.setdefault(f"outer/synced/{e.held.key}", []).append(e.held.pieces(False, s))
                wanted.setdefault(f"outer/momentum/{e.held.key}", []).append(e.held.pieces(False, m))
        self.restored = bool(wanted)
        for i, extra in enumerate(split_duplicates(wanted)):
            if i == len(passes):
                passes.append({})
            passes[i].update(extra)
        return passes


def island_keys(state: dict, island: int) -> dict:
    """``state``'s parameters and optimizer states (``model/``, ``optim/``) under ``island<i>/``
    (island 0's as they are)."""
    if island == 0:
        return state
    return {(f"island{island}/{k}" if k.startswith(("model/", "optim/")) else k): v for k, v in state.items()}


def own_keys(saved: dict, island: int) -> dict:
    """A checkpoint's keys (``state.saved_keys``) as island ``island`` reads them: its own
    ``island<i>/`` keys without the prefix, over the usual ones (island 0's, or a run's without
    islands), no other island's."""
    prefix = f"island{island}/"
    plain = {k: v for k, v in saved.items() if not k.startswith("island")}
    return {**plain, **{k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}}
