"""Transcendental functions of the op table as compiled loops, one pass over memory.

`erf` returns the C library's double-precision erf (what Python's math.erf calls, and so the
op's reference) of every element, rounded once to the operand's precision. Each output depends
only on its own input, so the parallel blocks (workers.py) give the same bits for any thread
count.

float64 operands call that erf per element (~20 ns, a scalar call LLVM cannot vectorize).
float32 operands, the models' case, take a vectorized kernel that gets the same bits about
seven times faster on one thread, with Ziv's rounding test: it evaluates erf in float64 from
its own polynomials and its own exp (only IEEE double +, -, *, / and integer bit operations: no
library call, no fast-math, no fused multiply-add, so the same value on every machine and in
every vector lane), whose distance to the C library's erf stays below _ERROR_BOUND relative
over all 2^32 float32 inputs, with a wide margin (benchmarks/erf_exhaustive.py,
docs/benchmarks.md). When both ends of approximation +- bound round to the same float32, so
does every value in between (rounding is monotone), the C library's erf among them, and that
float32 is the result; otherwise (about one element in 35000, and NaNs) the element is
recomputed with the C library's erf. Either way the bits are float32(C erf(x)).

Across machines the bits are therefore those of the C library's erf, as they were before this
kernel: glibc's erf is one portable C implementation (fdlibm's algorithm) on every x86-64 and
AArch64 Linux, with no CPU-dependent variant, so the sweep's comparison, and with it the
bound, holds wherever both sides compute the same bits; numba is never given fast-math here,
and without Intel's SVML (numba.config.USING_SVML, off unless icc_rt is installed) LLVM has no
vector erf to swap in. tests/test_special.py and tests/test_runtime_kernels.py pin the kernel
against math.erf bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from mplower.numerics.workers import run_blocks

# Below this many elements one thread does the whole loop (see gemm.SERIAL_BELOW): 2^16 float32
# elements take 0.16 ms on one thread (the ~0.1 ms of the other kernels' thresholds), float64
# ones (the C library's erf, ~20 ns each) about 1.3 ms.
SERIAL_BELOW = 1 << 16

# |approximation - C erf(x)| / |approximation| stays below this for every float32 x: the
# exhaustive sweep measured at most 2^-51.5 (docs/benchmarks.md), so the bound has a margin of
# 2^11; a wider bound only sends more elements to the fix-up.
_ERROR_BOUND = 2.0**-40

# Elements per flag check: the fix-up loop (not vectorized) runs only over a chunk that holds a
# flagged element.
_CHUNK = 256

# erf(x) = x * P(x^2) below _SPLIT; above it erfc(x) = exp(-x^2) * Q(_T / (_T + x)), the
# substitution of Numerical Recipes (3rd ed., section 6.2.2, t = 2 / (2 + x)) with _T = 3, up
# to _CLAMP, beyond which erfc(x) < 2^-55 and erf rounds to 1 in float64. P and Q have the same
# degree so that one Horner loop evaluates either, over coefficients selected per lane.
# Chebyshev fits to erf and erfcx in 40-digit arithmetic (benchmarks/erf_fit.py).
_SPLIT = 1.0
_CLAMP = 6.0
_T = 3.0
_ERF_SMALL = (
    5.957176147748911e-11,
    -1.1372848856791674e-09,
    1.4659775274047436e-08,
    -1.6350312701054695e-07,
    1.6461000484121368e-06,
    -1.4925595266831182e-05,
    0.0001205533111164271,
    -0.000854832698083379,
    0.0052239776248180145,
    -0.026866170645076792,
    0.11283791670954879,
    -0.3761263890318375,
    1.1283791670955126,
)
_ERFC_LARGE = (
    -0.035506324071029334,
    0.2384001564884133,
    -0.6594411116914638,
    0.9724661250761868,
    -0.9287694770056107,
    0.7256865674590404,
    -0.25030120177043613,
    0.2566677049969386,
    0.1208365507418102,
    0.18470987676684944,
    0.18711353426735305,
    0.18814039707960648,
    -2.8802148470534543e-06,
)
# exp(f) for |f| <= ln(2) / 2, also a Chebyshev fit (benchmarks/erf_fit.py).
_EXP = (
    2.762773069846965e-07,
    2.7641829585335596e-06,
    2.4801501014878055e-05,
    0.00019841166270355944,
    0.001388888893514123,
    0.008333333388852152,
    0.04166666666656548,
    0.16666666666545207,
    0.5000000000000007,
    1.0000000000000075,
    1.0,
)

_BLENDED = tuple(zip(_ERF_SMALL, _ERFC_LARGE, strict=True))

# exp(a) = 2^k exp(a - k ln 2), k = round(a / ln 2) (Cody and Waite's reduction): _LN2_HI has
# its 20 low bits clear, so k * _LN2_HI is exact for the |k| <= 52 that -_CLAMP^2 needs.
_INV_LN2 = 1.4426950408889634
_LN2_HI = 0.6931471804855391
_LN2_LO = 7.440617110012397e-11
# Adding 1.5 * 2^52 rounds a / ln 2 to an integer k held in the low bits of the sum.
_SHIFTER = 6755399441055744.0


@intrinsic
def _bits(typingctx, value):
    """The bits of a float64 as a uint64 (a register move that vectorizes)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))
    return types.uint64(types.float64), codegen


