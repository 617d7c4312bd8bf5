"""The same model, written two ways, gets the same facts and the same plan: transformers'
``LlamaForCausalLM`` (captured through torch.export; grouped-query keys repeated before attention,
its causal mask a tensor) against ``examples/llama3.py`` at the Llama-3 70B shape, planned on 1,024
H100; and transformers' MoE models report their experts as the graph holds them."""

import pytest
import torch

from autoshard import planner
from autoshard.capture import capture
from autoshard.cost_models import hardware
from autoshard.cost_models.analyze import analyze
from autoshard.ir import B, S

from conftest import captured
from graphs import TINY_DECODER

SEQ, GPUS, GLOBAL_BATCH = 8192, 1024, 2048  # NVIDIA's 70B recipe: 2 sequences of 8K per GPU
PLAN = ("mesh", "zero_stage", "schedule", "virtual_stages", "microbatches", "microbatch_size", "stage_layers")
PLAN += ("sequence_parallel", "precision", "attention")
# transformers' RMSNorm is written out (upcast, pow, mean, rsqrt, multiply, cast, scale); capture
# fuses it into one rms_norm, as the example calls it, so both price one norm that saves its
# input and drop the same tensors for recompute; what is left is transformers' upcast of the norm's
# input, a no-op cast the cost model still prices (0.8% of the predicted step at this shape)
STEP_WITHIN = 0.01


@pytest.fixture(scope="module")
def costs():
    """(transformers' Llama, the example) at 70B, captured and analysed at 8K tokens."""
    transformers = pytest.importorskip("transformers")
    import llama3

    c = llama3.CONFIGS["70b"]
    config = transformers.LlamaConfig(
        hidden_size=c.hidden,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        num_key_value_heads=c.kv_heads,
        intermediate_size=c.ffn,
        vocab_size=c.vocab,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.norm_eps,
        max_position_embeddings=SEQ,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    _, ours = captured("llama3", "70b", SEQ)
    return analyze(capture(model, seq=SEQ)), ours


def test_the_facts_are_the_same(costs):
    theirs, ours = (planner.model_summary(cost, "llama 70b", SEQ) for cost in costs)
    for fact in ("params", "layers", "hidden", "heads", "kv_heads", "experts", "vocab"):
        assert theirs[fact] == ours[fact], fact
    assert (ours["hidden"], ours["heads"], ours["kv_heads"]) == (8192, 64, 8)
    # causal attention counted causal in both: 449.3e9 per token, as the example has always had
    assert theirs["training_flops_per_token"] == pytest.approx(ours["training_flops_per_token"], rel=1e-3)


def test_the_plan_is_the_same(costs):
    plans = [
        planner.solve(planner.Problem(cost, hardware.load("h100"), GPUS, SEQ, GLOBAL_BATCH, "bf16", {}, "llama 70b"))[0]
        for cost in costs
    ]
    theirs, ours = (p.to_dict() for p in plans)
    assert {k: theirs[k] for k in PLAN} == {k: ours[k] for k in PLAN}
    assert plans[0].recompute == plans[1].recompute
    assert plans[0].predicted.step_time_s == pytest.approx(plans[1].predicted.step_time_s, rel=STEP_WITHIN)
    assert (ours["mesh"]["tp"], ours["mesh"]["pp"], ours["mesh"]["cp"]) == (2, 4, 4)  # the example's plan


_TOP2 = dict(num_experts_per_tok=2)


@pytest.mark.parametrize(
    ("config", "model", "experts", "ffn"),
    [
        ("MixtralConfig", "MixtralForCausalLM", dict(_TOP2, num_local_experts=4), 128),
        (
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
            32,
        ),
    ],
    ids=["mixtral", "qwen3-moe"],
)
def test_transformers_moe_models_report_their_experts(config, model, experts, ffn):
    """transformers stacks each layer's experts into one (experts, out, in) parameter and runs
    them as one grouped product over the routed tokens: its experts are the stack's first dim."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        built = getattr(transformers, model)(getattr(transformers, config)(**TINY_DECODER, **experts))
    cost = analyze(capture(built, seq=32))
    facts = planner.model_summary(cost, model, 32)
    assert (facts["experts"], facts["hidden"], facts["heads"], facts["kv_heads"]) == (4, 64, 4, 2)
    routed = [g for blk in cost.blocks for g in blk.gemms if g.experts]
    # gate and up fused, then down (one layer kind); each token's 2 picks spread evenly over the 4 experts
    assert sorted((g.batch, g.n, g.k) for g in routed) == [(4, 64, ffn), (4, 2 * ffn, 64)]
    assert all(g.m == 2 * B * S / 4 for g in routed)
