"""The pipeline, top to bottom: capture -> analyze -> search -> passes -> emit.

Both ``autoshard compile`` (:func:`compile_file`) and the Python API (``autoshard.plan``,
``autoshard.compile``: :func:`problem`, :func:`compile_plan`) run it:

1. **capture** (``autoshard.capture``): trace the model built on meta into an fx graph; the first
   pass, canonicalisation (``passes.canonical``), runs there, on the traced graph, since the cost
   model reads the form it leaves; then every node is annotated (``autoshard.ir`` keys);
2. **analyze** (``cost_models.analyze``, in :func:`problem`): per-layer FLOPs, bytes, memory;
3. **search** (``planner.solve``): the plan for the hardware and the run;
4. **passes** (``passes.apply``): the plan's rewrites of a fresh copy of the captured graph;
5. **emit** (``codegen.program_files``): the program's files.

``compile`` must never choose a plan it then refuses. Two things keep it so:

1. what the emitted program can run is a table (``autoshard.ir.capabilities``) the search reads
   (``Problem.emit``), so plans it cannot emit are never candidates;
2. what only the model's graph can tell (an op tensor parallelism cannot split, a mask context
   parallelism cannot shard) comes from running the passes: each emission is first a dry run on
   a copy of the captured graph, and a pass that refuses a choice (``passes.contract.Refusal``,
   naming the axis and value) takes that choice out of the search, which runs again. The plan
   records what was left out and why.

``--plan-only`` searches the whole space the cost model prices and records in the plan what would
keep it from being emitted (``Plan.not_emitted``).

The program records how to rebuild the single-device model (``autoshard.runtime.rebuild.Recipe``,
made by ``autoshard.rebuild``): the CLI's model file and config, or the Python API's builder or
transformers config.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from autoshard import codegen, passes, planner, whatif
from autoshard.capture import Captured, capture_file
from autoshard.capture.timing import phase
from autoshard.codegen import write_plan
from autoshard.cost_models import hardware as hw
from autoshard.cost_models import islands as island_costs
from autoshard.cost_models.analyze import analyze
from autoshard.errors import AutoshardError
from autoshard.ir import capabilities
from autoshard.ir.plan import Islands, Plan
from autoshard.noise_scale import critical_batch_note
from autoshard.passes.contract import Refusal
from autoshard.planner.candidates import family_options, meshes
from autoshard.rebuild import for_file
from autoshard.runtime.rebuild import Recipe

MAX_ROUNDS = 8  # searches after refusals; each refusal removes one (axis, value), so few are ever needed


@dataclass
class Compiled:
    """A compiled program: what ``autoshard.compile`` returns and ``autoshard compile`` writes."""

    plan: Plan
    result: object  # planner.search.SearchResult of the final search
    files: dict[str, str] | None  # the program (file name -> text); None for --plan-only
    comparison: str | None = None
    out: Path | None = None  # where it was last written
    # the search's input, frozen (``whatif.freeze``): written as ``cost.pkl`` for ``explain --what-if``
    inputs: planner.Problem | None = None

    def write(self, out: str | Path) -> Path:
        """Write ``plan.json``, ``plan.md``, the program files and the snapshot of the search's
        input (``whatif.SNAPSHOT``) to ``out`` (see ``codegen.write_plan``)."""
        with phase("writing"):
            extra = {**(self.files or {}), **({whatif.SNAPSHOT: whatif.dumps(self.inputs)} if self.inputs else {})}
            self.out = write_plan(self.plan, out, self.comparison, extra)
        return self.out


def compile_file(
    spec: str,
    config: str | None,
    *,
    hardware="h100",
    gpus: int,
    seq_len: int,
    global_batch: int,
    precision: str = "bf16",
    pins: dict | None = None,
    memory_headroom: float | None = None,
    plan_only: bool = False,
    compare: dict | None = None,
    dump_passes: str | Path | None = None,
    noise_scale: float | None = None,
    islands: Islands | None = None,
) -> Compiled:
    """``autoshard compile``: the whole pipeline for the model file ``spec`` (``model.py[:builder]``)
    at ``config``; the arguments are the command's (``islands``: DiLoCo's, ``--islands``).
    ``noise_scale``: the gradient noise scale in tokens, against which the plan notes whether its
    global batch is past the critical batch (``noise_scale.critical_batch_note``)."""
    profile = _hardware(hardware, memory_headroom)  # a bad profile fails before a long capture
    check_run(gpus, seq_len, global_batch)
    check_islands(islands, gpus, pins or {})
    observe = passes.dump_to(dump_passes) if dump_passes else None
    captured = capture_file(spec, config, seq_len, observe=observe)
    path, _, builder = spec.partition(":")
    name = Path(path).stem + (f":{config}" if config else "")
    problem_ = problem(captured, profile, gpus, seq_len, global_batch, precision, pins, name)
    recipe = for_file(path, builder or None, config)
    notes = [critical_batch_note(global_batch, seq_len, noise_scale)[1]] if noise_scale else []
    return compile_plan(
        problem_, captured, recipe, plan_only, compare, observe, consume=True, notes=notes, islands=islands
    )


def problem(
    captured: Captured,
    hardware,
    gpus: int,
    seq_len: int,
    global_batch: int,
    precision: str = "bf16",
    pins: dict | None = None,
    name: str | None = None,
) -> planner.Problem:
    """The search's problem for ``captured``: its cost analysis (``analyze``) on ``hardware`` (a
    profile name, a TOML path or a loaded ``Hardware``) for the run's size, with the user's pins
    (``planner.parse_force``)."""
    check_run(gpus, seq_len, global_batch)
    profile = _hardware(hardware)
    name = name or type(captured.model).__name__
    with phase("analysis"):
        cost = analyze(captured)
    return planner.Problem(cost, profile, gpus, seq_len, global_batch, precision, pins or {}, name)


def check_run(gpus, seq_len, global_batch) -> None:
    """The run's sizes are positive whole numbers (the CLI's parser checks its own)."""
    for key, value in (("gpus", gpus), ("seq_len", seq_len), ("global_batch", global_batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise AutoshardError(f"{key}={value!r}: must be a positive whole number")


def check_islands(islands: Islands | None, gpus: int, pins: dict) -> None:
    """DiLoCo's flags, before the capture: ``count`` islands of whole data-parallel groups."""
    if islands is None:
        return
    k = islands.count
    if not isinstance(k, int) or k < 1:
        raise AutoshardError(f"--islands {k}: give a whole number of islands, 1 or more")
    if not isinstance(islands.sync_every, int) or islands.sync_every < 1:
        raise AutoshardError(f"--sync-every {islands.sync_every}: give a whole number of steps, 1 or more")
    if not (math.isfinite(islands.outer_lr) and islands.outer_lr > 0):
        raise AutoshardError(f"--outer-lr {islands.outer_lr}: give a finite learning rate above 0 (DiLoCo: 0.7)")
    if not (math.isfinite(islands.outer_momentum) and 0 <= islands.outer_momentum < 1):
        raise AutoshardError(f"--outer-momentum {islands.outer_momentum}: give a momentum in [0, 1) (DiLoCo: 0.9)")
    if gpus % k:
        raise AutoshardError(f"--islands {k} does not divide --gpus {gpus}; give a divisor of {gpus}")
    order = pins.get("order")
    if k > 1 and order is not None and tuple(order.split("-") if isinstance(order, str) else order)[-1] != "dp":
        raise AutoshardError(
            f"--islands {k} splits the outermost ranks by their dp coordinate: pin an order with dp last "
            f"(e.g. order=tp-cp-pp-dp), or leave order to the search"
        )
    if "dp" in pins and pins["dp"] % k:
        raise AutoshardError(
            f"--islands {k} does not divide the pinned dp={pins['dp']}; pin a dp that {k} divides, or give "
            f"--islands dividing {pins['dp']}"
        )


