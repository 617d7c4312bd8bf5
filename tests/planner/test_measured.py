"""The cost model against published, measured training runs (``autoshard.planner.measured``).

These runs were not used to set any profile value. When this was written the predictions came
within -8%..+1% of the measured step times in BF16 (seven NVIDIA runs: LLaMA-3 8B, 70B and 405B
at 8K tokens, 8 to 2,304 H100) and within -5%..+16% in FP8 (four NVIDIA runs and DeepSeek-V3 on
H800). NVIDIA's DeepSeek-V3 BF16 recipes: -6% on 1,024 H100 (49.1 s against 52.04 s), -67% on 128
GB200 (11.5 s against 34.23 s; ``measured`` says why, and that run's bound is its own). The bounds
below guard that agreement against drift; ``benchmarks/accuracy.py`` prints it.
"""

from dataclasses import replace

import pytest

from autoshard.planner import parse_force
from autoshard.planner.measured import _DGXC, RUNS, masked_attention_share, predict

from conftest import captured

STEP_RUNS = [r for r in RUNS if r.step_s is not None]
WITHIN = {"bf16": 0.10, "fp8": 0.20}


@pytest.mark.parametrize("run", STEP_RUNS, ids=lambda r: f"{r.source}: {r.name}")
def test_predicted_step_time_is_close_to_the_measured_one(run):
    _, cost = captured(run.model, run.config, run.seq)
    plan = predict(run, cost)
    # every published setting is honoured, not searched around
    pins = parse_force(run.pins)
    for axis in ("tp", "pp", "cp", "ep", "dp"):
        assert getattr(plan.mesh, axis) == pins.get(axis, getattr(plan.mesh, axis))
    assert (plan.schedule, plan.microbatch_size) == (
        pins.get("schedule", plan.schedule),
        pins.get("mbs", plan.microbatch_size),
    )
    assert plan.predicted.step_time_s == pytest.approx(run.step_s, rel=run.within or WITHIN[run.precision])


@pytest.mark.parametrize("seq", [8192, 131072])
def test_masked_attention_share_is_the_attention_core_over_the_causal_count(seq):
    # LLaMA-3 405B: the causal attention core is 6*L*h*s of about 6N + 6*L*h*s training FLOPs per
    # token (N = 405e9 parameters); a count that ignores the mask adds that term again.
    _, cost = captured("llama3", "405b", seq)
    attention = 6 * 126 * 16384 * seq
    assert masked_attention_share(cost, seq) == pytest.approx(attention / (6 * 405e9 + attention), rel=0.03)


def _smallest_bf16_recipes():
    """NVIDIA's tuned dense BF16 recipes, the smallest scale of each model (the rest repeat the
    mesh). Not the DeepSeek-V3 ones: by the cost model their EP64 all-to-all over the network
    (H100) and 1F1B without overlap cost far more than the search's plans (23.9 s against 49.1 s
    on 1,024 H100, an EP8 inside each node; 9.1 s against 11.5 s on 128 GB200), and that
    comparison is a search of minutes."""
    recipes = [r for r in STEP_RUNS if r.source == _DGXC and r.precision == "bf16"]
    configs = dict.fromkeys(r.config for r in recipes)
    return [min((r for r in recipes if r.config == c), key=lambda r: r.gpus) for c in configs]


@pytest.mark.parametrize("run", _smallest_bf16_recipes(), ids=lambda r: r.name)
def test_tuned_recipes_are_close_to_the_plan_the_search_chooses(run):
    """Where experts tuned the plan for a stack the cost model describes, the search's unpinned
    choice is at most 10% faster by the model than their plan (the issue's golden margin)."""
    _, cost = captured(run.model, run.config, run.seq)
    pinned = predict(run, cost).predicted.step_time_s
    free = predict(replace(run, pins=""), cost).predicted.step_time_s
    assert free <= pinned * 1.000001
    assert pinned <= free * 1.10
