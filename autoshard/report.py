"""plan.md: the plan for people. What was chosen and what it is predicted to cost, where the GPUs'
coordinates fall on the hardware, where the step time and memory go, which layers each pipeline
rank runs, what lost and why, and (for a ``--plan-only`` plan) why the program is not emitted yet."""

from __future__ import annotations

from pathlib import Path

from autoshard.cost_models import hardware
from autoshard.errors import AutoshardError
from autoshard.ir.plan import Plan
from autoshard.ir.schedules import SCHEDULES, schedule
from autoshard.pictures import markdown as pictures
from autoshard.planner.explain import rationale

GB = 1e9


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return lines


def mesh_drawing(plan: Plan, domain: int) -> list[str]:
    """Which parallel coordinates the GPUs of the first NVLink domain hold, and what crosses it."""
    m = plan.mesh
    sizes = m.degrees()
    stride, strides = 1, {}
    for axis in m.order:
        strides[axis] = stride
        stride *= sizes[axis]
    lines = [f"Axes from innermost (consecutive ranks) to outermost: {' < '.join(f'{a}{sizes[a]}' for a in m.order)}."]
    inside, crossing = [], []
    for axis in m.order:
        if sizes[axis] == 1:
            continue
        span = strides[axis] * sizes[axis]
        per_node = max(1, min(sizes[axis], domain // strides[axis])) if strides[axis] < domain else 1
        (inside if span <= domain else crossing).append(
            f"{axis.upper()}{sizes[axis]}" + ("" if span <= domain else f" ({per_node} per node)")
        )
    lines.append(
        f"Inside one NVLink domain of {domain} GPUs: {', '.join(inside) or 'nothing'}; "
        f"across domains: {', '.join(crossing) or 'nothing'}."
    )
    if m.ep > 1:
        stage = " x ".join(f"{a}{sizes[a]}" for a in m.order if a != "pp" and sizes[a] > 1)
        lines.append(
            f"Expert layers fold over each stage's {stage} ranks (in that order): EP{m.ep} groups of "
            f"{m.ep} consecutive positions, EDP{m.edp} (the same position in every group), ETP{m.etp}."
        )
    shown = min(domain, plan.gpus)
    lines.append("")
    lines.append("```")
    lines.append(f"node 0 ({shown} GPUs)")
    for rank in range(shown):
        coords = " ".join(f"{a}{(rank // strides[a]) % sizes[a]}" for a in m.order if sizes[a] > 1)
        lines.append(f"  gpu {rank:<3d} {coords}")
    lines.append("```")
    return lines


def plan_markdown(plan: Plan, comparison: str | None = None, pictures_to: Path | None = None) -> str:
    """plan.md: the headline, then one section each (``_SECTIONS``), the pictures (drawn into
    ``pictures_to``, beside plan.md, where given), then the alternatives that lost, the
    comparison with a reference plan when there is one, and the rationale."""
    out = _headline(plan)
    for title, section in _SECTIONS:
        out += [f"## {title}", "", *section(plan), ""]
    out += _islands(plan)
    drawn = pictures(plan, pictures_to, _domain(plan))
    out += ["## Pictures", "", *drawn] if drawn else []
    out += _alternatives(plan)
    if comparison:
        out += ["## Compared with the reference plan", "", comparison, ""]
    out += ["## Rationale", "", "```", rationale(plan), "```", ""]
    return "\n".join(out)


def _headline(plan: Plan) -> list[str]:
    p, m = plan.predicted, plan.mesh
    fp8 = plan.precision["fp8_matmuls"]
    return [
        f"# Plan: {plan.model.get('name', 'model')} on {plan.gpus} x {plan.hardware}",
        "",
        f"**{m.product_form()}**, ZeRO-{plan.zero_stage}, {plan.schedule} schedule "
        f"({plan.virtual_stages} virtual stage(s) per rank), {plan.microbatches} micro-batches of "
        f"{plan.microbatch_size} x {plan.seq_len} tokens, "
        f"sequence parallel {'on' if plan.sequence_parallel else 'off'}, "
        f"attention {plan.attention}, precision {plan.precision['compute']}"
        + (f" with FP8 {', '.join(fp8)}" if fp8 else "")
        + ".",
        "",
        f"Predicted step time **{p.step_time_s:.3f} s**, MFU **{p.mfu * 100:.1f}%**, {p.tokens_per_s:,.0f} tokens/s.",
        "",
        *_not_emitted(plan),
    ]


def _step_time(plan: Plan) -> list[str]:
    p = plan.predicted
    rows = [
        ["compute (incl. recompute)", f"{p.compute_s:.3f}"],
        ["recompute", f"{p.recompute_s:.3f}"],
        ["optimizer step", f"{p.optimizer_s:.3f}"],
        ["compute slowed by hidden communication", f"{p.overlap_s:.3f}"],
        ["pipeline bubble", f"{p.bubble_fraction * p.step_time_s:.3f}"],
    ]
    exposed = [
        [f"{axis.upper()} communication exposed", f"{v['exposed']:.3f}"] for axis, v in p.comm_s.items() if v["total"]
    ]
    return _table(["part", "seconds"], rows + exposed)


def _communication(plan: Plan) -> list[str]:
    rows = [
        [axis.upper(), f"{v['total']:.3f}", f"{v['exposed']:.3f}", f"{v['total'] - v['exposed']:.3f}"]
        for axis, v in plan.predicted.comm_s.items()
    ]
    return _table(["axis", "total s", "exposed s", "overlapped s"], rows)


def _memory(plan: Plan) -> list[str]:
    p = plan.predicted
    mem = p.memory_bytes_per_gpu
    parts = ("params", "grads", "optimizer", "activations", "fp8_weights", "buffers", "total")
    rows = [[k.replace("_", " "), f"{mem[k] / GB:.2f}"] for k in parts if k in mem]
    return _table(
        ["part", "GB"], rows + [["usable (capacity minus reserve and headroom)", f"{p.memory_limit_bytes / GB:.2f}"]]
    )


def _checkpointing(plan: Plan) -> list[str]:
    """The decision per saved-tensor category; per run of pipeline ranks alike where the ranks
    differ (a rank holding more micro-batches in flight recomputes more)."""
    if not plan.stage_checkpoint:
        rows = [[k, _kept(plan, k, v)] for k, v in sorted(plan.checkpoint.items())]
        return _table(["saved-tensor category", "decision"], rows)
    pp = plan.mesh.pp
    stage = {SCHEDULES[plan.schedule].chunk_rank(s, pp): s for s in reversed(range(len(plan.stage_layers)))}
    runs, start = [], 0  # (header, a stage of those ranks)
    for r in range(1, pp + 1):
        if r == pp or plan.stage_checkpoint[stage[r]] != plan.stage_checkpoint[stage[start]]:
            runs.append((f"rank {start}" if r - start == 1 else f"ranks {start}-{r - 1}", stage[start]))
            start = r
    rows = [
        [k] + [_kept(plan, k, plan.stage_checkpoint[s][k], plan.stage_recompute(s)) for _, s in runs]
        for k in sorted(plan.checkpoint)
    ]
    return [f"Per pipeline rank: {plan.rank_recompute_text()}.", ""] + _table(
        ["saved-tensor category"] + [head for head, _ in runs], rows
    )


_SECTIONS = (
    ("The mesh on the hardware", lambda plan: mesh_drawing(plan, _domain(plan))),
    ("Where the step time goes (busiest pipeline rank)", _step_time),
    ("Communication per step", _communication),
    ("Memory on the busiest GPU", _memory),
    ("Pipeline stages", lambda plan: [_stages_text(plan)]),
    ("Activation checkpointing", _checkpointing),
)


def _alternatives(plan: Plan) -> list[str]:
    if not plan.alternatives:
        return []
    rows = [
        [
            " x ".join(f"{k.upper()}{v}" for k, v in a.mesh.items() if k != "order"),
            a.schedule,
            a.zero_stage,
            "-" if a.step_time_s is None else f"{a.step_time_s:.3f}",
            "-" if a.mfu is None else f"{a.mfu * 100:.1f}%",
            a.reason,
        ]
        for a in plan.alternatives
    ]
    return [
        "## Alternatives that lost",
        "",
        *_table(["mesh", "schedule", "ZeRO", "step s", "MFU", "why it lost"], rows),
        "",
    ]


def _islands(plan: Plan) -> list[str]:
    """DiLoCo's islands: how the data-parallel ranks split, the outer optimizer, and what crosses
    the link between islands against synchronous data parallelism over it."""
    isl = plan.islands
    if isl is None or isl.count <= 1:
        return []
    saved_b = isl.sync_dp_bytes_per_step - isl.outer_bytes_per_step
    saved_s = isl.sync_dp_s_per_step - isl.outer_s_per_step
    ratio = (
        f" ({isl.sync_dp_bytes_per_step / isl.outer_bytes_per_step:.1f}x fewer bytes)"
        if isl.outer_bytes_per_step
        else ""
    )
    rows = [
        ["DiLoCo outer step (amortised)", f"{isl.outer_bytes_per_step / 1e6:.3f}", f"{isl.outer_s_per_step:.4f}"],
        ["synchronous DP across islands", f"{isl.sync_dp_bytes_per_step / 1e6:.3f}", f"{isl.sync_dp_s_per_step:.4f}"],
        ["saved", f"{saved_b / 1e6:.3f}", f"{saved_s:.4f}"],
    ]
    return [
        "## Islands (DiLoCo)",
        "",
        f"{isl.count} islands of dp={plan.mesh.dp // isl.count} each ({plan.gpus // isl.count} GPUs); inside an "
        f"island the plan above runs synchronously. Every {isl.sync_every} steps the ranks at the same place in "
        f"every island average their parameters' change since the last sync and take an outer Nesterov SGD step "
        f"(lr {isl.outer_lr:g}, momentum {isl.outer_momentum:g}).",
        "",
        f"Between islands, per GPU per step{ratio}, on {isl.link or 'the link between islands'}:",
        "",
        *_table(["", "MB sent", "seconds"], rows),
        "",
    ]


def _not_emitted(plan: Plan) -> list[str]:
    """Why ``autoshard compile`` would not emit a program for this plan (nothing when it would)."""
    if not plan.not_emitted:
        return []
    lines = ["## Not emitted yet", ""]
    lines += [
        "The program emitter cannot run this plan yet (`compile` without `--plan-only` takes the best plan",
        "without these):",
        "",
    ]
    return lines + [f"- {reason}" for reason in plan.not_emitted] + [""]


def _domain(plan: Plan) -> int:

    try:
        return hardware.load(plan.hardware).nvlink_domain
    except AutoshardError:
        return 8


def _stages_text(plan: Plan) -> str:
    pp, v = plan.mesh.pp, plan.virtual_stages
    ranges = plan.stage_ranges()
    if pp == 1:
        return f"No pipeline: every GPU runs all {plan.model.get('layers')} layers, the embedding and the head."
    lines = ["```"]
    for rank in range(pp):
        parts = []
        for c in schedule(plan.schedule).chunks_of_rank(rank, pp, v):
            start, end = ranges[c]
            label = f"layers {start}-{end - 1}" if end > start else "no layers"
            extras = (["embedding"] if c == 0 else []) + (["head+loss"] if c == pp * v - 1 else [])
            parts.append(label + (f" + {' + '.join(extras)}" if extras else ""))
        lines.append(f"rank {rank:>3}: " + " | ".join(parts))
    lines.append("```")
    return "\n".join(lines)


def _kept(plan, category: str, decision: str, recompute: frozenset | None = None) -> str:
    """A category's checkpoint decision, saying where the layers keep FP8 copies instead (only
    under a checkpoint: where ``recompute``, the stage's set, is given, a non-empty one)."""
    under = plan.recompute if recompute is None else recompute
    if decision == "save" and under and category in plan.precision.get("fp8_saved", ()):
        return "save as fp8 copy (only FP8 matmuls read it; its op reruns in backward)"
    return decision
