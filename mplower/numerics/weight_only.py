"""Weight-only quantization algorithms: round-to-nearest, GPTQ and AWQ, one layer at a time.

Every function here takes one layer's weight `w` of shape (K, N) (the `x @ W` layout: K the
reduction axis, N the output columns) and the statistics of its input X (rows of K values) over
a calibration set, and returns the integers, scales and zero points of a group-wise grid:
`q` (K, N) int8, `scale` (K/group, N) float32 and `zero` (K/group, N) int8, so that the weight
the plan computes with is ONNX's blocked DequantizeLinear (axis 0, block_size = group):
(q - zero) * scale in float32. `group` 0 (or K) means one group per column. The grid of `bits`
bits: symmetric, scale = max|w| / (2^(bits-1) - 1) and zero 0 (mplower's round-to-nearest
grid); asymmetric, scale = (max - min) / (2^bits - 1) over [min(w, 0), max(w, 0)] and zero the
rounded -min / scale shifted into the signed range, so the integers stay in
[-2^(bits-1), 2^(bits-1) - 1] (i4/i8 storage). A value is quantized as ONNX QuantizeLinear
does: clamp(round_half_even(w / scale) + zero).

`LayerStats` is what the algorithms read from the calibration data: H = sum 2 X^T X (the
Hessian of the layer's squared reconstruction error, GPTQ's), sum |x| per input channel
(AWQ's activation scale) and the row count. All three are sums over samples, so they shard and
merge: a batch's contribution is computed in a fixed order (mplower's, never the BLAS
library's), and `merge` adds another's sums, so the statistics are bit-identical for any
thread count or BLAS, and for any sharding whose partial sums are merged in batch order. The
reconstruction error ||X W - X W_hat||^2 = tr(D^T (H/2) D) with D = W - W_hat is computed from H
alone, exactly what the per-row error would sum to, without keeping X.

GPTQ (Frantar et al. 2022, arXiv 2210.17323, Algorithm 1): damping `damp` times the mean of
diag(H) on the diagonal; the upper Cholesky factor of H^-1; columns quantized in order (by
decreasing diag(H) with `act_order`), each column's error spread over the columns not yet
quantized through that factor's row, with the updates to columns beyond the current block of
`block` columns applied lazily, once per block. Group scales are taken when a group's first
column comes up, from the group's columns as updated so far; blocks are aligned to groups so
that a group never straddles a lazy update (the reference implementation instead reads a
group that starts inside a block before that block's own updates). With `act_order` the groups
are static: the scales of each group of consecutive original columns are fixed from the
unquantized weight before any update (the reference implementation's `static_groups`), so the
integers keep the plain blocked layout and no g_idx permutation is needed at run time.

AWQ (Lin et al. 2023, arXiv 2306.00978, section 3.2): per-input-channel scales
s = mean|x|^alpha, normalized by sqrt(max(s) min(s)), alpha searched on a grid of `grid` values
in [0, 1); the weight scaled by s is quantized and the error of (x / s) @ Q(s W) against x @ W
measured on the calibration statistics; then, optionally, a clipping search per output column
and group: the group's range shrunk to (1 - i/grid) of its maximum, i < grid/2, keeping the
shrink with the least error on that group's share of the output (as llm-awq's auto_clip). The
caller divides the layer's input by s (folded into the preceding op where it can be).

Arithmetic: float64 throughout, with every sum in a fixed order (numba loops below), so results
are the same on every machine. Division by a column's scale uses the float32 scale, as the
executor's dequantize multiplies by it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def _k():
    """The fixed-order kernels (numba), loaded on first use so that importing this module
    does not load numba."""
    from mplower.numerics import weight_only_kernels
    return weight_only_kernels


def matmul_fixed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b in float64 with each sum in order: the same bits on any machine."""
    out = np.zeros((a.shape[0], b.shape[1]))
    _k().matmul_acc(np.ascontiguousarray(a, np.float64), np.ascontiguousarray(b, np.float64),
                    out, 1.0)
    return out


