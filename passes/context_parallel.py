"""Context parallelism: each rank of the CP group holds two chunks of every sequence (chunk ``i`` and
``2*cp-1-i``, so causal work is balanced) and attention runs over the whole sequence with ring
attention or all-gathered K/V, as the plan says.

Rewrites, before the tensor-parallel pass:

* the model's token input is cut to this rank's chunks (``cp_shard``) where the model reads it;
  the loss still receives the whole sequence and cuts its labels the same way, after shifting, so
  the next-token targets at chunk edges are right;
* ``arange`` over the sequence length (rotary angles, position ids) becomes ``cp_positions``: the
  global positions of this rank's chunks, so rotary embeddings see the true positions;
* causal attention (``scaled_dot_product_attention(..., is_causal=True)`` without a mask or
  dropout; capture has already made a mask tensor that is causal into ``is_causal``, see
  ``passes.canonicalize``) becomes ``cp_attention`` (ring or all-gather-KV over the CP group);
  so does attention whose mask is a sliding window (``node.meta["mask"]``, an ``ir.Mask``), with
  its window, each block masked by its global positions, and the nodes that only built the mask
  go; any other mask is refused with what it is (document masking, a positional bias);
* the mean cross-entropy becomes ``cp_cross_entropy``: this rank's sum over the mean's global count,
  so the CP ranks' losses (and gradients) add up to the single-sequence mean.

Which op is which is the op table's ``cp`` field (``autoshard.ir.ops.RULES``): attention,
loss, positions, and ops that mix values along a dimension (refused along the sequence). A model
the pass cannot shard raises ``Refusal(axis="cp")`` naming the line.
"""

from __future__ import annotations

import torch
from torch import fx

from autoshard import runtime
from autoshard.ir import Mask, S, ops
from autoshard.passes._graph import in_model as _in_model
from autoshard.passes._graph import note, place
from autoshard.passes._graph import op_name as _op
from autoshard.passes._graph import seq_dim as _seq_dim
from autoshard.passes.canonicalize import erase_unused
from autoshard.passes.contract import Refusal, RewriteContext


def _fail(node: fx.Node, why: str) -> Refusal:
    """What the pass cannot shard is in the model, whatever ``cp``: every degree above 1 is refused."""
    return Refusal.at(node, "context parallelism cannot handle {node}", why, "cp")


def _cp(node: fx.Node) -> str | None:
    row = ops.rule_of(node)
    return row.cp if row is not None and node.op == "call_function" else None


