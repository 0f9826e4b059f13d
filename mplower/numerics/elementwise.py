"""Elementwise chains of a network as one compiled pass over memory.

`add_relu` is np.maximum(a + b, 0) of two float arrays of one shape (a residual connection and
its relu): each output is the float add, rounded once, then the relu's select (a value <= 0,
-0.0 included, becomes +0.0; NaN stays), the operations the two ops compute on their own, so
the bits are the same as running them one after the other, without the intermediate array and
its second pass. With `rounding` (a bf16/f16 plan's residual), each output is then rounded by
round_to's own kernel (rounding._round_one) as it is stored: the bits of round_to after the
two ops. Each output depends only on its own inputs, so the parallel blocks (workers.py) give
the same bits for any thread count.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from mplower.numerics.rounding import MX_ROUNDING_FORMATS, _param_array, _param_tuple, _round_one
from mplower.numerics.workers import run_blocks

# Below this many elements one thread does the whole loop (about 0.1 ms of streaming; see
# gemm.SERIAL_BELOW for why small work stays off the worker threads).
SERIAL_BELOW = 1 << 18


@njit(cache=True, nogil=True)
def _add_relu_serial(a, b, y, bits, rounding, rpa):
    zero, rp = y.dtype.type(0), _param_tuple(rpa)
    for i in range(y.size):
        v = a[i] + b[i]
        v = zero if v <= zero else v  # noqa: FURB136 - max(0, NaN) would be 0
        if rounding:  # bits: y's float32 bit patterns
            bits[i] = _round_one(np.float32(v).view(np.uint32), rp)[0]
        else:
            y[i] = v


@njit(cache=True, nogil=True)
def _add_relu_blocks(a, b, y, bits, rounding, rpa, i0, i1):
    _add_relu_serial(a[i0:i1], b[i0:i1], y[i0:i1], bits[i0:i1] if rounding else bits,
                     rounding, rpa)


def add_relu(a: np.ndarray, b: np.ndarray, rounding: str | None = None) -> np.ndarray:
    """np.maximum(a + b, 0) for float arrays of the same shape and dtype, in one pass; then
    rounded to `rounding` (a round_to format other than the MX ones; float32 operands) as
    round_to rounds."""
    if a.shape != b.shape or a.dtype != b.dtype or a.dtype.kind != "f":
        raise ValueError(f"add_relu: operands must be float arrays of one shape and dtype, "
                         f"got {a.dtype}{a.shape} and {b.dtype}{b.shape}")
    if rounding is not None and (a.dtype != np.float32 or rounding in MX_ROUNDING_FORMATS):
        raise ValueError("add_relu: rounding applies to float32 operands, in a format of "
                         "round_to other than the MX ones")
    fa, fb = np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1)
    y = np.empty(fa.size, a.dtype)
    bits = y.view(np.uint32) if rounding is not None else np.zeros(0, np.uint32)
    args = (fa, fb, y, bits, rounding is not None, _param_array(rounding or "bf16", False))
    if y.size < SERIAL_BELOW:
        _add_relu_serial(*args)
    else:
        run_blocks(_add_relu_blocks, y.size, *args)
    return y.reshape(a.shape)
