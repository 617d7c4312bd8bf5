"""Expert parallelism: each MoE layer's routed experts split over the plan's EP ranks, tokens sent
to the rank that holds their expert and back by all-to-all.

A MoE layer is found from what its graph computes, not from names: an expert GEMM (op class
``experts``: a product by a stacked ``(E, ., .)`` weight, or a grouped GEMM over rows grouped by
expert) and everything computed from its rows alone, row by row, with the stacked weights (the
*expert region*: the activation between the up and down projections, the other GEMMs). What
enters the region is dispatched, what leaves it is combined:

* ``grouped``: rows sorted by expert with cumulative counts ``offs`` (transformers' grouped-GEMM
  experts, ``torch._grouped_mm``): ``rt.moe_dispatch`` exchanges the per-expert counts, then the
  rows (dropless: as many as each expert got), regrouped by local expert with local ``offs``;
  ``rt.moe_combine`` sends the results back in the original order;
* ``buffer``: a fixed-capacity ``(E, C, H)`` buffer (GShard): ``rt.moe_dispatch_buffer`` sends
  each rank its experts' slots, ``rt.moe_combine_buffer`` returns them.

The region's stacked weights keep this rank's ``E/ep`` experts (``decisions(gm).shards`` with axis ``ep``);
their gradients are summed over the expert-data-parallel ranks (``decisions(gm).expert_params``).
A weight stacked in the graph from the E experts' own parameters (``torch.stack``, as
``passes.moe_forms`` presents an ``nn.ModuleList``'s experts) keeps every parameter and its name:
each rank holds its ``1/ep`` of the rows of every expert's parameter (axis ``ep``), and the stack
of these pieces is exchanged by one equal all-to-all (``rt.moe_dispatch_buffer``) into the whole
weights of the rank's ``E/ep`` experts (the gradients go back the same way), before the GEMMs.
A checkpointed layer's recomputation exchanges them again (the GEMMs saved the whole weights, which
the checkpoint remakes rather than keeps: no whole weights held from forward to backward), as the
cost model counts (``BlockCost.replayed_exchanges``).

Under sequence parallelism each TP rank routes its own slice of the sequence, dispatched and
combined as above. Without it the routed tokens are the same on every TP rank, so each TP rank takes
its share of every expert's rows before the dispatch (``rt.moe_tp_share``: ``copy_to_tp`` first, so
the input's gradient is summed over TP) and the shares are put back together after the combine
(``rt.moe_tp_unshare``, zeros elsewhere, then ``reduce_from_tp``): experts compute each token once,
wherever the EP group lies (MoE parallel folding: the EP ranks come from the stage's tp x cp x dp
ranks).

``expert_balance`` (a pass of its own, run for every plan) counts each layer's expert loads in
forward (``rt.moe_record_load`` on the selected expert ids) and finds the layer's routing bias: a
buffer added to the router scores that reaches only the choice of experts, never the gates
(DeepSeek-V3's auxiliary-loss-free balancing); the training program updates it after each step.
Under sequence parallelism each TP rank counts its own tokens, so the loads summed over the routing
ranks are the layer's. It also puts ``rt.moe_balance_loss`` on the routed rows, with the router's
affinities and choice (and under sequence parallelism this rank's slice of each sequence, the loss's
terms counted over the whole sequences): the identity unless the program is run with a balance loss
(``train.py --aux-loss``), which it then attaches there, on whichever pipeline stage holds the
layer.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from autoshard.ir import ops
from autoshard.passes._graph import describe, note, place
from autoshard.passes.contract import Refusal, RewriteContext, decisions
from autoshard.passes.tensor_parallel import ParamShard, _localise, _param
from autoshard.runtime import collectives, moe

_KEEP_ROWS = ("getitem", "split", "view", "unsqueeze", "squeeze", "transpose", "permute", "expand", "slice")


@dataclass
class Region:
    """One MoE layer's expert region."""

    kind: str  # grouped | buffer
    experts: int
    inlet: fx.Node  # the tensor dispatched: rows grouped by expert, or the (E, C, H) buffer
    offs: fx.Node | None  # grouped: cumulative rows per expert
    gemms: list[fx.Node]
    weights: list[str]  # stacked expert parameters, and every parameter of a stack in the graph
    members: set[fx.Node] = field(default_factory=set)
    stacks: list[tuple[str, ...]] = field(default_factory=list)  # the parameters each graph stack reads

    def add(self, target: str | tuple[str, ...]) -> None:
        """Record the weight a GEMM of the region reads (``_weight_target``)."""
        if isinstance(target, tuple) and target not in self.stacks:
            self.stacks.append(target)
        for name in target if isinstance(target, tuple) else (target,):
            if name not in self.weights:
                self.weights.append(name)

    @property
    def where(self) -> str:
        return _module_path(self.gemms[0]) or self.gemms[0].name


