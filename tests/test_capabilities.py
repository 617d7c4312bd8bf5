"""The capability table: what the emitted program cannot run, with the way out."""

import json
from pathlib import Path

import pytest

from autoshard.ir import capabilities
from autoshard.ir.plan import Plan
from autoshard.ir.schedules import SCHEDULES

GOLDEN = Path(__file__).parent / "golden"


def _plan(name: str) -> Plan:
    return Plan.from_dict(json.loads((GOLDEN / f"{name}.json").read_text())["plan"])


def test_every_limit_says_what_to_do_instead():
    for limit in capabilities.LIMITS:
        fields = {k: _blocking_value(k) for k in limit.reads}
        assert limit.blocks(**fields), limit.name
        reason = limit.reason(**fields)
        assert "--force" in reason or "--precision" in reason, limit.name


def _blocking_value(key: str):
    split = next(n for n, s in SCHEDULES.items() if s.split_backward)
    return {
        "ep": 8,
        "etp": 2,
        "fp8": ("attention", "experts", "mlp"),
        "zero": 3,
        "schedule": split,
        "pp": 4,
        "dpcp": 8,
        "recompute": frozenset({"attention"}),
        "every": frozenset({"attention", "activation"}),
    }[key]


def test_limits_read_only_fields_a_plan_has():
    fields = capabilities.plan_fields(_plan("llama3_405b_8k_h100"))
    for limit in capabilities.LIMITS:
        assert set(limit.reads) <= set(fields), limit.name


def test_the_published_deepseek_plan_is_emittable_with_its_fp8_and_expert_parallelism():
    plan = _plan("deepseek_v3_671b_2k_h800")
    assert plan.mesh.ep > 1 and plan.precision["fp8_matmuls"]
    assert capabilities.refusals(plan) == []


def test_expert_tensor_parallelism_is_not_emitted():
    plan = _plan("deepseek_v3_671b_2k_h800")
    plan.mesh.etp = 2
    assert any("ETP2" in r for r in capabilities.refusals(plan))


@pytest.mark.parametrize("name", ["llama3_405b_8k_h100", "llama3_405b_131k_h100"])
def test_dense_bf16_golden_plans_are_emittable(name):
    assert capabilities.refusals(_plan(name)) == []


def test_a_limit_is_tested_only_once_its_fields_are_known():
    assert capabilities.blocking(capabilities.LIMITS, zero=3) == []  # schedule, pp, dp x cp unknown
    assert capabilities.blocking(capabilities.LIMITS, zero=3, schedule="zbv", pp=2, dpcp=2)
    assert not capabilities.blocking(capabilities.LIMITS, zero=3, schedule="zbv", pp=2, dpcp=1)
    assert not capabilities.blocking(capabilities.LIMITS, zero=3, schedule="interleaved", pp=2, dpcp=2)
