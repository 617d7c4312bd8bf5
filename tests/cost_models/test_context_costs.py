"""What the all-gather CP variant costs a layer, as the emitted program runs it (measured at full
scale by ``benchmarks/at_scale.py``): without recomputation the attention keeps the gathered K/V
for its backward; a checkpointed layer keeps none of them and its backward's replay gathers them
a second time."""

import pytest

from autoshard.cost_models import hardware
from autoshard.cost_models.layers import LayerCosts, kv_gathers

from conftest import captured

H100 = hardware.load("h100")
SEQ = 8192


@pytest.fixture(scope="module")
def layers():
    analysed = captured("llama3", "8b", SEQ)[1]
    return analysed, LayerCosts(analysed, SEQ, H100, True)


def _cp(payload) -> dict:
    return {kind: n for axis, kind, n in payload if axis == "cp"}


def test_a_checkpointed_layer_gathers_kv_twice_and_keeps_none(layers):
    analysed, costs = layers
    block, tp, cp = 0, 2, 4
    plain = _cp(costs.payload(block, 1, tp, cp, 1, "allgather-kv", ()))
    replayed = _cp(costs.payload(block, 1, tp, cp, 1, "allgather-kv", (), frozenset({"activation"})))
    assert plain["all_gather"] > 0
    assert replayed["all_gather"] == pytest.approx(2 * plain["all_gather"])
    assert replayed["reduce_scatter"] == pytest.approx(plain["reduce_scatter"]) == pytest.approx(plain["all_gather"])
    assert kv_gathers(frozenset()) == 1 and kv_gathers(frozenset({"attention"})) == 2
    # kept: the gathered K/V less the local shard the saved tensors already count
    full = 2 * analysed.blocks[block].eval("kv_elems", 1, SEQ / cp) * cp / tp
    assert costs.gathered_kv_kept(block, 1, tp, cp, "allgather-kv", frozenset()) == pytest.approx(full * 3 / 4)
    assert costs.gathered_kv_kept(block, 1, tp, cp, "allgather-kv", frozenset({"activation"})) == 0
    assert costs.gathered_kv_kept(block, 1, tp, cp, "ring", frozenset()) == 0
    assert costs.gathered_kv_kept(block, 1, tp, 1, "flash", frozenset()) == 0


def test_mla_prices_queries_keys_and_values_at_their_own_head_sizes():
    """DeepSeek-V3's latent attention at ``tiny``: 4 heads, queries and keys of 24 (16 + 8 rotary),
    values of 16. The attention's FLOPs (QK^T over 24, PV over 16) and the K/V that context
    parallelism moves each use their own head size."""
    seq, heads, qk, v = 64, 4, 24, 16
    analysed = captured("deepseek_v3", "tiny", seq)[1]
    for block in analysed.blocks:
        assert block.eval("kv_elems", 1, seq) == seq * heads * (qk + v)
        assert block.eval("flops_attention", 1, seq) == 2 * heads * seq * seq * (qk + v) / 2  # causal: half
    costs = LayerCosts(analysed, seq, H100, True)
    kv_bytes = 2 * seq / 2 * heads * (qk + v)  # bf16, one CP2 rank's half of the sequence
    assert _cp(costs.payload(0, 1, 1, 2, 1, "ring", ()))["send"] == pytest.approx((4 * 2 - 2) * kv_bytes)
