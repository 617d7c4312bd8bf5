"""Graph rewrites, one job per file, run in the order ``PASSES`` lists them.

The first, ``canonicalize``, runs at capture (``canonical``), on the freshly traced graph and with
no plan: the cost model and the planner read the graph it leaves. The others run for a plan
(``apply``).

Each entry is a :class:`~autoshard.passes.contract.Pass`: a function ``(gm, ctx) -> gm``, when it
applies, the ``node.meta`` keys it requires and writes, and the graph facts it ensures.
``apply`` builds the shared :class:`~autoshard.passes.contract.RewriteContext` from the plan and
runs the list, checking every contract on the way.
"""

from __future__ import annotations

from pathlib import Path

from torch import fx

from autoshard.errors import AutoshardError
from autoshard.ir.capabilities import refusals
from autoshard.passes.activation_checkpoint import activation_checkpoint, layers_wrapped
from autoshard.passes.canonicalize import canonicalize_pass, no_tracer_residue
from autoshard.passes.context_parallel import context_parallel, no_full_sequence_attention_left
from autoshard.passes.contract import Decisions, Dump, Observer, Pass, RewriteContext, decisions, run_passes
from autoshard.passes.expert_parallel import expert_balance, expert_parallel, no_experts_left_whole
from autoshard.passes.flash_attention import flash_attention, no_fusable_sdpa_left
from autoshard.passes.fp8 import fp8, fp8_calls_only
from autoshard.passes.fused_norm import fused_norm, no_torch_norm_left
from autoshard.passes.pipeline_split import chunks_chained, pipeline_split
from autoshard.passes.sequence_parallel import no_tp_all_reduce_left, sequence_parallel
from autoshard.passes.tensor_parallel import full_weights_left, tensor_parallel

_CAPTURED = ("shape", "dtype", "op", "op_class", "region", "layer")
_PLACED = ("shape", "region", "layer")  # what the nodes every pass inserts carry too


PASSES: list[Pass] = [
    Pass(
        "canonicalize",
        canonicalize_pass,
        lambda ctx: True,
        writes=("mask", "causal"),  # what a mask that stays is; which masked_fill is causal
        ensures=(no_tracer_residue,),
        summary="one form of the graph whichever tracer made it: no input guards or device constants; causal "
        "masks, repeated KV heads, written-out RMS norms and grouped GEMMs in their one form",
        phase="capture",
    ),
    Pass(
        "fused_norm",
        fused_norm,
        lambda ctx: True,
        requires=_CAPTURED,
        ensures=(no_torch_norm_left,),
        summary="RMSNorm and LayerNorm -> rt.rms_norm / rt.layer_norm (fp32 inside, keeps its input and statistics)",
    ),
    Pass(
        "flash_attention",
        flash_attention,
        lambda ctx: ctx.attention == "flash" or ctx.cp > 1,
        requires=_CAPTURED,
        ensures=(no_fusable_sdpa_left,),
        summary="scaled_dot_product_attention and the written-out causal softmax(QK^T)V -> rt.fused_attention",
    ),
    Pass(
        "context_parallel",
        context_parallel,
        lambda ctx: ctx.cp > 1,
        requires=_CAPTURED,
        writes=("note",),
        ensures=(no_full_sequence_attention_left,),
        summary="sequences in the load-balanced CP layout; ring or all-gather-KV attention; CP loss share",
    ),
    Pass(
        "tensor_parallel",
        tensor_parallel,
        lambda ctx: ctx.tp > 1,
        requires=(*_CAPTURED, "tp"),
        writes=("note",),
        ensures=(full_weights_left,),
        summary="column/row pairs, head split, vocabulary-parallel embedding and cross-entropy",
    ),
    Pass(
        "sequence_parallel",
        sequence_parallel,
        lambda ctx: ctx.sequence_parallel and ctx.tp > 1,
        requires=_CAPTURED,
        writes=("sp_sliced_dim", "sp_tp", "note"),
        ensures=(no_tp_all_reduce_left,),
        summary="norms, dropouts and residual adds on this rank's slice of the sequence between TP regions",
    ),
    Pass(
        "expert_balance",
        expert_balance,
        lambda ctx: True,
        requires=_CAPTURED,
        writes=("note",),
        summary="each MoE layer's expert loads counted in forward; its routing bias found for balancing",
    ),
    Pass(
        "expert_parallel",
        expert_parallel,
        lambda ctx: ctx.ep > 1 or ctx.tp > 1,
        requires=_CAPTURED,
        writes=("note",),
        ensures=(no_experts_left_whole,),
        summary="routed experts split over the EP ranks: all-to-all dispatch and combine; TP ranks share the rows",
    ),
    Pass(
        "fp8",
        fp8,
        lambda ctx: bool(ctx.fp8),
        requires=_PLACED,
        writes=("note", "fp8_left"),
        ensures=(fp8_calls_only,),
        summary="matmuls of the plan's FP8 kinds -> rt.fp8_linear / fp8_matmul / fp8_grouped_mm (blockwise E4M3)",
    ),
    Pass(
        "activation_checkpoint",
        activation_checkpoint,
        lambda ctx: bool(ctx.recompute),
        requires=_PLACED,
        writes=(),  # adds no key to the nodes it finds; its Checkpoint calls carry region, layer, source, op
        ensures=(layers_wrapped,),
        summary="the plan's selective-recompute set around each layer",
    ),
    Pass(
        "pipeline_split",
        pipeline_split,
        lambda ctx: True,
        requires=("region", "layer"),
        writes=(),  # leaves the nodes as they are: the chunks and the loss go to decisions(gm).split
        ensures=(chunks_chained,),
        summary="one sub-graph per pipeline chunk, and the loss",
    ),
]


def canonical(gm, inputs: tuple | None, observe: Observer | None = None, values=None):
    """Run the capture passes (``canonicalize``) on a freshly traced ``gm`` traced with ``inputs``;
    ``values(name)``: a meta buffer's value from the model's recorded initialisation, or None."""
    return run_passes(_phase("capture"), gm, RewriteContext(inputs=inputs, values=values), observe)


def apply(captured, plan, observe: Observer | None = None) -> fx.GraphModule:
    """Rewrite ``captured.graph_module`` (captured and analysed) as ``plan`` says, running the plan
    passes of ``PASSES`` in order (``observe``: see ``contract.run_passes``), and return it: each
    node's ``meta`` says what the passes decided about it, ``decisions(gm)`` what they decided
    about the parameters and the pipeline chunks. Features of the plan that no pass implements
    yet are refused here with the reason rather than silently dropped."""

    reasons = refusals(plan)
    if reasons:
        raise AutoshardError(reasons[0])
    ctx = RewriteContext.from_plan(plan)
    if isinstance(observe, Dump):
        observe.restart()
    return run_passes(_phase("plan"), captured.graph_module, ctx, observe)


def dump_to(folder) -> Dump:
    """The observer ``autoshard compile --dump-passes FOLDER`` gives every pass (``contract.Dump``)."""
    return Dump(Path(folder), PASSES)


def _phase(phase: str) -> list[Pass]:
    return [p for p in PASSES if p.phase == phase]


__all__ = ["PASSES", "Decisions", "Pass", "RewriteContext", "apply", "canonical", "decisions", "dump_to", "run_passes"]
