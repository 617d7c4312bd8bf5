"""Shapes: ``shape``, ``dtype``, ``storage`` and ``requires_grad`` on every node.

On the fx path, shapes are propagated with fake tensors whose batch and sequence sizes are
symbols, so every shape is a sympy expression in ``b`` and ``s`` (``autoshard.ir``). Repeated
layers are propagated once: a layer whose signature and input shapes match an earlier one reuses
that template's results, which is what makes a 126-layer model quick to capture. On the export
path, torch.export has already propagated them; they are read off its fake values. Either way
the result includes each layer's key (signature and input shapes), from which the layer kinds
follow (``structure.group_kinds``).
"""

from __future__ import annotations

import sympy
import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from autoshard.capture.structure import layer_signature
from autoshard.cost_models import ops
from autoshard.errors import AutoshardError
from autoshard.ir import B, S

_VALUE_KEYS = ("shape", "dtype", "storage", "shapes")


class _Shapes:
    """Turns fake-tensor values into ``node.meta`` entries with shapes in B and S."""

    def __init__(self, symbols: dict):
        self.symbols = symbols
        self.storage_ids: dict[int, int] = {}
        self.cache: dict = {}

    def dim(self, d):
        if isinstance(d, int):
            return d
        expr = d.node.expr
        if expr not in self.cache:
            self.cache[expr] = sympy.sympify(expr).xreplace(self.symbols)
        return self.cache[expr]

    def record(self, node: fx.Node, value) -> None:
        if isinstance(value, torch.Tensor):
            node.meta["shape"] = tuple(self.dim(d) for d in value.shape)
            node.meta["dtype"] = value.dtype
            key = value.untyped_storage()._cdata
            node.meta["storage"] = self.storage_ids.setdefault(key, len(self.storage_ids))
        else:
            node.meta["shape"] = None
            node.meta["dtype"] = None
            node.meta["storage"] = None
            if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
                node.meta["shapes"] = [tuple(self.dim(d) for d in v.shape) for v in value]

    def key(self, values) -> tuple:
        """The shapes of a layer's inputs, as part of its key."""
        return tuple(
            tuple(str(self.dim(d)) for d in v.shape) if isinstance(v, torch.Tensor) else repr(v) for v in values
        )


class _Propagator(fx.Interpreter):
    """Runs the graph on fake tensors, recording every node's value; a layer whose key matches an
    earlier layer's takes that template's values instead of running again."""

    def __init__(self, gm: fx.GraphModule, layers: dict[int, list[fx.Node]], shapes: _Shapes, env: ShapeEnv, watched):
        super().__init__(gm, garbage_collect_values=False)
        self.layers = layers
        self.shapes = shapes
        self.shape_env = env
        self.watched = watched
        self.signatures = {i: layer_signature(gm, nodes) for i, nodes in layers.items()}
        self.first_node = {nodes[0]: i for i, nodes in layers.items()}
        self.keys: dict[int, tuple] = {}
        self.templates: dict[tuple, int] = {}
        self.reuse: dict[fx.Node, fx.Node] = {}
        self.specialised: fx.Node | None = None  # the first node that fixed b or s to a number

    def run_node(self, n):
        if n in self.first_node:
            self._enter_layer(self.first_node[n])
        if n in self.reuse:
            src = self.reuse[n]
            for k in _VALUE_KEYS:
                if k in src.meta:
                    n.meta[k] = src.meta[k]
            return self.env[src]
        value = super().run_node(n)
        self.shapes.record(n, value)
        if self.specialised is None and any(sym in self.shape_env.replacements for sym in self.watched):
            self.specialised = n
        return value

    def _enter_layer(self, layer: int) -> None:
        sig, external = self.signatures[layer]
        if not all(e in self.env for e in external):
            self.keys[layer] = (sig, layer)
            return
        key = (sig, self.shapes.key([self.env[e] for e in external]))
        self.keys[layer] = key
        if key in self.templates:
            self.reuse.update(zip(self.layers[layer], self.layers[self.templates[key]]))
        else:
            self.templates[key] = layer


def propagate(
    gm: fx.GraphModule, inputs: tuple, layers: dict[int, list[fx.Node]], model: nn.Module
) -> dict[int, tuple]:
    """Fake-tensor shape propagation, batch and sequence symbolic, each layer kind once; returns
    each layer's key."""
    env = ShapeEnv(duck_shape=False)
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    device = next((p.device for p in model.parameters()), torch.device("meta"))
    first = torch.empty(inputs[0].shape, dtype=inputs[0].dtype, device=device)
    dynamic = [DimDynamic.DYNAMIC, DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (first.dim() - 2)
    fake0 = mode.from_tensor(first, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dynamic))
    b_sym, s_sym = fake0.shape[0], fake0.shape[1]
    with mode:
        fakes = [fake0] + [torch.zeros((b_sym, s_sym, *t.shape[2:]), dtype=t.dtype, device=device) for t in inputs[1:]]
    shapes = _Shapes({b_sym.node.expr: B, s_sym.node.expr: S})
    propagator = _Propagator(gm, layers, shapes, env, (b_sym.node.expr, s_sym.node.expr))
    with mode, torch.enable_grad():
        propagator.run(*fakes)
    n = propagator.specialised
    if n is not None:
        which = "sequence" if s_sym.node.expr in env.replacements else "batch"
        raise AutoshardError(
            f"the model fixes the {which} size at {n.meta.get('source') or n.name} ({n.meta.get('op')}); "
            "write that code so its shapes follow the inputs' sizes"
        )
    return propagator.keys


def read_export_shapes(gm: fx.GraphModule, layers: dict[int, list[fx.Node]]) -> dict[int, tuple]:
    """The shapes torch.export recorded (``node.meta["val"]``), in B and S; returns each layer's key."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    val = placeholders[0].meta["val"]
    symbols = {}
    for d, sym in zip(val.shape[:2], (B, S)):
        if not isinstance(d, int):
            symbols[d.node.expr] = sym
    shapes = _Shapes(symbols)
    for n in gm.graph.nodes:
        shapes.record(n, n.meta.get("val"))
    keys = {}
    for i, nodes in layers.items():
        sig, external = layer_signature(gm, nodes, tensors_only=True)
        keys[i] = (sig, shapes.key([e.meta.get("val") for e in external]))
    return keys


def requires_grad(gm: fx.GraphModule) -> None:
    """Floating outputs computed from a parameter need gradients; integer ones never do."""
    params = {name for name, _ in gm.named_parameters()}
    for n in gm.graph.nodes:
        dtype = n.meta.get("dtype")
        floating = dtype.is_floating_point if dtype is not None else "shapes" in n.meta
        if n.op == "get_attr":
            n.meta["requires_grad"] = n.target in params
        elif n.op == "call_module":
            owns = any(True for _ in gm.get_submodule(n.target).parameters())
            n.meta["requires_grad"] = floating and (
                owns or any(a.meta.get("requires_grad") for a in ops.tensor_args(n))
            )
        elif n.op == "placeholder":
            n.meta["requires_grad"] = False
        else:
            n.meta["requires_grad"] = floating and any(a.meta.get("requires_grad") for a in n.all_input_nodes)
