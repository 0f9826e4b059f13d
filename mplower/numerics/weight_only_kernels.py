"""Fixed-order float64 kernels of the weight-only algorithms (numerics/weight_only.py).

Kept apart so that importing weight_only (which the quantize pass does when `mplower passes`
lists it) does not load numba: the kernels load on first use.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(cache=True, parallel=True)
def matmul_acc(a, b, out, sign):
    """out += sign * a @ b, each element summed over k in order. Rows of out are independent
    (prange) and the inner loop runs along a row of b (vectorized across columns): neither
    changes any element's order of sums, so the bits do not depend on the thread count."""
    m, kk = a.shape
    for i in prange(m):
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


PANEL = 32  # columns factored before the trailing rows take their updates at once


@njit(cache=True, parallel=True)
def _trailing_update(m, lt, j0, j1):
    """m[i, k] -= sum over j in [j0, j1) of L[i, j] L[k, j], in order of j, for the trailing
    rows i >= j1 and j1 <= k <= i; lt holds L's panel transposed (row j - j0 is column j)."""
    n = m.shape[0]
    for i in prange(j1, n):
        # Slices, so that the inner loop's index starts at 0: a loop from j1 keeps numba's
        # negative-index check and does not vectorize (about 2x slower).
        row = m[i, j1:i + 1]
        for j in range(j1 - j0):
            c = lt[j, i]
            lj = lt[j, j1:i + 1]
            for k in range(row.shape[0]):
                row[k] -= c * lj[k]


@njit(cache=True)
def cholesky_lower(a):
    """L with L L^T = a (a symmetric positive definite); raises on a non-positive pivot.
    Every element takes its updates from columns j = 0, 1, ... in order, as the textbook loop
    does; a panel of PANEL columns is factored, then the trailing rows take the panel's updates
    row by row in parallel (each row's order unchanged, so the bits do not depend on threads)."""
    n = a.shape[0]
    m = a.copy()
    lo = np.zeros_like(a)
    for j0 in range(0, n, PANEL):
        j1 = min(j0 + PANEL, n)
        lt = np.zeros((j1 - j0, n))
        for j in range(j0, j1):
            s = m[j, j]
            if not s > 0.0:
                raise ValueError("matrix is not positive definite")
            d = np.sqrt(s)
            lo[j, j] = d
            lt[j - j0, j] = d
            for i in range(j + 1, n):
                v = m[i, j] / d
                lo[i, j] = v
                lt[j - j0, i] = v
            # the panel's own later columns (rows j+1 .. n, columns j+1 .. j1-1) now
            for i in range(j + 1, n):
                c = lt[j - j0, i]
                for k in range(j + 1, min(i + 1, j1)):
                    m[i, k] -= c * lt[j - j0, k]
        if j1 < n:
            _trailing_update(m, lt, j0, j1)
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


@njit(cache=True, parallel=True)
def lower_t_lower(m):
    """m^T @ m for lower-triangular m (the inverse of L L^T is L^-T L^-1), each element summed
    over k in order; rows of the result in parallel (a row's order does not depend on it)."""
    n = m.shape[0]
    out = np.zeros_like(m)
    for i in prange(n):
        for k in range(i, n):
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
