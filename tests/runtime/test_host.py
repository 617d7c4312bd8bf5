"""A CPU run keeps the memory a step frees for the next (``runtime.host``): glibc accepts both
settings. (What it saves is measured, not tested: a step's CPU time, in the module docstring;
page faults of a single block depend on glibc's dynamic threshold and are not a stable test.)"""

import platform
import sys

import pytest

from autoshard.runtime.host import keep_freed_memory


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="needs glibc on Linux: the setting is glibc's mallopt, a no-op elsewhere",
)
def test_glibc_takes_the_settings():
    assert keep_freed_memory()