def _split_islands(problem: planner.Problem, islands: Islands) -> None:
    """Islands split the data-parallel ranks: the search keeps to dp that ``islands.count`` divides,
    with dp the outermost axis (each island a block of consecutive ranks)."""
    if islands.count > 1:
        problem.dp_outermost = True
        dp = {d for d in range(1, problem.gpus + 1) if problem.gpus % d == 0 and d % islands.count}
        problem.excluded.setdefault("dp", set()).update(dp)


def _islands(plan: Plan, problem: planner.Problem, islands: Islands | None) -> None:
    """Record (and price) DiLoCo's islands in ``plan``: the user's, or where the profile's link
    between islands splits the GPUs (``sync_every`` 0: not asked for), the cost model's choice."""
    if islands is None or islands.count <= 1:
        return
    if not islands.sync_every:
        plan.islands, why = island_costs.choose(plan, problem.hw, islands.count)
        plan.notes.append(why)
        return
    if plan.model.get("experts"):
        raise AutoshardError("--islands: DiLoCo islands are not emitted for MoE models yet; compile without --islands")
    if plan.mesh.dp % islands.count:
        raise AutoshardError(
            f"--islands {islands.count} does not divide the plan's dp={plan.mesh.dp}; give --islands dividing "
            f"{plan.mesh.dp}, or --force dp=N with N a multiple of {islands.count}"
        )
    plan.islands = island_costs.price(plan, problem.hw, islands)


