"""MoE forms: experts written as a loop over expert modules, or as per-token gathered weights,
rewritten into the grouped form (rows sorted by expert, cumulative counts ``offs``, stacked
``(E, K, N)`` weights, ``rt.moe_grouped_mm``) that the cost model and expert parallelism read.

Run by ``passes.canonicalize.canonicalize`` on the traced graph, before capture annotates
anything: torch.export's aten graph (whose traced values, ``meta["val"]``, new nodes get too) or,
for the loop form, symbolic_trace's torch-level one (``nn.Linear`` calls, in-place ``index_add_``).
Both rewrites recognise the form by what the graph computes:

* :func:`expert_loops`: one identical expert subgraph per expert ``e`` of ``E`` (the candidates
  of a top-k, from its traced scores, or the one-hot mask's classes on a graph without values),
  each reading the rows that ``where(choices == e)`` or a one-hot mask's slice
  ``one_hot(choices, E).permute(...)[e]`` selects, its result added into one accumulator by
  ``out[idx] += y`` (``index_put``) or ``index_add``. The rows of every (token, slot) pair are
  taken once, sorted by expert (stable: by token within an expert, as each expert's ``where``
  takes them), the expert subgraph runs once on them with each projection a grouped GEMM by the
  ``torch.stack`` of the E experts' weights (the model's own parameters, each still read by its
  own name), and the results are added into the accumulator with one ``index_add``;
* :func:`batched_experts`: products by the rows of a stacked ``(E, N, K)`` parameter each routed
  token slot's choice selects (``bmm(W[ids], h.unsqueeze(-1)).squeeze(-1)``, transformers'
  ``batched_mm``) become grouped GEMMs over the slots sorted by expert; what the products
  compute row by row stays in that order, and leaves it restored to the slots' own order.

A form that differs in any way (a bias on an expert projection, experts of different structure,
an op that mixes rows) is left as it was.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import guard_or_false

from autoshard.ir import ops
from autoshard.runtime import moe

aten = torch.ops.aten
_INDEX_PUTS = (aten.index_put.default, aten.index_put_.default)
_ADDS = (aten.add.Tensor, aten.add_.Tensor)


# ---------------------------------------------------------------------------------------------
# nodes with their traced values


def _val(a):
    if isinstance(a, fx.Node):
        return a.meta.get("val")
    if isinstance(a, (list, tuple)):
        return type(a)(_val(x) for x in a)
    return a


def _emit(
    graph: fx.Graph,
    target,
    args: tuple,
    like: fx.Node,
    kwargs: dict | None = None,
    val=None,
    line=None,
    op="call_function",
) -> fx.Node:
    """A new node computing ``target(*args)`` with ``like``'s module, the source line of ``line``
    (default ``like``), and, in a graph of traced values (torch.export's), its value computed on
    the arguments' (fake) values unless ``val`` is given."""
    node = graph.create_node(op, target, args, kwargs or {})
    node.meta = {k: like.meta[k] for k in ("nn_module_stack",) if k in like.meta}
    if "stack_trace" in (line or like).meta:
        node.meta["stack_trace"] = (line or like).meta["stack_trace"]
    if val is None and "val" in like.meta and op == "call_function":
        val = target(*_val(args), **_val(kwargs or {}))
    if val is not None:
        node.meta["val"] = val
    return node


def _order_by_expert(graph: fx.Graph, ids: fx.Node, experts: int, like: fx.Node) -> tuple[fx.Node, fx.Node]:
    """(order, offs): the flat expert ids' positions sorted by expert (stable) and the cumulative
    count of each expert's rows (int32), as ``torch._grouped_mm`` reads them."""
    order = _emit(graph, aten.argsort.stable, (ids,), like, {"stable": True})
    counts = _emit(graph, aten._to_copy.default, (ids,), like, {"dtype": torch.float32})
    counts = _emit(graph, aten.histc.default, (counts, experts, 0, experts - 1), like)
    offs = _emit(graph, aten.cumsum.default, (counts, 0), like, {"dtype": torch.int32})
    return order, offs


def _grouped(graph: fx.Graph, rows: fx.Node, weight: fx.Node, offs: fx.Node, like: fx.Node, line: fx.Node) -> fx.Node:
    r, w = rows.meta.get("val"), weight.meta.get("val")
    val = r.new_empty((r.shape[0], w.shape[-1])) if r is not None and w is not None else None
    return _emit(graph, moe.grouped_mm, (rows, weight, offs), like, val=val, line=line)


def _erase_dead(gm: fx.GraphModule, doomed: set[fx.Node]) -> None:
    for node in reversed(list(gm.graph.nodes)):
        if node in doomed and not node.users:
            gm.graph.erase_node(node)


def _forward(starts) -> set[fx.Node]:
    """Every node computed from ``starts`` (included)."""
    seen, frontier = set(starts), list(starts)
    while frontier:
        for u in frontier.pop().users:
            if u not in seen:
                seen.add(u)
                frontier.append(u)
    return seen


# ---------------------------------------------------------------------------------------------
# a loop over expert modules (torch.export's aten graph, or symbolic_trace's torch-level one)


def _name(n) -> str:
    return ops.op_name(n) if isinstance(n, fx.Node) and n.op != "call_module" else ""


def _is_linear(gm: fx.GraphModule, n: fx.Node) -> bool:
    """A bias-free ``linear(activation, parameter)``: an ``aten.linear`` of a ``get_attr`` or an
    ``nn.Linear`` module call."""
    if n.op == "call_module":
        module = gm.get_submodule(n.target)
        return type(module) is torch.nn.Linear and module.bias is None
    return (
        n.target is aten.linear.default
        and n.args[1].op == "get_attr"
        and (len(n.args) < 3 or n.args[2] is None)
        and n.args[0].op != "get_attr"
    )


def _linear_weight(n: fx.Node) -> fx.Node | str:
    """The weight a linear reads: its ``get_attr`` node, or the module's parameter name."""
    return f"{n.target}.weight" if n.op == "call_module" else n.args[1]


def _top_k(choices: fx.Node) -> tuple[int, int] | None:
    """(k, E) when ``choices`` is the (tokens, k) indices of a top-k over E candidates (E from
    the traced values, or None where there are none)."""
    topk = ops.topk_of(choices)
    if topk is None:
        return None
    k = topk.args[1] if len(topk.args) > 1 else topk.kwargs.get("k")
    dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
    scores = topk.args[0].meta.get("val")
    val = choices.meta.get("val")
    if not isinstance(k, int) or dim not in (-1, 1) or val is not None and val.dim() != 2:
        return None
    return k, int(scores.shape[-1]) if scores is not None else None


def _permutation(node: fx.Node) -> list[int] | None:
    if _name(node) != "permute":
        return None
    dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
    return list(dims)


def _expert_mask(mask: fx.Node) -> tuple[fx.Node, int, int, int, int | None] | None:
    """(choices, expert, token position, slot position, E where the mask says it) of
    ``choices == e`` or of the slice ``one_hot(choices, E).permute(perm)[e]`` (``perm[0]`` the
    expert dimension): the positions are which of ``where(mask)``'s outputs hold the tokens and
    the slots."""
    name = _name(mask)
    if name == "eq" and isinstance(mask.args[0], fx.Node) and isinstance(mask.args[1], int):
        return mask.args[0], mask.args[1], 0, 1, None
    if name == "select" and mask.args[1] == 0 and isinstance(mask.args[2], int):
        source, e = mask.args[0], mask.args[2]
    elif name == "getitem" and isinstance(mask.args[1], int) and isinstance(mask.args[0], fx.Node):
        source, e = mask.args
    else:
        return None
    perm = _permutation(source)
    one_hot = source.args[0]
    if perm is None or perm[0] != 2 or sorted(perm) != [0, 1, 2] or _name(one_hot) != "one_hot":
        return None
    experts = one_hot.args[1] if len(one_hot.args) > 1 else one_hot.kwargs.get("num_classes")
    return one_hot.args[0], e, perm[1:].index(0), perm[1:].index(1), experts


class _Expert:
    """One expert's turn of the loop: its ``where``, the token and slot positions it selects, the
    value ``y`` it adds into the accumulator (``acc_in`` -> ``acc_out``; an in-place
    ``index_add_`` whose result nothing reads leaves the sum in ``acc_in`` itself)."""

    def __init__(self, where: fx.Node, token_pos: int, slot_pos: int):
        self.where = where
        parts = {u.args[1]: u for u in where.users if u.target is operator.getitem}
        self.token, self.slot = parts.get(token_pos), parts.get(slot_pos)
        self.acc_in = self.acc_out = self.y = None
        if self.token is not None:
            self._accumulation()

    def _accumulation(self) -> None:
        for u in self.token.users:
            name = _name(u)
            if name in ("index_add", "index_add_") and u.args[1] == 0 and u.args[2] is self.token:
                self.acc_in, self.acc_out, self.y = u.args[0], u, u.args[3]
            elif u.target in _INDEX_PUTS and list(u.args[1]) == [self.token] and u.args[2].target in _ADDS:
                read, y = u.args[2].args
                if read.target is aten.index.Tensor and read.args == (u.args[0], [self.token]):
                    self.acc_in, self.acc_out, self.y = u.args[0], u, y

    @property
    def in_place(self) -> bool:
        return _name(self.acc_out) == "index_add_" and not self.acc_out.users

    def accumulation(self) -> set[fx.Node]:
        """The nodes that add ``y`` into the accumulator (not ``y``'s computation)."""
        if _name(self.acc_out) in ("index_add", "index_add_"):
            return {self.acc_out}
        return {self.acc_out, self.acc_out.args[2], self.acc_out.args[2].args[0]}

    def body(self) -> list[fx.Node]:
        """The nodes computing ``y`` from the selected positions, in graph order."""
        inside: dict[fx.Node, bool] = {}

        def reads(n: fx.Node) -> bool:
            if n not in inside:
                below = [reads(a) for a in n.all_input_nodes]  # every input visited, not the first only
                inside[n] = n.target is operator.getitem and n.args[0] is self.where or any(below)
            return inside[n]

        reads(self.y)
        return [n for n in self.y.graph.nodes if inside.get(n) and n not in (self.token, self.slot)]

    def signature(self, gm: fx.GraphModule) -> tuple[tuple, list] | None:
        """The body's computation with this expert's own names left out, and its weights (the
        parameters it reads, in order); None where a parameter is read but by a bias-free linear."""
        body = self.body()
        local = {n: i for i, n in enumerate(body)}
        weights: list = []

        def arg(a):
            if isinstance(a, (list, tuple)):
                return tuple(arg(x) for x in a)
            if not isinstance(a, fx.Node):
                return a
            if a is self.token or a is self.slot:
                return ("position", a is self.token)
            if a in local:
                return ("node", local[a])
            if a.op == "get_attr":
                weights.append(a)
                return ("weight", tuple(a.meta["val"].shape))
            if a.op == "call_function":  # a value computed outside the loop, maybe once per expert
                return ("outside", a.target, tuple(x if isinstance(x, fx.Node) else repr(x) for x in a.args))
            return a

        sig = []
        for n in body:
            if n.op == "call_module":
                if not _is_linear(gm, n):
                    return None
                weights.append(_linear_weight(n))
                sig.append(("linear", tuple(gm.get_submodule(n.target).weight.shape), arg(n.args)))
                continue
            if any(a.op == "get_attr" for a in n.all_input_nodes) and not _is_linear(gm, n):
                return None
            sig.append((n.op, n.target, arg(n.args), arg(tuple(sorted(n.kwargs.items())))))
        return tuple(sig), weights


def _loops(gm: fx.GraphModule) -> list[tuple[fx.Node, int, list[_Expert]]]:
    """Each loop over experts: its choices, top-k and its experts' turns in expert order
    (complete, chained through one accumulator that nothing else reads)."""
    found: dict[fx.Node, dict[int, _Expert]] = {}
    told: dict[fx.Node, int | None] = {}
    for node in gm.graph.nodes:
        if _name(node) != "where" or len(node.args) != 1 or node.kwargs:
            continue
        mask = _expert_mask(node.args[0])
        if mask is None:
            continue
        choices, e, token_pos, slot_pos, experts = mask
        found.setdefault(choices, {})[e] = _Expert(node, token_pos, slot_pos)
        told[choices] = experts
    loops = []
    for choices, by_expert in found.items():
        routing = _top_k(choices)
        if routing is None:
            continue
        experts = routing[1] if routing[1] is not None else told[choices]
        if experts is None or sorted(by_expert) != list(range(experts)):
            continue
        turns = sorted(by_expert.values(), key=lambda t: _position(gm, t.where))
        if all(t.acc_out is not None for t in turns) and _chained(gm, turns):
            loops.append((choices, routing[0], [by_expert[e] for e in range(experts)]))
    return loops


def _position(gm: fx.GraphModule, node: fx.Node) -> int:
    return next(i for i, n in enumerate(gm.graph.nodes) if n is node)


def _chained(gm: fx.GraphModule, turns: list[_Expert]) -> bool:
    """Each turn adds into what the previous one produced (or, in place, into the same tensor),
    and only the turns read it before the last one."""
    acc = turns[0].acc_in
    adds = set().union(*(t.accumulation() for t in turns))
    for prev, turn in zip(turns, turns[1:]):
        if turn.acc_in is prev.acc_out:
            if not set(prev.acc_out.users) <= turn.accumulation():
                return False
        elif not (prev.in_place and turn.acc_in is acc):
            return False
    last = _position(gm, turns[-1].acc_out)
    return all(u in adds or _position(gm, u) > last for u in acc.users)


def expert_loops(gm: fx.GraphModule) -> bool:
    """Rewrite every loop over expert modules into the grouped form (see the module docstring);
    whether any was rewritten."""
    changed = False
    for choices, top_k, turns in _loops(gm):
        sigs = [t.signature(gm) for t in turns]
        if any(s is None for s in sigs) or any(s[0] != sigs[0][0] for s in sigs):
            continue
        if not _rows_only(gm, turns[0]):
            continue
        _rewrite_loop(gm, choices, top_k, turns, [s[1] for s in sigs])
        changed = True
    return changed


_ROW_OPS = ("getitem", "index", "linear", "reshape", "view", "unsqueeze", "to", "_to_copy", "contiguous", "sym_size")


def _rows_only(gm: fx.GraphModule, turn: _Expert) -> bool:
    """The expert's body computes row by row: its ops are element-wise, row selections, linears,
    views and casts, and (where the graph has traced values) each of its tensors has the selected
    rows as one of its dimensions."""
    rows = turn.token.meta.get("val")
    for n in turn.body():
        name = ops.op_name(n, gm)
        rule = ops.rule(name)
        if name not in _ROW_OPS and (rule is None or rule.op_class != "elementwise"):
            return False
        val = n.meta.get("val")
        tensor = rows is not None and isinstance(val, torch.Tensor)
        if tensor and not any(guard_or_false(d == rows.shape[0]) for d in val.shape):
            return False
    return True


def _rewrite_loop(gm: fx.GraphModule, choices: fx.Node, top_k: int, turns: list[_Expert], weights: list[list]) -> None:
    graph, first, last = gm.graph, turns[0], turns[-1]
    like = first.where
    with graph.inserting_before(last.acc_out):
        ids = _emit(graph, aten.reshape.default, (choices, [-1]), like)
        order, offs = _order_by_expert(graph, ids, len(turns), like)
        env = {
            first.token: _emit(graph, aten.div.Scalar_mode, (order, top_k), like, {"rounding_mode": "floor"}),
            first.slot: _emit(graph, aten.remainder.Scalar, (order, top_k), like),
        }
        stacked = {}
        for i, w in enumerate(weights[0]):
            if w not in stacked:
                params = [_weight_node(gm, ws[i]) for ws in weights]
                stack = _emit(graph, aten.stack.default, (params,), like)
                stacked[w] = _emit(graph, aten.transpose.int, (stack, 1, 2), like)
        for n in first.body():
            if _is_linear(gm, n):
                env[n] = _grouped(graph, env.get(n.args[0], n.args[0]), stacked[_linear_weight(n)], offs, like, n)
            else:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env.get(a, a))
                env[n] = _emit(graph, n.target, args, like, kwargs, line=n, op=n.op)
        out = _emit(
            graph, aten.index_add.default, (first.acc_in, 0, env[first.token], env[first.y]), like, line=last.acc_out
        )
    if last.in_place:  # the sum is read from the accumulator itself, after the loop
        after = _position(gm, last.acc_out)
        for u in [u for u in first.acc_in.users if u is not out and _position(gm, u) > after]:
            u.replace_input_with(first.acc_in, out)
    else:
        last.acc_out.replace_all_uses_with(out)
    doomed = set()
    for t in turns:
        mask = t.where.args[0]
        doomed |= _forward([t.where]) | t.accumulation() | {mask}
        if _name(mask) != "eq":  # the one-hot mask and its permutation
            doomed |= {mask.args[0], mask.args[0].args[0]}
    _erase_dead(gm, doomed)


