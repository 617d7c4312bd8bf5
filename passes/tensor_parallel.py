"""Tensor parallelism: Megatron column/row pairs, head split (GQA included), vocabulary-parallel
embedding and cross-entropy, rewritten into the traced graph.

Which matmuls are column-, row- or vocabulary-parallel comes from the graph analysis in
``autoshard.cost_models.sharding`` (``node.meta["tp_role"]``), never from module names. This pass
then follows each column output through the region to its row matmuls and decides, op by op, which
dimension of every tensor is split (``Shard``). Where a view splits a column's features into
several dimensions (``(b, s, 3*h) -> (b, s, 3, heads, head_dim)``) the split lands on the first
dimension the rest of the region carries untouched (heads, not the q/k/v selector), and the
column's weight rows are taken in that layout, strided if need be. Shape constants in views are
rewritten from the propagated shapes, and the collectives go in as explicit calls:

* ``copy_to_tp`` (f) once per input of a group of column matmuls,
* ``reduce_from_tp`` (g) after each row matmul, its bias added after the reduction,
* ``vocab_parallel_embedding`` for an embedding of the vocabulary,
* ``vocab_parallel_cross_entropy`` for the loss over vocabulary-split logits.

The result is the same code for every TP rank; ``ShardedGraph.shards`` says how each parameter is
sliced, and ``slice_parameter`` cuts rank r's piece out of a full tensor.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from autoshard import runtime
from autoshard.errors import AutoshardError
from autoshard.passes._graph import op_name as _op_name
from autoshard.runtime.stages import slice_full

# ---------------------------------------------------------------------------------------------
# shard layouts


@dataclass(frozen=True)
class Shard:
    """Tensor dimension ``dim`` (global size ``prod(factors)``) viewed as ``factors``; factor
    ``index`` is split into ``tp`` contiguous blocks."""

    dim: int
    factors: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return math.prod(self.factors)


@dataclass(frozen=True)
class ParamShard:
    dim: int
    factors: tuple[int, ...]
    index: int

    def describe(self) -> str:
        if all(f == 1 for f in self.factors[: self.index]):
            return f"dim {self.dim}"
        return f"dim {self.dim} viewed as {self.factors}, split along factor {self.index}"


def slice_parameter(full: torch.Tensor, spec: ParamShard, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full`` under ``spec``."""
    return slice_full(full, (spec.dim, spec.factors, spec.index), rank, tp).clone()


class Unsupported(AutoshardError):
    pass


def _fail(node: fx.Node, why: str) -> Unsupported:
    where = node.meta.get("source")
    return Unsupported(
        f"tensor parallelism cannot split {node.format_node()}{f' ({where})' if where else ''}: {why}; "
        "plan with --force tp=1"
    )


# ---------------------------------------------------------------------------------------------
# shapes

_PROBE = {"b": 3, "s": 7}  # stand-ins for the symbolic batch and sequence when grouping view dims


def _shape(node) -> tuple | None:
    if not isinstance(node, fx.Node):
        return None
    shape = node.meta.get("shape")
    return tuple(shape) if isinstance(shape, (tuple, list)) else None


def _num(x) -> int:
    if isinstance(x, int):
        return x
    try:
        return int(x.subs({sym: _PROBE.get(str(sym), 11) for sym in x.free_symbols}))
    except AttributeError:
        return int(x)


def _groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]]:
    """Pair runs of source and destination dims with equal products (size-1 dims stand alone)."""
    a, b = [_num(x) for x in src], [_num(x) for x in dst]
    out, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1 and (j >= len(b) or b[j] != 1):
            out.append(([i], []))
            i += 1
            continue
        if j < len(b) and b[j] == 1 and (i >= len(a) or a[i] != 1):
            out.append(([], [j]))
            j += 1
            continue
        gi, gj = [i], [j]
        pa, pb = a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa *= a[i]
                gi.append(i)
                i += 1
            else:
                pb *= b[j]
                gj.append(j)
                j += 1
        out.append((gi, gj))
    return out


# ---------------------------------------------------------------------------------------------
# propagation

