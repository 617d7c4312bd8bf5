"""Sequence parallelism (Korthikanti et al. 2022): between tensor-parallel regions, the residual
stream, its norms, dropouts and residual adds run on this rank's slice of the sequence.

Runs after ``tensor_parallel``. The hidden state entering the first layer is split along the
sequence (``scatter_to_sp``); each ``reduce_from_tp`` (all-reduce) at the end of a TP region
becomes ``reduce_scatter_to_sp``; each ``copy_to_tp`` at the start of one becomes
``gather_from_sp`` (all-gather). Everything between must be per-token (norms, pointwise ops); a
``size`` of the sequence dimension read there is multiplied back to the full length, so the model's
code keeps seeing the length it was written for. The parameters used in that stretch (norm
weights, biases added after a row matmul) see only this rank's tokens, so their gradients are
partial sums: ``partial_grads`` lists them for the runtime to all-reduce over the TP group.
"""

from __future__ import annotations

import operator

from torch import fx, nn

from autoshard import runtime
from autoshard.errors import AutoshardError
from autoshard.passes._graph import op_name as _op
from autoshard.passes._graph import seq_dim as _seq_dim

_POINTWISE = {
    "add", "sub", "mul", "div", "truediv", "neg", "dropout", "to", "float", "half", "bfloat16", "type_as",
    "contiguous", "clone", "iadd", "imul", "pow", "rsqrt", "sqrt", "_to_copy", "alias",
}  # fmt: skip
_REDUCTIONS = {"mean", "sum", "amax", "var"}  # per token when they reduce other dimensions
_NORMS = (nn.LayerNorm, nn.RMSNorm)


def _fail(node: fx.Node, why: str) -> AutoshardError:
    where = node.meta.get("source")
    return AutoshardError(
        f"sequence parallelism cannot run {node.format_node()}{f' ({where})' if where else ''} on a slice of the "
        f"sequence: {why}; plan with --force tp=1"
    )


def sequence_parallel(gm: fx.GraphModule, tp: int, notes: dict[str, str] | None = None) -> list[str]:
    """Rewrite ``gm`` in place; returns the parameters whose gradients are partial over TP.
    ``notes`` (node name -> comment for the emitted code) is updated for the nodes it changes."""
    notes = notes if notes is not None else {}
    if tp == 1:
        return []
    graph = gm.graph
    frontier: list[fx.Node] = []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is runtime.reduce_from_tp and node.meta.get("region") != "pre":
            dim = _seq_dim(node)
            if dim is None:
                raise _fail(node, "no sequence dimension")
            node.target, node.args = runtime.reduce_scatter_to_sp, (node.args[0], dim)
            notes[node.name] = f"sequence parallel: reduce-scatter the partial sums onto {tp} sequence slices"
            node.meta["sp_sliced_dim"], node.meta["sp_tp"] = dim, tp
            frontier.append(node)
    # the hidden state entering the layer stack: what a layer's first norm and residual add read
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
    for a in entries:
        with graph.inserting_after(a):
            scatter = graph.call_function(runtime.scatter_to_sp, (a, _seq_dim(a)))
        scatter.meta = {**a.meta, "region": "layer", "tp": "replicated"}
        notes[scatter.name] = f"sequence parallel: keep this rank's 1/{tp} of the sequence from here on"
        scatter.meta["sp_sliced_dim"], scatter.meta["sp_tp"] = _seq_dim(a), tp
        for user in list(a.users):
            if user is not scatter and user.meta.get("region") in ("layer", "post") and _residual_reader(user):
                user.replace_input_with(a, scatter)
        frontier.append(scatter)
    # follow the sliced stream, in program order, to the next TP region
    sliced: set[fx.Node] = set(frontier)
    partial: set[str] = set()
    for user in list(graph.nodes):
        if user in sliced:
            continue
        inputs = [a for a in user.all_input_nodes if a in sliced]
        if not inputs:
            continue
        node = inputs[0]
        if user.op == "call_function" and user.target is runtime.copy_to_tp:
            user.target, user.args = runtime.gather_from_sp, (user.args[0], _seq_dim(node))
            notes[user.name] = "sequence parallel: all-gather the sequence before the column matmuls"
            continue
        if user.op == "output":
            continue
        if user.op == "call_method" and user.target == "size":
            _size_to_full(graph, user, node, tp)
            continue
        if _op(user) in ("getattr", "dim", "new_ones", "new_zeros", "new_full", "new_empty", "_assert_tensor_metadata"):
            continue  # reads only the dtype, device or rank
        if user.op == "call_module" and isinstance(gm.get_submodule(user.target), _NORMS):
            partial.update(f"{user.target}.{p}" for p, _ in gm.get_submodule(user.target).named_parameters())
        elif _op(user) in _REDUCTIONS and _seq_dim(user) == _seq_dim(node):
            pass  # a reduction over features (RMSNorm written out): still one value per token
        elif _op(user) == "slice" and user.meta.get("shape") == node.meta.get("shape"):
            pass  # a slice that keeps everything
        elif _op(user) in _POINTWISE:
            for other in user.all_input_nodes:
                if other in sliced:
                    continue
                if other.op == "get_attr":
                    partial.add(other.target)
                    continue
                _check_broadcast(user, other, node)
        else:
            raise _fail(user, f"{_op(user)!r} is not per-token")
        sliced.add(user)
        user.meta["sp_sliced_dim"], user.meta["sp_tp"] = _seq_dim(user), tp
    graph.lint()
    gm.recompile()
    return sorted(partial)


def _residual_reader(node: fx.Node) -> bool:
    """A node of the residual stream: a norm module, or a pointwise op (the residual add)."""
    if node.op == "call_module":
        return node.meta.get("op_class") == "norm"
    return _op(node) in _POINTWISE


def _check_broadcast(user: fx.Node, other: fx.Node, sliced: fx.Node) -> None:
    dim = _seq_dim(sliced)
    shape, full = other.meta.get("shape"), sliced.meta.get("shape")
    if dim is None or not isinstance(shape, (tuple, list)):
        return
    k = dim - (len(full) - len(shape))
    if 0 <= k < len(shape) and shape[k] != 1:
        raise _fail(user, f"operand {other.name} spans the whole sequence")


def _size_to_full(graph: fx.Graph, size: fx.Node, source: fx.Node, tp: int) -> None:
    dim = size.args[1] if len(size.args) > 1 else size.kwargs.get("dim")
    seq = _seq_dim(source)
    rank = len(source.meta["shape"])
    if dim is None or (dim + rank if dim < 0 else dim) != seq:
        return
    with graph.inserting_after(size):
        full = graph.call_function(operator.mul, (size, tp))
    full.meta = {**size.meta}
    size.replace_all_uses_with(full, delete_user_cb=lambda u: u is not full)
