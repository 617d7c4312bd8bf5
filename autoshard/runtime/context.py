"""What the context-parallel pass puts in the graph: the CP layout of sequences and positions,
attention over the whole sequence, and the loss's share of a sequence-wide mean. Identities on a
CP group of one."""

from __future__ import annotations

import torch
import torch.distributed as dist

from autoshard.runtime.collectives import vocab_parallel_cross_entropy
from autoshard.runtime.groups import cp_group
from autoshard.runtime.ring_attention import allgather_attention, ring_attention, shard_sequence


def _cp() -> tuple[int, int]:
    group = cp_group()
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


def cp_shard(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's chunks (``rank`` and ``2*cp-1-rank`` of ``2*cp``) of a whole sequence."""
    cp, rank = _cp()
    return x if cp == 1 else shard_sequence(x, cp, rank, dim=dim)


def cp_positions(local_length, device=None) -> torch.Tensor:
    """Global positions of this rank's chunks, for a local sequence of ``local_length``."""
    cp, rank = _cp()
    positions = torch.arange(local_length * cp, device=device)
    return positions if cp == 1 else shard_sequence(positions, cp, rank, dim=0)


def cp_attention(q, k, v, variant: str = "ring", scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over every rank's keys (the last ``window``
    positions' only, for a sliding window)."""
    fn = ring_attention if variant == "ring" else allgather_attention
    return fn(q, k, v, group=cp_group(), causal=True, scale=scale, window=window)


def cp_cross_entropy(logits, target, ignore_index: int = -100, vocab_parallel: bool = False) -> torch.Tensor:
    """This rank's part of the mean cross-entropy over the whole sequence: the sum over its tokens
    divided by the count over all CP ranks (so the ranks' values and gradients add up)."""
    if vocab_parallel:
        total = vocab_parallel_cross_entropy(logits, target, ignore_index, reduction="sum")
    else:
        total = torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
    count = (target != ignore_index).sum().to(total.dtype)
    group = cp_group()
    if group is not None:
        dist.all_reduce(count, group=group)
    return total / count
