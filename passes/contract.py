"""What a rewrite pass is: a function ``(gm, ctx) -> gm`` with a declared contract.

Every pass in ``autoshard.passes.PASSES`` is a :class:`Pass`: when it applies (a predicate on the
context), the ``node.meta`` keys it requires on every computing node before it runs, the keys it
may write, and the graph facts it guarantees afterwards (each a check that returns what is wrong,
or ``None``). :func:`run_passes` runs the list in order and checks each contract as it goes, so a
pass that breaks one fails at once, by name, rather than three passes later.

:class:`RewriteContext` is the one object the passes share: the plan's decisions they need (read
only) and what they decide for the emitted program (parameter shards, renamed parameters,
comments for the generated code, partial gradients, the pipeline split).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torch import fx

from autoshard import ir, progress
from autoshard.errors import AutoshardError
from autoshard.passes._graph import describe

_COMPUTING = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class RewriteContext:
    """The plan's decisions the passes read (read only: what the passes decide goes on the graph,
    on its nodes' ``meta`` and in :func:`decisions`)."""

    tp: int = 1
    cp: int = 1
    ep: int = 1
    attention: str = "flash"  # flash | ring | allgather-kv (autoshard.ir.plan.ATTENTION)
    sequence_parallel: bool = False
    recompute: tuple[str, ...] = ()  # saved-tensor categories the layers recompute (some layers, with stage_recompute)
    stage_recompute: tuple[tuple[str, ...], ...] = ()  # per pipeline chunk, where chunks differ; () for all alike
    stage_layers: tuple[int, ...] = ()  # layers per pipeline chunk, in chunk order; () for one chunk
    seq: int = 0  # tokens per sequence on one context-parallel rank (0: unknown)
    fp8: tuple[str, ...] = ()  # the matmul kinds in FP8 (autoshard.ir.FP8_KINDS)
    fp8_saved: tuple[str, ...] = ()  # kept categories recomputation keeps as FP8 copies
    inputs: tuple | None = None  # the example inputs of a freshly traced graph (canonicalize's mask check)
    values: Callable | None = None  # a meta buffer's value by name from its recorded init (canonicalize)

    def recompute_of(self, layer: int | None) -> tuple[str, ...]:
        """The categories layer ``layer`` recomputes: its chunk's (``stage_recompute``), else ``recompute``."""
        if not self.stage_recompute or layer is None:
            return self.recompute
        end = 0
        for n, chunk in zip(self.stage_layers, self.stage_recompute):
            end += n
            if layer < end:
                return chunk
        return self.recompute

    def fp8_saved_of(self, layer: int | None) -> tuple[str, ...]:
        """The kept categories layer ``layer`` keeps as FP8 copies: none where it recomputes
        nothing (no checkpoint), else ``fp8_saved`` but what it recomputes."""
        mine = self.recompute_of(layer)
        return tuple(k for k in self.fp8_saved if k not in mine) if mine else ()

    @classmethod
    def from_plan(cls, plan) -> RewriteContext:
        """The context for ``plan`` (an ``autoshard.ir.plan.Plan``)."""
        m = plan.mesh
        return cls(
            tp=m.tp,
            cp=m.cp,
            ep=m.ep,
            attention=plan.attention,
            sequence_parallel=bool(plan.sequence_parallel) and m.tp > 1,
            recompute=tuple(sorted(k for k, v in plan.checkpoint.items() if v == "recompute")),
            stage_recompute=tuple(tuple(sorted(plan.stage_recompute(i))) for i in range(len(plan.stage_checkpoint))),
            stage_layers=tuple(plan.stage_layers),
            seq=plan.seq_len // m.cp,
            fp8=tuple(plan.precision.get("fp8_matmuls") or ()),
            fp8_saved=tuple(plan.precision.get("fp8_saved") or ()),
        )


