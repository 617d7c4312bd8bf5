"""Repeated layers on the export path: trace one representative per layer kind, copy the rest.

torch.export traces every op of every layer through fake tensors, about a second a layer, so a
126-layer model takes minutes where symbolic tracing takes seconds (``shapes`` propagates each
repeated layer once on that path). Here the layer stack is cut instead:

1. :func:`plan` groups the stack's layers into kinds from their modules
   (``structure.module_kinds``) and picks which to trace: the first layer, the first layer of
   every other kind, and the second layer of the first layer's kind (the first one reads the
   embedding, not a previous layer, so it cannot stand for the others);
2. :meth:`Cut.passthrough` makes every other layer return its input while the cut model is
   exported, so the traced layers run on the values they would see in the full model;
3. :meth:`Cut.expand` writes the full graph: every layer not traced is a copy of its kind's
   traced template, reading its own parameters, the previous layer's outputs where the template
   read its predecessor's, and the shared values (masks, rotary tables, sizes) the template read.

The result is the graph a full export gives, layer for layer (``tests/test_capture.py`` compares
the two). Whatever the cut cannot stand for raises :class:`NotRepeated` and the model is exported
whole: a layer output that is not one tensor like its input, a layer reading other than its
predecessor's outputs or the values all layers share, the first two layers of a kind tracing to
different code, a parameter shared between layers.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import operator
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils import _pytree as pytree

from autoshard.capture import structure


class NotRepeated(Exception):
    """The cut capture cannot stand for the full one; capture every layer."""


@dataclass
class Cut:
    """Which layers of the stack are traced, and which traced layer every other one copies."""

    container: nn.Module  # the layer stack (a ModuleList or Sequential)
    layers: list[nn.Module]  # its children, in order
    path: str  # the stack's module path in the traced wrapper ("model.model.layers")
    names: list[str]  # its children's names
    kinds: list[int]  # each layer's kind
    traced: list[int]  # the layers exported, in order
    template: dict[int, int]  # kind -> the traced layer the kind's other layers copy

    @property
    def saves(self) -> bool:
        return len(self.traced) < len(self.layers)

    @contextlib.contextmanager
    def passthrough(self):
        """While open, every layer not traced is replaced in the stack by a :class:`_Skip` (its
        parameters leave the exported state, which costs time per tensor too); the stack keeps
        its length, so a model indexing per-layer settings by loop position reads the right one."""
        container = self.container
        outputs: dict[int, object] = {}
        traced = set(self.traced)
        hooks = []
        try:
            for i, layer in enumerate(self.layers):
                if i in traced:
                    record = functools.partial(_record, outputs, self.kinds[i])
                    hooks.append(layer.register_forward_hook(record))
                else:
                    container._modules[self.names[i]] = _Skip(outputs, self.kinds[i])
            yield
        finally:
            for hook in hooks:
                hook.remove()
            for name, layer in zip(self.names, self.layers):
                container._modules[name] = layer

    def expand(self, gm: fx.GraphModule, wrapper: nn.Module) -> fx.GraphModule:
        """The full graph from the export ``gm`` of the cut ``wrapper`` (the traced training
        forward, whose parameters the layers not traced read)."""
        return _Expansion(self, gm, wrapper).graph_module()


def _record(outputs: dict, kind: int, module, args, out) -> None:
    outputs.setdefault(kind, out)


class _Skip(nn.Module):
    """Stands for a layer not traced: its first tensor argument, in the structure of its kind's
    traced output."""

    def __init__(self, outputs: dict, kind: int):
        super().__init__()
        self.outputs = outputs
        self.kind = kind

    def forward(self, *args, **kwargs):
        return _pass_input(self.outputs.get(self.kind), args, kwargs)


def plan(model: nn.Module) -> Cut | None:
    """The cut of ``model``'s layer stack (None without a stack or when its layers are shared)."""
    stack = structure.layer_stack(model)
    if stack is None:
        return None
    container = model.get_submodule(stack[0]) if stack[0] else model
    layers = [container.get_submodule(name) for name in stack[1]]
    kinds = structure.module_kinds(layers)
    if kinds is None:
        return None
    first: dict[int, list[int]] = {}
    for i, k in enumerate(kinds):
        if len(first.setdefault(k, [])) < 2:
            first[k].append(i)
    template = {k: (ls[1] if k == kinds[0] else ls[0]) for k, ls in first.items() if len(ls) > 1 or k != kinds[0]}
    traced = sorted({0, *template.values()})
    path = f"model.{stack[0]}" if stack[0] else "model"
    return Cut(container, layers, path, stack[1], kinds, traced, template)


