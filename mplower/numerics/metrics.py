"""How far a value is from its reference: rel-L2, SQNR and max-abs, written once.

The executor measures each op's drift with `drift`, the run report the outputs' (docs/report.md,
"Non-finite values"), and the quant report the error of each converted operand with `sqnr_db` and
`channel_sqnr_db`. Everything is computed in float64. These sit in numerics, below the backend
and the report, because both of them measure with them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Drift:
    """How far a result is from its fp32 reference (see `drift`)."""

    rel_l2: float
    sqnr_db: float
    max_abs: float
    nonfinite_mismatch: int


def finite_or_none(x: float | None) -> float | None:
    """A figure as the JSON reports write it: a non-finite one (inf drift, -inf SQNR) is null,
    since JSON has no NaN or Infinity (docs/report.md)."""
    return x if x is not None and math.isfinite(x) else None


def sqnr_from(signal: float, noise: float) -> float:
    """10 log10(signal / noise): inf where nothing was lost, -inf where there was no signal."""
    if noise == 0:
        return math.inf
    return float(10 * np.log10(signal / noise)) if signal > 0 else -math.inf


def _same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether `a` and `b` are views of the same memory, element for element."""
    return (a.dtype == b.dtype and a.shape == b.shape and a.strides == b.strides
            and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


def drift(y: np.ndarray, ref: np.ndarray) -> Drift:
    """rel_l2 = ||y - ref|| / ||ref||, SQNR and max |y - ref| in float64, over the positions
    where both are finite; a position where the two are the same non-finite value (the -inf
    of an attention mask in both) takes no part. Any other position with a non-finite value
    (finite in one and not the other, -inf against NaN, ...) is a non-finite mismatch: it is
    counted, and the drift is infinite (rel_l2 = max_abs = inf, SQNR = -inf).

    The executor takes drift at every op of the full report, so its float64 work goes block
    by block (`BLOCK` elements at a time) instead of as whole-tensor copies: three float64
    copies of a 64x2048x257 one-hot were 0.8 GB, most of magika's report peak. The sums are
    numpy's own, in its order (`_numpy_sum`): the figures are the bits that whole-array
    float64 arithmetic gives."""
    if y.size == 0:
        return Drift(0.0, math.inf, 0.0, 0)
    if _same_values(y, ref):  # an f32 weight against itself: what the steps below give, free
        return Drift(0.0, math.inf, 0.0, 0)
    # The order of the passes over all elements (finite?, mismatches, max) does not matter:
    # they go in y's memory order, a contiguous walk where y is a view of a whole tensor.
    y_order = _memory_order(y)
    finite, mismatch = True, 0
    for ys, rs in _blocks(y, ref, y_order):
        with np.errstate(invalid="ignore"):  # inf - inf: a NaN that is looked at below
            d = ys.astype(np.float64) - rs.astype(np.float64)
        if np.all(np.isfinite(d)):  # one pass for the common all-finite case
            continue
        finite = False
        y64, r64 = ys.astype(np.float64), rs.astype(np.float64)
        same = (y64 == r64) | (np.isnan(y64) & np.isnan(r64))
        mismatch += int(np.count_nonzero(~np.isfinite(d) & ~same))
    if mismatch:
        return Drift(math.inf, -math.inf, math.inf, mismatch)
    if finite:
        # Whole-array float64 copies keep each operand's memory order (astype's order "K"),
        # and numpy sums them in that order: ||ref||^2 in ref's, ||y - ref||^2 in y's.
        signal = _numpy_sum(ref.size, _squares(ref, ref, _memory_order(ref), False))
        noise_parts = _squares(y, ref, y_order, True)
        max_abs = 0.0
        for ys, rs in _blocks(y, ref, y_order):
            max_abs = max(max_abs, float(np.max(np.abs(ys.astype(np.float64)
                                                        - rs.astype(np.float64)))))
        noise = _numpy_sum(y.size, noise_parts)
    else:
        # Boolean indexing keeps the finite positions in C order, whatever the layout.
        kept = _finite_positions(y, ref)
        n = int(kept[-1]) if len(kept) else 0
        signal = _numpy_sum(n, _kept_squares(y, ref, kept, False))
        noise = _numpy_sum(n, _kept_squares(y, ref, kept, True))
        max_abs = 0.0
        for ys, rs in _blocks(y, ref, y_order):
            with np.errstate(invalid="ignore"):
                d = ys.astype(np.float64) - rs.astype(np.float64)
            d = d[np.isfinite(d)]
            if d.size:
                max_abs = max(max_abs, float(np.max(np.abs(d))))
    rel = float(np.sqrt(noise / signal)) if signal > 0 else (0.0 if noise == 0 else math.inf)
    return Drift(rel, sqnr_from(signal, noise), max_abs, mismatch)


# Elements of one block of drift's float64 work: 2 MiB a temporary.
BLOCK = 1 << 18
_PAIRWISE_LEAF = 128  # numpy's PW_BLOCKSIZE: below it, its pairwise sum is one unrolled loop


def _numpy_sum(n: int, part: Callable[[int, int], np.ndarray]) -> float:
    """np.sum of n float64 values, the values of [a, b) from part(a, b), bit for bit.

    numpy adds a contiguous float64 array with one pairwise sum over all of it (0 + the
    pairwise sum, its loops_utils.h): an array over 128 elements is split at n2 = n / 2 less
    n2 % 8 and the halves' sums are added. Each half is the same function of its own length,
    so the split is followed here down to halves of at most BLOCK elements, which numpy sums
    itself, and the halves' sums are added in numpy's order."""
    return _pairwise(part, 0, n) if n else 0.0


def _pairwise(part: Callable[[int, int], np.ndarray], a: int, m: int) -> float:
    # A module function, not a closure that calls itself: such a closure is a reference cycle
    # that would hold `part`'s tensors until the garbage collector runs.
    if m <= max(BLOCK, _PAIRWISE_LEAF):
        return float(np.sum(part(a, a + m)))
    half = m // 2
    half -= half % 8
    return _pairwise(part, a, half) + _pairwise(part, a + half, m - half)


def _squares(y: np.ndarray, ref: np.ndarray, order: tuple[int, ...] | None,
             difference: bool) -> Callable[[int, int], np.ndarray]:
    """part(a, b) for `_numpy_sum`: ref^2, or (y - ref)^2, at the elements a..b of the
    traversal that visits the axes in `order` (None: C order)."""
    yv, rv = (y, ref) if order is None else (y.transpose(order), ref.transpose(order))

    def part(a: int, b: int) -> np.ndarray:
        r = _flat(rv, a, b).astype(np.float64)
        if difference:
            r = _flat(yv, a, b).astype(np.float64) - r
        r *= r
        return r
    return part


def _flat(x: np.ndarray, a: int, b: int) -> np.ndarray:
    """Elements a..b of x in C order, copying only those."""
    return x.reshape(-1)[a:b] if x.flags.c_contiguous else x.flat[a:b]


def _memory_order(x: np.ndarray) -> tuple[int, ...]:
    """The axes, outermost first, of x.astype(np.float64)'s memory: numpy lays the copy out
    as x is laid out (order "K": axes by decreasing |stride|, ties in axis order)."""
    return tuple(sorted(range(x.ndim), key=lambda a: -abs(x.strides[a])))


def _blocks(y: np.ndarray, ref: np.ndarray, order: tuple[int, ...] | None
            ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(y, ref) BLOCK elements at a time, visiting the axes in `order` (None: C order)."""
    yv, rv = (y, ref) if order is None else (y.transpose(order), ref.transpose(order))
    for a in range(0, y.size, BLOCK):
        yield _flat(yv, a, a + BLOCK), _flat(rv, a, a + BLOCK)


def _finite_positions(y: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Cumulative count of the finite differences up to the end of each block (C order)."""
    counts = [0]
    for ys, rs in _blocks(y, ref, None):
        with np.errstate(invalid="ignore"):
            d = ys.astype(np.float64) - rs.astype(np.float64)
        counts.append(counts[-1] + int(np.count_nonzero(np.isfinite(d))))
    return np.asarray(counts, dtype=np.int64)


def _kept_squares(y: np.ndarray, ref: np.ndarray, kept: np.ndarray,
                  difference: bool) -> Callable[[int, int], np.ndarray]:
    """part(a, b) over the finite differences only (numbered in C order), as r[keep] and
    diff[keep] hold them."""
    def part(a: int, b: int) -> np.ndarray:
        out = []
        first = int(np.searchsorted(kept, a, side="right")) - 1
        for k in range(first, len(kept) - 1):
            if kept[k] >= b:
                break
            ys, rs = _flat(y, k * BLOCK, (k + 1) * BLOCK), _flat(ref, k * BLOCK, (k + 1) * BLOCK)
            r = rs.astype(np.float64)
            with np.errstate(invalid="ignore"):
                d = ys.astype(np.float64) - r
            keep = np.isfinite(d)
            v = d[keep] if difference else r[keep]
            lo, hi = max(a - kept[k], 0), min(b - kept[k], len(v))
            out.append(v[lo:hi])
        v = np.concatenate(out) if out else np.zeros(0)
        v *= v
        return v
    return part


def allclose_ratio(y: np.ndarray, ref: np.ndarray, rtol: float, atol: float) -> float:
    """The worst |y - ref| / (atol + rtol |ref|) over all elements, in float64: `y` meets
    numpy.allclose(y, ref, rtol, atol) exactly when this is at most 1, and the figure says by
    how much it passes or fails. As numpy's, an element where both are the same infinity is
    exact and NaN is never close; where the tolerance is 0 (atol = 0, ref = 0) only an exact
    element passes. A non-finite ratio is inf."""
    r = np.asarray(ref, np.float64).ravel()
    y64 = np.asarray(y, np.float64).ravel()
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.abs(y64 - r) / (atol + rtol * np.abs(r))
    ratio[y64 == r] = 0.0  # equal infinities, and 0/0 where the tolerance is 0
    if not ratio.size:
        return 0.0
    worst = float(np.max(ratio))  # NaN propagates: a NaN element fails
    return worst if math.isfinite(worst) else math.inf


def sqnr_db(y: np.ndarray | None, ref: np.ndarray | None) -> float | None:
    """10 log10(|ref|^2 / |y - ref|^2) of a converted value against its float original; None
    where the two are not comparable. Unlike `drift`, any non-finite difference is -inf: a
    conversion that produced inf or NaN lost everything, mask or not."""
    if y is None or ref is None or np.shape(y) != np.shape(ref):
        return None
    r = np.asarray(ref, np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf is NaN: not finite, -inf below
        d = np.asarray(y, np.float64) - r
    if not np.all(np.isfinite(d)):
        return -math.inf
    return sqnr_from(float(np.sum(r * r)), float(np.sum(d * d)))


def channel_sqnr_db(y: np.ndarray | None, ref: np.ndarray | None, axis: int) -> float | None:
    """The lowest `sqnr_db` over the channels along `axis` (channels without signal are
    skipped): a tensor-wide figure hides channels that a shared scale wiped out under one
    large one."""
    if y is None or ref is None or np.shape(y) != np.shape(ref) or np.ndim(ref) == 0:
        return None
    r = np.moveaxis(np.asarray(ref, np.float64), axis, 0).reshape(np.shape(ref)[axis], -1)
    with np.errstate(invalid="ignore"):  # inf - inf is NaN: not finite, -inf below
        d = np.moveaxis(np.asarray(y, np.float64), axis, 0).reshape(r.shape) - r
    if not np.all(np.isfinite(d)):
        return -math.inf
    signal, noise = np.sum(r * r, axis=1), np.sum(d * d, axis=1)
    keep = signal > 0
    if not np.any(keep):
        return None
    with np.errstate(divide="ignore"):
        per = 10 * np.log10(signal[keep] / noise[keep])
    return float(per.min())
