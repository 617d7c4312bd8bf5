"""``autoshard explain PLAN --what-if KEY=VALUE``: a counterfactual answered from a compiled plan,
without capturing the model again.

``compile`` writes, beside ``plan.json``, a snapshot of the search's whole input (``cost.pkl``):
the cost analysis frozen without its graph (``ModelCost.freeze``: every recomputation closure the
planner can ask for, sympy expressions in micro-batch and sequence), the hardware profile, the
run's sizes, the pins, the precision and what the rewrite passes refused. A what-if changes that
problem (a hardware field, another profile, the GPU count, the sequence length, the global batch)
and asks the planner twice:

1. the **same layout** under the change: the plan's mesh, axis order, schedule, ZeRO stage,
   micro-batch size, stage split, FP8, attention and sequence parallelism pinned (``--force``'s
   pins), and its recompute set too; where that set no longer fits, the layout is priced with
   the set the planner picks for it. DP takes up a changed GPU count and the micro-batch count a
   changed DP or global batch;
2. the **best plan** for the changed problem, searched afresh;

and says what moved: step time, MFU, memory per GPU, days and dollars per trillion tokens, and
the terms of the step time (``planner.explain.components``) that moved most.

The snapshot is a pickle: load only snapshots you wrote. It records the versions of autoshard,
the plan format, sympy and Python that wrote it; another version refuses it (recompile).
"""

from __future__ import annotations

import gzip
import importlib.metadata
import math
import pickle
import sys
from dataclasses import fields, replace
from pathlib import Path

import sympy

from autoshard import planner
from autoshard.cost_models import hardware as hw
from autoshard.errors import AutoshardError
from autoshard.ir.plan import PLAN_VERSION, Mesh, Plan
from autoshard.planner.candidates import Candidate
from autoshard.planner.costs import CandidateCosts
from autoshard.planner.evaluate import Evaluator
from autoshard.planner.explain import COMPONENTS, components, why_slower
from autoshard.planner.search import Evaluation, Planner

SNAPSHOT = "cost.pkl"
FORMAT = 1  # the snapshot's own layout
RUN_KEYS = ("gpus", "seq_len", "global_batch")
TABLES = ("peak_tflops", "overlap")  # profile tables a key may name an entry of (``peak_tflops.bf16``)
SECONDS_PER_DAY = 86400.0
TOKENS = 1e12  # days and dollars are per trillion training tokens


def versions() -> dict[str, object]:
    """What a snapshot must be read back by: its layout, the plan format and the code that pickled
    (autoshard, sympy) and compiled (Python) its expressions."""
    return {
        "format": FORMAT,
        "autoshard": importlib.metadata.version("autoshard"),  # the package's, as pyproject.toml sets it
        "plan": PLAN_VERSION,
        "sympy": sympy.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def freeze(problem: planner.Problem) -> planner.Problem:
    """``problem`` with its cost frozen (``ModelCost.freeze``) and its mutable parts copied: what
    ``compile`` snapshots once its search is done, before anything rewrites the graph."""
    return replace(
        problem,
        cost=problem.cost.freeze(),
        forced=dict(problem.forced),
        excluded={k: set(v) for k, v in problem.excluded.items()},
        exclusion_reasons=list(problem.exclusion_reasons),
    )


def dumps(frozen: planner.Problem) -> bytes:
    """The snapshot file's bytes: gzip of the versions, then the frozen problem, pickled."""
    return gzip.compress(
        pickle.dumps(versions(), protocol=pickle.HIGHEST_PROTOCOL)
        + pickle.dumps(frozen, protocol=pickle.HIGHEST_PROTOCOL),
        compresslevel=6,
        mtime=0,  # the same snapshot for the same problem: compile writes the same files each time
    )


def load(plan_path: str | Path) -> tuple[Plan, planner.Problem]:
    """The plan at ``plan_path`` (``plan.json`` or its directory) and the problem its snapshot
    holds; a one-line error where there is none or another version wrote it."""
    plan = Plan.load(plan_path)
    folder = Path(plan_path)
    folder = folder if folder.is_dir() else folder.parent
    path = folder / SNAPSHOT
    recompile = f"recompile the plan (autoshard compile ... -o {folder}) to ask what-if questions"
    if not path.is_file():
        raise AutoshardError(f"{folder} has no {SNAPSHOT} (a plan compiled before snapshots were written); {recompile}")
    try:
        with gzip.open(path, "rb") as f:
            wrote = pickle.load(f)
            if wrote != versions():
                raise AutoshardError(
                    f"{path} was written by {_versions_text(wrote)}, this is {_versions_text()}; {recompile}"
                )
            problem = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError, TypeError) as e:
        raise AutoshardError(f"{path} cannot be read ({type(e).__name__}: {e}); {recompile}") from None
    if not isinstance(problem, planner.Problem):
        raise AutoshardError(f"{path} holds no planning problem; {recompile}")
    return plan, problem


