"""CPU kernels for sparse weights (2:4 compressed matmul, CSR SpMM) and the sparse reality check.

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

`sparse_runner` is what the executor calls for an op lowered to a sparse kernel;
`reality_check` puts the numbers of one such op side by side (nominal sparsity, metadata,
modeled speedup on the target, measured speedup of these kernels against dense BLAS here,
conversion time), `sparse_report` does so for every op lower-sparse decided in a function,
with the dense fallbacks and their reason codes, and `sparse_lines` renders that section under
a report's table (`mplower report`, and the run report).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from numba import njit, prange

from mplower.dialect.mp import OPS, check_attrs
from mplower.dialect.plan import Plan
from mplower.io.npz import WeightStore
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import Function, Module
from mplower.ir.types import DenseAttr, TensorType
from mplower.lowering.sparsity import (
    WEIGHT_OPERAND,
    contraction_time,
    has_pattern,
    other_bytes,
    reduction_axis,
    sparsity,
    storage,
)
from mplower.lowering.target import CSR, DENSE, NO_SPARSE_KERNEL, SPARSE_1_2, SPARSE_2_4, Target
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


# ---- the reality check -----------------------------------------------------------------------

@dataclass(frozen=True)
class RealityCheck:
    """One sparse op's numbers: what the format promises, costs and delivers."""

    kernel: str
    nominal_sparsity: float  # fraction of zeros in the weight
    value_bytes: int  # stored values, in the compute format
    metadata_bytes: int  # 2-bit positions, or CSR column indices and row pointers
    dense_bytes: int  # the weight stored densely in the compute format
    metadata_overhead: float  # metadata bytes per value byte
    modeled_dense_s: float
    modeled_sparse_s: float
    modeled_speedup: float  # modeled dense time / sparse time on the target
    measured_dense_s: float | None  # numpy (BLAS) x @ W on this machine, median
    measured_sparse_s: float | None  # this module's kernel, median
    measured_speedup: float | None
    conversion_s: float | None  # compressing W once (compress_2_4 / to_csr)

    def as_dict(self) -> dict:
        return asdict(self)


