"""Repeated layers on the symbolic-trace path: trace a layer kind twice, copy its other layers.

``torch.fx.symbolic_trace`` runs every layer's Python code, creating each node through fx's
proxies, which is most of the trace time of a 126-layer model. A layer's traced code follows
from its module tree (classes, parameter shapes, plain attributes), the arguments it is called
with (which are proxies, and Python values) and nothing else that fx can see, so a layer whose
module tree equals an earlier layer's and that is called with proxies in the same places and
the same Python values traces to the same nodes, renamed to its own modules and parameters.
:class:`Copier` (``trace._Tracer.call_module``) writes such a layer from the first layer of its
kind instead of tracing it.

Code that depends on what fx cannot see (global state a layer changes) would break that, so
the second layer of each kind is traced as well and compared with the copy it would have been:
where they differ, the kind is traced layer by layer. A copied layer reads its own inputs, its
own parameters and modules, and nodes made before the stack's first layer (a mask, rotary
tables); a template reading anything else (a constant its forward makes, another layer's
parameter, a node of an earlier layer it was not given) is never copied, and a stack whose
layers share a module or a tensor (which fx names by its first owner) is traced whole. Node
names come out as a full trace names them: each copy is created in trace order with the name fx
would derive from its target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autoshard.capture import structure


class _NotCopied(Exception):
    """The template cannot stand for this call (trace the layer instead)."""


@dataclass
class _Template:
    """A traced layer: its path, the call's flattened arguments, its nodes and its output."""

    path: str
    spec: pytree.TreeSpec
    leaves: list
    nodes: list[fx.Node]
    out: object
    calls: dict[str, int]  # the module calls it made, by path (fx numbers a module's later calls)
    checked: bool = False  # the kind's second layer matched the copy it would have been
    broken: bool = False  # it did not, or the template reads what a copy cannot


@dataclass
class Copier:
    """Per traced wrapper: which stack layers are one kind, and each kind's template."""

    paths: dict[int, str]  # id(layer module) -> its path in the traced wrapper
    kinds: dict[int, tuple]  # id(layer module) -> its kind key (the module tree)
    templates: dict[tuple, _Template] = field(default_factory=dict)
    before: set[fx.Node] | None = None  # the nodes made before the stack's first layer

    @classmethod
    def of(cls, wrapper: nn.Module) -> Copier | None:
        """The copier for ``wrapper`` (a ``TrainingForward``) whose model has a layer stack."""
        stack = structure.layer_stack(wrapper.model)
        if stack is None:
            return None
        prefix = "model." + (stack[0] + "." if stack[0] else "")
        layers = {prefix + name: wrapper.get_submodule(prefix + name) for name in stack[1]}
        if len({id(m) for m in layers.values()}) < len(layers) or _share_tensors(layers.values()):
            return None  # a layer, or a tensor, shared between layers: fx names it by its first owner
        kinds = {id(m): _kind_key(m) for m in layers.values()}
        return cls({id(m): path for path, m in layers.items()}, kinds)

    def call(self, tracer: fx.Tracer, module: nn.Module, traced, args: tuple, kwargs: dict):
        """``module(*args, **kwargs)`` in ``tracer``'s graph: copied from its kind's template
        where that stands for it, else ``traced()`` (fx's own call), kept as the template or
        checked against it."""
        if self.before is None:
            self.before = set(tracer.graph.nodes)
        path, key = self.paths[id(module)], self.kinds[id(module)]
        if tracer.num_calls.get(path):  # called before: fx numbers this call's modules (``@1``)
            return traced()
        leaves, spec = pytree.tree_flatten((args, kwargs))
        template = self.templates.get(key)
        if template is not None and template.checked:
            try:
                out = _Copy(self, template, path, leaves, spec).write(tracer.graph, getattr(tracer, "proxy_cache", {}))
            except _NotCopied:
                pass
            else:
                for called, count in template.calls.items():
                    called = _renamed(called, template.path, path)
                    tracer.num_calls[called] = tracer.num_calls.get(called, 0) + count
                return out
        counts, start = dict(tracer.num_calls), tracer.graph._root.prev
        out = traced()
        nodes = _after(tracer.graph, start)
        calls = {p: n - counts.get(p, 0) for p, n in tracer.num_calls.items() if n != counts.get(p, 0)}
        if template is None:
            self.templates[key] = _Template(path, spec, leaves, nodes, out, calls)
        elif not template.checked and not template.broken:
            template.checked = _matches(self, template, path, leaves, spec, nodes, out, calls)
            template.broken = not template.checked
        return out


def _share_tensors(layers) -> bool:
    """Whether two layers hold one parameter or buffer."""
    seen: set[int] = set()
    for layer in layers:
        held = {id(t) for _, t in layer.named_parameters(remove_duplicate=False)}
        held |= {id(t) for _, t in layer.named_buffers(remove_duplicate=False)}
        if held & seen:
            return True
        seen |= held
    return False


def _kind_key(layer: nn.Module) -> tuple:
    """Every submodule's name, class, parameter and buffer shapes, and every plain attribute
    (a layer's own index included: code may branch on it)."""
    modules, attrs = structure._module_state(layer)
    return modules, tuple(sorted(attrs.items()))


def _after(graph: fx.Graph, start: fx.Node) -> list[fx.Node]:
    """The nodes of ``graph`` after ``start``, in order."""
    out, n = [], start.next
    while n is not graph._root:
        out.append(n)
        n = n.next
    return out


