"""`range-analysis`: predict, before anything runs, which values overflow or flush to zero.

Every value gets an interval [lo, hi] and, where known, `tiny`: a magnitude at or below which
lie at most 1% of its non-zero values. Values with a recorded range (calibrate's `mp.range` /
`mp.observed` / `mp.tiny`, or a range the user wrote, on ops or in a function's `arg_attrs`)
take it as measured; constants take their actual values; every other op's interval is
propagated from its operands':

* exact (the image of the operand box): relu, neg, exp, log, sqrt, rsqrt, sigmoid, tanh, gelu,
  maximum, minimum, casts, quantize round trips, data movement (reshape, transpose, flatten,
  concat, expand, where's two branches, trilu with its zeros; slice, gather and max_pool give a
  subset), reduce_max, and matmul/conv against known
  weights, bounded per output channel as sum_k max(lo w_k, hi w_k) (the exact extremes over
  a box of inputs; conv padding counts as a zero input);
* conservative (interval arithmetic, exact only for independent operands): add, sub, mul,
  div (unbounded if the divisor's interval holds 0), matmul of two activations, reduce_sum
  (n [lo, hi]), cumsum (1 to n times [lo, hi]), reduce_mean and the pools ([lo, hi]), softmax ((0, 1], with tiny =
  exp(lo - hi) / n), layer_norm and rms_norm (|z| <= sqrt(n - 1) resp. sqrt(n), times gamma,
  plus beta);
* an op that declares its own rule (`OpDef.bounds`: clip, the activations, sin, ...) takes it;
* anything else is unbounded, which flags nothing.

Flags, per format (option `formats`): a float format overflows where max |x| exceeds its
largest finite value and flushes to zero where at least 1% of the non-zero values lie below
half its smallest subnormal (they round to 0). i8 is per-tensor quantization with the value's
calibrated range: it overflows (saturates) where the observed extremes exceed that range, and
flushes where 1% of the non-zero values are below half a step. The pass writes `mp.overflow`
and `mp.underflow` (arrays of format names) on the producing op (`arg_attrs` for arguments)
and `mp.bound = [lo, hi]` where the interval was propagated; `assign-precision
{overflow_guard=true}` reads them (`guard`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from mplower.dialect.mp import CONTRACTIONS
from mplower.dialect.plan import BOUND, OVERFLOW, UNDERFLOW
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import RETURN, Function, Module, Value
from mplower.ir.opdef import OPS, OpError, Trait, check_attrs
from mplower.ir.types import TensorType
from mplower.lowering.calibration import (
    TINY,
    ConstantValues,
    observed_of,
    range_of,
    set_value_attrs,
    value_attrs,
)
from mplower.numerics.formats import FORMATS
from mplower.pass_manager import Pass, PassContext, option, register_pass

FLAG_KEYS = (OVERFLOW, UNDERFLOW, BOUND)
INF = math.inf


@dataclass(frozen=True)
class Interval:
    lo: float
    hi: float
    tiny: float | None = None  # at most 1% of the non-zero |x| are below it (None: unknown)

    @property
    def amax(self) -> float:
        return max(abs(self.lo), abs(self.hi))

    @property
    def bounded(self) -> bool:
        return math.isfinite(self.lo) and math.isfinite(self.hi)


UNBOUNDED = Interval(-INF, INF)


def _from(lo: float, hi: float) -> Interval:
    """An interval whose tiny is known where it excludes 0."""
    lo, hi = (lo, hi) if lo <= hi else (hi, lo)
    tiny = min(abs(lo), abs(hi)) if (lo > 0 or hi < 0) and math.isfinite(lo + hi) else None
    return Interval(lo, hi, tiny)


def _mul(a: Interval, b: Interval) -> Interval:
    with np.errstate(invalid="ignore"):
        ps = [x * y for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    ps = [0.0 if math.isnan(p) else p for p in ps]  # 0 * inf: the zero end contributes 0
    return _from(min(ps), max(ps))


def _union(xs: Sequence[Interval]) -> Interval:
    tinies = [x.tiny for x in xs]
    tiny = min(tinies) if all(t is not None for t in tinies) else None
    return Interval(min(x.lo for x in xs), max(x.hi for x in xs), tiny)


def _monotone(fn: Callable[[float], float]) -> Callable[[Interval], Interval]:
    def apply(x: Interval) -> Interval:
        with np.errstate(all="ignore"):
            a, b = float(fn(x.lo)), float(fn(x.hi))
        a = -INF if math.isnan(a) else a
        b = INF if math.isnan(b) else b
        return _from(min(a, b), max(a, b))
    return apply


def _gelu(x: float) -> float:
    return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0))) if math.isfinite(x) else \
        (0.0 if x < 0 else x)


_GELU_MIN_AT, _GELU_MIN = -0.7517916, -0.1699846  # argmin and min of the exact GELU

_UNARY: dict[str, Callable[[Interval], Interval]] = {
    "mp.relu": lambda x: Interval(max(x.lo, 0.0), max(x.hi, 0.0),
                                  x.tiny if x.lo >= 0 else None),
    "mp.neg": lambda x: Interval(-x.hi, -x.lo, x.tiny),
    "mp.exp": _monotone(lambda v: math.exp(min(v, 709.0)) if v < 709 else INF),
    "mp.log": _monotone(lambda v: math.log(v) if v > 0 else -INF),
    "mp.sqrt": _monotone(lambda v: math.sqrt(max(v, 0.0)) if math.isfinite(v) else INF),
    "mp.rsqrt": _monotone(lambda v: 1 / math.sqrt(v) if v > 0 else INF),
    "mp.sigmoid": _monotone(lambda v: 1 / (1 + math.exp(-v)) if v > -709 else 0.0),
    "mp.tanh": _monotone(math.tanh),
}
# Ops whose result holds values of their first operand only (or a subset of them), besides
# those that move elements (Trait.DATA_MOVEMENT, asked of the op: a new one needs no entry).
_PASS_THROUGH = frozenset({"mp.reduce_max", "mp.cast", "mp.dequantize", "mp.fake_quant",
                           "mp.max_pool2d", "mp.reduce_min", "mp.topk"})
_AVERAGING = frozenset({"mp.reduce_mean", "mp.avg_pool2d", "mp.global_avg_pool"})


def _contraction(op: str, ins: list[Interval], weights: list[np.ndarray | None],
                 in_types: list[TensorType], attrs: dict) -> Interval:
    x, w = ins[0], ins[1]
    padded = op == "mp.conv2d" and any(attrs.get("padding", (0, 0, 0, 0)))
    if padded:
        x = Interval(min(x.lo, 0.0), max(x.hi, 0.0))
    wv = weights[1]
    if wv is not None and weights[0] is None and x.bounded:
        w64 = wv.astype(np.float64)
        if op == "mp.conv2d":  # per output channel over (C, kh, kw)
            w64 = w64.reshape(w64.shape[0], -1).T
        hi = np.maximum(x.lo * w64, x.hi * w64).sum(axis=-2)
        lo = np.minimum(x.lo * w64, x.hi * w64).sum(axis=-2)
        out = _from(float(lo.min()), float(hi.max()))
    else:
        k = in_types[0].shape[-1] if op == "mp.matmul" else \
            int(np.prod(in_types[1].shape[1:]))
        p = _mul(x, w)
        out = _from(k * min(p.lo, 0.0), k * max(p.hi, 0.0))
    if len(ins) == 3:
        out = _from(out.lo + ins[2].lo, out.hi + ins[2].hi)
    return out


def propagate(op: str, ins: list[Interval], attrs: dict, in_types: list[TensorType],
              out_type: TensorType, weights: list[np.ndarray | None]) -> Interval:
    """The interval of an op's result from its operands' (see the module docstring)."""
    if op in _UNARY:
        return _UNARY[op](ins[0])
    if op == "mp.concat":
        return _union(ins)
    if op == "mp.where":  # either branch, whatever the mask
        return _union(ins[1:])
    if op in ("mp.scatter_elements", "mp.scatter_nd") and attrs["reduction"] in (
            "none", "max", "min"):  # data's values and the updates' (sums are unbounded)
        return _union([ins[0], ins[2]])
    if op == "mp.trilu":  # the operand's values and the zeros it writes
        return Interval(min(ins[0].lo, 0.0), max(ins[0].hi, 0.0), ins[0].tiny)
    opdef = OPS.get(op)
    if opdef is not None and opdef.bounds is not None:  # the op's own rule (OpDef.bounds)
        return _from(*opdef.bounds([(i.lo, i.hi) for i in ins], attrs))
    if op in _PASS_THROUGH or (opdef is not None and Trait.DATA_MOVEMENT in opdef.traits):
        return ins[0]
    if op == "mp.cumsum":  # a partial sum of 1 to n elements
        n = in_types[0].shape[attrs["axis"]]
        return _from(min(ins[0].lo, n * ins[0].lo), max(ins[0].hi, n * ins[0].hi))
    if op == "mp.gelu":
        lo, hi = ins[0].lo, ins[0].hi
        vals = [_gelu(lo), _gelu(hi)] + ([_GELU_MIN] if lo < _GELU_MIN_AT < hi else [])
        return _from(min(vals), max(vals))
    if op in ("mp.maximum", "mp.minimum"):
        pick = max if op == "mp.maximum" else min
        return _from(pick(ins[0].lo, ins[1].lo), pick(ins[0].hi, ins[1].hi))
    if op == "mp.add":
        return _from(ins[0].lo + ins[1].lo, ins[0].hi + ins[1].hi)
    if op == "mp.sub":
        return _from(ins[0].lo - ins[1].hi, ins[0].hi - ins[1].lo)
    if op == "mp.mul":
        return _mul(ins[0], ins[1])
    if op == "mp.div":
        d = ins[1]
        if d.lo <= 0 <= d.hi:
            return UNBOUNDED
        return _mul(ins[0], _from(1 / d.hi, 1 / d.lo))
    if op in CONTRACTIONS:
        return _contraction(op, ins, weights, in_types, attrs)
    if op == "mp.reduce_sum":
        n = max(in_types[0].size // max(out_type.size, 1), 1)
        return _from(n * ins[0].lo, n * ins[0].hi)
    if op in _AVERAGING:
        x = ins[0]
        if any(attrs.get("padding", (0,))):
            return _from(min(x.lo, 0.0), max(x.hi, 0.0))
        return Interval(x.lo, x.hi, x.tiny)
    if op == "mp.softmax":
        x = ins[0]
        n = in_types[0].shape[attrs["axis"]]
        tiny = math.exp(max(x.lo - x.hi, -745.0)) / n if x.bounded else None
        return Interval(tiny or 0.0, 1.0, tiny)
    if op in ("mp.layer_norm", "mp.rms_norm"):
        t = in_types[0]
        n = int(np.prod(t.shape[attrs["axis"] % t.rank:]))
        z = math.sqrt(max(n - 1, 1)) if op == "mp.layer_norm" else math.sqrt(n)
        out = _mul(Interval(-z, z), ins[1])
        if op == "mp.layer_norm":
            out = _from(out.lo + ins[2].lo, out.hi + ins[2].hi)
        return out
    return UNBOUNDED


def value_interval(f: Function, v: Value) -> Interval | None:
    """The measured or given interval of `v`, from its attributes."""
    r = observed_of(f, v)
    if r is None:
        return None
    tiny = value_attrs(f, v).get(TINY)
    return Interval(r[0], r[1], float(getattr(tiny, "value", tiny)) if tiny is not None
                    else None)


def flags(iv: Interval, fmt: str, quant_range: tuple[float, float] | None) -> tuple[bool, bool]:
    """(overflows, flushes to zero) in `fmt` for a value in `iv` (see the module docstring)."""
    f = FORMATS[fmt]
    if f.is_float:
        over = iv.bounded and iv.amax > f.max_finite
        under = iv.tiny is not None and 0 < 2 * iv.tiny <= f.min_subnormal / 2
        return over, under
    if quant_range is None:  # an integer format without a calibrated scale: nothing to say
        return False, False
    qmax = max(abs(quant_range[0]), abs(quant_range[1]))
    over = iv.bounded and iv.amax > qmax * (1 + 0.5 / f.max_finite)  # beyond the last step
    step = qmax / f.max_finite if qmax > 0 else 0.0
    under = iv.tiny is not None and 0 < 2 * iv.tiny <= step / 2
    return over, under


def hazard(f: Function, v: Value, fmt: str) -> str | None:
    """Why `v` cannot be held in `fmt`, from range-analysis's flags, or None."""
    attrs = value_attrs(f, v)
    over = fmt in attrs.get(OVERFLOW, ())
    under = fmt in attrs.get(UNDERFLOW, ())
    if not (over or under):
        return None
    r = observed_of(f, v) or _pair(attrs.get(BOUND))
    spec = FORMATS[fmt]
    if over:
        amax = max(abs(r[0]), abs(r[1])) if r else math.nan
        if spec.is_float:
            return f"{fmt} overflows (max {amax:.3g} > {spec.max_finite:.6g})"
        q = range_of(f, v)
        return f"{fmt} saturates (max {amax:.3g} beyond the calibrated {max(map(abs, q)):.3g})"
    tiny = attrs.get(TINY)
    shown = f"{float(getattr(tiny, 'value', tiny)):.3g}" if tiny is not None else "?"
    limit = spec.min_subnormal / 2 if spec.is_float else None
    where = f" < {limit:.3g}" if limit is not None else " below half a step"
    return f"{fmt} flushes to zero (1% of |x| at or below {shown}{where})"


