"""Transcendental functions of the op table as compiled loops, one pass over memory.

`erf` is the C library's double-precision erf (what Python's math.erf calls, and so the op's
reference before this kernel: the bits are the same) applied per element and rounded once to
the operand's precision. Each output depends only on its own input, so the parallel blocks (workers.py) give
the same bits for any thread count. Across machines the bits are those of the C library's
erf: glibc's is one portable C implementation (fdlibm's algorithm) on every x86-64 and AArch64
Linux, with no CPU-dependent variant; numba is never given fast-math here, and without Intel's
SVML (numba.config.USING_SVML, off unless icc_rt is installed) LLVM has no vector erf to swap
in. tests/test_special.py pins the kernel against math.erf bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from mplower.numerics.workers import run_blocks

# Below this many elements one thread does the whole loop (see gemm.SERIAL_BELOW): erf costs
# about 20 ns an element, so this is ~1 ms of work.
SERIAL_BELOW = 1 << 16


@njit(cache=True, nogil=True)
def _erf_serial(x, y):
    for i in range(x.size):
        y[i] = math.erf(np.float64(x[i]))


@njit(cache=True, nogil=True)
def _erf_blocks(x, y, i0, i1):
    _erf_serial(x[i0:i1], y[i0:i1])


def erf(x: np.ndarray) -> np.ndarray:
    """math.erf of every element, computed in float64 and rounded to x's float type."""
    x = np.asarray(x)
    flat = np.ascontiguousarray(x).reshape(-1)
    y = np.empty(flat.size, x.dtype)
    if flat.size < SERIAL_BELOW:
        _erf_serial(flat, y)
    else:
        run_blocks(_erf_blocks, flat.size, flat, y)
    return y.reshape(x.shape)
