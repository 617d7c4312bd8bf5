"""Structure: where each node sits in the model, and which layers repeat.

The repeated layer stack is the ``ModuleList``/``Sequential`` holding most parameters. Every node
gets its module path and type, its layer index and its region (``pre``, ``layer``, ``post``), and
the op it computes (the op table's name and class, ``autoshard.ir.ops``). Layers are
hashed by their code with layer-relative names (:func:`layer_signature`); layers whose signature
and input shapes agree are one :class:`LayerKind`, analysed once.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import fx, nn

from autoshard import modelfile
from autoshard.ir import ops


@dataclass
class LayerKind:
    """Layers that are copies of one another: same code, parameter and input shapes."""

    id: int
    layers: list[int]

    @property
    def template(self) -> int:
        return self.layers[0]

    @property
    def count(self) -> int:
        return len(self.layers)


def layer_stack(model: nn.Module) -> tuple[str, list[str]] | None:
    """The ModuleList/Sequential holding most parameters, with at least two children: its path
    and its children's names."""
    best = None
    for path, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2:
            size = sum(p.numel() for p in mod.parameters())
            if best is None or size > best[0]:
                best = (size, path, [name for name, _ in mod.named_children()])
    return (best[1], best[2]) if best else None


def module_kinds(layers: list[nn.Module]) -> list[int] | None:
    """The kind of each layer of the stack read from its modules alone, before any tracing
    (0 for the first layer's kind, then in order of first appearance), or None when a module
    object appears twice in the stack (a layer shared, not copied).

    Two layers are one kind when their module trees agree: each submodule's relative name and
    class, its parameters' and buffers' names, shapes, dtypes and ``requires_grad``, and its plain
    attributes (numbers, strings, flags and tuples of them, which is where models keep a layer's
    attention type or window). An attribute equal to each layer's own position is the layer's
    index (transformers' ``layer_idx``) and is not compared. Code that branches on that index
    alone is not seen here; the export path checks the first two layers of a kind against each
    other (``repeat``)."""
    if len({id(m) for m in layers}) < len(layers):
        return None
    states = [_module_state(m) for m in layers]
    index_keys = set.intersection(*({k for k, v in st[1].items() if v == repr(i)} for i, st in enumerate(states)))
    seen: dict[tuple, int] = {}
    kinds = []
    for modules, attrs in states:
        key = (modules, tuple(sorted((k, v) for k, v in attrs.items() if k not in index_keys)))
        kinds.append(seen.setdefault(key, len(seen)))
    return kinds


def _module_state(layer: nn.Module) -> tuple[tuple, dict]:
    """A layer's submodules (name, class, parameters, buffers) and its plain attributes by
    (submodule, attribute) name."""

    def plain(v) -> bool:
        if isinstance(v, (tuple, list)):
            return all(plain(x) for x in v)
        return v is None or isinstance(v, (bool, int, float, str, torch.dtype))

    def tensors(items) -> tuple:
        return tuple((name, tuple(t.shape), t.dtype, t.requires_grad) for name, t in items if t is not None)

    modules, attrs = [], {}
    for name, mod in layer.named_modules():
        modules.append(
            (name, type(mod), tensors(mod.named_parameters(recurse=False)), tensors(mod.named_buffers(recurse=False)))
        )
        attrs.update({(name, k): repr(v) for k, v in vars(mod).items() if plain(v)})
    return tuple(modules), attrs


_WRAPPER_PREFIX = "model."


def _strip(path: str) -> str:
    """A module path in the user's model, from one in the training wrapper."""
    if path == "model":
        return ""
    return path[len(_WRAPPER_PREFIX) :] if path.startswith(_WRAPPER_PREFIX) else path


def annotate_modules(gm: fx.GraphModule, model: nn.Module, stack: tuple[str, list[str]] | None) -> None:
    """``module_path``, ``module_type``, ``layer``, ``region`` and ``source`` on every node."""
    prefix = (stack[0] + ".") if stack and stack[0] else ""
    index = {name: i for i, name in enumerate(stack[1])} if stack else {}
    layer_re = re.compile(rf"^{re.escape(prefix)}([^.]+)(\.|$)")
    nodes = list(gm.graph.nodes)
    for n in nodes:
        path, mtype = _module_of(n, gm, model)
        n.meta["module_path"] = path
        n.meta["module_type"] = mtype
        m = layer_re.match(path) if stack else None
        n.meta["layer"] = index.get(m.group(1)) if m else None
        if "source" not in n.meta:
            n.meta["source"] = _source(n.meta.get("stack_trace"))
    _assign_regions(nodes)


def _module_of(n: fx.Node, gm: fx.GraphModule, model: nn.Module) -> tuple[str, str]:
    """The path (in the user's model) and class name of the innermost module ``n`` came from."""
    if n.op == "call_module":
        return _strip(n.target), type(gm.get_submodule(n.target)).__name__
    if n.op == "get_attr":
        path = _strip(n.target.rsplit(".", 1)[0]) if "." in n.target else ""
        return path, type(_get_module(model, path)).__name__ if path else type(model).__name__
    stack_meta = n.meta.get("nn_module_stack") or {}
    entries = [v for v in stack_meta.values() if isinstance(v, tuple) and not str(v[0]).startswith("_")]
    if not entries:
        return "", ""
    path, raw_type = entries[-1]
    if isinstance(raw_type, type):
        return _strip(str(path)), raw_type.__name__
    return _strip(str(path)), str(raw_type).rsplit(".", 1)[-1] if raw_type else ""