@dataclass
class Decisions:
    """What the passes decide beyond the nodes: facts about parameters, which are attributes of
    the graph module (read by ``get_attr`` nodes, by module calls, or by both) rather than nodes,
    and the pipeline split. They live on the rewritten graph module, ``gm.meta["decisions"]``
    (:func:`decisions`), so the emitter reads the graph and nothing else."""

    shards: dict = field(default_factory=dict)  # parameter -> tensor_parallel.ParamShard (axis tp or ep)
    origin: dict[str, str] = field(default_factory=dict)  # renamed parameter -> its name in the model
    partial_grads: list[str] = field(default_factory=list)  # parameters with partial gradients over TP
    expert_params: list[str] = field(default_factory=list)  # stacked expert weights (gradients over EDP)
    routing: dict = field(default_factory=dict)  # MoE layer -> {"experts", "top_k", "bias", "router"}
    fp8_params: list[str] = field(default_factory=list)  # weights whose matmuls run in FP8
    split: object = None  # pipeline_split.SplitProgram: the chunks and the loss, once the split has run


def decisions(gm: fx.GraphModule) -> Decisions:
    """The :class:`Decisions` recorded on ``gm`` (empty until a pass records one)."""
    return gm.meta.setdefault("decisions", Decisions())


GraphCheck = Callable[[fx.GraphModule, RewriteContext], "str | None"]


@dataclass(frozen=True)
class Pass:
    """One rewrite and its contract."""

    name: str
    run: Callable[[fx.GraphModule, RewriteContext], fx.GraphModule]
    applies: Callable[[RewriteContext], bool]
    requires: tuple[str, ...] = ()  # node.meta keys every computing node must carry before the pass
    writes: tuple[str, ...] = ()  # node.meta keys it may add to the nodes it finds
    ensures: tuple[GraphCheck, ...] = ()  # graph facts afterwards: each returns what is wrong, or None
    summary: str = ""
    # "capture": runs on the freshly traced graph, before capture annotates it and before any plan
    # (the cost model reads its result); "plan": runs on the captured graph for a plan
    phase: str = "plan"


class Refusal(AutoshardError):
    """A pass cannot rewrite this model for one of the plan's choices. ``axis`` names the choice
    (``"tp"``, ``"cp"``, ``"sp"``, ...) and ``value`` its value, so that the planner can leave that
    choice out and search again instead of handing the user a plan it cannot emit. ``value`` None
    refuses every value but 1 (what the model is, not the degree, is the obstacle); ``divides`` N
    every value that does not divide N (a dimension of that size)."""

    def __init__(self, message: str, axis: str, value=None, divides: int | None = None):
        super().__init__(message)
        self.axis, self.value, self.divides = axis, value, divides

    @classmethod
    def at(
        cls, node: fx.Node, refused: str, why: str, axis: str, value=None, divides: int | None = None, fix: str = ""
    ):
        """The refusal of ``node``: "``refused``: ``why``; plan with ``fix``", where ``refused``
        says what cannot be done with ``{node}`` standing for the node in words, with its line in
        the model's code (:func:`autoshard.passes._graph.describe`); ``fix`` is ``--force axis=1``
        unless given."""
        message = f"{refused.format(node=describe(node))}: {why}; plan with {fix or f'--force {axis}=1'}"
        return cls(message, axis=axis, value=value, divides=divides)

    def exclusion(self):
        """What the planner leaves out of ``axis`` (``Problem.excluded``): the value, ``"*"`` for
        all but 1, or ``("divides", N)``."""
        if self.divides is not None:
            return ("divides", self.divides)
        return "*" if self.value is None else self.value


class ContractError(AutoshardError):
    """A pass broke its declared contract: a bug in autoshard, not in the user's model."""


