"""Fixed-order float64 kernels of the weight-only algorithms (numerics/weight_only.py).

Kept apart so that importing weight_only (which the quantize pass does when `mplower passes`
lists it) does not load numba: the kernels load on first use.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def matmul_acc(a, b, out, sign):
    """out += sign * a @ b, each element summed over k in order (vectorized across columns,
    which does not change any element's order)."""
    m, kk = a.shape
    for i in range(m):
        for k in range(kk):
            c = sign * a[i, k]
            if c != 0.0:
                for j in range(b.shape[1]):
                    out[i, j] += c * b[k, j]


@njit(cache=True)
def gram_acc(x, h):
    """h += 2 * x.T @ x for x (R, K): the batch's sums over its rows in order (the inner loop
    runs along a row, so it vectorizes without reordering any element's sum), then added."""
    k = x.shape[1]
    g = np.zeros((k, k))
    for t in range(x.shape[0]):
        for i in range(k):
            xi = x[t, i]
            for j in range(i + 1):
                g[i, j] += xi * x[t, j]
    for i in range(k):
        for j in range(i + 1):
            h[i, j] += 2.0 * g[i, j]
            h[j, i] = h[i, j]


@njit(cache=True)
def cholesky_lower(a):
    """L with L L^T = a (a symmetric positive definite); raises on a non-positive pivot.
    Right-looking: each element takes its updates in the same order as the textbook
    (left-looking) loop, with the inner loop along a row."""
    n = a.shape[0]
    m = a.copy()
    lo = np.zeros_like(a)
    col = np.zeros(n)
    for j in range(n):
        s = m[j, j]
        if not s > 0.0:
            raise ValueError("matrix is not positive definite")
        d = np.sqrt(s)
        lo[j, j] = d
        for i in range(j + 1, n):
            col[i] = m[i, j] / d
            lo[i, j] = col[i]
        for i in range(j + 1, n):
            c = col[i]
            for k in range(j + 1, i + 1):
                m[i, k] -= c * col[k]
    return lo


@njit(cache=True)
def inverse_lower(lo):
    """The inverse of a lower-triangular matrix, by forward substitution (row i of the result
    is built from rows k < i, in order, along contiguous rows)."""
    n = lo.shape[0]
    inv = np.zeros_like(lo)
    for i in range(n):
        for k in range(i):
            c = lo[i, k]
            for j in range(k + 1):
                inv[i, j] -= c * inv[k, j]
        d = lo[i, i]
        for j in range(i):
            inv[i, j] /= d
        inv[i, i] = 1.0 / d
    return inv


@njit(cache=True)
def lower_t_lower(m):
    """m^T @ m for lower-triangular m (the inverse of L L^T is L^-T L^-1), each element summed
    over k in order."""
    n = m.shape[0]
    out = np.zeros_like(m)
    for k in range(n):
        for i in range(k + 1):
            c = m[k, i]
            for j in range(i + 1):
                out[i, j] += c * m[k, j]
    for i in range(n):
        for j in range(i):
            out[j, i] = out[i, j]
    return out


@njit(cache=True)
def quad_error(h, d):
    """sum over columns n of d[:, n]^T h d[:, n] / 2 (h = 2 X^T X: the squared error)."""
    hd = np.zeros_like(d)
    matmul_acc(h, d, hd, 1.0)
    s = 0.0
    for i in range(d.shape[0]):
        for j in range(d.shape[1]):
            s += d[i, j] * hd[i, j]
    return 0.5 * s


@njit(cache=True)
def column_sums(a):
    """Sum over the rows of a, in order, per column."""
    out = np.zeros(a.shape[1])
    for t in range(a.shape[0]):
        for j in range(a.shape[1]):
            out[j] += a[t, j]
    return out
