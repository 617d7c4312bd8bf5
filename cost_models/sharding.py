"""Tensor-parallel structure, found from the graph (never from module names).

A weighted matmul whose input is replicated is *column-parallel* when every path from its output
passes only through ops a head/feature shard can cross (pointwise ops, views, attention) and ends
in weighted matmuls, which are then *row-parallel* (Megatron's pairing: QKV -> attention -> output
projection; up/gate -> activation -> down). A weighted matmul whose output reaches the loss that
way is the *vocab-parallel* output head; an embedding indexed by a model input is vocab-parallel.
Everything else stays replicated (norms, routers, low-rank projections feeding a norm).

Which ops a shard crosses is the op table's ``tp`` field (``autoshard.ir.ops.RULES``):
exactly the ops for which the tensor-parallel pass implements a transfer rule, so the planner
never prices a split the pass then refuses for want of a rule.

A column whose output is viewed into heads and split into parts, some of one head (multi-query
attention's key and value in a fused QKV projection, Falcon's), keeps those parts whole on every
TP rank, as Megatron replicates key/value heads fewer than the TP degree (``passes.tensor_parallel``
does): :func:`single_heads` says which features those are, and the nodes that carry them to
attention stay ``replicated``. A key or value column of fewer heads than a TP degree shares each
head between ranks: :func:`attention_heads` says how many it has.

Writes ``node.meta["tp"]`` (``replicated`` | ``sharded`` | ``partial``) and, on weighted matmuls
and embeddings, ``node.meta["tp_role"]`` (``column`` | ``row`` | ``vocab`` | ``replicated``).
"""

from __future__ import annotations

import operator

from torch import fx

from autoshard.ir import ops


def _weighted(node: fx.Node, gm: fx.GraphModule) -> bool:
    r = ops.rule_of(node)
    return r is not None and r.flops == "matmul" and ops.weight_of(node, gm) is not None


def _splittable(node: fx.Node, gm: fx.GraphModule) -> bool:
    """A weighted matmul TP can split: a linear layer (the pass's ``linear`` rule), or experts
    (priced split; the expert-parallel pass owns them)."""
    return _weighted(node, gm) and (ops.rule_of(node).tp == "linear" or node.meta.get("op_class") == "experts")


def _transparent(node: fx.Node) -> bool:
    """A TP shard passes through ``node``: its row names a transfer rule that carries it on."""
    r = ops.rule_of(node)
    return r is not None and r.tp is not None and r.tp not in ops.TP_REGION_ENDS


def _explore(start: fx.Node, gm: fx.GraphModule):
    """Nodes reachable through transparent ops, the weighted matmuls and losses that end the
    paths, and whether every path ended in one of those."""
    region, rows, losses = set(), [], []
    frontier = [start]
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u in region or u in rows or _metadata_query(u):
                continue
            if _weighted(u, gm):
                if u.meta.get("op_class") == "router" or not _splittable(u, gm):
                    return region, rows, losses, False
                rows.append(u)
            elif ops.rule_of(u) is not None and ops.rule_of(u).tp == "loss":
                losses.append(u)
            elif u.op != "output" and _transparent(u):
                region.add(u)
                frontier.append(u)
            else:
                return region, rows, losses, False
    return region, rows, losses, True


