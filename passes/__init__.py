"""Graph rewrites, one job per file, run in the order ``apply`` lists them."""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.errors import AutoshardError


@dataclass
class Rewritten:
    """The per-rank program: pipeline chunks and the loss, with what the passes decided."""

    split: object  # pipeline_split.SplitProgram
    shards: dict  # parameter -> ParamShard (tensor parallelism)
    origin: dict  # renamed parameter -> name in the model
    notes: dict  # node name -> decision, shown as comments in the emitted code
    partial_grads: list  # parameters whose gradients are partial sums over TP (sequence parallel)


def apply(captured, plan) -> Rewritten:
    """Rewrite ``captured.graph_module`` (captured and analysed) as ``plan`` says, in this order:
    flash attention, context parallel, tensor parallel, sequence parallel, activation
    checkpointing, then the pipeline split.
    Features of the plan that no pass implements yet are refused here with the reason rather
    than silently dropped."""
    from autoshard.passes.activation_checkpoint import activation_checkpoint
    from autoshard.passes.context_parallel import context_parallel
    from autoshard.passes.flash_attention import flash_attention
    from autoshard.passes.pipeline_split import pipeline_split
    from autoshard.passes.sequence_parallel import sequence_parallel
    from autoshard.passes.tensor_parallel import tensor_parallel

    m = plan.mesh
    if m.ep > 1:
        raise AutoshardError(
            "emitting expert parallelism is not implemented yet; compile with --force ep=1 or use --plan-only"
        )
    if plan.precision.get("fp8_matmuls"):
        raise AutoshardError("emitting FP8 matmuls is not implemented yet; compile with --precision bf16")
    if plan.zero_stage == 3 and m.dp > 1 and m.pp > 1 and plan.schedule in ("zero-bubble", "zbv", "dualpipev"):
        # measured: FSDP2 resharding after forward loses weight gradients computed in the
        # schedule's separate weight-gradient pass (autoshard verify fails); ZeRO-2 is exact
        raise AutoshardError(
            f"emitting ZeRO-3 under the {plan.schedule} schedule is not supported yet (FSDP2's resharding and "
            "the split weight-gradient pass disagree); recompile with --force zero=2 or --force schedule=interleaved"
        )
    notes: dict[str, str] = {}
    if plan.attention == "flash" or m.cp > 1:
        flash_attention(captured.graph_module, notes)
    context_parallel(captured.graph_module, m.cp, plan.attention, notes)
    sharded = tensor_parallel(captured.graph_module, m.tp)
    sharded.notes.update(notes)
    partial = sequence_parallel(sharded.gm, m.tp, sharded.notes) if plan.sequence_parallel else []
    recompute = sorted(k for k, v in plan.checkpoint.items() if v == "recompute")
    kept = [k for k, v in plan.checkpoint.items() if v == "save"]
    if recompute and kept and m.pp > 1 and plan.schedule in ("zero-bubble", "zbv", "dualpipev"):
        # torch's selective checkpointing allows one backward per region; these schedules run two
        # (input gradients, then weight gradients)
        raise AutoshardError(
            f"the plan pairs the {plan.schedule} schedule with selective recomputation, which "
            "torch.utils.checkpoint's selective mode cannot run (it allows one backward per region and "
            "the schedule splits backward in two); recompile with --force recompute=full or "
            "--force schedule=interleaved"
        )
    activation_checkpoint(sharded.gm, recompute, sharded.notes)
    split = pipeline_split(sharded.gm, plan.stage_layers)
    return Rewritten(split, sharded.shards, sharded.origin, sharded.notes, partial)