def _weight_node(gm: fx.GraphModule, weight: fx.Node | str) -> fx.Node:
    """The ``get_attr`` node of a weight: the traced one, or a new one for a module's parameter."""
    if isinstance(weight, fx.Node):
        return weight
    return gm.graph.get_attr(weight)


# ---------------------------------------------------------------------------------------------
# per-token gathered weights (transformers' batched_mm)


class _Product:
    """``bmm(W[ids], h.unsqueeze(-1)).squeeze(-1)``: each routed slot's row of ``h`` times its
    expert's ``(N, K)`` matrix of the stacked parameter ``W``."""

    def __init__(self, out: fx.Node, h: fx.Node, weight: fx.Node, ids: fx.Node):
        self.out, self.h, self.weight, self.ids = out, h, weight, ids
        self.chain = {out, out.args[0], *out.args[0].args}

    @classmethod
    def of(cls, out: fx.Node) -> _Product | None:
        if out.target is not aten.squeeze.dim or out.args[1] not in (-1, 2):
            return None
        bmm = out.args[0]
        if bmm.target is not aten.bmm.default or len(bmm.users) != 1:
            return None
        sel, col = bmm.args
        if (
            sel.target is not aten.index.Tensor
            or col.target is not aten.unsqueeze.default
            or col.args[1] not in (-1, 2)
        ):
            return None
        weight, index = sel.args
        if weight.op != "get_attr" or len(index) != 1 or len(sel.users) != 1 or len(col.users) != 1:
            return None
        ids = index[0]
        if ops.topk_of(ids) is None or ids.meta["val"].dim() != 1 or weight.meta["val"].dim() != 3:
            return None
        return cls(out, col.args[0], weight, ids)


