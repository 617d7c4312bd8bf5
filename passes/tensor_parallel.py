"""Tensor parallelism: Megatron column/row pairs, head split (GQA included), vocabulary-parallel
embedding and cross-entropy, rewritten into the traced graph.

Which matmuls are column-, row- or vocabulary-parallel comes from the graph analysis in
``autoshard.cost_models.sharding`` (``node.meta["tp_role"]``), never from module names. This pass
then follows each column output through the region to its row matmuls and decides, op by op, which
dimension of every tensor is split (``Shard``). Where a view splits a column's features into
several dimensions (``(b, s, 3*h) -> (b, s, 3, heads, head_dim)``) the split lands on the first
dimension the rest of the region carries untouched (heads, not the q/k/v selector), and the
column's weight rows are taken in that layout, strided if need be. Shape constants in views are
rewritten from the propagated shapes (a size computed from the inputs' sizes, Bloom's
``batch * heads``, divided by tp where the heads merged into it are split), an unsplit tensor a
region reads over its split dimension (ALiBi's bias over batch x heads) is cut to this rank's
piece, and the collectives go in as explicit calls:

* ``copy_to_tp`` (f) once per input of a group of column matmuls,
* ``reduce_from_tp`` (g) after each row matmul, its bias added after the reduction,
* ``vocab_parallel_embedding`` for an embedding of the vocabulary,
* ``vocab_parallel_cross_entropy`` for the loss over vocabulary-split logits.

Key/value heads fewer than the TP degree (grouped-query attention, 1 < heads < tp, tp a multiple
of them) are shared, as Megatron shares them: their projection's weight stays whole on every rank
and the graph cuts out the rows of the one head this rank's query heads read, its gradient summed
over TP (``partial_grads``); a key/value projection of one head is kept whole the same way.

How a split passes through each op is the op's row in ``autoshard.ir.ops.RULES`` (its
``tp`` field): one transfer rule per kind (``_TRANSFER``), the same rows the planner's sharding
analysis reads. Where no rule applies the pass raises ``Refusal(axis="tp")`` naming the op's line.

The result is the same code for every TP rank; ``decisions(gm).shards`` says how each parameter is sliced,
and ``slice_parameter`` cuts rank r's piece out of a full tensor.
"""

from __future__ import annotations

import math
import operator
from collections import ChainMap
from dataclasses import dataclass

import sympy
import torch
from torch import fx, nn

from autoshard import runtime
from autoshard.cost_models.sharding import reaches_attention
from autoshard.errors import AutoshardError
from autoshard.ir import ops
from autoshard.passes._graph import note, place
from autoshard.passes._graph import op_name as _op_name
from autoshard.passes.contract import Refusal, RewriteContext, decisions
from autoshard.passes.pipeline_split import tied_parameters
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
    parts: tuple[int, ...] = ()  # or: the dimension is these unequal parts end to end, each split

    @property
    def size(self) -> int:
        return math.prod(self.factors)


@dataclass(frozen=True)
class ParamShard:
    dim: int
    factors: tuple[int, ...]
    index: int
    parts: tuple[int, ...] = ()
    axis: str = "tp"  # the group the pieces are spread over: tp, or ep for stacked expert weights

    def describe(self) -> str:
        if self.parts:
            return f"dim {self.dim} as parts {self.parts}, each split"
        if all(f == 1 for f in self.factors[: self.index]):
            return f"dim {self.dim}"
        return f"dim {self.dim} viewed as {self.factors}, split along factor {self.index}"