def median_time(fn: Callable[[], object], reps: int = 5, budget_s: float = 0.5) -> float:
    """Median wall time of `fn` after one warm-up call; fewer reps if they exceed `budget_s`."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def reality_check(kernel: str, w: np.ndarray, rows: int, compute: str, target: Target,
                  flops: int, moved_bytes: int, measure: bool = True,
                  seed: int = 0) -> RealityCheck:
    """The numbers of a matmul x (rows, K) @ W (K, N) lowered to `kernel` in `compute`.

    `flops` and `moved_bytes` (what the op reads and writes besides W) come from the IR and feed
    the target's cost model for both the dense and the sparse kernel. With `measure`, x is
    random and both this module's kernel and numpy's BLAS matmul run on the same float32 values.
    """
    k = w.shape[0]
    cols = w.size // k if k else 0
    nnz = int(np.count_nonzero(w))
    stored = storage(kernel, k, cols, compute, nnz)
    dense = storage(DENSE, k, cols, compute)
    dense_s = contraction_time(target, compute, DENSE, flops, moved_bytes, k, cols, nnz)
    sparse_s = contraction_time(target, compute, kernel, flops, moved_bytes, k, cols, nnz)
    measured = (None, None, None)
    if measure and w.ndim == 2:
        w32 = np.ascontiguousarray(w, np.float32)
        x = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
        conversion = median_time(lambda: compress(kernel, w32), reps=3)
        parts = compress(kernel, w32)
        dense_t = median_time(lambda: np.matmul(x, w32))
        sparse_t = median_time(lambda: multiply(kernel, x, parts, (k, cols)))
        measured = (dense_t, sparse_t, conversion)
    dense_t, sparse_t, conversion = measured
    return RealityCheck(
        kernel=kernel, nominal_sparsity=sparsity(w), value_bytes=stored.values,
        metadata_bytes=stored.metadata, dense_bytes=dense.total,
        metadata_overhead=stored.overhead, modeled_dense_s=dense_s, modeled_sparse_s=sparse_s,
        modeled_speedup=dense_s / sparse_s, measured_dense_s=dense_t,
        measured_sparse_s=sparse_t,
        measured_speedup=dense_t / sparse_t if dense_t is not None and sparse_t else None,
        conversion_s=conversion)


def sparse_report(module: Module, target: Target, func: str | None = None,
                  weights: str | None = None, measure: bool = True) -> dict[str, Any] | None:
    """The sparse reality check of a function: every matmul/conv2d that lower-sparse decided
    (`mp.kernel`, `mp.sparse_reason`) or legalize moved off a sparse kernel, with the numbers of
    `reality_check` for those on a sparse kernel and the dense fallbacks counted by reason code.
    None when no op was decided. Weights that cannot be read leave an op's numbers out and say
    why in its `note`; only matmuls are measured (this backend has no sparse conv kernel)."""
    f = module.function(func)
    stores: list[WeightStore] = []  # made on first use: a module without sparse ops needs none
    entries = []
    for n in f.ops():
        d = f.data(n)
        attrs = d["attrs"]
        if d["op"] not in ("mp.matmul", "mp.conv2d"):
            continue
        plan = Plan.of(attrs)
        kernel, reason = plan.kernel_or_dense, plan.sparse_reason
        if kernel == DENSE and reason is None:
            if NO_SPARSE_KERNEL not in plan.fallback:
                continue
            reason = NO_SPARSE_KERNEL  # legalize moved it off a sparse kernel
        entry: dict[str, Any] = {"name": f.value_name((n, 0)), "op": d["op"], "kernel": kernel,
                                 "reason": reason}
        if kernel != DENSE:
            entry.update(_op_check(f, n, kernel, module, weights, stores, target, measure))
        entries.append(entry)
    if not entries:
        return None
    dense = [e for e in entries if e["kernel"] == DENSE]
    return {
        "target": target.name,
        "considered": len(entries),
        "sparse_ops": len(entries) - len(dense),
        "dense_fallbacks": len(dense),
        "fallback_rate": len(dense) / len(entries),
        "kernels": dict(Counter(e["kernel"] for e in entries if e["kernel"] != DENSE)),
        "reasons": dict(Counter(e["reason"] for e in dense)),
        "ops": entries,
    }


def _op_check(f: Function, n: int, kernel: str, module: Module, weights: str | None,
              stores: list[WeightStore], target: Target, measure: bool) -> dict[str, Any]:
    d = f.data(n)
    op, attrs = d["op"], d["attrs"]
    ins, outs = f.operand_types(n), d["types"]
    node = f.operands(n)[WEIGHT_OPERAND][0]
    while f.op(node) in ("mp.sparse_encode", "mp.cast"):
        node = f.operands(node)[0][0]
    src = f.data(node)
    if src["op"] != "mp.constant":
        return {"note": "the weight is not a constant"}
    try:
        if isinstance(src["attrs"].get("value"), DenseAttr):
            w = src["attrs"]["value"].array
        else:
            if not stores:
                stores.append(WeightStore(module, weights))
            w = stores[0].get(src["attrs"]["name"], src["types"][0].shape, src["loc"])
    except DiagnosticError as e:
        return {"note": e.diagnostics[0].message}
    plan = Plan.of(attrs)
    compute, accum = plan.precision or ins[0].elem, plan.accum
    flops = int(OPS[op].flops(ins, outs, check_attrs(OPS[op], attrs)))
    axis = reduction_axis(op, w.ndim)
    w2 = np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)  # (K, everything else)
    rows = math.prod(ins[0].shape[:-1]) if op == "mp.matmul" else 0
    check = reality_check(kernel, w2, rows, compute, target, flops,
                          other_bytes(op, ins, outs, compute, accum),
                          measure=measure and op == "mp.matmul")
    return {"compute": compute, "weight_shape": list(w.shape), **check.as_dict()}


SPARSE_HEADER = ("name", "kernel", "sparsity", "metadata", "modeled", "measured here",
                 "conversion")


def sparse_lines(sparse: dict[str, Any], fmt: str) -> list[str]:
    """`sparse_report`'s section as lines to print under a report's table ("table" or
    "markdown"): a summary with the dense fallbacks by reason code, then one row per sparse op."""
    kernels = ", ".join(f"{k}: {v}" for k, v in sparse["kernels"].items()) or "none"
    reasons = ", ".join(f"{k}: {v}" for k, v in sparse["reasons"].items())
    out = ["", (f"sparse: {sparse['considered']} matmul/conv ops, {sparse['sparse_ops']} on sparse "
                f"kernels ({kernels}), {sparse['dense_fallbacks']} dense "
                f"({sparse['fallback_rate']:.1%})" + (f" - {reasons}" if reasons else ""))]
    rows = [_sparse_cells(e) for e in sparse["ops"] if e["kernel"] != DENSE]
    if not rows:
        return out
    if fmt == "markdown":
        out += ["", "| " + " | ".join(SPARSE_HEADER) + " |", "|" + "---|" * len(SPARSE_HEADER)]
        return out + ["| " + " | ".join(r) + " |" for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(SPARSE_HEADER)]
    out.append("  ".join(h.ljust(w) for h, w in zip(SPARSE_HEADER, widths)).rstrip())
    return out + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _sparse_cells(e: dict[str, Any]) -> list[str]:
    if "modeled_speedup" not in e:
        return [e["name"], e["kernel"], "-", "-", "-", e.get("note", "-"), "-"]
    measured = (f"{e['measured_speedup']:.2f}x ({e['measured_sparse_s'] * 1e6:.1f} us vs "
                f"{e['measured_dense_s'] * 1e6:.1f} us BLAS)"
                if e["measured_speedup"] is not None else "-")
    conversion = f"{e['conversion_s'] * 1e6:.1f} us" if e["conversion_s"] is not None else "-"
    return [e["name"], e["kernel"], f"{e['nominal_sparsity']:.1%}",
            f"{e['metadata_bytes']} B ({e['metadata_overhead']:.1%} of values)",
            f"{e['modeled_speedup']:.4f}x", measured, conversion]
