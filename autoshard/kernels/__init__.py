"""Triton kernels: FlashAttention (``flash``; registered as torch ops with their backward in
``autoshard.runtime.attention``) and blockwise FP8 (``fp8``). On CPU they run under
``TRITON_INTERPRET=1``."""

from autoshard.kernels.flash import flash_attention_backward, flash_forward

__all__ = ["flash_attention_backward", "flash_forward"]
