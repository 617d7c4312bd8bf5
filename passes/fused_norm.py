"""Fused norms: replace the model's RMSNorm and LayerNorm by one op each (``rt.rms_norm``,
``rt.layer_norm``: ``autoshard.runtime.norms``), which computes in fp32 and keeps for backward only
its input as it came and the per-token statistics, as Megatron's fused norms do and as the cost
model counts (torch's, under autocast, keep an fp32 copy of the input, and written out on CPUs
also the fp32 normalised values).

Found as ``nn.RMSNorm`` / ``nn.LayerNorm`` module calls and ``F.rms_norm`` / ``F.layer_norm``
(``torch.*`` and ``aten.*`` alike, as fx and torch.export write them). The fused call takes torch's
signature, ``(x, normalized_shape, weight, [bias,] eps)``, so that every later pass reads it as the
norm it replaces; a module's parameters are read as attributes. A norm written out of elementwise
ops (transformers' ``LlamaRMSNorm``) stays as it is.

Requires the canonical graph's ``op``; guarantees (:func:`no_torch_norm_left`) that no torch norm
call is left.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn

from autoshard.passes._graph import note, place
from autoshard.passes.contract import RewriteContext
from autoshard.runtime import norms

aten = torch.ops.aten
_RMS = {F.rms_norm, getattr(torch, "rms_norm", F.rms_norm), aten.rms_norm.default}
_LN = {F.layer_norm, torch.layer_norm, aten.layer_norm.default}
_MODULES = {nn.RMSNorm: norms.rms_norm, nn.LayerNorm: norms.layer_norm}


def _module_call(node: fx.Node, gm: fx.GraphModule) -> tuple | None:
    """(fused function, args) for a norm module's call."""
    module = gm.get_submodule(node.target)
    fused = _MODULES.get(type(module))
    if fused is None or len(node.args) != 1 or node.kwargs:
        return None
    params = []
    names = ("weight",) if fused is norms.rms_norm else ("weight", "bias")
    for name in names:
        p = getattr(module, name, None)
        if p is None:
            params.append(None)
            continue
        a = node.graph.get_attr(f"{node.target}.{name}")
        params.append(place(a, node, shape=tuple(p.shape), dtype=p.dtype, requires_grad=p.requires_grad, is_param=True))
    return fused, (node.args[0], tuple(module.normalized_shape), *params, module.eps)


def _function_call(node: fx.Node) -> tuple | None:
    if node.target in _RMS:
        fused, names = norms.rms_norm, ("input", "normalized_shape", "weight", "eps")
    elif node.target in _LN:
        fused, names = norms.layer_norm, ("input", "normalized_shape", "weight", "bias", "eps")
    else:
        return None
    values = list(node.args) + [None] * (len(names) - len(node.args))
    for i, name in enumerate(names):
        if name in node.kwargs:
            values[i] = node.kwargs[name]
    extra = set(node.kwargs) - set(names)
    if extra or len(node.args) > len(names):  # e.g. cudnn_enable of aten.layer_norm: the default only
        if extra != {"cudnn_enable"} and len(node.args) <= len(names):
            return None
        values = values[: len(names)]
    if fused is norms.layer_norm and values[4] is None:
        values[4] = 1e-5
    return fused, tuple(values)


def fused_norm(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    """Rewrite ``gm`` in place; a comment per fused norm goes to its ``meta["note"]``."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_module":
            with graph.inserting_before(node):
                found = _module_call(node, gm)
        elif node.op == "call_function":
            found = _function_call(node)
        else:
            continue
        if found is None:
            continue
        fused, args = found
        with graph.inserting_before(node):
            new = graph.call_function(fused, args)
        place(new, node, **node.meta)  # the same tensor as the norm it replaces (its storage, cost, TP state)
        note(new, "fused norm: fp32 inside, keeps its input and the per-token statistics for backward")
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


def no_torch_norm_left(gm: fx.GraphModule, ctx: RewriteContext) -> str | None:
    """Ensured: no RMSNorm / LayerNorm module or function call is left (each is ``rt.*_norm``)."""
    for node in gm.graph.nodes:
        torch_norm = node.op == "call_function" and (node.target in _RMS or node.target in _LN)
        if torch_norm and _function_call(node) is not None:
            return f"{node.name} still calls {node.target}"
        if node.op == "call_module" and type(gm.get_submodule(node.target)) in _MODULES and not node.kwargs:
            return f"{node.name} still calls the {type(gm.get_submodule(node.target)).__name__} module"
    return None