def _matches(copier, template, path, leaves, spec, nodes, out, calls) -> bool:
    """Whether the traced layer (``nodes``, ``out``, module ``calls``) is what copying
    ``template`` gives."""
    if calls != {_renamed(p, template.path, path): n for p, n in template.calls.items()}:
        return False
    try:
        copy = _Copy(copier, template, path, leaves, spec)
        return copy.same_as(nodes, out)
    except _NotCopied:
        return False


class _Copy:
    """The template's nodes written for the layer at ``path`` called with ``leaves``."""

    def __init__(self, copier: Copier, template: _Template, path: str, leaves: list, spec):
        if spec != template.spec or len(leaves) != len(template.leaves):
            raise _NotCopied
        self.env: dict[fx.Node, fx.Node] = {}
        for mine, theirs in zip(leaves, template.leaves):
            if isinstance(theirs, fx.Proxy) and isinstance(mine, fx.Proxy):
                if self.env.setdefault(theirs.node, mine.node) is not mine.node:
                    raise _NotCopied  # one template input given as two
            elif isinstance(theirs, fx.Proxy) or isinstance(mine, fx.Proxy) or not _same_value(mine, theirs):
                raise _NotCopied
        if len(set(self.env.values())) < len(self.env):
            raise _NotCopied  # two template inputs given as one
        self.template, self.before = template, copier.before
        self.old, self.new = template.path, path

    def _node(self, a: fx.Node) -> fx.Node:
        if a in self.env:
            return self.env[a]
        if a in self.before:
            return a
        raise _NotCopied  # a node of an earlier layer the call was not given

    def _target(self, n: fx.Node):
        if n.op not in ("get_attr", "call_module"):
            return n.target
        if n.target != self.old and not n.target.startswith(self.old + "."):
            raise _NotCopied  # a constant of the forward, or another module's attribute
        return self.new + n.target[len(self.old) :]

    def _fields(self, n: fx.Node) -> tuple:
        if n.op in ("placeholder", "output"):
            raise _NotCopied
        args = fx.node.map_arg(n.args, self._node)
        kwargs = fx.node.map_arg(n.kwargs, self._node)
        return n.op, self._target(n), args, kwargs

    def write(self, graph: fx.Graph, cache: dict):
        """Create the layer's nodes at the end of ``graph``; returns its output (proxies of
        them). Everything is checked before the first node is written. ``cache``: the tracer's
        attribute proxies by name, which a later read of a copied attribute reuses, as it
        would the traced one's."""
        given = dict(self.env)
        self.env.update((n, n) for n in self.template.nodes)
        for n in self.template.nodes:
            self._fields(n)
        self._output()
        self.env = given
        for n in self.template.nodes:
            op, target, args, kwargs = self._fields(n)
            # made bare, then given its arguments: fx checks a new node's arguments for raw
            # symbolic sizes leaf by leaf (half the cost of a copy), and the template's passed
            made = graph.create_node(op, target, None, None, None, n.type)
            made.args, made.kwargs = args, kwargs
            made.meta = _renamed_meta(n.meta, self.old, self.new)
            self.env[n] = made
            cached = cache.get(n.target) if op == "get_attr" else None
            if cached is not None and cached.node is n:
                cache[target] = fx.Proxy(made, cached.tracer)
        return self._output()

    def _output(self):
        leaves, spec = pytree.tree_flatten(self.template.out)
        out = []
        for leaf in leaves:
            if isinstance(leaf, fx.Proxy):
                out.append(fx.Proxy(self._node(leaf.node), leaf.tracer))
            elif isinstance(leaf, torch.Tensor):
                raise _NotCopied
            else:
                out.append(leaf)
        return pytree.tree_unflatten(out, spec)

    def same_as(self, nodes: list[fx.Node], out) -> bool:
        """Whether ``nodes`` (traced) and ``out`` are this copy, node for node."""
        if len(nodes) != len(self.template.nodes):
            return False
        for theirs, mine in zip(self.template.nodes, nodes):
            if self._fields(theirs) != (mine.op, mine.target, mine.args, mine.kwargs):
                return False
            if _renamed_meta(theirs.meta, self.old, self.new) != mine.meta or theirs.type != mine.type:
                return False
            self.env[theirs] = mine
        mine_leaves, mine_spec = pytree.tree_flatten(out)
        copy_leaves, copy_spec = pytree.tree_flatten(self._output())
        if mine_spec != copy_spec:
            return False
        return all(_same_leaf(a, b) for a, b in zip(mine_leaves, copy_leaves))


def _same_leaf(a, b) -> bool:
    if isinstance(a, fx.Proxy) or isinstance(b, fx.Proxy):
        return isinstance(a, fx.Proxy) and isinstance(b, fx.Proxy) and a.node is b.node
    return _same_value(a, b)


def _same_value(a, b) -> bool:
    """Python values a layer is called with that trace alike (tensors only when one object)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - a value without a plain equality: not known to be alike
        return False


def _renamed_meta(meta: dict, old: str, new: str) -> dict:
    """A template node's meta for the copy: its module stack renamed from ``old`` to ``new``."""
    out = dict(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        out["nn_module_stack"] = type(stack)(
            (_renamed(k, old, new), (_renamed(v[0], old, new), *v[1:])) for k, v in stack.items()
        )
    return out


def _renamed(path: str, old: str, new: str) -> str:
    if path == old or path.startswith(old + ".") or path.startswith(old + "@"):
        return new + path[len(old) :]
    return path
