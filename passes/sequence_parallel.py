"""Sequence parallelism (Korthikanti et al. 2022): between tensor-parallel regions, the residual
stream, its norms, dropouts and residual adds run on this rank's slice of the sequence.

Runs after ``tensor_parallel``. The hidden state entering the first layer is split along the
sequence (``scatter_to_sp``); each ``reduce_from_tp`` (all-reduce) at the end of a TP region
becomes ``reduce_scatter_to_sp``; each ``copy_to_tp`` at the start of one becomes
``gather_from_sp`` (all-gather). Everything between must be per-token (norms, pointwise ops); a
``size`` of the sequence dimension read there is multiplied back to the full length, so the model's
code keeps seeing the length it was written for. The parameters used in that stretch (norm
weights, biases added after a row matmul) see only this rank's tokens, so their gradients are
partial sums: ``decisions(gm).partial_grads`` lists them for the runtime to all-reduce over the TP group.

What is per-token is each op's ``sp`` rule in the op table (``autoshard.ir.ops.RULES``): pointwise
ops, reductions over features, norms (module or function), slices that keep everything; and here
slices, splits and concatenations of features and basic indexing that keeps the tokens; ops that
read only metadata are left alone (sizes of the sequence are restored). Linear layers that tensor
parallelism leaves whole (multi-head latent attention's down-projections) run on the slice too,
their weights' gradients partial; an operand spanning the whole sequence (a rotary table over every
position) is cut to this rank's positions (``scatter_to_sp``). Anything else on the sliced stream is
refused (``Refusal(axis="sp")``), naming the op's line.

A MoE layer runs on this rank's tokens as on a shorter sequence (``_moe_islands``): the router
reads the slice, the expert-parallel pass sends the routed rows to their experts and back (no
sequence all-gather or reduce-scatter around them, no sharing of rows among the TP ranks), and
the sizes read inside are this rank's. The router's weight gradients are partial over TP; the
routed experts' are summed over the ranks holding the same experts by expert parallelism. Shared
experts are dense MLPs like any other: column- and row-parallel, gathered and reduce-scattered.
"""

from __future__ import annotations

import operator

from torch import fx

from autoshard import runtime
from autoshard.ir import B, S, ops
from autoshard.passes._graph import describe, downstream, note, place, upstream
from autoshard.passes._graph import op_name as _op
from autoshard.passes._graph import seq_dim as _seq_dim
from autoshard.passes.contract import Refusal, RewriteContext, decisions
from autoshard.passes.expert_parallel import _split_dim, find_regions


def _fail(node: fx.Node, why: str) -> Refusal:
    refused = "sequence parallelism cannot run {node} on a slice of the sequence"
    return Refusal.at(node, refused, why, "sp", value=True, fix="--force sp=off (or --force tp=1)")


def _reduces_itself(node: fx.Node) -> bool:
    """A vocabulary-parallel embedding, which can reduce-scatter its partial sums itself."""
    return node.op == "call_function" and node.target is runtime.vocab_parallel_embedding


def _retarget(node: fx.Node, target, args: tuple) -> None:
    """Call ``target`` at ``node`` instead, renamed after it (the code reads
    ``gather_from_sp = rt.gather_from_sp(...)``, not the ``copy_to_tp`` it replaced), and the
    note on the row matmul whose partial sums it reduces says how they are reduced now."""
    node.target, node.args = target, args
    node.meta["op"] = ops.op_name(node)
    node._rename(target.__name__)
    source, said = args[0], "all-reduced by reduce_from_tp"
    if isinstance(source, fx.Node) and said in source.meta.get("note", ""):
        source.meta["note"] = source.meta["note"].replace(said, f"reduce-scattered by {target.__name__}")


