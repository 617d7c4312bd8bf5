"""plan.md: the pipeline layout follows the schedule's chunk-to-rank map, and a plan the emitter
cannot run says why."""

import dataclasses
import json

import pytest

from autoshard.ir.plan import Plan
from autoshard.report import plan_markdown

from conftest import ROOT

GOLDEN = ROOT / "tests" / "golden"


def _plan(name: str) -> Plan:
    return Plan.from_dict(json.loads((GOLDEN / f"{name}.json").read_text())["plan"])


def _stage_lines(md: str) -> list[str]:
    section = md.split("## Pipeline stages", 1)[1].split("```", 2)[1]
    return [line for line in section.splitlines() if line.startswith("rank")]


def test_a_v_shape_schedule_puts_the_first_and_last_chunks_on_rank_0():
    plan = _plan("deepseek_v3_671b_2k_h800")
    assert plan.schedule == "dualpipev"
    lines = _stage_lines(plan_markdown(plan))
    assert len(lines) == plan.mesh.pp
    assert "embedding" in lines[0] and "head+loss" in lines[0]


def test_a_round_robin_schedule_puts_the_last_chunk_on_the_last_rank():
    plan = _plan("llama3_405b_131k_h100")
    assert plan.schedule in ("interleaved", "zero-bubble") and plan.virtual_stages > 1
    lines = _stage_lines(plan_markdown(plan))
    assert "embedding" in lines[0] and "head+loss" in lines[-1]
    assert all(line.count("|") == plan.virtual_stages - 1 for line in lines)


@pytest.mark.parametrize("reasons", [[], ["expert parallelism: no pass emits it yet", "fp8 matmuls: no pass"]])
def test_not_emitted_yet_lists_the_reasons_only_when_there_are_some(reasons):
    plan = dataclasses.replace(_plan("llama3_405b_8k_h100"), not_emitted=reasons)
    md = plan_markdown(plan)
    assert ("## Not emitted yet" in md) == bool(reasons)
    for reason in reasons:
        assert f"- {reason}" in md
