"""Words for numbers: why an alternative lost, and the rationale of a plan."""

from __future__ import annotations

from autoshard.ir.plan import Plan

COMPONENTS = ("compute", "recompute", "optimizer", "bubble", "imbalance", "overlap", "tp", "cp", "ep", "pp", "dp")


def components(breakdown: dict) -> dict[str, float]:
    """Seconds per step each source of time contributes (communication: the exposed part)."""
    comm = breakdown["comm_s"]
    return {
        "compute": breakdown["compute_s"] - breakdown["recompute_s"],
        "recompute": breakdown["recompute_s"],
        "optimizer": breakdown.get("optimizer_s", 0.0),
        "bubble": breakdown["bubble_s"],
        "imbalance": breakdown["imbalance_s"],
        "overlap": breakdown["overlap_s"],
        **{axis: comm[axis]["exposed"] for axis in ("tp", "cp", "ep", "pp", "dp")},
    }


def _phrase(part: str, extra: float, alt: dict, mesh: dict, links: dict) -> str:
    axis_link = {
        "tp": links.get("tp"),
        "cp": links.get("cp"),
        "ep": links.get("ep"),
        "pp": links.get("pp"),
        "dp": links.get("dpcp"),
    }
    if part == "compute":
        return f"its kernels are less efficient at their local shapes ({extra:.2f} s more compute)"
    if part == "recompute":
        return f"it must recompute {extra:.2f} s more to fit in memory"
    if part == "optimizer":
        return f"its optimizer steps more parameters per GPU ({extra:.2f} s more)"
    if part == "bubble":
        return f"its pipeline bubble costs {extra:.2f} s more"
    if part == "overlap":
        return f"the communication it hides slows its compute by {extra:.2f} s more"
    if part == "imbalance":
        return f"its pipeline stages are less even ({extra:.2f} s more on the slowest)"
    name = {
        "tp": "tensor-parallel collectives",
        "cp": "context-parallel K/V traffic",
        "ep": "expert all-to-all",
        "pp": "pipeline sends",
        "dp": "data-parallel gradient and parameter traffic",
    }[part]
    degree = mesh.get(part, 1) if part != "dp" else mesh.get("dp", 1) * mesh.get("cp", 1)
    return f"{name} ({part.upper()}{degree} on {axis_link[part]}) expose {extra:.2f} s more"


def why_slower(best_breakdown: dict, best_time: float, alt_breakdown: dict, alt_time: float, alt_mesh: dict) -> str:
    """``+31% step time (6.10 s vs 4.66 s): TP collectives (TP8 on nvlink) expose 1.20 s more``."""
    mine, theirs = components(best_breakdown), components(alt_breakdown)
    extras = sorted(((theirs[k] - mine[k], k) for k in COMPONENTS), reverse=True)
    main = [(d, k) for d, k in extras if d > 0.02 * max(alt_time - best_time, 1e-9)][:2]
    pct = (alt_time / best_time - 1) * 100 if best_time else 0.0
    head = f"+{pct:.1f}% step time ({alt_time:.3f} s vs {best_time:.3f} s)"
    if not main:
        return head
    reasons = "; ".join(_phrase(k, d, alt_breakdown, alt_mesh, alt_breakdown.get("links", {})) for d, k in main)
    return f"{head}: {reasons}"


def rationale(plan: Plan) -> str:
    """What `autoshard explain` prints: the plan, where its time and memory go, and why it beat
    the alternatives."""
    m, p = plan.mesh, plan.predicted
    mem = p.memory_bytes_per_gpu
    gib = 1e9
    lines = [
        f"{plan.model.get('name', 'model')} on {plan.gpus} x {plan.hardware}, sequence {plan.seq_len}, "
        f"{plan.global_batch} sequences per step",
        f"Plan: {m.product_form()} (axes inside out: {' < '.join(m.order)}), ZeRO-{plan.zero_stage}, "
        f"{plan.schedule} schedule with {plan.virtual_stages} virtual stage(s) per rank, "
        f"{plan.microbatches} micro-batches of {plan.microbatch_size} sequence(s)",
        f"Predicted: {p.step_time_s:.3f} s per step, {p.mfu * 100:.1f}% MFU, {p.tokens_per_s:,.0f} tokens/s, "
        f"pipeline bubble {p.bubble_fraction * 100:.1f}% of the step",
        f"Memory on the busiest GPU: {p.memory_bytes_per_gpu['total'] / gib:.1f} GB of "
        f"{p.memory_limit_bytes / gib:.1f} GB usable (params {p.memory_bytes_per_gpu['params'] / gib:.1f}, "
        f"grads {mem['grads'] / gib:.1f}, optimizer {mem['optimizer'] / gib:.1f}, "
        f"activations {mem['activations'] / gib:.1f}, buffers {mem['buffers'] / gib:.1f})",
    ]
    recomputed = sorted(plan.recompute)
    if plan.stage_checkpoint:  # ranks holding more micro-batches in flight recompute more
        lines.append(f"Recomputed in backward, per pipeline rank: {plan.rank_recompute_text()}")
    else:
        lines.append(
            "Recomputed in backward: " + (", ".join(recomputed) if recomputed else "nothing (every saved tensor fits)")
        )
    comm = ", ".join(
        f"{axis.upper()} {v['exposed']:.3f} s exposed of {v['total']:.3f} s"
        for axis, v in p.comm_s.items()
        if v["total"] > 0
    )
    lines.append(f"Communication per step: {comm or 'none'}")
    lines.append(
        f"Compute per step: {p.compute_s:.3f} s (of which recompute {p.recompute_s:.3f} s), "
        f"plus {p.overlap_s:.3f} s it loses to the communication running beside it"
    )
    if plan.islands is not None and plan.islands.count > 1:
        isl = plan.islands
        lines.append(
            f"DiLoCo: {isl.count} islands of dp={m.dp // isl.count}, an outer Nesterov SGD step (lr {isl.outer_lr:g}, "
            f"momentum {isl.outer_momentum:g}) every {isl.sync_every} steps: {isl.outer_bytes_per_step / 1e6:.3g} MB "
            f"and {isl.outer_s_per_step:.3g} s per step per GPU between islands, against "
            f"{isl.sync_dp_bytes_per_step / 1e6:.3g} MB and {isl.sync_dp_s_per_step:.3g} s for synchronous DP"
        )
    if plan.alternatives:
        lines.append("Why not:")
        for alt in plan.alternatives:
            mesh = " x ".join(f"{k.upper()}{v}" for k, v in alt.mesh.items() if k != "order")
            lines.append(f"  {mesh}, {alt.schedule}, ZeRO-{alt.zero_stage}: {alt.reason}")
    lines.extend(plan.notes)
    return "\n".join(lines)
