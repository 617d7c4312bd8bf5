"""Context-parallel pass: the model reads its tokens in the CP layout, positions become global,
causal attention becomes cp_attention, and the loss becomes this rank's share of the mean."""

import sys

import torch

from autoshard import runtime
from autoshard.capture import capture
from autoshard.cost_models.analyze import analyze
from autoshard.passes.context_parallel import context_parallel
from autoshard.passes.flash_attention import flash_attention

from conftest import EXAMPLES

sys.path.insert(0, str(EXAMPLES))


def _count(gm, fn):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is fn)


def test_llama_cp2_graph():
    import llama3

    cap = capture(llama3.build("tiny"), (torch.zeros(2, 16, dtype=torch.long),))
    analyze(cap)
    gm = cap.graph_module
    flash_attention(gm)
    context_parallel(gm, 2, "ring")
    assert _count(gm, runtime.cp_shard) == 2  # the model's tokens, and the loss's labels
    assert _count(gm, runtime.cp_positions) == 4  # rotary angles of q and k in each of 2 layers
    assert _count(gm, runtime.cp_attention) == 2 and _count(gm, runtime.fused_attention) == 0
    assert _count(gm, runtime.cp_cross_entropy) == 1
    # without a CP group every runtime call is the identity: the loss is the single-device loss
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = capture(cap.model, (torch.zeros(2, 16, dtype=torch.long),)).graph_module
    assert torch.allclose(gm(tokens), plain(tokens), atol=1e-6)