def _module_path(node: fx.Node) -> str:
    """The dotted path of the innermost module ``node`` was traced in ("" outside every module)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [str(v[0]) for v in stack.values() if isinstance(v, tuple)]
    return paths[-1] if paths else ""


def _fail(region_or_node, why: str, divides: int | None = None, ep: int | None = None) -> Refusal:
    """Every EP degree above 1 refused, or with ``divides`` N those that do not divide N."""
    node = region_or_node.gemms[0] if isinstance(region_or_node, Region) else region_or_node
    return Refusal.at(node, "expert parallelism cannot shard the experts of {node}", why, "ep", ep, divides)


# ---------------------------------------------------------------------------------------------
# finding the regions


def _weight_target(node: fx.Node) -> str | tuple[str, ...] | None:
    """The parameter a stacked-weight argument reads (through views and casts), the parameters
    a ``torch.stack`` of them reads (after this pass, through its exchange), or None."""
    while node.op != "get_attr":
        if (params := ops.stacked_parameters(node)) is not None:
            return tuple(p.target for p in params)
        exchanged = node.target is moe.dispatch_buffer and ops.stacked_parameters(node.args[0]) is not None
        if not (exchanged or ops.is_weight(node)):
            return None
        node = node.args[0]
    return node.target


def _experts(gm: fx.GraphModule, target: str | tuple[str, ...]) -> int:
    return len(target) if isinstance(target, tuple) else int(_param(gm, target).shape[0])


def _gemm_parts(gemm: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """(activation, weight, offs) of an expert GEMM; None if it is not one this pass reads."""
    args = [a for a in gemm.args if isinstance(a, fx.Node)]
    if ops.op_name(gemm) in ops.GROUPED_MATMULS or gemm.meta.get("op") in ops.GROUPED_MATMULS:
        offs = gemm.args[2] if len(gemm.args) > 2 else gemm.kwargs.get("offs")
        return (gemm.args[0], gemm.args[1], offs) if isinstance(offs, fx.Node) else None
    weights = [a for a in args if ops.is_weight(a)]
    acts = [a for a in args if not ops.is_weight(a)]
    if len(weights) == 1 and len(acts) == 1 and len(acts[0].meta.get("shape") or ()) == 3:
        return acts[0], weights[0], None
    return None


def find_regions(gm: fx.GraphModule, ep: int | None = None) -> list[Region]:
    """Every MoE layer's expert region, in graph order. Experts this pass cannot read are refused
    for ``ep`` (``Refusal``), or, with ``ep=None``, left out."""
    regions: list[Region] = []
    done: set[fx.Node] = set()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    products = [n for n in gm.graph.nodes if n.meta.get("op_class") == "experts"]
    for gemm in products:
        if gemm in done:
            continue
        parts = _gemm_parts(gemm)
        target = _weight_target(parts[1]) if parts is not None else None
        if target is None:
            if ep is None:
                continue
            raise _fail(
                gemm,
                "it is an expert product of a kind this pass does not split (it splits "
                "stacked (E, ., .) weights read by a grouped GEMM over rows sorted by expert, or by a batched "
                "product over an (E, C, H) buffer)",
            )
        act, weight, offs = parts
        experts = _experts(gm, target)
        region = Region("grouped" if offs is not None else "buffer", experts, act, offs, [], [])
        _grow(region, gm, order)
        loose = [n for n in products if n not in region.members and _shares_inlet(n, region)]
        if loose and ep is None:
            done |= set(loose)
            continue
        if loose:
            raise _fail(region, f"{describe(loose[0])} reads the experts' rows together with other tensors")
        done |= set(region.gemms)
        regions.append(region)
    return regions


def _shares_inlet(node: fx.Node, region: Region) -> bool:
    parts = _gemm_parts(node)
    if parts is None:
        return False
    return parts[2] is region.offs if region.offs is not None else parts[0] is region.inlet


def _grow(region: Region, gm: fx.GraphModule, order: dict) -> None:
    """The nodes computed from the inlet alone, row by row, with the stacked weights: the
    region's members (the GEMMs among them)."""
    inside = {region.inlet}
    rows = _rows(region.inlet, region.kind)
    start = order[region.inlet]
    # no node past the last reader of what is inside can join: the walk stops there (it would
    # otherwise run to the graph's end once per MoE layer)
    last = max((order[u] for u in region.inlet.users), default=start)
    for node in list(gm.graph.nodes)[start + 1 :]:
        if order[node] > last:
            break
        ins = node.all_input_nodes
        if not any(i in inside for i in ins):
            continue
        if not all(i in inside or _outside_ok(i, region) for i in ins):
            continue
        if node.meta.get("op_class") == "experts":
            parts = _gemm_parts(node)
            if parts is None or (region.offs is not None and parts[2] is not region.offs):
                continue
            target = _weight_target(parts[1])
            if target is None or _experts(gm, target) != region.experts:
                continue
            region.gemms.append(node)
            region.add(target)
        elif not _keeps_rows(node, rows, region.kind):
            continue
        inside.add(node)
        last = max(last, *(order[u] for u in node.users)) if node.users else last
    region.members = inside - {region.inlet}


