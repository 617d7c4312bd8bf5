"""Golden plans: published configurations, planned from the cost model alone.

Each case checks that the decision the published plan is known for comes out of the search, that
the plan has not changed (``pytest --regen-golden`` rewrites tests/golden/*.json; review the diff
like code), and records how the published plan itself is predicted against the chosen one.
"""

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from autoshard import planner
from autoshard.cost_models import hardware
from autoshard.planner.measured import RUNS

from conftest import captured

GOLDEN = Path(__file__).parent / "golden"


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    config: str
    hardware: str
    gpus: int
    seq: int
    batch: int
    published: str  # the published configuration, as --force pins
    published_mfu: float
    precision: str = "bf16"
    # How close the cost model must come; None where it is known not to (see the case's comment)
    published_within: float | None = 0.10  # published plan's predicted step time vs the chosen one
    mfu_within: float | None = 0.25  # predicted MFU vs the published MFU, relative
    # The published plan against the best plan that uses the published schedule family
    same_schedule_within: float | None = 0.10


def _case(name: str, run: str, **within) -> Case:
    """A golden case from a published run of ``autoshard.planner.measured`` (its shape, pins, MFU)."""
    r = next(r for r in RUNS if r.name == run and r.mfu is not None)
    shape = (r.model, r.config, r.hardware, r.gpus, r.seq, r.global_batch)
    return Case(name, *shape, r.pins, r.mfu, r.precision, **within)


CASES = [
    # LLaMA-3 (arXiv 2407.21783, Table 4): interleaved schedule, FSDP-style DP (ZeRO-1 here).
    # At 8K tokens Meta's runs are slower than the cost model by 1.20-1.24x (1.25-1.29x if Meta
    # counted full attention), yet the same model predicts NVIDIA's measured step times for this
    # very 405B model at 8K tokens on 576-2,304 H100 within -1%..+1% (tests/planner/test_measured.py;
    # NVIDIA's MFU there is 54.5-55.8% by its full-attention count against Meta's 41-43%). The model
    # prices a tuned Megatron-class stack; it has no term for what Meta's run lost against one. It
    # also prefers TP2-4 with CP, as NVIDIA's own H100 recipes use CP2 at 8K, and a zero-bubble
    # schedule, which Meta did not run, to the published TP8 interleaved plan (12-15% slower by the
    # model). Restricted to the interleaved schedule, the published plan is within 10% of the best
    # (asserted below). The unrestricted margins are measured and reported, not asserted.
    _case("llama3_405b_16k_h100", "405b bf16 16384", published_within=None, mfu_within=None),
    _case("llama3_405b_8k_h100", "405b bf16 8192", published_within=None, mfu_within=None),
    _case("llama3_405b_131k_h100", "405b bf16 16384 131K"),
    # DeepSeek-V3 (arXiv 2412.19437, section 3): FP8 training, DualPipe, ZeRO-1, no TP. The
    # published layout (EP64 without CP) fits the model's 74 GB only by recomputing the experts,
    # and a recomputation that remakes the experts exchanges their tokens again, across nodes at
    # EP64 (measured at full scale: 1.50 of the planned expert-parallel bytes before the model
    # counted it). DeepSeek keeps the experts' inputs and recomputes only norms, MLA
    # up-projections and SwiGLU; the model's memory for that set does not fit on every rank at
    # EP64. With each pipeline rank choosing its own recompute set (the first ranks, holding the
    # most micro-batches, recompute more), predicted 25.8 s against 21.7 s for the chosen CP2 x
    # EP16 plan (1.19; 1.35 with one set for every rank): bounded, not within 10%.
    _case("deepseek_v3_671b_2k_h800", "deepseek-v3 fp8 2048", published_within=0.35, same_schedule_within=0.35),
]

DECISIONS = (
    "mesh",
    "zero_stage",
    "schedule",
    "virtual_stages",
    "microbatches",
    "microbatch_size",
    "stage_layers",
    "sequence_parallel",
    "checkpoint",
    "precision",
    "attention",
)

_RESULTS: dict = {}
_SAME_SCHEDULE: dict = {}  # the best plan restricted to the published plan's schedule


def plan_case(case: Case):
    if case.name not in _RESULTS:
        _, cost = captured(case.model, case.config, case.seq)
        problem = planner.Problem(
            cost,
            hardware.load(case.hardware),
            case.gpus,
            case.seq,
            case.batch,
            case.precision,
            {},
            f"{case.model}:{case.config}",
        )
        plan, result = planner.solve(problem)
        pins = planner.parse_force(case.published)
        comparison = planner.compare(problem, result, pins)
        published = (
            planner.Planner(
                planner.Problem(cost, problem.hw, case.gpus, case.seq, case.batch, case.precision, pins), alternatives=1
            )
            .run()
            .best
        )
        family = planner.parse_force(f"schedule={pins['schedule']}") if "schedule" in pins else {}
        same_schedule = planner.Planner(replace(problem, forced=family), alternatives=1).run().best
        _RESULTS[case.name] = (plan, comparison, published)
        _SAME_SCHEDULE[case.name] = same_schedule
    return _RESULTS[case.name]


