"""What emitted training programs import: process groups, autograd-aware collectives and the
vocabulary-parallel embedding and loss. Depends on torch only."""

from autoshard.runtime.attention import fused_attention
from autoshard.runtime.checkpoint import Checkpoint
from autoshard.runtime.collectives import (
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)
from autoshard.runtime.context import cp_attention, cp_cross_entropy, cp_positions, cp_shard
from autoshard.runtime.groups import set_groups, tp_group, tp_rank, tp_size
from autoshard.runtime.stages import size_of

__all__ = [
    "Checkpoint",
    "cp_attention",
    "cp_cross_entropy",
    "cp_positions",
    "cp_shard",
    "fused_attention",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_sp",
    "scatter_to_sp",
    "reduce_scatter_to_sp",
    "vocab_parallel_embedding",
    "vocab_parallel_cross_entropy",
    "set_groups",
    "size_of",
    "tp_group",
    "tp_rank",
    "tp_size",
]