def _pass_input(example, args: tuple, kwargs: dict):
    """A skipped layer's result: its first tensor argument, in the structure of ``example`` (its
    kind's traced output), which must hold exactly one tensor, shaped like that argument."""
    given = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    leaves, spec = pytree.tree_flatten(example)
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if not given or len(tensors) != 1:
        raise NotRepeated("a layer's output is not one tensor")
    out = leaves[tensors[0]]
    if [str(d) for d in out.shape] != [str(d) for d in given[0].shape] or out.dtype != given[0].dtype:
        raise NotRepeated("a layer's output is not shaped like its first input")
    leaves[tensors[0]] = given[0]
    return pytree.tree_unflatten(leaves, spec)


def _is_tensor(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), torch.Tensor)


def _like(a: list[fx.Node], b: list[fx.Node]) -> bool:
    """Two lists of layer outputs that can stand for each other: same count, shapes, dtypes."""

    def key(n):
        v = n.meta["val"]
        return tuple(str(d) for d in v.shape), v.dtype

    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b))


class _Expansion:
    """The cut graph read as segments (one per traced layer) and written out layer by layer."""

    def __init__(self, cut: Cut, gm: fx.GraphModule, wrapper: nn.Module):
        self.cut = cut
        self.gm = gm
        self.wrapper = wrapper
        self.index = {name: i for i, name in enumerate(cut.names)}
        self.nodes = list(gm.graph.nodes)
        self._segments()
        self._read_externals()
        self._check_interfaces()
        self._check_first_kind()

    # -- reading the cut graph ----------------------------------------------------------------

    def _layer_of_path(self, path: str) -> int | None:
        prefix = self.cut.path + "."
        if not path.startswith(prefix):
            return None
        return self.index.get(path[len(prefix) :].split(".", 1)[0])

    def _layer_of(self, n: fx.Node) -> int | None:
        if n.op == "get_attr":
            return self._layer_of_path(n.target)
        stack = n.meta.get("nn_module_stack") or {}
        paths = [v[0] for v in stack.values() if isinstance(v, tuple)]
        return self._layer_of_path(paths[-1]) if paths else None

    def _segments(self) -> None:
        """``segment[layer]``: the traced layer's nodes and the code after it up to the next
        traced layer (the model's loop body); ``pre`` and ``post``: the nodes around them."""
        traced = self.cut.traced
        first: dict[int, int] = {}
        owner: dict[int, int] = {}
        for pos, n in enumerate(self.nodes):
            layer = self._layer_of(n) if n.op != "get_attr" else None
            if layer is None:
                continue
            if layer not in traced:
                raise NotRepeated(f"a node of the skipped layer {layer}")
            first.setdefault(layer, pos)
            owner[pos] = layer
        if sorted(first) != traced:
            raise NotRepeated("a traced layer left no node")
        starts = [first[c] for c in traced]
        if starts != sorted(starts):
            raise NotRepeated("the traced layers are out of order")
        end = max(owner) + 1
        bounds = [*starts[1:], end]
        self.segment = {c: self.nodes[s:e] for c, s, e in zip(traced, starts, bounds)}
        for c, s, e in zip(traced, starts, bounds):
            if any(owner.get(p, c) != c for p in range(s, e)):
                raise NotRepeated("the traced layers' nodes interleave")
        self.where = {n: c for c, seg in self.segment.items() for n in seg}
        head, tail = self.nodes[: starts[0]], self.nodes[end:]
        if any(n.op == "get_attr" for n in self.nodes[starts[0] :]):
            raise NotRepeated("a parameter read after the first layer")
        self.pre, self.post = head, tail
        self.outputs = {
            c: [n for n in seg if _is_tensor(n) and any(self.where.get(u) != c for u in n.users)]
            for c, seg in self.segment.items()
        }

    def _read_externals(self) -> None:
        """What each segment (and the post region) reads from outside itself: ``("carried", i)``
        for output ``i`` of the previous traced layer, ``("shared", layer)`` for a size computed
        once in an earlier layer (the same value in every layer), nothing for pre-region nodes
        and parameters."""
        traced = self.cut.traced
        self.reads: dict[fx.Node, tuple] = {}
        previous = {c: (traced[i - 1] if i else None) for i, c in enumerate(traced)}
        previous[None] = traced[-1]  # the post region follows the last traced layer
        regions = [(c, self.segment[c]) for c in traced] + [(None, self.post)]
        for c, seg in regions:
            for n in seg:
                for a in n.all_input_nodes:
                    src = self.where.get(a)
                    if src is None or src == c:
                        continue
                    if _is_tensor(a):
                        if src != previous[c] or a not in self.outputs[src]:
                            raise NotRepeated(f"{n.name} reads {a.name} of a layer before its predecessor")
                        self.reads[a, c] = ("carried", self.outputs[src].index(a))
                    elif free_unbacked_symbols(a.meta.get("val")):
                        raise NotRepeated(f"{n.name} reads a data-dependent size of another layer")
                    else:
                        self.reads[a, c] = ("shared", src)

    def _source(self, layer: int) -> int:
        """The traced layer whose nodes full layer ``layer`` copies."""
        return layer if layer in self.segment else self.cut.template[self.cut.kinds[layer]]

    def _check_interfaces(self) -> None:
        """Every copied layer's predecessor gives the outputs its template's predecessor gave."""
        traced = self.cut.traced
        previous = {c: traced[i - 1] for i, c in enumerate(traced) if i}
        count = len(self.cut.layers)
        for layer in range(1, count + 1):
            template = self._source(layer) if layer < count else None
            expected = previous.get(template) if template is not None else traced[-1]
            if expected is None:
                continue
            if not _like(self.outputs[self._source(layer - 1)], self.outputs[expected]):
                raise NotRepeated(f"layer {layer} would read outputs unlike its template's")

    def _check_first_kind(self) -> None:
        """The first layer and the second of its kind trace to the same code and read the same
        shared values, but for what the second reads from its predecessor."""
        kind = self.cut.kinds[0]
        if kind not in self.cut.template:
            return
        a, b = self.segment[0], self.segment[self.cut.template[kind]]
        ta, tb = [n for n in a if _is_tensor(n)], [n for n in b if _is_tensor(n)]
        if len(ta) != len(tb):
            raise NotRepeated("the first two layers of a kind differ")
        local_a, local_b = {n: i for i, n in enumerate(ta)}, {n: i for i, n in enumerate(tb)}
        for x, y in zip(ta, tb):
            if (x.op, x.target) != (y.op, y.target):
                raise NotRepeated("the first two layers of a kind differ")
            for p, q in zip(x.all_input_nodes, y.all_input_nodes):
                if not (_is_tensor(p) and _is_tensor(q)):
                    continue
                if p in local_a or q in local_b:
                    if local_a.get(p) != local_b.get(q):
                        raise NotRepeated("the first two layers of a kind differ")
                elif p.op == "get_attr" or q.op == "get_attr":
                    if self._relative(p, 0) != self._relative(q, self.cut.template[kind]):
                        raise NotRepeated("the first two layers of a kind read different parameters")
                elif (q, self.cut.template[kind]) not in self.reads and p is not q:
                    raise NotRepeated("the first two layers of a kind read different shared values")

    def _relative(self, n: fx.Node, layer: int) -> str:
        prefix = f"{self.cut.path}.{self.cut.names[layer]}."
        return n.target[len(prefix) :] if n.op == "get_attr" and n.target.startswith(prefix) else n.target

    # -- writing the full graph ---------------------------------------------------------------

    def graph_module(self) -> fx.GraphModule:
        from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

        graph = fx.Graph()
        graph._codegen = copy.deepcopy(self.gm.graph._codegen)
        env: dict[fx.Node, fx.Node] = {}
        params: dict[str, fx.Node] = {}
        copies: dict[int, dict[fx.Node, fx.Node]] = {}
        outputs: dict[int, list[fx.Node]] = {}
        sizes: dict = {}  # the expression of each size node written, in b and s
        for cut_node, target in self._attributes():
            params[target] = (
                graph.node_copy(cut_node) if target == cut_node.target else _attribute(graph, cut_node, target)
            )
        written = False
        for n in self.nodes:
            if n.op == "get_attr":
                env[n] = params[n.target]
                continue
            if n in self.where:
                if not written:
                    for layer in range(len(self.cut.layers)):
                        self._write_layer(graph, layer, env, params, copies, outputs, sizes)
                    written = True
                continue
            region = None if n in self.post else "pre"
            env[n] = _node_copy(graph, n, lambda a, r=region: self._map(a, r, env, copies, outputs))
            if _size_expr(n) is not None:
                sizes.setdefault(_size_expr(n), env[n])
        with _use_lazy_graph_module(True):
            out = _make_graph_module(self._root(graph), graph, type(self.gm).__name__)
        out.meta.update(self.gm.meta)
        return out

    def _attributes(self) -> list[tuple[fx.Node, str]]:
        """Every parameter and buffer the full graph reads, in the order a full export lists
        them: each run of the traced layers' attributes stands for that run over every layer
        (the attributes of the layer it copies, renamed)."""
        out: list[tuple[fx.Node, str]] = []
        run: list[fx.Node] = []

        def flush():
            for layer in range(len(self.cut.layers)):
                source = self._source(layer)
                old, new = self._path(source), self._path(layer)
                out.extend((n, new + n.target[len(old) :]) for n in run if _under(n.target, old))
            run.clear()

        for n in self.nodes:
            if n.op != "get_attr":
                continue
            if self._layer_of(n) is None:
                flush()
                out.append((n, n.target))
            else:
                run.append(n)
        flush()
        return out

    def _path(self, layer: int) -> str:
        return f"{self.cut.path}.{self.cut.names[layer]}"

    def _root(self, graph: fx.Graph) -> dict:
        """What the full graph's attributes name: the cut export's, and the parameters of the
        layers not traced from the model (a tensor named twice is shared between layers)."""
        root: dict = {}
        seen: set[int] = set()
        for n in graph.nodes:
            if n.op not in ("get_attr", "call_module"):
                continue
            try:
                value = operator.attrgetter(n.target)(self.gm)
            except AttributeError:
                value = self._held(n.target)
            if isinstance(value, torch.Tensor):
                if id(value) in seen:
                    raise NotRepeated(f"{n.target} is shared with another attribute")
                seen.add(id(value))
            root[n.target] = value
        return root

    def _held(self, target: str):
        """The model's attribute ``target``; a copied layer's constant that torch.export lifted
        from its template's forward (``trace``) is not one, and may differ between layers."""
        try:
            return operator.attrgetter(target)(self.wrapper)
        except AttributeError:
            raise NotRepeated(f"{target} is a constant of a layer's forward, not of the model") from None

    def _map(self, a: fx.Node, region, env, copies, outputs, layer: int | None = None) -> fx.Node:
        """The node of the full graph that stands for ``a`` read in ``region`` (a traced layer,
        None for post, "pre") by full layer ``layer``."""
        if region == "pre":
            return env[a]
        read = self.reads.get((a, region))
        if read is None:
            return env[a]
        what, where = read
        if what == "shared":
            return copies[where][a]
        last = len(self.cut.layers) - 1 if layer is None else layer - 1
        return outputs[last][where]

    def _write_layer(self, graph, layer, env, params, copies, outputs, sizes) -> None:
        source = self._source(layer)
        old, new = self._path(source), self._path(layer)
        local: dict[fx.Node, fx.Node] = {}

        def arg(a: fx.Node) -> fx.Node:
            if a in local:
                return local[a]
            if a.op == "get_attr" and _under(a.target, old):
                target = new + a.target[len(old) :]
                if target not in params:
                    raise NotRepeated(f"layer {layer} has no parameter {target}")
                return params[target]
            return self._map(a, source, env, copies, outputs, layer)

        for n in self.segment[source]:
            size = _size_expr(n)
            if source != layer and size in sizes:
                local[n] = sizes[size]  # export computes a size once and reads it after
                continue
            copied = _node_copy(graph, n, arg)
            if size is not None:
                sizes.setdefault(size, copied)
            if source != layer:
                copied.meta = dict(n.meta)
                copied.meta["nn_module_stack"] = _renamed_stack(n.meta.get("nn_module_stack"), old, new)
            local[n] = copied
        copies[layer] = local
        outputs[layer] = [local[o] for o in self.outputs[source]]


