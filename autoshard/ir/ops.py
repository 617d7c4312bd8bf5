"""What autoshard knows about each op, in one table.

A row of ``RULES`` says, for one normalised op name (``node.meta["op"]``), everything the cost
model, the sharding analysis and the rewrite passes need to know about it, side by side:

* ``op_class``: one of ``autoshard.ir.OP_CLASSES`` (its kind: matmul, attention, norm, loss, ...),
  refined by graph patterns in :func:`classify` (routers, experts, written-out attention, norms);
* ``flops``: how to count its forward FLOPs (``zero | pointwise | matmul | sdpa | reduce | norm | loss``),
  ``flops_per_elem`` the FLOPs per output element where that is the count;
* ``saves``: what autograd keeps for backward (codes below); ``alias``: its output is a view of
  its first input;
* ``tp``: how a tensor-parallel shard passes through it, a key of ``TP_RULES``; the tensor-parallel
  pass implements each of those once and dispatches on this field, and the sharding analysis treats
  an op as TP-transparent exactly when it has one (``None``: a shard cannot pass);
* ``sp``: its sequence-parallel rule, a key of ``SP_RULES`` (``None``: not per-token);
* ``cp``: what the context-parallel pass does with it, a key of ``CP_RULES``;
* ``metadata``: it reads only its input's metadata, never its values (a key of ``METADATA``);
* ``signature``: the argument layout of an attention or loss call (a key of ``SIGNATURES``),
  read with :func:`call_args` by the cost model and every pass.
* ``cast``: it only changes its input's dtype (``CASTS``);
* ``grouped``: a grouped GEMM over rows sorted by expert (``GROUPED_MATMULS``).

Facts of the transfer rules themselves sit beside them: ``TP_REGION_ENDS`` (a row matmul and the
vocabulary-parallel loss end a tensor-parallel region), ``TP_ROW_WISE`` (rules that act on each
row alone).

Saved-tensor codes (``OpRule.saves``):
  ``partner``  bilinear ops (mul, matmul, linear): each operand is kept when the other needs a
               gradient (so ``linear`` keeps its input, never its weight as an activation);
  ``in0``/``in1`` a given input; ``out`` the output; ``mask`` one byte per output element
               (dropout, when active); ``sdpa`` q, k, v, output and the fp32 log-sum-exp;
  ``logprobs`` fp32 log-probabilities of the logits (cross-entropy).

Supporting a new op is a new row.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import sympy
import torch
from torch import fx

from autoshard.ir import B, S

# ---------------------------------------------------------------------------------------------
# The vocabularies of the rule fields

TP_RULES = {
    "pointwise": "element by element (operands broadcast; one that spans the split dimension unsplit is "
    "cut to this rank's piece)",
    "softmax": "element-wise but normalised along its dim argument, which must not be the split one",
    "reduce": "a reduction along its dim argument: the split passes when it is another dimension (a "
    "per-head norm); a sum or mean over the split dimension is this rank's part, all-reduced",
    "norm": "a normalisation over trailing features (F.layer_norm, F.rms_norm) that are not the split "
    "dimension: per head",
    "view": "view/reshape: the split dimension is followed through merged and split dimensions",
    "complex": "view_as_complex / view_as_real: a trailing dimension of (real, imaginary) pairs dropped "
    "or added, never the split one (complex rotary embeddings: the heads pass, the pairs stay whole)",
    "transpose": "two dimensions swapped",
    "permute": "dimensions permuted",
    "getitem": "basic indexing of a tensor, or one output of a split",
    "slice": "a slice or narrow along one dimension, not the split one",
    "select": "one index along a dimension (which disappears), not the split one",
    "split": "split/chunk/unbind into several outputs, read by getitem; along the split dimension "
    "only in equal parts, which puts every part's own split in the column's layout",
    "unsqueeze": "a new size-1 dimension",
    "squeeze": "size-1 dimensions removed",
    "expand": "broadcast to new leading or size-1 dimensions",
    "matmul": "a product of two activations, plus an added term (baddbmm); the split must be a batch "
    "dimension (heads, alone or merged with the batch)",
    "attention": "fused attention over heads: q, k and v split along heads",
    "cat": "concatenation of identically split tensors along another dimension",
    "stack": "stacking identically split tensors along a new dimension",
    "linear": "a linear layer by a parameter (nn.Linear, F.linear, addmm as in GPT-2's Conv1D): "
    "column- or row-parallel, as the analysis pairs them",
    "loss": "cross-entropy over logits split along the vocabulary (vocabulary-parallel)",
}

# transfer rules that end a tensor-parallel region (a row matmul, the vocabulary-parallel loss),
# and those that act on each row of a tensor alone (experts' rows may be split between ranks)
TP_REGION_ENDS = ("linear", "loss")
TP_ROW_WISE = ("pointwise", "softmax", "norm")

SP_RULES = {
    "pointwise": "per token: element by element, every operand per token or broadcast over the sequence",
    "reduce": "per token when it reduces over other dimensions than the sequence (a norm written out)",
    "norm": "a normalisation over features: per token; its weight and bias see only this rank's tokens",
    "same_shape": "per token when its output has its input's shape (a slice that keeps everything)",
    "view": "per token when it keeps each token's features together: the sequence kept as a "
    "dimension, or (batch, sequence) flattened into rows and back (GPT-2's Conv1D)",
}

CP_RULES = {
    "attention": "causal attention over the whole sequence: ring or all-gather-KV attention",
    "loss": "the mean cross-entropy: this rank's share of the sequence mean",
    "positions": "arange over the sequence: the global positions of this rank's chunks",
    "mixes": "mixes values along its dim argument: refused along the sequence (outside attention)",
}

METADATA = {
    "size": "sizes (the passes keep or rewrite the values it returns)",
    "attr": "dtype, device, rank, or a new tensor of explicit sizes on the input's device",
    "numel": "the element count (no pass restores it on a shard)",
}

# Argument layouts: (name, default) per position; keyword arguments go by name.
SIGNATURES: dict[str, tuple[tuple[str, object], ...]] = {
    "sdpa": (
        ("query", None),
        ("key", None),
        ("value", None),
        ("attn_mask", None),
        ("dropout_p", 0.0),
        ("is_causal", False),
        ("scale", None),
    ),
    "sdpa_flash": (  # aten._scaled_dot_product_flash_attention[_for_cpu]
        ("query", None),
        ("key", None),
        ("value", None),
        ("dropout_p", 0.0),
        ("is_causal", False),
    ),
    "sdpa_efficient": (  # aten._scaled_dot_product_{efficient,cudnn}_attention
        ("query", None),
        ("key", None),
        ("value", None),
        ("attn_mask", None),
        ("compute_log_sumexp", False),
        ("dropout_p", 0.0),
        ("is_causal", False),
    ),
    "fused_attention": (("query", None), ("key", None), ("value", None), ("is_causal", True), ("scale", None)),
    "cp_attention": (
        ("query", None),
        ("key", None),
        ("value", None),
        ("variant", "ring"),
        ("scale", None),
        ("window", None),
    ),
    "cross_entropy": (
        ("input", None),
        ("target", None),
        ("weight", None),
        ("size_average", None),
        ("ignore_index", -100),
        ("reduce", None),
        ("reduction", "mean"),
        ("label_smoothing", 0.0),
    ),
    "cross_entropy_loss": (  # aten: reduction as an int
        ("input", None),
        ("target", None),
        ("weight", None),
        ("reduction", 1),
        ("ignore_index", -100),
        ("label_smoothing", 0.0),
    ),
    "cp_cross_entropy": (("input", None), ("target", None), ("ignore_index", -100), ("vocab_parallel", False)),
}
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # aten's reduction codes


@dataclass(frozen=True)
class OpRule:
    op_class: str
    flops: str = "zero"  # zero | pointwise | matmul | sdpa | reduce | norm | loss
    saves: tuple[str, ...] = ()
    alias: bool = False
    tp: str | None = None  # a key of TP_RULES
    flops_per_elem: int = 1
    sp: str | None = None  # a key of SP_RULES
    cp: str | None = None  # a key of CP_RULES
    metadata: str | None = None  # a key of METADATA
    signature: str | None = None  # a key of SIGNATURES
    cast: bool = False  # it only changes its input's dtype
    grouped: bool = False  # a grouped GEMM: rows sorted by expert, one weight per group (``offs``)
    # the form its FP8 call takes (passes/fp8.py), where one exists: "linear" (x, w, bias),
    # "product" (x @ w, batched or not), "addmm" (bias, x, w) or "grouped" (rows, w, offs)
    fp8: str | None = None


def _rows(names: str, rule: OpRule, **fields) -> dict[str, OpRule]:
    return dict.fromkeys(names.split(), replace(rule, **fields))


_OTHER = OpRule("other")
_VIEW = OpRule("other", alias=True)
_PW = OpRule("elementwise", "pointwise", tp="pointwise", sp="pointwise")
_TRANSCENDENTAL = replace(_PW, flops_per_elem=4)
_MATMUL = OpRule("matmul", "matmul", ("partner",))
_SDPA = OpRule("attention", "sdpa", ("sdpa",), tp="attention", cp="attention")
_NORM = OpRule("norm", "norm", ("in0",), flops_per_elem=5, sp="norm")
_LOSS = OpRule("loss", "loss", ("logprobs",), flops_per_elem=4)
_REDUCE = OpRule("elementwise", "reduce")
_SOFTMAX = OpRule("elementwise", "pointwise", ("out",), flops_per_elem=5, tp="softmax", sp="reduce", cp="mixes")
_COLLECTIVE = OpRule("other")  # inserted by the passes: runtime collectives, identities on one rank

RULES: dict[str, OpRule] = {
    # matrix products
    **_rows("linear", _MATMUL, tp="linear", fp8="linear"),
    **_rows("addmm", _MATMUL, tp="linear", fp8="addmm"),  # addmm(bias, x, w): GPT-2's Conv1D
    **_rows("matmul mm bmm", _MATMUL, tp="matmul", fp8="product"),
    **_rows("baddbmm", _MATMUL, tp="matmul"),  # baddbmm(bias, a, b): ALiBi's scores
    **_rows("einsum", _MATMUL),
    **_rows("_grouped_mm grouped_mm grouped_mm_fallback", _MATMUL, grouped=True, fp8="grouped"),
    # attention
    **_rows("scaled_dot_product_attention", _SDPA, signature="sdpa"),
    # the aten kernels (torch.export): priced and split by heads; flash and CP leave them to torch
    **_rows(
        "_scaled_dot_product_flash_attention _scaled_dot_product_flash_attention_for_cpu",
        _SDPA,
        cp=None,
        signature="sdpa_flash",
    ),
    **_rows(
        "_scaled_dot_product_efficient_attention _scaled_dot_product_cudnn_attention",
        _SDPA,
        cp=None,
        signature="sdpa_efficient",
    ),
    **_rows("fused_attention", _SDPA, signature="fused_attention"),
    **_rows("cp_attention", _SDPA, cp=None, signature="cp_attention"),
    # normalisation
    **_rows("layer_norm rms_norm", _NORM, tp="norm"),
    **_rows("native_layer_norm _fused_rms_norm", _NORM),
    "group_norm": replace(_NORM, sp=None),  # groups of channels: dim 1, the sequence of a (b, s, h) input
    "embedding": OpRule("embedding", saves=("in0",)),
    "vocab_parallel_embedding": OpRule("embedding", saves=("in0",)),
    # losses
    **_rows("cross_entropy", _LOSS, tp="loss", cp="loss", signature="cross_entropy"),
    **_rows("cross_entropy_loss", _LOSS, tp="loss", cp="loss", signature="cross_entropy_loss"),
    **_rows("cp_cross_entropy", _LOSS, tp="loss", signature="cp_cross_entropy"),
    **_rows("nll_loss nll_loss_nd vocab_parallel_cross_entropy", _LOSS),
    # pointwise arithmetic
    **_rows("add sub rsub neg iadd add_ sub_ clamp", _PW),
    **_rows("mul mul_ imul div truediv div_ floordiv", _PW, saves=("partner",)),
    **_rows("gelu silu pow log square abs sin cos", _TRANSCENDENTAL, saves=("in0",)),
    **_rows("exp sigmoid tanh relu rsqrt sqrt reciprocal", _TRANSCENDENTAL, saves=("out",)),
    **_rows("softmax _softmax log_softmax _log_softmax", _SOFTMAX),
    **_rows("dropout native_dropout", _PW, saves=("mask",)),
    **_rows("masked_fill masked_fill_", _PW, saves=("in1",)),
    "where": replace(_PW, saves=("in0",)),
    **_rows("to float half bfloat16 type_as _to_copy to_compute", _PW, cast=True),
    **_rows("contiguous clone", _PW),
    **_rows("eq ne lt le gt ge logical_not invert bitwise_not", _PW),
    # reductions and routing (a feature shard passes the ones over other dimensions)
    **_rows("sum mean amax var std", _REDUCE, sp="reduce", tp="reduce"),
    **_rows("max min norm cumsum prod", _REDUCE),
    **_rows("topk sort argsort argmax histc bincount", OpRule("other", "reduce")),
    # indexing: moves data, keeps integer indices for backward
    **_rows("index_select gather index index_add", OpRule("other", saves=("in2",))),
    **_rows("scatter scatter_add index_put index_put_ index_copy", _OTHER),
    # views
    **_rows("view reshape _unsafe_view", _VIEW, tp="view", sp="view"),
    **_rows("flatten unflatten view_as", _VIEW, tp="view"),
    **_rows("view_as_complex view_as_real", _VIEW, tp="complex"),
    **_rows("transpose swapaxes t", _VIEW, tp="transpose"),
    "permute": replace(_VIEW, tp="permute"),
    "getitem": replace(_VIEW, tp="getitem"),
    **_rows("slice narrow", _VIEW, tp="slice", sp="same_shape"),
    "select": replace(_VIEW, tp="select"),
    **_rows("split split_with_sizes chunk unbind", _VIEW, tp="split"),
    "unsqueeze": replace(_VIEW, tp="unsqueeze"),
    "squeeze": replace(_VIEW, tp="squeeze"),
    **_rows("expand expand_as", _VIEW, tp="expand"),
    **_rows("alias detach", _VIEW, tp="pointwise", sp="pointwise"),
    "as_strided": _VIEW,
    # copies
    **_rows("cat concat", _OTHER, tp="cat"),
    "stack": replace(_OTHER, tp="stack"),
    **_rows("repeat repeat_interleave pad constant_pad_nd tril triu flip roll", _OTHER),
    # new tensors
    **_rows("zeros ones full empty zeros_like ones_like full_like empty_like outer one_hot", _OTHER),
    **_rows("rand randn randint lift_fresh_copy", _OTHER),
    "arange": replace(_OTHER, cp="positions"),
    "cp_positions": _OTHER,
    "cp_shard": _OTHER,
    # metadata
    **_rows("size sym_size", _OTHER, metadata="size"),
    **_rows("dim getattr _assert_tensor_metadata _guards_fn", _OTHER, metadata="attr"),
    **_rows("new_zeros new_ones new_full new_empty", _OTHER, metadata="attr"),
    **_rows("numel sym_numel", _OTHER, metadata="numel"),
    # collectives the passes insert
    **_rows("copy_to_tp reduce_from_tp gather_from_sp reduce_scatter_to_sp scatter_to_sp", _COLLECTIVE),
    **_rows("gather_tokens reduce_scatter_tokens", _COLLECTIVE),
    # mixture of experts (inserted by passes/expert_parallel.py): the EP all-to-alls and the TP
    # shares of the routed rows (priced with the experts, from their dispatch: LayerCosts), the
    # balancing hooks (identities on the routing)
    **_rows("dispatch combine dispatch_buffer combine_buffer", _COLLECTIVE),
    **_rows("tp_share tp_unshare tp_share_buffer tp_unshare_buffer", _COLLECTIVE),
    **_rows("record_load balance_loss", _VIEW),
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
    torch.Tensor.__matmul__: "matmul",
    getattr: "getattr",
}


def op_name(node: fx.Node, gm: fx.GraphModule | None = None) -> str:
    """Normalised name of what ``node`` computes, the key of ``RULES`` (``gm`` names modules)."""
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


def fp8_form(func) -> str | None:
    """The ``fp8`` column of what the callable ``func`` computes (a torch function or method as
    ``__torch_function__`` sees it), for running a model's own calls as the FP8 pass rewrites them."""
    row = rule(_FUNCTION_NAMES.get(func, getattr(func, "__name__", "")))
    return row.fp8 if row is not None else None