def _assign_regions(nodes: list[fx.Node]) -> None:
    """``pre`` before the first layer, ``post`` after the last; code between two layers belongs to
    the one before it; a parameter belongs where it is first used."""
    computing = [i for i, n in enumerate(nodes) if n.meta["layer"] is not None and n.op != "get_attr"]
    first = computing[0] if computing else None
    last = computing[-1] if computing else None
    current = None
    for i, n in enumerate(nodes):
        if n.op == "get_attr":
            continue
        if n.meta["layer"] is not None:
            n.meta["region"] = "layer"
            current = n.meta["layer"]
        elif first is None or i < first:
            n.meta["region"] = "pre"
        elif i > last:
            n.meta["region"] = "post"
        else:
            n.meta["region"] = "layer"
            n.meta["layer"] = current
    for n in nodes:
        if n.op == "get_attr":
            users = [u for u in n.users if "region" in u.meta]
            n.meta["region"] = users[0].meta["region"] if users else "pre"
            if n.meta["layer"] is None and users:
                n.meta["layer"] = users[0].meta["layer"]


def _get_module(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return model


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _source(trace: str | None) -> str | None:
    """``file:line`` of the innermost frame of the model's code in a recorded stack trace
    (torch.export's, which keeps only ``forward`` frames): :func:`autoshard.modelfile.model_line`."""
    if not trace:
        return None
    return modelfile.model_line((f, int(line)) for f, line in reversed(_FRAME.findall(trace)))


def layer_nodes(gm: fx.GraphModule) -> dict[int, list[fx.Node]]:
    """Each layer's computing nodes, in graph order."""
    out: dict[int, list[fx.Node]] = defaultdict(list)
    for n in gm.graph.nodes:
        if n.meta.get("layer") is not None and n.op not in ("get_attr", "placeholder"):
            out[n.meta["layer"]].append(n)
    return dict(out)


def layer_signature(
    gm: fx.GraphModule, nodes: list[fx.Node], tensors_only: bool = False
) -> tuple[tuple, list[fx.Node]]:
    """A layer's code with layer-relative names, and the outside nodes it reads, in order.

    ``tensors_only`` leaves out size arithmetic, which torch.export shares between layers."""
    if tensors_only:
        nodes = [n for n in nodes if n.meta.get("shape") is not None or "shapes" in n.meta]
    local = {n: i for i, n in enumerate(nodes)}
    external: dict[fx.Node, int] = {}  # in first-read order
    depth = _common_depth(nodes)

    def rel(path: str) -> str:
        return ".".join(path.split(".")[depth:])

    def arg_key(a):
        if isinstance(a, fx.Node):
            if tensors_only and a.meta.get("shape") is None and "shapes" not in a.meta:
                return "sym"
            if a in local:
                return ("L", local[a])
            if a.op == "get_attr":
                return ("P", rel(_strip(a.target)), tuple(a.meta.get("shape") or ()))
            return ("X", external.setdefault(a, len(external)))
        if isinstance(a, (list, tuple)):
            return tuple(arg_key(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, arg_key(v)) for k, v in a.items())
        if isinstance(a, (int, float, bool, str, type(None), torch.dtype, torch.device)):
            return a
        return type(a).__name__

    sig = []
    for n in nodes:
        target = n.target
        if n.op == "call_module":
            mod = gm.get_submodule(n.target)
            target = (rel(_strip(n.target)), type(mod).__name__, tuple(tuple(p.shape) for p in mod.parameters()))
        elif n.op == "get_attr":
            target = rel(_strip(n.target))
        sig.append(
            (n.op, target if isinstance(target, (str, tuple)) else id(target), arg_key(n.args), arg_key(n.kwargs))
        )
    return tuple(sig), list(external)


def _common_depth(nodes: list[fx.Node]) -> int:
    """Depth of the layer's own module path (e.g. 2 for ``layers.3``)."""
    paths = [n.meta["module_path"].split(".") for n in nodes if n.meta.get("module_path")]
    common = paths[0]
    for p in paths[1:]:
        k = 0
        while k < min(len(common), len(p)) and common[k] == p[k]:
            k += 1
        common = common[:k]
    return len(common)


def group_kinds(keys: dict[int, tuple]) -> list[LayerKind]:
    """Layers with equal keys (signature and input shapes) are one kind, in layer order."""
    groups: dict[tuple, list[int]] = {}
    for layer in sorted(keys):
        groups.setdefault(keys[layer], []).append(layer)
    return [LayerKind(i, layers) for i, layers in enumerate(groups.values())]


def annotate_ops(gm: fx.GraphModule) -> None:
    """``op`` (the op table's name) and ``op_class`` on every node, ``is_param`` on attributes."""
    params = {name for name, _ in gm.named_parameters()}
    for n in gm.graph.nodes:
        n.meta["op"] = ops.op_name(n, gm)
        if n.op == "get_attr":
            n.meta["is_param"] = n.target in params
    ops.classify(gm)
