"""The checkpoint categories: the units of selective recomputation the analysis sorts saved
tensors into (``cost_models.analyze`` says what each holds). A plan records, per category, whether
it is saved or recomputed; the analysis owns the list, so plans, passes and the search read it
from here. No dependencies: ``autoshard.plan`` imports it."""

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
