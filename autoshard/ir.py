"""The one IR: a ``torch.fx.GraphModule`` whose ``node.meta`` carries autoshard's annotations.

Keys written by capture (``autoshard.capture``):

``shape``          output shape, a tuple of ints and sympy expressions in the symbols ``b`` (batch)
                   and ``s`` (sequence) of ``autoshard.ir.B`` / ``autoshard.ir.S``; ``None`` when the
                   node does not produce one tensor (a tuple, a size, ``None``).
``dtype``          output ``torch.dtype`` (``None`` when not a tensor).
``storage``        int identifying the output's storage: views share their base's id, so saved
                   tensors can be counted once.
``requires_grad``  whether the output depends on trainable parameters (so backward reaches it).
``module_path``    dotted path of the innermost module the node came from ("" at the top level),
                   relative to the user's model (e.g. ``layers.3.attn.wq``).
``module_type``    class name of that module (e.g. ``Linear``).
``layer``          index in the repeated layer stack, or ``None`` outside it.
``region``         ``"pre"`` (before the stack: embeddings), ``"layer"``, or ``"post"`` (after it:
                   final norm, output head, loss).
``op``             normalised op name used by every table (``linear``, ``mm``, ``softmax``, ...).
``op_class``       one of ``OP_CLASSES``.
``source``         ``"file:line"`` in the user's code, where the tracer recorded it.

Keys written by analysis (``autoshard.cost_models``):

``tp``             tensor-parallel state of the output: ``"replicated"``, ``"sharded"``,
                   ``"partial"``; ``tp_role`` on weighted matmuls and embeddings: ``"column"``,
                   ``"row"``, ``"vocab"``, or ``"replicated"``.
``cost``           ``cost_models.ops.NodeCost``: forward FLOPs, bytes moved, bytes saved.

Later passes add ``sharding`` and ``stage``.
"""

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