def _outside_ok(node: fx.Node, region: Region) -> bool:
    """An input a region node may read from outside: the stacked weights, the counts, sizes."""
    return node is region.offs or ops.is_weight(node) or node.meta.get("shape") is None and node.op != "call_function"


def _rows(node: fx.Node, kind: str):
    shape = node.meta.get("shape") or ()
    return tuple(shape[:2]) if kind == "buffer" else tuple(shape[:1])


def _keeps_rows(node: fx.Node, rows: tuple, kind: str) -> bool:
    """Acts on each row (each expert's slot) alone and keeps the row dimension(s) first."""
    r = ops.rule_of(node)
    if r is None or r.metadata:
        return False
    if r.tp not in (*ops.TP_ROW_WISE, *_KEEP_ROWS) and r.op_class != "elementwise":
        return False
    shape = node.meta.get("shape")
    if shape is None:  # a split/chunk: its getitems carry the shapes
        return r.tp == "split" and _split_dim(node) >= len(rows)
    return tuple(shape[: len(rows)]) == rows and (r.tp not in ("softmax", "norm") or _last_dim(node))


def _split_dim(node: fx.Node) -> int:
    """The dimension a split/chunk cuts (``x.chunk(n, dim)``, ``x.split(size, dim)``), >= 0."""
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    rank = len(node.args[0].meta.get("shape") or ()) if isinstance(node.args[0], fx.Node) else 0
    return dim % rank if isinstance(dim, int) and rank else -1


def _last_dim(node: fx.Node) -> bool:
    dims = ops.dims_arg(node, len(node.meta.get("shape") or ()))
    return dims is None or all(d == len(node.meta["shape"]) - 1 for d in dims)


# ---------------------------------------------------------------------------------------------
# the rewrite


