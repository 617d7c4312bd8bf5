"""Small questions every pass asks of a traced node."""

from __future__ import annotations

from torch import fx

from autoshard.ir import S


def op_name(node) -> str:
    """The normalised op (``node.meta["op"]``), else the target's name; "" for a non-node."""
    if not isinstance(node, fx.Node):
        return ""
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return node.meta.get("op") or target


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
