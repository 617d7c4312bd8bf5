"""Shapes: ``shape``, ``dtype``, ``storage`` and ``requires_grad`` on every node.

On the fx path, shapes are propagated with fake tensors whose batch and sequence sizes are
symbols, so every shape is a sympy expression in ``b`` and ``s`` (``autoshard.ir``). Repeated
layers are propagated once: a layer whose signature and input shapes match an earlier one reuses
that template's results, which is what makes a 126-layer model quick to capture. On the export
path, torch.export has already propagated them; they are read off its fake values. Either way
the result includes each layer's key (signature and input shapes), from which the layer kinds
follow (``structure.group_kinds``).

A size only the data decides (how many tokens an expert takes from ``torch.where``, ``nonzero``
or a boolean mask) is an unbacked symbol to the tracer. :func:`_estimate` replaces it by an
expression in ``b`` and ``s`` with a stated assumption (balanced routing: a mask comparing top-k
routing choices with one expert holds ``slots / experts`` of them), which capture records as a
note the plan repeats; a size it cannot estimate is a one-line error naming the op and its line.
"""

from __future__ import annotations

import sympy
import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic,
    GuardOnDataDependentSymNode,
    ShapeEnv,
    StatelessSymbolicContext,
    free_unbacked_symbols,
)

from autoshard.capture import trace
from autoshard.capture.structure import layer_signature
from autoshard.errors import AutoshardError
from autoshard.ir import B, S, ops

_VALUE_KEYS = ("shape", "dtype", "storage", "shapes")


class _Shapes:
    """Turns fake-tensor values into ``node.meta`` entries with shapes in B and S."""

    def __init__(self, symbols: dict):
        self.symbols = symbols
        self.storage_ids: dict[int, int] = {}
        self.cache: dict = {}
        self.notes: dict[str, str] = {}  # the assumption behind each estimated size, by where it is

    def estimate_new_sizes(self, node: fx.Node, value) -> None:
        """Give each data-dependent size that first appears in ``value`` its estimate."""
        for sym in _unbacked(value):
            if sym not in self.symbols:
                self.symbols[sym], note = _estimate(node)
                self.notes.setdefault(_where(node), note)

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
        self.extra_traceback = False  # its errors are one line (AutoshardError), not fx's node dump
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
        try:
            value = super().run_node(n)
        except (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException) as e:
            raise AutoshardError(
                f"{_where(n)} ({ops.op_name(n, self.module)}) branches on or sizes by the values of a tensor "
                f"({type(e).__name__}); write it with sizes that follow the inputs' shapes"
            ) from e
        if n.meta.get("autoshard_logits"):  # the model's output, which the default loss reads as logits
            trace.check_logits(value)
        self.shapes.estimate_new_sizes(n, value)
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
) -> tuple[dict[int, tuple], list[str]]:
    """Fake-tensor shape propagation, batch and sequence symbolic, each layer kind once; returns
    each layer's key and the assumptions behind the sizes it estimated."""
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
    check_sizes(gm)
    return propagator.keys, list(shapes.notes.values())


def read_export_shapes(gm: fx.GraphModule, layers: dict[int, list[fx.Node]]) -> tuple[dict[int, tuple], list[str]]:
    """The shapes torch.export recorded (``node.meta["val"]``), in B and S; returns each layer's
    key and the assumptions behind the sizes it estimated."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    val = placeholders[0].meta["val"]
    symbols = {}
    for d, sym in zip(val.shape[:2], (B, S)):
        if not isinstance(d, int):
            symbols[d.node.expr] = sym
    shapes = _Shapes(symbols)
    seen: set[int] = set()  # the values already read: a copied layer's nodes share its template's
    for n in gm.graph.nodes:
        value = n.meta.get("val")
        if id(value) not in seen:  # a value seen before holds no size not estimated then
            seen.add(id(value))
            shapes.estimate_new_sizes(n, value)
        shapes.record(n, value)
    check_sizes(gm)
    keys = {}
    for i, nodes in layers.items():
        sig, external = layer_signature(gm, nodes, tensors_only=True)
        keys[i] = (sig, shapes.key([e.meta.get("val") for e in external]))
    return keys, list(shapes.notes.values())


def check_sizes(gm: fx.GraphModule) -> None:
    """Every shape is in ``b``, ``s`` and numbers (what the cost model can evaluate)."""
    for n in gm.graph.nodes:
        for shape in [n.meta.get("shape")] + list(n.meta.get("shapes") or []):
            for d in shape or ():
                if isinstance(d, sympy.Basic) and not d.free_symbols <= {B, S}:
                    raise AutoshardError(
                        f"{_where(n)} ({n.meta.get('op') or ops.op_name(n, gm)}) has a size autoshard cannot "
                        f"follow ({d}); write it with sizes that follow the inputs' shapes"
                    )


# ---------------------------------------------------------------------------------------------
# Data-dependent sizes

_COUNTS_TRUE = {"nonzero": 0, "argwhere": 0, "where": 0, "masked_select": 1}  # op -> its mask argument


def _unbacked(value) -> set:
    """The data-dependent size symbols in a tensor's shape, a size, or a tuple of them."""
    if isinstance(value, (tuple, list)):
        return set().union(*(_unbacked(v) for v in value)) if value else set()
    if isinstance(value, (torch.Tensor, torch.SymInt)):
        return set(free_unbacked_symbols(value.shape if isinstance(value, torch.Tensor) else value))
    return set()


def _where(n: fx.Node) -> str:
    return n.meta.get("source") or n.name


def _estimate(n: fx.Node) -> tuple[sympy.Expr, str]:
    """The expected value of the data-dependent size ``n`` produces, and the assumption behind
    it: the number of true elements of a mask that compares top-k routing choices with one
    choice, when routing is balanced (every one of the ``E`` choices equally often)."""
    op = ops.op_name(n)
    mask = _mask_of(n, op)
    routed = ops.routing_mask(mask) if mask is not None else None
    if routed is None:
        raise AutoshardError(
            f"{_where(n)} ({op}) has a data-dependent size autoshard cannot estimate; give it a static "
            "size (a fixed capacity per expert, as examples/deepseek_v3.py does)"
        )
    slots, choices = routed
    expected = sympy.expand(ops.numel(mask.meta["shape"]) / choices)
    note = (
        f"{_where(n)} ({op}): a data-dependent size, estimated as {expected} assuming balanced routing "
        f"(each of {choices} experts takes an equal share of the {slots} routed token slots)"
    )
    return expected, note


def _mask_of(n: fx.Node, op: str) -> fx.Node | None:
    """The boolean tensor whose true elements ``n`` counts: the argument of ``nonzero``,
    one-argument ``where`` and ``masked_select``, or a boolean index."""
    tensors = [a for a in n.args if isinstance(a, fx.Node)]
    if op in _COUNTS_TRUE and (op != "where" or len(tensors) == 1):
        i = _COUNTS_TRUE[op]
        return n.args[i] if len(n.args) > i and isinstance(n.args[i], fx.Node) else None
    if op in ("getitem", "index", "index_put", "index_put_"):
        flat = list(_nodes_in(n.args[1:]))
        masks = [a for a in flat if a.meta.get("dtype") == torch.bool]
        return masks[0] if len(masks) == 1 else None
    return None


def _nodes_in(x):
    if isinstance(x, fx.Node):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _nodes_in(y)


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
