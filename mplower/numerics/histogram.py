"""Compiled passes over a float32 tensor for calibration's statistics.

`tensor_counts` adds, per value v (|v| exactly a float64), the bin floor(|v| * scale) to the
histogram of its side (v >= 0 or v < 0, each side with its own power-of-two `scale`) and the
frexp exponent of every non-zero |v| to the exponent counts of its side. Multiplying by a power
of two is exact (no overflow or underflow in these ranges), as ldexp is, so the counts are the
integers that np.ldexp, np.floor and np.bincount over a float64 copy give; counts commute, so
merging stays exact. The bins need the tensor's range first; where no histogram is wanted
(minmax calibration), `tensor_summary` counts the exponents and finds the extrema in one pass.

The side and the exponent are read from the value's bits: its top nine bits (sign and exponent
field) index the exponent counts directly, and a normal value's frexp exponent is its field less
126; field 255 is a value that is not finite. Zeros and subnormals share field 0; where it was
hit, a second pass takes the subnormals' exponents from frexp (and moves each -0.0, whose sign
bit is set but which is not < 0, to the histogram's non-negative side). Exponent increments go
to four interleaved copies of the table, one per position modulo 4 (a tensor's values share a
handful of exponents, and incrementing one counter again and again waits on the previous
increment's store). Other float dtypes are counted with numpy (float64: an integer tensor;
rare). Large tensors are counted in parts on the worker threads (mplower.numerics.workers), each
part into counts of its own, which then add up: integers and extrema, so the totals do not
depend on the split.
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


@njit(cache=True, nogil=True)
def _fold(ex, xs, bs, exponents, exp_lo):
    """Add the exponent-field counts `ex` (four copies of sign x field) into exponents (2, n),
    with the subnormals' exponents from frexp; returns the count of values not finite."""
    bad = 0
    for c in range(4):
        for s in range(2):
            for e in range(1, 255):  # 0: zeros and subnormals; 255: not finite
                exponents[s, e - _FIELD_BIAS - exp_lo] += ex[(c << 9) + (s << 8) + e]
            bad += ex[(c << 9) + (s << 8) + 255]
    if ex[0] + ex[256] + ex[512] + ex[768] + ex[1024] + ex[1280] + ex[1536] + ex[1792] == 0:
        return bad
    for j in range(xs.size):  # zeros and subnormals
        b = bs[j]
        if b & 0x7FFFFFFF != 0 and (b >> 23) & 0xFF == 0:
            exponents[b >> 31, math.frexp(np.float64(abs(xs[j])))[1] - exp_lo] += 1
    return bad


@njit(cache=True, nogil=True, inline="always")
def _scan(xs, bs, ex):
    """Count the exponent fields of xs (bits bs) into the four tables of ex; return (min, max)
    of xs (+inf, -inf when empty; meaningless if a value is not finite)."""
    inf = np.float32(np.inf)
    small0 = small1 = small2 = small3 = inf
    big0 = big1 = big2 = big3 = -inf
    n4 = xs.size - xs.size % 4
    for j in range(0, n4, 4):  # four copies of the table, four chains of extrema
        ex[bs[j] >> 23] += 1
        ex[512 + (bs[j + 1] >> 23)] += 1
        ex[1024 + (bs[j + 2] >> 23)] += 1
        ex[1536 + (bs[j + 3] >> 23)] += 1
        small0, big0 = min(small0, xs[j]), max(big0, xs[j])
        small1, big1 = min(small1, xs[j + 1]), max(big1, xs[j + 1])
        small2, big2 = min(small2, xs[j + 2]), max(big2, xs[j + 2])
        small3, big3 = min(small3, xs[j + 3]), max(big3, xs[j + 3])
    for j in range(n4, xs.size):
        ex[bs[j] >> 23] += 1
        small0, big0 = min(small0, xs[j]), max(big0, xs[j])
    return min(min(small0, small1), min(small2, small3)), max(max(big0, big1), max(big2, big3))


@njit(cache=True, nogil=True)
def _summary(x, bits, lo, hi, exponents, exp_lo, out):
    """Values x[lo:hi] into exponents (2, n_exp); out = [min, max, count not finite] (the
    extrema are meaningless where that count is not 0)."""
    xs, bs = x[lo:hi], bits[lo:hi]
    ex = np.zeros(4 * 512, np.int64)
    out[0], out[1] = _scan(xs, bs, ex)
    out[2] = _fold(ex, xs, bs, exponents, exp_lo)


