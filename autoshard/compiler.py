"""The compile driver: search a plan the program can run, rewrite the graph for it, emit.

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
from dataclasses import dataclass
from pathlib import Path

from autoshard import codegen, passes, planner
from autoshard.codegen import write_plan
from autoshard.errors import AutoshardError
from autoshard.ir import capabilities
from autoshard.ir.plan import Plan
from autoshard.passes.contract import Refusal
from autoshard.planner.candidates import family_options, meshes
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

    def write(self, out: str | Path) -> Path:
        """Write ``plan.json``, ``plan.md`` and the program files to ``out`` (see ``codegen.write_plan``)."""

        self.out = write_plan(self.plan, out, self.comparison, self.files)
        return self.out


def compile_plan(
    problem: planner.Problem,
    captured,
    rebuild: Recipe,
    plan_only: bool = False,
    compare: dict | None = None,
    dump_passes: str | Path | None = None,
) -> Compiled:
    """Search ``problem`` and, unless ``plan_only``, rewrite the graph for the plan found and emit
    the program; the program rebuilds the single-device model with ``rebuild``. ``dump_passes``:
    a folder for each pass's graph before and after it (``passes.dump_to``)."""

    problem.emit = not plan_only
    for _ in range(MAX_ROUNDS):
        plan, result = planner.solve(problem)
        comparison = planner.compare(problem, result, compare) if compare is not None else None
        if comparison:
            plan.notes.append(comparison)
        if plan_only:
            return Compiled(plan, result, None, comparison)
        left_out = _left_out(problem)
        if left_out:
            plan.notes.append(
                f"Searched without what the program does not emit yet ({', '.join(left_out)}); "
                "--plan-only searches the whole space."
            )
        try:
            fresh = _fresh(captured)
            rewritten = passes.apply(fresh, plan, passes.dump_to(Path(dump_passes)) if dump_passes else None)
            files = codegen.program_files(plan, rewritten, fresh, rebuild)
        except Refusal as refusal:
            _exclude(problem, refusal)
            continue
        return Compiled(plan, result, files, comparison)
    raise AutoshardError(
        f"the rewrite passes refused {MAX_ROUNDS} plans in a row ({'; '.join(problem.exclusion_reasons)}); "
        "pin a plan with --force, or use --plan-only"
    )


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


__all__ = ["Compiled", "compile_plan"]