def _crossing(start: fx.Node, region: set[fx.Node], order: dict[fx.Node, int]) -> str | None:
    """Does the region reduce over the column's output features themselves (not per head)?
    ``partial``: a sum or mean (OLMo2's q norm over all heads, written out), which the pass
    splits as partial sums all-reduced, but a pairing without one is preferred, so such columns
    are tried last; ``blocked``: a norm op or another reduction over them, which no split can run
    (a low-rank projection's norm, after a split off of its rope part or not). ``order``: each
    node's position in the graph, made once per graph (per column, it was quadratic in its size)."""
    features = {start}  # tensors whose last dimension is (a part of) the column's features
    found = None
    for n in sorted(region, key=order.__getitem__):
        src = next((a for a in n.all_input_nodes if a in features), None)
        if src is None:
            continue
        r = ops.rule_of(n)
        shape, before = n.meta.get("shape") or (), src.meta.get("shape") or ()
        if r is not None and r.tp in ("reduce", "norm"):
            dims = ops.dims_arg(n, len(before)) if r.tp == "reduce" else (len(before) - 1,)
            if dims is None or len(before) - 1 in dims:
                if r.tp == "norm" or n.meta.get("op") not in ("sum", "mean"):
                    return "blocked"
                found = "partial"
                continue
        kept = r is not None and r.tp in ("pointwise", "slice", "split", "getitem", "softmax", "reduce", "norm")
        if kept or (r is not None and r.tp == "view" and shape and before and shape[-1] == before[-1]):
            features.add(n)
    return found


def annotate(gm: fx.GraphModule) -> None:
    nodes = list(gm.graph.nodes)
    for n in nodes:
        n.meta["tp"] = "replicated"
        n.meta.pop("tp_role", None)
    deferred = []
    order = {n: i for i, n in enumerate(nodes)}
    for n in nodes:
        if n.meta.get("op_class") == "embedding":
            indices = ops.tensor_args(n)
            n.meta["tp_role"] = "vocab" if any(_from_input(a) for a in indices) else "replicated"
            continue
        if not _weighted(n, gm) or "tp_role" in n.meta:
            continue
        if n.meta.get("op_class") == "router" or not _splittable(n, gm):
            n.meta["tp_role"] = "replicated"
            continue
        crossing = _crossing(n, _explore(n, gm)[0], order)
        if crossing == "blocked":
            n.meta["tp_role"] = "replicated"
        elif crossing == "partial":
            deferred.append(n)
        else:
            _pair(n, gm)
    for n in deferred:
        if "tp_role" not in n.meta:
            _pair(n, gm, crossing=True)


def _pair(n: fx.Node, gm: fx.GraphModule, crossing: bool = False) -> None:
    """Make ``n`` a column (its region's matmuls rows) or the vocabulary head, else replicated. A
    column that crosses its features (tried last) cannot take a matmul paired already as a column."""
    region, rows, losses, ok = _explore(n, gm)
    if crossing and (losses or any(r.meta.get("tp_role") not in (None, "row") for r in rows)):
        ok = False
    if ok and rows and not losses and all(_only_from(r, region | {n}, gm) for r in rows):
        n.meta["tp_role"] = "column"
        for r in rows:
            r.meta["tp_role"] = "row"
            r.meta["tp"] = "partial"
    elif ok and losses and not rows:
        n.meta["tp_role"] = "vocab"
    else:
        n.meta["tp_role"] = "replicated"
        return
    n.meta["tp"] = "sharded"
    for m in region:
        m.meta["tp"] = "sharded"
    whole, parts = single_heads(n)
    for m in _until_attention(parts, region):
        m.meta["tp"] = "replicated"
    if whole and whole == n.meta["shape"][-1]:  # a key/value projection of one head
        n.meta["tp"] = "replicated"


