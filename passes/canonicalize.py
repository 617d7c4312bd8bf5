"""Canonicalize: one form of the traced graph, whichever tracer produced it.

``torch.fx.symbolic_trace`` and ``torch.export`` trace the same training forward into different
graphs: export adds checks of the example inputs and records the capture's device (meta) as a
constant. Capture runs :func:`canonicalize` right after tracing, before it annotates anything, so
that the cost model, the planner and every pass read the same kind of graph and none of them
cleans up after a tracer.
"""

from __future__ import annotations

import torch
from torch import fx

GUARDS = "_guards_fn"  # torch.export's submodule that checks the inputs against its shape guards


_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata  # export checks dtypes at run time; a no-op here


def canonicalize(gm: fx.GraphModule) -> fx.GraphModule:
    """Bring a freshly traced ``gm`` into canonical form, in place, and return it.

    Requires: ``gm`` is a traced training forward (``autoshard.capture.trace``) with at least one
    placeholder, the model inputs first among them. Nothing is read from ``node.meta``.

    Guarantees:

    - no ``_guards_fn`` call or submodule: torch.export's check of the inputs' shapes against the
      guards it derived (the emitted program's inputs differ from the example's, by design);
    - no ``_assert_tensor_metadata`` node: export's checks that a tensor has the dtype and the
      device (meta) it had while tracing;
    - no ``torch.device("meta")`` among any node's arguments: a factory call or ``.to`` that
      export recorded with the capture's device reads the device of the first model input
      instead, from one ``getattr(input, "device")`` node after the placeholders, so the graph
      runs wherever its inputs are;
    - every other node, its arguments and its ``meta`` are as traced (a graph already canonical,
      as ``symbolic_trace`` of a model without device constants gives, is left unchanged).
    """
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.users:
            continue
        if (node.op == "call_module" and node.target == GUARDS) or (
            node.op == "call_function" and getattr(node.target, "overloadpacket", None) is _ASSERT_METADATA
        ):
            graph.erase_node(node)
            changed = True
    if hasattr(gm, GUARDS) and not any(n.op == "call_module" and n.target == GUARDS for n in graph.nodes):
        gm.delete_submodule(GUARDS)
    changed |= _inputs_device(graph)
    if changed:
        graph.lint()
        gm.recompile()
    return gm


def _is_meta(x) -> bool:
    return isinstance(x, torch.device) and x.type == "meta"


def _inputs_device(graph: fx.Graph) -> bool:
    """Replace the meta-device constants by the first input's device; whether any was found."""
    device = None
    for node in list(graph.nodes):
        if not (any(_is_meta(a) for a in node.args) or any(_is_meta(v) for v in node.kwargs.values())):
            continue
        if device is None:
            placeholders = [p for p in graph.nodes if p.op == "placeholder"]
            with graph.inserting_after(placeholders[-1]):
                device = graph.call_function(getattr, (placeholders[0], "device"))
        node.args = tuple(device if _is_meta(a) else a for a in node.args)
        node.kwargs = {k: device if _is_meta(v) else v for k, v in node.kwargs.items()}
    return device is not None
