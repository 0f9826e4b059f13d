"""A tensor-core accumulator that keeps fewer bits than f32, promoted to f32 at intervals.

DeepSeek-V3's report (DeepSeek-AI, arXiv:2412.19437, section 3.3.2, "Increasing Accumulation
Precision") measured that the FP8 GEMMs of NVIDIA's Hopper tensor cores keep only about 14
bits of the running sum, and that copying the partial sums to f32 registers every N_C = 128
elements of K (four WGMMAs) recovers the accuracy. `matmul_limited_accum` models that adder:
for each output, K is cut into intervals of `interval` elements, and each interval into steps
of `group` products (32: the K of one fp8 wgmma instruction, PTX ISA `wgmma.mma_async`
m64nNk32 for .e4m3/.e5m2). At each step the running sum and the step's products (exact: the
operands are fp8/fp4 values) are aligned to the largest exponent among them, each truncated
toward zero to `bits` bits below that exponent's leading bit, added exactly, and the sum
truncated toward zero to `bits` significant bits. At the end of an interval that partial sum
is added to an f32 total (round to nearest even).

Fitted and checked on an H200 (benchmarks/gpu_check.py, docs/benchmarks.md; the measured
outputs are tests/data/h200_fp8_scaled_mm.npz): with `bits`=14, `group`=32 it reproduces
torch._scaled_mm with use_fast_accum=True (never promoted) bit for bit on 98.6% of outputs
of a K=4096 product of positive fp8 values and 90% of one of signed values, and the default
(promoted by cuBLAS) with `interval`=128 on 97% of the positive one; a running sum truncated
after every single addition (group 1) matched 0.2% and overstated the signed error 28-fold.
A model fitted to one chip and one library, not NVIDIA's documented adder (there is none).
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
def _kernel(a, b, bits, interval, group, out):
    m, k = a.shape
    n = b.shape[1]
    for i in prange(m):
        for j in range(n):
            total = np.float32(0)
            for k0 in range(0, k, interval):
                k1 = min(k, k0 + interval)
                acc = 0.0
                for g0 in range(k0, k1, group):
                    g1 = min(k1, g0 + group)
                    big = abs(acc)
                    for kk in range(g0, g1):
                        big = max(big, abs(np.float64(a[i, kk]) * np.float64(b[kk, j])))
                    if big == 0.0 or not math.isfinite(big):
                        for kk in range(g0, g1):
                            acc += np.float64(a[i, kk]) * np.float64(b[kk, j])
                        continue
                    unit = math.ldexp(1.0, math.frexp(big)[1] - bits)
                    steps = math.trunc(acc / unit)  # integers below 2^bits: exact sums
                    for kk in range(g0, g1):
                        steps += math.trunc(np.float64(a[i, kk]) * np.float64(b[kk, j]) / unit)
                    acc = _truncate(steps * unit, bits)
                total = np.float32(total + np.float32(acc))
            out[i, j] = total


WGMMA_K = 32  # products per accumulator step: the K of one fp8 wgmma on Hopper


def matmul_limited_accum(a: np.ndarray, b: np.ndarray, bits: int, interval: int,
                         group: int = WGMMA_K) -> np.ndarray:
    """`a @ b` (2-D float32) with a `bits`-bit accumulator taking `group` products a step,
    promoted to f32 every `interval`."""
    if not 1 <= bits <= 24 or interval < 1 or group < 1:
        raise ValueError(f"accumulator bits must be in 1..24, the interval and group >= 1; "
                         f"got {bits} bits, interval {interval}, group {group}")
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul_limited_accum needs (M, K) @ (K, N); got {a.shape} @ {b.shape}")
    out = np.empty((a.shape[0], b.shape[1]), dtype=np.float32)
    _kernel(a, b, bits, interval, group, out)
    return out