_ROW_WISE_VIEWS = (aten.chunk.default, aten.split.Tensor, aten.unsqueeze.default, aten.squeeze.dim)


def _row_wise(node: fx.Node, rows) -> bool:
    """Computes each row alone: an element-wise op or a getitem, or a chunk/split/(un)squeeze
    away from dimension 0, on tensors of ``rows`` rows."""
    vals = [node.meta.get("val"), *(a.meta.get("val") for a in node.all_input_nodes)]
    tensors = [t for v in vals for t in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, torch.Tensor)]
    if not tensors or any(v.dim() == 0 or v.shape[0] != rows for v in tensors):
        return False
    if node.target is operator.getitem:
        return True
    if node.target in _ROW_WISE_VIEWS:
        dim = node.args[2] if len(node.args) > 2 else node.args[1] if node.target is not aten.chunk.default else 0
        return dim % (node.args[0].meta["val"].dim() + (node.target is aten.unsqueeze.default)) != 0
    rule = ops.rule(ops.op_name(node))
    return rule is not None and rule.op_class == "elementwise"


def batched_experts(gm: fx.GraphModule) -> bool:
    """Rewrite every set of per-token gathered expert products into grouped GEMMs (see the module
    docstring); whether any was rewritten."""
    by_ids: dict[fx.Node, list[_Product]] = {}
    for node in gm.graph.nodes:
        if (product := _Product.of(node)) is not None:
            by_ids.setdefault(product.ids, []).append(product)
    changed = False
    for ids, products in by_ids.items():
        changed |= _rewrite_batched(gm, ids, products)
    return changed


