"""Per-node forward cost, symbolic in batch ``b`` and sequence ``s``: FLOPs by the op table's
``flops`` column (``autoshard.ir.ops``), bytes moved by the node's tensors at the training dtype."""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
from torch import fx

from autoshard.ir.ops import call_args, numel, rule, tensor_args


@dataclass(frozen=True)
class NodeCost:
    """Forward cost of one node. ``flops`` and ``bytes_moved`` are sympy expressions in b, s;
    bytes count floating tensors at ``float_bytes`` per element (the training compute dtype)."""

    flops: sympy.Expr
    bytes_moved: sympy.Expr


ZERO_COST = NodeCost(sympy.Integer(0), sympy.Integer(0))


def elem_bytes(dtype: torch.dtype | None, float_bytes: int) -> int:
    if dtype is None:
        return 0
    if dtype.is_floating_point:
        return float_bytes
    return torch.empty((), dtype=dtype).element_size() if dtype != torch.bool else 1


def matmul_flops(node: fx.Node, gm: fx.GraphModule) -> sympy.Expr:
    out = node.meta["shape"]
    name = node.meta["op"]
    if node.op == "call_module":
        k = gm.get_submodule(node.target).in_features
    elif name == "einsum":
        return _einsum_flops(node)
    else:
        first = tensor_args(node)[1 if name in ("addmm", "baddbmm") else 0]
        k = first.meta["shape"][-1]
    return 2 * numel(out) * k


def _einsum_flops(node: fx.Node) -> sympy.Expr:
    equation = node.args[0].replace(" ", "")
    inputs = equation.split("->")[0].split(",")
    sizes = {}
    for letters, operand in zip(inputs, tensor_args(node)):
        sizes.update(zip(letters, operand.meta["shape"]))
    return 2 * numel(sizes.values())


def sdpa_flops(node: fx.Node) -> sympy.Expr:
    q, k, v = tensor_args(node)[:3]
    *lead, sq, d = q.meta["shape"]
    sk, dv = k.meta["shape"][-2], v.meta["shape"][-1]
    flops = 2 * numel(lead) * sq * sk * (d + dv)
    if call_args(node).get("is_causal", True):  # cp_attention is always causal
        flops = flops / 2
    return flops


def node_cost(node: fx.Node, gm: fx.GraphModule, float_bytes: int = 2) -> NodeCost:
    r = rule(node.meta.get("op", ""))
    shape = node.meta.get("shape")
    if r is None or shape is None or r.alias:
        return ZERO_COST
    out = numel(shape)
    if r.flops == "matmul":
        flops = matmul_flops(node, gm)
    elif r.flops == "sdpa":
        flops = sdpa_flops(node)
    elif r.flops in ("reduce", "loss"):
        ins = tensor_args(node)
        flops = (numel(ins[0].meta["shape"]) if ins else out) * r.flops_per_elem
    elif r.flops in ("pointwise", "norm"):
        flops = out * r.flops_per_elem
    else:
        flops = sympy.Integer(0)
    moved = out * elem_bytes(node.meta.get("dtype"), float_bytes)
    for a in tensor_args(node):
        moved += numel(a.meta["shape"]) * elem_bytes(a.meta.get("dtype"), float_bytes)
    if node.op == "call_module" and r.op_class != "embedding":  # a lookup reads rows, not the table
        for p in gm.get_submodule(node.target).parameters():
            moved += p.numel() * float_bytes
    elif r.op_class == "embedding":
        moved -= sum((numel(a.meta["shape"]) * float_bytes for a in tensor_args(node) if a.op == "get_attr"), 0)
    return NodeCost(sympy.sympify(flops), sympy.sympify(moved))
