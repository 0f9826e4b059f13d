"""Elementwise chains of a network as one compiled pass over memory.

`add_relu` is np.maximum(a + b, 0) of two float arrays of one shape (a residual connection and
its relu): each output is the float add, rounded once, then the relu's select (a value <= 0,
-0.0 included, becomes +0.0; NaN stays), the operations the two ops compute on their own, so
the bits are the same as running them one after the other, without the intermediate array and
its second pass. Each output depends only on its own inputs, so the parallel blocks
(workers.py) give the same bits for any thread count.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from mplower.numerics.workers import run_blocks

# Below this many elements one thread does the whole loop (about 0.1 ms of streaming; see
# gemm.SERIAL_BELOW for why small work stays off the worker threads).
SERIAL_BELOW = 1 << 18


@njit(cache=True, nogil=True)
def _add_relu_serial(a, b, y):
    zero = y.dtype.type(0)
    for i in range(y.size):
        v = a[i] + b[i]
        y[i] = zero if v <= zero else v  # noqa: FURB136 - max(0, NaN) would be 0


@njit(cache=True, nogil=True)
def _add_relu_blocks(a, b, y, i0, i1):
    _add_relu_serial(a[i0:i1], b[i0:i1], y[i0:i1])


def add_relu(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """np.maximum(a + b, 0) for float arrays of the same shape and dtype, in one pass."""
    if a.shape != b.shape or a.dtype != b.dtype or a.dtype.kind != "f":
        raise ValueError(f"add_relu: operands must be float arrays of one shape and dtype, "
                         f"got {a.dtype}{a.shape} and {b.dtype}{b.shape}")
    fa, fb = np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1)
    y = np.empty(fa.size, a.dtype)
    if y.size < SERIAL_BELOW:
        _add_relu_serial(fa, fb, y)
    else:
        run_blocks(_add_relu_blocks, y.size, fa, fb, y)
    return y.reshape(a.shape)