def context_parallel(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    """Rewrite ``gm`` in place for ``ctx.cp`` ranks with ``ctx.attention`` (ring or
    all-gather-KV); a comment per changed node goes to its ``meta["note"]``."""
    if ctx.cp == 1:
        return gm
    _shard_inputs(gm.graph, ctx)
    _global_positions(gm.graph, ctx)
    _shard_attention(gm.graph, ctx)
    _shard_loss(gm.graph, ctx)
    gm.graph.lint()
    gm.recompile()
    return gm


def _shard_inputs(graph: fx.Graph, ctx: RewriteContext) -> None:
    """The model reads its token input in this rank's layout; the loss keeps the whole sequence."""
    cp = ctx.cp
    for ph in [n for n in graph.nodes if n.op == "placeholder"]:
        model_users = [u for u in ph.users if _in_model(u)]
        if not model_users:
            continue
        dim = _seq_dim(ph)
        if dim is None:
            raise _fail(ph, "a model input without a sequence dimension")
        with graph.inserting_after(ph):
            local = graph.call_function(runtime.cp_shard, (ph, dim))
        place(local, model_users[0], ph, region="pre", tp=ph.meta.get("tp", "replicated"))
        for u in model_users:
            u.replace_input_with(ph, local)
        _local_lengths(graph, ph, local, dim)
        note(local, f"context parallel: this rank's 2 of {2 * cp} sequence chunks (load-balanced layout)")


def _global_positions(graph: fx.Graph, ctx: RewriteContext) -> None:
    """An arange over the sequence length becomes the global positions of the local chunks."""
    for node in list(graph.nodes):
        if _cp(node) == "positions" and _in_model(node):
            shape = node.meta.get("shape")
            if not (isinstance(shape, (tuple, list)) and len(shape) == 1 and shape[0] == S):
                continue
            start, step = (node.args[0], node.args[2] if len(node.args) > 2 else 1) if len(node.args) > 1 else (0, 1)
            if start != 0 or step != 1 or "start" in node.kwargs or "step" in node.kwargs:
                raise _fail(node, "arange over the sequence with a start other than 0 or a step other than 1")
            node.args = node.args[1:2] if len(node.args) > 1 else node.args
            node.target = runtime.cp_positions
            node.kwargs = {k: v for k, v in node.kwargs.items() if k == "device"}
            node.meta["op"] = ops.op_name(node)
            note(node, "context parallel: global positions of this rank's chunks")


def _shard_attention(graph: fx.Graph, ctx: RewriteContext) -> None:
    """Attention runs over the whole sequence (ring or all-gather-KV); any other op that mixes
    values along the sequence is refused."""
    for node in list(graph.nodes):
        kind = _cp(node)
        if kind == "mixes" and _in_model(node) and _along_sequence(node):
            raise _fail(node, _unfused_why(node))
        if kind != "attention":
            continue
        why = _not_shardable(node)
        if why:
            raise _fail(node, why)
        args = ops.call_args(node)
        qkv = (args["query"], args["key"], args["value"])
        mask, window = args.get("attn_mask"), _window(node)
        new = _replace_call(graph, node, runtime.cp_attention, (*qkv, ctx.attention, args["scale"], window))
        erase_unused(graph, [mask])  # once no attention reads it
        within = f", window {window}" if window else ""
        note(new, f"context parallel: {ctx.attention} attention over the {ctx.cp} ranks' chunks{within}")


def _shard_loss(graph: fx.Graph, ctx: RewriteContext) -> None:
    """The loss reads its labels in the same layout and takes the mean over the whole sequence."""
    for node in list(graph.nodes):
        if _cp(node) != "loss" or _in_model(node):
            continue
        args = ops.call_args(node)
        source = _label_source(args["target"])
        with graph.inserting_after(source):
            sharded = graph.call_function(runtime.cp_shard, (source, _seq_dim(source)))
        place(sharded, source)
        for u in list(source.users):
            if u is not sharded and not _in_model(u):
                u.replace_input_with(source, sharded)
        if args["reduction"] != "mean" or args["weight"] is not None or args["label_smoothing"]:
            raise _fail(node, "only the unweighted mean cross-entropy is split over the sequence")
        loss_args = (args["input"], args["target"], args["ignore_index"])
        loss = _replace_call(graph, node, runtime.cp_cross_entropy, loss_args)
        note(loss, "context parallel: this rank's share of the sequence-mean loss")


def _replace_call(graph: fx.Graph, node: fx.Node, target, args: tuple) -> fx.Node:
    """Call ``target`` on ``args`` in place of ``node``, which is erased; the new node keeps its
    metadata but the op's own (``op``, ``op_class``) and the note on the call it replaces."""
    with graph.inserting_after(node):
        new = graph.call_function(target, args)
    place(new, node, **{k: v for k, v in node.meta.items() if k not in ("op", "op_class", "note")})
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


def no_full_sequence_attention_left(gm: fx.GraphModule, ctx: RewriteContext) -> str | None:
    """Ensured: no attention over the whole sequence and no whole-sequence loss remain."""
    for node in gm.graph.nodes:
        if _cp(node) == "attention" or (_cp(node) == "loss" and not _in_model(node)):
            return f"{node.name} ({node.meta.get('op')}) still works on the whole sequence"
    return None


def _local_lengths(graph: fx.Graph, ph: fx.Node, local: fx.Node, dim: int) -> None:
    """The model's reads of the input's sequence length (torch.export's ``sym_size(input, 1)``,
    which sizes its views, expands and positions) read the local chunks' length instead: each
    from a sequence-long tensor its user already reads (so it stays in that user's pipeline
    chunk), else from the local input. The loss keeps the whole sequence's length."""
    rank = len(ph.meta["shape"])
    for size in list(ph.users):
        if not (size.target is torch.ops.aten.sym_size.int and size.args[1] % rank == dim):
            continue
        for user in [u for u in size.users if _in_model(u)]:
            source = next(((a, d) for a in user.all_input_nodes if (d := _seq_dim(a)) is not None), (local, dim))
            with graph.inserting_before(user):
                length = graph.call_function(size.target, source)
            place(length, user, size)
            user.replace_input_with(size, length)


def _window(attention: fx.Node) -> int | None:
    """The sliding window of attention whose mask is one (``meta["mask"]``), else None."""
    mask = attention.meta.get("mask")
    return mask.window if isinstance(mask, Mask) and mask.kind == "sliding_window" else None


# what to do about each mask kind context parallelism does not shard
_MASK_FIX = {
    "document": "train on packed sequences without document masking",
    "positional_bias": "use rotary position embeddings instead",
    "padding": "train on packed sequences without padding",
    "buffer": "build the mask in forward from positions, or call scaled_dot_product_attention(is_causal=True),",
}


def _mask_why(mask) -> str:
    """Why context parallelism does not shard attention with ``mask`` (an ``ir.Mask`` or None),
    and the fix where there is one."""
    what = mask.what if isinstance(mask, Mask) else "attention with a mask tensor"
    fix = _MASK_FIX.get(mask.kind) if isinstance(mask, Mask) else None
    tail = f" ({fix} to shard it)" if fix else ""
    return f"{what} is not sharded by context parallelism, only causal and sliding-window attention are{tail}"


def _not_shardable(attention: fx.Node) -> str | None:
    """Why ring / all-gather-KV attention cannot compute this attention call, or None."""
    args = ops.call_args(attention)
    if args.get("attn_mask") is not None and _window(attention) is None:
        return _mask_why(attention.meta.get("mask"))
    if not args["is_causal"] and _window(attention) is None:
        return "attention without causality is not sharded by context parallelism (only causal attention is)"
    if args.get("dropout_p", 0.0) not in (0, 0.0):
        return f"attention with dropout (p={args['dropout_p']}) is not sharded by context parallelism"
    return None


# ops between QK^T and the softmax that fused attention computes too (scale, mask, casts)
_FUSED_SCORE_OPS = ("mul", "div", "truediv", "add", "masked_fill", *ops.CASTS)


def _unfused_why(node: fx.Node) -> str:
    """Why a sequence-mixing op is left outside attention: for the softmax of written-out
    attention the flash-attention pass could not fuse, the bias on its scores (``meta["mask"]``:
    Bloom's ALiBi) or the ops on them that fused attention does not compute (Gemma 2's tanh
    soft-capping)."""
    if node.meta.get("op_class") != "attention":
        return f"a {_op(node)} along the sequence outside attention (run the flash-attention pass first)"
    mask = node.meta.get("mask")
    if isinstance(mask, Mask) and mask.kind == "sliding_window":
        return (
            f"written-out {mask.what}, which the flash-attention pass does not fuse (call "
            "scaled_dot_product_attention with the mask to shard it)"
        )
    if isinstance(mask, Mask):
        return _mask_why(mask)
    extra, scores = [], node.args[0] if node.args else None
    while isinstance(scores, fx.Node) and not (ops.rule_of(scores) and ops.rule_of(scores).flops == "matmul"):
        if _op(scores) not in _FUSED_SCORE_OPS and _op(scores) not in extra and not _is_view(scores):
            extra.append(_op(scores))
        scores = scores.args[0] if scores.args else None
    if not extra:
        return f"written-out attention the flash-attention pass did not fuse (its {_op(node)})"
    return (
        f"written-out attention whose scores pass through {', '.join(extra)} (as logit soft-capping does), "
        "which fused and ring attention do not compute"
    )


def _is_view(node: fx.Node) -> bool:
    row = ops.rule_of(node)
    return row is not None and row.tp == "view"


def _along_sequence(node: fx.Node) -> bool:
    """Does this op mix values along a dimension of the sequence's length?"""
    src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    shape = src.meta.get("shape") if src is not None else None
    if not isinstance(shape, (tuple, list)):
        return False
    dims = ops.dims_arg(node, len(shape))
    return any(shape[d] == S for d in (range(len(shape)) if dims is None else dims))


def _label_source(target: fx.Node) -> fx.Node:
    """The (batch, seq) label tensor a flattened loss target comes from."""
    node = target
    while _seq_dim(node) is None:
        row = ops.rule_of(node)
        reshaped = row is not None and (row.tp == "view" or row.tp == "pointwise" and len(node.all_input_nodes) == 1)
        if not reshaped or not node.args:  # a view or cast of the labels
            raise _fail(target, "labels without a sequence dimension")
        node = node.args[0]
    return node