def _versions_text(v: dict | None = None) -> str:
    v = v if isinstance(v, dict) else {}
    v = v or versions()
    return (
        f"autoshard {v.get('autoshard')} (plan format {v.get('plan')}, snapshot format {v.get('format')}), "
        f"sympy {v.get('sympy')}, Python {v.get('python')}"
    )


# ---------------------------------------------------------------------------------------------
# the question


def hardware_keys() -> list[str]:
    """The profile's numeric fields a what-if may set."""
    return [f.name for f in fields(hw.Hardware) if hw.numeric(f.name)]


def keys_text() -> str:
    tables = ", ".join(f"{t}.<key>" for t in TABLES)
    return f"{', '.join(RUN_KEYS)}, hardware, {', '.join(hardware_keys())}, {tables}"


def parse(items: list[str]) -> dict[str, str]:
    """``["nvlink_gbps=100", "gpus=8192"]`` -> ``{"nvlink_gbps": "100", "gpus": "8192"}``, each
    key known and given once (``seq-len`` is ``seq_len``)."""
    out: dict[str, str] = {}
    for item in items:
        key, eq, value = (x.strip() for x in item.partition("="))
        key = key.replace("-", "_")
        table, dot, entry = key.partition(".")
        known = key in RUN_KEYS or key == "hardware" or key in hardware_keys() or (dot and table in TABLES and entry)
        if not eq or not value or not known:
            raise AutoshardError(f"--what-if {item!r}: expected KEY=VALUE with KEY one of {keys_text()}")
        if key in out:
            raise AutoshardError(f"--what-if {key} is given twice; give each key once")
        out[key] = value
    return out


def changed(problem: planner.Problem, changes: dict[str, str]) -> tuple[planner.Problem, list[dict]]:
    """``problem`` under ``changes`` (``parse``), and each change as ``{"key", "from", "to"}``.
    ``hardware=`` first (another profile, keeping the plan's memory headroom), then the profile's
    fields, then the run's sizes."""
    profile, done = problem.hw, []
    if "hardware" in changes:
        profile = replace(hw.load(changes["hardware"]), memory_headroom=problem.hw.memory_headroom)
        done.append({"key": "hardware", "from": problem.hw.name, "to": profile.name})
    fields_ = {k: _number(k, v) for k, v in changes.items() if k not in RUN_KEYS and k != "hardware"}
    if fields_:
        before = profile
        profile = hw.changed(profile, fields_, "--what-if")
        done += [{"key": k, "from": _field(before, k), "to": _field(profile, k)} for k in fields_]
    sizes = {"gpus": problem.gpus, "seq_len": problem.seq, "global_batch": problem.global_batch}
    for key in RUN_KEYS:
        if key in changes:
            value = _number(key, changes[key])
            if value != int(value) or value < 1:
                raise AutoshardError(f"--what-if {key}={changes[key]}: must be a positive whole number")
            done.append({"key": key, "from": sizes[key], "to": int(value)})
            sizes[key] = int(value)
    out = replace(problem, hw=profile, gpus=sizes["gpus"], seq=sizes["seq_len"], global_batch=sizes["global_batch"])
    return out, done