def upper_cholesky_of_inverse(h: np.ndarray) -> np.ndarray:
    """U upper-triangular with U^T U = h^-1 (GPTQ's Cholesky form of the inverse Hessian)."""
    k = _k()
    h_inv = k.lower_t_lower(k.inverse_lower(k.cholesky_lower(np.ascontiguousarray(h, np.float64))))
    return np.ascontiguousarray(k.cholesky_lower(h_inv).T)


# ---- statistics ------------------------------------------------------------------------------


@dataclass
class LayerStats:
    """Sums over the calibration rows of one layer's input: H = sum 2 x^T x, sum |x|, rows."""

    hessian: np.ndarray  # (K, K) float64
    abs_sum: np.ndarray  # (K,) float64
    rows: int = 0

    @classmethod
    def zeros(cls, k: int) -> LayerStats:
        return cls(np.zeros((k, k)), np.zeros(k))

    def add(self, x: np.ndarray) -> None:
        """Accumulate the rows of x (..., K): one batch's contribution, in a fixed order."""
        rows = np.ascontiguousarray(np.asarray(x, np.float64).reshape(-1, self.abs_sum.size))
        _k().gram_acc(rows, self.hessian)
        self.abs_sum += _k().column_sums(np.abs(rows))
        self.rows += rows.shape[0]

    def merge(self, other: LayerStats) -> None:
        """Add another shard's sums (merge shards in batch order for bit-identical sums)."""
        self.hessian += other.hessian
        self.abs_sum += other.abs_sum
        self.rows += other.rows

    def mean_abs(self) -> np.ndarray:
        return self.abs_sum / max(self.rows, 1)


def reconstruction_error(w: np.ndarray, w_hat: np.ndarray, hessian: np.ndarray) -> float:
    """||X W - X W_hat|| / ||X W|| over the calibration rows, from H = sum 2 X^T X alone."""
    w = np.asarray(w, np.float64)
    num = _k().quad_error(np.ascontiguousarray(hessian), np.ascontiguousarray(w - w_hat))
    den = _k().quad_error(np.ascontiguousarray(hessian), np.ascontiguousarray(w))
    return float(np.sqrt(max(num, 0.0) / den)) if den > 0 else 0.0


