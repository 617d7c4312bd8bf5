"""Flash-attention pass: SDPA calls and the written-out causal softmax(QK^T)V pattern become one
``fused_attention`` call, and the loss is unchanged."""

import sys

import torch

from autoshard import runtime
from autoshard.capture import capture, causal_lm_loss
from autoshard.cost_models.analyze import analyze
from autoshard.passes.flash_attention import flash_attention

from conftest import EXAMPLES

sys.path.insert(0, str(EXAMPLES))


def _ops(gm):
    return [n.meta.get("op") for n in gm.graph.nodes if n.op == "call_function"]


def _check(name, expected_before):
    module = __import__(name)
    torch.manual_seed(0)
    model = module.build("tiny")
    cap = capture(model, (torch.zeros(2, 16, dtype=torch.long),))
    analyze(cap)
    gm = cap.graph_module
    assert _ops(gm).count(expected_before) == 2  # Before: one per layer
    assert flash_attention(gm) == 2
    fused = [n for n in gm.graph.nodes if n.target is runtime.fused_attention]
    assert len(fused) == 2 and all(n.args[3] is True for n in fused)  # Expected: causal fused calls
    assert expected_before not in _ops(gm)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(gm(tokens), causal_lm_loss(model(tokens), tokens), atol=1e-6)
    return gm


def test_written_out_attention_is_fused():
    gm = _check("gpt", "softmax")
    assert "masked_fill" not in _ops(gm) and "triu" not in [n.target for n in gm.graph.nodes]


def test_sdpa_calls_are_fused():
    _check("llama3", "scaled_dot_product_attention")
