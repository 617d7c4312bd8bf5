"""Activation checkpointing: each layer becomes one ``Checkpoint`` call that recomputes the plan's
kinds, holding exactly that layer's nodes, and the wrapped graph computes the same loss and
gradients."""

import operator
import sys

import torch
from torch import fx

from autoshard.capture import capture
from autoshard.cost_models.analyze import analyze
from autoshard.passes import PASSES, RewriteContext, run_passes
from autoshard.passes.activation_checkpoint import activation_checkpoint, layers_wrapped
from autoshard.passes.contract import decisions
from autoshard.runtime.checkpoint import Checkpoint

from conftest import EXAMPLES
from graphs import TinyLM, expected_loss, listing, loss, notes, tokens

sys.path.insert(0, str(EXAMPLES))


def _tiny():
    torch.manual_seed(0)
    return capture(TinyLM(2), (tokens(),), loss=loss).graph_module


def _expected_top() -> fx.Graph:
    g = fx.Graph()
    t = g.placeholder("tokens")
    h = g.call_module("model.embed", (t,))
    h = g.call_module("checkpoint_0", (h,))
    h = g.call_module("checkpoint_1", (h,))
    g.output(expected_loss(g, g.call_module("model.head", (h,)), t))
    return g


def _expected_layer(i: int, reads: str) -> fx.Graph:
    g = fx.Graph()
    x = g.placeholder(reads)
    g.output(
        g.call_function(operator.add, (x, g.call_function(torch.relu, (g.call_module(f"model.layers.{i}.lin", (x,)),))))
    )
    return g


def test_each_layer_becomes_one_checkpoint_of_exactly_its_nodes():
    gm = _tiny()
    ctx = RewriteContext(recompute=("activation", "attention"))
    assert activation_checkpoint(gm, ctx) is gm
    assert listing(gm.graph) == listing(_expected_top())
    for i, reads in ((0, "model_embed"), (1, "checkpoint_0")):  # the embedding, layer 0
        wrapped = gm.get_submodule(f"checkpoint_{i}")
        assert isinstance(wrapped, Checkpoint) and wrapped.recompute == ["activation", "attention"]
        assert listing(wrapped.fn.graph) == listing(_expected_layer(i, reads))
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("checkpoint_")]
    assert [(n.meta["region"], n.meta["layer"], n.meta["op"]) for n in calls] == [
        ("layer", 0, "checkpoint"),
        ("layer", 1, "checkpoint"),
    ]
    assert notes(gm) == {
        n.name: f"layer {i} under activation checkpointing: recompute activation, attention"
        for i, n in enumerate(calls)
    }


def test_a_checkpoint_call_has_the_shape_of_what_its_layer_hands_on():
    gm = _tiny()
    shapes = {n.meta["layer"]: n.meta.get("shape") for n in gm.graph.nodes if n.op == "call_function"
              and n.target is operator.add and n.meta.get("region") == "layer"}  # fmt: skip
    activation_checkpoint(gm, RewriteContext(recompute=("activation",)))
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("checkpoint_")]
    # a later pipeline chunk reads the batch and sequence sizes off its input, this call's result
    assert [n.meta["shape"] for n in calls] == [shapes[0], shapes[1]] and shapes[0] is not None


def test_nothing_to_recompute_leaves_the_graph_alone():
    gm = _tiny()
    before = listing(gm.graph)
    assert activation_checkpoint(gm, RewriteContext()) is gm
    assert listing(gm.graph) == before


def test_the_ensured_fact_holds_after_the_pass_and_not_before():
    gm = _tiny()
    ctx = RewriteContext(recompute=("activation",))
    assert "outside its checkpoint" in layers_wrapped(gm, ctx)
    (ac,) = [p for p in PASSES if p.name == "activation_checkpoint"]
    assert layers_wrapped in ac.ensures
    run_passes([ac], gm, ctx)  # checks requires, writes and ensures
    assert layers_wrapped(gm, ctx) is None
    assert "recomputes ['activation']" in layers_wrapped(gm, RewriteContext(recompute=("attention",)))


def test_a_parameter_only_its_layer_reads_moves_into_the_layer_graph():
    """Else the first pipeline chunk would keep reads of every layer's parameters (torch.export
    reads all of them with ``get_attr``) and hold parameters of layers it does not run."""
    torch.manual_seed(0)
    gm = capture(TinyLM(2, scale=True), (tokens(),), loss=loss).graph_module
    params = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    assert params == ["model.layers.0.scale", "model.layers.1.scale"]
    ctx = RewriteContext(recompute=("activation",), stage_layers=(1, 1))
    run_passes([p for p in PASSES if p.name in ("activation_checkpoint", "pipeline_split")], gm, ctx)
    assert not [n for n in gm.graph.nodes if n.op == "get_attr"]
    for i, chunk in enumerate(decisions(gm).split.chunks):
        layer = chunk.get_submodule(f"checkpoint_{i}").fn
        assert [n.target for n in layer.graph.nodes if n.op == "get_attr"] == [f"model.layers.{i}.scale"]
        assert not [n for n in chunk.graph.nodes if n.op == "get_attr"]


def _gpt():
    import gpt

    torch.manual_seed(0)
    cap = capture(gpt.build("tiny"), (torch.zeros(2, 16, dtype=torch.long),))
    analyze(cap)
    return cap.graph_module


def test_gradients_are_unchanged():
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = _gpt()
    expected_loss_value = plain(batch)
    expected_loss_value.backward()
    expected = {k: p.grad.clone() for k, p in plain.named_parameters() if p.grad is not None}

    wrapped = activation_checkpoint(_gpt(), RewriteContext(recompute=("activation", "attention")))
    again = wrapped(batch)
    again.backward()
    assert torch.allclose(again, expected_loss_value)
    got = dict(wrapped.named_parameters())
    assert expected and set(expected) <= set(got)
    for name, grad in expected.items():
        assert torch.allclose(got[name].grad, grad, atol=1e-6), name
