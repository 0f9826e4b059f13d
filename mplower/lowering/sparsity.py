"""Sparsity patterns of weights: pruning, checking, and what a sparse weight costs to store and run.

One place for the facts that `sparsify`, `lower-sparse`, the CPU kernels and the report share:
which axis of a weight is its reduction axis (the axis structured patterns group along), how
N:M and magnitude pruning choose what to keep (largest magnitudes, the lower index on ties),
whether a tensor has a pattern, how many bytes a weight takes in each kernel's storage format
(values plus metadata: 2-bit indices for 2:4 and 1:2, int32 column indices and row pointers for
CSR), and the roofline time of a contraction whose weight is stored that way
(mplower.lowering.target.Target.op_time). Pure numpy; the numba kernels live in mplower.backend.sparse.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mplower.dialect.mp import WEIGHT_OPERAND
from mplower.dialect.plan import result_format
from mplower.ir.types import TensorType
from mplower.lowering.target import CSR, DENSE, SPARSE_1_2, SPARSE_2_4, Target
from mplower.numerics.formats import FORMATS

# Structured patterns as (kept, group size): NVIDIA's sparse tensor cores keep 2 of every 4
# consecutive values along the reduction axis for 8/16-bit inputs and 1 of every 2 for tf32.
PATTERNS: dict[str, tuple[int, int]] = {"2:4": (2, 4), "1:2": (1, 2)}
KERNEL_PATTERN = {SPARSE_2_4: "2:4", SPARSE_1_2: "1:2"}  # structured kernel -> pattern
ENCODING_OF_KERNEL = {SPARSE_2_4: "2:4", SPARSE_1_2: "1:2", CSR: "csr"}  # kernel -> encoding
# Metadata of the structured formats: a 2-bit position per kept value (two per group of four),
# the layout of the sparse tensor cores' metadata operand; cuSPARSELt stores tf32's 1:2 in the
# same 4-bits-per-4-values layout, with the kept value's position given as a pair.
STRUCTURED_INDEX_BITS = 2
CSR_INDEX_BYTES = 4  # int32 column indices and row pointers, as cuSPARSE and scipy use


def reduction_axis(op: str, rank: int) -> int:
    """The axis of a weight that the op sums over: K of a matmul's (..., K, N) second operand,
    the input channel of a conv2d's OIHW weight (TensorRT and cuSPARSELt prune convolutions
    along input channels, for each output channel and kernel position)."""
    if op == "mp.conv2d":
        return 1
    return rank - 2


def _groups(w: np.ndarray, m: int, axis: int) -> np.ndarray:
    """`w` with `axis` moved last, zero-padded to a multiple of `m` and split into groups of `m`."""
    a = np.moveaxis(np.asarray(w), axis, -1)
    pad = (-a.shape[-1]) % m
    if pad:
        a = np.concatenate([a, np.zeros(a.shape[:-1] + (pad,), a.dtype)], axis=-1)
    return a.reshape(a.shape[:-1] + (a.shape[-1] // m, m))


def prune_structured(w: np.ndarray, pattern: str, axis: int) -> np.ndarray:
    """Keep the n largest magnitudes of every group of m consecutive values along `axis`
    (the lower index on ties) and zero the rest. A trailing partial group is treated as if
    padded with zeros."""
    n, m = PATTERNS[pattern]
    w = np.asarray(w)
    g = _groups(w, m, axis)
    # A stable sort of descending magnitude puts the lower index first among equal magnitudes.
    order = np.argsort(-np.abs(g.astype(np.float64)), axis=-1, kind="stable")
    keep = np.zeros(g.shape, dtype=bool)
    np.put_along_axis(keep, order[..., :n], True, axis=-1)
    pruned = np.where(keep, g, np.zeros((), w.dtype))
    k = w.shape[axis]
    flat = pruned.reshape(pruned.shape[:-2] + (-1,))[..., :k]
    return np.ascontiguousarray(np.moveaxis(flat, -1, axis))


def prune_magnitude(w: np.ndarray, sparsity: float) -> np.ndarray:
    """Zero the `round(sparsity * size)` smallest magnitudes of `w` (unstructured magnitude
    pruning); among equal magnitudes the higher index goes first, so the lower one is kept."""
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity}")
    w = np.asarray(w)
    flat = w.reshape(-1)
    count = round(sparsity * flat.size)
    order = np.lexsort((-np.arange(flat.size), np.abs(flat.astype(np.float64))))
    out = flat.copy()
    out[order[:count]] = 0
    return out.reshape(w.shape)


def has_pattern(w: np.ndarray, pattern: str, axis: int) -> bool:
    """Whether every group of m along `axis` holds at most n non-zeros (NaN counts as one)."""
    n, m = PATTERNS[pattern]
    if w.ndim == 0:
        return False
    return bool(np.all(np.count_nonzero(_groups(w, m, axis), axis=-1) <= n))


def patterns_of(w: np.ndarray, axis: int) -> frozenset[str]:
    """The structured patterns `w` has along `axis` (a 1:2 tensor also has 2:4)."""
    return frozenset(p for p in PATTERNS if has_pattern(w, p, axis))


def sparsity(w: np.ndarray) -> float:
    """The fraction of zeros."""
    return 1.0 - np.count_nonzero(w) / w.size if w.size else 0.0


def stored_bits(elem: str) -> int:
    """Bits one value occupies in memory: tf32 travels in 32-bit words."""
    return 32 if elem == "tf32" else FORMATS[elem].bits


@dataclass(frozen=True)
class Storage:
    """What a 2-D (K, N) weight occupies in a kernel's format, in bytes."""

    values: int
    metadata: int

    @property
    def total(self) -> int:
        return self.values + self.metadata

    @property
    def overhead(self) -> float:
        """Metadata bytes per value byte."""
        return self.metadata / self.values if self.values else 0.0