def slice_parameter(full: torch.Tensor, spec: ParamShard, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full`` under ``spec``."""
    return slice_full(full, (spec.dim, spec.factors, spec.index, spec.parts), rank, tp).clone()


def _fail(node: fx.Node, why: str, tp: int | None = None, divides: int | None = None) -> Refusal:
    """``tp`` where the obstacle is that degree (or ``divides`` N, a size every degree must
    divide); None where it is the model, refusing every degree above 1 in one round."""
    return Refusal.at(node, "tensor parallelism cannot split {node}", why, "tp", value=tp, divides=divides)


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
# propagation: one transfer rule per kind of ``ops.TP_RULES``, chosen by the op's row


class _Propagator:
    def __init__(self, gm: fx.GraphModule, tp: int):
        self.gm, self.tp = gm, tp
        self.shard: dict[fx.Node, Shard] = {}
        self.items: dict[fx.Node, tuple[Shard | None, ...]] = {}  # a split's outputs, read by getitem
        self.layout: dict[fx.Node, Shard] = {}  # column / vocab matmul -> its output features' layout
        self.root: dict[fx.Node, fx.Node] = {}  # sharded tensor -> the column matmul it comes from
        self.rows: dict[fx.Node, Shard] = {}  # row matmul -> the layout of its input features
        self.losses: dict[fx.Node, Shard] = {}
        self.sizes: dict[fx.Node, tuple[int, object]] = {}  # node -> (argument index, local value) to write
        self.rewrites: dict[fx.Node, tuple] = {}  # node -> its arguments on a shard (a slice's local range)
        self.entering: dict[fx.Node, set[fx.Node]] = {}  # unsplit tensor read in a region -> its readers there
        # an unsplit tensor over the split dimension read in a region -> (the piece, its readers)
        self.cuts: dict[fx.Node, tuple[Shard, set[fx.Node]]] = {}
        self.module_partials: set[str] = set()  # parameters of norm modules run per head
        self.params: dict[fx.Node, Shard] = {}  # a parameter read whole in a region -> its split
        self.partial_sums: dict[fx.Node, str] = {}  # a sum or mean over the split dimension -> which
        # a column whose parts of one head stay whole on every rank (multi-query attention's key
        # and value in a fused projection) -> (its parts in heads, features per head)
        self.whole_heads_of: dict[fx.Node, tuple[tuple[int, ...], int]] = {}
        # a key or value column of fewer heads than tp (1 < heads < tp) -> its heads: each rank
        # computes the one head its query heads read, shared with tp/heads ranks (Megatron's)
        self.shared_heads: dict[fx.Node, int] = {}
        self._order: dict[fx.Node, int] | None = None

    @property
    def order(self) -> dict[fx.Node, int]:
        """Each node's place in the graph (propagation leaves the graph as it is)."""
        if self._order is None:
            self._order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        return self._order

    def fail(self, node: fx.Node, why: str, divides: int | None = None) -> Refusal:
        return _fail(node, why, self.tp if divides else None, divides)

    # the column matmuls start regions -----------------------------------------------------
    def start(self, node: fx.Node) -> None:
        shape = _shape(node)
        out = _num(shape[-1])
        if out % self.tp:
            raise self.fail(node, f"{out} output features do not divide by tp={self.tp}", divides=out)
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
        row = ops.rule_of(node)
        kind = row.tp if row is not None else None
        src = sharded[0]
        s = self.shard[src]
        if row is not None and row.metadata in ("size", "attr"):
            return  # the local size (what the rewritten views need), dtype, device
        if kind == "linear":
            if node.meta.get("tp_role") != "row":
                raise self.fail(node, "a linear layer reads a split tensor but is not paired as row-parallel")
            self.rows[node] = s
            return
        if kind == "loss":
            self.losses[node] = s
            return
        transfer = _TRANSFER.get(kind)
        if transfer is None:
            raise self.fail(node, f"no tensor-parallel rule for {_op_name(node)!r} on a split tensor")
        out = transfer(self, node, src, s)
        if isinstance(out, tuple):
            self.items[node] = out
            out = next((x for x in out if x is not None), None)
        if out is None:
            return
        if kind not in _CHECKS_OWN_INPUTS:
            for other in sharded[1:]:
                o = self.shard[other]
                shift = len(_shape(node) or ()) - len(_shape(other) or ())
                if o.dim + shift != out.dim or o.factors != out.factors or o.index != out.index:
                    raise self.fail(node, "its inputs are split along different dimensions")
        self.shard[node] = out
        self.root[node] = self.root[src]

    # transfer rules, one per kind --------------------------------------------------------
    def pointwise(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard:
        shape = _shape(node)
        dim = s.dim + len(shape) - len(_shape(src))
        for a in node.all_input_nodes:
            if a not in self.shard:
                self._broadcast(node, a, dim, len(shape))
        return Shard(dim, s.factors, s.index)

    def softmax(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard:
        dims = ops.dims_arg(node, len(_shape(node)))
        if dims is None or s.dim in dims:
            raise self.fail(node, f"{_op_name(node)} over the split dimension")
        return self.pointwise(node, src, s)

    def reduce(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard | None:
        """Over other dimensions the split passes (a per-head norm's mean over the head's
        features); a sum or mean over the split dimension is this rank's part of it, completed by
        an all-reduce after the node (``partial_sums``), and the result is replicated."""
        rank = len(_shape(src))
        dims = ops.dims_arg(node, rank)
        if dims is None:
            raise self.fail(node, f"{_op_name(node)} over every dimension of a split tensor")
        if s.dim not in dims:
            keep = _keepdim(node)
            return Shard(s.dim - (0 if keep else sum(1 for d in dims if d < s.dim)), s.factors, s.index)
        if _op_name(node) not in ("sum", "mean") or node.meta.get("dtype") not in (None, *_FLOATS):
            raise self.fail(node, f"{_op_name(node)} over the split dimension")
        self.partial_sums[node] = _op_name(node)
        return None

    def norm(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard:
        """``layer_norm(x, shape, w, b)`` / ``rms_norm(x, shape, w)`` over trailing features that
        are not the split dimension (q/k norms per head): per-head weights broadcast, and enter."""
        if node.args[0] is not src:
            raise self.fail(node, "a split norm weight")
        module = self.gm.get_submodule(node.target) if node.op == "call_module" else None
        normalised = getattr(module, "normalized_shape", None) if module is not None else node.args[1]
        rank = len(_shape(src))
        if normalised is None or s.dim >= rank - len(normalised):
            raise self.fail(node, f"{_op_name(node)} normalises over the split dimension")
        if module is not None:  # its weight sees this rank's heads only: a partial gradient
            self.module_partials.update(f"{node.target}.{n}" for n, p in module.named_parameters() if p.requires_grad)
        return self.pointwise(node, src, s)

    def view(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard | None:
        """A column's whole output viewed as one head that only attention reads (multi-query
        attention's key or value projection) is not split: every rank keeps it whole (None)."""
        src_shape, dst_shape = _shape(src), _shape(node)
        if (
            self.root[src] is src
            and len(dst_shape) == len(src_shape) + 1
            and _num(dst_shape[-2]) == 1
            and _num(dst_shape[-1]) == _num(src_shape[-1])
            and reaches_attention(node)
        ):
            self.whole_heads_of[src] = ((1,), _num(src_shape[-1]))
            return None
        for gi, gj in _groups(src_shape, dst_shape):
            if s.dim not in gi:
                continue
            if s.parts and (len(gi), len(gj)) != (1, 1):
                raise self.fail(node, "a view of a split dimension made of unequal parts")
            if s.parts:
                return Shard(gj[0], s.factors, s.index, s.parts)
            if len(gi) == 1 and len(gj) == 1:
                return Shard(gj[0], s.factors, s.index)
            if len(gi) == 1:  # split one dim into several
                sizes = tuple(_num(dst_shape[j]) for j in gj)
                if sizes == s.factors:
                    return Shard(gj[s.index], (sizes[s.index],), 0)
                if len(s.factors) != 1:
                    raise self.fail(node, "re-splits an already structured split dimension")
                return self._choose_split(node, src, gj, sizes)
            if len(gj) == 1 and self.root[src] in self.shared_heads:
                raise self.fail(node, "merges key/value heads that TP ranks share with other dimensions")
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
            raise self.fail(node, "a view that both splits and merges the split dimension")
        raise self.fail(node, "cannot follow the split dimension through this view")

    def complex(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard:
        """``view_as_complex`` drops the trailing (real, imaginary) pair dimension, ``view_as_real``
        adds it: the split (heads, before the pairs) stays where it is, the pairs stay whole."""
        if s.dim >= len(_shape(node)):
            raise self.fail(node, "splits the (real, imaginary) pairs of a complex view")
        return s

    def transpose(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard:
        rank = len(_shape(node))
        d0, d1 = (0, 1) if _op_name(node) == "t" else (_norm_dim(d, rank) for d in _dims(node, 2))
        dim = d1 if s.dim == d0 else d0 if s.dim == d1 else s.dim
        return Shard(dim, s.factors, s.index)

    def permute(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard:
        return Shard(_perm(node).index(s.dim), s.factors, s.index)

    def getitem(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard | None:
        if src in self.items:  # one output of a split
            return self.items[src][node.args[1]]
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
                        raise self.fail(node, "slices the split dimension")
                    return Shard(out_dim, s.factors, s.index)
                dim, out_dim = dim + 1, out_dim + 1
            elif isinstance(item, int):
                if dim == s.dim:
                    raise self.fail(node, "indexes the split dimension")
                dim += 1
            else:
                raise self.fail(node, "advanced indexing of a split tensor")
        return Shard(out_dim + s.dim - dim, s.factors, s.index)

    def slice(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard:
        """``aten.slice(x, dim, start, end)``, ``narrow(x, dim, start, length)``."""
        shape = _shape(node)
        d = _norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(shape))
        if d == s.dim and shape[d] != _shape(src)[d]:
            return self._part(node, src, s)
        return s

    def _part(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard:
        """A slice of a column's output features (Phi-3's fused q/k/v, of unequal widths): the
        features become the parts the slices of ``src`` cut, each split over the ranks, the
        weight's rows taken part by part; the slice takes its part's local range."""
        start, end = _slice_range(node, _num(_shape(src)[s.dim]))
        parts = self._parts_of(node, src, s)
        bounds = [sum(parts[:k]) for k in range(len(parts) + 1)]
        if start not in bounds or end not in bounds:
            raise self.fail(node, "slices the split dimension across the parts its other slices cut")
        first, last = bounds.index(start), bounds.index(end)
        if last != first + 1:
            raise self.fail(node, "slices several parts of the split dimension at once")
        local = bounds[first] // self.tp
        width = parts[first] // self.tp
        tail = (width,) if _op_name(node) == "narrow" else (local + width, *node.args[4:])
        self.rewrites[node] = (*node.args[:2], local, *tail)
        return Shard(s.dim, (parts[first],), 0)

    def _parts_of(self, node: fx.Node, src: fx.Node, s: Shard) -> tuple[int, ...]:
        """The parts ``src``'s slices (or an unequal split) cut its split features into; the
        column's layout becomes them (once, the same for every slice)."""
        root = self.root[src]
        size = _num(_shape(src)[s.dim])
        if s.parts:
            return s.parts
        layout = self.layout[root]
        heads = layout.factors != s.factors and self._heads_of(layout, s)
        if len(s.factors) != 1 or layout.parts or (layout.factors != s.factors and not heads):
            raise self.fail(node, "slices an already structured split dimension")
        cuts = {0, size}
        for u in src.users:
            if _op_name(u) in ("slice", "narrow") and _norm_dim(u.args[1], len(_shape(src))) == s.dim:
                cuts.update(_slice_range(u, size))
            elif _op_name(u) == "split_with_sizes" or (_op_name(u) == "split" and isinstance(u.args[1], list)):
                sizes = [int(x) for x in u.args[1]]
                cuts.update(sum(sizes[:k]) for k in range(len(sizes) + 1))
        bounds = sorted(cuts)
        parts = tuple(b - a for a, b in zip(bounds, bounds[1:]))
        whole = heads and 1 in parts and all(p % self.tp == 0 for p in parts if p != 1)
        if any(p % self.tp for p in parts) and not whole:
            raise self.fail(
                node, f"parts {parts} of the split dimension do not divide by tp={self.tp}", divides=math.gcd(*parts)
            )
        if heads:  # parts of heads: the weight's rows are those parts of whole heads
            inner = layout.size // size
            self.layout[root] = self.shard[root] = Shard(layout.dim, (layout.size,), 0, tuple(p * inner for p in parts))
            if whole:
                self.whole_heads_of[root] = (parts, inner)
            self.shard[src] = Shard(s.dim, s.factors, s.index, parts)
            return parts
        self.layout[root] = Shard(layout.dim, layout.factors, layout.index, parts)
        self._refit(root, layout.factors, layout.index, parts)
        return parts

    def _heads_of(self, layout: Shard, s: Shard) -> bool:
        """``s`` splits whole heads of a column whose features ``layout`` describes: its one factor
        is the layout's first (heads, then each head's features), or the plain features viewed so."""
        plain = len(layout.factors) == 1 and not layout.parts
        return len(s.factors) == 1 and layout.size % s.size == 0 and (plain or layout.factors[0] == s.size)

    def local_units(self, part: int) -> int:
        """This rank's share of a part of ``part`` heads: 1/tp of it, or one whole head every rank keeps."""
        return 1 if part == 1 else part // self.tp

    def select(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard:
        d = _norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs["dim"], len(_shape(src)))
        if d == s.dim:
            raise self.fail(node, "selects along the split dimension")
        return Shard(s.dim - (d < s.dim), s.factors, s.index)

    def split(self, node: fx.Node, src: fx.Node, s: Shard) -> tuple[Shard | None, ...]:
        if self.root[src] in self.shared_heads:
            raise self.fail(node, "splits key/value heads that TP ranks share (fewer heads than tp)")
        shapes = node.meta.get("shapes") or ()
        rank = len(_shape(src))
        name = _op_name(node)
        d = node.args[1 if name == "unbind" else 2] if len(node.args) > (1 if name == "unbind" else 2) else None
        d = _norm_dim(node.kwargs.get("dim", 0) if d is None else d, rank)
        if name == "unbind":
            if d == s.dim:
                raise self.fail(node, "unbinds the split dimension")
            return tuple(Shard(s.dim - (d < s.dim), s.factors, s.index) for _ in shapes)
        if d != s.dim:
            return tuple(s for _ in shapes)
        parts = {_num(shape[d]) for shape in shapes}
        if len(parts) != 1 or s.parts:
            whole = self._parts_of(node, src, s)
            sizes = [_num(shape[d]) for shape in shapes]
            if list(whole) != sizes:
                raise self.fail(node, "splits the split dimension unlike its other slices")
            kept = self.root[src] in self.whole_heads_of
            self.sizes[node] = (1, [self.local_units(x) if kept else x // self.tp for x in sizes])
            # a head every rank keeps whole is not split: attention reads it as one key/value head
            return tuple(None if kept and x == 1 else Shard(d, (x,), 0) for x in sizes)
        n, c = len(shapes), parts.pop()
        if c % self.tp:
            raise self.fail(node, f"parts of {c} along the split dimension do not divide by tp={self.tp}", divides=c)
        if s.factors != (n, c) or s.index != 1:
            root = self.root[src]
            if len(s.factors) != 1 or self.layout[root].factors != s.factors:
                raise self.fail(node, "splits an already structured split dimension")
            self.layout[root] = Shard(self.layout[root].dim, (n, c), 1)
            self._refit(root, (n, c), 1)
        if name in ("split", "split_with_sizes"):  # sizes in the argument: each part's local size
            sizes = node.args[1] if len(node.args) > 1 else node.kwargs["split_size"]
            self.sizes[node] = (1, c // self.tp if isinstance(sizes, int) else [c // self.tp] * n)
        return tuple(Shard(d, (c,), 0) for _ in shapes)

    def unsqueeze(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard:
        d = _norm_dim(_dims(node, 1)[0], len(_shape(node)))
        return Shard(s.dim + (1 if d <= s.dim else 0), s.factors, s.index)

    def squeeze(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard:
        shape = _shape(src)
        given = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if given is None:
            if _num(shape[s.dim]) // self.tp == 1:
                raise self.fail(node, "squeeze() would drop the split dimension, of size 1 on each rank")
            dims = [i for i, x in enumerate(shape) if _num(x) == 1]
        else:
            dims = [_norm_dim(x, len(shape)) for x in (given if isinstance(given, (tuple, list)) else (given,))]
            dims = [x for x in dims if _num(shape[x]) == 1]
        return Shard(s.dim - sum(1 for x in dims if x < s.dim), s.factors, s.index)

    def expand(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard:
        return Shard(s.dim + len(_shape(node)) - len(_shape(src)), s.factors, s.index)

    def matmul(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard:
        """A batch dimension (heads) passes; an added term before the two factors (``baddbmm``'s
        ALiBi bias over batch x heads) is split alike, or cut to this rank's piece."""
        rank_in = len(_shape(src))
        if s.dim >= rank_in - 2:
            raise self.fail(node, "a matrix product over the split dimension")
        out = Shard(s.dim + len(_shape(node)) - rank_in, s.factors, s.index)
        for a in node.args[:-2]:
            if a in self.shard and self.shard[a] != out:
                raise self.fail(node, "its added term is split unlike its product")
            if isinstance(a, fx.Node) and a not in self.shard:
                self._broadcast(node, a, out.dim, len(_shape(node)))
        return out

    def attention(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard | tuple[Shard | None, ...]:
        """q, k and v each split along their own heads (fewer key heads with GQA); that none is
        left whole is checked once the propagation is complete (``whole_heads``)."""
        args = ops.call_args(node)
        for x in (args["query"], args["key"], args["value"]):
            if x in self.shard and self.shard[x].dim != len(_shape(x)) - 3:
                raise self.fail(node, "attention's inputs must be split along heads")
        if "shapes" in node.meta:  # an aten kernel: the output, the log-sum-exp, ...
            return tuple(Shard(s.dim, s.factors, s.index) if x is not None else None for x in node.meta["shapes"])
        return Shard(len(_shape(node)) - 3, s.factors, s.index)

    def cat(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard:
        d = _norm_dim(node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0), len(_shape(node)))
        if d == s.dim:
            raise self.fail(node, "concatenation along the split dimension")
        self._same_inputs(node, s)
        return s

    def stack(self, node: fx.Node, src: fx.Node, s: Shard) -> Shard:
        d = _norm_dim(node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0), len(_shape(node)))
        self._same_inputs(node, s)
        return Shard(s.dim + (1 if d <= s.dim else 0), s.factors, s.index)

    def whole_heads(self) -> None:
        """Every split attention reads q, k and v split along heads, but a key or value of one
        head, which every query head reads: a whole input of more heads (a key made by a matmul
        the analysis left replicated) would meet another number of heads on each rank."""
        for node in [n for n in self.shard if _is_attention(n)]:
            args = ops.call_args(node)
            for name in ("query", "key", "value"):
                x, shape = args[name], _shape(args[name])
                if x not in self.shard and shape is not None and (name == "query" or _num(shape[-3]) != 1):
                    raise self.fail(node, f"its {name} {x.name} keeps all {shape[-3]} heads, another input is split")

    # helpers ----------------------------------------------------------------------------
    def _same_inputs(self, node: fx.Node, s: Shard) -> None:
        """Every tensor of a cat/stack is split as ``s`` (a broadcast expanded to the split
        dimension expands to the local size)."""
        for a in node.args[0]:
            if a in self.shard:
                if self.shard[a] != s:
                    raise self.fail(node, "its inputs are split along different dimensions")
            elif isinstance(a, fx.Node):
                self._broadcast(node, a, s.dim, len(_shape(a)), localise=s)

    def _broadcast(self, node: fx.Node, a: fx.Node, dim: int, rank: int, localise: Shard | None = None) -> None:
        """An unsplit operand must not span the split dimension ``dim`` (of a rank-``rank``
        result), unless it is an ``expand`` of a size-1 dimension there, which then expands to
        the local size (``localise``: the split it takes)."""
        other = _shape(a)
        if other is None:
            return
        k = dim - (rank - len(other))
        if not (0 <= k < len(other)) or _num(other[k]) == 1:
            self._enters(a, node)
            return
        row = ops.rule_of(a)
        base = _shape(a.args[0]) if a.args and isinstance(a.args[0], fx.Node) else None
        if localise is not None and row is not None and row.tp == "expand" and base is not None and len(a.users) == 1:
            j = k - (len(other) - len(base))
            if j < 0 or _num(base[j]) == 1:
                self.shard[a] = Shard(k, localise.factors, localise.index)
                self.root[a] = self.root[next(iter(x for x in node.args[0] if x in self.shard))]
                self._enters(a.args[0], a)
                return
        param, casts = _cast_of_parameter(a)
        if param is not None and localise is None and _num(other[k]) == _num(_shape(node)[dim]):
            # a parameter over the split features (OLMo2's q/k norm weight over all heads,
            # Cohere's (heads, head_dim) one, read through a cast): this rank's slice of it, in
            # the region's layout
            src = next(x for x in node.all_input_nodes if x in self.shard)
            if self.root[src] in self.shared_heads:
                raise self.fail(node, f"a per-head parameter {param.target} of key/value heads that TP ranks share")
            s = self.shard[src]
            self.params[param] = Shard(k, s.factors, s.index, s.parts)
            for c in casts:
                self.shard[c], self.root[c] = self.params[param], self.root[src]
            return
        if localise is None and _num(other[k]) == _num(_shape(node)[dim]):
            # a tensor over the split dimension made outside the region (ALiBi's bias of slope_h *
            # key position over batch x heads): this rank's piece of it
            s = next(self.shard[x] for x in node.all_input_nodes if x in self.shard)
            self._cut(node, a, Shard(k, s.factors, s.index, s.parts))
            return
        raise self.fail(node, f"operand {a.name} is not split but spans the split dimension")

    def _cut(self, node: fx.Node, a: fx.Node, s: Shard) -> None:
        """``node`` reads this rank's piece of the unsplit ``a`` (``_cut_entering``): one
        contiguous block of the split factor per index of the factors before it, which must be
        whole heads and not depend on the batch or sequence after it."""
        mid, inner = s.factors[s.index], math.prod(s.factors[s.index + 1 :])
        ones = {x: 1 for x in getattr(_shape(a)[s.dim], "free_symbols", ())}
        if s.parts or mid % self.tp or int(sympy.sympify(_shape(a)[s.dim]).subs(ones)) % (mid * inner):
            raise self.fail(node, f"operand {a.name} is not split but spans the split dimension")
        if self.cuts.setdefault(a, (s, set()))[0] != s:
            raise self.fail(node, f"operand {a.name} is read split in two ways")
        self.cuts[a][1].add(node)
        self._enters(a, node)

    def _enters(self, a: fx.Node, reader: fx.Node) -> None:
        """A replicated tensor that needs a gradient enters the region: each rank's gradient of
        it covers its own slice only, so it goes through ``copy_to_tp`` (f: all-reduce backward)."""
        if a.meta.get("requires_grad"):
            self.entering.setdefault(a, set()).add(reader)

    def _choose_split(self, node: fx.Node, src: fx.Node, gj: list[int], sizes: tuple[int, ...]) -> Shard:
        """The first output dim of the split that divides by tp and that the rest of the region
        carries through to its row matmuls; the column's weight layout follows."""
        root = self.root[src]
        # a part of a split column (its layout is already (parts, features)): splitting the
        # first factor in contiguous blocks is splitting the whole, so the layout stays
        plain = self.layout[root].factors == self.shard[src].factors
        reasons = []
        if plain and self._shares_heads(node, src, sizes[0]):
            trial = Shard(gj[0], (sizes[0],), 0)
            self.shared_heads[root] = sizes[0]
            why = self._try(node, trial)
            if why is None:
                self.layout[root] = Shard(self.layout[root].dim, sizes, 0)
                self._refit(root, sizes, 0)
                return trial
            del self.shared_heads[root]
            reasons.append(why)
        for k, size in enumerate(sizes if plain else sizes[:1]):
            if size % self.tp or size == 1:
                continue
            trial = Shard(gj[k], (size,), 0)
            why = self._try(node, trial)
            if why is None:
                if plain:
                    self.layout[root] = Shard(self.layout[root].dim, sizes, k)
                    self._refit(root, sizes, k)
                return trial
            reasons.append(why)
        if not plain and not reasons:
            raise self.fail(node, "a second, different split of a column's features")
        raise self.fail(node, reasons[0] if reasons else f"none of {sizes} divides by tp={self.tp}")

    def _shares_heads(self, node: fx.Node, src: fx.Node, heads: int) -> bool:
        """``node`` views a column's whole output as ``heads`` heads, fewer than tp (and dividing
        it), that only attention reads: a key or value of grouped-query attention, each head shared
        by tp/heads ranks."""
        return self.root[src] is src and 1 < heads < self.tp and self.tp % heads == 0 and reaches_attention(node)

    def _refit(self, root: fx.Node, sizes: tuple[int, ...], k: int, parts: tuple[int, ...] = ()) -> None:
        """Every tensor split as ``root``'s plain features takes its new layout."""
        for n, sh in list(self.shard.items()):
            if self.root.get(n) is root and len(sh.factors) == 1:
                self.shard[n] = Shard(sh.dim, sizes, k, parts)

    def _try(self, node: fx.Node, trial: Shard) -> str | None:
        """Propagate ``trial`` through everything downstream of ``node`` up to attention (whose output
        the query heads make) on a scratch copy."""
        scratch = _Propagator(self.gm, self.tp)
        # the trial writes over the propagator's maps without copying them (a copy per trial
        # made this quadratic in the graph: 480 trials of 5,000-node maps at 2T)
        scratch.shard = ChainMap({}, self.shard)
        scratch.items = ChainMap({}, self.items)
        scratch.root = ChainMap({}, self.root)
        scratch.layout = ChainMap({}, self.layout)
        scratch.shared_heads = ChainMap({}, self.shared_heads)
        scratch._order = self.order
        scratch.shard[node] = trial
        scratch.root[node] = self.root[node.all_input_nodes[0]]
        downstream, frontier = [], [node]
        seen = {node}
        while frontier:
            for u in frontier.pop().users:
                if u not in seen and u.meta.get("tp_role") != "row":
                    seen.add(u)
                    downstream.append(u)
                    if not _is_attention(u):  # its output has the query's heads, which the trial may not reach
                        frontier.append(u)
        try:
            scratch.run(sorted(downstream, key=self.order.__getitem__))
        except Refusal as e:
            return str(e).split(": ", 1)[-1].rsplit(";", 1)[0]
        return None


# ops.TP_RULES kind -> the rule that carries a shard through it ("linear" and "loss" end a region)
_TRANSFER = {
    "pointwise": _Propagator.pointwise,
    "softmax": _Propagator.softmax,
    "reduce": _Propagator.reduce,
    "norm": _Propagator.norm,
    "view": _Propagator.view,
    "complex": _Propagator.complex,
    "transpose": _Propagator.transpose,
    "permute": _Propagator.permute,
    "getitem": _Propagator.getitem,
    "slice": _Propagator.slice,
    "select": _Propagator.select,
    "split": _Propagator.split,
    "unsqueeze": _Propagator.unsqueeze,
    "squeeze": _Propagator.squeeze,
    "expand": _Propagator.expand,
    "matmul": _Propagator.matmul,
    "attention": _Propagator.attention,
    "cat": _Propagator.cat,
    "stack": _Propagator.stack,
}
IMPLEMENTED = frozenset(_TRANSFER) | set(ops.TP_REGION_ENDS)  # every kind of ops.TP_RULES
_CHECKS_OWN_INPUTS = ("attention", "matmul", "cat", "stack")


_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _cast_of_parameter(a: fx.Node) -> tuple[fx.Node | None, list[fx.Node]]:
    """The parameter ``a`` reads (itself, or through casts each read only by the next) and those
    casts; ``(None, [])`` where ``a`` is something else."""
    casts = []
    while a.meta.get("op") in ops.CASTS and len(a.users) == 1 and isinstance(a.args[0], fx.Node):
        casts.append(a)
        a = a.args[0]
    return (a, casts) if a.op == "get_attr" else (None, [])


def _is_attention(node: fx.Node) -> bool:
    row = ops.rule_of(node)
    return row is not None and row.tp == "attention"


def _keepdim(node: fx.Node) -> bool:
    """A reduction's ``keepdim`` (positional 2 where it is a bool, as aten's sum/mean/amax have it)."""
    if "keepdim" in node.kwargs:
        return bool(node.kwargs["keepdim"])
    return len(node.args) > 2 and isinstance(node.args[2], bool) and node.args[2]


def _slice_range(node: fx.Node, size: int) -> tuple[int, int]:
    """``(start, end)`` of ``aten.slice(x, dim, start, end)`` / ``narrow(x, dim, start, length)``,
    clamped to ``size``; a step other than 1 is refused by the caller's parts check."""
    args = list(node.args) + [None] * 5
    if _op_name(node) == "narrow":
        return int(args[2]), int(args[2]) + int(args[3])
    start = 0 if args[2] is None else int(args[2])
    end = size if args[3] is None else min(int(args[3]), size)
    step = 1 if args[4] is None else int(args[4])
    if step != 1 or start < 0 or end < 0:
        return -1, -1
    return start, end


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


def tensor_parallel(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    """Rewrite ``gm`` (captured and analysed: ``node.meta`` has ``shape``, ``op``, ``tp_role``)
    into the graph every rank of a ``ctx.tp``-way group runs. Modules are replaced by local-shaped
    ones on the meta device; ``decisions(gm).shards`` says how to cut each parameter (``slice_parameter``),
    ``decisions(gm).origin`` the model's name of each renamed one, ``meta["note"]`` each decision."""
    if ctx.tp == 1:
        return gm
    nodes = list(gm.graph.nodes)  # as traced: the steps below insert and erase nodes
    prop = _propagate(gm, nodes, ctx.tp)
    _rewrite_view_sizes(prop, ctx.tp)
    _split_columns(gm, ctx, prop)
    _cut_entering(gm, ctx.tp, prop)
    _split_rows(gm, ctx, prop)
    _split_embeddings(gm, ctx, nodes)
    _split_losses(gm, ctx, prop)
    _complete_partial_sums(gm, ctx, prop)
    _split_region_parameters(gm, ctx, prop)
    decisions(gm).partial_grads.extend(sorted(prop.module_partials))
    _tie_shards(gm, decisions(gm).shards)
    gm.graph.lint()
    gm.recompile()
    return gm


def _propagate(gm: fx.GraphModule, nodes: list[fx.Node], tp: int) -> _Propagator:
    """Follow each column (and vocabulary head) matmul's split through its region."""
    prop = _Propagator(gm, tp)
    for node in nodes:
        if node.meta.get("tp_role") in ("column", "vocab") and node.meta.get("op_class") == "matmul":
            prop.start(node)
    prop.run(nodes)
    prop.whole_heads()
    return prop


def _rewrite_view_sizes(prop: _Propagator, tp: int) -> None:
    """Views and splits: rewrite the constant of the split dimension to its local size."""
    for node, s in prop.shard.items():
        if _op_name(node) in ("view", "reshape", "expand") and node.op in ("call_method", "call_function"):
            whole = s.parts and prop.root[node] in prop.whole_heads_of
            group = prop.shared_heads.get(prop.root[node], tp)  # shared heads: one of them a rank
            _rewrite_sizes(node, s, group, sum(map(prop.local_units, s.parts)) if whole else None)
    for node, (i, value) in prop.sizes.items():
        node.args = (*node.args[:i], value, *node.args[i + 1 :])
    for node, args in prop.rewrites.items():
        node.args = args


def _split_columns(gm: fx.GraphModule, ctx: RewriteContext, prop: _Propagator) -> None:
    """Column (and vocabulary head) matmuls: local weight, f on the input and on replicated reads."""
    tp, graph = ctx.tp, gm.graph
    f_of: dict[fx.Node, fx.Node] = {}
    for node, layout in prop.layout.items():
        lin = _linear(gm, node, tp)
        x = node.args[lin.x]
        if x not in f_of:
            with graph.inserting_after(x):
                f_of[x] = place(graph.call_function(runtime.copy_to_tp, (x,)), node, x, tp="replicated")
        node.replace_input_with(x, f_of[x])
        if node in prop.whole_heads_of:
            _keep_whole_heads(gm, tp, node, lin, *prop.whole_heads_of[node])
            continue
        if node in prop.shared_heads:
            _share_heads(gm, tp, node, lin, prop.shared_heads[node])
            continue
        if lin.module:
            local = nn.Linear(lin.in_f, lin.out_f // tp, bias=lin.bias is not None, device="meta")
            _swap(gm, node.target, local)
        else:
            _localise(gm, lin.weight, lin.local(0, tp))
            if lin.bias:
                _localise(gm, lin.bias, (lin.out_f // tp,))
        decisions(gm).shards[lin.weight] = lin.spec(0, layout)
        if lin.bias is not None:
            decisions(gm).shards[lin.bias] = ParamShard(0, layout.factors, layout.index, layout.parts)
        role = "vocabulary-parallel head" if node.meta.get("tp_role") == "vocab" else "column-parallel"
        note(node, f"tp={tp}: {role}, out_features {lin.out_f} -> {lin.out_f // tp}")
    # replicated tensors read inside a region: f on them too, so their gradients are summed
    for x, readers in prop.entering.items():
        if x.op == "get_attr":  # a parameter (a per-head norm's weight): f where each reader is
            for reader in readers:
                with graph.inserting_before(reader):
                    f = place(graph.call_function(runtime.copy_to_tp, (x,)), reader, x, tp="replicated")
                reader.replace_input_with(x, f)
            continue
        if x not in f_of:
            with graph.inserting_after(x):
                f_of[x] = place(graph.call_function(runtime.copy_to_tp, (x,)), x, tp="replicated")
        for reader in readers:
            reader.replace_input_with(x, f_of[x])


def _cut_entering(gm: fx.GraphModule, tp: int, prop: _Propagator) -> None:
    """An unsplit tensor over a split dimension (``prop.cuts``): its readers in the region take
    this rank's piece, cut once after it (after its ``copy_to_tp`` where it needs a gradient,
    whose all-reduce then completes the gradient of the pieces)."""
    graph = gm.graph
    for a, (s, readers) in prop.cuts.items():
        reader = next(iter(readers))
        source = next(
            x for x in reader.all_input_nodes if x is a or (x.target is runtime.copy_to_tp and x.args[0] is a)
        )
        mid, inner = s.factors[s.index], math.prod(s.factors[s.index + 1 :])
        width, k, shape = mid // tp * inner, s.dim, _shape(a)
        outer = _div(shape[k], mid * inner)
        with graph.inserting_after(source):
            rank = place(graph.call_function(runtime.tp_rank, ()), a, shape=None, dtype=None, requires_grad=False)
        with graph.inserting_after(rank):
            at = place(graph.call_function(operator.mul, (rank, width)), a, shape=None, dtype=None, requires_grad=False)
        with graph.inserting_after(at):
            rows = graph.call_function(torch.unflatten, (source, k, (-1, mid * inner)))
            place(rows, a, source, shape=(*shape[:k], outer, mid * inner, *shape[k + 1 :]))
        with graph.inserting_after(rows):
            piece = graph.call_function(torch.narrow, (rows, k + 1, at, width))
            place(piece, a, source, shape=(*shape[:k], outer, width, *shape[k + 1 :]))
        with graph.inserting_after(piece):
            cut = graph.call_function(torch.flatten, (piece, k, k + 1))
            place(cut, a, source, shape=(*shape[:k], _div(shape[k], tp), *shape[k + 1 :]))
        for reader in readers:
            reader.replace_input_with(source, cut)
        note(
            cut,
            f"tp={tp}: an unsplit tensor read by a split region, this rank's {width} of every {mid * inner} "
            f"along dim {k}",
        )


def _div(size, n: int):
    """A size (an int or a sympy expression in batch and sequence) divided by ``n``, which divides it."""
    return size // n if isinstance(size, int) else sympy.simplify(size / n)


def _keep_whole_heads(gm: fx.GraphModule, tp: int, node: fx.Node, lin: _Lin, parts: tuple, inner: int) -> None:
    """A column whose parts of one head (multi-query attention's key and value in a fused
    projection, ``parts`` in heads of ``inner`` features) every rank keeps whole, as Megatron
    replicates key/value heads fewer than the TP degree: its weight and bias stay whole on every
    rank, and the graph cuts out this rank's rows (1/tp of every larger part, all of each one-head
    part) before the product. Each rank's gradient of them is then partial over TP (its own query
    rows, and the shared heads as its own query heads read them): ``partial_grads`` sums it."""
    if parts == (1,):  # a projection of one head: its output whole, as its weight
        decisions(gm).partial_grads.extend(n for n in (lin.weight, lin.bias) if n is not None)
        note(node, f"tp={tp}: one key/value head, whole on every rank, its gradients summed over TP")
        return
    if lin.stored_in_out:
        raise _fail(node, "a fused projection with one-head parts whose weight is stored (in, out)", tp)
    graph, rows = gm.graph, [p * inner for p in parts]
    rank = _on_whole_parameters(gm, node, lin)
    for i, name in ((1, lin.weight), (2, lin.bias)):
        if name is None:
            continue
        full, pieces, start = node.args[i], [], 0
        shape = tuple(_param(gm, name).shape)
        for width in rows:
            with graph.inserting_before(node):
                if width == inner:  # one head: all of it
                    at = start
                else:
                    offset = graph.call_function(operator.mul, (rank, width // tp))
                    at = graph.call_function(operator.add, (offset, start))
                    for n in (offset, at):
                        place(n, node, shape=None, dtype=None, requires_grad=False)
                local = width if width == inner else width // tp
                piece = graph.call_function(torch.narrow, (full, 0, at, local))
                place(piece, node, full, shape=(local, *shape[1:]), tp="replicated")
            pieces.append(piece)
            start += width
        with graph.inserting_before(node):
            mine = graph.call_function(torch.cat, (pieces, 0))
            place(mine, node, full, shape=(sum(p.meta["shape"][0] for p in pieces), *shape[1:]), tp="replicated")
        node.replace_input_with(full, mine)
        decisions(gm).partial_grads.append(name)
    kept = ", ".join(str(w) for w in rows if w == inner)
    note(
        node,
        f"tp={tp}: column-parallel, out_features {lin.out_f} -> {sum(w if w == inner else w // tp for w in rows)}, "
        f"one-head parts ({kept} rows) whole on every rank, their gradients summed over TP",
    )


def _on_whole_parameters(gm: fx.GraphModule, node: fx.Node, lin: _Lin) -> fx.Node:
    """Make column ``node`` read its whole weight and bias as arguments (an ``nn.Linear`` call
    becomes ``F.linear`` on its parameters), for the graph to cut this rank's rows out; returns
    the node of this rank's TP index, inserted before ``node``."""
    graph = gm.graph
    with graph.inserting_before(node):
        rank = place(graph.call_function(runtime.tp_rank, ()), node, shape=None, dtype=None, requires_grad=False)
    if lin.module:
        reads = []
        for name in (lin.weight, lin.bias):
            if name is not None:
                with graph.inserting_before(node):
                    shape = tuple(_param(gm, name).shape)
                    reads.append(place(graph.get_attr(name), node, shape=shape, tp="replicated", requires_grad=True))
        node.op, node.target, node.args = "call_function", torch.nn.functional.linear, (node.args[0], *reads)
        node.meta["op"] = ops.op_name(node)
    return rank


def _share_heads(gm: fx.GraphModule, tp: int, node: fx.Node, lin: _Lin, heads: int) -> None:
    """A key or value column of ``heads`` heads, fewer than ``tp``: as Megatron replicates them,
    its weight and bias stay whole on every rank and the graph cuts out the rows of the one head
    this rank's query heads read (head ``rank // (tp / heads)``). The ranks sharing a head each
    hold the gradient of their own query heads' reads, and the others none: ``partial_grads``
    sums them over TP."""
    if lin.stored_in_out:
        raise _fail(node, "key/value heads shared between TP ranks from a weight stored (in, out)", tp)
    graph, width = gm.graph, lin.out_f // heads
    rank = _on_whole_parameters(gm, node, lin)
    with graph.inserting_before(node):
        head = graph.call_function(operator.floordiv, (rank, tp // heads))
        at = graph.call_function(operator.mul, (head, width))
        for n in (head, at):
            place(n, node, shape=None, dtype=None, requires_grad=False)
    for i, name in ((1, lin.weight), (2, lin.bias)):
        if name is not None:
            full = node.args[i]
            shape = tuple(_param(gm, name).shape)
            with graph.inserting_before(node):
                piece = graph.call_function(torch.narrow, (full, 0, at, width))
                place(piece, node, full, shape=(width, *shape[1:]), tp="replicated")
            node.replace_input_with(full, piece)
            decisions(gm).partial_grads.append(name)
    note(
        node,
        f"tp={tp}: {heads} key/value heads, each shared by {tp // heads} ranks: this rank's head "
        f"(out_features {lin.out_f} -> {width}), its gradients summed over TP",
    )


def _split_rows(gm: fx.GraphModule, ctx: RewriteContext, prop: _Propagator) -> None:
    """Row matmuls: local weight, g on the output, bias added after the reduction."""
    tp, graph = ctx.tp, gm.graph
    for node, layout in prop.rows.items():
        lin = _linear(gm, node, tp)
        if layout.size != lin.in_f:
            raise _fail(node, f"its input features {layout.size} are not the weight's {lin.in_f}", tp)
        decisions(gm).shards[lin.weight] = lin.spec(1, layout)
        bias_name = None
        if lin.module:
            module = gm.get_submodule(node.target)
            _swap(gm, node.target, nn.Linear(lin.in_f // tp, lin.out_f, bias=False, device="meta"))
            if module.bias is not None:
                bias_name = f"{node.target}_bias".replace(".", "_")
                gm.register_parameter(bias_name, module.bias)
                decisions(gm).origin[bias_name] = f"{node.target}.bias"
        else:
            _localise(gm, lin.weight, lin.local(1, tp))
            if lin.bias is not None and lin.stored_in_out:  # addmm(bias, x, w) -> mm(x, w)
                bias_name = lin.bias
                node.target = torch.ops.aten.mm.default if isinstance(node.target, torch._ops.OpOverload) else torch.mm
                node.args = node.args[1:]
                node.meta["op"] = ops.op_name(node)
            elif lin.bias is not None:
                bias_name = lin.bias
                node.args = node.args[:2]
                node.kwargs = {k: v for k, v in node.kwargs.items() if k != "bias"}
        with graph.inserting_after(node):
            g = place(graph.call_function(runtime.reduce_from_tp, (node,)), node, tp="replicated")
        _redirect(node, g)
        if bias_name is not None:
            with graph.inserting_after(g):
                b = place(graph.get_attr(bias_name), node, shape=(lin.out_f,), tp="replicated")
            with graph.inserting_after(b):
                add = place(graph.call_function(operator.add, (g, b)), node, tp="replicated")
            _redirect(g, add)
        note(
            node,
            f"tp={tp}: row-parallel, in_features {lin.in_f} -> {lin.in_f // tp}, "
            "partial sums all-reduced by reduce_from_tp",
        )


def _split_embeddings(gm: fx.GraphModule, ctx: RewriteContext, nodes: list[fx.Node]) -> None:
    """Embeddings of the vocabulary: a 1/tp slice of the rows, looked up by vocab_parallel_embedding."""
    tp, graph = ctx.tp, gm.graph
    for node in nodes:
        if node.meta.get("tp_role") == "vocab" and node.meta.get("op_class") == "embedding":
            if node.op == "call_module":
                module = gm.get_submodule(node.target)
                rows, dim, ids = module.num_embeddings, module.embedding_dim, node.args[0]
                weight_name, padding = f"{node.target}.weight", module.padding_idx
            elif node.op == "call_function" and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr":
                weight_name, ids = node.args[0].target, node.args[1]  # aten.embedding(weight, ids, padding_idx)
                rows, dim = _param(gm, weight_name).shape
                padding = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
                padding = None if padding is None or padding < 0 else padding
            else:
                raise _fail(node, "an embedding whose table is not a parameter")
            tied = decisions(gm).shards.get(weight_name)  # the vocabulary head's weight too: already this rank's rows
            if tied is not None:
                rows = math.prod(tied.factors)
            if rows % tp:
                raise _fail(node, f"vocabulary {rows} does not divide by tp={tp}", tp, divides=rows)
            if node.op == "call_module":
                _swap(gm, node.target, nn.Embedding(rows // tp, dim, device="meta"))
            elif tied is None:
                _localise(gm, weight_name, (rows // tp, dim))
            with graph.inserting_before(node):
                w = place(graph.get_attr(weight_name), node, shape=(rows, dim), tp="sharded")
            with graph.inserting_after(node):
                args = (ids, w) if padding is None else (ids, w, padding)
                emb = graph.call_function(runtime.vocab_parallel_embedding, args)
                place(emb, node, tp="replicated")
            node.replace_all_uses_with(emb)
            graph.erase_node(node)
            decisions(gm).shards[weight_name] = ParamShard(0, (rows,), 0)
            note(emb, f"tp={tp}: vocabulary-parallel embedding, rows {rows} -> {rows // tp}")


def _split_losses(gm: fx.GraphModule, ctx: RewriteContext, prop: _Propagator) -> None:
    """The loss over vocabulary-split logits: vocab_parallel_cross_entropy."""
    tp, graph = ctx.tp, gm.graph
    for node, s in prop.losses.items():
        if s.dim != len(_shape(node.args[0])) - 1:
            raise _fail(node, "only cross-entropy over logits split along the vocabulary is supported")
        if node.target is runtime.cp_cross_entropy:
            node.args = (*node.args[:3], True)  # vocabulary-parallel and context-parallel at once
            note(node, f"tp={tp}: vocabulary-parallel cross-entropy over the split logits")
            continue
        args = ops.call_args(node)
        if args["weight"] is not None or args["label_smoothing"]:
            raise _fail(node, "class weights or label smoothing in a vocabulary-split loss")
        with graph.inserting_after(node):
            ce = graph.call_function(
                runtime.vocab_parallel_cross_entropy,
                (args["input"], args["target"], args["ignore_index"], args["reduction"]),
            )
            place(ce, node, tp="replicated")
        node.replace_all_uses_with(ce)
        graph.erase_node(node)
        note(ce, f"tp={tp}: vocabulary-parallel cross-entropy over the split logits")


def _split_region_parameters(gm: fx.GraphModule, ctx: RewriteContext, prop: _Propagator) -> None:
    """A parameter a region reads element by element along its split features is cut the same
    way; every read of it must be one of those."""
    for node, s in prop.params.items():
        others = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == node.target]
        readers = [u for n in others for u in n.users]
        if any(u not in prop.shard for u in readers):
            raise _fail(node, f"parameter {node.target} is split in one place and read whole in another")
        shape = list(_param(gm, node.target).shape)
        shape[s.dim] //= ctx.tp
        _localise(gm, node.target, tuple(shape))
        decisions(gm).shards[node.target] = ParamShard(s.dim, s.factors, s.index, s.parts)
        note(node, f"tp={ctx.tp}: this rank's {shape[s.dim]} of the split features")


def _complete_partial_sums(gm: fx.GraphModule, ctx: RewriteContext, prop: _Propagator) -> None:
    """A sum or mean over the split dimension (OLMo2's q/k norm over all heads): each rank has its
    part; ``reduce_from_tp`` adds the parts (a mean of equal parts is their sum over tp). Its
    readers in the region get it through ``copy_to_tp`` (the region's entering tensors), whose
    backward sums their partial gradients."""
    tp, graph = ctx.tp, gm.graph
    for node, kind in prop.partial_sums.items():
        with graph.inserting_after(node):
            total = place(graph.call_function(runtime.reduce_from_tp, (node,)), node, tp="replicated")
        last = total
        if kind == "mean":
            with graph.inserting_after(total):
                last = place(graph.call_function(operator.truediv, (total, tp)), node, tp="replicated")
        _redirect(node, total)
        if last is not total:
            _redirect(total, last)
        note(node, f"tp={tp}: a {kind} over the split features, this rank's part; all-reduced after")


def full_weights_left(gm: fx.GraphModule, ctx: RewriteContext) -> str | None:
    """Ensured: every column, row and vocabulary matmul multiplies by a 1/tp slice of its weight."""
    for node in gm.graph.nodes:
        if node.meta.get("tp_role") not in ("column", "row", "vocab") or node.meta.get("op_class") != "matmul":
            continue
        if node.meta.get("tp_role") == "column" and _cut_in_graph(node):
            continue  # kept whole, this rank's rows cut in the graph (``_keep_whole_heads``, ``_share_heads``)
        lin = _linear(gm, node, ctx.tp)
        if lin.weight in decisions(gm).partial_grads:
            continue  # one key/value head, kept whole (``_keep_whole_heads``)
        spec = decisions(gm).shards.get(lin.weight)
        local = _param(gm, lin.weight).shape
        if spec is None or local[spec.dim] * ctx.tp != math.prod(spec.factors):
            return f"{node.name} keeps the full weight {lin.weight} {tuple(local)}"
    return None


def _cut_in_graph(node: fx.Node) -> bool:
    """A linear whose weight is this rank's rows of a parameter, cut in the graph."""
    w = node.args[1] if node.op == "call_function" and len(node.args) > 1 else None
    if isinstance(w, fx.Node) and w.target is torch.narrow:  # one piece (``_share_heads``)
        return True
    return isinstance(w, fx.Node) and w.target is torch.cat and all(p.target is torch.narrow for p in w.args[0])


def load_local(gm: fx.GraphModule, ctx: RewriteContext, full: dict[str, torch.Tensor], rank: int) -> None:
    """Give ``gm`` (rewritten by :func:`tensor_parallel` with ``ctx``) TP rank ``rank``'s slices
    of the full parameters and buffers ``full`` (named as in the traced module, e.g.
    ``model.layers.0.attn.wq.weight``)."""
    local, by_id = {}, {}
    named = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers()]
    for name, t in named:
        if id(t) in by_id:  # a tied parameter: the same local tensor under each name
            local[name] = by_id[id(t)]
            continue
        source = decisions(gm).origin.get(name, name)
        if source not in full:
            raise AutoshardError(f"no value for parameter {source}; the state does not match the model")
        value = full[source]
        spec = decisions(gm).shards.get(source)
        value = slice_parameter(value, spec, rank, ctx.tp) if spec is not None else value.clone()
        if tuple(value.shape) != tuple(t.shape):
            raise AutoshardError(f"{source}: local shape {tuple(value.shape)} but the graph expects {tuple(t.shape)}")
        local[name] = by_id[id(t)] = nn.Parameter(value, t.requires_grad) if isinstance(t, nn.Parameter) else value
    persistent = gm.state_dict(keep_vars=True)
    for name in [n for n in local if n not in persistent]:  # a buffer outside the state (a rope's frequencies)
        owner, _, leaf = name.rpartition(".")
        setattr(gm.get_submodule(owner) if owner else gm, leaf, local.pop(name))
    gm.load_state_dict(local, strict=True, assign=True)


def _local_size(node: fx.Node) -> bool:
    """``x.size(d)`` of a split tensor: already the local size at run time."""
    return _op_name(node) == "size" and node.args[0].meta.get("tp") != "replicated"


def _global_size(value: fx.Node) -> bool:
    """A size computed by arithmetic on sizes of replicated tensors (``batch * heads``): the
    global size on every rank."""
    frontier = [value]
    while frontier:
        n = frontier.pop()
        row = ops.rule_of(n)
        if row is not None and row.metadata == "size":
            if n.args[0].meta.get("tp") != "replicated":
                return False
        elif n.op == "call_function" and n.target in _ARITHMETIC:
            frontier.extend(n.all_input_nodes)
        else:
            return False
    return True


_ARITHMETIC = (operator.mul, operator.add, operator.sub, operator.floordiv)


def _divided(value: fx.Node, tp: int) -> fx.Node:
    """``value // tp``, inserted once after the global size ``value``: the local size of a
    dimension split over ``tp`` ranks."""
    for u in value.users:
        if u.target is operator.floordiv and u.args == (value, tp):
            return u
    with value.graph.inserting_after(value):
        return place(value.graph.call_function(operator.floordiv, (value, tp)), value)


def _redirect(old: fx.Node, new: fx.Node) -> None:
    """Every user of ``old`` except ``new`` (which consumes it) reads ``new`` instead."""
    old.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)


@dataclass(frozen=True)
class _Lin:
    weight: str  # parameter names
    bias: str | None
    out_f: int
    in_f: int
    module: bool  # an nn.Linear call (else F.linear / aten.linear / addmm on parameters)
    x: int = 0  # the position of the activation among the arguments
    stored_in_out: bool = False  # the weight is (in, out): addmm(bias, x, w), GPT-2's Conv1D

    def local(self, dim: int, tp: int) -> tuple[int, int]:
        """The weight's local shape with features ``dim`` (0: out, 1: in) split."""
        out_f, in_f = (self.out_f // tp, self.in_f) if dim == 0 else (self.out_f, self.in_f // tp)
        return (in_f, out_f) if self.stored_in_out else (out_f, in_f)

    def spec(self, dim: int, layout: Shard) -> ParamShard:
        """How the weight is cut when its features ``dim`` (0: out, 1: in) follow ``layout``."""
        return ParamShard(1 - dim if self.stored_in_out else dim, layout.factors, layout.index, layout.parts)


def _params(*nodes) -> bool:
    return all(n is None or isinstance(n, fx.Node) and n.op == "get_attr" for n in nodes)


def _linear(gm: fx.GraphModule, node: fx.Node, tp: int) -> _Lin:
    if node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.Linear):
        m = gm.get_submodule(node.target)
        bias = f"{node.target}.bias" if m.bias is not None else None
        return _Lin(f"{node.target}.weight", bias, m.out_features, m.in_features, True)
    name = _op_name(node)
    if node.op == "call_function" and name == "linear":
        w = node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if _params(w, b):
            out_f, in_f = _param(gm, w.target).shape
            return _Lin(w.target, b.target if b is not None else None, out_f, in_f, False)
    if node.op == "call_function" and name in ("addmm", "mm"):  # addmm(bias, x, w); mm(x, w) once split
        b, w = (node.args[0], node.args[2]) if name == "addmm" else (None, node.args[1])
        if _params(w, b) and not node.kwargs:
            in_f, out_f = _param(gm, w.target).shape
            bias = b.target if b is not None else None
            return _Lin(w.target, bias, out_f, in_f, False, x=1 if name == "addmm" else 0, stored_in_out=True)
    raise _fail(node, "only linear layers whose weight is a parameter are split")


def _param(gm: fx.GraphModule, target: str) -> torch.Tensor:
    owner, _, leaf = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, leaf)


def _localise(gm: fx.GraphModule, target: str, shape: tuple[int, ...]) -> None:
    """Replace parameter ``target`` by an empty one of the local ``shape`` on the meta device,
    wherever the model ties it (GPT-2's embedding and head share one)."""
    owner, _, leaf = target.rpartition(".")
    old = getattr(gm.get_submodule(owner) if owner else gm, leaf)
    new = nn.Parameter(torch.empty(shape, dtype=old.dtype, device="meta"), old.requires_grad)
    for module in gm.modules():
        for name, p in list(module._parameters.items()):
            if p is old:
                setattr(module, name, new)


def _tie_shards(gm: fx.GraphModule, shards: dict[str, ParamShard]) -> None:
    """A tied parameter is read under one name, its first (the one ``named_parameters`` gives and
    the emitted program holds), and every name of it is cut the same way."""
    for tied in tied_parameters(gm):
        spec = next((shards[n] for n in tied if n in shards), None)
        for n in tied if spec is not None else ():
            shards.setdefault(n, spec)
        for node in gm.graph.nodes:
            if node.op == "get_attr" and node.target in tied[1:]:
                node.target = tied[0]


def _swap(gm: fx.GraphModule, target: str, module: nn.Module) -> None:
    parent, _, name = target.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, name, module)


def _rewrite_sizes(node: fx.Node, s: Shard, tp: int, local: int | None = None) -> None:
    """The split dimension's constant size in a view, as this rank's (``local``, default 1/tp)."""
    args = list(node.args)
    packed = len(args) == 2 and isinstance(args[1], (tuple, list))
    sizes = list(args[1]) if packed else args[1:]
    if s.dim >= len(sizes):
        return
    value = sizes[s.dim]
    if isinstance(value, int):
        if value == -1:
            return
        sizes[s.dim] = value // tp if local is None else local
    elif isinstance(value, fx.Node) and _global_size(value) and local is None:
        sizes[s.dim] = _divided(value, tp)
    elif isinstance(value, fx.Node) and not _local_size(value):
        raise _fail(node, "the split dimension's size is computed, not a constant; write it as a constant")
    node.args = (args[0], type(args[1])(sizes)) if packed else (args[0], *sizes)


__all__ = [
    "tensor_parallel",
    "full_weights_left",
    "load_local",
    "Shard",
    "ParamShard",
    "slice_parameter",
    "IMPLEMENTED",
]