def _golden(case: Case, request) -> dict:
    plan, comparison, published = plan_case(case)
    current = {
        "case": case.__dict__,
        "plan": plan.to_dict(),
        "published": {
            "pins": case.published,
            "step_time_s": published.step_time_s,
            "mfu": published.mfu,
            "slower_than_chosen": published.step_time_s / plan.predicted.step_time_s - 1,
            "best_same_schedule_s": _SAME_SCHEDULE[case.name].step_time_s,
            "slower_than_best_same_schedule": published.step_time_s / _SAME_SCHEDULE[case.name].step_time_s - 1,
            "comparison": comparison,
        },
    }
    path = GOLDEN / f"{case.name}.json"
    if request.config.getoption("--regen-golden") or not path.exists():
        path.write_text(json.dumps(current, indent=2) + "\n")
    return json.loads(path.read_text()), current


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_plan_matches_golden(case, request):
    golden, current = _golden(case, request)
    for key in DECISIONS:
        assert current["plan"][key] == golden["plan"][key], f"{key} changed; rerun with --regen-golden if intended"
    assert current["plan"]["predicted"]["step_time_s"] == pytest.approx(
        golden["plan"]["predicted"]["step_time_s"], rel=1e-6
    )
    assert current["published"]["step_time_s"] == pytest.approx(golden["published"]["step_time_s"], rel=1e-6)


def _inside_nvlink(plan, axis: str, domain: int) -> bool:
    stride = 1
    for a in plan.mesh.order:
        if a == axis:
            return stride * getattr(plan.mesh, a) <= domain
        stride *= getattr(plan.mesh, a)
    raise AssertionError(axis)


def test_deepseek_on_h800_takes_no_tensor_parallelism_but_experts_and_pipeline():
    plan, _, _ = plan_case(CASES[3])
    assert plan.mesh.tp == 1
    assert plan.mesh.ep > 1 and plan.mesh.pp > 1


@pytest.mark.parametrize("case", CASES[:2], ids=[c.name for c in CASES[:2]])
def test_llama3_uses_tensor_parallelism_inside_one_nvlink_domain(case):
    plan, _, _ = plan_case(case)
    assert plan.mesh.tp > 1
    assert _inside_nvlink(plan, "tp", hardware.load(case.hardware).nvlink_domain)


def test_llama3_at_128k_needs_context_parallelism():
    plan, _, _ = plan_case(CASES[2])
    assert plan.mesh.cp > 1


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_plan_md_explains_the_published_plan(case):
    plan, comparison, published = plan_case(case)
    assert comparison.startswith("Reference")
    if published.step_time_s > plan.predicted.step_time_s * 1.001:
        assert "step time" in comparison and "more" in comparison  # names what separates them


@pytest.mark.parametrize("case", [c for c in CASES if c.published_within], ids=lambda c: c.name)
def test_published_plan_is_predicted_close_to_the_chosen_one(case):
    plan, _, published = plan_case(case)
    assert published.step_time_s <= plan.predicted.step_time_s * (1 + case.published_within)


@pytest.mark.parametrize("case", [c for c in CASES if c.same_schedule_within], ids=lambda c: c.name)
def test_published_plan_is_close_to_the_best_plan_on_its_schedule(case):
    _, _, published = plan_case(case)
    best = _SAME_SCHEDULE[case.name]
    assert best.step_time_s <= published.step_time_s * 1.000001  # the search finds at least it
    assert published.step_time_s <= best.step_time_s * (1 + case.same_schedule_within)


@pytest.mark.parametrize("case", [c for c in CASES if c.mfu_within], ids=lambda c: c.name)
def test_predicted_mfu_is_close_to_the_published_one(case):
    plan, _, _ = plan_case(case)
    assert plan.predicted.mfu == pytest.approx(case.published_mfu, rel=case.mfu_within)


def test_every_golden_plan_fits_its_memory():
    for case in CASES:
        plan, _, _ = plan_case(case)
        assert plan.predicted.memory_bytes_per_gpu["total"] <= plan.predicted.memory_limit_bytes
        assert math.isfinite(plan.predicted.step_time_s)


def test_gpt3_selective_checkpointing_in_line_with_korthikanti():
    """Korthikanti et al.: selective recompute (the attention core) saves 70% of a GPT-3 layer's
    activations for about 2.7% extra FLOPs; full recompute costs about 33%."""
    _, cost = captured("gpt", "175b", 2048)
    layer = cost.blocks[0]
    step = 3 * layer.eval("flops", 1, 2048)  # forward + backward of one layer
    selective = layer.recompute_fn({"attention"})(1, 2048) / step
    full = layer.recompute_fn(set(layer.categories))(1, 2048) / step
    assert 0 < selective <= 0.027
    assert full == pytest.approx(1 / 3, rel=0.02)
    kept = layer.activation_bytes(1, 2048, tp=8, sp=True, recompute={"attention"})
    saved = 1 - kept / layer.activation_bytes(1, 2048, tp=8, sp=True)
    assert saved == pytest.approx(0.70, abs=0.03)
