"""The one float matrix product of mplower, with a summation order that is mplower's own.

BLAS libraries pick their blocking, and with it the order in which an output's products are
summed, by CPU kernel (OPENBLAS_CORETYPE), thread count and matrix shape, and vectorize along
K so that a row's result depends on where it sits in its batch. With products that round (f32
operands, the fp32 reference) each of those changes the last bit. `matmul` fixes the order:

    c[i, j] = 0;  for k = 0, 1, ..., K-1:  c[i, j] = fl(c[i, j] + fl(a[i, k] * b[k, j]))

in the result's precision (float32, or float64 when an operand is float64), a rounded product
and a rounded sum per step, never a fused multiply-add (the kernel is compiled without
fastmath, so LLVM may neither contract nor reassociate). Tiling keeps that order: the work is
cut into tiles of output rows and columns, each tile owned by one thread and swept over K in
ascending blocks, and SIMD lanes hold different output columns. So every output element is the
same function of its own row of `a` and column of `b` whatever the thread count, the BLAS
library, the tile a row lands in or the batch around it.

Integer operands stay on np.matmul: numpy multiplies integers without BLAS, exactly.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

# A tile is _ROWS output rows x _COLS columns, swept over K in blocks of _DEPTH: its output rows
# (16 KiB) stay in L1 while the (_DEPTH, _COLS) block of b (256 KiB) stays in L2. The sizes
# change speed only, never a result.
_ROWS, _COLS, _DEPTH = 16, 256, 256
# Below this many multiply-adds one thread does the whole product: entering a parallel region
# costs more than the product itself (and 10-15 ms when other processes hold the cores).
SERIAL_BELOW = 1 << 21


@njit(cache=True)
def _tile(a, b, c, t, ia, ib):
    """Tile t of c (batch, row block, column block, in that order of significance)."""
    m, kk = a.shape[1], a.shape[2]
    n = b.shape[2]
    tiles_i = (m + _ROWS - 1) // _ROWS
    tiles_j = (n + _COLS - 1) // _COLS
    batch = t // (tiles_i * tiles_j)
    rest = t % (tiles_i * tiles_j)
    i0 = (rest // tiles_j) * _ROWS
    j0 = (rest % tiles_j) * _COLS
    i1 = min(i0 + _ROWS, m)
    j1 = min(j0 + _COLS, n)
    x = a[ia[batch]]
    w = b[ib[batch]]
    y = c[batch]
    for k0 in range(0, kk, _DEPTH):
        k1 = min(k0 + _DEPTH, kk)
        i = i0
        while i + 1 < i1:  # two rows share each load of b
            y0 = y[i, j0:j1]
            y1 = y[i + 1, j0:j1]
            for k in range(k0, k1):
                a0 = x[i, k]
                a1 = x[i + 1, k]
                row = w[k, j0:j1]
                for j in range(j1 - j0):
                    y0[j] += a0 * row[j]
                    y1[j] += a1 * row[j]
            i += 2
        if i < i1:
            y0 = y[i, j0:j1]
            for k in range(k0, k1):
                a0 = x[i, k]
                row = w[k, j0:j1]
                for j in range(j1 - j0):
                    y0[j] += a0 * row[j]


@njit(cache=True)
def _gemm_serial(a, b, c, ia, ib):
    tiles = c.shape[0] * ((c.shape[1] + _ROWS - 1) // _ROWS) * ((c.shape[2] + _COLS - 1) // _COLS)
    for t in range(tiles):
        _tile(a, b, c, t, ia, ib)


@njit(cache=True, parallel=True)
def _gemm_parallel(a, b, c, ia, ib):
    tiles = c.shape[0] * ((c.shape[1] + _ROWS - 1) // _ROWS) * ((c.shape[2] + _COLS - 1) // _COLS)
    for t in prange(tiles):
        _tile(a, b, c, t, ia, ib)


def _batches(x: np.ndarray, batch: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray,
                                                                              np.ndarray]:
    """x as a contiguous (B, rows, cols) stack of its own matrices, and for each of the
    `batch` products (flattened) the index of its matrix: broadcasting without copies."""
    own = x.shape[:-2]
    stack = np.ascontiguousarray(x.reshape((int(np.prod(own)),) + x.shape[-2:]), dtype)
    index = np.arange(stack.shape[0], dtype=np.int64).reshape(own)
    return stack, np.ascontiguousarray(np.broadcast_to(index, batch).reshape(-1))


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """np.matmul(a, b) (batch broadcasting, 1-D operands) in the fixed order of the module
    docstring for float operands (float32, or float64 if either is); integers as np.matmul."""
    a, b = np.asarray(a), np.asarray(b)
    dtype = np.result_type(a, b)
    if dtype.kind != "f":
        return np.matmul(a, b)
    dtype = np.dtype(np.float64 if dtype == np.float64 else np.float32)
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError("matmul: operands must have at least one dimension")
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    if a2.shape[-1] != b2.shape[-2]:
        raise ValueError(f"matmul: contraction mismatch: {a.shape} @ {b.shape}")
    batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    (m, k), n = a2.shape[-2:], b2.shape[-1]
    sa, ia = _batches(a2, batch, dtype)
    sb, ib = _batches(b2, batch, dtype)
    c = np.zeros((ia.size, m, n), dtype)
    if c.size and k:
        run = _gemm_serial if c.size * k < SERIAL_BELOW else _gemm_parallel
        run(sa, sb, c, ia, ib)
    y = c.reshape(batch + (m, n))
    if a.ndim == 1:
        y = y[..., 0, :]
    if b.ndim == 1:
        y = y[..., 0]
    return y