def rule(name: str) -> OpRule | None:
    if name in RULES:
        return RULES[name]
    if "grouped_mm" in name:
        return _MATMUL
    return None


def rule_of(node) -> OpRule | None:
    """The row of a node (by ``node.meta["op"]``); None for a non-node or an unknown op."""
    return rule(node.meta.get("op", "")) if isinstance(node, fx.Node) else None


def call_args(node: fx.Node) -> dict[str, object]:
    """The arguments of an attention or loss call by name, defaults filled in, as its row's
    ``signature`` lays them out (a loss's ``reduction`` always as a string)."""
    layout = SIGNATURES[RULES[node.meta["op"]].signature]
    args = {name: node.args[i] if i < len(node.args) else default for i, (name, default) in enumerate(layout)}
    args.update(node.kwargs)
    if isinstance(args.get("reduction"), int):
        args["reduction"] = _REDUCTIONS[args["reduction"]]
    return args


def dims_arg(node: fx.Node, rank: int) -> tuple[int, ...] | None:
    """The dimensions a reduction or softmax works along (``dim``, positional 1), normalised;
    None when it reduces over everything."""
    d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if d is None:
        return None
    return tuple(x % rank for x in (d if isinstance(d, (tuple, list)) else (d,)))


# ---------------------------------------------------------------------------------------------
# Reading a node's tensors


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


