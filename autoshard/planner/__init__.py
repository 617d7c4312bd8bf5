"""Plan: choose TP/PP/CP/EP/DP, ZeRO, schedule, micro-batches, stage partition, recompute set,
FP8 and attention variant for one model on one machine, from the cost model alone."""

from __future__ import annotations

from autoshard.cost_models import comm
from autoshard.cost_models.analyze import ModelCost
from autoshard.errors import AutoshardError
from autoshard.ir import capabilities
from autoshard.ir.plan import AXES, CHECKPOINT_CATEGORIES, PLAN_VERSION, Alternative, Mesh, Plan, Predicted
from autoshard.ir.schedules import SCHEDULES
from autoshard.planner.candidates import Problem, parse_force
from autoshard.planner.costs import CandidateCosts
from autoshard.planner.evaluate import Evaluator
from autoshard.planner.explain import why_slower
from autoshard.planner.promises import rank_promises
from autoshard.planner.search import Evaluation, Planner, SearchResult

__all__ = ["Problem", "parse_force", "solve", "to_plan", "model_summary", "compare"]


def model_summary(cost: ModelCost, name: str, seq: int) -> dict:
    facts = cost.facts
    return {
        "name": name,
        "params": cost.params,
        "layers": cost.num_layers,
        "layer_kinds": [blk.count for blk in cost.blocks],
        "hidden": facts.get("hidden"),
        "heads": (facts.get("heads") or [None])[0],
        "kv_heads": (facts.get("kv_heads") or [None])[0],
        "experts": facts.get("experts", 0),
        "vocab": facts.get("vocab"),
        "training_flops_per_token": cost.flops_per_token(seq)["training"],
    }


def solve(problem: Problem, alternatives: int = 4) -> tuple[Plan, SearchResult]:
    """Search, then describe the winner (and the runners-up) as a Plan."""
    result = Planner(problem, alternatives).run()
    return to_plan(problem, result), result


def to_plan(problem: Problem, result: SearchResult) -> Plan:
    best = result.best
    plan = _plan_of(problem, best)
    for alt in result.ranked[1:]:
        plan.alternatives.append(
            Alternative(
                mesh={**_mesh(alt).degrees(), "order": list(alt.candidate.order)},
                schedule=alt.candidate.schedule,
                zero_stage=alt.candidate.zero,
                step_time_s=alt.step_time_s,
                mfu=alt.mfu,
                reason=why_slower(
                    best.breakdown, best.step_time_s, alt.breakdown, alt.step_time_s, _mesh(alt).degrees()
                ),
            )
        )
    seen = {tuple(a.mesh[k] for k in AXES) for a in plan.alternatives}
    for ev in result.infeasible:
        key = ev.candidate.mesh_key()
        if key in seen or key == best.candidate.mesh_key() or len(plan.alternatives) >= 2 * max(1, len(result.ranked)):
            continue
        seen.add(key)
        plan.alternatives.append(
            Alternative(
                mesh={**_mesh(ev).degrees(), "order": list(ev.candidate.order)},
                schedule=ev.candidate.schedule,
                zero_stage=ev.candidate.zero,
                step_time_s=None,
                mfu=None,
                reason=ev.reason,
            )
        )
    return plan


def _matmul_kinds(cost) -> set[str]:
    """The kinds of weighted matmul the model has (``autoshard.ir.MATMUL_KINDS``)."""
    return {g.kind for blk in (cost.pre, *cost.blocks, cost.post) for g in blk.gemms}


def _fp8_saved(problem: Problem, ev: Evaluation) -> dict:
    """``{"fp8_saved": [...]}``: the kept checkpoint categories the layers keep as FP8 copies
    under selective recomputation (``ModelCost.fp8_saved``), or nothing when there are none."""
    c = ev.candidate
    sp = c.tp > 1 and problem.sequence_parallel
    # where stages recompute different sets, what any of them keeps so (each stage's checkpoint
    # keeps those of them it does not recompute: ``RewriteContext.fp8_saved_of``)
    saved = frozenset().union(
        *(problem.cost.fp8_saved(rc, tuple(c.fp8), tp=c.tp, sp=sp) for rc in set(ev.rank_recompute) or {c.recompute})
    )
    return {"fp8_saved": sorted(saved)} if saved else {}


def _mesh(ev: Evaluation) -> Mesh:
    c = ev.candidate
    return Mesh(tp=c.tp, pp=c.pp, cp=c.cp, ep=c.ep, dp=c.dp, order=list(c.order))


def _plan_of(problem: Problem, ev: Evaluation) -> Plan:
    """The Plan of the evaluated candidate ``ev``."""
    c = ev.candidate
    plan = Plan(
        version=PLAN_VERSION,
        model=model_summary(problem.cost, problem.model_name, problem.seq),
        hardware=problem.hw.name,
        gpus=problem.gpus,
        seq_len=problem.seq,
        global_batch=problem.global_batch,
        mesh=_mesh(ev),
        zero_stage=c.zero,
        schedule=c.schedule,
        virtual_stages=c.v,
        microbatches=problem.global_batch // (c.dp * c.mbs),
        microbatch_size=c.mbs,
        stage_layers=list(ev.stage_layers),
        sequence_parallel=c.tp > 1 and problem.sequence_parallel,
        checkpoint=_checkpoint(problem, frozenset().union(*ev.rank_recompute) if ev.rank_recompute else c.recompute),
        stage_checkpoint=_stage_checkpoint(problem, ev),
        precision={
            "compute": "bf16",
            "fp8_matmuls": [k for k in c.fp8 if k in _matmul_kinds(problem.cost)],
            "grad_reduce": "fp32",
            **_fp8_saved(problem, ev),
        },
        attention=c.attention,
        predicted=_predicted(problem, ev),
        forced={k: _jsonable(v) for k, v in problem.forced.items()},
        notes=_notes(problem, ev),
        dp_bucket_bytes=_dp_bucket_bytes(problem, ev),
    )
    if not problem.emit:
        plan.not_emitted = capabilities.refusals(plan)
    return plan