def _number(key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise AutoshardError(f"--what-if {key}={text}: expected a number") from None
    if not math.isfinite(value):
        raise AutoshardError(f"--what-if {key}={text}: expected a finite number")
    return value


def _field(profile: hw.Hardware, key: str):
    table, _, entry = key.partition(".")
    return (getattr(profile, table) or {}).get(entry) if entry else getattr(profile, key)


def layout_pins(plan: Plan) -> dict:
    """The plan's layout as ``--force`` pins (``planner.parse_force``'s typed form): all but DP
    and the micro-batch count, which follow from the GPUs and the global batch; the recompute
    set where every rank uses the same one."""
    m = plan.mesh
    pins = {
        "tp": m.tp,
        "pp": m.pp,
        "cp": m.cp,
        "ep": m.ep,
        "order": tuple(m.order),
        "schedule": plan.schedule,
        "v": plan.virtual_stages,
        "zero": plan.zero_stage,
        "mbs": plan.microbatch_size,
        "stage_layers": tuple(plan.stage_layers),
        "fp8": tuple(sorted(plan.precision.get("fp8_matmuls", []))),
        "attention": plan.attention,
        "sp": plan.sequence_parallel,
    }
    if not plan.stage_checkpoint:
        pins["recompute"] = plan.recompute
    return pins


def priced(problem: planner.Problem, pins: dict) -> Evaluation:
    """The best plan of ``problem`` under ``pins`` besides its own (one layout: priced)."""
    return Planner(replace(problem, forced={**problem.forced, **pins}), alternatives=1).run().best


def same_layout(problem: planner.Problem, pins: dict) -> tuple[Evaluation | None, str]:
    """The plan's layout (``pins``) priced on ``problem``: (its evaluation, a note), with the
    planner's recompute set where the plan's no longer fits; (None, why) where nothing does."""
    try:
        return priced(problem, pins), ""
    except AutoshardError as e:
        why = _why_not(problem, pins, str(e))
    if "recompute" not in pins:
        return None, why
    kept = "+".join(sorted(pins["recompute"])) or "nothing"
    try:
        ev = priced(problem, {k: v for k, v in pins.items() if k != "recompute"})
    except AutoshardError:
        return None, f"recomputing {kept}, it {why}; no other recompute set fits either" if "fit" in why else why
    return ev, f"recomputing {kept}, as the plan does, it no longer fits ({why}); priced with the set the planner picks"


def _why_not(problem: planner.Problem, pins: dict, error: str) -> str:
    """Why the layout ``pins`` has no plan on ``problem``: its memory where it does not fit (the
    candidate evaluated on its own, every rank recomputing the pinned set, or everything where
    the ranks' sets differ), else the planner's ``error``."""
    layout = pins["tp"] * pins["pp"] * pins["cp"]
    if problem.gpus % layout:
        return f"its TP x PP x CP = {layout} GPUs do not divide {problem.gpus} GPUs"
    dp = problem.gpus // layout
    if problem.global_batch % (dp * pins["mbs"]):
        return (
            f"the global batch of {problem.global_batch} does not split into DP {dp} x micro-batches of "
            f"{pins['mbs']} sequence(s)"
        )
    reason = _reason(error)
    if "fit" not in reason:  # a rule the layout breaks under the change, not its memory
        return reason
    pinned = replace(problem, forced={**problem.forced, **pins})
    recompute = pins.get("recompute", pinned.categories)
    c = Candidate(
        pins["tp"], pins["pp"], pins["cp"], pins["ep"], dp, pins["mbs"], pins["fp8"], pins["attention"],
        frozenset(recompute), pins["schedule"], pins["v"], pins["order"], pins["zero"],
    )  # fmt: skip
    return Evaluator(CandidateCosts(pinned)).evaluate(c, pins["stage_layers"]).reason or reason


def _reason(error: str) -> str:
    """The planner's error about the layout's pins in the layout's words: what follows the pins
    of "no plan satisfies --force ...", or a broken pin's rule as the plan's."""
    if error.startswith("no plan satisfies"):
        return error.split(": ", 1)[-1].split("; relax a pin")[0]
    return error.replace("--force ", "the plan's ", 1)


def ask(plan_path: str | Path, items: list[str]) -> dict:
    """What the plan at ``plan_path`` becomes under the what-ifs ``items`` (``KEY=VALUE``): the
    answer as plain data (``text`` words it)."""
    plan, problem = load(plan_path)
    new, changes = changed(problem, parse(items))
    pins = layout_pins(plan)
    base = priced(problem, pins)
    same, why = same_layout(new, pins)
    try:
        best_plan, result = planner.solve(new)
    except AutoshardError as e:  # nothing fits the changed problem: say so beside the rest
        best_plan, result, nothing = None, None, str(e)
    best = result.best if result else None
    answer = {
        "plan": str(plan_path),
        "changes": changes,
        "notes": _notes(plan, problem, new, base),
        "before": _summary(problem, base),
        "same_layout": _summary(new, same) if same else {"fits": False, "reason": why},
        "best": _summary(new, best) if best else {"fits": False, "reason": nothing},
        "moved": _moved(base, same) if same else [],
    }
    if same and why:
        answer["same_layout"]["note"] = why
    if best is None:
        answer["best_vs_same"] = "no plan fits the changed problem"
    elif same is None:
        answer["best_vs_same"] = "the current layout does not run under the change"
    elif same.step_time_s > best.step_time_s * (1 + 1e-9):
        reason = why_slower(best.breakdown, best.step_time_s, same.breakdown, same.step_time_s, _mesh(same).degrees())
        answer["best_vs_same"] = f"keeping the current layout is {reason}"
    else:
        answer["best_vs_same"] = "the current layout is still the best the planner finds"
    if best_plan:
        answer["best"]["alternatives"] = [
            {"mesh": a.mesh, "schedule": a.schedule, "zero_stage": a.zero_stage, "reason": a.reason}
            for a in best_plan.alternatives[:3]
        ]
    return answer


def _notes(plan: Plan, old: planner.Problem, new: planner.Problem, base: Evaluation) -> list[str]:
    notes = []
    if not math.isclose(base.step_time_s, plan.predicted.step_time_s, rel_tol=1e-6):
        cause = (
            "its pipeline ranks' recompute sets, chosen again for its stage split, differ from the plan's"
            if plan.stage_checkpoint
            else "the comparison starts from the snapshot's"
        )
        notes.append(
            f"the snapshot prices the plan at {_seconds(base.step_time_s)}/step, plan.json says "
            f"{_seconds(plan.predicted.step_time_s)}: {cause}"
        )
    if new.seq * new.global_batch != old.seq * old.global_batch:
        notes.append(
            f"tokens per step change from {old.seq * old.global_batch:,} to {new.seq * new.global_batch:,}: "
            "compare tokens/s and days per trillion tokens rather than step times"
        )
    if new.emit:
        notes.append(
            "the new layouts were not rewritten by the passes, which may refuse one for this model; compile to confirm"
        )
    if old.forced:
        notes.append("the plan's own --force pins hold in the fresh search too")
    return notes


def _mesh(ev: Evaluation) -> Mesh:
    c = ev.candidate
    return Mesh(tp=c.tp, pp=c.pp, cp=c.cp, ep=c.ep, dp=c.dp, order=list(c.order))


def _summary(problem: planner.Problem, ev: Evaluation) -> dict:
    """One priced plan, as the answer shows it."""
    c = ev.candidate
    tokens_per_s = problem.global_batch * problem.seq / ev.step_time_s
    days = TOKENS / tokens_per_s / SECONDS_PER_DAY
    recompute = sorted(frozenset().union(*ev.rank_recompute) if ev.rank_recompute else c.recompute)
    return {
        "fits": True,
        "hardware": problem.hw.name,
        "gpus": problem.gpus,
        "seq_len": problem.seq,
        "global_batch": problem.global_batch,
        "layout": {
            **_mesh(ev).degrees(),
            "order": list(c.order),
            "schedule": c.schedule,
            "virtual_stages": c.v,
            "zero_stage": c.zero,
            "microbatches": problem.global_batch // (c.dp * c.mbs),
            "microbatch_size": c.mbs,
            "recompute": recompute,
            "fp8_matmuls": list(c.fp8),
            "stage_layers": list(ev.stage_layers),
        },
        "step_time_s": ev.step_time_s,
        "mfu": ev.mfu,
        "training_flops_per_token": problem.cost.flops_per_token(problem.seq)["training"],
        "memory_bytes_per_gpu": ev.memory.get("total", 0.0),
        "memory_limit_bytes": problem.hw.usable_bytes,
        "tokens_per_s": tokens_per_s,
        "days_per_1t_tokens": days,
        "usd_per_1t_tokens": days * 24 * problem.gpus * problem.hw.price_per_gpu_hour,
        "terms_s": components(ev.breakdown),
    }


def _moved(base: Evaluation, same: Evaluation, most: int = 3) -> list[dict]:
    """The terms of the step time (``components``) that moved most from ``base`` to ``same``,
    largest change first; those under 1% of the larger step time left out."""
    before, after = components(base.breakdown), components(same.breakdown)
    floor = 0.01 * max(base.step_time_s, same.step_time_s)
    moved = sorted(COMPONENTS, key=lambda k: -abs(after[k] - before[k]))
    return [
        {"term": k, "before_s": before[k], "after_s": after[k]}
        for k in moved[:most]
        if abs(after[k] - before[k]) > floor
    ]


# ---------------------------------------------------------------------------------------------
# words

TERMS = {
    "compute": "compute",
    "recompute": "recomputation",
    "optimizer": "optimizer step",
    "bubble": "pipeline bubble",
    "imbalance": "stage imbalance",
    "overlap": "compute lost to overlapped communication",
    "tp": "exposed tensor-parallel communication",
    "cp": "exposed context-parallel communication",
    "ep": "exposed expert all-to-all",
    "pp": "exposed pipeline sends",
    "dp": "exposed data-parallel communication",
}


def text(answer: dict) -> str:
    """The answer in words, for the terminal."""
    change = ", ".join(f"{c['key']} {_value(c['from'])} -> {_value(c['to'])}" for c in answer["changes"])
    before, same, best = answer["before"], answer["same_layout"], answer["best"]
    lines = [f"What if {change or 'nothing changes'}:"]
    lines.append(f"  now:         {_layout(before)}")
    lines.append(f"               {_numbers(before)}")
    if same["fits"]:
        lines.append(f"  same layout: {_layout(same)}")
        lines.append(f"               {_numbers(same, before)}")
        if same.get("note"):
            lines.append(f"               ({same['note']})")
        for m in answer["moved"]:
            delta = m["after_s"] - m["before_s"]
            lines.append(
                f"               {TERMS[m['term']]}: {_seconds(m['before_s'])} -> {_seconds(m['after_s'])} "
                f"({'+' if delta >= 0 else '-'}{_seconds(abs(delta))})"
            )
    else:
        lines.append(f"  same layout: no longer runs: {same['reason']}")
    if best["fits"]:
        lines.append(f"  best plan:   {_layout(best)}")
        lines.append(f"               {_numbers(best, before)}")
    else:
        lines.append(f"  best plan:   none: {best['reason']}")
    lines.append(f"  {answer['best_vs_same']}")
    lines += [f"  note: {n}" for n in answer["notes"]]
    return "\n".join(lines)


def _seconds(t: float) -> str:
    """``4.700 s``, or ``12.3 ms`` below a second (a tiny model's step)."""
    if abs(t) < 5e-7:  # a difference of two sums: rounding, not time
        return "0 s"
    return f"{t:.3f} s" if abs(t) >= 1 else f"{t * 1e3:.3g} ms"


def _value(v) -> str:
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)