_ELEMENTWISE = {
    "add", "sub", "rsub", "neg", "mul", "div", "truediv", "gelu", "silu", "relu", "sigmoid", "tanh", "exp",
    "pow", "sin", "cos", "rsqrt", "sqrt", "square", "abs", "log", "dropout", "masked_fill", "where", "to",
    "float", "half", "bfloat16", "type_as", "contiguous", "clone", "detach", "softmax", "log_softmax",
    "iadd", "imul", "clamp", "reciprocal", "eq", "ne", "lt", "le", "gt", "ge",
}  # fmt: skip
_WITH_DIM = {"softmax", "log_softmax"}
_ATTENTION = ("scaled_dot_product_attention", "attention_fused", "cp_attention")


@dataclass
class ShardedGraph:
    gm: fx.GraphModule
    tp: int
    shards: dict[str, ParamShard] = field(default_factory=dict)  # parameter name -> how it is split
    origin: dict[str, str] = field(default_factory=dict)  # renamed parameter -> its name in the model
    notes: dict[str, str] = field(default_factory=dict)  # node name -> decision, for emitted comments


class _Propagator:
    def __init__(self, gm: fx.GraphModule, tp: int):
        self.gm, self.tp = gm, tp
        self.shard: dict[fx.Node, Shard] = {}
        self.layout: dict[fx.Node, Shard] = {}  # column / vocab matmul -> its output features' layout
        self.root: dict[fx.Node, fx.Node] = {}  # sharded tensor -> the column matmul it comes from
        self.rows: dict[fx.Node, Shard] = {}  # row matmul -> the layout of its input features
        self.losses: dict[fx.Node, Shard] = {}

    # the column matmuls start regions -----------------------------------------------------
    def start(self, node: fx.Node) -> None:
        shape = _shape(node)
        out = _num(shape[-1])
        if out % self.tp:
            raise _fail(node, f"{out} output features do not divide by tp={self.tp}")
        s = Shard(len(shape) - 1, (out,), 0)
        self.shard[node] = self.layout[node] = s
        self.root[node] = node

    def run(self, nodes: list[fx.Node]) -> None:
        for node in nodes:
            if node in self.shard or node.op in ("placeholder", "output", "get_attr"):
                continue
            sharded = [a for a in node.all_input_nodes if a in self.shard]
            if not sharded:
                continue
            self.visit(node, sharded)

    def visit(self, node: fx.Node, sharded: list[fx.Node]) -> None:
        role = node.meta.get("tp_role")
        name = _op_name(node)
        src = sharded[0]
        s = self.shard[src]
        if role == "row":
            self.rows[node] = s
            return
        if node.meta.get("op_class") == "loss":
            self.losses[node] = s
            return
        if name in ("size", "sym_size", "getattr", "dim", "_assert_tensor_metadata"):
            return  # the local size (what the rewritten views need), dtype, device
        out = self.transfer(node, name, src, s)
        if out is not None:
            for other in sharded[1:]:
                o = self.shard[other]
                shift = len(_shape(node) or ()) - len(_shape(other) or ())
                if name not in (
                    "scaled_dot_product_attention",
                    "attention_fused",
                    "cp_attention",
                    "matmul",
                    "cat",
                ) and (o.dim + shift != out.dim or o.factors != out.factors or o.index != out.index):
                    raise _fail(node, "its inputs are split along different dimensions")
            self.shard[node] = out
            self.root[node] = self.root[src]

    def transfer(self, node: fx.Node, name: str, src: fx.Node, s: Shard) -> Shard | None:
        shape = _shape(node)
        if name in ("view", "reshape", "_unsafe_view", "flatten", "unflatten", "view_as"):
            return self._view(node, src, s)
        if name in ("transpose", "swapaxes"):
            d0, d1 = (_norm_dim(d, len(shape)) for d in _dims(node, 2))
            dim = d1 if s.dim == d0 else d0 if s.dim == d1 else s.dim
            return Shard(dim, s.factors, s.index)
        if name == "permute":
            perm = _perm(node)
            return Shard(perm.index(s.dim), s.factors, s.index)
        if name in ("t",):
            return Shard(1 - s.dim, s.factors, s.index)
        if name == "getitem":
            return self._getitem(node, src, s)
        if name == "slice":  # aten.slice(x, dim, start, end)
            d = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(shape))
            if d == s.dim and _shape(node)[d] != _shape(src)[d]:
                raise _fail(node, "slices the split dimension")
            return s
        if name in ("unsqueeze",):
            d = _norm_dim(_dims(node, 1)[0], len(shape))
            return Shard(s.dim + (1 if d <= s.dim else 0), s.factors, s.index)
        if name in ("expand", "expand_as"):
            return Shard(s.dim + len(shape) - len(_shape(src)), s.factors, s.index)
        if name in _ATTENTION:
            if s.dim != len(_shape(src)) - 3:
                raise _fail(node, "attention's inputs must be split along heads")
            return Shard(len(shape) - 3, s.factors, s.index)
        if name == "matmul":
            rank_in = len(_shape(src))
            if s.dim >= rank_in - 2:
                raise _fail(node, "a matrix product over the split dimension")
            return Shard(s.dim + len(shape) - rank_in, s.factors, s.index)
        if name == "cat":
            d = _norm_dim(node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0), len(shape))
            if d == s.dim:
                raise _fail(node, "concatenation along the split dimension")
            return s
        if name in _ELEMENTWISE:
            if name in _WITH_DIM:
                d = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
                if d is None or _norm_dim(d, len(shape)) == s.dim:
                    raise _fail(node, f"{name} over the split dimension")
            dim = s.dim + len(shape) - len(_shape(src))
            for a in node.all_input_nodes:
                if a in self.shard or _shape(a) is None:
                    continue
                other = _shape(a)
                k = dim - (len(shape) - len(other))
                if 0 <= k < len(other) and _num(other[k]) != 1:
                    raise _fail(node, f"operand {a.name} is not split but spans the split dimension")
            return Shard(dim, s.factors, s.index)
        raise _fail(node, f"no tensor-parallel rule for {name!r} on a split tensor")

    def _view(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard:
        src_shape, dst_shape = _shape(src), _shape(node)
        for gi, gj in _groups(src_shape, dst_shape):
            if s.dim not in gi:
                continue
            if len(gi) == 1 and len(gj) == 1:
                return Shard(gj[0], s.factors, s.index)
            if len(gi) == 1:  # split one dim into several
                sizes = tuple(_num(dst_shape[j]) for j in gj)
                if sizes == s.factors:
                    return Shard(gj[s.index], (sizes[s.index],), 0)
                if len(s.factors) != 1:
                    raise _fail(node, "re-splits an already structured split dimension")
                return self._choose_split(node, src, gj, sizes)
            if len(gj) == 1:  # merge several dims into one
                factors: list[int] = []
                index = 0
                for i in gi:
                    if i == s.dim:
                        index = len(factors) + s.index
                        factors.extend(s.factors)
                    else:
                        factors.append(_num(src_shape[i]))
                return Shard(gj[0], tuple(factors), index)
            raise _fail(node, "a view that both splits and merges the split dimension")
        raise _fail(node, "cannot follow the split dimension through this view")

    def _choose_split(self, node: fx.Node, src: fx.Node, gj: list[int], sizes: tuple[int, ...]) -> Shard:
        """The first output dim of the split that divides by tp and that the rest of the region
        carries through to its row matmuls; the column's weight layout follows."""
        root = self.root[src]
        if self.layout[root].factors != self.shard[src].factors:
            raise _fail(node, "a second, different split of a column's features")
        reasons = []
        for k, size in enumerate(sizes):
            if size % self.tp or size == 1:
                continue
            trial = Shard(gj[k], (size,), 0)
            why = self._try(node, trial)
            if why is None:
                self.layout[root] = Shard(self.layout[root].dim, sizes, k)
                self._refit(root, sizes, k)
                return trial
            reasons.append(why)
        raise _fail(node, reasons[0] if reasons else f"none of {sizes} divides by tp={self.tp}")

    def _refit(self, root: fx.Node, sizes: tuple[int, ...], k: int) -> None:
        for n, sh in list(self.shard.items()):
            if self.root.get(n) is root and len(sh.factors) == 1:
                self.shard[n] = Shard(sh.dim, sizes, k)

    def _try(self, node: fx.Node, trial: Shard) -> str | None:
        """Propagate ``trial`` through everything downstream of ``node`` on a scratch copy."""
        scratch = _Propagator(self.gm, self.tp)
        scratch.shard = dict(self.shard)
        scratch.root = dict(self.root)
        scratch.layout = dict(self.layout)
        scratch.shard[node] = trial
        scratch.root[node] = self.root[node.all_input_nodes[0]]
        downstream, frontier = [], [node]
        seen = {node}
        while frontier:
            for u in frontier.pop().users:
                if u not in seen and u.meta.get("tp_role") != "row":
                    seen.add(u)
                    downstream.append(u)
                    frontier.append(u)
        order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        try:
            scratch.run(sorted(downstream, key=order.__getitem__))
        except Unsupported as e:
            return str(e).split(": ", 1)[-1].rsplit(";", 1)[0]
        return None

    def _getitem(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard:
        index = node.args[1]
        if not isinstance(index, tuple):
            index = (index,)
        rank = len(_shape(src))
        consumed = sum(1 for i in index if i is not None and i is not Ellipsis)
        out_dim, dim = 0, 0
        for item in index:
            if item is Ellipsis:
                skip = rank - consumed
                if dim <= s.dim < dim + skip:
                    return Shard(out_dim + s.dim - dim, s.factors, s.index)
                dim, out_dim = dim + skip, out_dim + skip
            elif item is None:
                out_dim += 1
            elif isinstance(item, slice):
                if dim == s.dim:
                    if item != slice(None, None, None):
                        raise _fail(node, "slices the split dimension")
                    return Shard(out_dim, s.factors, s.index)
                dim, out_dim = dim + 1, out_dim + 1
            elif isinstance(item, int):
                if dim == s.dim:
                    raise _fail(node, "indexes the split dimension")
                dim += 1
            else:
                raise _fail(node, "advanced indexing of a split tensor")
        return Shard(out_dim + s.dim - dim, s.factors, s.index)


def _norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _dims(node: fx.Node, k: int) -> list[int]:
    args = list(node.args[1:]) + [node.kwargs[x] for x in ("dim0", "dim1", "dim") if x in node.kwargs]
    return [int(a) for a in args[:k]]


def _perm(node: fx.Node) -> list[int]:
    args = node.args[1:]
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = args[0]
    rank = len(_shape(node))
    return [_norm_dim(int(a), rank) for a in args]


# ---------------------------------------------------------------------------------------------
# the rewrite


def tensor_parallel(gm: fx.GraphModule, tp: int) -> ShardedGraph:
    """Rewrite ``gm`` (captured and analysed: ``node.meta`` has ``shape``, ``op``, ``tp_role``)
    into the graph every rank of a ``tp``-way group runs. Modules are replaced by local-shaped
    ones on the meta device; materialise them with ``slice_parameter`` and ``ShardedGraph.shards``."""
    result = ShardedGraph(gm, tp)
    if tp == 1:
        return result
    nodes = list(gm.graph.nodes)
    prop = _Propagator(gm, tp)
    for node in nodes:
        if node.meta.get("tp_role") in ("column", "vocab") and node.meta.get("op_class") == "matmul":
            prop.start(node)
    prop.run(nodes)
    graph = gm.graph
    # views: rewrite the constant of the split dimension
    for node, s in prop.shard.items():
        if _op_name(node) in ("view", "reshape", "expand") and node.op in ("call_method", "call_function"):
            _rewrite_sizes(node, s, tp)
    # column (and vocabulary head) matmuls: local weight, f on the input
    f_of: dict[fx.Node, fx.Node] = {}
    for node, layout in prop.layout.items():
        lin = _linear(gm, node)
        x = node.args[0]
        if x not in f_of:
            with graph.inserting_after(x):
                f_of[x] = _inherit(graph.call_function(runtime.copy_to_tp, (x,)), node, "replicated", x)
        node.replace_input_with(x, f_of[x])
        if lin.module:
            local = nn.Linear(lin.in_f, lin.out_f // tp, bias=lin.bias is not None, device="meta")
            _swap(gm, node.target, local)
        else:
            _localise(gm, lin.weight, (lin.out_f // tp, lin.in_f))
            if lin.bias:
                _localise(gm, lin.bias, (lin.out_f // tp,))
        spec = ParamShard(0, layout.factors, layout.index)
        result.shards[lin.weight] = spec
        if lin.bias is not None:
            result.shards[lin.bias] = spec
        role = "vocabulary-parallel head" if node.meta.get("tp_role") == "vocab" else "column-parallel"
        result.notes[node.name] = f"tp={tp}: {role}, out_features {lin.out_f} -> {lin.out_f // tp}"
    # row matmuls: local weight, g on the output, bias after the reduction
    for node, layout in prop.rows.items():
        lin = _linear(gm, node)
        if layout.size != lin.in_f:
            raise _fail(node, f"its input features {layout.size} are not the weight's {lin.in_f}")
        result.shards[lin.weight] = ParamShard(1, layout.factors, layout.index)
        bias_name = None
        if lin.module:
            module = gm.get_submodule(node.target)
            _swap(gm, node.target, nn.Linear(lin.in_f // tp, lin.out_f, bias=False, device="meta"))
            if module.bias is not None:
                bias_name = f"{node.target}_bias".replace(".", "_")
                gm.register_parameter(bias_name, module.bias)
                result.origin[bias_name] = f"{node.target}.bias"
        else:
            _localise(gm, lin.weight, (lin.out_f, lin.in_f // tp))
            if lin.bias is not None:
                bias_name = lin.bias
                node.args = node.args[:2]
                node.kwargs = {k: v for k, v in node.kwargs.items() if k != "bias"}
        with graph.inserting_after(node):
            g = _inherit(graph.call_function(runtime.reduce_from_tp, (node,)), node, "replicated")
        _redirect(node, g)
        if bias_name is not None:
            with graph.inserting_after(g):
                b = _inherit(graph.get_attr(bias_name), node, "replicated")
            with graph.inserting_after(b):
                add = _inherit(graph.call_function(operator.add, (g, b)), node, "replicated")
            _redirect(g, add)
        result.notes[node.name] = (
            f"tp={tp}: row-parallel, in_features {lin.in_f} -> {lin.in_f // tp}, "
            "partial sums all-reduced by reduce_from_tp"
        )
    # vocabulary-parallel embeddings
    for node in nodes:
        if node.meta.get("tp_role") == "vocab" and node.meta.get("op_class") == "embedding":
            if node.op == "call_module":
                module = gm.get_submodule(node.target)
                rows, dim, ids = module.num_embeddings, module.embedding_dim, node.args[0]
                weight_name = f"{node.target}.weight"
            elif node.op == "call_function" and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr":
                weight_name, ids = node.args[0].target, node.args[1]  # aten.embedding(weight, ids)
                rows, dim = _param(gm, weight_name).shape
            else:
                raise _fail(node, "an embedding whose table is not a parameter")
            if rows % tp:
                raise _fail(node, f"vocabulary {rows} does not divide by tp={tp}")
            if node.op == "call_module":
                _swap(gm, node.target, nn.Embedding(rows // tp, dim, device="meta"))
            else:
                _localise(gm, weight_name, (rows // tp, dim))
            with graph.inserting_before(node):
                w = _inherit(graph.get_attr(weight_name), node, "sharded")
            with graph.inserting_after(node):
                emb = _inherit(graph.call_function(runtime.vocab_parallel_embedding, (ids, w)), node, "replicated")
            node.replace_all_uses_with(emb)
            graph.erase_node(node)
            result.shards[weight_name] = ParamShard(0, (rows,), 0)
            result.notes[emb.name] = f"tp={tp}: vocabulary-parallel embedding, rows {rows} -> {rows // tp}"
    # the loss over vocabulary-split logits
    for node, s in prop.losses.items():
        if node.target is runtime.cp_cross_entropy and s.dim == len(_shape(node.args[0])) - 1:
            node.args = (*node.args[:3], True)  # vocabulary-parallel and context-parallel at once
            result.notes[node.name] = f"tp={tp}: vocabulary-parallel cross-entropy over the split logits"
            continue
        if _op_name(node) not in ("cross_entropy", "cross_entropy_loss") or s.dim != len(_shape(node.args[0])) - 1:
            raise _fail(node, "only cross-entropy over logits split along the vocabulary is supported")
        if node.op == "call_function" and _op_name(node) == "cross_entropy_loss":  # aten: positional defaults
            extra = list(node.args[2:]) + [None, 1, -100][len(node.args[2:]) :]
            if extra[0] is not None or (len(extra) > 3 and extra[3]):
                raise _fail(node, "class weights or label smoothing in a vocabulary-split loss")
            reduction, ignore = {0: "none", 1: "mean", 2: "sum"}[extra[1]], extra[2]
        else:
            ignore = node.kwargs.get("ignore_index", -100)
            reduction = node.kwargs.get("reduction", "mean")
        with graph.inserting_after(node):
            ce = graph.call_function(
                runtime.vocab_parallel_cross_entropy, (node.args[0], node.args[1], ignore, reduction)
            )
            _inherit(ce, node, "replicated")
        node.replace_all_uses_with(ce)
        graph.erase_node(node)
        result.notes[ce.name] = f"tp={tp}: vocabulary-parallel cross-entropy over the split logits"
    graph.lint()
    gm.recompile()
    return result


def load_local(sharded: ShardedGraph, full: dict[str, torch.Tensor], rank: int) -> None:
    """Give ``sharded.gm`` TP rank ``rank``'s slices of the full parameters and buffers ``full``
    (named as in the traced module, e.g. ``model.layers.0.attn.wq.weight``)."""
    local = {}
    for name, t in [*sharded.gm.named_parameters(), *sharded.gm.named_buffers()]:
        source = sharded.origin.get(name, name)
        if source not in full:
            raise AutoshardError(f"no value for parameter {source}; the state does not match the model")
        value = full[source]
        spec = sharded.shards.get(source)
        value = slice_parameter(value, spec, rank, sharded.tp) if spec is not None else value.clone()
        if tuple(value.shape) != tuple(t.shape):
            raise AutoshardError(f"{source}: local shape {tuple(value.shape)} but the graph expects {tuple(t.shape)}")
        local[name] = value
    sharded.gm.load_state_dict(local, strict=True, assign=True)


def _local_size(node: fx.Node) -> bool:
    """``x.size(d)`` of a split tensor: already the local size at run time."""
    return _op_name(node) == "size" and node.args[0].meta.get("tp") != "replicated"


_INHERITED = ("nn_module_stack", "module_path", "module_type", "layer", "region", "source")


def _inherit(new: fx.Node, anchor: fx.Node, tp_state: str, shape_of: fx.Node | None = None) -> fx.Node:
    """Give an inserted node its anchor's place in the model (layer, region, module, source) and
    the global shape of ``shape_of`` (default: the anchor)."""
    new.meta.update({k: anchor.meta[k] for k in _INHERITED if k in anchor.meta})
    new.meta["tp"] = tp_state
    new.meta["shape"] = (shape_of or anchor).meta.get("shape")
    return new


def _redirect(old: fx.Node, new: fx.Node) -> None:
    """Every user of ``old`` except ``new`` (which consumes it) reads ``new`` instead."""
    old.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)


@dataclass(frozen=True)
class _Lin:
    weight: str  # parameter names
    bias: str | None
    out_f: int
    in_f: int
    module: bool  # an nn.Linear call (else F.linear / aten.linear on parameters)


def _linear(gm: fx.GraphModule, node: fx.Node) -> _Lin:
    if node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.Linear):
        m = gm.get_submodule(node.target)
        bias = f"{node.target}.bias" if m.bias is not None else None
        return _Lin(f"{node.target}.weight", bias, m.out_features, m.in_features, True)
    if node.op == "call_function" and _op_name(node) == "linear":
        w = node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if (
            isinstance(w, fx.Node)
            and w.op == "get_attr"
            and (b is None or (isinstance(b, fx.Node) and b.op == "get_attr"))
        ):
            out_f, in_f = _param(gm, w.target).shape
            return _Lin(w.target, b.target if b is not None else None, out_f, in_f, False)
    raise _fail(node, "only linear layers whose weight is a parameter are split")


def _param(gm: fx.GraphModule, target: str) -> torch.Tensor:
    owner, _, leaf = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, leaf)


def _localise(gm: fx.GraphModule, target: str, shape: tuple[int, ...]) -> None:
    """Replace parameter ``target`` by an empty one of the local ``shape`` on the meta device."""
    owner, _, leaf = target.rpartition(".")
    module = gm.get_submodule(owner) if owner else gm
    old = getattr(module, leaf)
    setattr(module, leaf, nn.Parameter(torch.empty(shape, dtype=old.dtype, device="meta"), old.requires_grad))


def _swap(gm: fx.GraphModule, target: str, module: nn.Module) -> None:
    parent, _, name = target.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, name, module)


def _rewrite_sizes(node: fx.Node, s: Shard, tp: int) -> None:
    args = list(node.args)
    packed = len(args) == 2 and isinstance(args[1], (tuple, list))
    sizes = list(args[1]) if packed else args[1:]
    if s.dim >= len(sizes):
        return
    value = sizes[s.dim]
    if isinstance(value, int):
        if value == -1:
            return
        sizes[s.dim] = value // tp
    elif isinstance(value, fx.Node) and not _local_size(value):
        raise _fail(node, "the split dimension's size is computed, not a constant; write it as a constant")
    node.args = (args[0], type(args[1])(sizes)) if packed else (args[0], *sizes)


__all__ = ["tensor_parallel", "load_local", "ShardedGraph", "Shard", "ParamShard", "slice_parameter"]