def _checkpoint(problem: Problem, recompute: frozenset) -> dict[str, str]:
    """Category -> save | recompute, over the model's checkpoint categories."""
    cats = sorted(c for c in problem.categories if c in CHECKPOINT_CATEGORIES)
    return {cat: ("recompute" if cat in recompute else "save") for cat in cats}


def _stage_checkpoint(problem: Problem, ev: Evaluation) -> list[dict[str, str]]:
    """Per virtual stage, its rank's recompute set where the ranks' sets differ; else none."""
    c = ev.candidate
    if len(set(ev.rank_recompute)) < 2:
        return []
    sched = SCHEDULES[c.schedule]
    return [_checkpoint(problem, ev.rank_recompute[sched.chunk_rank(ch, c.pp)]) for ch in range(c.pp * c.v)]


def _dp_bucket_bytes(problem: Problem, ev: Evaluation) -> int:
    """The program's gradient bucket size (``comm.bucket_bytes``) for the busiest rank's
    gradients; 0 where no bucketed reduction runs (one data-parallel rank, FSDP2 at ZeRO-2/3).
    Between the program's first bucket (1 MiB) and its largest (64 MiB, ``runtime.zero``)."""
    c = ev.candidate
    if c.dp * c.cp == 1 or c.zero >= 2:
        return 0
    where = CandidateCosts(problem).where(c, True)[1]["dpcp"]
    return comm.bucket_bytes(ev.memory["grads"], c.zero, where, problem.hw, 2**20, 64 * 2**20)


def _predicted(problem: Problem, ev: Evaluation) -> Predicted:
    """What the cost model predicts for ``ev``: step time, throughput, memory, time by kind and
    each pipeline rank's promises."""
    b = ev.breakdown
    tokens = problem.global_batch * problem.seq
    return Predicted(
        step_time_s=ev.step_time_s,
        mfu=ev.mfu,
        tokens_per_s=tokens / ev.step_time_s,
        bubble_fraction=b["bubble_s"] / ev.step_time_s,
        memory_bytes_per_gpu={
            k: ev.memory[k]
            for k in ("params", "grads", "optimizer", "activations", "fp8_weights", "buffers", "total")
            if k != "fp8_weights" or ev.memory.get(k)
        },
        comm_s={axis: {"total": v["total"], "exposed": v["exposed"]} for axis, v in b["comm_s"].items()},
        compute_s=b["compute_s"],
        recompute_s=b["recompute_s"],
        overlap_s=b["overlap_s"],
        optimizer_s=b["optimizer_s"],
        memory_limit_bytes=problem.hw.usable_bytes,
        ranks=rank_promises(Evaluator(CandidateCosts(problem)), ev),
    )


def _notes(problem: Problem, ev: Evaluation) -> list[str]:
    """The plan's notes: a partition cut short, choices the passes cannot emit, capture's notes
    and the memory limit."""
    return (
        ([] if ev.optimal else ["The stage partition solver stopped at its time limit: the split may not be optimal."])
        + [
            f"Left out of the search, as the rewrite passes cannot emit it for this model: {r}"
            for r in problem.exclusion_reasons
        ]
        + list(problem.cost.captured.notes)
        + [f"Memory limit: {problem.hw.memory_limit_text()} (--memory-headroom keeps a share of it free besides)."]
    )


def _jsonable(v):
    if isinstance(v, frozenset):
        return sorted(v)
    if isinstance(v, tuple):
        return list(v)
    return v


def compare(problem: Problem, result: SearchResult, pins: dict) -> str:
    """The best plan under ``pins`` (a published configuration, say) against the chosen one: what
    the cost model predicts for it and what separates the two."""
    from dataclasses import replace

    best = result.best
    try:
        ref = Planner(replace(problem, forced={**problem.forced, **pins}), alternatives=1).run().best
    except AutoshardError as e:
        return f"Reference plan {_pins(pins)}: {e}"
    c = ref.candidate
    head = (
        f"Reference {_pins(pins)} evaluated as {_mesh(ref).product_form()}, {c.schedule} (v={c.v}), ZeRO-{c.zero}, "
        f"recompute {'+'.join(sorted(c.recompute)) or 'nothing'}: "
        f"{ref.step_time_s:.3f} s/step, {ref.mfu * 100:.1f}% MFU"
    )
    if ref.step_time_s <= best.step_time_s * (1 + 1e-9):
        return f"{head}; the chosen plan is the same or equivalent."
    why = why_slower(best.breakdown, best.step_time_s, ref.breakdown, ref.step_time_s, _mesh(ref).degrees())
    return f"{head}; it is {why}."


def _pins(pins: dict) -> str:
    return ",".join(f"{k}={'+'.join(sorted(v)) if isinstance(v, frozenset) else v}" for k, v in pins.items())
