"""Before/Expected specifications of a pass, as TVM Relax tests its transforms.

A spec states what a pass must produce as a program: an ``nn.Module`` whose ``forward`` is the
rewritten program, traced with torch.fx by :func:`program` (the runtime's collectives and kernels
stay calls, as the passes insert them). :func:`assert_same_program` compares the pass's output
with it node by node, in order: the kind of node, its target (a function by identity, a module by
its path, type and shape, a parameter by its path and shape), its arguments (nodes by position,
constants by type and value) and the ``node.meta`` decisions the spec names. On a mismatch it
shows the first node that differs and both programs' code.

The Before models share one skeleton, :class:`LM`, captured and analysed by :func:`before` with
the short loss of ``tests/graphs.py``; an Expected program holds the same skeleton with the
local shapes under ``self.model``, so that its modules and parameters have the Before's names.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from autoshard.capture import capture
from autoshard.cost_models.analyze import analyze
from autoshard.runtime import collectives, fp8, moe

from graphs import loss

# what the passes insert as calls: recorded as calls when an Expected program calls them
RUNTIME = (
    collectives.copy_to_tp,
    collectives.reduce_from_tp,
    collectives.vocab_parallel_embedding,
    collectives.vocab_parallel_cross_entropy,
    moe.dispatch,
    moe.combine,
    moe.dispatch_buffer,
    moe.combine_buffer,
    moe.tp_share,
    moe.tp_unshare,
    moe.tp_share_buffer,
    moe.tp_unshare_buffer,
    moe.grouped_mm,
    fp8.fp8_linear,
    fp8.fp8_matmul,
    fp8.fp8_addmm,
    fp8.fp8_grouped_mm,
)


class LM(nn.Module):
    """A token embedding, residual ``blocks`` (the layer stack), a vocabulary head."""

    def __init__(self, *blocks: nn.Module, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(blocks)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.layers:
            x = x + block(x)
        return self.head(x)


def before(model: nn.Module) -> fx.GraphModule:
    """``model`` captured on 2 x 8 tokens with ``graphs.loss`` and analysed, as a pass finds it."""
    cap = capture(model, (torch.zeros(2, 8, dtype=torch.long),), loss=loss)
    analyze(cap)
    return cap.graph_module


def program(module: nn.Module) -> fx.GraphModule:
    """``module``'s forward as an fx program, the calls of ``RUNTIME`` kept as calls (where the
    forward calls them by name, imported into its module, as the specs do)."""
    return fx.GraphModule(module, fx.Tracer(autowrap_functions=RUNTIME).trace(module))


def call(like: fx.Proxy, fn, *args) -> fx.Proxy:
    """A call of ``fn`` on no traced value (``rt.tp_rank()``), which tracing would run rather than
    record, recorded in the program ``like`` is traced into."""
    return like.tracer.create_proxy("call_function", fn, args, {})


def assert_same_program(actual: fx.GraphModule, expected: fx.GraphModule, meta: dict | None = None) -> None:
    """``actual`` is ``expected``, node for node; ``meta`` maps an Expected node's name to the
    ``node.meta`` values the actual node in its place must carry."""
    named = {n.name: n for n in expected.graph.nodes}
    unknown = sorted(set(meta or {}) - set(named))
    assert not unknown, f"meta names nodes the Expected program does not have: {unknown}"
    wanted = {named[name]: values for name, values in (meta or {}).items()}
    got, want = list(actual.graph.nodes), list(expected.graph.nodes)
    at_got, at_want = {n: i for i, n in enumerate(got)}, {n: i for i, n in enumerate(want)}
    for i, (a_node, e_node) in enumerate(zip(got, want)):
        keys = wanted.get(e_node, {})
        a = {**_fields(a_node, actual, at_got), **{f"meta[{k!r}]": a_node.meta.get(k, "<missing>") for k in keys}}
        e = {**_fields(e_node, expected, at_want), **{f"meta[{k!r}]": v for k, v in keys.items()}}
        differ = [k for k in e if a[k] != e[k]]
        if differ:
            raise AssertionError(_report(actual, expected, i, differ, a, e))
    if len(got) != len(want):
        raise AssertionError(_report(actual, expected, min(len(got), len(want)), ["number of nodes"], {}, {}))


def _fields(node: fx.Node, gm: fx.GraphModule, index: dict) -> dict:
    """What two programs must agree on at ``node`` (``index``: each node's position in ``gm``)."""
    return {
        "op": node.op,
        "target": _target(node, gm),
        "args": _value(node.args, index),
        "kwargs": _value(node.kwargs, index),
    }


def _target(node: fx.Node, gm: fx.GraphModule):
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return node.target, type(module), module.extra_repr()
    if node.op == "get_attr":
        owner, _, leaf = node.target.rpartition(".")
        value = getattr(gm.get_submodule(owner), leaf)
        return node.target, tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
    return node.target


def _value(a, index: dict):
    """An argument as a comparable value: nodes by position, containers by kind and contents,
    constants by type and value (``1``, ``1.0`` and ``True`` differ)."""
    if isinstance(a, fx.Node):
        return "%", index[a]
    if isinstance(a, tuple):
        return "tuple", tuple(_value(x, index) for x in a)
    if isinstance(a, list):
        return "list", tuple(_value(x, index) for x in a)
    if isinstance(a, dict):
        return "dict", tuple((k, _value(v, index)) for k, v in sorted(a.items()))
    if isinstance(a, slice):
        return "slice", _value(a.start, index), _value(a.stop, index), _value(a.step, index)
    return type(a), a


def _report(actual: fx.GraphModule, expected: fx.GraphModule, i: int, differ: list, a: dict, e: dict) -> str:
    def line(gm: fx.GraphModule) -> str:
        nodes = list(gm.graph.nodes)
        return nodes[i].format_node() if i < len(nodes) else "(no node)"

    what = "; ".join(f"{k}: {a[k]!r} where the Expected has {e[k]!r}" for k in differ if k in e)
    return (
        f"the pass's program differs from the Expected at node {i} ({', '.join(differ)})\n"
        f"  actual:   {line(actual)}\n  expected: {line(expected)}\n  {what}\n"
        f"--- actual ---\n{actual.code}\n--- expected ---\n{expected.code}"
    )
