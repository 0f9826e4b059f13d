"""Freed tensor memory kept for the next run, as onnxruntime's CPU arena keeps its own.

An inference allocates its activations afresh (numpy and numba's runtime call malloc), and
glibc's malloc hands large blocks back to the kernel when they are freed: blocks above the mmap
threshold are unmapped at once, and the top of the heap is trimmed once more than
M_TRIM_THRESHOLD of it is free. Each run then touches fresh pages, and every first touch of a
4 KiB page is a page fault that zeroes it. On the 2-core VM of docs/benchmarks.md that cost
ResNet-50 at batch 1 about 15-20 ms a run (~40 %) whenever other plans in the process had moved
glibc's adaptive threshold (benchmarks/runtime.py interleaves five).

`keep_freed_memory` fixes the mmap threshold at glibc's largest (32 MiB on 64-bit: bigger
tensors are still mapped and unmapped) and trims the heap only past 1 GiB of free memory, so a
run reuses the pages the previous run freed. The process's resident memory then stays near
its peak between runs, as it does with an arena; the peak itself does not grow. It is called
by the executor's repeated-run entry points (run_lowered, run_reference), once per process,
only on glibc; MPLOWER_MALLOC=default leaves malloc as it is.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's HEAP_MAX_SIZE / 2 on 64-bit: larger values are refused
TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed blocks (see the module docstring), once per process;
    True if the settings are in effect."""
    if os.environ.get("MPLOWER_MALLOC", "") == "default" or platform.system() != "Linux" \
            or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        return libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 \
            and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):
        return False
