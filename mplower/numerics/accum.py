"""A tensor-core accumulator that keeps fewer bits than f32, promoted to f32 at intervals.

DeepSeek-V3's report (DeepSeek-AI, arXiv:2412.19437, section 3.3.2, "Increasing Accumulation
Precision") measured that the FP8 GEMMs of NVIDIA's Hopper tensor cores keep only about 14
bits of the running sum, and that copying the partial sums to f32 registers every N_C = 128
elements of K (four WGMMAs) recovers the accuracy. `matmul_limited_accum` models that: for each
output, K is cut into intervals of `interval` elements; within one the products (exact: the
operands are fp8/fp4 values) are added one by one, in k order, to an accumulator that after
each addition is truncated toward zero to `bits` significant bits (the alignment shift drops
the low bits of the smaller addend, as a fixed-width adder does); at the end of the interval
that partial sum is added to an f32 total (round to nearest even). bits = 24 and any interval
is f32 accumulation in k order. A model of the hardware, not a bit-exact copy of it: NVIDIA
does not document the adder.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange


@njit(cache=True)
def _truncate(v: float, bits: int) -> float:
    if v == 0.0 or not math.isfinite(v):
        return v
    m, e = math.frexp(v)  # v = m * 2^e, 0.5 <= |m| < 1
    return math.ldexp(math.trunc(m * 2.0 ** bits) / 2.0 ** bits, e)


@njit(cache=True, parallel=True)
def _kernel(a, b, bits, interval, out):
    m, k = a.shape
    n = b.shape[1]
    for i in prange(m):
        for j in range(n):
            total = np.float32(0)
            for k0 in range(0, k, interval):
                acc = 0.0
                for kk in range(k0, min(k, k0 + interval)):
                    acc = _truncate(acc + np.float64(a[i, kk]) * np.float64(b[kk, j]), bits)
                total = np.float32(total + np.float32(acc))
            out[i, j] = total


def matmul_limited_accum(a: np.ndarray, b: np.ndarray, bits: int,
                         interval: int) -> np.ndarray:
    """`a @ b` (2-D float32) with a `bits`-bit accumulator promoted to f32 every `interval`."""
    if not 1 <= bits <= 24 or interval < 1:
        raise ValueError(f"accumulator bits must be in 1..24 and the interval >= 1; got "
                         f"{bits} bits, interval {interval}")
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul_limited_accum needs (M, K) @ (K, N); got {a.shape} @ {b.shape}")
    out = np.empty((a.shape[0], b.shape[1]), dtype=np.float32)
    _kernel(a, b, bits, interval, out)
    return out