def _node_copy(graph: fx.Graph, n: fx.Node, arg) -> fx.Node:
    """``graph.node_copy(n, arg)``, the copy made bare and then given its arguments: fx checks
    a new node's arguments for raw symbolic sizes leaf by leaf (most of the cost of a copy),
    and the exported graph's nodes, which these copy, hold none."""
    args, kwargs = fx.node.map_arg(n.args, arg), fx.node.map_arg(n.kwargs, arg)
    copied = graph.create_node(n.op, n.target, None, None, n.name, n.type)
    copied.args, copied.kwargs = args, kwargs
    copied.meta = copy.copy(n.meta)
    return copied


def _attribute(graph: fx.Graph, like: fx.Node, target: str) -> fx.Node:
    """A get_attr of ``target`` standing where ``like`` stands in its own layer."""
    node = graph.create_node("get_attr", target, name=target.replace(".", "_"))
    node.meta = dict(like.meta)
    return node


def _size_expr(n: fx.Node):
    """The symbolic expression of a size node whose value follows from the inputs' sizes alone
    (None for tensors and data-dependent sizes)."""
    v = n.meta.get("val")
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) and not free_unbacked_symbols(v):
        return v.node.expr
    return None


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _renamed_stack(stack: dict | None, old: str, new: str) -> dict | None:
    """A node's module stack with the layer's path ``old`` renamed ``new`` (keys end in it too)."""
    if not stack:
        return stack
    out = {}
    for key, value in stack.items():
        if isinstance(value, tuple) and _under(str(value[0]), old):
            path = new + str(value[0])[len(old) :]
            key = key[: -len(value[0])] + path if key.endswith(value[0]) else key
            value = (path, *value[1:])
        out[key] = value
    return out