def _pair(v: Any) -> tuple[float, float] | None:
    return (float(v[0]), float(v[1])) if isinstance(v, tuple) and len(v) == 2 else None


def analyze_function(module: Module, f: Function, formats: Sequence[str],
                     weights: str | None, ctx: PassContext) -> None:
    try:
        consts: ConstantValues | None = ConstantValues(module, f, weights)
    except DiagnosticError:
        consts = None
    intervals: dict[Value, Interval] = {}

    def constant(v: Value) -> np.ndarray | None:
        if consts is None or v not in consts:
            return None
        try:
            return consts.get(v)
        except (DiagnosticError, OpError):
            return None

    def record(v: Value, iv: Interval, propagated: bool) -> None:
        intervals[v] = iv
        q = range_of(f, v)
        over = [fmt for fmt in formats if flags(iv, fmt, q)[0]]
        under = [fmt for fmt in formats if flags(iv, fmt, q)[1]]
        attrs: dict[str, Any] = {}
        if over:
            attrs[OVERFLOW] = tuple(over)
        if under:
            attrs[UNDERFLOW] = tuple(under)
        if propagated and iv.bounded:
            attrs[BOUND] = (float(iv.lo), float(iv.hi))
        set_value_attrs(f, v, attrs, replace=FLAG_KEYS)
        ctx.stat("values-analyzed")
        ctx.stat("overflow-predicted", bool(over))
        ctx.stat("underflow-predicted", bool(under))
        ctx.stat("values-unbounded", not iv.bounded)

    for a in f.args:
        v = (a, 0)
        if FORMATS[f.type_of(v).elem].is_float:
            record(v, value_interval(f, v) or UNBOUNDED, False)
    values = [((n, k), t) for n in f.ops() if f.op(n) != RETURN
              for k, t in enumerate(f.types(n)) if FORMATS[t.elem].is_float]
    for v, out_type in values:
        n, d = v[0], f.data(v[0])
        measured = value_interval(f, v)
        if measured is not None:
            record(v, measured, False)
            continue
        value = constant(v)
        if value is not None:
            vals = np.abs(value[value != 0])
            lo, hi = (float(value.min()), float(value.max())) if value.size else (0.0, 0.0)
            record(v, Interval(lo, hi, float(vals.min()) if vals.size else None), False)
            continue
        ins = f.operands(n)
        operand_ivs = [intervals.get(u, UNBOUNDED) for u in ins]
        opdef = OPS.get(d["op"])
        try:
            attrs = check_attrs(opdef, d["attrs"]) if opdef is not None else {}
        except OpError:
            attrs = {}
        iv = propagate(d["op"], operand_ivs, attrs, f.operand_types(n), out_type,
                       [constant(u) for u in ins])
        record(v, iv, True)


