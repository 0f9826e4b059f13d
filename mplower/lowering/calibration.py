"""Calibration statistics: mergeable histograms, range estimators, and where ranges are recorded.

`TensorStats` summarizes every value one tensor took over a calibration set: exact min, max and
per-channel max |x|, a histogram of |x| (negative and non-negative values apart) and a count of
non-zero magnitudes per binary exponent. All of it is integer counts or exact extrema, and the
histogram grid is a power-of-two range [0, 2**exp) split into `bins` (a power of two) equal
bins, where `exp` is the smallest exponent above every |x| seen so far. Widening the range by
one power of two merges neighbouring bins in pairs, and a value's bin at a wider range is
exactly its bin at the narrower one halved (the bin index is |x| scaled by a power of two,
floored: exact in binary floating point). So statistics gathered batch by batch and merged in
any order, or over any split of the same data, are bit-identical to those of a single pass.

The estimators turn a `TensorStats` into the range [lo, hi] that quantization will use:
`minmax` (the observed extremes, as ONNX Runtime's MinMax calibrator), `percentile` (clip |x| at
a percentile of the histogram, as ORT's and ModelOpt's percentile calibrators), `entropy`
(TensorRT's KL-divergence threshold search, Migacz 2017, "8-bit inference with TensorRT") and
`mse` (the clip threshold minimizing the expected quantization error over the histogram, as
ModelOpt's and NNCF's MSE range estimators). Thresholds apply to |x| and the range keeps the
observed sign structure: one-sided data stays one-sided.

Ranges live on the module as attributes of the op that produces the value (`mp.range`,
`mp.calib`, ...); function arguments have no op, so theirs go in the function's `arg_attrs`
(an array of one dictionary per argument, as MLIR's func.func spells argument attributes), and
those of an op with several results (mp.split) in its `mp.result_attrs`, one dictionary per
result. `value_attrs` / `set_value_attrs` hide these differences. Weights are read through
`ConstantValues`, which evaluates the constant-only part of a function with each op's reference
semantics on the arrays of mplower.io.npz.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

import numpy as np

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.dialect.plan import (
    CALIB,
    CHANNEL_ABSMAX,
    NONFINITE,
    OBSERVED,
    RANGE,
    RESULT_ATTRS,
    TINY,
)
from mplower.io.npz import WeightStore
from mplower.ir.graph import ARG, Function, Module, Value
from mplower.ir.opdef import OPS, check_attrs
from mplower.ir.types import DenseAttr, tensor

METHODS = ("minmax", "percentile", "entropy", "mse")
# Attributes a calibration writes (and a new calibration replaces).
CALIB_KEYS = (RANGE, CALIB, OBSERVED, TINY, CHANNEL_ABSMAX, NONFINITE)
ARG_ATTRS = "arg_attrs"

# Binary exponents (np.frexp) of non-zero float32 magnitudes lie in [-148, 129].
_EXP_LO, _EXP_HI = -160, 140
TINY_QUANTILE = 0.01  # mp.tiny: this quantile of the non-zero magnitudes, as a power of two


class TensorStats:
    """Everything calibration keeps about one tensor; `add` and `merge` commute exactly.

    The two sides of zero are kept apart, each binned over its own range: [0, 2**exp_pos) for
    the values >= 0, [0, 2**exp_neg) for |x| of those < 0 (`pos` and `neg` are both at the
    wider of the two), with their frexp exponents and, per channel, the largest and smallest
    value. So the statistics of max(x, 0) follow from those of x exactly (`relu`)."""

    def __init__(self, bins: int = 2048, histogram: bool = True):
        """`histogram=False` leaves the histograms at zero (minmax reads only the extremes and
        the exponents): half the counting work."""
        if bins < 2 or bins & (bins - 1):
            raise ValueError(f"bins must be a power of two >= 2, got {bins}")
        self.bins = bins
        self.histogram = histogram
        self.count = 0
        self.min = math.inf
        self.max = -math.inf
        # Side s (0: x >= 0, 1: x < 0) is binned over magnitudes [0, 2**exps[s]).
        self.side_exp: list[int | None] = [None, None]
        self.hist = np.zeros((2, bins), np.int64)
        self.side_exponents = np.zeros((2, _EXP_HI - _EXP_LO), np.int64)  # by frexp exponent
        self.channel_max: np.ndarray | None = None
        self.channel_min: np.ndarray | None = None
        # Values left out of every statistic above: -inf, +inf and NaN (an attention mask's
        # -inf is intentional; a range is taken over the finite values, and a value holding
        # any of these is kept out of integer formats: mplower.passes.quantize).
        self.nonfinite = np.zeros(3, np.int64)

    @property
    def has_nonfinite(self) -> bool:
        return bool(self.nonfinite.any())

    @property
    def exp(self) -> int | None:
        """The histogram covers magnitudes [0, 2**exp) (None: so far only zeros)."""
        known = [e for e in self.side_exp if e is not None]
        return max(known) if known else None

    @property
    def pos(self) -> np.ndarray:
        """Counts of |x| of x >= 0 over [0, 2**exp)."""
        return self._side(0)

    @property
    def neg(self) -> np.ndarray:
        """Counts of |x| of x < 0 over [0, 2**exp)."""
        return self._side(1)

    @property
    def exponents(self) -> np.ndarray:
        """Non-zero |x| by frexp exponent (from _EXP_LO)."""
        return self.side_exponents.sum(axis=0)

    @property
    def channel_absmax(self) -> np.ndarray | None:
        if self.channel_max is None:
            return None
        return np.maximum(self.channel_max, -self.channel_min) + 0.0  # +0.0: never -0.0

    def _side(self, s: int) -> np.ndarray:
        e, top = self.side_exp[s], self.exp
        return self.hist[s] if e is None or e == top else _rebin(self.hist[s], top - e)

    @property
    def amax(self) -> float:
        return max(abs(self.min), abs(self.max)) if self.count else 0.0

    @property
    def bin_width(self) -> float:
        return math.ldexp(1.0, self.exp) / self.bins if self.exp is not None else 0.0

    def add(self, x: np.ndarray, channel_axis: int | None = None) -> None:
        """Account for one batch of values; `channel_axis` also tracks each channel's extremes
        (the same axis every time)."""
        x = np.asarray(x)
        if x.dtype.kind != "f":
            x = x.astype(np.float64)  # exact for every integer value
        elif x.dtype.itemsize < 4:
            x = x.astype(np.float32)  # exact for every narrow float value
        if x.size == 0:
            return
        # Compiled passes over float32 (the counts of an ldexp/bincount over float64).
        from mplower.numerics.histogram import channel_summary, tensor_counts, tensor_summary

        high = low = None
        # Extrema (per channel too) and exponents in one pass; with a histogram its own pass
        # counts the exponents, after the extrema have set the bins. They go to a scratch
        # array first: a batch with non-finite values is counted again without them.
        exponents = np.zeros_like(self.side_exponents)
        if channel_axis is not None:
            lo, hi, bad, low, high = channel_summary(x, channel_axis, exponents, _EXP_LO)
        elif self.histogram:  # the bins need the range: the extrema first, from numpy
            lo, hi = float(x.min()), float(x.max())
            bad = 0 if math.isfinite(lo) and math.isfinite(hi) else \
                int(np.count_nonzero(~np.isfinite(x)))  # a NaN makes both NaN
        else:
            lo, hi, bad = tensor_summary(x, exponents, _EXP_LO)
        if bad:
            self._add_finite(x, channel_axis)
            return
        if not self.histogram:
            self.side_exponents += exponents
        self.count += x.size
        self.min, self.max = min(self.min, lo) + 0.0, max(self.max, hi) + 0.0  # never -0.0
        for s, top in ((0, hi), (1, -lo)):
            if top > 0:
                self._widen(s, int(np.frexp(top)[1]))  # top < 2**exp, strictly
        if high is not None:
            if self.channel_max is None:
                self.channel_max, self.channel_min = high, low
            else:
                np.maximum(self.channel_max, high, out=self.channel_max)
                np.minimum(self.channel_min, low, out=self.channel_min)
        if self.histogram:
            log_bins = int(np.log2(self.bins))
            tensor_counts(x, tuple(log_bins - (e or 0) for e in self.side_exp), self.hist,
                          self.side_exponents, _EXP_LO)

    def _add_finite(self, x: np.ndarray, channel_axis: int | None) -> None:
        """`add` of the finite values of x; the others are counted in `nonfinite`. A channel
        without a finite value has extremes 0."""
        finite = np.isfinite(x)
        self.nonfinite += (int(np.count_nonzero(x == -np.inf)),
                           int(np.count_nonzero(x == np.inf)), int(np.count_nonzero(np.isnan(x))))
        if np.any(finite):
            self.add(x[finite])
        if channel_axis is None:
            return
        rows = np.moveaxis(np.asarray(x, np.float64), channel_axis, 0).reshape(
            x.shape[channel_axis], -1)
        keep = np.moveaxis(finite, channel_axis, 0).reshape(rows.shape)
        any_finite = keep.any(axis=1)
        high = np.where(any_finite, np.where(keep, rows, -np.inf).max(axis=1), 0.0) + 0.0
        low = np.where(any_finite, np.where(keep, rows, np.inf).min(axis=1), 0.0) + 0.0
        if self.channel_max is None:
            self.channel_max, self.channel_min = high, low
        else:
            np.maximum(self.channel_max, high, out=self.channel_max)
            np.minimum(self.channel_min, low, out=self.channel_min)

    def merge(self, other: TensorStats) -> None:
        """Fold another tensor's statistics into this one (same `bins`)."""
        if other.bins != self.bins:
            raise ValueError("cannot merge statistics with different bin counts")
        self.nonfinite += other.nonfinite
        if other.count == 0:
            return
        for s in range(2):
            e = other.side_exp[s]
            if e is None:
                self.hist[s, :1] += other.hist[s, :1]  # zeros: bin 0 at every range
                continue
            self._widen(s, e)
            ours = self.side_exp[s]
            self.hist[s] += other.hist[s] if e == ours else _rebin(other.hist[s], ours - e)
        self.side_exponents += other.side_exponents
        self.count += other.count
        self.min, self.max = min(self.min, other.min), max(self.max, other.max)
        if other.channel_max is not None:
            if self.channel_max is None:
                self.channel_max, self.channel_min = (other.channel_max.copy(),
                                                      other.channel_min.copy())
            else:
                np.maximum(self.channel_max, other.channel_max, out=self.channel_max)
                np.minimum(self.channel_min, other.channel_min, out=self.channel_min)

    def relu(self) -> TensorStats:
        """The statistics of max(x, 0) over the same values, exactly as counting them would
        give: the negative values become zeros (bin 0 of the non-negative side), the
        non-negative side is unchanged."""
        out = TensorStats(self.bins, self.histogram)
        out.count = self.count
        # relu(-inf) = 0, a finite value the statistics above do not hold: kept as non-finite,
        # so the value stays out of integer formats, as its operand does.
        out.nonfinite = self.nonfinite.copy()
        if self.count:
            out.min, out.max = max(self.min, 0.0) + 0.0, max(self.max, 0.0) + 0.0
        out.side_exp = [self.side_exp[0], None]
        out.hist[0] = self.hist[0]
        if self.histogram:  # every x < 0 is non-zero, so its exponent was counted
            out.hist[0, 0] += int(self.side_exponents[1].sum())
        out.side_exponents[0] = self.side_exponents[0]
        if self.channel_max is not None:
            out.channel_max = np.maximum(self.channel_max, 0.0) + 0.0
            out.channel_min = np.maximum(self.channel_min, 0.0) + 0.0
        return out

    def _widen(self, s: int, exp: int) -> None:
        e = self.side_exp[s]
        if e is None:  # so far only zeros, which are in bin 0 at every range
            self.side_exp[s] = exp
        elif exp > e:
            self.hist[s] = _rebin(self.hist[s], exp - e)
            self.side_exp[s] = exp

    def tiny(self, quantile: float = TINY_QUANTILE) -> float | None:
        """A power of two at or below the `quantile` of the non-zero magnitudes (None: all 0)."""
        exponents = self.exponents
        total = int(exponents.sum())
        if total == 0:
            return None
        k = int(np.searchsorted(np.cumsum(exponents), quantile * total))
        return math.ldexp(1.0, k + _EXP_LO - 1)  # frexp exponent e: |x| in [2**(e-1), 2**e)


