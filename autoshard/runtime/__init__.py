"""What emitted programs import. Depends on torch only (never on the planner, the passes or codegen).

The public names below are what an emitted stage file calls, as ``rt.<name>``:

building a stage (``__init__``, on the meta device; the training program fills the parameters)
    ``put_module``, ``put_parameter``, ``put_buffer``: attach a layer, a parameter or a buffer at
    the single-device model's dotted name (``model.layers.0.attn.wq``), creating the containers on
    the way; ``Checkpoint``: a layer's forward under the plan's selective recomputation.
tensor and sequence parallelism (the autograd-aware collectives over the TP group)
    ``copy_to_tp``, ``reduce_from_tp``, ``gather_from_sp``, ``scatter_to_sp``,
    ``reduce_scatter_to_sp``, ``gather_tokens``, ``reduce_scatter_tokens`` (the same on rows of
    flattened batch and sequence), ``vocab_parallel_embedding``, ``vocab_parallel_cross_entropy``.
context parallelism
    ``cp_shard``, ``cp_positions``, ``cp_attention``, ``cp_cross_entropy``.
mixture of experts (``autoshard.runtime.moe``)
    ``moe_grouped_mm`` (rows grouped by expert times stacked weights), ``moe_dispatch`` /
    ``moe_combine`` (dropless all-to-all over the EP group, counts first), ``moe_dispatch_buffer`` /
    ``moe_combine_buffer`` (fixed-capacity buffers), ``moe_tp_share`` / ``moe_tp_unshare`` and their
    ``_buffer`` forms (each TP rank's share of the routed rows), ``moe_record_load`` (expert loads
    for balancing), ``moe_balance_loss`` (an optional balance loss attached to the routed rows).
FP8 matmuls (``autoshard.runtime.fp8``: 1x128 / 128x128 E4M3 scaling, fp32 accumulation, the three GEMMs)
    ``fp8_linear`` (``x @ w.T + b``), ``fp8_matmul`` (``x @ w``, also stacked experts), ``fp8_addmm``,
    ``fp8_grouped_mm``.
attention, norms and graph helpers
    ``fused_attention`` (Triton FlashAttention on CUDA, SDPA elsewhere), ``rms_norm`` and
    ``layer_norm`` (one op each, fp32 inside, keeping their input and statistics), ``size_of``,
    ``to_compute`` (a cast to the program's compute dtype).
process groups (set once by the training program from its device mesh)
    ``set_groups``, ``tp_group``, ``tp_rank``, ``tp_size``.

The training program itself is ``autoshard.runtime.trainer`` (an emitted ``train.py`` calls its
``main``), built from ``program`` (mesh, chunks, data parallelism, data), ``stages`` (loading and
materialising stage files) and ``schedules`` (the pipeline schedule table).
"""

from autoshard.runtime.attention import fused_attention
from autoshard.runtime.checkpoint import Checkpoint
from autoshard.runtime.collectives import (
    copy_to_tp,
    gather_from_sp,
    gather_tokens,
    reduce_from_tp,
    reduce_scatter_to_sp,
    reduce_scatter_tokens,
    scatter_to_sp,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)
from autoshard.runtime.context import cp_attention, cp_cross_entropy, cp_positions, cp_shard
from autoshard.runtime.fp8 import fp8_addmm, fp8_grouped_mm, fp8_linear, fp8_matmul
from autoshard.runtime.groups import set_groups, tp_group, tp_rank, tp_size
from autoshard.runtime.moe import balance_loss as moe_balance_loss
from autoshard.runtime.moe import combine as moe_combine
from autoshard.runtime.moe import combine_buffer as moe_combine_buffer
from autoshard.runtime.moe import dispatch as moe_dispatch
from autoshard.runtime.moe import dispatch_buffer as moe_dispatch_buffer
from autoshard.runtime.moe import grouped_mm as moe_grouped_mm
from autoshard.runtime.moe import record_load as moe_record_load
from autoshard.runtime.moe import tp_share as moe_tp_share
from autoshard.runtime.moe import tp_share_buffer as moe_tp_share_buffer
from autoshard.runtime.moe import tp_unshare as moe_tp_unshare
from autoshard.runtime.moe import tp_unshare_buffer as moe_tp_unshare_buffer
from autoshard.runtime.norms import layer_norm, rms_norm
from autoshard.runtime.stages import put_buffer, put_module, put_parameter, size_of, to_compute

__all__ = [
    "put_module",
    "put_parameter",
    "put_buffer",
    "Checkpoint",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_sp",
    "scatter_to_sp",
    "reduce_scatter_to_sp",
    "gather_tokens",
    "reduce_scatter_tokens",
    "vocab_parallel_embedding",
    "vocab_parallel_cross_entropy",
    "cp_shard",
    "cp_positions",
    "cp_attention",
    "cp_cross_entropy",
    "fused_attention",
    "rms_norm",
    "layer_norm",
    "fp8_linear",
    "fp8_matmul",
    "fp8_grouped_mm",
    "fp8_addmm",
    "moe_grouped_mm",
    "moe_dispatch",
    "moe_combine",
    "moe_dispatch_buffer",
    "moe_combine_buffer",
    "moe_tp_share",
    "moe_tp_unshare",
    "moe_tp_share_buffer",
    "moe_tp_unshare_buffer",
    "moe_record_load",
    "moe_balance_loss",
    "size_of",
    "to_compute",
    "set_groups",
    "tp_group",
    "tp_rank",
    "tp_size",
]
