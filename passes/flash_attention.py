"""Flash attention: replace attention in the traced graph by one fused call (``rt.fused_attention``: the
Triton kernel on GPUs, PyTorch's fused attention on CPUs).

Found two ways: calls of ``scaled_dot_product_attention`` without a mask or dropout, and the
written-out pattern ``softmax(q @ k^T * c [masked_fill(m, -inf)]) [dropout p=0] @ v`` whose mask
``m`` is causal: marked so by canonicalisation (``meta["causal"]``, however ``m`` is built: nanoGPT's
``bias[:, :, :T, :T] == 0``), or ``triu(ones(s, s), 1)``. The read of a buffer the mask came from
stays: the buffer is part of the model's state, which the program keeps and saves.
Attention with dropout > 0, an arbitrary mask or a bias is left alone (the kernel has none of them).
Which calls are SDPA is the op table's ``signature`` (``autoshard.ir.ops``), whose layout
``ops.call_args`` reads.
"""

from __future__ import annotations

import math

from torch import fx

from autoshard import runtime
from autoshard.ir import ops
from autoshard.passes._graph import note, place
from autoshard.passes._graph import op_name as _op
from autoshard.passes.contract import RewriteContext


def _arg(node: fx.Node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _inherit(new: fx.Node, old: fx.Node) -> fx.Node:
    return place(new, old, **{k: v for k, v in old.meta.items() if k not in ("op", "op_class")})


def _sdpa(node: fx.Node) -> bool:
    row = ops.rule_of(node)
    return node.op == "call_function" and row is not None and row.signature == "sdpa"


def _fusable(node: fx.Node) -> bool:
    """An SDPA call the kernel runs: no mask, no dropout."""
    args = ops.call_args(node)
    return args["attn_mask"] is None and args["dropout_p"] in (0, 0.0)


def _replace_sdpa(graph: fx.Graph, node: fx.Node) -> bool:
    if not _fusable(node):
        return False
    args = ops.call_args(node)
    causal, scale = bool(args["is_causal"]), args["scale"]
    q, k, v = args["query"], args["key"], args["value"]
    with graph.inserting_after(node):
        new = _inherit(graph.call_function(runtime.fused_attention, (q, k, v, causal, scale)), node)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    note(new, f"flash attention ({'causal' if causal else 'full'}): Triton kernel on GPUs")
    return True


def _causal_mask(mask: fx.Node) -> bool:
    """``ones(s, s).triu(1)`` (or ``new_ones``): True above the diagonal."""
    return _op(mask) == "triu" and _arg(mask, 1, "diagonal", 0) == 1 and _op(mask.args[0]) in ("new_ones", "ones")


def _replace_pattern(graph: fx.Graph, out: fx.Node) -> bool:
    """``out = probs @ v`` where probs = softmax(scores[, causal mask]) [dropout p=0]."""
    probs, v = out.args[0], out.args[1]
    if _op(probs) == "dropout":
        if _arg(probs, 1, "p", 0.5) not in (0, 0.0) or len(probs.users) != 1:
            return False
        probs = probs.args[0]
    if _op(probs) != "softmax" or _arg(probs, 1, "dim") not in (-1, 3) or len(probs.users) != 1:
        return False
    scores, causal = probs.args[0], False
    if _op(scores) == "masked_fill":
        causal_fill = scores.meta.get("causal") or _causal_mask(scores.args[1])
        if not (causal_fill and scores.args[2] == float("-inf")) or len(scores.users) != 1:
            return False
        scores, causal = scores.args[0], True
    scale = 1.0
    if _op(scores) in ("mul", "truediv", "div") and isinstance(scores.args[1], (int, float)):
        scale = scores.args[1] if _op(scores) == "mul" else 1.0 / scores.args[1]
        if len(scores.users) != 1:
            return False
        scores = scores.args[0]
    if _op(scores) != "matmul" or len(scores.users) != 1:
        return False
    q, kt = scores.args
    if _op(kt) != "transpose" or sorted(int(d) % 4 for d in kt.args[1:3]) != [2, 3]:
        return False
    k = kt.args[0]
    shape = q.meta.get("shape")
    if shape is not None and len(shape) == 4 and isinstance(shape[-1], int):
        default = 1.0 / math.sqrt(shape[-1])
        scale_arg = None if math.isclose(scale, default, rel_tol=1e-12) else scale
    else:
        scale_arg = scale
    with graph.inserting_after(out):
        new = _inherit(graph.call_function(runtime.fused_attention, (q, k, v, causal, scale_arg)), out)
    out.replace_all_uses_with(new)
    _erase_chain(graph, out)
    note(new, f"flash attention ({'causal' if causal else 'full'}) in place of the written-out softmax(QK^T)V")
    return True


def _erase_chain(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and, transitively, the inputs it leaves without users (the old pattern)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.users or n.op in ("placeholder", "get_attr", "output"):
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        stack.extend(inputs)


def flash_attention(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    """Rewrite ``gm`` in place; a comment per fused attention goes to its ``meta["note"]``."""
    graph = gm.graph
    for node in list(graph.nodes):
        if getattr(node, "_erased", False) or node.op != "call_function":
            continue
        if _sdpa(node):
            _replace_sdpa(graph, node)
        elif _op(node) == "matmul":
            _replace_pattern(graph, node)
    graph.lint()
    gm.recompile()
    return gm


def no_fusable_sdpa_left(gm: fx.GraphModule, ctx: RewriteContext) -> str | None:
    """Ensured: every SDPA call without a mask or dropout became ``fused_attention``."""
    for node in gm.graph.nodes:
        if _sdpa(node) and _fusable(node):
            return f"{node.name} is still scaled_dot_product_attention"
    return None
