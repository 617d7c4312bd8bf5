"""Selective activation checkpointing for one layer: ``torch.utils.checkpoint`` with
``create_selective_checkpoint_contexts``, saving the outputs of the op kinds the plan keeps and
recomputing the rest in backward.

The plan chooses per saved-tensor kind; at run time the policy sees ATen ops, so each kind maps
to the ops that produce it (a matmul in the attention score path counts as ``linear_output`` here,
which the cost model counts under ``attention``: the policy can keep a little more than planned,
never less). With every kind recomputed this is full recomputation of the layer from its input.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten


def _ops(*names: str) -> set:
    return {getattr(aten, n) for n in names if hasattr(aten, n)}


KINDS = {
    "attention": _ops(
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_softmax",
    ),
    "activation": _ops("gelu", "silu", "relu", "sigmoid", "tanh"),
    "norm_output": _ops("native_layer_norm", "_fused_rms_norm"),
    "dropout_mask": _ops("native_dropout"),
    "linear_output": _ops("mm", "addmm", "bmm"),
    "norm_input": _ops("add"),
    "experts": _ops("_grouped_mm"),
}


def _policy(saved: frozenset, ctx, func, *args, **kwargs):
    packet = getattr(func, "overloadpacket", func)
    return CheckpointPolicy.MUST_SAVE if packet in saved else CheckpointPolicy.PREFER_RECOMPUTE


class Checkpoint(nn.Module):
    """Run ``fn`` (a layer) under activation checkpointing, keeping the kinds not in ``recompute``."""

    def __init__(self, fn, recompute: list[str]):
        super().__init__()
        object.__setattr__(self, "fn", fn)  # not a child module: its parameters belong to the stage
        self.recompute = sorted(recompute)
        keep = frozenset().union(*(KINDS.get(k, set()) for k in KINDS if k not in self.recompute))
        self._keeps = bool(keep)
        self._context = functools.partial(create_selective_checkpoint_contexts, functools.partial(_policy, keep))

    def forward(self, *args):
        if not self._keeps:  # full recomputation: plain checkpointing (no selective cache)
            return checkpoint(self.fn, *args, use_reentrant=False)
        return checkpoint(self.fn, *args, use_reentrant=False, context_fn=self._context)

    def extra_repr(self) -> str:
        return f"recompute={self.recompute}"
