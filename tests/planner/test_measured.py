"""The cost model against published, measured training runs (``autoshard.planner.measured``).

These runs were not used to set any profile value. The targets (issue 28): over all step-time
runs the median |predicted/measured - 1| is at most ``MEDIAN_WITHIN`` (10%), and every run is
within ``WITHIN`` (25%) or within its own bound, which its comment and ``why`` explain. When this
was written: 34 runs (H100, H800, H200, B200, GB200; Megatron-Core, torchtitan, DeepSeek's
HAI-LLM), median 7.0%, 32 within 25%; beyond it only the two with their own bounds (NVIDIA's first
GB200 DeepSeek-V3 recipe and DeepSeek-V3's own run). ``benchmarks/accuracy.py`` prints it.
"""

import functools
import statistics
from dataclasses import replace

import pytest

from autoshard.planner import parse_force
from autoshard.planner.measured import _DGXC, MEDIAN_WITHIN, RUNS, WITHIN, masked_attention_share, predict

from conftest import captured

STEP_RUNS = [r for r in RUNS if r.step_s is not None]


@functools.cache
def _plan(run):
    _, cost = captured(run.model, run.config, run.seq)
    return predict(run, cost)


@pytest.mark.parametrize("run", STEP_RUNS, ids=lambda r: f"{r.source}: {r.name}")
def test_predicted_step_time_is_close_to_the_measured_one(run):
    plan = _plan(run)
    # every published setting is honoured, not searched around
    pins = parse_force(run.pins)
    for axis in ("tp", "pp", "cp", "ep", "dp"):
        assert getattr(plan.mesh, axis) == pins.get(axis, getattr(plan.mesh, axis))
    assert (plan.schedule, plan.microbatch_size) == (
        pins.get("schedule", plan.schedule),
        pins.get("mbs", plan.microbatch_size),
    )
    assert plan.predicted.step_time_s == pytest.approx(run.step_s, rel=run.within or WITHIN)


def test_the_median_miss_over_all_runs_is_within_the_target():
    misses = [abs(_plan(run).predicted.step_time_s / run.step_s - 1) for run in STEP_RUNS]
    assert statistics.median(misses) <= MEDIAN_WITHIN


def test_the_set_is_wide_and_each_own_bound_says_why():
    """At least 20 step-time runs, on every GPU the issue names, dense and MoE, from more than one
    training stack; a run may loosen its bound only with a reason, and only beyond ``WITHIN``."""
    assert len(STEP_RUNS) >= 20
    assert {"h100", "h200", "b200", "gb200-nvl72"} <= {r.hardware for r in STEP_RUNS}
    assert {"llama3", "deepseek_v3"} <= {r.model for r in STEP_RUNS}
    assert len({r.runtime for r in STEP_RUNS}) >= 2
    for run in STEP_RUNS:
        assert run.within is None or (run.within > WITHIN and run.why), run.name


@pytest.mark.parametrize("config,params", [("15b", 15.6e9), ("340b", 341.0e9)])
def test_nemotron4_has_the_published_parameter_count(config, params):
    # Nemotron-4 15B (arXiv 2402.16819): 3.2B embedding + 12.5B non-embedding parameters; 340B
    # (arXiv 2406.11704): 341B by its shapes (untied 256K embeddings, squared-ReLU MLP of 4h)
    _, cost = captured("nemotron4", config, 4096)
    assert cost.params == pytest.approx(params, rel=0.01)


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
    (H100) and 1F1B without overlap cost far more than the search's plans (when this was written,
    about half the step on 1,024 H100 with an EP8 inside each node), and that comparison is a
    search of minutes. Not the other recipes (Megatron-Bridge, Nemotron-4, torchtitan): this
    guards the margin on one family, it does not repeat it per source."""
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