def single_heads(column: fx.Node) -> tuple[int, list[fx.Node]]:
    """The output features of ``column`` that every TP rank computes whole, and the nodes that
    take them out of its output: the parts of one head of an unequal split of the column's
    output viewed into heads (Falcon's ``fused_qkv.view(b, s, -1, d).split([heads, 1, 1], -2)``),
    or all of them where the output viewed as one head only reaches attention (a multi-query key
    or value projection, ``k_proj(x).view(b, s, 1, d)``). (0, []) for any other column."""
    node = viewed = column
    while True:
        users = [u for u in node.users if not _metadata_query(u)]
        r = ops.rule_of(users[0]) if len(users) == 1 else None
        if r is None or r.tp not in ("view", "transpose", "permute"):
            break
        node = users[0]
        viewed = node if r.tp == "view" else viewed
    split = users[0] if r is not None and r.tp == "split" else None
    shape = viewed.meta.get("shape") or ()
    if split is None and viewed is not column and len(shape) > 2 and shape[-2] == 1 and reaches_attention(viewed):
        return int(column.meta["shape"][-1]), [viewed]
    shape = node.meta.get("shape") or ()
    if split is None or node is column or len(split.args) < 2 or not isinstance(split.args[1], (list, tuple)):
        return 0, []
    sizes = [int(x) for x in split.args[1]]
    features = int(column.meta["shape"][-1])
    dim = (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) % len(shape)
    if len(set(sizes)) == 1 or 1 not in sizes or int(shape[dim]) != sum(sizes) or features == sum(sizes):
        return 0, []  # not a split of heads (of more than one feature each)
    inner = features // sum(sizes)
    parts = [u for u in split.users if u.target is operator.getitem and sizes[u.args[1]] == 1]
    return inner * sizes.count(1), parts


def attention_heads(column: fx.Node) -> int:
    """The heads ``column``'s whole output is viewed into where attention alone reads them (a key
    or value projection, ``k_proj(x).view(b, s, heads, d)``); 0 for any other column. A TP degree
    above them shares each head between ranks (``passes.tensor_parallel``)."""
    users = [u for u in column.users if not _metadata_query(u)]
    r = ops.rule_of(users[0]) if len(users) == 1 else None
    if r is None or r.tp != "view":
        return 0
    shape, features = users[0].meta.get("shape") or (), (column.meta.get("shape") or (0,))[-1]
    if len(shape) < 2 or shape[-2] * shape[-1] != features or not reaches_attention(users[0]):
        return 0
    return int(shape[-2])


def reaches_attention(node: fx.Node) -> bool:
    """Every path from ``node`` ends in attention (through ops other than matmuls and losses)."""
    seen, frontier = set(), [node]
    while frontier:
        for u in frontier.pop().users:
            r = ops.rule_of(u)
            if u in seen or _metadata_query(u) or (r is not None and r.tp == "attention"):
                continue
            if not _transparent(u) or u.op == "output":
                return False
            seen.add(u)
            frontier.append(u)
    return True


def _until_attention(starts: list[fx.Node], region: set[fx.Node]) -> set[fx.Node]:
    """``starts`` and the region's nodes they reach before attention."""
    out, frontier = set(), list(starts)
    while frontier:
        n = frontier.pop()
        if n in out or (ops.rule_of(n) is not None and ops.rule_of(n).tp == "attention"):
            continue
        out.add(n)
        frontier.extend(u for u in n.users if u in region)
    return out


def _metadata_query(node: fx.Node) -> bool:
    """``x.size(-1)``, ``x.dtype``: reads no data (the TP pass rewrites the sizes it returns);
    an element count is not one (no pass restores it on a shard)."""
    r = ops.rule_of(node)
    return r is not None and r.metadata in ("size", "attr")


def _from_input(node: fx.Node) -> bool:
    """Does this tensor come straight (through views) from a model input?"""
    while node.op != "placeholder":
        r = ops.rule_of(node)
        if not (r and r.alias) or not node.args or not isinstance(node.args[0], fx.Node):
            return False
        node = node.args[0]
    return True


def _only_from(row: fx.Node, region: set[fx.Node], gm: fx.GraphModule) -> bool:
    """A row-parallel matmul must take its activation from the sharded region."""
    acts = [a for a in ops.tensor_args(row) if not ops.is_weight(a)]
    return all(a in region for a in acts)


def splits_work(node: fx.Node) -> bool:
    """Is this node's compute divided among the TP ranks?"""
    return node.meta.get("tp") in ("sharded", "partial") or node.meta.get("tp_role") in ("column", "row", "vocab")
