"""Context parallelism: each rank of the CP group holds two chunks of every sequence (chunk ``i`` and
``2*cp-1-i``, so causal work is balanced) and attention runs over the whole sequence with ring
attention or all-gathered K/V, as the plan says.

Rewrites, before the tensor-parallel pass:

* the model's token input is cut to this rank's chunks (``cp_shard``) where the model reads it;
  the loss still receives the whole sequence and cuts its labels the same way, after shifting, so
  the next-token targets at chunk edges are right;
* ``arange`` over the sequence length (rotary angles, position ids) becomes ``cp_positions``: the
  global positions of this rank's chunks, so rotary embeddings see the true positions;
* causal attention (``scaled_dot_product_attention(..., is_causal=True)`` without a mask) becomes
  ``cp_attention`` (ring or all-gather-KV over the CP group);
* the mean cross-entropy becomes ``cp_cross_entropy``: this rank's sum over the mean's global count,
  so the CP ranks' losses (and gradients) add up to the single-sequence mean.
"""

from __future__ import annotations

from torch import fx

from autoshard import runtime
from autoshard.errors import AutoshardError
from autoshard.ir import S
from autoshard.passes._graph import in_model as _in_model
from autoshard.passes._graph import op_name as _op
from autoshard.passes._graph import seq_dim as _seq_dim


def _fail(node: fx.Node, why: str) -> AutoshardError:
    where = node.meta.get("source")
    return AutoshardError(
        f"context parallelism cannot handle {node.format_node()}{f' ({where})' if where else ''}: {why}; "
        "plan with --force cp=1"
    )


def context_parallel(gm: fx.GraphModule, cp: int, variant: str, notes: dict | None = None) -> None:
    notes = notes if notes is not None else {}
    if cp == 1:
        return
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    # 1. the model reads its token input in this rank's layout; the loss keeps the whole sequence
    for ph in placeholders:
        model_users = [u for u in ph.users if _in_model(u)]
        if not model_users:
            continue
        dim = _seq_dim(ph)
        if dim is None:
            raise _fail(ph, "a model input without a sequence dimension")
        with graph.inserting_after(ph):
            local = graph.call_function(runtime.cp_shard, (ph, dim))
        local.meta = {**ph.meta, "nn_module_stack": model_users[0].meta.get("nn_module_stack"), "region": "pre"}
        for u in model_users:
            u.replace_input_with(ph, local)
        notes[local.name] = f"context parallel: this rank's 2 of {2 * cp} sequence chunks (load-balanced layout)"
    # 2. positions: arange over the sequence length -> the global positions of the local chunks
    for node in list(graph.nodes):
        if node.op == "call_function" and _op(node) == "arange" and _in_model(node):
            shape = node.meta.get("shape")
            if not (isinstance(shape, (tuple, list)) and len(shape) == 1 and shape[0] == S):
                continue
            if len(node.args) != 1:
                raise _fail(node, "arange over the sequence with a start or step")
            node.target = runtime.cp_positions
            node.kwargs = {k: v for k, v in node.kwargs.items() if k == "device"}
            notes[node.name] = "context parallel: global positions of this rank's chunks"
    # 3. attention over the whole sequence
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        name = _op(node)
        if name == "scaled_dot_product_attention":
            mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
            causal = bool(node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False))
            if mask is not None or not causal:
                raise _fail(node, "attention with an explicit mask (only causal attention is sharded)")
            q, k, v = node.args[:3]
            scale = node.kwargs.get("scale")
        elif node.target is runtime.fused_attention:
            q, k, v, causal, scale = node.args
            if not causal:
                raise _fail(node, "non-causal attention across the sequence")
        elif name in ("softmax",) and _in_model(node) and _seq_dim(node) is not None:
            raise _fail(node, "a softmax over the sequence outside attention (run the flash-attention pass first)")
        else:
            continue
        with graph.inserting_after(node):
            new = graph.call_function(runtime.cp_attention, (q, k, v, variant, scale))
        new.meta = {**node.meta, "op": "cp_attention"}
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        notes[new.name] = f"context parallel: {variant} attention over the {cp} ranks' chunks"
    # 4. the loss: labels in the same layout, the mean taken over the whole sequence
    for node in list(graph.nodes):
        if _op(node) not in ("cross_entropy", "cross_entropy_loss") or _in_model(node):
            continue
        logits, target = node.args[0], node.args[1]
        source = _label_source(target)
        with graph.inserting_after(source):
            sharded = graph.call_function(runtime.cp_shard, (source, _seq_dim(source)))
        sharded.meta = dict(source.meta)
        for u in list(source.users):
            if u is not sharded and not _in_model(u):
                u.replace_input_with(source, sharded)
        ignore = node.kwargs.get("ignore_index", -100)
        if node.kwargs.get("reduction", "mean") != "mean" or node.kwargs.get("weight") is not None:
            raise _fail(node, "only the mean cross-entropy is split over the sequence")
        with graph.inserting_after(node):
            loss = graph.call_function(runtime.cp_cross_entropy, (logits, node.args[1], ignore))
        loss.meta = dict(node.meta)
        node.replace_all_uses_with(loss)
        graph.erase_node(node)
        notes[loss.name] = "context parallel: this rank's share of the sequence-mean loss"
    graph.lint()
    gm.recompile()


def _label_source(target: fx.Node) -> fx.Node:
    """The (batch, seq) label tensor a flattened loss target comes from."""
    node = target
    while _seq_dim(node) is None:
        if _op(node) not in ("reshape", "view", "flatten", "contiguous") or not node.args:
            raise _fail(target, "labels without a sequence dimension")
        node = node.args[0]
    return node
