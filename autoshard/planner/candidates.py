"""The search space: what a plan chooses, the problem it is chosen for, and ``--force`` pins."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import permutations

from autoshard.cost_models.analyze import ModelCost, category_subsets
from autoshard.cost_models.hardware import Hardware
from autoshard.errors import AutoshardError
from autoshard.ir import FP8_DEFAULT, FP8_KINDS, capabilities
from autoshard.ir.plan import ATTENTION, AXES, CHECKPOINT_CATEGORIES, GRID_AXES
from autoshard.ir.schedules import SCHEDULES


@dataclass(frozen=True)
class Candidate:
    """One point of the search space (everything but the stage partition, which CP-SAT picks)."""

    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    mbs: int  # sequences per micro-batch
    fp8: tuple[str, ...]  # the matmul kinds in FP8 (autoshard.ir.FP8_KINDS), () for none
    attention: str
    recompute: frozenset[str]
    schedule: str = "1f1b"
    v: int = 1
    order: tuple[str, ...] = GRID_AXES
    zero: int = 1

    def mesh_key(self) -> tuple[int, ...]:
        return (self.tp, self.pp, self.cp, self.ep, self.dp)

    @property
    def edp(self) -> int:
        """Expert data parallelism: the ranks of a stage's tp x cp x dp that hold the same
        experts (``Mesh.edp``, expert tensor parallelism 1)."""
        return self.tp * self.cp * self.dp // self.ep


@dataclass
class Problem:
    cost: ModelCost
    hw: Hardware
    gpus: int
    seq: int
    global_batch: int
    precision: str = "bf16"  # bf16 | fp8 | auto
    forced: dict = field(default_factory=dict)
    model_name: str = "model"
    # search only what the emitted program can run (``autoshard.ir.capabilities``); off for
    # ``--plan-only`` and the golden cases, which search the whole space the cost model prices
    emit: bool = False
    # choices the rewrite passes refused for this model, by axis (``{"tp": {4}, "sp": {True}}``;
    # "*": every value but the trivial one), found by ``compile``'s dry run of the passes
    excluded: dict = field(default_factory=dict)
    exclusion_reasons: list = field(default_factory=list)
    # DiLoCo islands split the dp coordinate's outer part: dp the outermost axis of size > 1, so
    # that each island is a block of consecutive ranks (a datacenter's)
    dp_outermost: bool = False

    def __post_init__(self) -> None:
        if not self.cost.blocks:
            source = self.cost.captured.source
            raise AutoshardError(
                f"{source + ': ' if source else ''}the model has no stack of repeated layers (an nn.ModuleList or "
                "nn.Sequential of blocks its forward runs in turn), which autoshard splits into pipeline stages and "
                "shards layer by layer; hold the layers in one"
            )

    @property
    def sequence_parallel(self) -> bool:
        """Sequence parallelism with TP, unless pinned off or refused by the passes."""
        return self.forced.get("sp", True) and True not in self.excluded.get("sp", ())

    def allowed(self, **fields) -> bool:
        """No refusal of the passes and, when emitting, no limit of the program blocks ``fields``."""
        if any(self.refused(axis, fields.get(axis)) for axis in self.excluded):
            return False
        return not self.emit or capabilities.allows(**fields)

    def refused(self, axis: str, value) -> bool:
        """Whether a refusal of the passes (``excluded``) leaves ``value`` of ``axis`` out."""
        values = self.excluded.get(axis, ())
        if value in values or ("*" in values and value not in (None, 1, False)):
            return True
        # ("divides", N): a dimension of N elements cannot be split value ways
        return isinstance(value, int) and value > 1 and any(isinstance(x, tuple) and x[1] % value for x in values)

    @property
    def layer_kinds(self) -> list[int]:
        kinds = [0] * self.cost.num_layers
        for i, blk in enumerate(self.cost.blocks):
            for layer in blk.layers:
                kinds[layer] = i
        return kinds

    @property
    def num_layers(self) -> int:
        return self.cost.num_layers

    @property
    def categories(self) -> frozenset[str]:
        """The saved-tensor categories the model's layers have."""
        return frozenset(c for blk in self.cost.blocks for c in blk.categories)


