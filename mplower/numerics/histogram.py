"""One pass over a float tensor, in its own dtype, for calibration's histograms.

`magnitude_counts` is what mplower.calibration.TensorStats.add used to compute with a float64
copy of the tensor, np.ldexp, np.floor, three np.bincount and np.frexp (six passes and 8 bytes
an element): per value v, with |v| exactly a float64, the bin floor(|v| * 2**shift) in `pos`
(v >= 0) or `neg` (v < 0), and the frexp exponent of every non-zero |v| in `exponents`.
Multiplying by a power of two is exact (no overflow or underflow in these ranges), as ldexp
is, so the counts are the same integers; counts commute, so merging stays exact.

The frexp exponent of a normal value is its biased exponent field less the bias minus one,
read from the value's bits (a shift and a mask, against a C library call per element);
subnormals, rare, take frexp itself. Large tensors are counted in parts on the worker threads
(mplower.numerics.workers), each part into counts of its own, which then add up: integers, so
the totals do not depend on the split.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from mplower.numerics.workers import run_blocks

# Tensors below this many values are counted on one thread (about 0.3 ms of work).
SERIAL_BELOW = 1 << 18
_PARTS = 8

# dtype -> (unsigned view, mantissa bits, exponent mask, frexp bias: frexp's exponent of a
# normal value is its exponent field minus this)
_LAYOUT = {np.dtype(np.float32): (np.uint32, 23, 0xFF, 126),
           np.dtype(np.float64): (np.uint64, 52, 0x7FF, 1022)}


# Zeros (half of a relu's output) go to spare slots past the end, one of _SPARE in turn: a
# branch on "is it zero" mispredicts on such data, and incrementing bin 0 again and again
# waits on the previous increment's store every time.
_SPARE = 8


@njit(cache=True, nogil=True)
def _counts(x, bits, mant_bits, emask, ebias, scale, pos, neg, exponents, exp_lo):
    bins, n_exp = pos.size, exponents.size
    hist = np.zeros((2, bins + _SPARE), np.int64)  # x >= 0, x < 0
    exps = np.zeros(n_exp + _SPARE, np.int64)
    subnormals = 0
    for i in range(x.size):
        v = x[i]
        zero = v == 0
        spare = i & (_SPARE - 1)
        if bins:  # the same every iteration: predicted
            b = np.int64(np.float64(abs(v)) * scale)  # >= 0: truncation is floor
            hist[np.int64(v < 0), bins + spare if zero else b] += 1
        e = np.int64((bits[i] >> mant_bits) & emask)
        exps[e - ebias - exp_lo if e > 0 else n_exp + spare] += 1
        subnormals += np.int64(e == 0) * np.int64(not zero)  # counted without a branch
    if subnormals:  # rare: their exponents from frexp, in a second pass
        for i in range(x.size):
            if x[i] != 0 and (bits[i] >> mant_bits) & emask == 0:
                exps[math.frexp(np.float64(abs(x[i])))[1] - exp_lo] += 1
    if bins:
        pos += hist[0, :bins]
        neg += hist[1, :bins]
        pos[0] += hist[0, bins:].sum()  # the zeros (-0.0 is not < 0: a non-negative value)
    exponents += exps[:n_exp]


@njit(cache=True, nogil=True)
def _count_parts(x, bits, mant_bits, emask, ebias, scale, pos, neg, exponents, exp_lo, p0, p1):
    per = (x.size + pos.shape[0] - 1) // pos.shape[0]
    for p in range(p0, p1):
        lo, hi = p * per, min(x.size, (p + 1) * per)
        _counts(x[lo:hi], bits[lo:hi], mant_bits, emask, ebias, scale, pos[p], neg[p],
                exponents[p], exp_lo)


def magnitude_counts(x: np.ndarray, shift: int, pos: np.ndarray, neg: np.ndarray,
                     exponents: np.ndarray, exp_lo: int) -> None:
    """Add x's values (finite, max |x| * 2**shift below pos.size) into the int64 counts; with
    empty `pos` and `neg`, into `exponents` only."""
    flat = np.ascontiguousarray(x).reshape(-1)
    if flat.dtype not in _LAYOUT:
        flat = flat.astype(np.float64)
    view, mant_bits, emask, ebias = _LAYOUT[flat.dtype]
    args = (flat, flat.view(view), mant_bits, emask, ebias, math.ldexp(1.0, shift))
    if flat.size < SERIAL_BELOW:
        _counts(*args, pos, neg, exponents, exp_lo)
        return
    parts = [np.zeros((_PARTS, a.size), np.int64) for a in (pos, neg, exponents)]
    run_blocks(_count_parts, _PARTS, *args, *parts, exp_lo)
    for total, part in zip((pos, neg, exponents), parts):
        total += part.sum(axis=0)