@intrinsic
def _from_bits(typingctx, value):
    """The float64 whose bits are a uint64."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(types.uint64), codegen


@njit(cache=True, inline="always")
def _exp_negative(a):
    # a in [-_CLAMP^2, 0]: 2^k is a normal double, whose bits are (k + 1023) << 52. The bits of
    # `shifted` are those of 1.5 * 2^52 plus k, and the shift keeps only their low 12 bits.
    shifted = a * _INV_LN2 + _SHIFTER
    k = shifted - _SHIFTER
    f = (a - k * _LN2_HI) - k * _LN2_LO
    p = _EXP[0]
    for c in _EXP[1:]:
        p = p * f + c
    return p * _from_bits((_bits(shifted) + np.uint64(1023)) << np.uint64(52))


@njit(cache=True, inline="always")
def _erf_approx(x):
    # Every lane computes both branches and selects, so that the loop has no branch to stop
    # LLVM from vectorizing it. A NaN stays NaN through either branch.
    r = abs(x)
    small = r < _SPLIT
    rc = _CLAMP if r >= _CLAMP else r  # noqa: FURB136 - min(_CLAMP, nan) would be _CLAMP
    v = r * r if small else _T / (_T + rc)
    p = 0.0
    for c_small, c_large in _BLENDED:
        p = p * v + (c_small if small else c_large)
    tail = 1.0 - _exp_negative(-(rc * rc)) * p
    # x * P keeps the sign of zero: erf(-0.0) is -0.0.
    return x * p if small else (-tail if x < 0 else tail)


# error_model="numpy": without it numba tests every float division for a zero divisor (to raise
# ZeroDivisionError), a branch that stops LLVM from vectorizing the loop (~12x slower).
@njit(cache=True, nogil=True, error_model="numpy")
def _erf32_serial(x, y, bound):
    """y = float32(C erf(x)) for float32 x; returns how many elements the fix-up recomputed.
    `bound` is _ERROR_BOUND (the tests pass larger ones to send more elements to the
    fix-up)."""
    flagged = 0
    for c0 in range(0, x.size, _CHUNK):
        xs = x[c0:c0 + _CHUNK]
        ys = y[c0:c0 + _CHUNK]
        misses = 0
        for i in range(xs.size):
            a = _erf_approx(np.float64(xs[i]))
            lo = np.float32(a - abs(a) * bound)
            hi = np.float32(a + abs(a) * bound)
            # lo != hi also for a NaN, which the fix-up gives the C library's NaN bits.
            ys[i] = lo if lo == hi else np.float32(np.nan)
            misses += lo != hi
        if misses:
            for i in range(xs.size):
                if ys[i] != ys[i]:
                    ys[i] = math.erf(np.float64(xs[i]))
                    flagged += 1
    return flagged


@njit(cache=True, nogil=True)
def _erf32_blocks(x, y, i0, i1):
    _erf32_serial(x[i0:i1], y[i0:i1], _ERROR_BOUND)


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
    if flat.dtype == np.float32:
        if flat.size < SERIAL_BELOW:
            _erf32_serial(flat, y, _ERROR_BOUND)
        else:
            run_blocks(_erf32_blocks, flat.size, flat, y)
    elif flat.size < SERIAL_BELOW:
        _erf_serial(flat, y)
    else:
        run_blocks(_erf_blocks, flat.size, flat, y)
    return y.reshape(x.shape)