# ---------------------------------------------------------------------------------------------
# --force


FORCE_FIELDS = {
    "tp": int,
    "pp": int,
    "cp": int,
    "ep": int,
    "dp": int,
    "zero": int,
    "schedule": str,
    "v": int,
    "microbatches": int,
    "mbs": int,
    "recompute": str,
    "fp8": str,
    "attention": str,
    "order": str,
    "stage_layers": str,
    "sp": str,
}


def parse_force(text: str | None) -> dict:
    """``tp=8,pp=16,schedule=interleaved,recompute=attention+activation`` -> typed pins."""
    if not text:
        return {}
    out: dict = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise AutoshardError(f"--force expects name=value pairs, got {item!r}")
        key, value = (x.strip() for x in item.split("=", 1))
        key = {"zero_stage": "zero", "virtual_stages": "v", "microbatch_size": "mbs"}.get(key, key)
        if key not in FORCE_FIELDS:
            raise AutoshardError(f"--force: unknown field {key!r}; fields: {', '.join(FORCE_FIELDS)}")
        if FORCE_FIELDS[key] is int:
            try:
                out[key] = int(value)
            except ValueError:
                raise AutoshardError(f"--force {key}={value}: expected a whole number") from None
            if out[key] < (0 if key == "zero" else 1):
                raise AutoshardError(f"--force {key}={value}: must be positive")
        else:
            out[key] = value
    return _normalise_force(out)


def _normalise_force(pins: dict) -> dict:
    if "schedule" in pins and pins["schedule"] not in SCHEDULES:
        raise AutoshardError(f"--force schedule={pins['schedule']}: choose one of {', '.join(SCHEDULES)}")
    if "attention" in pins and pins["attention"] not in ATTENTION:
        raise AutoshardError(f"--force attention={pins['attention']}: choose one of {', '.join(ATTENTION)}")
    if "zero" in pins and pins["zero"] not in (0, 1, 2, 3):
        raise AutoshardError(f"--force zero={pins['zero']}: ZeRO stage must be 0, 1, 2 or 3")
    if "sp" in pins:
        if pins["sp"] not in ("on", "off", "true", "false"):
            raise AutoshardError(f"--force sp={pins['sp']}: use on or off")
        pins["sp"] = pins["sp"] in ("on", "true")
    if "fp8" in pins:
        value = pins["fp8"]
        kinds = FP8_DEFAULT if value in ("on", "true") else () if value in ("off", "false") else value.split("+")
        bad = set(kinds) - set(FP8_KINDS)
        if bad:
            raise AutoshardError(
                f"--force fp8={value}: use on, off, or matmul kinds joined by + from {', '.join(FP8_KINDS)} "
                f"(on means {'+'.join(FP8_DEFAULT)})"
            )
        pins["fp8"] = tuple(sorted(set(kinds)))
    if "recompute" in pins:
        value = pins["recompute"]
        cats = (
            set() if value in ("none", "") else set(CHECKPOINT_CATEGORIES) if value == "full" else set(value.split("+"))
        )
        bad = cats - set(CHECKPOINT_CATEGORIES)
        if bad:
            raise AutoshardError(
                f"--force recompute: unknown category {sorted(bad)[0]!r}; use none, full, or "
                f"categories joined by + from {', '.join(CHECKPOINT_CATEGORIES)}"
            )
        pins["recompute"] = frozenset(cats)
    if "order" in pins:
        order = tuple(pins["order"].split("-"))
        if sorted(order) != sorted(GRID_AXES):
            raise AutoshardError(f"--force order={pins['order']}: list tp, cp, pp, dp joined by -, innermost first")
        pins["order"] = order
    if "stage_layers" in pins:
        try:
            pins["stage_layers"] = tuple(int(x) for x in pins["stage_layers"].split("+"))
        except ValueError:
            raise AutoshardError("--force stage_layers: layer counts joined by +, e.g. 7+8+8+...+7") from None
    return pins


