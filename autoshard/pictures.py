"""Pictures beside plan.md: the pipeline schedule as a Gantt chart, memory per pipeline rank and
the mesh on the nodes. Each picture is a plain function building its numbers from the plan
(``timeline``, ``memory_bars``, ``mesh_nodes``; the tests check those against the plan) and one
drawing them. matplotlib is imported inside the drawing functions, so ``import autoshard`` stays
fast and a compile without matplotlib still writes plan.md (which then says why no pictures)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from autoshard.ir.plan import Plan
from autoshard.ir.schedules import SCHEDULES, _rank_order

GB = 1e9
SHOWN_MICROBATCHES = 16  # past this many micro-batches the Gantt adds a panel of the first ones
MANY_BLOCKS = 3000  # past this many blocks in a step, the whole-step panel draws a rank's busy time as one bar
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "fp8_weights", "buffers")
KIND_COLOUR = {"forward": "tab:blue", "input": "tab:orange", "weight": "tab:green", "backward": "tab:red"}
KIND_LETTER = {
    "FORWARD": "forward",
    "BACKWARD_INPUT": "input",
    "BACKWARD_WEIGHT": "weight",
    "FULL_BACKWARD": "backward",
}


# -- the pipeline schedule ---------------------------------------------------------------------


@dataclass
class Block:
    """One pass of one micro-batch through one chunk on one pipeline rank, in predicted seconds;
    its last ``send_s`` is the hand-over to the next rank."""

    rank: int
    kind: str  # forward | input (input-gradient) | weight (weight-gradient) | backward (both at once)
    chunk: int
    microbatch: int
    start_s: float
    end_s: float
    send_s: float = 0.0


@dataclass
class Timeline:
    """The pipeline part of a step: ``blocks`` on ``ranks`` rows over ``span_s``; the step's
    remaining ``step_time_s - span_s`` (optimizer step, exposed data-parallel traffic, the slowest
    rank's extra work) follows it. ``stage_s``: forward, input-gradient and weight-gradient seconds
    of one micro-batch through one rank, all its chunks."""

    ranks: int
    blocks: list[Block]
    step_time_s: float
    stage_s: tuple[float, float, float]
    span_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.span_s = max((b.end_s for b in self.blocks), default=0.0)

    @property
    def idle_share(self) -> float:
        """The average rank's idle time inside the pipeline span, as a share of the step: what
        the plan's ``bubble_fraction`` predicts."""
        busy = sum(b.end_s - b.start_s for b in self.blocks) / self.ranks
        return (self.span_s - busy) / self.step_time_s


def stage_times(plan: Plan) -> tuple[float, float, float]:
    """Seconds of forward, input-gradient and weight-gradient work of one micro-batch through one
    pipeline rank, such that the schedule's own bubble rule (``Schedule.bubble``) gives the plan's
    bubble. The forward's share is the ranks' FLOPs' (``predicted.ranks``; recomputation counts
    in the backward). Without a split backward the rule fixes their sum; with one, their sum is
    what the step leaves the passes (step time less bubble, optimizer step, exposed
    data-parallel traffic and overlap slowdown) and the rule fixes the weight pass's share.
    Without a pipeline they add up to the plan's compute time."""
    sched, m, pp, v = SCHEDULES[plan.schedule], plan.microbatches, plan.mesh.pp, plan.virtual_stages
    p = plan.predicted
    flops = [r["flops"] for r in p.ranks] or [{"forward": 1.0, "backward": 2.0}]
    fwd = sum(f["forward"] for f in flops) / sum(f["forward"] + f["backward"] + f.get("recompute", 0.0) for f in flops)
    bubble_s = p.bubble_fraction * p.step_time_s
    if pp == 1 or not sched.split_backward:
        unit = sched.bubble(pp, m, v, fwd, 1 - fwd, 0.0)
        total = bubble_s / unit if unit > 0 else p.compute_s / m
        return fwd * total, (1 - fwd) * total, 0.0
    total = (p.step_time_s - bubble_s - p.optimizer_s - p.comm_s.get("dp", {}).get("exposed", 0.0) - p.overlap_s) / m
    f, low, high = fwd * total, 0.0, (1 - fwd) * total
    for _ in range(60):  # the bubble falls as the weight pass grows: bisect for the plan's
        w = (low + high) / 2
        low, high = (w, high) if sched.bubble(pp, m, v, f, total - f - w, w) > bubble_s else (low, w)
    return f, total - f - low, low


def rank_orders(plan: Plan) -> list[list[tuple[str, int, int]]]:
    """Per pipeline rank, its (kind, chunk, micro-batch) passes in the order torch's class for the
    schedule runs them (``schedules._rank_order``; an overlapped forward-backward pair as its
    forward then its backward); 1F1B's order (warm-up forwards, then one forward one backward)
    where a rank holds one chunk and runs whole backwards."""
    row, pp, m, v = SCHEDULES[plan.schedule], plan.mesh.pp, plan.microbatches, plan.virtual_stages
    if v == 1 and not row.split_backward:
        return [_one_f_one_b(r, pp, m) for r in range(pp)]
    out = []
    for rank in range(pp):
        order = []
        for action in _rank_order(row, rank, pp, m, v):
            parts = action.sub_actions if action.computation_type.name == "OVERLAP_F_B" else (action,)
            for a in sorted(parts, key=lambda a: a.computation_type.name != "FORWARD"):
                order.append((KIND_LETTER[a.computation_type.name], a.stage_index, a.microbatch_index))
        out.append(order)
    return out


def _one_f_one_b(rank: int, pp: int, m: int) -> list[tuple[str, int, int]]:
    warmup = min(m, pp - 1 - rank)
    order = [("forward", rank, i) for i in range(warmup)]
    for i in range(warmup, m):
        order += [("forward", rank, i), ("backward", rank, i - warmup)]
    return order + [("backward", rank, i) for i in range(m - warmup, m)]


def timeline(plan: Plan) -> Timeline:
    """Each rank's passes placed as early as their order and their inputs allow: a forward after
    the previous chunk's forward of its micro-batch, a backward after the next chunk's backward
    (the last chunk's: after its forward), a weight pass after its input pass. Every chunk of a
    rank takes ``1/v`` of ``stage_times``; the hand-over to the next rank is the end of a block
    (``comm_s['pp']`` spread over the sends, the cost model folds it into the stage times too)."""
    f, b, w = stage_times(plan)
    pp, v, m = plan.mesh.pp, plan.virtual_stages, plan.microbatches
    last = pp * v - 1
    length = {"forward": f / v, "input": b / v, "weight": w / v, "backward": (b + w) / v}
    send = plan.predicted.comm_s.get("pp", {}).get("total", 0.0) / max(1, 2 * m * v) if pp > 1 else 0.0
    orders, done, free = rank_orders(plan), {}, [0.0] * pp
    nxt = [0] * pp
    while any(nxt[r] < len(orders[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while nxt[r] < len(orders[r]):
                kind, c, i = orders[r][nxt[r]]
                need = _inputs(kind, c, i, last)
                if any(n not in done for n in need):
                    break
                start = max([free[r], *(done[n].end_s for n in need)])
                hands_on = (c < last) if kind == "forward" else (c > 0 and kind != "weight")
                block = Block(r, kind, c, i, start, start + length[kind], min(send, length[kind]) * hands_on)
                done[(kind if kind != "backward" else "input", c, i)] = block
                free[r], nxt[r], moved = block.end_s, nxt[r] + 1, True
        if not moved:
            raise RuntimeError(f"{plan.schedule}: the ranks' orders wait on each other")
    return Timeline(pp, sorted(done.values(), key=lambda b: (b.rank, b.start_s)), plan.predicted.step_time_s, (f, b, w))


def _inputs(kind: str, chunk: int, mb: int, last: int) -> list[tuple[str, int, int]]:
    """The passes a pass waits for (a full backward is filed as the input pass it includes)."""
    if kind == "forward":
        return [("forward", chunk - 1, mb)] if chunk else []
    if kind == "weight":
        return [("input", chunk, mb)]
    return [("forward", chunk, mb)] + ([("input", chunk + 1, mb)] if chunk < last else [])


def draw_schedule(plan: Plan, tl: Timeline, path: Path) -> str:
    """The Gantt chart of ``tl`` as ``path`` .png and .svg; returns the caption. The whole step
    on top; past ``SHOWN_MICROBATCHES`` micro-batches a second panel below draws the start of the
    step at a readable scale. Micro-batch numbers appear where a block is wide enough."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, per_mb = plan.microbatches, sum(tl.stage_s)
    windows = [max(tl.step_time_s, tl.span_s)]  # a plan of fewer micro-batches than ranks may overrun
    if m > SHOWN_MICROBATCHES:  # the fill and the first micro-batches' steady state
        windows.append(min(tl.span_s, per_mb * SHOWN_MICROBATCHES + (tl.span_s - m * per_mb)))
    row = 0.45 if tl.ranks <= 16 else 0.2
    fig, axes = plt.subplots(len(windows), 1, figsize=(14, 1.0 + len(windows) * (0.6 + row * tl.ranks)), squeeze=False)
    for n, (ax, window) in enumerate(zip(axes[:, 0], windows)):
        _draw_blocks(ax, plan, tl, window, merge=n == 0 and len(tl.blocks) > MANY_BLOCKS)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLOUR.values()]
    labels = ["forward", "input gradient", "weight gradient", "full backward"]
    axes[0, 0].legend(handles, labels, loc="lower right", bbox_to_anchor=(1, 1), ncol=4, fontsize=7, frameon=False)
    v = plan.virtual_stages
    axes[0, 0].set_title(f"{plan.schedule}: {tl.ranks} ranks x {v} chunk(s), {m} micro-batches", fontsize=9, loc="left")
    _save(fig, path)
    shown = f"above, the whole step; below, its first {windows[-1]:.3g} s" if len(windows) > 1 else "the whole step"
    return (
        f"Pipeline schedule ({shown} of {tl.step_time_s:.3g} s): each block is one micro-batch's pass "
        f"(its number where it fits) through one chunk (lighter: a later chunk), black ticks the hand-over to the "
        f"next rank, white the bubble ({tl.idle_share * 100:.1f}% of the step; the cost model predicts "
        f"{plan.predicted.bubble_fraction * 100:.1f}%), grey the rest of the step (optimizer step, exposed "
        f"data-parallel traffic, the slowest rank's extra work). Stage times: the average rank's."
    )


def _draw_blocks(ax, plan: Plan, tl: Timeline, window: float, merge: bool) -> None:
    """``tl``'s blocks starting before ``window`` seconds on ``ax``: one collection per rank, kind
    and chunk shade, labels where they fit; where ``merge`` (the whole step of more than
    ``MANY_BLOCKS`` blocks, under a pixel each) a rank's back-to-back blocks draw as one busy bar:
    the bubble's shape is what that scale shows."""
    pp = tl.ranks
    shown = [blk for blk in tl.blocks if blk.start_s < window]
    if merge:
        for rank in range(pp):
            ax.broken_barh(_busy(b for b in shown if b.rank == rank), (rank - 0.4, 0.8), color="tab:purple", lw=0)
    else:
        _draw_each(ax, plan, shown, pp, window)
    if window > tl.span_s:
        ax.axvspan(tl.span_s, tl.step_time_s, color="lightgrey")
    ax.set_xlim(0, window)
    ax.set_ylim(pp - 0.5, -0.5)
    step = max(1, pp // 16)
    ax.set_yticks(range(0, pp, step), [f"rank {r}" for r in range(0, pp, step)], fontsize=7)
    ax.set_xlabel("predicted seconds into the step" + (" (purple: busy)" if merge else ""), fontsize=8)


def _busy(blocks) -> list[tuple[float, float]]:
    """(start, width) of the runs of back-to-back ``blocks`` (in start order)."""
    runs: list[list[float]] = []
    for blk in blocks:
        if runs and blk.start_s <= runs[-1][1] + 1e-12:
            runs[-1][1] = max(runs[-1][1], blk.end_s)
        else:
            runs.append([blk.start_s, blk.end_s])
    return [(start, end - start) for start, end in runs]


def _draw_each(ax, plan: Plan, shown: list[Block], pp: int, window: float) -> None:
    """Every block of ``shown``, coloured by kind, lighter for a rank's later chunks."""
    v, vee = plan.virtual_stages, SCHEDULES[plan.schedule].v_shape
    groups: dict[tuple, list] = {}
    for blk in shown:
        nth = int(blk.chunk >= pp) if vee else blk.chunk // pp  # which of the rank's chunks
        groups.setdefault((blk.rank, blk.kind, nth), []).append((blk.start_s, blk.end_s - blk.start_s))
        if blk.send_s:
            groups.setdefault((blk.rank, "send", 0), []).append((blk.end_s - blk.send_s, blk.send_s))
        if blk.end_s - blk.start_s > window / 80:
            ax.text((blk.start_s + blk.end_s) / 2, blk.rank, str(blk.microbatch), ha="center", va="center", fontsize=5)
    for (rank, kind, nth), spans in groups.items():
        if kind == "send":
            ax.broken_barh(spans, (rank - 0.4, 0.15), color="black", lw=0)
        else:
            alpha = 1.0 - 0.6 * nth / max(1, v - 1)
            ax.broken_barh(spans, (rank - 0.4, 0.8), color=KIND_COLOUR[kind], alpha=alpha, ec="white", lw=0.2)


def _save(fig, path: Path) -> None:
    """``path`` as PNG and SVG, the same bytes for the same plan (no date, fixed SVG ids), so a
    recompile changes no file that did not change."""
    import matplotlib
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    with matplotlib.rc_context({"svg.hashsalt": "autoshard", "svg.fonttype": "none"}):  # text as text: small, quick
        fig.savefig(path.with_suffix(".svg"), metadata={"Date": None})
    plt.close(fig)


# -- memory per pipeline rank ------------------------------------------------------------------


def memory_bars(plan: Plan) -> list[dict[str, float]]:
    """Per pipeline rank, bytes by part (``MEMORY_PARTS``, those the plan has) from the plan's
    per-rank promises (``predicted.ranks``); the busiest GPU's figures where the plan has none."""
    ranks = plan.predicted.ranks or [plan.predicted.memory_bytes_per_gpu]
    return [{k: float(r.get("memory_bytes", r).get(k, 0.0)) for k in MEMORY_PARTS} for r in ranks]


def draw_memory(plan: Plan, bars: list[dict[str, float]], path: Path) -> str:
    """Stacked bars of ``bars`` against the usable memory; returns the caption."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    limit = plan.predicted.memory_limit_bytes / GB
    fig, ax = plt.subplots(figsize=(max(6, 0.25 * len(bars) + 3), 4))
    bottom = [0.0] * len(bars)
    for part in MEMORY_PARTS:
        heights = [b[part] / GB for b in bars]
        if any(heights):
            ax.bar(range(len(bars)), heights, bottom=bottom, label=part.replace("_", " "))
            bottom = [x + h for x, h in zip(bottom, heights)]
    tallest = max(bottom)
    if tallest > 0.2 * limit:  # else the line would flatten the bars: the title says the limit
        ax.axhline(limit, color="black", ls="--", lw=1, label=f"usable {limit:.1f} GB")
    ax.set_xticks(range(len(bars)), [str(r) for r in range(len(bars))], fontsize=6 if len(bars) > 16 else 8)
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel("GB per GPU")
    ax.legend(fontsize=7, loc="lower right")
    tight = min(limit - t for t in bottom)
    ax.set_title(f"memory per pipeline rank: {limit:.1f} GB usable, least headroom {tight:.1f} GB", fontsize=9)
    _save(fig, path)
    return (
        f"Memory per GPU on each pipeline rank by part against the usable {limit:.1f} GB (capacity less the "
        f"profile's reserve and headroom); the fullest rank leaves {tight:.1f} GB."
    )


# -- the mesh on the nodes ---------------------------------------------------------------------


def mesh_nodes(plan: Plan, domain: int, most: int = 16) -> list[list[dict[str, int]]]:
    """The coordinates of the GPUs of the first nodes (NVLink domains of ``domain`` GPUs), enough
    to hold one data-parallel replica (``most`` nodes at most): per node, per GPU, axis -> index."""
    sizes, stride, strides = plan.mesh.degrees(), 1, {}
    for axis in plan.mesh.order:
        strides[axis], stride = stride, stride * sizes[axis]
    replica = max((strides[a] * sizes[a] for a in plan.mesh.order if a != "dp" and sizes[a] > 1), default=1)
    nodes = min(most, max(1, -(-min(replica, plan.gpus) // domain)))
    return [
        [
            {a: (g // strides[a]) % sizes[a] for a in plan.mesh.order if sizes[a] > 1}
            for g in range(n * domain, (n + 1) * domain)
        ]
        for n in range(nodes)
        if n * domain < plan.gpus
    ]


def draw_mesh(plan: Plan, nodes: list[list[dict[str, int]]], domain: int, path: Path) -> str:
    """One box per node (NVLink domain), one cell per GPU with its coordinates, coloured by its
    pipeline rank; the title says which axes stay inside a domain and which cross the network."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(domain, 8)
    rows = -(-domain // cols)
    per_row = min(4, len(nodes))
    grid = -(-len(nodes) // per_row)
    fig, ax = plt.subplots(figsize=(max(7.0, 3.2 * per_row), 1.0 + grid * (0.5 * rows + 0.5)))
    colours = plt.get_cmap("tab20")
    for n, gpus in enumerate(nodes):
        x0, y0 = (n % per_row) * (cols + 1), -(n // per_row) * (rows + 1.2)
        ax.add_patch(plt.Rectangle((x0 - 0.1, y0 - rows - 0.1), cols + 0.2, rows + 0.2, fill=False, lw=1.5))
        ax.text(x0, y0 + 0.15, f"node {n}", fontsize=7)
        for g, coords in enumerate(gpus):
            x, y = x0 + g % cols, y0 - 1 - g // cols
            ax.add_patch(
                plt.Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, color=colours(coords.get("pp", 0) % 20), alpha=0.6)
            )
            label = "\n".join(f"{a}{i}" for a, i in coords.items())
            ax.text(x + 0.5, y + 0.5, label, ha="center", va="center", fontsize=4.5)
    ax.set_xlim(-0.5, per_row * (cols + 1))
    ax.set_ylim(-grid * (rows + 1.2), 0.6)
    ax.set_axis_off()
    inside, crossing = _placement(plan, domain)
    ax.set_title(f"inside a node's NVLink domain: {inside}\nacross the network: {crossing}", fontsize=8)
    _save(fig, path)
    return (
        f"The first {len(nodes)} node(s) of {domain} GPUs, each GPU with its coordinates (colour: pipeline rank); "
        f"inside one NVLink domain: {inside}; across the network: {crossing}."
    )


def _placement(plan: Plan, domain: int) -> tuple[str, str]:
    """The axes whose groups fit in one NVLink domain, and those that cross domains."""
    sizes, stride, inside, crossing = plan.mesh.degrees(), 1, [], []
    for axis in plan.mesh.order:
        span = stride * sizes[axis]
        if sizes[axis] > 1:
            (inside if span <= domain else crossing).append(f"{axis.upper()}{sizes[axis]}")
        stride = span
    return ", ".join(inside) or "nothing", ", ".join(crossing) or "nothing"


# -- plan.md -----------------------------------------------------------------------------------


def markdown(plan: Plan, out: Path | None, domain: int) -> list[str]:
    """Draw the pictures into ``out`` and return plan.md's lines embedding them with their
    captions; one line saying why there are none where matplotlib is missing (nothing without
    ``out``: plan.md rendered on its own)."""
    if out is None:
        return []
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ["Pictures of the schedule, memory and mesh need matplotlib (`pip install matplotlib`).", ""]
    out = Path(out)
    lines = []
    if plan.mesh.pp > 1:
        caption = draw_schedule(plan, timeline(plan), out / "schedule.png")
        lines += ["![pipeline schedule](schedule.png)", "", caption, ""]
    caption = draw_memory(plan, memory_bars(plan), out / "memory.png")
    lines += ["![memory per pipeline rank](memory.png)", "", caption, ""]
    caption = draw_mesh(plan, mesh_nodes(plan, domain), domain, out / "mesh.png")
    return lines + ["![mesh on the nodes](mesh.png)", "", caption, ""]