# ---------------------------------------------------------------------------------------------
# Op classes from the table, refined by graph patterns

CASTS = tuple(name for name, r in RULES.items() if r.cast)  # ops that only change a dtype
GROUPED_MATMULS = tuple(name for name, r in RULES.items() if r.grouped)


def cast_target(node) -> torch.dtype | None:
    """The dtype a ``to``/``_to_copy`` call names (as torch.export records casts), or None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or op_name(node) not in ("to", "_to_copy"):
        return None
    return next((a for a in (*node.args[1:], node.kwargs.get("dtype")) if isinstance(a, torch.dtype)), None)


def stacked_parameters(node: fx.Node) -> list[fx.Node] | None:
    """The parameters ``node`` stacks (``torch.stack`` of ``get_attr`` nodes: one expert's
    projection each, as ``passes.moe_forms`` stacks an ``nn.ModuleList``'s), or None."""
    if node.op != "call_function" or _name(node) != "stack" or not isinstance(node.args[0], (list, tuple)):
        return None
    params = list(node.args[0])
    return params if params and all(isinstance(p, fx.Node) and p.op == "get_attr" for p in params) else None


def is_weight(node: fx.Node) -> bool:
    """A parameter, or a view/cast of one (``w.t()``, ``w.to(bf16)``), or the rows of a stacked
    expert parameter that routing choices select (:func:`expert_rows`), or a stack of parameters
    (:func:`stacked_parameters`)."""
    while True:
        if node.op == "get_attr" or stacked_parameters(node) is not None:
            return True
        if node.op == "call_module" or not node.args or not isinstance(node.args[0], fx.Node):
            return False
        r = rule(node.meta.get("op", ""))
        if r is None or not (r.alias or node.meta.get("op") in CASTS or expert_rows(node)):
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
                if stacked_parameters(src) is not None:
                    return tuple(src.meta["shape"])
                src = src.args[0]
            return tuple(gm.get_parameter(src.target).shape) if _is_param(gm, src.target) else tuple(src.meta["shape"])
    return None


def _is_param(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False


def classify(gm: fx.GraphModule) -> None:
    """Set ``op_class`` on every node: the table's class, then three graph patterns.

    - a matmul by a 3-D (stacked) weight is ``experts`` (a grouped GEMM, a batched product, or a
      stacked weight's rows gathered per routed token, :func:`expert_rows`); by a 2-D weight
      whose output reaches a ``topk`` through pointwise ops is ``router``;
    - every weighted matmul on the rows a loop over experts dispatches to one expert
      (:func:`dispatched_experts`: ``x[where(choices == i)]``), up to where they are combined,
      is ``experts``, whatever its module is (an ``nn.ModuleList`` of ordinary MLPs);
    - a matmul of two activations (QK^T, probabilities @ V) is ``attention``, and so is every
      node on a path from one such matmul to another (scale, mask, softmax, dropout);
    - a normalisation written out op by op (HuggingFace's RMSNorm, a hand-written LayerNorm) is
      ``norm``, found from its ops (:func:`written_norms`), whatever its module is called.
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
    for n in nodes:
        if dispatched_experts(n) is not None:
            for m in _expert_work(n, gm):
                m.meta["op_class"] = "experts"
    for n in written_norms(nodes):
        n.meta["op_class"] = "norm"
    act = set(act_matmuls)
    for first in act_matmuls:
        between = _forward_until(first, act)
        for n in between:
            if n.meta["op_class"] in ("elementwise", "other"):
                n.meta["op_class"] = "attention"


def written_norms(nodes: list[fx.Node]) -> set[fx.Node]:
    """The nodes of every normalisation written out op by op: a mean over the last dimension
    (kept) of ``x`` or ``x**2`` (``(x - mean)**2`` for a LayerNorm), through ``rsqrt``/``sqrt``
    (after ``+ eps``) to a product with or quotient of ``x``, then casts and a multiply by a
    weight / add of a bias; with the casts of ``x`` and the centring ``x - mean(x)`` before it."""
    found: set[fx.Node] = set()
    for stat in nodes:
        base = _feature_stat(stat)
        if base is None:
            continue
        norm = _normalised(stat, base)
        if norm is None:
            continue
        members = {stat, *norm}
        if base is not stat.args[0]:
            members.add(stat.args[0])  # the square
        tail = norm[-1]
        while True:
            users = [u for u in tail.users if not (rule_of(u) and rule_of(u).metadata)]
            if len(users) != 1 or not _norm_tail(users[0], tail):
                break
            tail = users[0]
            members.add(tail)
        members |= _norm_head(base, members)
        found |= {m for m in members if m.meta.get("shape") is not None}
    return found


def _feature_stat(node: fx.Node) -> fx.Node | None:
    """For ``mean(x**2, -1, keepdim=True)`` or ``mean(x, -1, keepdim=True)`` (``var`` too): ``x``."""
    if node.meta.get("op") not in ("mean", "var") or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    src, shape = node.args[0], node.meta.get("shape")
    rank = len(src.meta.get("shape") or ())
    if not rank or not isinstance(shape, (tuple, list)) or len(shape) != rank or shape[-1] != 1:
        return None
    if dims_arg(node, rank) != (rank - 1,):
        return None
    op = src.meta.get("op")
    if op == "pow" and len(src.args) > 1 and src.args[1] == 2 or op == "square":
        return src.args[0]
    if op == "mul" and len(src.args) > 1 and src.args[0] is src.args[1]:
        return src.args[0]
    return src


def _same(a, b) -> bool:
    """The same tensor, or the same op on the same arguments (``x - mean`` computed twice)."""
    if a is b:
        return True
    return isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.target == b.target and a.args == b.args


def _is_base(a, base: fx.Node) -> bool:
    """``base`` itself, the same op on the same inputs, or ``base - mean(base)`` (after ``var(base)``)."""
    if _same(a, base):
        return True
    return _centring(a) and a.args[0] is base


def _centring(n) -> bool:
    """``x - mean(x, -1, keepdim=True)``."""
    return (
        isinstance(n, fx.Node)
        and n.meta.get("op") == "sub"
        and isinstance(n.args[1], fx.Node)
        and _feature_stat(n.args[1]) is n.args[0]
    )


def _normalised(stat: fx.Node, base: fx.Node, depth: int = 4) -> list[fx.Node] | None:
    """The path from ``stat`` through ``rsqrt``/``sqrt`` to ``base * rsqrt(...)`` or
    ``base / sqrt(...)``, ending with that product; None if there is none."""
    frontier = [(stat, [], False)]
    for _ in range(depth):
        nxt = []
        for n, path, rooted in frontier:
            for u in n.users:
                op, r = u.meta.get("op"), rule_of(u)
                if rooted and op in ("mul", "div", "truediv"):
                    other = [a for a in u.args if a is not n]
                    if other and _is_base(other[0], base) and (op == "mul" or u.args[1] is n):
                        return [*path, *([] if other[0] is base else [other[0]]), u]
                if r is not None and r.flops == "pointwise" and r.sp == "pointwise":
                    nxt.append((u, [*path, u], rooted or op in ("rsqrt", "sqrt")))
        frontier = nxt
    return None


def _norm_tail(node: fx.Node, prev: fx.Node) -> bool:
    """A cast of the normalised value, or its product with a weight / sum with a bias."""
    op = node.meta.get("op")
    if op in CASTS:
        return True
    others = [a for a in node.args if isinstance(a, fx.Node) and a is not prev]
    return op in ("mul", "add") and len(others) == 1 and is_weight(others[0])


def _norm_head(base: fx.Node, members: set[fx.Node]) -> set[fx.Node]:
    """What computes ``base`` for the norm alone: casts of its input, the centring ``x - mean(x)``."""
    head: set[fx.Node] = set()
    frontier = [base, *(m for m in members if _centring(m))]
    while frontier:
        n = frontier.pop()
        centring = _centring(n)
        if not (n.meta.get("op") in CASTS or centring):
            continue
        users = [u for u in n.users if not (rule_of(u) and rule_of(u).metadata)]
        if not all(u in members or u in head for u in users):
            continue
        head.add(n)
        if centring:
            head.add(n.args[1])
        frontier.extend(a for a in n.args[:1] if isinstance(a, fx.Node))
    return head


def carries_values(r: OpRule | None) -> bool:
    """Pointwise ops and views: what lies between a matmul and what consumes its result."""
    return r is not None and r.flops != "matmul" and (r.op_class == "elementwise" or r.tp not in (None, "loss"))


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
                if u not in seen and carries_values(r):
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
            elif carries_values(r) and walk(u, depth + 1):
                on_path.add(u)
                hit = True
        return hit

    walk(start, 0)
    return on_path


# ---------------------------------------------------------------------------------------------
# Mixture of experts, from the routing: top-k choices select each token's experts

# ops that hand integer routing choices (or positions) on with their values unchanged
_KEEPS_VALUES = ("view", "reshape", "_unsafe_view", "flatten", "unflatten", "contiguous", "clone", "alias",
                 "detach", "to", "_to_copy", "squeeze", "unsqueeze", "permute", "transpose", "t")  # fmt: skip
_ROW_SELECTS = ("index", "getitem", "index_select")


def _name(n: fx.Node) -> str:
    """``n``'s op name, before capture has annotated it too (``op_name`` without modules)."""
    return n.meta.get("op") or ("" if n.op == "call_module" else op_name(n))


def topk_of(n: fx.Node, depth: int = 8) -> fx.Node | None:
    """The ``topk`` whose indices ``n`` is (through value-preserving views and casts)."""
    for _ in range(depth):
        name = _name(n)
        if name == "getitem" and n.args[1] == 1 and isinstance(n.args[0], fx.Node):
            return n.args[0] if _name(n.args[0]) == "topk" else None
        if name not in _KEEPS_VALUES or not n.args or not isinstance(n.args[0], fx.Node):
            return None
        n = n.args[0]
    return None


def routing_candidates(n: fx.Node) -> int | None:
    """E when ``n`` holds routing choices: the indices of a top-k over E candidates."""
    topk = topk_of(n)
    if topk is None:
        return None
    dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
    return int(topk.args[0].meta["shape"][dim])


def routing_mask(mask: fx.Node) -> tuple[sympy.Expr, int] | None:
    """(slots, E) when ``mask`` is ``choices == c`` for routing choices over E candidates: each
    of its ``slots`` elements holds one of E, so under balanced routing 1/E of them are true."""
    if _name(mask) != "eq":
        return None
    for side in mask.args[:2]:
        if isinstance(side, fx.Node) and (experts := routing_candidates(side)) is not None:
            return numel(side.meta["shape"]), experts
    return None


def _selected(node) -> tuple[fx.Node, fx.Node] | None:
    """(source, index) of a row selection along dim 0 by one index tensor: ``x[idx]``
    (``index`` or ``getitem``) or ``index_select(x, 0, idx)``."""
    name = _name(node) if isinstance(node, fx.Node) else ""
    if name not in _ROW_SELECTS or len(node.args) < 2 or not isinstance(node.args[0], fx.Node):
        return None
    if name == "index_select":
        idx = node.args[2] if node.args[1] == 0 and len(node.args) > 2 else None
    else:
        idx = node.args[1]
        if name == "index" and isinstance(idx, (list, tuple)) and len(idx) == 1:
            idx = idx[0]
    dtype = idx.meta.get("dtype") if isinstance(idx, fx.Node) else None
    if dtype is None or dtype == torch.bool or dtype.is_floating_point:  # integer positions only
        return None
    return node.args[0], idx


def expert_rows(node: fx.Node) -> bool:
    """``W[choices]``: each routed token slot's expert's weight, selected from a parameter
    stacked over the E experts a top-k routing chooses among (transformers' ``batched_mm``)."""
    sel = _selected(node)
    if sel is None:
        return False
    src, idx = sel
    shape = src.meta.get("shape")
    return isinstance(shape, tuple) and len(shape) >= 3 and is_weight(src) and routing_candidates(idx) == shape[0]


def dispatched_experts(node: fx.Node) -> int | None:
    """E when ``node`` takes the token rows routed to one expert out of E: ``x[idx]`` with
    ``idx`` the positions of the true elements (``where``, ``nonzero``) of a mask comparing the
    routing choices with that expert (:func:`routing_mask`)."""
    sel = _selected(node)
    if sel is None or is_weight(sel[0]):
        return None
    idx = sel[1]
    for _ in range(8):
        if _name(idx) not in _KEEPS_VALUES or not idx.args or not isinstance(idx.args[0], fx.Node):
            break
        idx = idx.args[0]
    if _name(idx) == "getitem" and isinstance(idx.args[0], fx.Node):
        idx = idx.args[0]
    if _name(idx) not in ("where", "nonzero", "argwhere") or not idx.args or not isinstance(idx.args[0], fx.Node):
        return None
    if _name(idx) == "where" and len(idx.args) != 1:
        return None
    routed = routing_mask(idx.args[0])
    return routed[1] if routed is not None else None


def _row_count(n: fx.Node):
    """The leading size of ``n``'s output (of its first output, for a split)."""
    shape = n.meta.get("shape") or (n.meta.get("shapes") or [None])[0]
    return shape[0] if shape else None


def _expert_work(dispatch: fx.Node, gm: fx.GraphModule, limit: int = 32) -> list[fx.Node]:
    """The weighted matmuls computing on the rows ``dispatch`` took for one expert: reached from
    it through pointwise ops, views and weighted matmuls that keep those rows, up to where the
    rows are combined (an index_put, index_add or scatter, which carries no values on)."""
    rows = _row_count(dispatch)
    found, seen, frontier = [], {dispatch}, [dispatch]
    for _ in range(limit):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u in seen or _row_count(u) != rows:
                    continue
                seen.add(u)
                r = rule_of(u)
                if r is not None and r.flops == "matmul" and weight_of(u, gm) is not None:
                    found.append(u)
                elif not carries_values(r):
                    continue
                nxt.append(u)
        frontier = nxt
    return found


def expert_count(node: fx.Node, gm: fx.GraphModule) -> int | None:
    """How many experts the routing of an ``experts`` matmul chooses among: its stacked weight's
    leading size, or, for one expert's matmul in a loop over experts, the routing candidates of
    the dispatch its rows came from (found walking back through what :func:`_expert_work` follows)."""
    w = weight_of(node, gm)
    if w is not None and len(w) == 3:
        return int(w[0])
    seen, frontier = set(), [node]
    while frontier:
        n = frontier.pop()
        for a in tensor_args(n):
            if a in seen or is_weight(a):
                continue
            seen.add(a)
            if (experts := dispatched_experts(a)) is not None:
                return experts
            r = rule_of(a)
            if carries_values(r) or r is not None and r.flops == "matmul" and a.meta.get("op_class") == "experts":
                frontier.append(a)
    return None


__all__ = [
    "RULES",
    "MODULE_OPS",
    "TP_RULES",
    "SP_RULES",
    "CP_RULES",
    "METADATA",
    "SIGNATURES",
    "OpRule",
    "op_name",
    "rule",
    "rule_of",
    "call_args",
    "dims_arg",
    "classify",
    "written_norms",
    "expert_rows",
    "stacked_parameters",
    "dispatched_experts",
    "expert_count",
    "routing_mask",
    "routing_candidates",
    "B",
    "S",
]