# ---------------------------------------------------------------------------------------------
# enumeration


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def tp_choices(problem: Problem) -> list[int]:
    """TP degrees dividing every head count and split feature size, and each key/value head count
    or divided by it (fewer key/value heads than ranks: each shared by tp/heads ranks)."""
    dims = problem.cost.facts.get("tp_dims") or [1]
    g = 0
    for d in dims:
        g = math.gcd(g, d)
    kv = problem.cost.facts.get("kv_heads") or []
    return [t for t in divisors(g) if problem.gpus % t == 0 and all(h % t == 0 or t % h == 0 for h in kv)]


def check_problem(problem: Problem) -> None:
    """Inputs that admit no plan at all, reported before any search."""
    pins = problem.forced
    if problem.global_batch < 1 or problem.seq < 1 or problem.gpus < 1:
        raise AutoshardError("gpus, seq-len and global-batch must be positive")
    if (problem.precision == "fp8" or pins.get("fp8")) and "fp8" not in problem.hw.peak_tflops:
        raise AutoshardError(
            f"{problem.hw.name} has no FP8 peak in its profile (no FP8 tensor cores to plan for); plan FP8 for a "
            "GPU that has them (--hardware h100, h800, h200, b200) or use --precision bf16"
        )
    for axis in ("tp", "pp", "cp", "dp"):
        if axis in pins and problem.gpus % pins[axis]:
            raise AutoshardError(f"--force {axis}={pins[axis]} does not divide --gpus {problem.gpus}")
    if problem.emit:
        wanted = {k: pins[k] for k in ("ep", "fp8") if k in pins}
        if problem.precision == "fp8":
            wanted.setdefault("fp8", FP8_DEFAULT)
        for reason in capabilities.blocking(capabilities.EMIT_LIMITS, **wanted):
            raise AutoshardError(reason)
    if "schedule" in pins:  # what torch cannot run, for the pins given (other axes as they may be)
        every = problem.categories
        fields = {"schedule": pins["schedule"], "pp": pins.get("pp", 2), "dpcp": pins.get("dp", 2) * pins.get("cp", 1)}
        fields |= {"zero": pins["zero"]} if "zero" in pins else {}
        fields |= {"recompute": pins["recompute"] & every, "every": every} if "recompute" in pins else {}
        for reason in capabilities.blocking(capabilities.TORCH_LIMITS, **fields):
            raise AutoshardError(f"--force {_given(pins)}: {reason}")
    if "tp" in pins and pins["tp"] not in tp_choices(problem):
        allowed = ", ".join(map(str, tp_choices(problem)))
        raise AutoshardError(
            f"--force tp={pins['tp']} does not divide the model's heads and feature sizes "
            f"{problem.cost.facts.get('tp_dims')}; TP can be {allowed}"
        )
    if "cp" in pins and pins["cp"] > 1 and problem.seq % (2 * pins["cp"]):
        raise AutoshardError(f"--force cp={pins['cp']}: --seq-len {problem.seq} is not divisible by 2*cp")
    experts = problem.cost.facts.get("experts", 0)
    if "ep" in pins and pins["ep"] > 1 and (not experts or experts % pins["ep"]):
        raise AutoshardError(f"--force ep={pins['ep']} does not divide the model's {experts} experts")
    if "dp" in pins and problem.global_batch % pins["dp"]:
        raise AutoshardError(f"--force dp={pins['dp']}: --global-batch {problem.global_batch} is not divisible by DP")
    if not meshes(problem):
        unbatched = meshes(replace_batch(problem, problem.gpus))
        smallest_dp = min((m[4] for m in unbatched), default=None)
        if smallest_dp and problem.global_batch < smallest_dp:
            raise AutoshardError(
                f"--global-batch {problem.global_batch} is smaller than the smallest data-parallel degree "
                f"({smallest_dp}) that {problem.gpus} GPUs allow{_pin_text(pins)}; "
                f"raise it to a multiple of {smallest_dp}"
            )
        raise AutoshardError(_no_mesh(problem))


