"""Activation checkpointing: each repeated layer becomes one call to ``rt.Checkpoint``, which
recomputes in backward the saved-tensor kinds the plan marks ``recompute``.

Runs after the parallel rewrites and before the pipeline split. A layer's nodes are moved into
their own graph (inputs: the values it reads from before it; outputs: the values read after it),
called as ``checkpoint_L(*inputs)``. The layer's parameters stay attributes of ``gm``; the reads of
those only the layer used (``get_attr``, as torch.export writes parameters) move into its graph.

Requires ``region`` and ``layer`` on every node and reads ``ctx.recompute`` and ``ctx.fp8_saved``
(the kept categories held as FP8 copies: the FP8 pass marked their quantisations ``keep_fp8``). Guarantees
(:func:`layers_wrapped`): the only computing nodes left in the ``layer`` region are one
``Checkpoint`` call per layer, recomputing exactly ``ctx.recompute``, and the ``getitem`` s that
unpack its outputs (besides reads of a model input's size or device and integer arithmetic on
them, read off nothing the layer computes, which belong to no layer); each call carries the
layer's ``region``, ``layer`` and ``source``, with ``op`` ``"checkpoint"``, and a note in
``ctx.notes``. Nothing else in the graph changes.
"""

from __future__ import annotations

import operator

from torch import fx

from autoshard.passes.contract import RewriteContext
from autoshard.passes.pipeline_split import input_meta_nodes
from autoshard.runtime.checkpoint import Checkpoint


def activation_checkpoint(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    """Wrap every layer of ``gm`` in place (nothing when ``ctx.recompute`` is empty); returns ``gm``."""
    recompute = list(ctx.recompute)
    if not recompute:
        return gm
    notes = ctx.notes
    graph = gm.graph
    # a model input's size or device and arithmetic on its sizes, read off nothing the layer
    # computes, belong to no layer: the layers reading one take it as an input, and the pipeline
    # split recomputes it in each chunk reading it (inside a layer, one a later layer reads would
    # be handed on between stages, which send tensors only: transformers' MoE blocks compute
    # batch * sequence once for every layer)
    meta = input_meta_nodes(graph)
    layers: dict[int, list[fx.Node]] = {}
    members: dict[int, set[fx.Node]] = {}
    for node in graph.nodes:
        if node.meta.get("region") == "layer" and node.meta.get("layer") is not None and node.op != "get_attr":
            layer = node.meta["layer"]
            mine = members.setdefault(layer, set())
            if node in meta and not any(a in mine for a in node.all_input_nodes):
                continue
            layers.setdefault(layer, []).append(node)
            mine.add(node)
    for layer, body in sorted(layers.items()):
        members = set(body)
        inputs: list[fx.Node] = []
        for n in body:
            for a in n.all_input_nodes:
                if a not in members and a not in inputs and a.op != "get_attr":
                    inputs.append(a)
        outputs = [n for n in body if any(u not in members for u in n.users)]
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
        fn = fx.GraphModule(gm, sub, class_name=f"Layer{layer}")
        name = f"checkpoint_{layer}"
        gm.add_submodule(name, Checkpoint(fn, recompute, ctx.fp8_saved))
        anchor = body[-1]
        with graph.inserting_after(anchor):
            call = graph.call_module(name, tuple(inputs))
        call.meta = {k: anchor.meta[k] for k in ("region", "layer", "nn_module_stack", "source") if k in anchor.meta}
        call.meta["op"] = "checkpoint"
        if len(outputs) == 1:  # what the layer hands on has its shape (a later chunk reads sizes off it)
            call.meta["shape"] = outputs[0].meta.get("shape")
        notes[call.name] = f"layer {layer} under activation checkpointing: recompute {', '.join(sorted(recompute))}" + (
            f"; keep {', '.join(ctx.fp8_saved)} as fp8 copies" if ctx.fp8_saved else ""
        )
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
            o.replace_all_uses_with(r, delete_user_cb=lambda u, m=members: u not in m)
        for n in reversed(body):
            graph.erase_node(n)
        for a in env:  # parameters only the layer read: its graph reads them now
            if a.op == "get_attr" and not a.users:
                graph.erase_node(a)
    graph.lint()
    gm.recompile()
    return gm


def _checkpoint_call(gm: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), Checkpoint)


def layers_wrapped(gm: fx.GraphModule, ctx: RewriteContext) -> str | None:
    """``ensures`` of the pass: every layer is one Checkpoint call recomputing ``ctx.recompute``,
    and nothing else computes in the layers. Returns what is wrong, or None."""
    seen: set[int] = set()
    meta = input_meta_nodes(gm.graph)
    for node in gm.graph.nodes:
        if node.meta.get("region") != "layer" or node.op in ("get_attr", "placeholder", "output") or node in meta:
            continue
        if _checkpoint_call(gm, node):
            if node.meta.get("layer") in seen:
                return f"layer {node.meta.get('layer')} has two checkpoint calls"
            seen.add(node.meta.get("layer"))
            recompute = gm.get_submodule(node.target).recompute
            if recompute != sorted(ctx.recompute):
                return f"{node.name} recomputes {recompute}, the plan {sorted(ctx.recompute)}"
        elif not (node.target is operator.getitem and _checkpoint_call(gm, node.args[0])):
            return f"{node.format_node()} in layer {node.meta.get('layer')} is outside its checkpoint"
    return None