def sequence_parallel(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    """Rewrite ``gm`` (after ``tensor_parallel``) in place; adds the parameters whose gradients
    are partial over TP to ``decisions(gm).partial_grads`` and a comment per changed node to its ``meta["note"]``."""
    if ctx.tp == 1:
        return gm
    frontier = _reduce_scatter_region_ends(gm.graph, ctx)
    frontier += [_slice_entry(gm.graph, entry, ctx) for entry in _stream_entries(gm.graph)]
    partial = _follow_slices(gm, ctx, frontier)
    gm.graph.lint()
    gm.recompile()
    decisions(gm).partial_grads.extend(sorted(partial))
    return gm


def _reduce_scatter_region_ends(graph: fx.Graph, ctx: RewriteContext) -> list[fx.Node]:
    """Each TP region's closing all-reduce outside the embedding becomes a reduce-scatter onto
    the sequence slices (of the rows of flattened tokens when there is no sequence dimension);
    returns those nodes, where the sliced stream starts."""
    tp = ctx.tp
    frontier: list[fx.Node] = []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is runtime.reduce_from_tp and node.meta.get("region") != "pre":
            dim = _seq_dim(node)
            if dim is None and _flat_tokens(node) and ctx.seq:
                _retarget(node, runtime.reduce_scatter_tokens, (node.args[0], ctx.seq))
                dim = 0
            elif dim is None:
                raise _fail(node, "no sequence dimension")
            else:
                _retarget(node, runtime.reduce_scatter_to_sp, (node.args[0], dim))
            node.meta["note"] = f"sequence parallel: reduce-scatter the partial sums onto {tp} sequence slices"
            node.meta["sp_sliced_dim"], node.meta["sp_tp"] = dim, tp
            frontier.append(node)
    return frontier


def _stream_entries(graph: fx.Graph) -> set[fx.Node]:
    """The hidden state entering the layer stack: what a layer's first norm and residual add
    read from the embedding region."""
    first = [
        n
        for n in graph.nodes
        if n.meta.get("region") in ("layer", "post") and any(a.meta.get("region") == "pre" for a in n.all_input_nodes)
    ]
    entries = set()
    for n in first:
        for a in n.all_input_nodes:
            if a.meta.get("region") == "pre" and a.op != "get_attr" and _seq_dim(a) is not None and _residual_reader(n):
                entries.add(a)
    return entries


def _slice_entry(graph: fx.Graph, a: fx.Node, ctx: RewriteContext) -> fx.Node:
    """Hand the layers this rank's slice of the entering hidden state ``a``; returns the node
    that holds the slice."""
    tp = ctx.tp
    readers = [u for u in a.users if u.meta.get("region") in ("layer", "post") and _residual_reader(u)]
    if _reduces_itself(a) and set(readers) == set(a.users):
        # the vocabulary-parallel embedding's partial sums reduce-scattered onto the slices,
        # rather than all-reduced and then cut
        a.kwargs = {**a.kwargs, "sp_dim": _seq_dim(a)}
        a.meta["sp_sliced_dim"], a.meta["sp_tp"] = _seq_dim(a), tp
        note(a, f"sequence parallel: reduce-scatter the partial sums onto {tp} sequence slices")
        return a
    with graph.inserting_after(a):
        scatter = graph.call_function(runtime.scatter_to_sp, (a, _seq_dim(a)))
    place(scatter, a, tp="replicated", sp_sliced_dim=_seq_dim(a), sp_tp=tp)  # (the end of the embedding region)
    scatter.meta["note"] = f"sequence parallel: keep this rank's 1/{tp} of the sequence from here on"
    for user in list(a.users):
        if user is not scatter and user.meta.get("region") in ("layer", "post") and _residual_reader(user):
            user.replace_input_with(a, scatter)
    return scatter


def _follow_slices(gm: fx.GraphModule, ctx: RewriteContext, frontier: list[fx.Node]) -> set[str]:
    """Follow the sliced stream from ``frontier``, in program order, to the next TP region,
    whose input is gathered again: every op on the way runs on the slice or is refused. Returns
    the parameters whose gradients are partial over TP."""
    tp, graph = ctx.tp, gm.graph
    sliced: set[fx.Node] = set(frontier)
    partial: set[str] = set()
    island = _moe_islands(graph)
    experts = {w for region in find_regions(gm) for w in region.weights} if island else set()
    fulls: dict[fx.Node, fx.Node] = {}  # a size of the sliced dimension made whole -> the size read
    for user in list(graph.nodes):
        if user in sliced:
            continue
        inputs = [a for a in user.all_input_nodes if a in sliced]
        if not inputs:
            continue
        node = inputs[0]
        if user.op == "call_function" and user.target is runtime.copy_to_tp:
            _gather_at_region_start(user, node, ctx)
            continue
        if user.op == "output":
            continue
        row = ops.rule_of(user)
        if row is not None and row.metadata == "size":
            full = _size_to_full(graph, user, node, tp, island)
            if full is not None:
                fulls[full] = user
            if user not in island:
                continue
        elif row is not None and row.metadata == "attr":
            continue  # reads only the dtype, device or rank
        if user in island:  # a MoE layer's routing and experts: they run on this rank's tokens as they are
            partial.update(_island_parameters(gm, user, sliced) - experts)
            sliced.add(user)
            user.meta["sp_sliced_dim"], user.meta["sp_tp"] = _sliced_dim(user), tp
            continue
        if row is not None and row.sp == "view":
            if not _view_of_tokens(graph, user, node, tp, ctx.seq):
                raise _fail(user, "a view that mixes the sequence with features")
        elif not _per_token(user, node, row):
            raise _fail(user, _why_not_per_token(user, row))
        else:
            partial.update(_partial_parameters(gm, user, node, row, sliced))
        sliced.add(user)
        user.meta["sp_sliced_dim"], user.meta["sp_tp"] = _sliced_dim(user), tp
    _localise_island_sizes(graph, island, sliced, fulls, tp)
    return partial


def _gather_at_region_start(copy: fx.Node, sliced: fx.Node, ctx: RewriteContext) -> None:
    """The ``copy_to_tp`` opening a TP region becomes an all-gather of the sequence (of the rows
    of flattened tokens when ``sliced`` has no sequence dimension)."""
    if _seq_dim(sliced) is None:  # rows of flattened (batch, sequence)
        _retarget(copy, runtime.gather_tokens, (copy.args[0], ctx.seq))
    else:
        _retarget(copy, runtime.gather_from_sp, (copy.args[0], _seq_dim(sliced)))
    copy.meta["note"] = "sequence parallel: all-gather the sequence before the column matmuls"


def _partial_parameters(
    gm: fx.GraphModule, user: fx.Node, sliced: fx.Node, row: ops.OpRule | None, stream: set[fx.Node]
) -> set[str]:
    """The parameters the per-token op ``user`` applies to this rank's tokens only, whose
    gradients are therefore partial: a norm module's own, or the operands off the sliced
    ``stream`` of a pointwise op or functional norm (each checked to broadcast along the
    sequence)."""
    if user.op == "call_module":
        return {f"{user.target}.{p}" for p, _ in gm.get_submodule(user.target).named_parameters()}
    found: set[str] = set()
    if row.sp in ("pointwise", "norm") or row.tp == "linear":
        for other in user.all_input_nodes:
            if other in stream:
                continue
            if other.op == "get_attr":
                found.add(other.target)
            elif row.tp == "linear" or not _slice_operand(gm.graph, user, other, sliced):
                found.update(_parameters_behind(other))
    return found


def _per_token(user: fx.Node, sliced: fx.Node, row: ops.OpRule | None) -> bool:
    """Does ``user`` compute each token of its output from the same token of ``sliced``?"""
    kind = row.sp if row is not None else None
    if kind in ("norm", "pointwise"):
        return True
    if kind == "reduce":  # over features: the sequence dimension stays where it was
        seq = _sliced_dim(sliced)
        dims = ops.dims_arg(user, len(sliced.meta["shape"]))
        return _sliced_dim(user) == seq and dims is not None and seq not in dims
    if kind == "same_shape":  # a slice that keeps everything, or one of features
        dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0)
        rank = len(sliced.meta["shape"])
        same = user.meta.get("shape") == sliced.meta.get("shape")
        return same or (isinstance(dim, int) and dim % rank != _sliced_dim(sliced) and _sliced_dim(user) is not None)
    if row is not None and row.tp == "linear":  # one TP leaves whole: a product over each token's features
        return user.op == "call_module" or user.args[0] is sliced
    if row is not None and row.tp == "split":  # into groups of features
        return _split_dim(user) != _sliced_dim(sliced)
    if ops.op_name(user) == "cat":  # of sliced tensors, along features
        parts, dim = user.args[0], user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0)
        seq = _sliced_dim(sliced)
        rank = len(sliced.meta["shape"])
        return dim % rank != seq and all(p.meta.get("sp_sliced_dim") == seq for p in parts)
    if row is not None and row.tp == "getitem":  # one output of a split, or a basic index keeping the tokens
        if isinstance(sliced.meta.get("shape"), (tuple, list)):
            return _basic_index(user.args[1]) and _sliced_dim(user) is not None
        return True
    return False


