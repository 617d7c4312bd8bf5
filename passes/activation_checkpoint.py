"""Activation checkpointing: each repeated layer becomes one call to ``rt.Checkpoint``, which
recomputes in backward the saved-tensor kinds the plan marks ``recompute`` for the layer's
pipeline stage (``ctx.recompute_of``: stages may differ, a rank holding more micro-batches in
flight recomputing more); a layer whose stage recomputes nothing is left alone.

Runs after the parallel rewrites and before the pipeline split. A layer's nodes are moved into
their own graph (inputs: the values it reads from before it; outputs: the values read after it),
called as ``checkpoint_L(*inputs)``. The layer's parameters stay attributes of ``gm``; the reads of
those only the layer used (``get_attr``, as torch.export writes parameters) move into its graph.

Requires ``region`` and ``layer`` on every node and reads ``ctx.recompute`` and ``ctx.fp8_saved``
(the kept categories held as FP8 copies: the FP8 pass marked their quantisations ``keep_fp8``). Guarantees
(:func:`layers_wrapped`): the only computing nodes left in the ``layer`` region are one
``Checkpoint`` call per layer that recomputes something, recomputing exactly its stage's set, and the ``getitem`` s that
unpack its outputs (besides reads of a model input's size or device and integer arithmetic on
them, read off nothing the layer computes, which belong to no layer); each call carries the
layer's ``region``, ``layer`` and ``source``, with ``op`` ``"checkpoint"``, and a note in
``meta["note"]``. Nothing else in the graph changes.
"""

from __future__ import annotations

import operator

from torch import fx

from autoshard.passes._graph import note
from autoshard.passes.contract import RewriteContext
from autoshard.passes.pipeline_split import input_meta_nodes
from autoshard.runtime.checkpoint import Checkpoint


