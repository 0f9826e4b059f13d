"""One pass over a float32 tensor for calibration's statistics.

`tensor_counts` adds, per value v (|v| exactly a float64), the bin floor(|v| * scale) to the
histogram of its side (v >= 0 or v < 0, each side with its own power-of-two `scale`) and the
frexp exponent of every non-zero |v| to the exponent counts of its side. Multiplying by a power
of two is exact (no overflow or underflow in these ranges), as ldexp is, so the counts are the
integers that np.ldexp, np.floor and np.bincount over a float64 copy give; counts commute, so
merging stays exact.

The side and the exponent are read from the value's bits: its top nine bits (sign and exponent
field) index the exponent counts directly, and a normal value's frexp exponent is its field less
126. Zeros and subnormals share field 0; where it was hit, a second pass takes the subnormals'
exponents from frexp and moves each -0.0 (whose sign bit is set, but which is not < 0) to the
non-negative side. Exponent increments go to four interleaved copies of the table, one per
position modulo 4 (a tensor's values share a handful of exponents, and incrementing one
counter again and again waits on the previous increment's store). Other float dtypes are
counted with numpy (float64: an integer tensor; rare). Large tensors are counted in parts on
the worker threads (mplower.numerics.workers), each part into counts of its own, which then add
up: integers, so the totals do not depend on the split.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from mplower.numerics.workers import run_blocks

# Tensors below this many values are counted on one thread (about 0.1 ms of work).
SERIAL_BELOW = 1 << 18
_PARTS = 8
_FIELD_BIAS = 126  # frexp's exponent of a normal float32 is its exponent field minus this
_NEG_ZERO = 0x80000000


@njit(cache=True, nogil=True)
def _counts(x, bits, scales, lo, hi, hist, exponents, exp_lo):
    """Values x[lo:hi] into hist (2, bins: empty for none) and exponents (2, n_exp)."""
    bins = hist.shape[1]
    h = np.zeros(2 * bins, np.int64)
    ex = np.zeros(4 * 512, np.int64)
    xs, bs = x[lo:hi], bits[lo:hi]
    for j in range(xs.size):  # from 0: LLVM unrolls the loop by the copy index j & 3
        b = bs[j]
        ex[((j & 3) << 9) + (b >> 23)] += 1
        if bins:  # the same every iteration: predicted
            s = b >> 31
            h[s * bins + np.int64(np.float64(abs(xs[j])) * scales[s])] += 1
    for s in range(2):
        for b in range(bins):
            hist[s, b] += h[s * bins + b]
        for e in range(1, 255):  # 0: zeros and subnormals; 255: not finite
            for c in range(4):
                exponents[s, e - _FIELD_BIAS - exp_lo] += ex[(c << 9) + (s << 8) + e]
    if ex[0] + ex[256] + ex[512] + ex[768] + ex[1024] + ex[1280] + ex[1536] + ex[1792] == 0:
        return
    for j in range(xs.size):  # zeros and subnormals
        b = bs[j]
        if b == _NEG_ZERO and bins:
            hist[1, 0] -= 1
            hist[0, 0] += 1
        elif b & 0x7FFFFFFF != 0 and (b >> 23) & 0xFF == 0:
            exponents[b >> 31, math.frexp(np.float64(abs(xs[j])))[1] - exp_lo] += 1


@njit(cache=True, nogil=True)
def _count_parts(x, bits, scales, hist, exponents, exp_lo, p0, p1):
    parts = hist.shape[0]
    for p in range(p0, p1):
        _counts(x, bits, scales, x.size * p // parts, x.size * (p + 1) // parts, hist[p],
                exponents[p], exp_lo)


def tensor_counts(x: np.ndarray, shifts: tuple[int, int], hist: np.ndarray,
                  exponents: np.ndarray, exp_lo: int) -> None:
    """Add x's values (finite; max |x| * 2**shifts[side] below the bin count) into the int64
    counts `hist` (2, bins: the v >= 0 and the v < 0 side; (2, 0) for none) and `exponents`
    (2, n: the frexp exponents, from exp_lo, of the non-zero values of each side)."""
    scales = np.array([math.ldexp(1.0, s) for s in shifts])
    if x.dtype != np.float32:
        _numpy_counts(np.asarray(x, np.float64).reshape(-1), scales, hist, exponents, exp_lo)
        return
    flat = np.ascontiguousarray(x).reshape(-1)
    args = (flat, flat.view(np.uint32), scales)
    if flat.size < SERIAL_BELOW:
        _counts(*args, 0, flat.size, hist, exponents, exp_lo)
        return
    hists = np.zeros((_PARTS,) + hist.shape, np.int64)
    exps = np.zeros((_PARTS,) + exponents.shape, np.int64)
    run_blocks(_count_parts, _PARTS, *args, hists, exps, exp_lo)
    hist += hists.sum(axis=0)
    exponents += exps.sum(axis=0)


def _numpy_counts(flat: np.ndarray, scales: np.ndarray, hist: np.ndarray,
                  exponents: np.ndarray, exp_lo: int) -> None:
    """tensor_counts of float64 values, with numpy's float64 operations."""
    neg = flat < 0
    for s, side in enumerate((flat[~neg], flat[neg])):
        mags = np.abs(side)
        if hist.shape[1]:
            hist[s] += np.bincount(np.floor(mags * scales[s]).astype(np.int64),
                                   minlength=hist.shape[1])
        exps = np.frexp(mags[mags != 0])[1] - exp_lo
        exponents[s] += np.bincount(np.clip(exps, 0, exponents.shape[1] - 1),
                                    minlength=exponents.shape[1])