def storage(kernel: str, k: int, cols: int, elem: str, nnz: int | None = None) -> Storage:
    """Bytes of a weight with `k` values along its reduction axis and `cols` such lines
    (N of a (K, N) matmul weight), stored for `kernel` in `elem`.

    Structured formats keep n of every m values along K (K padded to a multiple of m), plus
    2 bits of position per kept value; CSR keeps the `nnz` non-zeros with an int32 column index
    each and K + 1 int32 row pointers.
    """
    bits = stored_bits(elem)
    if kernel == DENSE:
        return Storage((k * cols * bits + 7) // 8, 0)
    if kernel in KERNEL_PATTERN:
        n, m = PATTERNS[KERNEL_PATTERN[kernel]]
        kept = -(-k // m) * n * cols
        return Storage((kept * bits + 7) // 8, (kept * STRUCTURED_INDEX_BITS + 7) // 8)
    if kernel == CSR:
        if nnz is None:
            raise ValueError("the CSR storage of a weight depends on its non-zero count")
        return Storage((nnz * bits + 7) // 8, CSR_INDEX_BYTES * (nnz + k + 1))
    raise ValueError(f"unknown kernel '{kernel}'")


def contraction_time(target: Target, compute: str, kernel: str, flops: int, moved_bytes: int,
                     k: int, cols: int, nnz: int) -> float:
    """Roofline time of a matmul/conv whose weight is stored for `kernel` in `compute`.

    `flops` is the dense count and `moved_bytes` what the op reads and writes besides the
    weight (`other_bytes`). Structured kernels run at their dense-equivalent peak; CSR does
    the work of the stored non-zeros only (Target.op_time's convention).
    """
    size = k * cols
    work = flops if kernel != CSR else (flops * nnz // size if size else 0)
    nbytes = moved_bytes + storage(kernel, k, cols, compute, nnz).total
    return target.op_time(work, nbytes, compute, kernel)


def other_bytes(op: str, ins: list[TensorType], outs: list[TensorType], compute: str,
                accum: str | None) -> int:
    """What a contraction reads and writes besides its weight, with its float operands in the
    compute format and its results in the format the plan writes (mplower.dialect.plan.result_format)."""
    out_elem = result_format(op, compute, accum)

    def nbytes(t: TensorType, elem: str) -> int:
        return (t.size * stored_bits(elem if FORMATS[t.elem].is_float else t.elem) + 7) // 8

    return (sum(nbytes(t, compute) for i, t in enumerate(ins) if i != WEIGHT_OPERAND)
            + sum(nbytes(t, out_elem) for t in outs))