def _layout(s: dict) -> str:
    lay = s["layout"]
    mesh = " x ".join(f"{k.upper()}{lay[k]}" for k in ("tp", "pp", "cp", "ep", "dp"))
    rc = "+".join(lay["recompute"]) or "nothing"
    return (
        f"{mesh}, ZeRO-{lay['zero_stage']}, {lay['schedule']} (v={lay['virtual_stages']}), "
        f"{lay['microbatches']} micro-batches of {lay['microbatch_size']}, recompute {rc}"
    )


def _numbers(s: dict, ref: dict | None = None) -> str:
    def pct(key: str) -> str:
        return f" ({(s[key] / ref[key] - 1) * 100:+.1f}%)" if ref and ref[key] else ""

    return (
        f"{_seconds(s['step_time_s'])}/step{pct('step_time_s')}, {s['mfu'] * 100:.1f}% MFU, "
        f"{s['memory_bytes_per_gpu'] / 1e9:.1f} of {s['memory_limit_bytes'] / 1e9:.1f} GB/GPU, "
        f"{s['tokens_per_s']:,.0f} tokens/s, {s['days_per_1t_tokens']:.2f} days and "
        f"${s['usd_per_1t_tokens']:,.0f} per 1T tokens{pct('usd_per_1t_tokens') if ref else ''}"
    )
