"""The attention call the flash-attention pass puts in the graph: autoshard's Triton FlashAttention
on CUDA, PyTorch's ``scaled_dot_product_attention`` elsewhere (CPU runs, where exactness matters
and the Triton interpreter would be slow). Same signature and result either way.

The Triton kernels (``autoshard.kernels.flash``) are registered here as two torch ops,
``autoshard::flash_attention`` (output and log-sum-exp) and ``autoshard::flash_attention_backward``,
with the first's backward calling the second. As ops they are what the checkpoint policy sees
(``runtime.checkpoint``: the ``attention`` kind), what FLOP counters can be taught, and, through
their fake implementations, what a rank running on fake tensors runs (``runtime.fake``): the GPU
program's kernels, which keep only the output and the log-sum-exp for backward.
"""

from __future__ import annotations

import math

import torch

from autoshard.ir import KERNEL_HEAD_DIMS
from autoshard.runtime import fake


@torch.library.custom_op("autoshard::flash_attention", mutates_args=())
def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> tuple[
    torch.Tensor, torch.Tensor
]:  # fmt: skip
    from autoshard.kernels.flash import flash_forward  # lazy: Triton loads only where a GPU runs the kernel

    return flash_forward(q, k, v, causal, scale)


@_flash.register_fake
def _(q, k, v, causal, scale):
    b, h, sq, _ = q.shape
    return q.new_empty((b, h, sq, v.size(-1))), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("autoshard::flash_attention_backward", mutates_args=())
def _flash_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from autoshard.kernels.flash import flash_attention_backward  # lazy: Triton loads only on a GPU

    return flash_attention_backward(q, k, v, out, lse, do, causal, scale)


@_flash_backward.register_fake
def _(q, k, v, out, lse, do, causal, scale):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _save(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, do, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.autoshard.flash_attention_backward(q, k, v, out, lse, do, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


_flash.register_autograd(_backward, setup_context=_save)


def flash_attention_with_lse(q, k, v, causal: bool = True, scale: float | None = None):
    """The Triton kernel: (output, log-sum-exp in natural-log units, shaped (batch, heads, seq_q))
    over (batch, heads, seq, dim) tensors, K/V heads may be fewer; differentiable in q, k, v."""
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else float(scale)
    return torch.ops.autoshard.flash_attention(q, k, v, causal, scale)


def flash_attention(q, k, v, causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Like ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)``."""
    return flash_attention_with_lse(q, k, v, causal, scale)[0]


def kernel_runs(q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> bool:
    """Whether attention over these tensors runs the Triton kernel: on CUDA, with query/key and
    value head sizes it is built for (each in ``KERNEL_HEAD_DIMS``; they may differ) and values
    shaped like the keys otherwise. Other head sizes (MLA's 192 for queries and keys; the tiny
    DeepSeek-V3's 24) are not powers of two, which a Triton tile's extent must be: there
    ``fused_attention`` runs torch's fused attention and context parallelism its PyTorch math
    (the ring one block's scores at a time, dropped after the block). On fake tensors, which
    stand for the GPU program, always: where the head dimensions are not the kernel's the GPU
    program runs torch's fused attention, which keeps what the kernel keeps (the output and the
    log-sum-exp); a CPU's would be the unfused math, holding the scores (8.6 GB per layer and
    micro-batch at DeepSeek-V3's 128 heads and 4K tokens)."""
    if fake.is_fake(q):
        return True
    if q.size(-1) not in KERNEL_HEAD_DIMS:
        return False
    if v is not None and (v.size(-1) not in KERNEL_HEAD_DIMS or (k is not None and k.shape[:-1] != v.shape[:-1])):
        return False
    if not q.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` in autocast's dtype where autocast is on, as it casts the inputs of
    ``scaled_dot_product_attention`` (it has no rule for the kernel's op)."""
    kind = tensors[0].device.type
    if not torch.is_autocast_enabled(kind):
        return tensors
    dtype = torch.get_autocast_dtype(kind)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def fused_attention(q, k, v, causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Attention over (batch, heads, seq, dim) tensors, K/V heads may be fewer (grouped queries)."""
    if kernel_runs(q, k, v):
        q, k, v = autocast_inputs(q, k, v)
        return flash_attention(q, k, v, causal=causal, scale=scale)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, enable_gqa=k.size(1) != q.size(1)
    )
