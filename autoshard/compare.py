"""``autoshard compare``: one model planned on several hardware profiles and GPU counts, side by side.

The model is captured and costed once (its graph does not depend on the hardware); each hardware
profile and GPU count is then its own search (``planner.solve``), exactly what ``autoshard compile
--plan-only`` runs for that row, so every row prints the ``compile`` command that reproduces it.
A row that nothing fits says why instead of stopping the table. What a row reports beside the plan:
step time, MFU, tokens per second, and for ``tokens`` training tokens the days, GPU-hours and cost
(the profile's ``price_per_gpu_hour``), and the busiest GPU's memory against what it can use.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, replace

from autoshard import planner
from autoshard.cost_models import hardware as hw
from autoshard.errors import AutoshardError
from autoshard.planner.gpus import smallest_gpus_that_fit

SECONDS_PER_DAY = 86400.0
MOST_GPUS = 4 * 64**3  # the largest count the default (no --gpus) tries: 1,048,576


@dataclass
class Row:
    hardware: str
    gpus: int
    command: str  # the ``autoshard compile`` that reproduces the row
    plan: str = ""  # mesh, schedule, ZeRO stage, recompute
    step_time_s: float | None = None
    mfu: float | None = None
    tokens_per_s: float | None = None
    days: float | None = None
    gpu_hours: float | None = None
    cost_usd: float | None = None
    memory_gb: float | None = None  # the busiest GPU's
    usable_gb: float | None = None
    reason: str = ""  # why the row has no plan (nothing fits, or the pins cannot hold)
    degrees: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def parse_list(text: str, what: str, cast=str) -> list:
    """``a,b,c`` as a list; a one-line error naming ``what`` where an item is empty or bad."""
    items = [t.strip() for t in text.split(",")]
    if not all(items):
        raise AutoshardError(f"--{what} {text!r}: an empty item; give a comma-separated list, e.g. h100,b200")
    try:
        return [cast(t) for t in items]
    except ValueError:
        raise AutoshardError(f"--{what} {text!r}: expected whole numbers, e.g. 8192,16384") from None


def compare(
    spec: str,
    config: str | None,
    hardware: list[str],
    gpus: list[int] | None,
    seq_len: int,
    global_batch: int,
    tokens: float | None = None,
    precision: str = "bf16",
    pins: str | None = None,
) -> list[Row]:
    """The rows of the table: every hardware profile in ``hardware`` at every GPU count in ``gpus``
    (None: each profile's smallest count that fits the model)."""
    from autoshard.capture import capture_file  # lazy: capture loads torch; a bad list fails before it
    from autoshard.compiler import check_run  # lazy: as capture
    from autoshard.cost_models.analyze import analyze  # lazy: as capture

    profiles = [hw.load(name) for name in hardware]  # a bad name fails before a long capture
    for n in gpus or [1]:
        check_run(n, seq_len, global_batch)
    forced = planner.parse_force(pins) if pins else {}
    cost = analyze(capture_file(spec, config, seq_len))
    rows = []
    for name, profile in zip(hardware, profiles):
        counts = gpus
        if counts is None:
            least = _least_gpus(planner.Problem(cost, profile, 1, seq_len, global_batch, precision, forced))
            counts = [least] if least else []
            if not least:
                rows.append(Row(name, 0, "", reason=f"no power of two up to {MOST_GPUS:,} GPUs fits"))
        for n in counts:
            problem = planner.Problem(cost, profile, n, seq_len, global_batch, precision, forced, spec)
            command = _command(spec, config, name, n, seq_len, global_batch, precision, pins)
            rows.append(_row(problem, name, n, command, tokens))
    return rows


def _least_gpus(problem: planner.Problem) -> int | None:
    """The smallest power of two of GPUs on which some plan of ``problem`` fits, up to
    ``MOST_GPUS`` (``smallest_gpus_that_fit`` tries 2x to 64x of a count: probed from 4, 256, ...)."""
    start = 4
    while start < MOST_GPUS:
        found = smallest_gpus_that_fit(replace(problem, gpus=start))
        if found:
            return found
        start *= 64
    return None


def _row(problem: planner.Problem, name: str, gpus: int, command: str, tokens: float | None) -> Row:
    """One profile at one GPU count: its plan and what training ``tokens`` on it takes."""
    row = Row(name, gpus, command, usable_gb=problem.hw.usable_bytes / 1e9)
    try:
        plan, _ = planner.solve(problem, alternatives=1)
    except AutoshardError as e:
        row.reason = str(e)
        return row
    p = plan.predicted
    row.plan = _describe(plan)
    row.degrees = {**plan.mesh.degrees(), "schedule": plan.schedule, "zero": plan.zero_stage}
    row.step_time_s, row.mfu, row.tokens_per_s = p.step_time_s, p.mfu, p.tokens_per_s
    row.memory_gb = p.memory_bytes_per_gpu.get("total", 0.0) / 1e9
    if tokens:
        seconds = tokens / p.tokens_per_s
        row.days = seconds / SECONDS_PER_DAY
        row.gpu_hours = seconds * gpus / 3600
        row.cost_usd = row.gpu_hours * problem.hw.price_per_gpu_hour
    return row


def _describe(plan) -> str:
    """The plan in one short line: mesh, schedule, ZeRO stage, what it recomputes, FP8."""
    parts = [plan.mesh.product_form(), f"{plan.schedule} (v={plan.virtual_stages})", f"ZeRO-{plan.zero_stage}"]
    recompute = sorted(plan.recompute)
    parts.append("recompute " + "+".join(recompute) if recompute else "no recompute")
    if plan.precision.get("fp8_matmuls"):
        parts.append("FP8 " + "+".join(plan.precision["fp8_matmuls"]))
    return ", ".join(parts)


def _command(spec, config, name, gpus, seq_len, global_batch, precision, pins) -> str:
    args = ["autoshard", "compile", spec]
    if config:
        args += ["--config", config]
    args += ["--hardware", name, "--gpus", str(gpus), "--seq-len", str(seq_len)]
    args += ["--global-batch", str(global_batch), "--precision", precision]
    if pins:
        args += ["--force", pins]
    return shlex.join([*args, "--plan-only", "-o", f"out/{name}-{gpus}"])


def table(rows: list[Row], tokens: float | None) -> str:
    """The rows as a markdown table, then each row's ``compile`` command."""
    head = ["hardware", "GPUs", "plan", "step s", "MFU", "tokens/s", "GB/GPU (usable)"]
    if tokens:
        head += ["days", "GPU-hours", "cost USD"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.step_time_s is None:
            cells = [r.hardware, str(r.gpus), f"no plan: {r.reason}"] + [""] * (len(head) - 3)
        else:
            cells = [
                r.hardware,
                f"{r.gpus:,}",
                r.plan,
                f"{r.step_time_s:.2f}",
                f"{r.mfu:.1%}",
                f"{r.tokens_per_s:,.0f}",
                f"{r.memory_gb:.1f} ({r.usable_gb:.1f})",
            ]
            if tokens:
                cells += [f"{r.days:,.1f}", f"{r.gpu_hours / 1e6:,.2f}M", f"${r.cost_usd / 1e6:,.1f}M"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"{r.hardware} x {r.gpus}: {r.command}" for r in rows if r.command]
    return "\n".join(lines)


def as_json(rows: list[Row], tokens: float | None) -> str:
    return json.dumps({"tokens": tokens, "rows": [r.to_dict() for r in rows]}, indent=2)


def chart(rows: list[Row], path: str, tokens: float | None) -> None:
    """A bar chart of the rows (days to train ``tokens`` where given, else step time), PNG or SVG
    by ``path``'s suffix. matplotlib is imported here: only a chart needs it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise AutoshardError("--chart needs matplotlib: pip install matplotlib") from None
    fitted = [r for r in rows if r.step_time_s is not None]
    if not fitted:
        raise AutoshardError("--chart: no row has a plan to draw")
    labels = [f"{r.hardware}\n{r.gpus:,} GPUs" for r in fitted]
    values = [r.days if tokens else r.step_time_s for r in fitted]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(fitted)), 4.0))
    bars = ax.bar(range(len(fitted)), values, color="#4c72b0")
    for bar, r in zip(bars, fitted):
        note = f"MFU {r.mfu:.0%}" + (f"\n${r.cost_usd / 1e6:,.1f}M" if tokens else "")
        ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(fitted)), labels, fontsize=8)
    ax.set_ylabel(f"days to train {tokens:.3g} tokens" if tokens else "predicted step time (s)")
    ax.set_title("autoshard compare")
    fig.tight_layout()
    try:
        fig.savefig(path)
    except (OSError, ValueError) as e:
        raise AutoshardError(f"--chart {path}: cannot write it ({e}); give a writable .png or .svg path") from None
    finally:
        plt.close(fig)
