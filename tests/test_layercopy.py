"""The symbolic trace with repeated layers copied (``capture.layercopy``) is the full trace."""

import itertools

import pytest
import torch
from torch import fx, nn

from autoshard import modelfile
from autoshard.capture import layercopy
from autoshard.capture.trace import trace

EXAMPLES = "examples"


def _traced(model: nn.Module, inputs: tuple, loss=None, copies: bool = True) -> tuple[fx.GraphModule, list]:
    """The traced training forward, with layer copies or without, and the copiers made."""
    made = []
    original = layercopy.Copier.of

    def of(root):
        copier = original(root) if copies else None
        made.append(copier)
        return copier

    layercopy.Copier.of = of
    try:
        gm, tracer, _ = trace(model, inputs, loss)
    finally:
        layercopy.Copier.of = original
    assert tracer == "symbolic_trace"
    return gm, made


def _fields(n: fx.Node) -> tuple:
    named = fx.node.map_arg((n.args, n.kwargs), lambda a: ("node", a.name))
    return n.name, n.op, n.target, named, n.type, n.meta, [u.name for u in n.users]


def _same_graph(a: fx.GraphModule, b: fx.GraphModule) -> None:
    assert [_fields(n) for n in a.graph.nodes] == [_fields(n) for n in b.graph.nodes]
    assert a.code == b.code


@pytest.mark.parametrize(("file", "config"), [("llama3.py", "deep"), ("deepseek_v3.py", "671b")])
def test_copied_layers_trace_as_a_full_trace(file, config):
    mf = modelfile.load(f"{EXAMPLES}/{file}")
    model = mf.build(config)
    inputs = mf.sample_inputs(config, 2, 16)
    copied, copiers = _traced(model, inputs, mf.loss)
    full, _ = _traced(model, inputs, mf.loss, copies=False)
    _same_graph(copied, full)
    templates = list(copiers[0].templates.values())
    assert templates and all(t.checked for t in templates)  # the layers were copied, not traced


class _Counted(nn.Module):
    """A layer whose traced code changes from call to call through state fx does not see."""

    calls = itertools.count()

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x) * next(self.calls)


class _Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))  # read by get_attr, named by fx

    def forward(self, x):
        return x + torch.relu(self.proj(x)) * self.scale


class _Stack(nn.Module):
    def __init__(self, layers: int, layer=_Counted, rounds: int = 1):
        super().__init__()
        self.rounds = rounds  # times the stack runs
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(layer() for _ in range(layers))
        self.head = nn.Linear(8, 16)

    def forward(self, tokens):
        x = self.embed(tokens)
        for _ in range(self.rounds):
            for layer in self.layers:
                x = layer(x)
        return self.head(x)


def test_a_kind_whose_second_layer_differs_is_traced_layer_by_layer():
    model = _Stack(5)
    inputs = (torch.zeros(2, 4, dtype=torch.long),)
    _Counted.calls = itertools.count()
    copied, copiers = _traced(model, inputs)
    _Counted.calls = itertools.count()
    full, _ = _traced(model, inputs, copies=False)
    _same_graph(copied, full)
    (template,) = copiers[0].templates.values()
    assert template.broken and not template.checked


def test_layers_sharing_a_tensor_are_traced_whole():
    model = _Stack(5, _Plain)
    model.layers[3].scale = model.layers[0].scale  # fx names it model.layers.0.scale in both
    inputs = (torch.zeros(2, 4, dtype=torch.long),)
    copied, copiers = _traced(model, inputs)
    full, _ = _traced(model, inputs, copies=False)
    _same_graph(copied, full)
    assert copiers == [None]


def test_a_stack_run_twice_traces_as_a_full_trace():
    model = _Stack(5, _Plain, rounds=2)  # the second round's module calls are numbered (``@1``)
    inputs = (torch.zeros(2, 4, dtype=torch.long),)
    copied, copiers = _traced(model, inputs)
    full, _ = _traced(model, inputs, copies=False)
    _same_graph(copied, full)
    assert all(t.checked for t in copiers[0].templates.values())