def _rebin(counts: np.ndarray, doublings: int) -> np.ndarray:
    """Counts at a range 2**doublings times wider: bins merge in groups of 2**doublings."""
    n = counts.size
    if doublings >= int(np.log2(n)):
        out = np.zeros_like(counts)
        out[0] = counts.sum()
        return out
    group = 1 << doublings
    out = np.zeros_like(counts)
    out[: n // group] = counts.reshape(-1, group).sum(axis=1)
    return out


# ---- range estimators -----------------------------------------------------------------------

def steps_for(stats: TensorStats, symmetric: bool) -> int:
    """Quantization steps between 0 and the clip threshold the estimators optimize for: 127
    per side for symmetric int8, 255 for one-sided data quantized asymmetrically."""
    one_sided = stats.min >= 0 or stats.max <= 0
    return 255 if one_sided and not symmetric else 127


def estimate_range(stats: TensorStats, method: str, percentile: float = 99.99,
                   symmetric: bool = True) -> tuple[float, float]:
    """The range [lo, hi] that `method` calibrates for this tensor."""
    if stats.count == 0:
        return 0.0, 0.0
    if method == "minmax" or stats.exp is None:
        return stats.min, stats.max
    hist = stats.pos + stats.neg
    if method == "percentile":
        t = percentile_threshold(hist, stats.bin_width, percentile)
    elif method == "entropy":
        t = entropy_threshold(hist, stats.bin_width, steps_for(stats, symmetric) + 1)
    elif method == "mse":
        t = mse_threshold(hist, stats.bin_width, steps_for(stats, symmetric))
    else:
        raise ValueError(f"unknown calibration method '{method}'; known: {', '.join(METHODS)}")
    t = min(t, stats.amax)
    return max(stats.min, -t), min(stats.max, t)


def percentile_threshold(hist: np.ndarray, width: float, percentile: float) -> float:
    """The upper edge of the bin holding the `percentile`-th percentile of |x|."""
    cum = np.cumsum(hist)
    k = int(np.searchsorted(cum, percentile / 100.0 * cum[-1]))
    return (min(k, hist.size - 1) + 1) * width


def entropy_threshold(hist: np.ndarray, width: float, levels: int = 128) -> float:
    """TensorRT's entropy calibration: the clip threshold whose `levels`-bin quantization of
    the |x| distribution has the least KL divergence from it (outliers folded into the last
    kept bin). Searched over every bin edge from `levels` bins to the last non-zero bin."""
    nz = np.flatnonzero(hist)
    last = int(nz[-1]) + 1 if nz.size else 1
    if last <= levels:
        return last * width
    h = hist[:last].astype(np.float64)
    tail = np.concatenate([np.cumsum(h[::-1])[::-1], [0.0]])  # tail[i] = sum h[i:]
    best_i, best_kl = last, math.inf
    for i in range(levels, last + 1):
        p = h[:i].copy()
        p[-1] += tail[i]
        ref = h[:i]
        starts = (np.arange(levels) * i) // levels
        sums = np.add.reduceat(ref, starts)
        nonzero = np.add.reduceat((ref > 0).astype(np.float64), starts)
        group = np.repeat(np.arange(levels), np.diff(np.append(starts, i)))
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(ref > 0, sums[group] / nonzero[group], 0.0)
        keep = p > 0
        ps, qs = p[keep] / p.sum(), q[keep]
        qs = np.where(qs > 0, qs / max(q.sum(), 1e-300), 1e-12)  # smoothed as in TensorRT
        kl = float(np.sum(ps * np.log(ps / qs)))
        if kl < best_kl:
            best_i, best_kl = i, kl
    return best_i * width


def mse_threshold(hist: np.ndarray, width: float, steps: int) -> float:
    """The clip threshold t (a bin edge) minimizing sum n_b (c_b - Q_t(c_b))^2 over bin centres
    c_b, where Q_t rounds to `steps` equal steps in [0, t] and saturates at t."""
    nz = np.flatnonzero(hist)
    last = int(nz[-1]) + 1 if nz.size else 1
    counts = hist[:last].astype(np.float64)
    centres = (np.arange(last) + 0.5) * width
    best_t, best_err = last * width, math.inf
    for lo in range(1, last + 1, 256):  # candidates in chunks: bounded memory
        t = np.arange(lo, min(lo + 256, last + 1))[:, None] * width
        step = t / steps
        q = np.minimum(np.rint(centres[None, :] / step), steps) * step
        err = ((centres[None, :] - q) ** 2 * counts[None, :]).sum(axis=1)
        k = int(np.argmin(err))
        if err[k] < best_err:
            best_t, best_err = float(t[k, 0]), float(err[k])
    return best_t


# ---- where ranges are recorded --------------------------------------------------------------

def value_attrs(f: Function, value: Value) -> Mapping[str, Any]:
    """The attributes that describe `value`: its producer's, its entry of the producer's
    `mp.result_attrs` where the producer has several results, or the argument's `arg_attrs`."""
    node, k = value
    if f.op(node) == ARG:
        table, index = f.attrs.get(ARG_ATTRS), f.attrs_of(node)["index"]
    elif len(f.types(node)) > 1:
        table, index = f.attrs_of(node).get(RESULT_ATTRS), k
    else:
        return f.attrs_of(node)
    if isinstance(table, tuple) and index < len(table) and isinstance(table[index], dict):
        return table[index]
    return {}


def set_value_attrs(f: Function, value: Value, attrs: Mapping[str, Any],
                    replace: tuple[str, ...] = CALIB_KEYS) -> None:
    """Set `attrs` on `value`, first dropping the `replace` keys it had."""
    node, index = value
    if f.op(node) == ARG or len(f.types(node)) > 1:
        is_arg = f.op(node) == ARG
        table = f.attrs.get(ARG_ATTRS) if is_arg else f.attrs_of(node).get(RESULT_ATTRS)
        size = len(f.args) if is_arg else len(f.types(node))
        entries = [dict(d) if isinstance(d, dict) else {} for d in table] \
            if isinstance(table, tuple) and len(table) == size else [{} for _ in range(size)]
        entry = entries[f.attrs_of(node)["index"] if is_arg else index]
        for k in replace:
            entry.pop(k, None)
        entry.update(attrs)
        if is_arg:
            f.attrs[ARG_ATTRS] = tuple(entries)
        else:
            f.set_attr(node, RESULT_ATTRS, tuple(entries))
        return
    for k in replace:
        f.del_attr(node, k)
    for k, v in attrs.items():
        f.set_attr(node, k, v)


def range_of(f: Function, value: Value) -> tuple[float, float] | None:
    """The recorded quantization range of `value`, or None."""
    r = value_attrs(f, value).get(RANGE)
    if isinstance(r, tuple) and len(r) == 2:
        return float(_plain(r[0])), float(_plain(r[1]))
    return None


def nonfinite_of(f: Function, value: Value) -> tuple[int, int, int] | None:
    """How many -inf, +inf and NaN values calibration saw in `value` (None: none)."""
    r = value_attrs(f, value).get(NONFINITE)
    if isinstance(r, tuple) and len(r) == 3:
        return tuple(int(_plain(c)) for c in r)  # type: ignore[return-value]
    return None


def observed_of(f: Function, value: Value) -> tuple[float, float] | None:
    """The observed extremes of `value` (`mp.observed` where the method clipped, else the range)."""
    attrs = value_attrs(f, value)
    r = attrs.get(OBSERVED, attrs.get(RANGE))
    if isinstance(r, tuple) and len(r) == 2:
        return float(_plain(r[0])), float(_plain(r[1]))
    return None


def channel_absmax_of(f: Function, value: Value) -> np.ndarray | None:
    v = value_attrs(f, value).get(CHANNEL_ABSMAX)
    return np.asarray(v.array, np.float64) if isinstance(v, DenseAttr) else None


def _plain(v: Any) -> float:
    return getattr(v, "value", v)


def record(f: Function, value: Value, stats: TensorStats, method: str,
           percentile: float = 99.99, symmetric: bool = True,
           channels: bool = False) -> tuple[float, float]:
    """Write the calibrated range (and what else the module keeps) for one value."""
    lo, hi = estimate_range(stats, method, percentile, symmetric)
    attrs: dict[str, Any] = {RANGE: (float(lo), float(hi)), CALIB: method}
    if (lo, hi) != (stats.min, stats.max):
        attrs[OBSERVED] = (float(stats.min), float(stats.max))
    tiny = stats.tiny()
    if tiny is not None:
        attrs[TINY] = tiny
    if channels and stats.channel_absmax is not None:
        attrs[CHANNEL_ABSMAX] = dense_f32(stats.channel_absmax)
    if stats.has_nonfinite:
        attrs[NONFINITE] = tuple(int(c) for c in stats.nonfinite)
    set_value_attrs(f, value, attrs)
    return lo, hi


def dense_f32(values: np.ndarray, shape: tuple[int, ...] | None = None) -> DenseAttr:
    a = np.array(values, np.float32, order="C")  # ascontiguousarray would make a 0-d array 1-d
    if shape is not None:
        a = a.reshape(shape)
    return DenseAttr(a, tensor(a.shape, "f32"))


# ---- the constant part of a function --------------------------------------------------------

def constant_nodes(f: Function) -> set[int]:
    """Ops whose results depend on constants only (weights and what is computed from them)."""
    out: set[int] = set()
    for n in f.ops():
        ins = f.operands(n)
        if f.op(n) == "mp.constant" or (f.op(n) in OPS and ins and all(u in out for u, _ in ins)):
            out.add(n)
    return out


class ConstantValues:
    """Values of constant-only ops of a function, in f32 as the executor's reference holds them."""

    def __init__(self, module: Module, f: Function, weights: str | None = None):
        self.f = f
        self.weights = WeightStore(module, weights)
        self.nodes = constant_nodes(f)
        self._cache: dict[Value, np.ndarray] = {}

    def __contains__(self, value: Value) -> bool:
        return value[0] in self.nodes

    def get(self, value: Value) -> np.ndarray:
        node, k = value
        hit = self._cache.get(value)
        if hit is not None:
            return hit
        d = self.f.data(node)
        t = d["types"][k]
        if d["op"] == "mp.constant":
            attrs = d["attrs"]
            raw = attrs["value"].array if isinstance(attrs.get("value"), DenseAttr) else \
                self.weights.get(attrs["name"], t.shape, d["loc"])
        else:
            opdef = OPS[d["op"]]
            raw = opdef.reference([self.get(v) for v in self.f.operands(node)],
                                  check_attrs(opdef, d["attrs"]), d["types"])[k]
        arr = np.asarray(raw)
        if arr.dtype.kind == "f" and arr.dtype != np.float64:
            arr = arr.astype(np.float32)
        self._cache[value] = arr
        return arr


# ---- progress --------------------------------------------------------------------------------

class Progress:
    """A one-line progress bar on a terminal, drawn only once a run has lasted `delay` s."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None,
                 delay: float = 0.5):
        self.total, self.label, self.delay = max(total, 1), label, delay
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.start = time.perf_counter()
        self._drawn_at = -math.inf
        self._active = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self._active and now - self.start >= self.delay and (
                now - self._drawn_at >= 0.1 or self.done >= self.total):
            self._drawn_at = now
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(30 * frac)
            self.stream.write(f"\r{self.label} [{bar:<30}] {self.done}/{self.total} "
                              f"{now - self.start:.1f}s")
            self.stream.flush()

    def close(self) -> None:
        if self._active and self._drawn_at > -math.inf:
            self.stream.write("\n")
            self.stream.flush()