@register_pass
@dataclass
class RangeAnalysis(Pass):
    """Predict per value which formats overflow or flush to zero, from calibrated or given ranges.

    Intervals start from recorded ranges (calibrate's, or `mp.range` written by hand on an op
    or in `arg_attrs`) and constants, and are propagated through the other ops (exactly for
    monotone and data-movement ops and for matmul/conv against known weights, conservatively
    for the rest; see the module docstring). Writes `mp.overflow` / `mp.underflow` (format
    names) and `mp.bound`; `assign-precision{overflow_guard=true}` acts on them.
    """

    name: ClassVar[str] = "range-analysis"
    statistics: ClassVar[dict[str, str]] = {
        "values-analyzed": "values given an interval",
        "overflow-predicted": "values that overflow in at least one checked format",
        "underflow-predicted": "values that flush to zero in at least one checked format",
        "values-unbounded": "values whose interval could not be bounded",
    }
    formats: tuple[str, ...] = option(("f16", "bf16", "f8E4M3FN", "f8E5M2", "i8"),
                                      "formats to check")

    def run(self, module: Module, ctx: PassContext) -> None:
        unknown = [fmt for fmt in self.formats if fmt not in FORMATS]
        if unknown:
            raise DiagnosticError.at(module.loc, f"range-analysis: unknown format(s) "
                                                 f"{', '.join(unknown)}")
        for f in module.functions.values():
            analyze_function(module, f, self.formats, ctx.weights_path, ctx)

