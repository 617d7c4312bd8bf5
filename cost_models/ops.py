"""What autoshard knows about each op, in one table.

A row says, for one normalised op name: its op class, how to count its forward FLOPs, what
autograd keeps for backward, whether its output aliases its first input, and how a tensor-parallel
shard of the hidden/head dimension passes through it. Supporting a new op is a new row.

Saved-tensor codes (``OpRule.saves``):
  ``partner``  bilinear ops (mul, matmul, linear): each operand is kept when the other needs a
               gradient (so ``linear`` keeps its input, never its weight as an activation);
  ``in0``/``in1`` a given input; ``out`` the output; ``mask`` one byte per output element
               (dropout, when active); ``sdpa`` q, k, v, output and the fp32 log-sum-exp;
  ``logprobs`` fp32 log-probabilities of the logits (cross-entropy).
TP codes (``OpRule.tp``): ``pointwise`` and ``view`` let a shard of heads or hidden units pass;
``opaque`` (norms, reductions over features, routing, loss) does not.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import sympy
import torch
from torch import fx

from autoshard.ir import B, S


@dataclass(frozen=True)
class OpRule:
    op_class: str
    flops: str = "zero"  # zero | pointwise | matmul | sdpa | reduce | norm | loss
    saves: tuple[str, ...] = ()
    alias: bool = False
    tp: str = "opaque"
    flops_per_elem: int = 1


_VIEW = OpRule("other", alias=True, tp="view")
_COPY = OpRule("other", tp="view")
_ZERO = OpRule("other")


def _pw(saves: tuple[str, ...] = (), per_elem: int = 1) -> OpRule:
    return OpRule("elementwise", "pointwise", saves, tp="pointwise", flops_per_elem=per_elem)


_MATMUL = OpRule("matmul", "matmul", ("partner",), tp="pointwise")
_NORM = OpRule("norm", "norm", ("in0",), flops_per_elem=5)
_SDPA = OpRule("attention", "sdpa", ("sdpa",), tp="pointwise")

RULES: dict[str, OpRule] = {
    # matrix products
    **dict.fromkeys(["linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum"], _MATMUL),
    **dict.fromkeys(["_grouped_mm", "grouped_mm", "grouped_mm_fallback"], _MATMUL),
    # fused attention
    **dict.fromkeys(
        [
            "scaled_dot_product_attention",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
        ],
        _SDPA,
    ),
    # normalisation
    **dict.fromkeys(["layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"], _NORM),
    "group_norm": _NORM,
    "embedding": OpRule("embedding", saves=("in0",)),
    **dict.fromkeys(
        ["cross_entropy", "cross_entropy_loss", "nll_loss", "nll_loss_nd"],
        OpRule("loss", "loss", ("logprobs",), flops_per_elem=4),
    ),
    # pointwise arithmetic
    **dict.fromkeys(["add", "sub", "rsub", "neg", "iadd", "add_", "sub_", "clamp"], _pw()),
    **dict.fromkeys(["mul", "mul_", "imul", "div", "truediv", "div_", "floordiv"], _pw(("partner",))),
    **dict.fromkeys(["gelu", "silu", "pow", "log", "square", "abs", "sin", "cos"], _pw(("in0",), 4)),
    **dict.fromkeys(["exp", "sigmoid", "tanh", "relu", "rsqrt", "sqrt", "reciprocal"], _pw(("out",), 4)),
    **dict.fromkeys(
        ["softmax", "_softmax", "log_softmax", "_log_softmax"],
        OpRule("elementwise", "pointwise", ("out",), flops_per_elem=5),
    ),
    "dropout": OpRule("elementwise", "pointwise", ("mask",), tp="pointwise"),
    "native_dropout": OpRule("elementwise", "pointwise", ("mask",), tp="pointwise"),
    **dict.fromkeys(["masked_fill", "masked_fill_"], _pw(("in1",))),
    "where": _pw(("in0",)),
    **dict.fromkeys(["to", "float", "half", "bfloat16", "type_as", "_to_copy", "contiguous", "clone"], _pw()),
    **dict.fromkeys(["eq", "ne", "lt", "le", "gt", "ge", "logical_not", "invert", "bitwise_not"], _pw()),
    # reductions and routing (a feature shard cannot pass through them)
    **dict.fromkeys(
        ["sum", "mean", "amax", "max", "min", "norm", "var", "std", "cumsum", "prod"], OpRule("elementwise", "reduce")
    ),
    **dict.fromkeys(["topk", "sort", "argsort", "argmax", "histc", "bincount"], OpRule("other", "reduce")),
    # indexing: moves data, keeps integer indices for backward
    **dict.fromkeys(["index_select", "gather", "index"], OpRule("other", saves=("in2",))),
    "index_add": OpRule("other", saves=("in2",)),
    **dict.fromkeys(["scatter", "scatter_add", "index_put", "index_put_", "index_copy"], _ZERO),
    # views and copies
    **dict.fromkeys(
        [
            "view",
            "reshape",
            "_unsafe_view",
            "transpose",
            "permute",
            "t",
            "expand",
            "expand_as",
            "unsqueeze",
            "squeeze",
            "flatten",
            "unflatten",
            "split",
            "split_with_sizes",
            "chunk",
            "unbind",
            "getitem",
            "narrow",
            "select",
            "slice",
            "alias",
            "detach",
            "view_as",
            "as_strided",
        ],
        _VIEW,
    ),
    **dict.fromkeys(
        [
            "cat",
            "concat",
            "stack",
            "repeat",
            "repeat_interleave",
            "pad",
            "constant_pad_nd",
            "tril",
            "triu",
            "flip",
            "roll",
        ],
        _COPY,
    ),
    **dict.fromkeys(
        [
            "zeros",
            "ones",
            "full",
            "empty",
            "arange",
            "zeros_like",
            "ones_like",
            "full_like",
            "empty_like",
            "new_zeros",
            "new_ones",
            "new_full",
            "new_empty",
            "outer",
            "one_hot",
            "rand",
            "randn",
            "randint",
            "lift_fresh_copy",
        ],
        _ZERO,
    ),
    **dict.fromkeys(
        ["size", "sym_size", "dim", "getattr", "numel", "_assert_tensor_metadata", "sym_numel", "_guards_fn"], _ZERO
    ),
}

# Modules torch.fx keeps as leaves (torch.nn's own), by class name.
MODULE_OPS = {
    "Linear": "linear",
    "Embedding": "embedding",
    "LayerNorm": "layer_norm",
    "RMSNorm": "rms_norm",
    "GroupNorm": "group_norm",
    "Dropout": "dropout",
    "GELU": "gelu",
    "SiLU": "silu",
    "ReLU": "relu",
    "Tanh": "tanh",
    "Sigmoid": "sigmoid",
    "Softmax": "softmax",
    "Identity": "alias",
    "CrossEntropyLoss": "cross_entropy",
}
RULES["alias"] = _VIEW

_FUNCTION_NAMES = {
    operator.add: "add",
    operator.mul: "mul",
    operator.sub: "sub",
    operator.truediv: "div",
    operator.floordiv: "floordiv",
    operator.neg: "neg",
    operator.getitem: "getitem",
    operator.pow: "pow",
    operator.matmul: "matmul",
    getattr: "getattr",
}


def op_name(node: fx.Node, gm: fx.GraphModule) -> str:
    """Normalised name of what ``node`` computes, the key of ``RULES``."""
    if node.op in ("placeholder", "get_attr", "output"):
        return node.op
    if node.op == "call_module":
        kind = type(gm.get_submodule(node.target)).__name__
        return MODULE_OPS.get(kind, f"module:{kind}")
    if node.op == "call_method":
        return node.target
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.__name__
    return _FUNCTION_NAMES.get(target, getattr(target, "__name__", str(target)))


def rule(name: str) -> OpRule | None:
    if name in RULES:
        return RULES[name]
    if "grouped_mm" in name:
        return _MATMUL
    return None


# ---------------------------------------------------------------------------------------------
# Per-node cost (forward), symbolic in b and s


@dataclass(frozen=True)
class NodeCost:
    """Forward cost of one node. ``flops`` and ``bytes_moved`` are sympy expressions in b, s;
    bytes count floating tensors at ``float_bytes`` per element (the training compute dtype)."""

    flops: sympy.Expr
    bytes_moved: sympy.Expr


ZERO_COST = NodeCost(sympy.Integer(0), sympy.Integer(0))


def numel(shape) -> sympy.Expr:
    out = sympy.Integer(1)
    for d in shape:
        out *= d
    return out


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """Tensor-valued node arguments in call order (positional, then keyword)."""
    found = []
    for a in list(node.args) + list(node.kwargs.values()):
        for n in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(n, fx.Node) and n.meta.get("shape") is not None:
                found.append(n)
    return found


def elem_bytes(dtype: torch.dtype | None, float_bytes: int) -> int:
    if dtype is None:
        return 0
    if dtype.is_floating_point:
        return float_bytes
    return torch.empty((), dtype=dtype).element_size() if dtype != torch.bool else 1


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


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
    if _arg(node, 5, "is_causal", False):
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


__all__ = ["RULES", "MODULE_OPS", "OpRule", "NodeCost", "op_name", "rule", "node_cost", "B", "S"]


# ---------------------------------------------------------------------------------------------
# Op classes from the table, refined by graph patterns


def is_weight(node: fx.Node) -> bool:
    """A parameter, or a view/cast of one (``w.t()``, ``w.to(bf16)``)."""
    while True:
        if node.op == "get_attr":
            return True
        if node.op == "call_module" or not node.args or not isinstance(node.args[0], fx.Node):
            return False
        r = rule(node.meta.get("op", ""))
        if r is None or not (r.alias or node.meta.get("op") in ("to", "float", "_to_copy", "bfloat16")):
            return False
        node = node.args[0]


def weight_of(node: fx.Node, gm: fx.GraphModule) -> tuple[int, ...] | None:
    """Shape of the weight a matmul multiplies by, or None for activation-by-activation."""
    if node.op == "call_module":
        w = getattr(gm.get_submodule(node.target), "weight", None)
        return tuple(w.shape) if w is not None else None
    for a in tensor_args(node):
        if is_weight(a):
            src = a
            while src.op != "get_attr":
                src = src.args[0]
            return tuple(gm.get_parameter(src.target).shape) if _is_param(gm, src.target) else tuple(src.meta["shape"])
    return None


def _is_param(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False


def _norm_module(module_type: str) -> bool:
    return module_type.lower().endswith("norm")


def classify(gm: fx.GraphModule) -> None:
    """Set ``op_class`` on every node: the table's class, then three graph patterns.

    - a matmul by a 3-D (stacked) weight is ``experts``; by a 2-D weight whose output reaches a
      ``topk`` through pointwise ops is ``router``;
    - a matmul of two activations (QK^T, probabilities @ V) is ``attention``, and so is every
      node on a path from one such matmul to another (scale, mask, softmax, dropout);
    - any computation inside a module whose class name ends in ``Norm`` is ``norm`` (norms
      written out op by op, as in HuggingFace models).
    """
    nodes = list(gm.graph.nodes)
    act_matmuls = []
    for n in nodes:
        name = n.meta.get("op", "")
        r = rule(name)
        n.meta["op_class"] = r.op_class if r else "other"
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        if r is not None and r.flops == "matmul":
            w = weight_of(n, gm)
            if w is None:
                n.meta["op_class"] = "attention"
                act_matmuls.append(n)
            elif len(w) == 3 or "grouped_mm" in name:
                n.meta["op_class"] = "experts"
            elif _reaches_topk(n):
                n.meta["op_class"] = "router"
        elif _norm_module(n.meta.get("module_type", "")) and n.meta.get("shape") is not None:
            n.meta["op_class"] = "norm"
    act = set(act_matmuls)
    for first in act_matmuls:
        between = _forward_until(first, act)
        for n in between:
            if n.meta["op_class"] in ("elementwise", "other"):
                n.meta["op_class"] = "attention"


def _carries_values(r: OpRule | None) -> bool:
    """Pointwise ops and views: what lies between a matmul and what consumes its result."""
    return r is not None and r.flops != "matmul" and (r.op_class == "elementwise" or r.tp in ("pointwise", "view"))


def _pointwise_users(node: fx.Node):
    for u in node.users:
        r = rule(u.meta.get("op", ""))
        yield u, r


def _reaches_topk(start: fx.Node, limit: int = 12) -> bool:
    frontier, seen = [start], set()
    for _ in range(limit):
        nxt = []
        for n in frontier:
            for u, r in _pointwise_users(n):
                if u.meta.get("op") == "topk":
                    return True
                if u not in seen and _carries_values(r):
                    seen.add(u)
                    nxt.append(u)
        frontier = nxt
    return False


def _forward_until(start: fx.Node, stops: set[fx.Node], limit: int = 16) -> set[fx.Node]:
    """Nodes on pointwise/view paths from ``start`` that end in a node of ``stops``."""
    on_path: set[fx.Node] = set()

    def walk(n: fx.Node, depth: int) -> bool:
        if depth > limit:
            return False
        hit = False
        for u, r in _pointwise_users(n):
            if u in stops:
                hit = True
            elif _carries_values(r) and walk(u, depth + 1):
                on_path.add(u)
                hit = True
        return hit

    walk(start, 0)
    return on_path
