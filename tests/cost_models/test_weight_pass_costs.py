"""What a split backward's input pass keeps for its weight pass (ZB1P, ZB-V, DualPipeV): the
gradient of every output a weight is applied to. torch's input pass keeps it for the weighted
matmuls and for the norms' scales alike (``get_param_groups`` takes every parameter's consumer);
measured at full scale (``benchmarks/at_scale.py``), DeepSeek-V3 671B's busiest DualPipeV rank
held two hidden-size gradients per layer more than planned (its two RMSNorms' and the small MLA
norms': 3.5 GB over 26 waiting layers) before the norms were counted."""

import pytest

from autoshard.cost_models import hardware
from autoshard.cost_models.layers import LayerCosts

from conftest import captured

SEQ = 4096


@pytest.fixture(scope="module")
def analysed():
    return captured("llama3", "8b", SEQ)[1]


def test_the_weight_pass_keeps_the_gradients_of_the_norms_outputs_too(analysed):
    block = analysed.blocks[0]
    hidden = 4096
    norms = block.weighted_outputs
    assert len(norms) == 2  # the attention's and the MLP's RMSNorm; no matmul among them
    assert all(t.per_token and not t.tp_sharded for t in norms)
    for tp, sp in ((1, False), (4, True), (4, False)):
        costs = LayerCosts(analysed, SEQ, hardware.load("h100"), sp)
        held = costs.held_for_weights(0, 1, tp, 1)
        norm_bytes = 2 * 2 * SEQ * hidden / (tp if sp else 1)
        without = held - norm_bytes
        # what is left is the matmuls' output gradients: q, k, v, gate, up (column: 1/tp), o, down
        per_token = (4096 + 1024 + 1024 + 2 * 14336) / tp + 2 * 4096
        assert without == pytest.approx(2 * SEQ * per_token)
