"""The attention call the flash-attention pass puts in the graph: autoshard's Triton FlashAttention
on CUDA, PyTorch's ``scaled_dot_product_attention`` elsewhere (CPU runs, where exactness matters
and the Triton interpreter would be slow). Same signature and result either way."""

from __future__ import annotations

import torch


def _triton_ready(q: torch.Tensor) -> bool:
    if not q.is_cuda or q.size(-1) not in (16, 32, 64, 128):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fused_attention(q, k, v, causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Attention over (batch, heads, seq, dim) tensors, K/V heads may be fewer (grouped queries)."""
    if _triton_ready(q):
        from autoshard.kernels.flash import flash_attention

        return flash_attention(q, k, v, causal=causal, scale=scale)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, enable_gqa=k.size(1) != q.size(1)
    )
