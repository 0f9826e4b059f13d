"""CPU kernels for sparse weights: 2:4 compressed matmul and CSR SpMM.

Both kernels compute y = x @ W for a 2-D weight W of shape (K, N) that is stored sparse, with
float32 products and sums (the f32 accumulator), so they equal the dense matmul of the same
values to fp32 reassociation. Layouts:

- 2:4 (`compress_2_4`): the layout of NVIDIA's sparse tensor cores. For each output column n
  and each group of four consecutive values along K, the two kept values (`values[n, 2g]`,
  `values[n, 2g + 1]`, in increasing K order) and their two 2-bit positions in the group,
  packed four bits per group, two groups per byte (`indices[n, g // 2]`, group g in the low
  nibble when g is even). A group with fewer than two non-zeros keeps a zero at a free position.
  A 1:2 weight is a 2:4 weight and runs on the same kernel (cuSPARSELt stores tf32 1:2 alike).
- CSR (`to_csr`): compressed along K as well, one CSR row per output column: its non-zero
  values, their int32 positions along K and int32 row pointers. For a (K, N) weight these are
  exactly the arrays of scipy.sparse.csr_matrix(W.T), the (out, in) weight of a linear layer
  as cuSPARSE SpMM and TVM's sparse_dense take it.

Both kernels work on x^T and y^T and give each thread whole output columns: y^T[j] (one row,
in L1) accumulates `value * x^T[k]` over the stored (k, value) of column j, a contiguous axpy
that LLVM vectorizes. x and y are transposed in cache-sized blocks on the way in and out.

`sparse_runner` is what the executor calls for an op lowered to a sparse kernel; `compress`
and `multiply` are the two halves it runs, which the sparse reality check
(mplower.report.sparse) times against dense BLAS.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit, prange

from mplower.ir.types import TensorType
from mplower.lowering.sparsity import has_pattern
from mplower.lowering.target import CSR, SPARSE_1_2, SPARSE_2_4
from mplower.numerics.formats import FORMATS
from mplower.numerics.rounding import ROUNDING_FORMATS

SPARSE_KERNELS = (SPARSE_2_4, SPARSE_1_2, CSR)
# Below this many multiply-adds a kernel runs on one thread (about 0.1 ms of work).
PARALLEL_MIN_WORK = 1 << 20


# ---- 2:4 ---------------------------------------------------------------------------------------

@njit(cache=True)
def _compress_rows(rows: np.ndarray, values: np.ndarray, meta: np.ndarray) -> int:
    """Fill values/meta from rows (N, K padded to 4); -1 if fine, else the first bad row."""
    n, k = rows.shape
    for j in range(n):
        for g in range(k // 4):
            p0, p1, count = -1, -1, 0
            for i in range(4):
                if rows[j, 4 * g + i] != 0:
                    if count == 2:
                        return j
                    if count == 0:
                        p0 = i
                    else:
                        p1 = i
                    count += 1
            # Fewer than two non-zeros: keep zeros at the lowest free positions, in order.
            if count == 0:
                p0, p1 = 0, 1
            elif count == 1:
                p1 = 1 if p0 == 0 else 0
                if p1 < p0:
                    p0, p1 = p1, p0
            values[j, 2 * g] = rows[j, 4 * g + p0]
            values[j, 2 * g + 1] = rows[j, 4 * g + p1]
            meta[j, g >> 1] |= np.uint8((p0 | (p1 << 2)) << (4 * (g & 1)))
    return -1


def compress_2_4(w: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(values, indices) of a 2-D weight with the 2:4 pattern along `axis` (its K).

    values: float32 (N, K4 / 2) and indices: uint8 (N, ceil(K4 / 8)), K4 = K rounded up to a
    multiple of 4. Raises ValueError naming the first group with more than two non-zeros.
    """
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"a 2:4 weight must be 2-D, got shape {list(w.shape)}")
    rows = np.moveaxis(w.astype(np.float32, copy=False), axis, 1)  # (N, K)
    n, k = rows.shape
    k4 = -(-k // 4) * 4
    padded = np.zeros((n, k4), np.float32)
    padded[:, :k] = rows
    values = np.zeros((n, k4 // 2), np.float32)
    meta = np.zeros((n, -(-k4 // 8)), np.uint8)
    bad = _compress_rows(padded, values, meta)
    if bad >= 0:
        raise ValueError(f"the weight does not have the 2:4 pattern along axis {axis}: output "
                         f"{bad} has a group of four with more than two non-zeros")
    return values, meta


@njit(cache=True)
def _gather_column(xt: np.ndarray, vals: np.ndarray, ks: np.ndarray, yt: np.ndarray,
                   j: int) -> None:
    """yt[j, :] = sum over p of vals[p] * xt[ks[p], :]: the row of yt (one output column of y)
    stays in L1 while the rows of xt stream past, and the inner loop is a contiguous axpy."""
    m = xt.shape[1]
    for i in range(m):
        yt[j, i] = 0.0
    for p in range(vals.shape[0]):
        v = vals[p]
        xrow = xt[ks[p]]
        for i in range(m):
            yt[j, i] += v * xrow[i]


@njit(cache=True)
def _transpose(a: np.ndarray, out: np.ndarray) -> None:
    """out[:a.shape[1], :a.shape[0]] = a.T in 32 x 32 blocks (numpy's strided copy of a
    transposed view misses the cache on every element). Serial: it is bound by memory, and a
    parallel region waits for a descheduled thread on a shared machine."""
    r, c = a.shape
    for b in range((c + 31) // 32):
        c0 = 32 * b
        for r0 in range(0, r, 32):
            for cc in range(c0, min(c0 + 32, c)):
                for rr in range(r0, min(r0 + 32, r)):
                    out[cc, rr] = a[rr, cc]


@njit(cache=True)
def _column_2_4(xt: np.ndarray, values: np.ndarray, meta: np.ndarray, yt: np.ndarray,
                j: int) -> None:
    """yt[j, :] = sum over kept t of values[j, t] * xt[k(j, t), :]."""
    half = values.shape[1]
    ks = np.empty(half, np.int64)
    for g in range(half // 2):  # unpack the 2-bit positions of output j
        b = (meta[j, g >> 1] >> (4 * (g & 1))) & 15
        ks[2 * g] = 4 * g + (b & 3)
        ks[2 * g + 1] = 4 * g + (b >> 2)
    _gather_column(xt, values[j], ks, yt, j)


# Each kernel comes serial and parallel (one output column per task): a parallel region costs
# tens of microseconds to start, and on a shared machine it waits for a descheduled thread, so
# small products run serially. Two functions, not one compiled twice: numba's on-disk cache
# does not tell the two compilations of one function apart.
@njit(cache=True)
def _matmul_2_4_serial(xt: np.ndarray, values: np.ndarray, meta: np.ndarray,
                       yt: np.ndarray) -> None:
    for j in range(values.shape[0]):
        _column_2_4(xt, values, meta, yt, j)


@njit(parallel=True, cache=True)
def _matmul_2_4_parallel(xt: np.ndarray, values: np.ndarray, meta: np.ndarray,
                         yt: np.ndarray) -> None:
    for j in prange(values.shape[0]):
        _column_2_4(xt, values, meta, yt, j)


def _through_transposes(x: np.ndarray, k: int, k_rows: int, n: int,
                        kernel: Callable[[np.ndarray, np.ndarray], None]) -> np.ndarray:
    """y (..., n) = kernel applied to x^T (k_rows rows, the ones past k zero) giving y^T."""
    x2 = np.ascontiguousarray(x, np.float32).reshape(-1, k)
    xt = np.empty((k_rows, x2.shape[0]), np.float32)
    xt[k:] = 0.0
    _transpose(x2, xt)
    yt = np.empty((n, x2.shape[0]), np.float32)
    kernel(xt, yt)
    y = np.empty((x2.shape[0], n), np.float32)
    _transpose(yt, y)
    return y.reshape(np.shape(x)[:-1] + (n,))


def matmul_2_4(x: np.ndarray, values: np.ndarray, indices: np.ndarray,
               shape: tuple[int, int]) -> np.ndarray:
    """x @ W for W of `shape` (K, N) given as compress_2_4(W, axis=0); x is (..., K)."""
    k, n = shape
    work = values.size * (np.size(x) // k)
    run = _matmul_2_4_parallel if work >= PARALLEL_MIN_WORK else _matmul_2_4_serial
    # K is padded to a multiple of 4: the padding positions point at zero rows of x^T.
    return _through_transposes(x, k, 2 * values.shape[1], n,
                               lambda xt, yt: run(xt, values, indices, yt))


# ---- CSR ---------------------------------------------------------------------------------------

def to_csr(w: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(data float32, indices int32, indptr int32) of a 2-D weight compressed along `axis` (K):
    one CSR row per output column, whose column indices are positions along K. For a (K, N)
    matmul weight these are the arrays of scipy.sparse.csr_matrix(W.T), the (out, in) layout
    of a linear layer's weight that SpMM libraries (cuSPARSE, TVM's sparse_dense) take."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"a CSR weight must be 2-D, got shape {list(w.shape)}")
    rows = np.moveaxis(w, axis, 1)  # (N, K)
    out, ks = np.nonzero(rows)  # row-major order: CSR order
    indptr = np.zeros(rows.shape[0] + 1, np.int32)
    np.cumsum(np.bincount(out, minlength=rows.shape[0]), out=indptr[1:])
    return rows[out, ks].astype(np.float32), ks.astype(np.int32), indptr


@njit(cache=True)
def _spmm_csr_serial(data: np.ndarray, indices: np.ndarray, indptr: np.ndarray,
                     xt: np.ndarray, yt: np.ndarray) -> None:
    for j in range(len(indptr) - 1):
        _gather_column(xt, data[indptr[j]:indptr[j + 1]], indices[indptr[j]:indptr[j + 1]],
                       yt, j)


@njit(parallel=True, cache=True)
def _spmm_csr_parallel(data: np.ndarray, indices: np.ndarray, indptr: np.ndarray,
                       xt: np.ndarray, yt: np.ndarray) -> None:
    for j in prange(len(indptr) - 1):
        _gather_column(xt, data[indptr[j]:indptr[j + 1]], indices[indptr[j]:indptr[j + 1]],
                       yt, j)


def spmm_csr_t(data: np.ndarray, indices: np.ndarray, indptr: np.ndarray,
               xt: np.ndarray) -> np.ndarray:
    """A @ xt for A in CSR (one row per output) and xt (K, M): the CSR @ dense product, as
    scipy's `csr_matrix @ ndarray` computes it; returns (N, M) float32."""
    xt = np.ascontiguousarray(xt, np.float32)
    yt = np.empty((len(indptr) - 1, xt.shape[1]), np.float32)
    run = _spmm_csr_parallel if len(data) * xt.shape[1] >= PARALLEL_MIN_WORK else _spmm_csr_serial
    run(data, indices, indptr, xt, yt)
    return yt


def spmm_csr(x: np.ndarray, data: np.ndarray, indices: np.ndarray, indptr: np.ndarray,
             n: int) -> np.ndarray:
    """x @ W for W (K, N) given as to_csr(W) (n = N, one CSR row per output); x is (..., K)."""
    if n != len(indptr) - 1:
        raise ValueError(f"the CSR weight has {len(indptr) - 1} outputs, not {n}")
    k = np.shape(x)[-1]
    work = len(data) * (np.size(x) // k)
    run = _spmm_csr_parallel if work >= PARALLEL_MIN_WORK else _spmm_csr_serial
    return _through_transposes(x, k, k, n,
                               lambda xt, yt: run(data, indices, indptr, xt, yt))


# ---- the executor's entry point ------------------------------------------------------------------

class _Compressed:
    """A sparse kernel on one weight: compresses W on first use and again only if another array
    arrives (the executor hands over the same constant array on every run)."""

    def __init__(self, kernel: str, shape: tuple[int, int]):
        self.kernel, self.shape = kernel, shape
        self.source: np.ndarray | None = None
        self.parts: tuple[np.ndarray, ...] = ()

    def __call__(self, xs: list[np.ndarray]) -> np.ndarray:
        x, w = xs
        if w is not self.source:
            self.parts = compress(self.kernel, w)
            self.source = w
        return multiply(self.kernel, x, self.parts, self.shape)


def compress(kernel: str, w: np.ndarray) -> tuple[np.ndarray, ...]:
    """The stored form of W (K, N) for `kernel` (the one-time conversion)."""
    if kernel == CSR:
        return to_csr(w)
    if kernel == SPARSE_1_2 and not has_pattern(w, "1:2", 0):
        raise ValueError("the weight does not have the 1:2 pattern along K")
    return compress_2_4(w, axis=0)


def multiply(kernel: str, x: np.ndarray, parts: tuple[np.ndarray, ...],
             shape: tuple[int, int]) -> np.ndarray:
    """x @ W with W (K, N) = `shape` in its stored form `parts` (from `compress`)."""
    if kernel == CSR:
        return spmm_csr(x, *parts, n=shape[1])
    return matmul_2_4(x, *parts, shape=shape)


def sparse_runner(kernel: str, x_type: TensorType, w_type: TensorType,
                  out_type: TensorType) -> Callable[[list[np.ndarray]], np.ndarray] | None:
    """A function of the operand values [x, W] (W dense, zeros included) that returns x @ W
    in float32 computed by `kernel`, or None where this backend has no such kernel (an
    integer or f64 operand, a weight that is not 2-D, a dense kernel): run those densely.
    The result is unrounded; the caller rounds it to `out_type`'s element type."""
    if (kernel not in SPARSE_KERNELS or w_type.rank != 2 or x_type.rank < 1
            or x_type.elem not in ROUNDING_FORMATS or w_type.elem not in ROUNDING_FORMATS
            or not FORMATS[out_type.elem].is_float):
        return None
    return _Compressed(kernel, (w_type.shape[0], w_type.shape[1]))
