"""FP8 matmuls: every weighted matmul of a kind the plan runs in FP8 (``plan.precision
["fp8_matmuls"]``, kinds from ``autoshard.ir.MATMUL_KINDS`` that the analysis wrote on each one as
``node.meta["matmul_kind"]``) becomes a call of ``autoshard.runtime.fp8``, whose forward quantises
the input in 1x128 tiles and the weight in 128x128 blocks to E4M3 and multiplies with fp32
accumulation, and whose backward runs the input-gradient and weight-gradient GEMMs the same way.

The forms rewritten (what capture, canonicalisation and the other passes leave):

``nn.Linear`` module call, ``F.linear(x, w, b)``                   -> ``rt.fp8_linear(x, w, b)``
``x @ w``, ``torch.matmul`` / ``mm`` / ``bmm`` by a weight, or as methods -> ``rt.fp8_matmul(x, w)``
``torch.addmm(b, x, w)`` by a weight (``Conv1D``)                   -> ``rt.fp8_addmm(b, x, w)``
``rt.moe_grouped_mm(rows, w, offs)``                               -> ``rt.fp8_grouped_mm(rows, w, offs)``

Which form an op takes is the op table's ``fp8`` column (``autoshard.ir.ops``), read by the
node's ``meta["op"]``.

It runs after tensor, sequence and expert parallelism, so it rewrites each rank's local product
(its TP slice of a weight, its EP rank's experts): the scaling groups are cut out of what the rank
holds. Activation checkpointing wraps the rewritten calls like any other op. Matmuls of the other
kinds (the router, the output head unless the plan says so) and the attention core are left as
they are; a weighted matmul of an FP8 kind in a form not listed (a product by per-token gathered
expert weights) stays in the compute precision, and the emitted line says so.

Under selective recomputation, a call whose input is of a category the plan keeps as FP8 copies
(``plan.precision["fp8_saved"]``, ``ModelCost.fp8_saved``) gets ``keep_fp8=True``: the layer's
checkpoint keeps that quantisation and recomputes the input (``runtime.checkpoint``). So does
every experts' GEMM where the plan keeps the experts: what they multiply (the dispatched rows, the
activations' product) is made by ops the checkpoint does not cache, and the cost model counts
their FP8 copies kept.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from autoshard.ir import ops
from autoshard.ir.categories import saved_category
from autoshard.passes._graph import note, place
from autoshard.passes.contract import RewriteContext, decisions
from autoshard.runtime import fp8 as runtime_fp8
from autoshard.runtime import moe

aten = torch.ops.aten
_EXCHANGES = {  # the experts' all-to-alls: the direction that reaches the experts goes in FP8
    moe.dispatch: "fp8: the routed rows go in 1x128 e4m3 tiles (half the bytes), as the experts multiply them",
    moe.dispatch_buffer: "fp8: the routed rows go in 1x128 e4m3 tiles (half the bytes), as the experts multiply them",
    moe.combine: "fp8: its gradient goes back to the experts in 1x128 e4m3 tiles; the rows come in bf16",
    moe.combine_buffer: "fp8: its gradient goes back to the experts in 1x128 e4m3 tiles; the rows come in bf16",
}
_WHAT = "x 1x128 e4m3, w 128x128 e4m3, fp32 accumulate; dX, dW GEMMs in e4m3 too"


def _weight_arg(node: fx.Node) -> bool:
    """The right operand is a weight (parameter, view of one) and the left one is not."""
    x, w = node.args[0], node.args[1]
    return (
        isinstance(w, fx.Node)
        and ops.is_weight(w)
        and not ops.expert_rows(w)
        and isinstance(x, fx.Node)
        and not ops.is_weight(x)
    )


def _rewrite(node: fx.Node, gm: fx.GraphModule) -> fx.Node | str:
    """Rewrite one matmul: the FP8 call that replaces it, else why it was left as it is."""
    row = ops.rule_of(node)
    form = row.fp8 if row is not None and node.op in ("call_function", "call_method", "call_module") else None
    if form == "linear":
        return _linear_module(node, gm) if node.op == "call_module" else _retarget(node, runtime_fp8.fp8_linear)
    if form == "product":
        return _product(node)
    if form == "addmm":
        return _addmm(node)
    if form == "grouped" and node.target is moe.grouped_mm:
        return _retarget(node, runtime_fp8.fp8_grouped_mm)
    if node.op == "call_module":
        return f"a {type(gm.get_submodule(node.target)).__name__} module call"
    return "a form the FP8 pass does not rewrite"


def _retarget(node: fx.Node, target) -> fx.Node:
    node.op, node.target = "call_function", target
    return node


def _linear_module(node: fx.Node, gm: fx.GraphModule) -> fx.Node | str:
    """An ``nn.Linear`` module call -> ``rt.fp8_linear(x, weight, bias)`` reading its parameters."""
    graph = gm.graph
    module = gm.get_submodule(node.target)
    if type(module) is not nn.Linear or len(node.args) != 1 or node.kwargs:
        return f"a {type(module).__name__} module call"
    with graph.inserting_before(node):
        args = [node.args[0]]
        for name in ("weight", "bias"):
            p = getattr(module, name)
            if p is not None:
                a = graph.get_attr(f"{node.target}.{name}")
                args.append(place(a, node, shape=tuple(p.shape), dtype=p.dtype, requires_grad=True, is_param=True))
        new = graph.call_function(runtime_fp8.fp8_linear, tuple(args))
    place(new, node, **{k: node.meta[k] for k in ("op", "op_class", "matmul_kind", "cost") if k in node.meta})
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


def _product(node: fx.Node) -> fx.Node | str:
    """``x @ w`` by a 2-d weight, or a batched product by stacked weights -> ``rt.fp8_matmul``."""
    if node.kwargs or len(node.args) != 2 or not _weight_arg(node):
        return "the weight is not the right operand"
    w = node.args[1].meta.get("shape") or ()
    x = node.args[0].meta.get("shape") or ()
    batched = node.meta.get("op") == "bmm" or (len(x) == 3 and x[0] == w[0])
    if len(w) == 3 and not (len(x) == 3 and batched):
        return "a broadcast product by stacked weights"
    if len(w) not in (2, 3):
        return f"a {len(w)}-d weight"
    return _retarget(node, runtime_fp8.fp8_matmul)


def _addmm(node: fx.Node) -> fx.Node | str:
    """``addmm(bias, x, w)`` by a weight -> ``rt.fp8_addmm``."""
    if node.kwargs or len(node.args) != 3:
        return "an addmm with beta or alpha"
    x, w = node.args[1], node.args[2]
    if not (isinstance(w, fx.Node) and ops.is_weight(w) and isinstance(x, fx.Node) and not ops.is_weight(x)):
        return "the weight is not the right operand"
    return _retarget(node, runtime_fp8.fp8_addmm)


def fp8(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    kinds = set(ctx.fp8)
    for node in list(gm.graph.nodes):
        if "experts" in kinds and node.op == "call_function" and node.target in _EXCHANGES:
            node.kwargs = {**node.kwargs, "fp8": True}
            note(node, _EXCHANGES[node.target])
            continue
        kind = node.meta.get("matmul_kind")
        if kind not in kinds:
            continue
        done = _rewrite(node, gm)
        if isinstance(done, fx.Node):
            text = f"fp8 ({kind}): {_WHAT}"
            layer = node.meta.get("layer")
            if _input_category(done) in ctx.fp8_saved_of(layer) or _experts_copy(kind, ctx.recompute_of(layer)):
                done.kwargs = {**done.kwargs, "keep_fp8": True}
                text += "; recomputation keeps x's fp8 copy, not x"
            if done is not node and "note" in node.meta:  # a module call replaced: its note moves
                done.meta["note"] = node.meta["note"]
            note(done, text)
            decisions(gm).fp8_params.extend(_weights(done))
        else:
            note(node, f"fp8 plan, left in the compute precision: {done}")
            node.meta["fp8_left"] = done
    gm.graph.lint()
    gm.recompile()
    return gm


def _experts_copy(kind: str, recompute: tuple[str, ...]) -> bool:
    """An FP8 experts' GEMM under selective recomputation that keeps the experts: it keeps its
    input's FP8 copy (``ModelCost.activation_bytes``). What the experts multiply is made by ops the
    checkpoint does not cache (the dispatch, a product of activations): without the copy the
    recomputation ran them again, the dispatch's all-to-all with them."""
    return kind == "experts" and bool(recompute) and "experts" not in recompute