def activation_checkpoint(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    """Wrap every layer of ``gm`` that recomputes something (its stage's set,
    ``ctx.recompute_of``) in place; returns ``gm``."""
    for layer, body in sorted(layer_bodies(gm.graph).items()):
        recompute, fp8_saved = list(ctx.recompute_of(layer)), ctx.fp8_saved_of(layer)
        if not recompute:
            continue
        anchor = body[-1]
        meta = {k: anchor.meta[k] for k in ("region", "layer", "nn_module_stack", "source") if k in anchor.meta}
        meta["op"] = "checkpoint"
        name = f"checkpoint_{layer}"
        sub = layer_graph(body)
        gm.add_submodule(name, Checkpoint(_layer_module(gm, sub, f"Layer{layer}"), recompute, fp8_saved))
        call = call_in_place(gm.graph, body, name, meta)
        kept = f"; keep {', '.join(fp8_saved)} as fp8 copies" if fp8_saved else ""
        recomputed = ", ".join(sorted(recompute))
        note(call, f"layer {layer} under activation checkpointing: recompute {recomputed}{kept}")
    gm.graph.lint()
    gm.recompile()
    return gm


def _layer_module(gm: fx.GraphModule, graph: fx.Graph, name: str) -> fx.GraphModule:
    """``graph`` as a module over ``gm``'s attributes, its Python code written when first run or
    read (torch's lazy graph module, private since 2.2): a plan-only dry run, and the emitter,
    which writes code of its own, never need it, and writing it costs milliseconds a layer."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # a torch without it: the code is written now
        return fx.GraphModule(gm, graph, class_name=name)
    return _LazyGraphModule(gm, graph, class_name=name)


def layer_bodies(graph: fx.Graph) -> dict[int, list[fx.Node]]:
    """Layer -> its computing nodes, in graph order. A model input's size or device and
    arithmetic on its sizes, read off nothing the layer computes, belong to no layer: the layers
    reading one take it as an input, and the pipeline split recomputes it in each chunk reading it
    (inside a layer, one a later layer reads would be handed on between stages, which send
    tensors only: transformers' MoE blocks compute batch * sequence once for every layer). A read
    of a layer's buffer that nothing uses (a causal mask the flash-attention pass fused away) is
    the layer's too: the layer still holds the buffer, which is part of the model's state."""
    meta = input_meta_nodes(graph)
    layers: dict[int, list[fx.Node]] = {}
    members: dict[int, set[fx.Node]] = {}
    for node in graph.nodes:
        computes = node.op not in ("get_attr", "placeholder", "output") or (node.op == "get_attr" and not node.users)
        if computes and node.meta.get("region") == "layer" and node.meta.get("layer") is not None:
            layer = node.meta["layer"]
            mine = members.setdefault(layer, set())
            if node in meta and not any(a in mine for a in node.all_input_nodes):
                continue
            layers.setdefault(layer, []).append(node)
            mine.add(node)
    return layers


def _inputs_outputs(body: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """The values ``body`` reads from before it (parameter reads aside) and those read after it."""
    members = set(body)
    inputs: list[fx.Node] = []
    for n in body:
        for a in n.all_input_nodes:
            if a not in members and a not in inputs and a.op != "get_attr":
                inputs.append(a)
    return inputs, [n for n in body if any(u not in members for u in n.users)]


def layer_graph(body: list[fx.Node]) -> fx.Graph:
    """``body`` (one layer's nodes) as a graph of its own: its inputs the values it reads from
    before it, its outputs the values read after it; it reads its parameters itself."""
    inputs, outputs = _inputs_outputs(body)
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
    for n in body:
        for a in n.all_input_nodes:
            if a.op == "get_attr" and a not in env:
                env[a] = sub.get_attr(a.target)
        env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    return sub


def call_in_place(graph: fx.Graph, body: list[fx.Node], target: str, meta: dict) -> fx.Node:
    """Replace ``body`` in ``graph`` by one ``call_module(target)`` of its ``layer_graph`` with
    ``meta`` (its outputs unpacked by ``getitem`` where there are several); the reads of
    parameters only it read go too. Returns the call."""
    members = set(body)
    inputs, outputs = _inputs_outputs(body)
    read = {a for n in body for a in n.all_input_nodes if a.op == "get_attr"}
    with graph.inserting_after(body[-1]):
        call = graph.call_module(target, tuple(inputs))
    call.meta = dict(meta)
    if len(outputs) == 1:  # what the layer hands on has its shape (a later chunk reads sizes off it)
        call.meta["shape"] = outputs[0].meta.get("shape")
    results = [call]
    if len(outputs) > 1:
        results = []
        last = call
        for i, o in enumerate(outputs):
            with graph.inserting_after(last):
                last = graph.call_function(operator.getitem, (call, i))
            last.meta = {**call.meta, "shape": o.meta.get("shape")}
            results.append(last)
    for o, r in zip(outputs, results):
        o.replace_all_uses_with(r, delete_user_cb=lambda u: u not in members)
    for n in reversed(body):
        graph.erase_node(n)
    for a in [n for n in graph.nodes if n in read]:  # parameters only the layer read: its graph reads them now
        if not a.users:
            graph.erase_node(a)
    return call


def _checkpoint_call(gm: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), Checkpoint)


def layers_wrapped(gm: fx.GraphModule, ctx: RewriteContext) -> str | None:
    """``ensures`` of the pass: every layer that recomputes something is one Checkpoint call
    recomputing its stage's set (``ctx.recompute_of``), and nothing else computes in those
    layers; a layer that recomputes nothing is left as it was. Returns what is wrong, or None."""
    seen: set[int] = set()
    meta = input_meta_nodes(gm.graph)
    for node in gm.graph.nodes:
        if node.meta.get("region") != "layer" or node.op in ("get_attr", "placeholder", "output") or node in meta:
            continue
        wanted = sorted(ctx.recompute_of(node.meta.get("layer")))
        if _checkpoint_call(gm, node):
            if node.meta.get("layer") in seen:
                return f"layer {node.meta.get('layer')} has two checkpoint calls"
            seen.add(node.meta.get("layer"))
            recompute = gm.get_submodule(node.target).recompute
            if recompute != wanted:
                return f"{node.name} recomputes {recompute}, the plan {wanted}"
        elif wanted and not (node.target is operator.getitem and _checkpoint_call(gm, node.args[0])):
            return f"{node.format_node()} in layer {node.meta.get('layer')} is outside its checkpoint"
    return None