def _no_mesh(problem: Problem) -> str:
    """Why no mesh satisfies the divisibility rules: the pin that rules every mesh out, where
    dropping that one pin would leave some, else the rules themselves."""
    pins = problem.forced
    mesh_pins = {k: pins[k] for k in AXES if k in pins}
    shown = ",".join(f"{k}={v}" for k, v in mesh_pins.items())
    if problem.excluded and meshes(replace(problem, excluded={})):
        pinned = f"--force {shown}: " if shown else ""
        return (
            f"{pinned}every mesh left is one the rewrite passes refused for this model "
            f"({'; '.join(problem.exclusion_reasons)})"
        )
    grid = [k for k in ("tp", "pp", "cp", "dp") if k in mesh_pins]
    product = math.prod(mesh_pins[k] for k in grid)
    if problem.gpus % product or (len(grid) == 4 and product != problem.gpus):
        relation = "is not" if len(grid) == 4 else "does not divide"
        return f"--force {shown}: {'*'.join(grid)} = {product} {relation} --gpus {problem.gpus}"
    if mesh_pins.get("pp", 1) > problem.num_layers + 2:
        return (
            f"--force pp={mesh_pins['pp']}: more pipeline stages than the model's {problem.num_layers} layers "
            "and its embedding and head"
        )
    for axis, value in sorted(mesh_pins.items(), key=lambda kv: kv[0] != "ep"):  # EP's folding first
        others = meshes(replace(problem, forced={k: v for k, v in pins.items() if k != axis}))
        if not others:
            continue
        if axis == "ep":
            stages = sorted({tp * cp * dp for tp, _, cp, _, dp in others})
            return (
                f"--force {shown}: ep={value} does not divide the tp*cp*dp ranks of a pipeline stage, which "
                f"expert layers take their EP groups from; the other settings leave stages of "
                f"{', '.join(map(str, stages))} ranks"
            )
        allowed = sorted({m[AXES.index(axis)] for m in others})
        choices = ", ".join(map(str, allowed))
        return f"--force {shown}: no mesh has {axis}={value} with the other settings; {axis} can be {choices}"
    hint = "; try a power-of-two GPU count" if problem.gpus & (problem.gpus - 1) else ""
    return (
        f"{problem.gpus} GPUs admit no factorisation tp*pp*cp*dp with tp in {tp_choices(problem)}, "
        f"pp <= {problem.num_layers + 2}, 2*cp dividing --seq-len {problem.seq} and dp dividing "
        f"--global-batch {problem.global_batch}{_pin_text(pins)}{hint}"
    )


def replace_batch(problem: Problem, batch: int) -> Problem:
    return replace(problem, global_batch=batch)


def _given(pins: dict) -> str:
    """The pins as the user wrote them (``zero=3,schedule=zbv``)."""
    shown = {k: "+".join(sorted(v)) if isinstance(v, frozenset) else v for k, v in pins.items()}
    return ",".join(f"{k}={v}" for k, v in shown.items() if k in ("schedule", "zero", "recompute", "pp", "dp", "cp"))


def _pin_text(pins: dict) -> str:
    shown = {k: v for k, v in pins.items() if k in ("tp", "pp", "cp", "dp", "ep")}
    return f" under --force {shown}" if shown else ""