def _inside(gm: fx.GraphModule, products: list[_Product]) -> list[fx.Node]:
    """The products' outputs and what is computed from them alone, row by row, in graph order."""
    outs = {p.out for p in products}
    chains = set().union(*(p.chain for p in products))
    rows = products[0].ids.meta["val"].shape[0]
    inside: list[fx.Node] = []
    for node in gm.graph.nodes:
        ins = node.all_input_nodes
        if node in outs or node not in chains and ins and all(i in inside for i in ins) and _row_wise(node, rows):
            inside.append(node)
    return inside


def _rewrite_batched(gm: fx.GraphModule, ids: fx.Node, products: list[_Product]) -> bool:
    inside = _inside(gm, products)
    chains = set().union(*(p.chain for p in products))
    exits = {n: [u for u in n.users if u not in inside and u not in chains] for n in inside}
    exits = {n: users for n, users in exits.items() if users}
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    anchor = min((u for users in exits.values() for u in users), key=position.__getitem__, default=None)
    inlets = [p.h for p in products if p.h not in inside]
    if anchor is None or any(position[n] > position[anchor] for n in (*inlets, ids, *(p.out for p in products))):
        return False
    graph, like = gm.graph, products[0].out
    experts = int(products[0].weight.meta["val"].shape[0])
    with graph.inserting_before(anchor):
        order, offs = _order_by_expert(graph, ids, experts, like)
        inverse = _emit(graph, aten.argsort.stable, (order,), like, {"stable": True})
        env: dict[fx.Node, fx.Node] = {}
        for h in dict.fromkeys(inlets):
            env[h] = _emit(graph, aten.index.Tensor, (h, [order]), like, line=h)
        product_of = {p.out: p for p in products}
        weights: dict[fx.Node, fx.Node] = {}
        for n in inside:
            if n in product_of:
                p = product_of[n]
                if p.weight not in weights:
                    weights[p.weight] = _emit(graph, aten.transpose.int, (p.weight, 1, 2), like)
                env[n] = _grouped(graph, env[p.h], weights[p.weight], offs, n, n)
            else:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env.get(a, a))
                env[n] = _emit(graph, n.target, args, n, kwargs)
        for n, users in exits.items():
            back = _emit(graph, aten.index.Tensor, (env[n], [inverse]), n)
            for u in users:
                u.replace_input_with(n, back)
    _erase_dead(gm, set(inside) | chains)
    return True


__all__ = ["expert_loops", "batched_experts"]
