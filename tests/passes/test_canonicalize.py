"""Canonicalize: torch.export's guards, metadata asserts and meta-device constants go; the device of
the first input takes the constants' place; a graph that is already canonical is left alone."""

import operator

import pytest
import torch
from torch import fx, nn

from autoshard.capture import capture
from autoshard.capture.trace import trace
from autoshard.passes.canonicalize import canonicalize

from graphs import TINY_DECODER, TinyLM, listing, loss, tokens

META = torch.device("meta")


class _Guards(nn.Module):
    def forward(self, x):
        pass


def _before() -> fx.GraphModule:
    """What torch.export gives for ``x + arange(x.size(1))`` traced on meta."""
    g = fx.Graph()
    x = g.placeholder("x")
    g.call_module("_guards_fn", (x,))
    size = g.call_function(torch.ops.aten.sym_size.int, (x, 1))
    g.call_function(torch.ops.aten._assert_tensor_metadata.default, (x,), {"dtype": torch.float32, "device": META})
    positions = g.call_function(torch.ops.aten.arange.default, (size,), {"device": META, "pin_memory": False})
    moved = g.call_function(torch.ops.aten.to.dtype_layout, (positions,), {"dtype": torch.float32, "device": META})
    g.output(g.call_function(operator.add, (x, moved)))
    root = nn.Module()
    root._guards_fn = _Guards()
    return fx.GraphModule(root, g)


def _expected() -> fx.Graph:
    g = fx.Graph()
    x = g.placeholder("x")
    device = g.call_function(getattr, (x, "device"))
    size = g.call_function(torch.ops.aten.sym_size.int, (x, 1))
    positions = g.call_function(torch.ops.aten.arange.default, (size,), {"device": device, "pin_memory": False})
    moved = g.call_function(torch.ops.aten.to.dtype_layout, (positions,), {"dtype": torch.float32, "device": device})
    g.output(g.call_function(operator.add, (x, moved)))
    return g


def test_export_artefacts_go_and_the_inputs_device_replaces_meta():
    gm = _before()
    out = canonicalize(gm)
    assert out is gm
    assert listing(gm.graph) == listing(_expected())
    assert not hasattr(gm, "_guards_fn")


def test_the_canonical_graph_runs_where_its_inputs_are():
    x = torch.randn(2, 5)
    with pytest.raises(RuntimeError):  # the traced graph makes its positions on meta
        _before()(x)
    gm = canonicalize(_before())
    assert torch.equal(gm(x), x + torch.arange(5.0))


def test_a_canonical_graph_is_left_unchanged():
    gm, tracer, _ = trace(TinyLM(2), (tokens(),), loss)
    assert tracer == "symbolic_trace"
    before = listing(gm.graph)
    assert listing(canonicalize(gm).graph) == before


def test_capture_hands_on_the_canonical_graph():
    """A device fixed in the model (as export records one) is read off the input after capture, and
    the captured graph computes the model's loss on CPU."""
    torch.manual_seed(0)
    model = TinyLM(2, device=META)
    cap = capture(model, (tokens(),), loss=loss)
    nodes = list(cap.graph_module.graph.nodes)
    (device,) = [n for n in nodes if n.target is getattr]
    assert device.args == (nodes[0], "device")
    zeros = [n for n in nodes if n.target is torch.zeros]
    assert len(zeros) == 2 and all(n.kwargs["device"] is device for n in zeros)
    for block in model.layers:
        block.device = None  # the same model without the fixed device
    assert torch.allclose(cap.graph_module(tokens()), loss(model(tokens()), tokens()))


def test_export_path_graphs_carry_no_artefacts():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**TINY_DECODER)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    cap = capture(model, seq=32)
    assert cap.tracer == "export"
    nodes = list(cap.graph_module.graph.nodes)
    names = [getattr(n.target, "__name__", str(n.target)) for n in nodes]
    assert not [n for n in names if n.startswith(("_assert_tensor_metadata", "_guards_fn"))]
    assert not hasattr(cap.graph_module, "_guards_fn")
    meta = [n for n in nodes if META in (*n.args, *n.kwargs.values())]
    assert not meta
    (device,) = [n for n in nodes if n.target is getattr and n.args[1:] == ("device",)]
    (first_input, *_) = [n for n in nodes if n.op == "placeholder"]
    assert device.args[0] is first_input and device.meta["region"] == "pre"
    assert len(device.users) > 2  # the aranges of the positions and the casts of every layer