def meshes(problem: Problem) -> list[tuple[int, int, int, int, int]]:
    """(tp, pp, cp, ep, dp) that satisfy every divisibility rule."""
    pins, out = problem.forced, []
    experts = problem.cost.facts.get("experts", 0)
    max_stages = problem.num_layers + 2
    for tp in tp_choices(problem):
        rest = problem.gpus // tp
        for cp in divisors(rest):
            if cp > 1 and problem.seq % (2 * cp):
                continue
            for pp in divisors(rest // cp):
                if pp > max_stages:
                    continue
                dp = rest // (cp * pp)
                if problem.global_batch % dp:
                    continue
                # expert layers fold EP over the stage's tp x cp x dp ranks (``Mesh``)
                eps = divisors(math.gcd(experts, tp * cp * dp)) if experts else [1]
                for ep in eps:
                    mesh = {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "dp": dp}
                    if all(mesh[k] == pins[k] for k in mesh if k in pins) and problem.allowed(**mesh):
                        out.append((tp, pp, cp, ep, dp))
    return out


@lru_cache(maxsize=65536)
def runnable(schedule: str, pp: int, recompute: frozenset, every: frozenset, zero: int, dpcp: int) -> bool:
    """Combinations torch's runtime can run at all (``capabilities.TORCH_LIMITS``: a schedule
    that splits backward in two takes no selective recomputation and no ZeRO-3); the search keeps
    to them with or without ``Problem.emit``."""
    fields = {"schedule": schedule, "pp": pp, "recompute": recompute, "every": every, "zero": zero, "dpcp": dpcp}
    return not capabilities.blocking(capabilities.TORCH_LIMITS, **fields)


def family_options(problem: Problem, cp: int) -> list[tuple[tuple[str, ...], str]]:
    """(FP8 matmul kinds, attention variant) pairs a mesh with ``cp`` context-parallel ranks can
    take: FP8 off, or on for the default kinds (``autoshard.ir.FP8_DEFAULT``; ``--force fp8=``
    picks others)."""
    pins = problem.forced
    fp8s = [()]
    if "fp8" in problem.hw.peak_tflops:
        fp8s = {"bf16": [()], "fp8": [FP8_DEFAULT], "auto": [(), FP8_DEFAULT]}[problem.precision]
    if "fp8" in pins:
        fp8s = [pins["fp8"]]
    attentions = ["flash"] if cp == 1 else ["ring", "allgather-kv"]
    attentions = [a for a in attentions if pins.get("attention", a) == a]
    return [(f, a) for f in fp8s for a in attentions if problem.allowed(fp8=f, attention=a)]


def recompute_options(problem: Problem) -> list[frozenset[str]]:
    cats = sorted(problem.categories)
    if "recompute" in problem.forced:
        return [frozenset(problem.forced["recompute"] & set(cats))]
    return list(category_subsets(cats))


def schedules(problem: Problem, pp: int, m: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) that torch runs with ``pp`` stages and ``m`` micro-batches
    (``Schedule.runs_with``), at most one chunk per layer (plus the embedding and the head) each:
    1F1B, then the interleaved schedules by v, then the V-shaped ones."""
    pins = problem.forced
    vmax = max(1, (problem.num_layers + 2) // pp)
    out = []
    for name, s in SCHEDULES.items():
        for v in [s.fixed_v] if s.fixed_v else range(2, vmax + 1):
            if (pp > 1 or s.fixed_v == 1) and v <= vmax and s.runs_with(pp, m, v) is None:
                out.append((name, v))
    order = list(SCHEDULES)
    out.sort(key=lambda sv: (SCHEDULES[sv[0]].fixed_v or 1.5, sv[1], order.index(sv[0])))
    return [(s, v) for s, v in out if pins.get("schedule", s) == s and pins.get("v", v) == v]


def orders(c: Candidate, problem: Problem) -> list[tuple[str, ...]]:
    """Axis orders that differ in where some axis of size > 1 lands."""
    if "order" in problem.forced:
        return [problem.forced["order"]]
    sizes = {"tp": c.tp, "cp": c.cp, "pp": c.pp, "dp": c.dp}
    active = [a for a in GRID_AXES if sizes[a] > 1]
    idle = [a for a in GRID_AXES if sizes[a] == 1]
    outer = [p for p in permutations(active) if not problem.dp_outermost or p[-1] == "dp"]
    return [tuple(p) + tuple(idle) for p in outer] or [GRID_AXES]


def with_fields(c: Candidate, **kw) -> Candidate:
    return replace(c, **kw)
