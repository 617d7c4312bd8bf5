"""Layer kinds: each repeated layer of the rewritten chunks as a graph of its own with its names
made relative to the layer, and the layers whose code is then the same grouped as one kind (one
emitted ``nn.Module`` class, instantiated per layer).

A layer is cut out of its chunk as activation checkpointing cuts it (``layer_graph``: the values it
reads from before it are its inputs, the values read after it its outputs), or is a checkpointed
layer's graph already. In its own graph the layer reads its parameters and submodules by their
names under the layer (``attn.wq``), names its values as fx would in a graph of that layer alone,
takes any parameter it reads from outside the layer as one more input, and reads each string
constant naming the layer (the key a MoE layer counts its expert loads under) from an attribute
that its constructor sets from the layer's name: what differs between two layers of one kind is
then only their name, a constructor argument."""

from __future__ import annotations

import inspect
import re
from collections import Counter
from dataclasses import dataclass, field

from torch import fx

from autoshard.errors import AutoshardError
from autoshard.passes.activation_checkpoint import call_in_place, layer_bodies, layer_graph
from autoshard.passes.pipeline_split import input_meta_nodes
from autoshard.runtime.checkpoint import Checkpoint


@dataclass
class Layer:
    """One layer of one chunk: ``graph`` its code with names relative to ``prefix``."""

    index: int
    prefix: str  # the layer's module in the model: "model.layers.3"
    graph: fx.Graph
    owner: fx.GraphModule  # holds the layer's modules and parameters under their full names
    constants: dict[str, str]  # attribute -> what follows the layer's name in the string it holds
    call: fx.Node  # the layer's call in the chunk's graph
    checkpoint: Checkpoint | None = None
    kind: str = ""
    source: str = ""  # the model's class of the layer, where the module stack names it


@dataclass
class Kind:
    """Layers whose code is the same: one class."""

    name: str
    layers: list[Layer] = field(default_factory=list)


def chunk_layers(chunk: fx.GraphModule) -> list[Layer]:
    """The layers of ``chunk``, each called in the chunk's graph as one module call (a checkpointed
    layer as its ``Checkpoint``, any other layer cut out of the graph, called by its module name
    ``model.layers.3``)."""
    graph = chunk.graph
    calls = [n for n in graph.nodes if n.op == "call_module" and isinstance(chunk.get_submodule(n.target), Checkpoint)]
    if calls:
        layers = []
        for call in calls:
            checkpoint = chunk.get_submodule(call.target)
            sub = checkpoint.fn.graph
            layer = call.meta["layer"]
            layers.append(_layer(layer, _prefix(layer, sub.nodes), sub, checkpoint.fn, call, checkpoint))
        return layers
    layers = []
    for layer, body in sorted(_absorbed(graph, layer_bodies(graph)).items()):
        prefix = _prefix(layer, body)
        sub = layer_graph(body)
        call = call_in_place(graph, body, prefix, {"region": "layer", "layer": layer})
        layers.append(_layer(layer, prefix, sub, chunk, call, None))
    return layers


def _absorbed(graph: fx.Graph, bodies: dict[int, list[fx.Node]]) -> dict[int, list[fx.Node]]:
    """``bodies`` with the arithmetic on sizes that reads only what one layer computes moved into
    that layer (the pipeline split recomputes it in each chunk and leaves it no layer: ``s * 2``
    of a size ``s`` the layer read)."""
    member = {n: layer for layer, body in bodies.items() for n in body}
    meta = input_meta_nodes(graph)
    for node in graph.nodes:
        found = {member.get(a) for a in node.all_input_nodes}
        if node in meta and node not in member and len(found) == 1 and None not in found:
            member[node] = found.pop()
    order = {n: i for i, n in enumerate(graph.nodes)}
    out: dict[int, list[fx.Node]] = {}
    for node, layer in sorted(member.items(), key=lambda item: order[item[0]]):
        out.setdefault(layer, []).append(node)
    return out


def _prefix(layer: int, nodes) -> str:
    """The module of layer ``layer``: the dotted prefix ending in the layer's number that most of
    the parameters and submodules its nodes read lie under."""
    found = Counter()
    for node in {a: None for n in nodes for a in (n, *n.all_input_nodes)}:
        if node.op in ("get_attr", "call_module"):
            parts = node.target.split(".")
            if str(layer) in parts[:-1]:
                found[".".join(parts[: parts.index(str(layer)) + 1])] += 1
    if not found:
        raise AutoshardError(f"layer {layer} reads no parameter of its own, so it has no module to emit as a class")
    return found.most_common(1)[0][0]


