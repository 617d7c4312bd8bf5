"""Triton kernels. ``flash_attention`` needs Triton; on CPU it runs under ``TRITON_INTERPRET=1``."""

from autoshard.kernels.flash import flash_attention, flash_attention_with_lse

__all__ = ["flash_attention", "flash_attention_with_lse"]
