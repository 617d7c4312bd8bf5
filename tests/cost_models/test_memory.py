import pytest

from autoshard.cost_models.estimate import estimate
from autoshard.cost_models.hardware import load
from autoshard.cost_models.memory import model_state_bytes


def test_zero_stages_match_the_zero_paper_example():
    # Rajbhandari et al.: 7.5B parameters, N_d = 64: 120 GB -> 31.4 / 16.6 / 1.9 GB.
    p = 7.5e9
    assert model_state_bytes(p, 0, 64)["total"] == pytest.approx(120e9)
    assert model_state_bytes(p, 1, 64)["total"] == pytest.approx(31.4e9, rel=0.01)
    assert model_state_bytes(p, 2, 64)["total"] == pytest.approx(16.6e9, rel=0.01)
    assert model_state_bytes(p, 3, 64)["total"] == pytest.approx(1.875e9)


def test_worked_estimate_example():
    # 2e12 params, 40e12 tokens, H100 at 50% MFU (issue #2).
    out = estimate(2e12, 40e12, load("h100"), mfu=0.5, gpus=2048, zero=3)
    assert out["flops"] == pytest.approx(4.8e26)
    assert out["model_state_bytes"] == pytest.approx(32e12)
    assert out["gpus_for_model_states"] == 400
    assert out["gpu_years"] == pytest.approx(30_700, rel=0.01)
    assert out["model_state_bytes_per_gpu"] == pytest.approx(15.6e9, rel=0.01)
    assert out["cost_usd"] == pytest.approx(out["gpu_hours"] * 2.0)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_experts_shard_over_their_expert_data_parallel_ranks(zero):
    """TP2 x DP64 with EP16 folded over the stage's 128 ranks: the dense states shard over the 64
    DP ranks, the experts' over the 128 / 16 = 8 ranks holding the same experts."""
    from autoshard.cost_models.memory import program_state_bytes, sharded_state_bytes

    dense, expert = 1e9, 8e9
    both = sharded_state_bytes(dense, expert, zero, 64, 2 * 64 // 16)
    for part in ("params", "grads", "optimizer", "total"):
        assert both[part] == pytest.approx(
            program_state_bytes(dense, zero, 64)[part] + program_state_bytes(expert, zero, 8)[part]
        )


def test_fsdp_shards_are_the_masters():
    """ZeRO-2/3 as the programs run them (FSDP2 over more than one rank): the fp32 shards are the
    parameters and the optimizer's masters at once, so the parameters hold 4 bytes over the ranks
    (and ZeRO-2 the bf16 weights whole beside them), the optimizer the two moments only: ZeRO-3
    holds 16 bytes over the ranks, not 2 + 4 + 12; ZeRO-2 the same total as the ZeRO paper's
    count with fp32 gradients. Over one rank FSDP2 does not run: the paper's count."""
    from autoshard.cost_models.memory import GRAD_REDUCE_BYTES, program_state_bytes

    p = 8e9
    z3 = program_state_bytes(p, 3, 8)
    assert (z3["params"], z3["grads"], z3["optimizer"], z3["total"]) == (4e9, 4e9, 8e9, 16e9)
    z2 = program_state_bytes(p, 2, 8)
    assert (z2["params"], z2["grads"], z2["optimizer"]) == (2 * p + 4e9, 4e9, 8e9)
    assert z2["total"] == model_state_bytes(p, 2, 8, GRAD_REDUCE_BYTES)["total"]
    for zero in (0, 1, 2, 3):
        assert program_state_bytes(p, zero, 1) == model_state_bytes(p, zero, 1, GRAD_REDUCE_BYTES)
    assert program_state_bytes(p, 1, 8) == model_state_bytes(p, 1, 8, GRAD_REDUCE_BYTES)