def _layer(index, prefix, sub, owner, call, checkpoint) -> Layer:
    graph, constants, outside = relative_graph(sub, prefix)
    if outside:  # parameters read from outside the layer: the chunk reads them and passes them in
        with call.graph.inserting_before(call):
            reads = [call.graph.get_attr(target) for target in outside]
        call.args = (*call.args, *reads)
    layer = Layer(index, prefix, graph, owner, constants, call, checkpoint)
    layer.source = _source_class(sub, prefix)
    return layer


def _source_class(sub: fx.Graph, prefix: str) -> str:
    """The name of the model's class of the module at ``prefix``, from the module stacks."""
    for node in sub.nodes:
        for entry in (node.meta.get("nn_module_stack") or {}).values():
            if isinstance(entry, tuple) and len(entry) == 2 and str(entry[0]) == prefix:
                kind = entry[1]
                return (kind if isinstance(kind, str) else kind.__name__).rsplit(".", 1)[-1]
    return "Layer"


def _base(name: str, prefix: str) -> str:
    """A node's name without the layer's module (``model_layers_3_attn_wq`` -> ``attn_wq``, the
    name of a call a pass retargeted) and the number fx added to keep it unique (``view_5``)."""
    return re.sub(r"_\d+$", "", name.removeprefix(f"{prefix.replace('.', '_')}_"))


def relative_graph(sub: fx.Graph, prefix: str):
    """``sub`` (one layer's graph) rebuilt with its names relative to ``prefix`` (in its nodes'
    notes too): returns the graph, the attributes holding strings that name the layer (attribute -> the string's
    tail after ``prefix``) and the full names of the parameters it reads from outside the layer,
    which became its last inputs."""
    graph, env, constants = fx.Graph(), {}, {}
    under = f"{prefix}."
    outside = [n.target for n in sub.nodes if n.op == "get_attr" and not n.target.startswith(under)]
    inputs = [n for n in sub.nodes if n.op == "placeholder"]
    taken = [f"x_{i}" if i else "x" for i in range(len(inputs))]
    for node, name in zip(inputs, taken):
        env[node] = graph.placeholder(name)
    for target in outside:
        name = target.rsplit(".", 1)[-1]
        env[target] = graph.placeholder(name if name not in taken else f"{name}_")
    for node in sub.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "get_attr" and not node.target.startswith(under):
            env[node] = env[node.target]
            continue
        target, name = node.target, _base(node.name, prefix)
        if node.op in ("get_attr", "call_module"):
            if not target.startswith(under):
                raise AutoshardError(f"layer {prefix} calls {target}, a module outside it; cannot emit it as a class")
            target = name = target[len(under) :]
            name = name.replace(".", "_")
        args = fx.map_arg(node.args, env.__getitem__)
        kwargs = fx.map_arg(node.kwargs, env.__getitem__)
        if node.op == "call_function":
            args, kwargs = _constants_read(graph, node, args, kwargs, prefix, constants)
        env[node] = graph.create_node(node.op, target, args, kwargs, name=name)
        if "note" in node.meta:
            env[node].meta["note"] = node.meta["note"].replace(under, "")
    return graph, constants, outside


def _constants_read(graph: fx.Graph, node: fx.Node, args: tuple, kwargs: dict, prefix: str, constants: dict):
    """``args`` and ``kwargs`` with each string naming the layer (``prefix`` or a name under it)
    replaced by a read of the attribute that holds it (``constants``: attribute -> the string's
    tail), named after the parameter it is passed to; each attribute is read once."""
    reads = {n.target: n for n in graph.nodes if n.op == "get_attr" and n.target in constants}
    try:
        params = list(inspect.signature(node.target).parameters)
    except (TypeError, ValueError):
        params = []

    def read(value, param: str):
        if not isinstance(value, str) or not (value == prefix or value.startswith(f"{prefix}.")):
            return value
        tail = value[len(prefix) :]
        attr = next((a for a, t in constants.items() if t == tail), None)
        if attr is None:
            attr = param if param not in constants and param.isidentifier() else f"name_{len(constants)}"
            constants[attr] = tail
        if attr not in reads:
            reads[attr] = graph.get_attr(attr)
        return reads[attr]

    args = tuple(read(a, params[i] if i < len(params) else "name") for i, a in enumerate(args))
    return args, {k: read(v, k) for k, v in kwargs.items()}


def group(layers: list[Layer], key) -> list[Kind]:
    """The kinds of ``layers``: layers with equal ``key(layer)`` are one kind, named after the
    model's class of its first layer (numbered where two kinds share a class)."""
    kinds: dict = {}
    for layer in layers:
        kinds.setdefault(key(layer), Kind("")).layers.append(layer)
    taken: Counter = Counter()
    for kind in kinds.values():
        source = kind.layers[0].source
        taken[source] += 1
        kind.name = source if taken[source] == 1 else f"{source}{taken[source]}"
        for layer in kind.layers:
            layer.kind = kind.name
    return list(kinds.values())
