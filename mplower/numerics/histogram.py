"""One pass over a float tensor, in its own dtype, for calibration's histograms.

`magnitude_counts` is what mplower.calibration.TensorStats.add used to compute with a float64
copy of the tensor, np.ldexp, np.floor, three np.bincount and np.frexp (six passes and 8 bytes
an element): per value v, with |v| exactly a float64, the bin floor(|v| * 2**shift) in `pos`
(v >= 0) or `neg` (v < 0), and the frexp exponent of every non-zero |v| in `exponents`.
Multiplying by a power of two is exact (no overflow or underflow in these ranges), as ldexp
is, so the counts are the same integers; counts commute, so merging stays exact.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _counts(x, scale, pos, neg, exponents, exp_lo):
    for i in range(x.size):
        v = np.float64(x[i])
        m = abs(v)
        b = np.int64(math.floor(m * scale))
        if v < 0:
            neg[b] += 1
        else:
            pos[b] += 1
        if m > 0:
            exponents[math.frexp(m)[1] - exp_lo] += 1


def magnitude_counts(x: np.ndarray, shift: int, pos: np.ndarray, neg: np.ndarray,
                     exponents: np.ndarray, exp_lo: int) -> None:
    """Add x's values (finite, max |x| * 2**shift below pos.size) into the int64 counts."""
    flat = np.ascontiguousarray(x).reshape(-1)
    _counts(flat, math.ldexp(1.0, shift), pos, neg, exponents, exp_lo)
