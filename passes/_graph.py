"""Small questions every pass asks of a traced node."""

from __future__ import annotations

from torch import fx

from autoshard.ir import S, ops


def op_name(node) -> str:
    """The normalised op (``node.meta["op"]``), else the target's name; "" for a non-node."""
    if not isinstance(node, fx.Node):
        return ""
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return node.meta.get("op") or target


def describe(node: fx.Node) -> str:
    """``node`` in words, for a message to the user: what it computes, its line in the model's
    code and the module it came from ("the mul at modeling_cohere.py:41
    (model.layers.0.self_attn.q_norm)"); a module call by its path, a model input or a parameter
    by its name."""
    if node.op == "placeholder":
        return f"the model input {node.target}"
    path, source = node.meta.get("module_path"), node.meta.get("source")
    if node.op == "get_attr":  # by its name in the model (the target is the training wrapper's)
        name = ".".join(filter(None, (path, node.target.rsplit(".", 1)[-1])))
        return f"the {'parameter' if node.meta.get('is_param') else 'buffer'} {name}"
    if node.op == "call_module":  # "the Linear layers.0.mlp.up_proj"
        what, path = f"the {node.meta.get('module_type') or 'module'} {path or node.target}", ""
    else:
        what = f"the {op_name(node)}"
    if source:
        what += f" at {source}"
    if path:
        return f"{what} ({path})"
    return what if in_model(node) else f"{what} in the loss"


def seq_dim(node: fx.Node) -> int | None:
    """The dimension of the node's output that is the sequence (the symbol ``s``), if exactly one."""
    shape = node.meta.get("shape")
    if not isinstance(shape, (tuple, list)):
        return None
    hits = [i for i, d in enumerate(shape) if getattr(d, "free_symbols", None) and d == S]
    return hits[0] if len(hits) == 1 else None


def in_model(node: fx.Node) -> bool:
    """Inside the user's model (not the loss the training wrapper adds after it): fx records
    ``("model", Model)`` on the module stack, torch.export ``("model", "pkg.Model")``."""
    if node.op == "call_module":
        return True
    stack = node.meta.get("nn_module_stack") or {}
    paths = [str(v[0]) for v in stack.values() if isinstance(v, tuple)]
    return any(p == "model" or p.startswith("model.") for p in paths)


def note(node: fx.Node, text: str) -> None:
    """Record a decision on ``node`` (``meta["note"]``, after any earlier pass's): the emitted
    program shows it as a comment above the node's line."""
    before = node.meta.get("note")
    node.meta["note"] = f"{before}; {text}" if before else text


_PLACE = ("nn_module_stack", "module_path", "module_type", "layer", "region", "source", "tp")
_FROM_TENSOR = ("shape", "dtype", "requires_grad")


def place(new: fx.Node, anchor: fx.Node, like: fx.Node | None = None, **meta) -> fx.Node:
    """Complete the meta of a node a pass inserted: the anchor's place in the model (layer,
    region, module, source, TP state), the shape, dtype and ``requires_grad`` of ``like``
    (default: the anchor), its ``op`` and ``op_class`` from the op table, and ``meta`` (which
    may override any of them)."""
    like = like or anchor
    new.meta.update({k: anchor.meta[k] for k in _PLACE if k in anchor.meta})
    new.meta.update({k: like.meta[k] for k in _FROM_TENSOR if k in like.meta})
    new.meta["op"] = ops.op_name(new)
    row = ops.rule(new.meta["op"])
    new.meta["op_class"] = row.op_class if row is not None else "other"
    new.meta.update(meta)
    return new


def upstream(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it reads, transitively."""
    return _reach(node, lambda n: n.all_input_nodes)


def downstream(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node that reads it, transitively."""
    return _reach(node, lambda n: n.users)


def _reach(node: fx.Node, step) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(step(n))
    return seen
