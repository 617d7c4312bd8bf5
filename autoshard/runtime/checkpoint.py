"""Selective activation checkpointing for one layer: ``torch.utils.checkpoint`` with
``create_selective_checkpoint_contexts``, saving the outputs of the op kinds the plan keeps and
recomputing the rest in backward.

The plan chooses per saved-tensor kind; at run time the policy sees ATen ops, so each kind maps
to the ops that produce it (a matmul in the attention score path counts as ``linear_output`` here,
which the cost model counts under ``attention``: the policy can keep a little more than planned,
never less). With every kind recomputed this is full recomputation of the layer from its input.

FP8 matmuls (``runtime.fp8``) are two ops to the policy: the input's quantisation and the forward
GEMM. The GEMM's output is a ``linear_output`` (``experts`` for the experts' products) like any
matmul's. A kept kind in ``fp8_saved`` is kept as its FP8 copy instead: its ops are recomputed
and the quantisations the stage file marks ``keep_fp8=True`` (of that kind's tensors, which only
FP8 matmuls read) are kept, 1 byte and a 4-byte scale per 128 elements instead of 2 or 4 bytes.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autoshard.runtime import attention, fp8, norms  # noqa: F401 (attention and norms register their torch ops)

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
    )
    | {torch.ops.autoshard.flash_attention},  # the Triton kernel (runtime.attention)
    "activation": _ops("gelu", "silu", "relu", "sigmoid", "tanh"),
    "norm_output": _ops("native_layer_norm", "_fused_rms_norm")
    | {torch.ops.autoshard.rms_norm, torch.ops.autoshard.layer_norm},  # the fused norms (runtime.norms)
    "dropout_mask": _ops("native_dropout"),
    "linear_output": _ops("mm", "addmm", "bmm"),
    "norm_input": _ops("add"),
    "experts": _ops("_grouped_mm"),
}


_QUANTIZE = torch.ops.autoshard.fp8_quantize_rows
_FP8_MM = torch.ops.autoshard.fp8_mm


def _policy(kept: frozenset, saved: frozenset, ctx, func, *args, **kwargs):
    packet = getattr(func, "overloadpacket", func)
    if packet is _QUANTIZE:
        keep = args[1]
    elif packet is _FP8_MM:
        keep = ("experts" if args[7] else "linear_output") in kept
    else:
        keep = packet in saved
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


class Checkpoint(nn.Module):
    """Run ``fn`` (a layer) under activation checkpointing, keeping the kinds not in ``recompute``
    (those in ``fp8_saved`` as their FP8 copies)."""

    def __init__(self, fn, recompute: list[str], fp8_saved: list[str] = ()):
        super().__init__()
        object.__setattr__(self, "fn", fn)  # not a child module: its parameters belong to the stage
        self.recompute = sorted(recompute)
        self.fp8_saved = sorted(k for k in fp8_saved if k not in self.recompute)
        kept = frozenset(k for k in KINDS if k not in self.recompute and k not in self.fp8_saved)
        saved = frozenset().union(*(KINDS[k] for k in kept))
        self._keeps = bool(saved) or bool(self.fp8_saved)
        self._context = functools.partial(create_selective_checkpoint_contexts, functools.partial(_policy, kept, saved))

    def _run(self, *args):
        fp8.forget_inputs()  # the forward and its recomputation quantise the same inputs first
        return self.fn(*args)

    def forward(self, *args):
        if not self._keeps:  # full recomputation: plain checkpointing (no selective cache)
            return checkpoint(self._run, *args, use_reentrant=False)
        return checkpoint(self._run, *args, use_reentrant=False, context_fn=self._context)

    def extra_repr(self) -> str:
        return f"recompute={self.recompute}" + (f", fp8_saved={self.fp8_saved}" if self.fp8_saved else "")
