"""The checkpoint categories: the units of selective recomputation the analysis sorts saved
tensors into (``cost_models.analyze`` says what each holds). A plan records, per category, whether
it is saved or recomputed; the analysis owns the list, so plans, passes and the search read it
from here. ``autoshard.plan`` imports it, and the passes find an fx node's category here."""

from __future__ import annotations

# the runtime keeps or recomputes a layer's tensors by the op that made them; the activation
# functions' list is its own (the emitted program depends on the runtime only), read here so that
# what the plan counts as kept is what the program keeps
from autoshard.runtime.checkpoint import ACTIVATION_FUNCTIONS

CHECKPOINT_CATEGORIES: tuple[str, ...] = (
    "norm_input",
    "norm_output",
    "linear_output",
    "activation",
    "attention",
    "dropout_mask",
    "experts",
)


def saved_category(root, saver, external: bool) -> str:
    """Checkpoint category of a kept tensor, by the op that produced it (and, for pointwise
    results, by who keeps it): ``root`` the fx node that made its storage, ``saver`` the one
    keeping it, ``external`` whether ``root`` is outside the layer (its input)."""
    if external:
        return "layer_input"
    producer = root.meta.get("op_class")
    if producer in ("norm", "matmul", "router", "attention", "experts"):
        return {"norm": "norm_output", "matmul": "linear_output", "router": "linear_output"}.get(producer, producer)
    if root.meta.get("op") in ACTIVATION_FUNCTIONS:  # inside the experts too: the runtime keeps by op
        return "activation"
    if saver.meta.get("op_class") == "experts" or any(
        a.meta.get("op_class") == "experts" for a in root.all_input_nodes
    ):
        return "experts"
    if saver.meta.get("op_class") == "norm":
        return "norm_input"
    return "activation"
