"""The checkpoint categories: the units of selective recomputation. The analysis sorts saved
tensors into them (``cost_models.analyze`` says what each holds), a plan records per category
whether it is saved or recomputed, and the runtime's policy (``runtime.checkpoint``) keeps or
recomputes a layer's tensors by the op that made them. Both sides read this module, so what the
plan counts as kept is what the program keeps.

The one place they differ is stated in ``RUNTIME_OPS``: the policy sees ATen ops, so a matmul in
the attention score path is a ``linear_output`` there, where the cost model counts it under
``attention`` (the policy can keep a little more than planned, never less).
"""

from __future__ import annotations

CHECKPOINT_CATEGORIES: tuple[str, ...] = (
    "norm_input",
    "norm_output",
    "linear_output",
    "activation",
    "attention",
    "dropout_mask",
    "experts",
)

# the ops whose outputs are ``activation`` wherever they are (inside the experts too)
ACTIVATION_FUNCTIONS = frozenset({"gelu", "silu", "relu", "sigmoid", "tanh"})

# category -> the ops (``namespace::name``) whose outputs the runtime's policy keeps for it; an op
# this torch does not have is skipped. ``autoshard::`` ops are the runtime's own: the Triton flash
# kernel, the fused norms.
RUNTIME_OPS: dict[str, tuple[str, ...]] = {
    "attention": (
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_softmax",
        "autoshard::flash_attention",
    ),
    "activation": tuple(f"aten::{name}" for name in sorted(ACTIVATION_FUNCTIONS)),
    "norm_output": ("aten::native_layer_norm", "aten::_fused_rms_norm", "autoshard::rms_norm", "autoshard::layer_norm"),
    "dropout_mask": ("aten::native_dropout",),
    "linear_output": ("aten::mm", "aten::addmm", "aten::bmm"),
    "norm_input": ("aten::add",),
    "experts": ("aten::_grouped_mm",),
}


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
