"""The host allocator of a CPU run: keep freed memory for the next step.

On CPUs torch allocates with the C library's ``malloc``, which serves a large block (above a
threshold that starts at 128 KiB) with a fresh ``mmap`` and returns it to the system when freed:
every step's activations, gradients and optimizer temporaries are then new pages the kernel
zeroes on first touch. A GPU run has torch's caching allocator for this; here glibc's own knobs
do it: blocks up to 32 MiB (its largest mmap threshold) come from the heap, and the heap is not
trimmed, so a step reuses the pages the step before freed. Measured on the LLaMA example (small,
one rank, bf16): a step's CPU time 10% lower, the optimizer step's 15%. Elsewhere (another C
library, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit hosts
NEVER_TRIM = (1 << 31) - 1


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds as the module docstring says; whether it could."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
