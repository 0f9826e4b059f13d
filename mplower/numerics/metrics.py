"""How far a value is from its reference: rel-L2, SQNR and max-abs, written once.

The executor measures each op's drift with `drift`, the run report the outputs' (docs/report.md,
"Non-finite values"), and the quant report the error of each converted operand with `sqnr_db` and
`channel_sqnr_db`. Everything is computed in float64. These sit in numerics, below the backend
and the report, because both of them measure with them.
"""

from __future__ import annotations

import math
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
    counted, and the drift is infinite (rel_l2 = max_abs = inf, SQNR = -inf)."""
    if _same_values(y, ref):  # an f32 weight against itself: what the steps below give, free
        return Drift(0.0, math.inf, 0.0, 0)
    # In place where it can be, so that at most two float64 copies are alive (the executor
    # takes drift at every op of the full report: this is its peak memory).
    r = ref.astype(np.float64)
    diff = y.astype(np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf: a NaN that is looked at below
        diff -= r
    mismatch = 0
    if not np.all(np.isfinite(diff)):  # one pass for the common all-finite case
        y64 = y.astype(np.float64)
        same = (y64 == r) | (np.isnan(y64) & np.isnan(r))
        mismatch = int(np.count_nonzero(~np.isfinite(diff) & ~same))
        if mismatch:
            return Drift(math.inf, -math.inf, math.inf, mismatch)
        keep = np.isfinite(diff)
        r, diff = r[keep], diff[keep]
    r *= r
    signal = float(np.sum(r))
    del r
    max_abs = float(np.max(np.abs(diff))) if diff.size else 0.0
    diff *= diff
    noise = float(np.sum(diff))
    rel = float(np.sqrt(noise / signal)) if signal > 0 else (0.0 if noise == 0 else math.inf)
    return Drift(rel, sqnr_from(signal, noise), max_abs, mismatch)


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
