"""The Plan: the single contract between planning and rewriting. A JSON-serialisable dataclass;
every quantity carries its unit in its name (``_s`` seconds, ``_bytes``, ``_per_s``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from autoshard.errors import AutoshardError
from autoshard.ir.categories import CHECKPOINT_CATEGORIES
from autoshard.ir.schedules import NAMES
from autoshard.ir.schedules import SCHEDULES as TABLE

PLAN_VERSION = 1
# the fields plan.json may leave out
OPTIONAL_FIELDS = (
    "alternatives", "forced", "notes", "not_emitted", "stage_checkpoint", "dp_bucket_bytes", "islands",
)  # fmt: skip
AXES = ("tp", "pp", "cp", "ep", "dp")  # the mesh's degrees, in the order a mesh tuple lists them
GRID_AXES = ("tp", "cp", "pp", "dp")  # the rank grid's axes (ep folds into cp x dp), innermost first by default
SCHEDULES = NAMES  # the schedule table's rows (autoshard.ir.schedules)
ATTENTION = ("flash", "ring", "allgather-kv")


@dataclass
class Mesh:
    """Parallel degrees. ``tp*pp*cp*dp`` GPUs; ``order`` lists tp, cp, pp, dp from innermost
    (consecutive ranks, NVLink) to outermost.

    Expert layers fold their own grid over the same ranks (Megatron-Core's MoE parallel folding):
    a pipeline stage's ``tp*cp*dp`` ranks, flattened in ``order`` with pp skipped (innermost
    fastest), split into expert-parallel groups of ``ep`` consecutive positions; rank ``r`` of a
    group holds experts ``[r*E/ep, (r+1)*E/ep)``. The ranks at the same index of every group are
    the expert-data-parallel group (``edp``), which sums the experts' gradients and over which
    ZeRO shards their states. ``etp`` is expert tensor parallelism: 1, experts keep whole
    weights (the only value the planner chooses)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    order: list[str] = field(default_factory=lambda: ["tp", "cp", "pp", "dp"])
    etp: int = 1

    @property
    def edp(self) -> int:
        """Ranks of a stage holding the same experts: ``tp*cp*dp / (ep*etp)``."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def product_form(self) -> str:
        return " x ".join(f"{a.upper()}{getattr(self, a)}" for a in AXES)

    def degrees(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}


@dataclass
class Predicted:
    step_time_s: float
    mfu: float  # model FLOPs (no recompute) / (step time x GPUs x bf16 peak)
    tokens_per_s: float
    bubble_fraction: float  # pipeline idle share of the step
    memory_bytes_per_gpu: dict[str, float]  # params, grads, optimizer, activations, buffers, total
    comm_s: dict[str, dict[str, float]]  # axis -> {"total": s, "exposed": s}, per step, busiest GPU
    compute_s: float  # arithmetic + memory-bound work per step, busiest GPU
    recompute_s: float  # of which recomputation
    memory_limit_bytes: float  # usable HBM: capacity minus the profile's reserve
    overlap_s: float = 0.0  # compute lost to communication running beside it (hidden is not free)
    optimizer_s: float = 0.0  # the optimizer step, busiest GPU (memory-bound: bytes per parameter stepped)
    # per pipeline rank, what one optimizer step holds and does there (``planner.promises``):
    # memory_bytes by part, matmul-class flops, comm_bytes by dimension and collective, and the
    # bytes each dimension sends on the wire; what ``autoshard verify --at-scale`` checks
    ranks: list[dict] = field(default_factory=list)


@dataclass
class Alternative:
    mesh: dict
    schedule: str
    zero_stage: int
    step_time_s: float | None  # None: infeasible
    mfu: float | None
    reason: str  # why it lost, in words with numbers


@dataclass
class Islands:
    """DiLoCo (Douillard et al., arXiv 2311.08105): the data-parallel ranks split into ``count``
    islands (the dp coordinate's outer part: island ``i`` holds dp ranks ``[i*dp/count,
    (i+1)*dp/count)``). Inside an island the plan runs as chosen (synchronous DP/ZeRO over its
    ``dp/count`` ranks); every ``sync_every`` steps the ranks at the same place in every island
    average their parameters' change since the last sync (the outer gradient) and take an outer
    Nesterov SGD step (``outer_lr``, ``outer_momentum``) from the synced copy.

    The cost fields (per GPU, per optimizer step, over the link between islands: the profile's
    ``wan_gbps``/``wan_latency_ms``) price the outer all-reduce amortised over ``sync_every`` steps
    against the synchronous data-parallel gradient reduction crossing that link every step."""

    count: int = 1
    sync_every: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_bytes_per_step: float = 0.0  # bytes each GPU sends between islands, per step (amortised)
    outer_s_per_step: float = 0.0  # the outer all-reduce's time, per step (amortised)
    sync_dp_bytes_per_step: float = 0.0  # what synchronous DP over the islands would send
    sync_dp_s_per_step: float = 0.0  # and its time
    link: str = ""  # the link priced, in words


@dataclass
class Plan:
    version: int
    model: dict  # name, params, layers, hidden, heads, kv_heads, experts, vocab, training FLOPs/token
    hardware: str
    gpus: int
    seq_len: int
    global_batch: int  # sequences per optimizer step
    mesh: Mesh
    zero_stage: int
    schedule: str
    virtual_stages: int
    microbatches: int
    microbatch_size: int  # sequences per micro-batch per data-parallel rank
    stage_layers: list[int]  # layers per virtual stage, in pipeline order; embedding on the first, head on the last
    sequence_parallel: bool
    # saved-tensor category -> "save" | "recompute"; where stages differ (``stage_checkpoint``), a
    # category any stage recomputes
    checkpoint: dict[str, str]
    precision: dict  # {"compute": "bf16", "fp8_matmuls": [...], "grad_reduce": "fp32"}
    attention: str
    predicted: Predicted
    alternatives: list[Alternative] = field(default_factory=list)
    forced: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # why the program emitter would refuse this plan (empty when ``compile`` can emit it); only a
    # plan searched over the whole space (``--plan-only``) can have reasons here
    not_emitted: list[str] = field(default_factory=list)
    # per virtual stage, in pipeline order, its own ``checkpoint`` (the chunks of one pipeline rank
    # alike): a rank holding more micro-batches in flight recomputes more; empty when every stage
    # uses ``checkpoint``
    stage_checkpoint: list[dict[str, str]] = field(default_factory=list)
    # bytes per bucket of the data-parallel gradient reduction the program overlaps with the last
    # backward (ZeRO-0/1; ``runtime.reduction``), from the cost model's latency and bandwidth of
    # that collective (``cost_models.comm.bucket_bytes``); 0: the program's own rule
    dp_bucket_bytes: int = 0
    # DiLoCo islands (``Islands``); None: one island, synchronous data parallelism throughout
    islands: Islands | None = None

    # -- serialisation ---------------------------------------------------------------------

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict, source: str = "plan.json") -> Plan:
        if not isinstance(data, dict):
            raise AutoshardError(f"{source}: not a plan (expected a JSON object)")
        version = data.get("version")
        if version != PLAN_VERSION:
            raise AutoshardError(
                f"{source}: plan format version {version!r}, this autoshard reads version {PLAN_VERSION}; "
                "recompile the plan with this version"
            )
        names = {f.name for f in fields(cls)}
        missing = [n for n in names if n not in data and n not in OPTIONAL_FIELDS]
        if missing:
            raise AutoshardError(f"{source}: missing field(s) {', '.join(sorted(missing))}; recompile the plan")
        unknown = set(data) - names
        if unknown:
            raise AutoshardError(f"{source}: unknown field(s) {', '.join(sorted(unknown))}")
        try:
            kwargs = dict(data)
            kwargs["mesh"] = Mesh(**data["mesh"])
            kwargs["predicted"] = Predicted(**data["predicted"])
            kwargs["alternatives"] = [Alternative(**a) for a in data.get("alternatives", [])]
            if data.get("islands") is not None:
                kwargs["islands"] = Islands(**data["islands"])
            plan = cls(**kwargs)
        except TypeError as e:
            raise AutoshardError(f"{source}: malformed plan ({e}); recompile the plan") from e
        plan.validate(source)
        return plan

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON (``path`` may be a directory: then ``path/plan.json``)."""
        path = Path(path)
        if path.is_dir() or not path.suffix:
            path = path / "plan.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json() + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        if path.is_dir():
            path = path / "plan.json"
        if not path.is_file():
            raise AutoshardError(f"plan not found: {path}; run `autoshard compile ... -o DIR` first")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise AutoshardError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from e
        return cls.from_dict(data, str(path))

    def validate(self, source: str = "plan") -> None:
        """Internal consistency, so that a hand-edited plan fails here and not at run time."""
        m = self.mesh
        problems = []
        for a in AXES:
            if not isinstance(getattr(m, a), int) or getattr(m, a) < 1:
                problems.append(f"mesh.{a} must be a positive integer")
        if problems:
            raise AutoshardError(f"{source}: {problems[0]}")
        if m.gpus != self.gpus:
            problems.append(f"tp*pp*cp*dp = {m.gpus} but gpus = {self.gpus}")
        if not isinstance(m.etp, int) or m.etp < 1:
            problems.append("mesh.etp must be a positive integer")
        elif (m.tp * m.cp * m.dp) % (m.ep * m.etp):
            problems.append(f"ep*etp = {m.ep * m.etp} does not divide a stage's tp*cp*dp = {m.tp * m.cp * m.dp} ranks")
        if sorted(m.order) != ["cp", "dp", "pp", "tp"]:
            problems.append(f"mesh.order must list tp, cp, pp, dp once each, got {m.order}")
        if self.schedule not in SCHEDULES:
            problems.append(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if len(self.stage_layers) != m.pp * self.virtual_stages:
            problems.append(
                f"stage_layers has {len(self.stage_layers)} entries, expected pp*virtual_stages = "
                f"{m.pp * self.virtual_stages}"
            )
        if sum(self.stage_layers) != self.model.get("layers", sum(self.stage_layers)):
            problems.append(
                f"stage_layers sum to {sum(self.stage_layers)}, the model has {self.model.get('layers')} layers"
            )
        if any(n < 0 for n in self.stage_layers):
            problems.append("stage_layers has a negative entry")
        if self.microbatches * self.microbatch_size * m.dp != self.global_batch:
            problems.append(
                f"microbatches x microbatch_size x dp = {self.microbatches * self.microbatch_size * m.dp}, "
                f"global_batch = {self.global_batch}"
            )
        if self.seq_len % (2 * m.cp) and m.cp > 1:
            problems.append(f"seq_len {self.seq_len} is not divisible by 2*cp = {2 * m.cp}")
        if self.zero_stage not in (0, 1, 2, 3):
            problems.append(f"zero_stage must be 0-3, got {self.zero_stage}")
        if self.attention not in ATTENTION:
            problems.append(f"attention {self.attention!r} is not one of {', '.join(ATTENTION)}")
        bad = [
            k for k, v in self.checkpoint.items() if k not in CHECKPOINT_CATEGORIES or v not in ("save", "recompute")
        ]
        if bad:
            problems.append(f"checkpoint entry {bad[0]!r} is not category -> save|recompute")
        problems += self._stage_checkpoint_problems()
        if self.islands is not None and (self.islands.count < 1 or m.dp % self.islands.count):
            problems.append(f"islands.count {self.islands.count} does not divide dp = {m.dp}")
        if problems:
            raise AutoshardError(f"{source}: inconsistent plan: {problems[0]}; recompile instead of editing by hand")

    def _stage_checkpoint_problems(self) -> list[str]:
        """What is wrong with ``stage_checkpoint``: one entry per virtual stage, each over
        ``checkpoint``'s categories, ``checkpoint`` recomputing what any stage recomputes, and the
        chunks of one pipeline rank alike (they share its memory)."""
        stages = self.stage_checkpoint
        if not stages:
            return []
        if not isinstance(stages, list) or len(stages) != len(self.stage_layers):
            return [f"stage_checkpoint must list one entry per virtual stage ({len(self.stage_layers)})"]
        for i, entry in enumerate(stages):
            if not isinstance(entry, dict) or set(entry) != set(self.checkpoint):
                return [f"stage_checkpoint[{i}] must name the categories of checkpoint: {sorted(self.checkpoint)}"]
            if any(v not in ("save", "recompute") for v in entry.values()):
                return [f"stage_checkpoint[{i}] maps a category to something but save|recompute"]
        if frozenset().union(*(self.stage_recompute(i) for i in range(len(stages)))) != self.recompute:
            return ["checkpoint must recompute exactly the categories some stage_checkpoint entry recomputes"]
        if self.schedule in TABLE:
            rank = {}
            for i in range(len(stages)):
                r = TABLE[self.schedule].chunk_rank(i, self.mesh.pp)
                if rank.setdefault(r, stages[i]) != stages[i]:
                    return [f"stage_checkpoint: the chunks of pipeline rank {r} recompute different sets"]
        return []

    # -- views -------------------------------------------------------------------------------

    @property
    def recompute(self) -> frozenset[str]:
        """The categories recomputed on some stage (on every stage, unless ``stage_checkpoint``
        says otherwise)."""
        return frozenset(k for k, v in self.checkpoint.items() if v == "recompute")

    def stage_recompute(self, stage: int) -> frozenset[str]:
        """The categories virtual stage ``stage`` recomputes."""
        entry = self.stage_checkpoint[stage] if self.stage_checkpoint else self.checkpoint
        return frozenset(k for k, v in entry.items() if v == "recompute")

    def rank_recompute_text(self) -> str:
        """Which pipeline ranks recompute what, runs of alike ranks together: "rank 0 recomputes
        attention+mlp; ranks 1-3 save everything" (one clause for all ranks without
        ``stage_checkpoint``)."""

        def what(rc: frozenset, one: bool) -> str:
            if rc:
                return f"recompute{'s' if one else ''} {'+'.join(sorted(rc))}"
            return f"save{'s' if one else ''} everything"

        pp = self.mesh.pp
        if not self.stage_checkpoint:
            return f"every rank: {what(self.recompute, False)}" if pp > 1 else what(self.recompute, False)
        sets: dict[int, frozenset] = {}
        for stage in range(len(self.stage_checkpoint)):
            sets.setdefault(TABLE[self.schedule].chunk_rank(stage, pp), self.stage_recompute(stage))
        runs, start = [], 0
        for r in range(1, pp + 1):
            if r == pp or sets[r] != sets[start]:
                who = f"rank {start}" if r - start == 1 else f"ranks {start}-{r - 1}"
                runs.append(f"{who} {what(sets[start], r - start == 1)}")
                start = r
        return "; ".join(runs)

    def layer_recompute(self, layer: int) -> frozenset[str]:
        """The categories layer ``layer`` recomputes: its stage's."""
        for stage, (start, end) in enumerate(self.stage_ranges()):
            if start <= layer < end:
                return self.stage_recompute(stage)
        return self.recompute

    def stage_ranges(self) -> list[tuple[int, int]]:
        """[start, end) layer range of each virtual stage."""
        out, start = [], 0
        for n in self.stage_layers:
            out.append((start, start + n))
            start += n
        return out