def _basic_index(index) -> bool:
    """An index of slices, integers, ``None`` and ``...`` only (no tensor picks rows)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items)


def _why_not_per_token(user: fx.Node, row: ops.OpRule | None) -> str:
    """Why ``user`` cannot run on the slice."""
    if row is not None and row.tp == "linear":
        return "it multiplies the slice by a tensor other than a weight"
    return f"{_op(user)!r} is not per-token"


def _moe_islands(graph: fx.Graph) -> set[fx.Node]:
    """The nodes of every MoE layer that run on this rank's tokens as they are, as on a shorter
    sequence: from the stream the router reads (through views: its sizes and views included) to
    the first node every path from the router passes through that has the shape of that stream
    again (the combined experts' output). Routing, dispatch and combine mix tokens (sorting by expert,
    capacity counts) but each token's result is its own, so the sliced stream passes through
    whole; sizes read inside stay this rank's."""
    routers = [n for n in graph.nodes if n.meta.get("op_class") == "router"]
    if not routers:
        return set()
    after = _post_dominators(graph)
    island: set[fx.Node] = set()
    for router in routers:
        tokens = next(a for a in router.all_input_nodes if not ops.is_weight(a))
        entry = _stream_entry(tokens)
        shapes = (tokens.meta.get("shape"), entry.meta.get("shape"))
        exit_ = after.get(router)
        while exit_ is not None and exit_.op != "output" and exit_.meta.get("shape") not in shapes:
            exit_ = after.get(exit_)
        if exit_ is not None and exit_.op != "output":
            island |= (downstream(entry) & upstream(exit_)) - {entry} | {exit_}
    return island


