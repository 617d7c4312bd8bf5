"""The one IR: a ``torch.fx.GraphModule`` whose ``node.meta`` carries autoshard's annotations.

``KEYS`` below is the authoritative list of the keys autoshard writes, who writes each and what
it holds; ``TORCH_KEYS`` the keys torch.fx and torch.export write themselves, which autoshard
reads or carries along. Every pass declares the keys it requires and writes
(``autoshard.passes.contract.Pass``), and the pass pipeline checks after each pass that the graph
carries no key outside these two lists (``tests/test_ir.py`` checks the codebase the same way).

Shapes are tuples of ints and sympy expressions in the symbols ``b`` (batch) and ``s``
(sequence), ``autoshard.ir.B`` and ``autoshard.ir.S``.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

B = sympy.Symbol("b", positive=True, integer=True)
S = sympy.Symbol("s", positive=True, integer=True)

OP_CLASSES = (
    "matmul",
    "attention",
    "norm",
    "elementwise",
    "embedding",
    "router",
    "experts",
    "loss",
    "other",
)

# What a weighted matmul computes, the unit of the FP8 choice (``cost_models.analyze`` labels each
# one): attention's projections, a dense MLP's, routed experts', the router's, the output head's.
MATMUL_KINDS = ("attention", "mlp", "experts", "router", "head")
FP8_KINDS = ("attention", "experts", "head", "mlp")  # the kinds an FP8 plan may run in FP8
FP8_DEFAULT = ("attention", "experts", "mlp")  # DeepSeek-V3's: head, router, norms and attention's core stay high


# the head sizes the Triton attention kernels are built for (a tile is a power of two): query/key
# and value heads may differ, each one of these; other sizes run torch's attention
KERNEL_HEAD_DIMS = (16, 32, 64, 128)


# what an attention mask tensor that is not plainly causal is (``Mask.kind``)
MASK_KINDS = (
    "sliding_window",  # causal, each query sees the last ``window`` positions (its own included)
    "document",  # from the inputs' values: positions attend only within their document
    "padding",  # from the inputs' values otherwise (padding, or a document mask not recognised)
    "positional_bias",  # an additive bias computed from positions (ALiBi: slope_h * distance)
    "buffer",  # read from a buffer that has no values while captured (on meta): not known causal
    "not_causal",  # lets positions attend to later ones
    "other",  # from a parameter or a module, not evaluable from the sizes, or of another pattern
)


@dataclass(frozen=True)
class Mask:
    """``node.meta["mask"]`` on attention whose mask tensor stays: what the mask is."""

    kind: str  # one of MASK_KINDS
    what: str  # a phrase for refusals ("sliding-window attention (window 4096)")
    window: int | None = None  # positions each query sees, for a sliding window


@dataclass(frozen=True)
class Key:
    name: str
    writer: str  # the module that writes it
    what: str


KEYS: dict[str, Key] = {
    k.name: k
    for k in (
        # capture (autoshard.capture)
        Key("shape", "capture", "output shape (ints and sympy expressions in b, s); None unless one tensor"),
        Key("shapes", "capture", "output shapes of a node that returns several tensors (a tuple of shapes)"),
        Key("dtype", "capture", "output torch.dtype; None when not a tensor"),
        Key("storage", "capture", "id of the output's storage: views share their base's, so saved tensors count once"),
        Key("requires_grad", "capture", "whether the output depends on trainable parameters"),
        Key("is_param", "capture", "on get_attr nodes: the attribute is a trainable parameter (not a buffer)"),
        Key("module_path", "capture", "dotted path of the innermost user module the node came from ('' at top)"),
        Key("module_type", "capture", "class name of that module (for messages only: no decision reads it)"),
        Key("layer", "capture", "index in the repeated layer stack, or None outside it"),
        Key("region", "capture", "'pre' (before the stack), 'layer', or 'post' (after it: head, loss)"),
        Key("source", "capture", "'file:line' of the model's code that wrote it: the user's file or a modeling_*.py"),
        Key("op", "capture", "normalised op name, the key of the op table (autoshard.ir.ops)"),
        Key("op_class", "capture", "one of OP_CLASSES, from the op table refined by graph patterns"),
        Key(
            "causal", "capture", "on masked_fill(scores, m, -inf) in written-out attention: m hides the later positions"
        ),
        Key(
            "mask",
            "capture",
            "on attention (or written-out attention's softmax) masked other than causally: an ir.Mask",
        ),
        Key("autoshard_logits", "capture", "on the model's output under the default loss: checked to be 3-D logits"),
        # analysis (autoshard.cost_models)
        Key("tp", "analysis", "tensor-parallel state of the output: 'replicated', 'sharded' or 'partial'"),
        Key("tp_role", "analysis", "on weighted matmuls and embeddings: 'column', 'row', 'vocab' or 'replicated'"),
        Key("matmul_kind", "analysis", "on weighted matmuls: one of MATMUL_KINDS (what the FP8 choice is made per)"),
        Key("cost", "analysis", "ir.ops.NodeCost: forward FLOPs and bytes moved, symbolic in b, s"),
        # passes
        Key("fp8_left", "fp8", "on a matmul of an FP8 kind left in the compute precision: why (its note says so)"),
        Key("note", "passes", "the decisions behind the node, '; '-joined: the comment above its line in the program"),
        Key("sp_sliced_dim", "sequence_parallel", "the dimension a sequence-parallel node's output is sliced along"),
        Key("sp_tp", "sequence_parallel", "how many slices that dimension is cut into (the TP degree)"),
    )
}

# keys of a graph module's own ``meta`` (``GraphModule.meta``), not its nodes'
GRAPH_KEYS: dict[str, Key] = {
    k.name: k
    for k in (
        Key("decisions", "passes", "passes.contract.Decisions: parameter shards, renames, gradient groups, the split"),
    )
}

TORCH_KEYS = frozenset(
    {
        "nn_module_stack",  # module path -> (qualified name, class) of every enclosing module
        "stack_trace",
        "source_fn_stack",
        "torch_fn",
        "val",  # torch.export: the fake tensor of the output
        "tensor_meta",
        "example_value",
        "seq_nr",
        "original_aten",
        "from_node",
        "unbacked_bindings",
        "custom",
        "partitioner_tag",
        "recompute",
        "ac_graph_id",
        "autograd_backward",
        "is_wrapped",
        "grapharg",
        "val_nested",
        "eager_input_vals",
        "_numeric_debug_handle",
        "node_idx",
    }
)


def unknown_keys(meta: dict) -> set[str]:
    """The keys of ``meta`` neither autoshard's table nor torch documents."""
    return {k for k in meta if k not in KEYS and k not in TORCH_KEYS}