@njit(cache=True, nogil=True)
def _row_summary(x, bits, r0, r1, inner, exponents, exp_lo, out, low, high):
    """`_summary` of rows r0 .. r1 - 1 of x (rows of `inner` values, row r of channel
    r % low.size), also folding each row's extrema into its channel's low and high."""
    ex = np.zeros(4 * 512, np.int64)
    small, big = np.float32(np.inf), np.float32(-np.inf)
    channels = low.size
    for r in range(r0, r1):
        lo, hi = _scan(x[r * inner:(r + 1) * inner], bits[r * inner:(r + 1) * inner], ex)
        c = r % channels
        low[c], high[c] = min(low[c], lo), max(high[c], hi)
        small, big = min(small, lo), max(big, hi)
    out[0], out[1] = small, big
    out[2] = _fold(ex, x[r0 * inner:r1 * inner], bits[r0 * inner:r1 * inner], exponents, exp_lo)


@njit(cache=True, nogil=True)
def _row_summary_parts(x, bits, rows, inner, exponents, exp_lo, out, low, high, p0, p1):
    parts = exponents.shape[0]
    for p in range(p0, p1):
        _row_summary(x, bits, rows * p // parts, rows * (p + 1) // parts, inner, exponents[p],
                     exp_lo, out[p], low[p], high[p])


@njit(cache=True, nogil=True)
def _counts(x, bits, scales, lo, hi, hist, exponents, exp_lo):
    """Values x[lo:hi] (finite) into hist (2, bins) and exponents (2, n_exp)."""
    bins = hist.shape[1]
    h = np.zeros(2 * bins, np.int64)
    ex = np.zeros(4 * 512, np.int64)
    xs, bs = x[lo:hi], bits[lo:hi]
    for j in range(xs.size):  # from 0: LLVM unrolls the loop by the copy index j & 3
        b = bs[j]
        ex[((j & 3) << 9) + (b >> 23)] += 1
        s = b >> 31
        h[s * bins + np.int64(np.float64(abs(xs[j])) * scales[s])] += 1
    for s in range(2):
        for b in range(bins):
            hist[s, b] += h[s * bins + b]
    _fold(ex, xs, bs, exponents, exp_lo)
    if ex[256] + ex[768] + ex[1280] + ex[1792] == 0:
        return
    for j in range(xs.size):  # -0.0 has the sign bit but is not < 0: the v >= 0 side
        if bs[j] == 0x80000000:
            hist[1, 0] -= 1
            hist[0, 0] += 1


@njit(cache=True, nogil=True)
def _summary_parts(x, bits, exponents, exp_lo, out, p0, p1):
    parts = exponents.shape[0]
    for p in range(p0, p1):
        _summary(x, bits, x.size * p // parts, x.size * (p + 1) // parts, exponents[p], exp_lo,
                 out[p])


@njit(cache=True, nogil=True)
def _count_parts(x, bits, scales, hist, exponents, exp_lo, p0, p1):
    parts = hist.shape[0]
    for p in range(p0, p1):
        _counts(x, bits, scales, x.size * p // parts, x.size * (p + 1) // parts, hist[p],
                exponents[p], exp_lo)


def _float32(x: np.ndarray) -> np.ndarray | None:
    return np.ascontiguousarray(x).reshape(-1) if x.dtype == np.float32 else None


def tensor_summary(x: np.ndarray, exponents: np.ndarray, exp_lo: int) -> tuple[float, float, int]:
    """Add the frexp exponents (from exp_lo) of x's non-zero values to `exponents` (int64, 2 x n:
    the v > 0 and the v < 0 side) and return x's (min, max, number of values not finite) from
    the same pass; the extrema are meaningless where that number is not 0."""
    flat = _float32(x)
    if flat is None:
        flat = np.asarray(x, np.float64).reshape(-1)
        bad = int(np.count_nonzero(~np.isfinite(flat)))
        if bad == 0:
            _numpy_counts(flat, np.ones(2), np.zeros((2, 0), np.int64), exponents, exp_lo)
        return float(flat.min()), float(flat.max()), bad
    if flat.size < SERIAL_BELOW:
        out = np.zeros(3)
        _summary(flat, flat.view(np.uint32), 0, flat.size, exponents, exp_lo, out)
    else:
        exps = np.zeros((_PARTS,) + exponents.shape, np.int64)
        parts = np.zeros((_PARTS, 3))
        run_blocks(_summary_parts, _PARTS, flat, flat.view(np.uint32), exps, exp_lo, parts)
        exponents += exps.sum(axis=0)
        out = np.array([parts[:, 0].min(), parts[:, 1].max(), parts[:, 2].sum()])
    return float(out[0]), float(out[1]), int(out[2])