def _post_dominators(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Each node's immediate post-dominator: the nearest node every path from it to the output takes."""
    import networkx as nx  # lazy: a third of a second to import, and only MoE islands under SP need it

    reverse = nx.DiGraph()
    for node in graph.nodes:
        reverse.add_node(node)
        for user in node.users:
            reverse.add_edge(user, node)
    sink = next(n for n in reversed(graph.nodes) if n.op == "output")
    doms = nx.immediate_dominators(reverse, sink)
    return {n: d for n, d in doms.items() if d is not n}


def _stream_entry(node: fx.Node) -> fx.Node:
    """The stream tensor the router's input ``node`` is, above the views that flatten it into rows."""
    while (row := ops.rule_of(node)) is not None and row.sp == "view" and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _island_parameters(gm: fx.GraphModule, node: fx.Node, sliced: set[fx.Node]) -> set[str]:
    """The trainable parameters a MoE island node applies to this rank's tokens: their gradients
    are partial over TP (the caller leaves out the routed experts' stacked weights, whose
    gradients expert parallelism sums over the ranks holding the same experts)."""
    if node.op == "call_module":
        return {f"{node.target}.{p}" for p, _ in gm.get_submodule(node.target).named_parameters()}
    found = set()
    for a in node.all_input_nodes:
        while a not in sliced and a.op != "get_attr" and ops.is_weight(a):  # a view or cast of a weight
            a = a.all_input_nodes[0]
        if a.op == "get_attr" and a.meta.get("requires_grad"):
            found.add(a.target)
    return found


def _localise_island_sizes(
    graph: fx.Graph, island: set[fx.Node], sliced: set[fx.Node], fulls: dict[fx.Node, fx.Node], tp: int
) -> None:
    """What a MoE island reads from outside that was computed from sizes alone (a number of rows,
    an ``arange`` over them) is recomputed from this rank's share of the sequence: a size of the
    whole sequence (or of the flattened tokens) of an unsliced tensor, such as the token ids,
    becomes ``size // tp``, one made whole by ``_size_to_full`` the size it was made from."""
    memo: dict[fx.Node, fx.Node] = {}

    def local(a: fx.Node, reader: fx.Node) -> fx.Node:
        if a in memo:
            return memo[a]
        memo[a] = a
        row = ops.rule_of(a)
        if a in fulls:
            memo[a] = fulls[a]
        elif row is not None and row.metadata == "size" and a.args[0] not in sliced:
            memo[a] = _local_size(graph, a, tp)
        elif a.op == "call_function" and all(i.meta.get("shape") is None for i in a.all_input_nodes):
            args = {i: local(i, reader) for i in a.all_input_nodes}
            if any(i is not j for i, j in args.items()):
                with graph.inserting_before(reader):  # after what it reads, before the first island reader
                    clone = graph.node_copy(a, args.__getitem__)
                place(clone, a, like=a)
                memo[a] = clone
        return memo[a]

    for node in [n for n in graph.nodes if n in island]:
        for a in node.all_input_nodes:
            if a not in island and a not in sliced and not ops.is_weight(a):
                node.replace_input_with(a, local(a, node))
    # the whole-sequence sizes the island read and nothing else does (numbers, not tensors): left,
    # they would be dead code in the emitted program
    for a in reversed(list(graph.nodes)):
        dead = not a.users and a.op in ("call_function", "call_method") and a.meta.get("shape") is None
        if dead and not a.is_impure():
            graph.erase_node(a)


def _local_size(graph: fx.Graph, size: fx.Node, tp: int) -> fx.Node:
    """``size // tp`` where ``size`` reads the sequence (or flattened tokens) of its tensor, else ``size``."""
    tensor = size.args[0]
    shape = tensor.meta.get("shape") if isinstance(tensor, fx.Node) else None
    dim = size.args[1] if len(size.args) > 1 else size.kwargs.get("dim")
    if not isinstance(shape, (tuple, list)) or not isinstance(dim, int) or shape[dim] not in (S, B * S):
        return size
    with graph.inserting_after(size):
        share = graph.call_function(operator.floordiv, (size, tp))
    return place(share, size, like=size)


def no_tp_all_reduce_left(gm: fx.GraphModule, ctx: RewriteContext) -> str | None:
    """Ensured: outside the embedding ('pre') every TP all-reduce became a reduce-scatter."""
    for node in gm.graph.nodes:
        if node.target is runtime.reduce_from_tp and node.meta.get("region") != "pre":
            return f"{node.name} still all-reduces over TP in region {node.meta.get('region')!r}"
    return None


def _residual_reader(node: fx.Node) -> bool:
    """A node of the residual stream: a norm, or a pointwise op (the residual add)."""
    if node.op == "call_module":
        return node.meta.get("op_class") == "norm"
    row = ops.rule_of(node)
    return row is not None and row.sp in ("pointwise", "norm")


def _flat_tokens(node: fx.Node) -> bool:
    """Rows of flattened (batch, sequence): a 2-or-more-dimensional tensor whose first size is b*s."""
    shape = node.meta.get("shape")
    if not isinstance(shape, (tuple, list)) or len(shape) < 2 or not getattr(shape[0], "free_symbols", None):
        return False
    return bool(shape[0] == B * S)


def _sliced_dim(node: fx.Node) -> int | None:
    """The dimension that holds this rank's tokens: the sequence, or the rows of flattened tokens."""
    dim = _seq_dim(node)
    return 0 if dim is None and _flat_tokens(node) else dim


def _view_of_tokens(graph: fx.Graph, view: fx.Node, src: fx.Node, tp: int, seq: int) -> bool:
    """A view of the sliced stream that keeps every token's features together: the sequence stays
    a dimension, or (batch, sequence) is flattened into rows or unflattened back. A size it is
    given for the sequence is the whole one (read from an unsliced input, or made whole by
    ``_size_to_full``) and becomes this rank's share."""
    before, after = _sliced_dim(src), _sliced_dim(view)
    if before is None or after is None or (_seq_dim(src) is None and _seq_dim(view) is None and not seq):
        return False
    args = list(view.args)
    packed = len(args) == 2 and isinstance(args[1], (tuple, list))
    sizes = list(args[1]) if packed else args[1:]
    k = _seq_dim(view)
    if k is None:  # into rows: (b, s, ...) -> (b*s, ...), spelt -1
        if _seq_dim(src) not in (None, 1) or not sizes:
            return False
        sizes[0] = -1
    elif _seq_dim(src) is None and k != 1:  # out of rows: (b*s, ...) -> (b, s, ...) only
        return False
    elif k < len(sizes) and isinstance(sizes[k], int) and sizes[k] != -1:
        sizes[k] = sizes[k] // tp
    elif k < len(sizes) and isinstance(sizes[k], fx.Node):
        with graph.inserting_before(view):
            local = graph.call_function(operator.floordiv, (sizes[k], tp))
        place(local, view, like=sizes[k])
        sizes[k] = local
    elif k < len(sizes) and not isinstance(sizes[k], int):
        return False
    if packed:
        view.args = (args[0], type(args[1])(sizes))
    else:
        view.args = (args[0], *sizes)
    return True


def _parameters_behind(node: fx.Node) -> set[str]:
    """The trainable parameters a replicated operand is computed from (Gemma's norm scales by
    ``1 + weight``): applied to this rank's tokens only, their gradients are partial too."""
    found, seen, todo = set(), set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr":
            if n.meta.get("requires_grad"):
                found.add(n.target)
        else:
            todo.extend(n.all_input_nodes)
    return found


def _slice_operand(graph: fx.Graph, user: fx.Node, other: fx.Node, sliced: fx.Node) -> bool:
    """An operand ``other`` of the per-token op ``user`` that spans the whole sequence (a rotary
    embedding's cos and sin over every position) is cut to this rank's slice (``scatter_to_sp``:
    its gradient, all-gathered, is whole on every rank); returns whether it was. One that
    broadcasts along the sequence is left as it is; any other is refused."""
    dim = _seq_dim(sliced)
    shape, full = other.meta.get("shape"), sliced.meta.get("shape")
    if dim is None or not isinstance(shape, (tuple, list)):
        return False
    k = dim - (len(full) - len(shape))
    if not 0 <= k < len(shape) or shape[k] == 1:
        return False
    if shape[k] != S:
        raise _fail(user, f"its operand {describe(other)} spans the sequence in a way it cannot slice")
    with graph.inserting_before(user):
        scatter = graph.call_function(runtime.scatter_to_sp, (other, k))
    place(scatter, user, like=other, tp="replicated", sp_sliced_dim=k, sp_tp=sliced.meta.get("sp_tp"))
    note(scatter, "sequence parallel: this rank's positions of a tensor over the whole sequence")
    user.replace_input_with(other, scatter)
    return True


def _size_to_full(graph: fx.Graph, size: fx.Node, source: fx.Node, tp: int, island: set[fx.Node]) -> fx.Node | None:
    """A size of the sliced dimension, made whole again for every reader outside a MoE ``island``
    (which runs on this rank's tokens and reads their number); returns the whole size's node."""
    dim = size.args[1] if len(size.args) > 1 else size.kwargs.get("dim")
    seq = _sliced_dim(source)
    rank = len(source.meta["shape"])
    if dim is None or (dim + rank if dim < 0 else dim) != seq:
        return None
    with graph.inserting_after(size):
        full = graph.call_function(operator.mul, (size, tp))
    place(full, size)
    size.replace_all_uses_with(full, delete_user_cb=lambda u: u is not full and u not in island)
    return full
