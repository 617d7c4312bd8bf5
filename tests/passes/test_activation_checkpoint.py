"""Activation checkpointing: each layer becomes one ``Checkpoint`` call that recomputes the plan's
kinds, and the wrapped graph computes the same loss and gradients."""

import sys

import torch

from autoshard.capture import capture
from autoshard.cost_models.analyze import analyze
from autoshard.passes.activation_checkpoint import activation_checkpoint
from autoshard.runtime.checkpoint import Checkpoint

from conftest import EXAMPLES

sys.path.insert(0, str(EXAMPLES))


def _graph():
    import gpt

    torch.manual_seed(0)
    cap = capture(gpt.build("tiny"), (torch.zeros(2, 16, dtype=torch.long),))
    analyze(cap)
    return cap.graph_module


def test_layers_are_wrapped_and_gradients_unchanged():
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = _graph()
    loss = plain(tokens)
    loss.backward()
    expected = {k: p.grad.clone() for k, p in plain.named_parameters()}

    wrapped = _graph()
    assert activation_checkpoint(wrapped, ["attention", "activation"]) == 2
    calls = [n for n in wrapped.graph.nodes if n.op == "call_module" and n.target.startswith("checkpoint_")]
    assert [n.target for n in calls] == ["checkpoint_0", "checkpoint_1"]
    assert all(isinstance(wrapped.get_submodule(n.target), Checkpoint) for n in calls)
    assert not any(
        n.meta.get("layer") == 0 and n.op == "call_module" and "layers" in n.target for n in wrapped.graph.nodes
    )
    again = wrapped(tokens)
    again.backward()
    assert torch.allclose(again, loss)
    params = dict(plain.named_parameters())
    for name, p in params.items():
        if p.grad is None:
            continue
        got = dict(wrapped.named_parameters()).get(name)
        assert got is not None and torch.allclose(got.grad, expected[name], atol=1e-6), name


def test_nothing_to_recompute_leaves_the_graph_alone():
    gm = _graph()
    before = len(gm.graph.nodes)
    assert activation_checkpoint(gm, []) == 0
    assert len(gm.graph.nodes) == before