def _input_category(node: fx.Node) -> str | None:
    """The checkpoint category (``ir.categories.saved_category``) of the activation an FP8
    call keeps for backward, found as the analysis found it: by the op that made its storage
    (views share their base's). None for a value a pass made (no storage recorded: a TP gather,
    an expert dispatch), whose FP8 copy is then never what recomputation keeps."""
    x = node.args[1] if node.target is runtime_fp8.fp8_addmm else node.args[0]
    if not isinstance(x, fx.Node) or x.meta.get("storage") is None:
        return None
    root, storage = x, x.meta["storage"]
    while (up := next((a for a in root.all_input_nodes if a.meta.get("storage") == storage), None)) is not None:
        root = up
    external = root.op == "placeholder" or root.meta.get("layer") != node.meta.get("layer")
    return saved_category(root, node, external)


def _weights(node: fx.Node) -> list[str]:
    """The parameters (get_attr targets) the FP8 call multiplies by."""
    w = node.args[2] if node.target is runtime_fp8.fp8_addmm else node.args[1]
    while isinstance(w, fx.Node) and w.op != "get_attr":
        w = w.args[0] if w.args else None
    return [w.target] if isinstance(w, fx.Node) else []


def fp8_calls_only(gm: fx.GraphModule, ctx: RewriteContext) -> str | None:
    """No weighted matmul of an FP8 kind is left in the compute precision unexplained."""
    kinds = set(ctx.fp8)
    for node in gm.graph.nodes:
        if node.meta.get("matmul_kind") in kinds and node.target not in _FP8_CALLS and "fp8_left" not in node.meta:
            return f"{node.name} ({node.meta['matmul_kind']}) is still a compute-precision matmul"
    return None


_FP8_CALLS = (runtime_fp8.fp8_linear, runtime_fp8.fp8_matmul, runtime_fp8.fp8_addmm, runtime_fp8.fp8_grouped_mm)

__all__ = ["fp8", "fp8_calls_only"]