def expert_parallel(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    """Shard every MoE layer's experts over ``ctx.ep`` ranks, each TP rank computing its share of
    the routed tokens (see the module docstring)."""
    # with EP1 (TP only) experts this pass cannot read stay whole on every TP rank, as before it
    regions = find_regions(gm, ctx.ep if ctx.ep > 1 else None)
    for region in regions:
        if region.experts % ctx.ep:
            raise _fail(region, f"EP{ctx.ep} does not divide its {region.experts} experts", region.experts, ctx.ep)
        _rewrite(gm, region, ctx)
        for target in region.weights:
            if target not in decisions(gm).expert_params:
                decisions(gm).expert_params.append(target)
    gm.graph.lint()
    gm.recompile()
    return gm


def _call(gm: fx.GraphModule, anchor: fx.Node, fn, args: tuple, like: fx.Node | None = None) -> fx.Node:
    with gm.graph.inserting_after(anchor):
        node = gm.graph.call_function(fn, args)
    return place(node, anchor, like)


def _getitem(gm: fx.GraphModule, anchor: fx.Node, source: fx.Node, i: int, like: fx.Node | None) -> fx.Node:
    with gm.graph.inserting_after(anchor):
        node = gm.graph.call_function(operator.getitem, (source, i))
    return place(node, anchor, like)


def _rewrite(gm: fx.GraphModule, region: Region, ctx: RewriteContext) -> None:
    tp, ep = ctx.tp, ctx.ep
    inlet, offs = region.inlet, region.offs
    cursor, rows = inlet, inlet
    share, shared = None, _tp_shared(ctx)
    if shared:  # every TP rank holds the same tokens: each computes its share of each expert's rows
        rows = cursor = _call(gm, cursor, collectives.copy_to_tp, (rows,), inlet)
        if region.kind == "grouped":
            share = cursor = _call(gm, cursor, moe.tp_share, (rows, offs), inlet)
            rows = cursor = _getitem(gm, cursor, share, 0, inlet)
            offs = cursor = _getitem(gm, cursor, share, 1, region.offs)
        else:
            rows = cursor = _call(gm, cursor, moe.tp_share_buffer, (rows,), inlet)
    local_offs, recv = offs, None
    if ep > 1:
        if region.kind == "grouped":
            sent = cursor = _call(gm, cursor, moe.dispatch, (rows, offs), inlet)
            rows = cursor = _getitem(gm, cursor, sent, 0, inlet)
            local_offs = cursor = _getitem(gm, cursor, sent, 1, region.offs)
            recv = cursor = _getitem(gm, cursor, sent, 2, region.offs)
        else:
            rows = cursor = _call(gm, cursor, moe.dispatch_buffer, (rows,), inlet)
    sp = ", sequence parallel" if tp > 1 and not shared else ""
    note(rows, f"ep={ep}, tp={tp}{sp}: this rank's experts' rows ({region.experts // ep} of {region.experts} experts)")
    for node in region.members:
        node.replace_input_with(inlet, rows)
        if region.offs is not None:
            node.replace_input_with(region.offs, local_offs)
    _localise_weights(gm, region, ctx)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for leaving in sorted(_exits(region), key=order.__getitem__):
        _combine(gm, leaving, region, ctx, offs, recv, share)


def _tp_shared(ctx: RewriteContext) -> bool:
    """Do the TP ranks route the same tokens, to be shared out among them? Not under sequence
    parallelism, which hands each TP rank its slice of the tokens (or refuses)."""
    return ctx.tp > 1 and not ctx.sequence_parallel


def _exits(region: Region) -> list[fx.Node]:
    return [n for n in region.members if any(u not in region.members for u in n.users)]


def _combine(gm, leaving: fx.Node, region: Region, ctx: RewriteContext, offs, recv, share) -> None:
    users = [u for u in leaving.users if u not in region.members]
    cursor = out = leaving
    if ctx.ep > 1:
        if region.kind == "grouped":
            out = cursor = _call(gm, cursor, moe.combine, (out, offs, recv), leaving)
        else:
            out = cursor = _call(gm, cursor, moe.combine_buffer, (out,), leaving)
    if _tp_shared(ctx):
        if region.kind == "grouped":
            index = _getitem(gm, cursor, share, 2, None)
            cursor = index
            out = cursor = _call(gm, cursor, moe.tp_unshare, (out, index, region.offs), leaving)
        else:
            out = cursor = _call(gm, cursor, moe.tp_unshare_buffer, (out,), leaving)
        out = _call(gm, cursor, collectives.reduce_from_tp, (out,), leaving)
    for u in users:
        u.replace_input_with(leaving, out)


def _localise_weights(gm: fx.GraphModule, region: Region, ctx: RewriteContext) -> None:
    """This rank's ``E/ep`` experts of each stacked weight (axis ``ep`` of ``decisions(gm).shards``)."""
    if ctx.ep == 1:
        return
    local = region.experts // ctx.ep
    stacked = {name for names in region.stacks for name in names}
    for names in region.stacks:
        _gather_stacked(gm, names, ctx.ep)
    for target in [t for t in region.weights if t not in stacked]:
        _localise(gm, target, (local, *_param(gm, target).shape[1:]))
        decisions(gm).shards[target] = ParamShard(0, (region.experts,), 0, axis="ep")
    for node in gm.graph.nodes:  # the weights' views: E -> E/ep in the recorded shapes
        shape = node.meta.get("shape")
        if not shape or shape[0] != region.experts:
            continue  # first the cheap test: this runs once per MoE layer over the whole graph
        if ops.stacked_parameters(node) is not None or node.op == "get_attr" and node.target in stacked:
            continue  # a stack and its parameters: _gather_stacked gave their shapes
        if ops.is_weight(node) and _weight_target(node) in region.weights:
            node.meta["shape"] = (local, *shape[1:])


def _gather_stacked(gm: fx.GraphModule, names: tuple[str, ...], ep: int) -> None:
    """Each of ``names`` (one expert's parameter each) keeps this rank's ``1/ep`` of its rows;
    their stack becomes the whole weights of this rank's experts by one equal all-to-all."""
    rows = int(_param(gm, names[0]).shape[0])
    if rows % ep:
        raise _fail(
            next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == names[0]),
            f"EP{ep} does not divide the {rows} rows of each expert's parameter",
        )
    for name in names:
        _localise(gm, name, (rows // ep, *_param(gm, name).shape[1:]))
        decisions(gm).shards[name] = ParamShard(0, (rows,), 0, axis="ep")
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and node.target in names and node.meta.get("shape"):
            node.meta["shape"] = (rows // ep, *node.meta["shape"][1:])
        params = ops.stacked_parameters(node)
        if params is None or tuple(p.target for p in params) != names:
            continue
        experts, _, *rest = node.meta["shape"]
        node.meta["shape"] = (experts, rows // ep, *rest)
        whole = _call(gm, node, moe.dispatch_buffer, (node,), node)
        whole.meta["shape"] = (experts // ep, rows, *rest)
        note(whole, f"ep={ep}: the whole weights of this rank's {experts // ep} experts from every rank's rows")
        for u in [u for u in node.users if u is not whole]:
            u.replace_input_with(node, whole)
            if (u.meta.get("shape") or (None,))[0] == experts:  # a view of the weights: E -> E/ep
                u.meta["shape"] = (experts // ep, *u.meta["shape"][1:])


def no_experts_left_whole(gm: fx.GraphModule, ctx: RewriteContext) -> str | None:
    """After the pass: every stacked expert weight holds ``E/ep`` experts."""
    if ctx.ep == 1:
        return None
    for target in decisions(gm).expert_params:
        spec = decisions(gm).shards.get(target)
        if spec is None or getattr(spec, "axis", "tp") != "ep":
            return f"expert weight {target} is not split over the EP ranks"
    return None


# ---------------------------------------------------------------------------------------------
# load balancing


def expert_balance(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    """Count each MoE layer's expert loads in forward and record its routing bias, if it has one
    (``decisions(gm).routing``: layer key -> {"experts", "bias"}), for the program's balancing step."""
    for region in find_regions(gm):
        chosen = _selection(region)
        if chosen is None:  # the loads of a routing this pass does not read are not logged
            continue
        key = region.where
        with gm.graph.inserting_after(chosen):
            counted = gm.graph.call_function(moe.record_load, (chosen, region.experts, key))
        place(counted, chosen, chosen)
        for u in [u for u in chosen.users if u is not counted]:
            u.replace_input_with(chosen, counted)
        scores = _affinities(chosen, region.experts)
        if scores is not None:  # where the program's optional balance loss attaches (identity by default)
            with gm.graph.inserting_after(region.inlet):
                sliced = ctx.tp > 1 and ctx.sequence_parallel  # each TP rank routes its slice of each sequence
                seq = ctx.seq // ctx.tp if sliced else ctx.seq
                attached = gm.graph.call_function(
                    moe.balance_loss, (region.inlet, scores, counted, region.experts, seq, key, sliced)
                )
            place(attached, region.inlet, region.inlet)
            for u in [u for u in region.inlet.users if u is not attached]:
                u.replace_input_with(region.inlet, attached)
        bias = _routing_bias(gm, chosen, region.experts)
        decisions(gm).routing[key] = {
            "experts": region.experts,
            "top_k": _top_k(chosen),
            "bias": bias,
            "router": _module_path(chosen.args[0]),  # where the choice is made (verification replays it)
        }
        note(counted, "expert loads counted for balancing" + (f" (routing bias {bias})" if bias else ""))
    gm.graph.lint()
    gm.recompile()
    return gm


def _top_k(chosen: fx.Node) -> int:
    shape = chosen.meta.get("shape") or (0, 0)
    return int(shape[-1])


def _ancestors(node: fx.Node, stop=lambda n: False) -> list[fx.Node]:
    seen, frontier, out = {node}, [node], []
    while frontier:
        n = frontier.pop()
        for a in n.all_input_nodes:
            if a not in seen and not stop(a):
                seen.add(a)
                out.append(a)
                frontier.append(a)
    return out


def _selection(region: Region) -> fx.Node | None:
    """The router's choice of experts that orders the region's rows: the indices output of a
    top-k over the ``E`` expert scores, the nearest one above the inlet (and the counts)."""
    starts = [region.inlet] + ([region.offs] if region.offs is not None else [])
    best, best_depth = None, None
    for start in starts:
        frontier, seen, depth = [start], {start}, 0
        while frontier and depth < 40:
            nxt = []
            for n in frontier:
                if _is_topk_indices(n, region.experts):
                    if best_depth is None or depth < best_depth:
                        best, best_depth = n, depth
                    continue
                for a in n.all_input_nodes:
                    if a not in seen and a.op != "get_attr":
                        seen.add(a)
                        nxt.append(a)
            frontier, depth = nxt, depth + 1
    return best


def _is_topk_indices(node: fx.Node, experts: int) -> bool:
    if node.op != "call_function" or node.target is not operator.getitem or node.args[1] != 1:
        return False
    src = node.args[0]
    if not isinstance(src, fx.Node) or src.meta.get("op") != "topk":
        return False
    shape = src.args[0].meta.get("shape") if isinstance(src.args[0], fx.Node) else None
    return bool(shape) and shape[-1] == experts


def _affinities(chosen: fx.Node, experts: int) -> fx.Node | None:
    """The router's token-to-expert affinities the choice is made from: the nearest sigmoid or
    softmax over the ``E`` experts above the top-k."""
    frontier, seen = [chosen.args[0]], set()
    while frontier:
        n = frontier.pop(0)
        for a in n.all_input_nodes:
            if a in seen or a.meta.get("op_class") == "router":
                continue
            seen.add(a)
            shape = a.meta.get("shape") or ()
            if a.meta.get("op") in ("sigmoid", "softmax", "_softmax") and shape and shape[-1] == experts:
                return a
            frontier.append(a)
    return None


def _routing_bias(gm: fx.GraphModule, chosen: fx.Node, experts: int) -> str | None:
    """A buffer of ``E`` values added to the scores the choice is made from, whose values reach
    nothing but that choice (a float path from it ends in ids, masks or nothing)."""
    topk = chosen.args[0]
    for node in _ancestors(topk, stop=lambda n: n.meta.get("op_class") in ("router", "matmul")):
        if node.op != "get_attr" or _is_parameter(gm, node.target):
            continue
        if tuple(node.meta.get("shape") or ()) != (experts,):
            continue
        if _selection_only(node):
            return node.target
    return None


def _is_parameter(gm: fx.GraphModule, target: str) -> bool:
    owner, _, leaf = target.rpartition(".")
    return leaf in (gm.get_submodule(owner) if owner else gm)._parameters


def _selection_only(bias: fx.Node) -> bool:
    """Every float value computed from ``bias`` dies out in integer or boolean tensors (ids,
    masks) before anything is output: it steers which experts are chosen, not their gates."""
    frontier, seen = [bias], {bias}
    while frontier:
        for u in frontier.pop().users:
            if u.op == "output":
                return False
            if u not in seen and not _ids_or_mask(u):
                seen.add(u)
                frontier.append(u)
    return True


def _ids_or_mask(node: fx.Node) -> bool:
    """An integer or boolean tensor: the indices a top-k returns, a comparison's mask."""
    src = node.args[0] if node.args else None
    if node.target is operator.getitem and isinstance(src, fx.Node) and src.meta.get("op") == "topk":
        return node.args[1] == 1
    dtype = node.meta.get("dtype")
    return isinstance(dtype, torch.dtype) and not dtype.is_floating_point


__all__ = ["Region", "find_regions", "expert_parallel", "expert_balance", "no_experts_left_whole"]