# ---- the grid --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grid:
    """A `bits`-bit integer grid, symmetric or with zero points (module docstring)."""

    bits: int
    sym: bool = True
    lo: int = field(init=False)
    hi: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lo", -(1 << (self.bits - 1)))
        object.__setattr__(self, "hi", (1 << (self.bits - 1)) - 1)

    def params(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Scale (float32) and zero point per column of w (rows: one group's values)."""
        w = np.asarray(w, np.float64)
        if self.sym:
            amax = np.abs(w).max(axis=0)
            scale = _safe(amax / self.hi)
            return scale, np.zeros(scale.shape, np.int64)
        lo, hi = np.minimum(w.min(axis=0), 0.0), np.maximum(w.max(axis=0), 0.0)
        scale = _safe((hi - lo) / (self.hi - self.lo))
        zero = np.clip(np.rint(-lo / scale) + self.lo, self.lo, self.hi).astype(np.int64)
        return scale, zero

    def quantize(self, w: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(w / scale.astype(np.float64)) + zero, self.lo,
                       self.hi).astype(np.int64)

    def dequantize(self, q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
        """(q - zero) * scale in float32, as the executor's dequantize, returned as float64."""
        return ((q - zero).astype(np.float32) * scale.astype(np.float32)).astype(np.float64)


def _safe(scale: np.ndarray) -> np.ndarray:
    """float32 scales, 1 where a group is all zeros (any positive scale represents it)."""
    s = np.asarray(scale, np.float64).astype(np.float32)
    return np.where(s > 0, s, np.float32(1.0)).astype(np.float32)


def group_size(k: int, group: int) -> int:
    """The group length along K: `group`, or K for 0, for a group not below K, or for one that
    does not divide K (per column then, as round-to-nearest does)."""
    return group if 0 < group < k and k % group == 0 else k


def dequantize_grouped(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """The float64 weight the plan computes with: blocked dequantize along K, in float32."""
    g = q.shape[0] // scale.shape[0]
    s = np.repeat(scale, g, axis=0).astype(np.float32)
    z = np.repeat(zero, g, axis=0)
    return ((q.astype(np.int64) - z).astype(np.float32) * s).astype(np.float64)


def _pack(q: np.ndarray, scales: list[np.ndarray], zeros: list[np.ndarray]
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (q.astype(np.int8), np.stack(scales).astype(np.float32),
            np.stack(zeros).astype(np.int8))


def rtn_quantize(w: np.ndarray, *, bits: int, group: int, sym: bool
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round-to-nearest on the group-wise grid: the baseline."""
    w = np.asarray(w, np.float64)
    grid, g = Grid(bits, sym), group_size(w.shape[0], group)
    q = np.empty(w.shape, np.int64)
    scales, zeros = [], []
    for a in range(0, w.shape[0], g):
        s, z = grid.params(w[a:a + g])
        q[a:a + g] = grid.quantize(w[a:a + g], s, z)
        scales.append(s)
        zeros.append(z)
    return _pack(q, scales, zeros)


# ---- GPTQ ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GptqFactor:
    """What GPTQ derives from a layer's Hessian alone: the inputs that never fire, the column
    order, and U (upper Cholesky factor of the damped, permuted H^-1). Layers that read the same
    input (q, k and v; gate and up) share it, so it is factored once for them."""

    dead: np.ndarray  # (K,) bool
    perm: np.ndarray  # (K,) int
    u: np.ndarray  # (K, K)


def gptq_factor(hessian: np.ndarray, *, damp: float = 0.01, act_order: bool = False
                ) -> GptqFactor:
    h = np.array(hessian, np.float64)
    k = h.shape[0]
    dead = np.diag(h) == 0  # inputs that never fire: any weight does, keep it out of H
    h[dead, dead] = 1.0
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    h = h[np.ix_(perm, perm)]
    h[np.diag_indices(k)] += damp * float(np.mean(np.diag(h)))
    return GptqFactor(dead, perm, upper_cholesky_of_inverse(h))


def gptq_quantize(w: np.ndarray, hessian: np.ndarray | None, *, bits: int, group: int,
                  sym: bool, damp: float = 0.01, act_order: bool = False, block: int = 128,
                  factor: GptqFactor | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GPTQ of one layer (module docstring): (q, scale, zero) of w (K, N) given H (K, K), or
    given its `factor` (gptq_factor with the same damp and act_order) in place of H."""
    if factor is None:
        factor = gptq_factor(hessian, damp=damp, act_order=act_order)
    wt = np.array(np.asarray(w, np.float64).T)  # (N, K): the paper's rows x columns
    k = wt.shape[1]
    grid, g = Grid(bits, sym), group_size(k, group)
    wt[:, factor.dead] = 0.0
    static = None
    if act_order:
        static = [grid.params(wt[:, a:a + g].T) for a in range(0, k, g)]
    perm, u = factor.perm, factor.u
    wt = np.ascontiguousarray(wt[:, perm])
    # Blocks aligned to groups (module docstring); the result is the same for any block size
    # but for the order of floating-point sums.
    step = max(block - block % g, g) if g < k else block
    q = np.zeros((wt.shape[0], k), np.int64)
    scale_of, zero_of = [None] * (k // g), [None] * (k // g)
    for i1 in range(0, k, step):
        i2 = min(i1 + step, k)
        errs = np.zeros((wt.shape[0], i2 - i1))
        for i in range(i1, i2):
            col = perm[i]
            grp = col // g
            if static is not None:
                scale_of[grp], zero_of[grp] = static[grp]
            elif col % g == 0:  # without act_order the columns come in order
                scale_of[grp], zero_of[grp] = grid.params(wt[:, i:i + g].T)
            s, z = scale_of[grp], zero_of[grp]
            qi = grid.quantize(wt[:, i], s, z)
            q[:, col] = qi
            err = (wt[:, i] - grid.dequantize(qi, s, z)) / u[i, i]
            # The column's error spread over the rest of the block now ...
            wt[:, i + 1:i2] -= np.outer(err, u[i, i + 1:i2])
            errs[:, i - i1] = err
        # ... and over the columns after the block once, lazily.
        if i2 < k:
            tail = np.ascontiguousarray(wt[:, i2:])
            _k().matmul_acc(errs, np.ascontiguousarray(u[i1:i2, i2:]), tail, -1.0)
            wt[:, i2:] = tail
    return _pack(q.T, scale_of, zero_of)


# ---- AWQ -------------------------------------------------------------------------------------


def awq_scales(mean_abs: np.ndarray, alpha: float) -> np.ndarray:
    """s = mean|x|^alpha (at least 1e-4), normalized by sqrt(max(s) min(s)) (llm-awq)."""
    s = np.maximum(np.asarray(mean_abs, np.float64), 1e-4) ** alpha
    return s / np.sqrt(s.max() * s.min())


def awq_quantize(w: np.ndarray, stats: LayerStats, *, bits: int, group: int, sym: bool,
                 grid: int = 20, clip: bool = True
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """AWQ of one layer (module docstring): (q, scale, zero, s) where q, scale, zero quantize
    s[:, None] * w and the layer's input is to be divided by s (float32)."""
    w = np.asarray(w, np.float64)
    h = np.ascontiguousarray(stats.hessian)
    best: tuple[float, np.ndarray] | None = None
    for i in range(grid):
        s = awq_scales(stats.mean_abs(), i / grid).astype(np.float32).astype(np.float64)
        q, sc, z = rtn_quantize(w * s[:, None], bits=bits, group=group, sym=sym)
        err = _k().quad_error(h, np.ascontiguousarray(w - dequantize_grouped(q, sc, z)
                                                      / s[:, None]))
        if best is None or err < best[0]:
            best = (err, s)
    s = best[1]
    ws = w * s[:, None]
    if clip:
        q, sc, z = clip_search(ws, h / (s[:, None] * s[None, :]), bits=bits, group=group,
                               sym=sym, grid=grid)
    else:
        q, sc, z = rtn_quantize(ws, bits=bits, group=group, sym=sym)
    return q, sc, z, s.astype(np.float32)


def clip_search(w: np.ndarray, hessian: np.ndarray, *, bits: int, group: int, sym: bool,
                grid: int = 20) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group and output column, the clipping range max|w| (1 - i/grid), i < grid/2, whose
    grid gives the least error on that group's share of the output, x_g @ w_g."""
    k, n = w.shape
    g = group_size(k, group)
    qgrid = Grid(bits, sym)
    q = np.empty(w.shape, np.int64)
    scales, zeros = [], []
    for a in range(0, k, g):
        wg = w[a:a + g]
        hg = np.ascontiguousarray(hessian[a:a + g, a:a + g])
        amax = np.abs(wg).max(axis=0)
        best_err = np.full(n, np.inf)
        best_q = np.zeros(wg.shape, np.int64)
        best_s, best_z = np.ones(n, np.float32), np.zeros(n, np.int64)
        for i in range(grid // 2):
            m = amax * (1 - i / grid)
            cur = np.clip(wg, -m, m)
            s, z = qgrid.params(cur)
            qi = qgrid.quantize(cur, s, z)
            d = np.ascontiguousarray(wg - qgrid.dequantize(qi, s, z))
            hd = np.zeros_like(d)
            _k().matmul_acc(hg, d, hd, 1.0)
            err = _k().column_sums(np.ascontiguousarray(d * hd))
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_q[:, better] = qi[:, better]
            best_s = np.where(better, s, best_s)
            best_z = np.where(better, z, best_z)
        q[a:a + g] = best_q
        scales.append(best_s)
        zeros.append(best_z)
    return _pack(q, scales, zeros)