def channel_summary(x: np.ndarray, axis: int, exponents: np.ndarray,
                    exp_lo: int) -> tuple[float, float, int, np.ndarray, np.ndarray]:
    """`tensor_summary` of a non-empty x with each channel's (min, max) along `axis` as float64
    vectors, from the same pass (numpy's min and max reductions took two more)."""
    axis %= x.ndim
    flat = _float32(x)
    channels = x.shape[axis]
    if flat is None:
        lo, hi, bad = tensor_summary(x, exponents, exp_lo)
        rows = np.asarray(x, np.float64).reshape(math.prod(x.shape[:axis]), channels, -1)
        return lo, hi, bad, rows.min(axis=(0, 2)), rows.max(axis=(0, 2))
    inner = math.prod(x.shape[axis + 1:])
    rows = flat.size // inner
    parts = _PARTS if flat.size >= SERIAL_BELOW else 1
    exps = np.zeros((parts,) + exponents.shape, np.int64)
    out = np.zeros((parts, 3))
    low = np.full((parts, channels), np.inf, np.float32)
    high = np.full((parts, channels), -np.inf, np.float32)
    if parts == 1:
        _row_summary(flat, flat.view(np.uint32), 0, rows, inner, exps[0], exp_lo, out[0],
                     low[0], high[0])
    else:
        run_blocks(_row_summary_parts, parts, flat, flat.view(np.uint32), rows, inner, exps,
                   exp_lo, out, low, high)
    exponents += exps.sum(axis=0)
    return (float(out[:, 0].min()), float(out[:, 1].max()), int(out[:, 2].sum()),
            low.min(axis=0).astype(np.float64), high.max(axis=0).astype(np.float64))


def tensor_counts(x: np.ndarray, shifts: tuple[int, int], hist: np.ndarray,
                  exponents: np.ndarray, exp_lo: int) -> None:
    """Add x's values (finite; max |x| * 2**shifts[side] below the bin count) into the int64
    counts `hist` (2 x bins: |x| of the v >= 0 and of the v < 0 side) and `exponents` (as
    tensor_summary's)."""
    scales = np.array([math.ldexp(1.0, s) for s in shifts])
    flat = _float32(x)
    if flat is None:
        _numpy_counts(np.asarray(x, np.float64).reshape(-1), scales, hist, exponents, exp_lo)
    elif flat.size < SERIAL_BELOW:
        _counts(flat, flat.view(np.uint32), scales, 0, flat.size, hist, exponents, exp_lo)
    else:
        hists = np.zeros((_PARTS,) + hist.shape, np.int64)
        exps = np.zeros((_PARTS,) + exponents.shape, np.int64)
        run_blocks(_count_parts, _PARTS, flat, flat.view(np.uint32), scales, hists, exps,
                   exp_lo)
        hist += hists.sum(axis=0)
        exponents += exps.sum(axis=0)


def _numpy_counts(flat: np.ndarray, scales: np.ndarray, hist: np.ndarray,
                  exponents: np.ndarray, exp_lo: int) -> None:
    """tensor_counts of float64 values (finite), with numpy's float64 operations; an empty
    `hist` (2 x 0) for the exponents only."""
    neg = flat < 0
    for s, side in enumerate((flat[~neg], flat[neg])):
        mags = np.abs(side)
        if hist.shape[1]:
            hist[s] += np.bincount(np.floor(mags * scales[s]).astype(np.int64),
                                   minlength=hist.shape[1])
        exps = np.frexp(mags[mags != 0])[1] - exp_lo
        exponents[s] += np.bincount(np.clip(exps, 0, exponents.shape[1] - 1),
                                    minlength=exponents.shape[1])