def compile_plan(
    problem: planner.Problem,
    captured: Captured,
    rebuild: Recipe,
    plan_only: bool = False,
    compare: dict | None = None,
    dump_passes: str | Path | passes.Observer | None = None,
    consume: bool = False,
    notes: Sequence[str] = (),
    islands: Islands | None = None,
) -> Compiled:
    """Search ``problem`` and, unless ``plan_only``, rewrite the graph for the plan found and emit
    the program; the program rebuilds the single-device model with ``rebuild``. ``dump_passes``:
    a folder for each pass's graph before and after it, or the observer (``passes.dump_to``).
    ``consume``: the caller never reads ``captured`` again, so the plan-only dry run may rewrite
    its graph in place instead of a copy (copying a 61-layer graph costs a quarter of a second).
    ``notes``: said in the plan (its rationale, in plan.md) besides the search's own. Long
    because its arguments are the command's and its body the retry loop around the passes'
    refusals, which reads as one piece."""

    problem.emit = not plan_only
    moe = problem.cost.facts.get("experts")
    spans = island_costs.spanned(problem.hw, problem.gpus) if islands is None and not moe else 1
    if spans > 1:  # the profile's link between islands splits the GPUs: DP is what crosses it
        islands = Islands(count=spans, sync_every=0)
    if islands is not None:
        _split_islands(problem, islands)
    observe = passes.dump_to(dump_passes) if isinstance(dump_passes, (str, Path)) else dump_passes
    for _ in range(MAX_ROUNDS):
        with phase("search"):
            plan, result = planner.solve(problem)
        plan.notes.extend(notes)
        _islands(plan, problem, islands)
        comparison = planner.compare(problem, result, compare) if compare is not None else None
        if comparison:
            plan.notes.append(comparison)
        if plan_only:
            with phase("snapshot"):  # before the dry run, which may rewrite the graph in place
                inputs = whatif.freeze(problem)
            with phase("dry-run passes"):
                _dry_run(plan, captured, copy=not consume)
            return Compiled(plan, result, None, comparison, inputs=inputs)
        left_out = _left_out(problem)
        if left_out:
            plan.notes.append(
                f"Searched without what the program does not emit yet ({', '.join(left_out)}); "
                "--plan-only searches the whole space."
            )
        try:
            with phase("rewrite passes"):
                fresh = _fresh(captured)
                rewritten = passes.apply(fresh, plan, observe)
            with phase("code generation"):
                files = codegen.program_files(plan, rewritten, fresh, rebuild)
        except Refusal as refusal:
            _exclude(problem, refusal)
            continue
        with phase("snapshot"):
            inputs = whatif.freeze(problem)
        return Compiled(plan, result, files, comparison, inputs=inputs)
    raise AutoshardError(
        f"the rewrite passes refused {MAX_ROUNDS} plans in a row ({'; '.join(problem.exclusion_reasons)}); "
        "pin a plan with --force, or use --plan-only"
    )


def _dry_run(plan: Plan, captured: Captured, copy: bool = True) -> None:
    """For ``--plan-only``: run the rewrite passes on ``captured`` (a copy, unless ``copy`` is
    false: nothing reads it afterwards) for ``plan``, emitting nothing, and record in
    ``plan.not_emitted`` what they refuse, so that the plan says whether ``compile`` would emit
    it or search on. A plan the emitter's limits already keep out is not rewritten."""
    if plan.not_emitted:
        return
    try:
        passes.apply(_fresh(captured) if copy else captured, plan)
    except Refusal as refusal:
        plan.not_emitted.append(f"the rewrite passes refuse it for this model: {refusal}")


def _hardware(hardware, memory_headroom: float | None = None):
    """The hardware profile ``hardware`` names (or is), with the user's memory headroom."""
    profile = hardware if isinstance(hardware, hw.Hardware) else hw.load(hardware)
    if memory_headroom is not None:
        profile = dataclasses.replace(profile, memory_headroom=memory_headroom)
    return profile


def _left_out(problem: planner.Problem) -> list[str]:
    """The emitter's limits that block some point of the whole search space of ``problem``."""

    whole = dataclasses.replace(problem, emit=False)
    names = set()
    for tp, pp, cp, ep, dp in meshes(whole):
        for fp8, attention in family_options(whole, cp):
            fields = {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "dp": dp, "fp8": fp8, "attention": attention}
            for limit in capabilities.EMIT_LIMITS:
                if all(k in fields for k in limit.reads) and limit.blocks(**{k: fields[k] for k in limit.reads}):
                    names.add(limit.name)
    return sorted(names)


def _fresh(captured):
    """A copy of ``captured`` whose graph the passes may rewrite (they rewrite in place), so that
    a refused attempt leaves the original intact. fx copies a graph without recursing along its
    node list; the per-layer node lists are mapped onto the copy by name."""
    gm = copy.deepcopy(captured.graph_module)
    by_name = {n.name: n for n in gm.graph.nodes}
    layer_nodes = {k: [by_name[n.name] for n in nodes] for k, nodes in captured.layer_nodes.items()}
    return dataclasses.replace(captured, graph_module=gm, layer_nodes=layer_nodes)


def _exclude(problem: planner.Problem, refusal) -> None:
    values = problem.excluded.setdefault(refusal.axis, set())
    if refusal.value is not None and problem.refused(refusal.axis, refusal.value):
        # the same refusal twice: the search did not honour the exclusion
        raise AutoshardError(f"{refusal} (the planner chose it again after the passes refused it; a bug)")
    values.add(refusal.exclusion())
    if refusal.axis in problem.forced and problem.refused(refusal.axis, problem.forced[refusal.axis]):
        raise refusal  # the user pinned what the passes refuse: their message says what to do
    problem.exclusion_reasons.append(str(refusal))


__all__ = ["Compiled", "check_run", "compile_file", "compile_plan", "problem"]