def check_requires(p: Pass, gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op not in _COMPUTING:
            continue
        missing = [k for k in p.requires if k not in node.meta]
        if missing:
            raise ContractError(
                f"pass {p.name} requires node.meta {missing} but {node.format_node()} lacks it "
                "(an earlier step did not run); please report this with --debug"
            )


def _keys(gm: fx.GraphModule) -> dict[fx.Node, frozenset[str]]:
    return {n: frozenset(n.meta) for n in gm.graph.nodes}


def check_ensures(p: Pass, gm: fx.GraphModule, ctx: RewriteContext, before: dict[fx.Node, frozenset[str]]) -> None:
    for node in gm.graph.nodes:
        unknown = ir.unknown_keys(node.meta)
        if unknown:
            raise ContractError(f"pass {p.name} left undocumented node.meta keys {sorted(unknown)} on {node.name}")
        if node in before:
            added = set(node.meta) - before[node] - set(p.writes)
            if added:
                raise ContractError(
                    f"pass {p.name} wrote node.meta {sorted(added)} on {node.name} but declares only {list(p.writes)}"
                )
    for check in p.ensures:
        wrong = check(gm, ctx)
        if wrong:
            raise ContractError(f"pass {p.name} did not ensure its contract: {wrong}")


# what ``run_passes`` shows an observer: the pass, "before" or "after", the graph and the context
Observer = Callable[[Pass, str, fx.GraphModule, RewriteContext], None]


def run_passes(passes: list[Pass], gm: fx.GraphModule, ctx: RewriteContext, observe: Observer | None = None):
    """Run ``passes`` in order on ``gm``, those that apply to ``ctx``, checking each contract;
    ``observe`` sees the graph before and after each pass that runs; a terminal's progress line
    names the pass running."""
    for p in passes:
        if not p.applies(ctx):
            continue
        with progress.stage(p.name):
            check_requires(p, gm)
            before = _keys(gm)
            if observe:
                observe(p, "before", gm, ctx)
            gm = p.run(gm, ctx)
            if observe:
                observe(p, "after", gm, ctx)
            check_ensures(p, gm, ctx, before)
    return gm


class Dump:
    """An observer writing each pass's graph before and after it as readable code, one file each,
    numbered by the pass's place in the list: ``folder/04_tensor_parallel.before.py`` (as
    inductor's ``GraphTransformObserver`` does). After the pipeline split, the chunks' and the
    loss's code follow the graph's. Each rewrite of a plan (``restart``) replaces the files of the
    plan passes before it; the capture passes' files stay."""

    def __init__(self, folder: Path, order: list[Pass]):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise AutoshardError(
                f"--dump-passes {folder}: cannot make that folder ({e.strerror}); give another"
            ) from None
        self.folder, self.order = folder, [p.name for p in order]
        self.phases = {p.name: p.phase for p in order}
        self.restart(phase=None)

    def restart(self, phase: str | None = "plan") -> None:
        """Remove what an earlier rewrite wrote: every dump file (``phase`` None) or those of the
        passes of ``phase``."""
        for stale in [*self.folder.glob("*.before.py"), *self.folder.glob("*.after.py")]:
            name = stale.name.split(".")[0].split("_", 1)[-1]
            if phase is None or self.phases.get(name) == phase:
                stale.unlink()

    def __call__(self, p: Pass, when: str, gm: fx.GraphModule, ctx: RewriteContext) -> None:
        text = f"# {p.name}: {p.summary}\n# {when} the pass\n{gm.code}"
        split = decisions(gm).split
        if when == "after" and split is not None:
            parts = [
                *(f"# chunk {c}\n{chunk.code}" for c, chunk in enumerate(split.chunks)),
                f"# loss\n{split.loss.code}",
            ]
            text += "\n".join(parts)
        (self.folder / f"{self.order.index(p.name):02d}_{p.name}.{when}.py").write_text(text)


__all__ = [
    "Dump",
    "RewriteContext",
    "Pass",
    "Refusal",
    "ContractError",
    "run_passes",
    "check_requires",
    "check_ensures",
]
