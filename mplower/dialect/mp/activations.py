"""Activations and elementwise math: the ONNX activation functions (Clip, HardSwish, Elu, ...),
rounding, trigonometric and hyperbolic functions, Mod, Hardmax and the bitwise integer ops.

A float op here computes in float64 and rounds once to its operand's type (f32, or f64): the
executor hands a narrow float's operands in as f32 and rounds the f32 result to the narrow
type, so a bf16 HardSwish is one rounding of the f32 value, as for every other unary op. Each
op also declares its range rule (`bounds`: the image of its operands' intervals), which
range-analysis reads; for a function that is continuous between known critical points that is
the function at the interval's ends and at the critical points inside it.

Precision classes (the sheets' groups): clip, abs and thresholded_relu pick operand values
(`@value-preserving`); the activations proper are `@activation`, which the mixed-precision
sheets let follow their inputs as they do sigmoid and tanh. The trigonometric and hyperbolic
functions and mod are in neither: a rounding of the argument of sin(x) is an absolute error of
ulp(x) in the result (8 at x = 2048 in bf16, the angles of a rotary embedding), and sinh/cosh
grow like exp, so they stay f32 unless a sheet names them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from mplower.dialect.mp.common import (
    _ELEMENTWISE,
    _FLOATS,
    _NUMERIC,
    _PICKS,
    _VECTOR,
    _axis,
    _binary_infer,
    _def,
    _elem_of,
    _fl,
    _mul,
    _num,
    _one_minus,
    _per_element,
    _per_input_element,
    _sum_to,
    _times,
    _unary_infer,
    _zeros_like,
)
from mplower.ir.opdef import AttrSpec, GradBuilder, OpError, Trait, Value, Vjp
from mplower.ir.types import TensorType, tensor
from mplower.numerics.formats import FORMATS

_ACTIVATION = _ELEMENTWISE | {Trait.ACTIVATION}
# The integer types bitwise ops take: ONNX's (no 4-bit codes, no masks).
_BITS = frozenset(e for e in _NUMERIC if FORMATS[e].is_int) - {"i1", "i4"}
_BIG = 1e300  # a stand-in for an infinite interval end that every function here can take
INF = math.inf

Fn = Callable[[np.ndarray, Mapping[str, Any]], np.ndarray]
Interval = tuple[float, float]

# ---------------------------------------------------------------------------------------------
# Range rules


def _image(fn: Fn, critical: Callable[[Mapping[str, Any]], Iterable[float]] | None = None,
           domain: Interval = (-_BIG, _BIG)
           ) -> Callable[[Sequence[Interval], Mapping[str, Any]], Interval]:
    """The image of [lo, hi] under `fn`, continuous and monotone between its `critical` points
    (and at most jumping monotonically at them): its values at the ends and at the critical
    points inside. The interval is first cut to the function's `domain` (outside it the result
    is NaN, which no format overflows on); an end beyond _BIG is taken as infinite, in and out."""
    def bounds(ins: Sequence[Interval], a: Mapping[str, Any]) -> Interval:
        lo, hi = (max(min(v, domain[1]), domain[0]) for v in ins[0])
        points = [lo, hi, *(c for c in (critical(a) if critical else ()) if lo < c < hi)]
        with np.errstate(all="ignore"):
            ys = fn(np.array(points, np.float64), a)
        if np.isnan(ys).any():
            return -INF, INF
        y_lo, y_hi = float(ys.min()), float(ys.max())
        return (-INF if y_lo <= -_BIG else y_lo), (INF if y_hi >= _BIG else y_hi)
    return bounds


class _Image(NamedTuple):
    """A range rule `_image` builds from the op's own function: its critical points and
    domain."""

    critical: Callable[[Mapping[str, Any]], Iterable[float]] | None = None
    domain: Interval = (-_BIG, _BIG)


def _periodic(critical_phase: float) -> Callable[[Sequence[Interval], Mapping], Interval]:
    """sin (extremes at pi/2 + k pi: `critical_phase` = pi/2) and cos (at k pi: 0)."""
    fn = np.sin if critical_phase else np.cos

    def bounds(ins: Sequence[Interval], a: Mapping[str, Any]) -> Interval:
        lo, hi = ins[0]
        if not (math.isfinite(lo) and math.isfinite(hi)) or hi - lo >= 2 * math.pi:
            return -1.0, 1.0
        k = math.ceil((lo - critical_phase) / math.pi)
        points = [lo, hi, *(critical_phase + j * math.pi
                            for j in range(k, k + 3) if critical_phase + j * math.pi < hi)]
        ys = fn(np.array(points))
        return float(ys.min()), float(ys.max())
    return bounds


def _tan_bounds(ins: Sequence[Interval], a: Mapping[str, Any]) -> Interval:
    lo, hi = ins[0]
    if not (math.isfinite(lo) and math.isfinite(hi)) or \
            math.floor(lo / math.pi - 0.5) != math.floor(hi / math.pi - 0.5):
        return -INF, INF  # a pole (pi/2 + k pi) inside
    return math.tan(lo), math.tan(hi)


def _within(lo: float, hi: float) -> Callable[[Sequence[Interval], Mapping], Interval]:
    """An op whose result always lies in [lo, hi] (hardmax)."""
    return lambda ins, a: (lo, hi)


# ---------------------------------------------------------------------------------------------
# Gradient helpers


def _where(g: GradBuilder, mask: Value, a: Value, b: Value) -> Value:
    return g.emit("mp.where", [mask, a, b])


def _cmp(g: GradBuilder, op: str, x: Value, k: float) -> Value:
    return g.emit(op, [x, g.splat(k, (), g.type_of(x).elem)])


def _derivative(rule: Callable[[GradBuilder, Value, Value, Mapping], Value]) -> Vjp:
    """A unary op's rule from its derivative dy/dx (built from x, y and the attrs)."""
    return lambda g, xs, y, dy, a, needs: [g.emit("mp.mul", [dy, rule(g, xs[0], y, a)])]


def _flat(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
          needs: Sequence[bool]) -> list[Value | None]:
    """Piecewise constant (sign, floor, ceil, round, hardmax): zero almost everywhere."""
    return [_zeros_like(g, x) if need else None for x, need in zip(xs, needs)]


def _piecewise(g: GradBuilder, x: Value, below: float, inside: Value, above: float,
               lo: float, hi: float) -> Value:
    """`below` for x < lo, `inside` on [lo, hi], `above` for x > hi."""
    elem = g.type_of(x).elem
    y = _where(g, _cmp(g, "mp.less", x, lo), g.splat(below, (), elem), inside)
    return _where(g, _cmp(g, "mp.greater", x, hi), g.splat(above, (), elem), y)


# ---------------------------------------------------------------------------------------------
# Unary float functions, on float64 values


def _sigmoid(v: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-v))  # exp overflows to inf for v << 0: 1 / inf is the 0 wanted


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)  # log(1 + exp(x)) without overflow


def _hard_sigmoid(x: np.ndarray, a: Mapping) -> np.ndarray:
    return np.clip(a["alpha"] * x + a["beta"], 0.0, 1.0)


def _hard_swish(x: np.ndarray, a: Mapping) -> np.ndarray:
    return x * np.clip(x / 6.0 + 0.5, 0.0, 1.0)  # ONNX: alpha = 1/6, beta = 0.5


def _leaky_relu(x: np.ndarray, a: Mapping) -> np.ndarray:
    return np.where(x < 0, a["alpha"] * x, x)


def _elu(x: np.ndarray, alpha: float) -> np.ndarray:
    return np.where(x < 0, alpha * np.expm1(x), x)  # -0 is x itself, as ONNX writes it


def _selu(x: np.ndarray, a: Mapping) -> np.ndarray:
    # x <= 0 takes the exp branch (ONNX Selu), whose value at -0 is +0.
    return np.where(x > 0, a["gamma"] * x, a["gamma"] * a["alpha"] * np.expm1(x) + 0.0)


def _celu(x: np.ndarray, a: Mapping) -> np.ndarray:
    alpha = a["alpha"]
    return np.maximum(x, 0.0) + np.minimum(0.0, alpha * np.expm1(np.minimum(x, 0.0) / alpha))


def _shrink(x: np.ndarray, a: Mapping) -> np.ndarray:
    lam, bias = a["lambd"], a["bias"]
    return np.where(x < -lam, x + bias, np.where(x > lam, x - bias, 0.0))


def _swish(x: np.ndarray, a: Mapping) -> np.ndarray:
    return x * _sigmoid(a["alpha"] * x)


# The minima of the non-monotone smooth activations, where their derivative is zero: mish at
# x* with tanh(sp) + x* sech^2(sp) sigmoid(x*) = 0, swish (alpha = 1) at 1 + x*(1 - sigmoid(x*))
# = 0 (roots found in float64 to 1e-10; checked in tests/test_onnx_activations.py).
_MISH_MIN_AT = -1.1924312145
_SWISH_MIN_AT = -1.2784645428


def _swish_critical(a: Mapping) -> tuple[float, ...]:
    return (_SWISH_MIN_AT / a["alpha"],) if a["alpha"] else ()


# ---------------------------------------------------------------------------------------------
# Derivatives dy/dx of the unary ops, from mp ops (x the operand, y the result)

D = Callable[[GradBuilder, Value, Value, Mapping], Value]


def _k(g: GradBuilder, like: Value, v: float) -> Value:
    """The scalar `v` in the element type of `like`."""
    return g.splat(float(v), (), g.type_of(like).elem)


def _plus(g: GradBuilder, v: Value, k: float) -> Value:
    return g.emit("mp.add", [v, _k(g, v, k)])


def _filled(g: GradBuilder, x: Value, k: float) -> Value:
    return g.emit("mp.add", [_zeros_like(g, x), _k(g, x, k)])


def _d_hard_sigmoid(g: GradBuilder, x: Value, y: Value, a: Mapping) -> Value:
    inside = _plus(g, _times(g, x, a["alpha"]), a["beta"])  # the slope where 0 < it < 1
    return _piecewise(g, inside, 0.0, _filled(g, x, a["alpha"]), 0.0, 0.0, 1.0)


def _d_hard_swish(g: GradBuilder, x: Value, y: Value, a: Mapping) -> Value:
    return _piecewise(g, x, 0.0, _plus(g, _times(g, x, 1 / 3), 0.5), 1.0, -3.0, 3.0)


def _d_exp_branch(scale: Callable[[Mapping], float], shift: Callable[[Mapping], float],
                  y_scale: Callable[[Mapping], float]) -> D:
    """elu, selu, celu: `scale` for x > 0, else y_scale y + shift (their exp branch)."""
    def d(g: GradBuilder, x: Value, y: Value, a: Mapping) -> Value:
        neg = _plus(g, _times(g, y, y_scale(a)), shift(a))
        return _where(g, _cmp(g, "mp.greater", x, 0.0), _filled(g, x, scale(a)), neg)
    return d


def _d_mish(g: GradBuilder, x: Value, y: Value, a: Mapping) -> Value:
    t = g.emit("mp.tanh", [g.emit("mp.softplus", [x])])
    sech2 = _one_minus(g, _mul(g, t, t))
    return g.emit("mp.add", [t, _mul(g, x, sech2, g.emit("mp.sigmoid", [x]))])


def _d_softsign(g: GradBuilder, x: Value, y: Value, a: Mapping) -> Value:
    s = _one_minus(g, g.emit("mp.abs", [y]))  # 1 - |y| = 1 / (1 + |x|)
    return _mul(g, s, s)


def _d_swish(g: GradBuilder, x: Value, y: Value, a: Mapping) -> Value:
    s = g.emit("mp.sigmoid", [_times(g, x, a["alpha"])])
    return g.emit("mp.add", [s, _times(g, _mul(g, x, s, _one_minus(g, s)), a["alpha"])])


def _d_inverse(g: GradBuilder, v: Value) -> Value:
    return g.emit("mp.div", [_k(g, v, 1.0), v])


def _d_step(at: Callable[[Mapping], float]) -> D:
    """thresholded_relu: 1 for x > alpha, else 0."""
    return lambda g, x, y, a: _where(g, _cmp(g, "mp.greater", x, at(a)), _filled(g, x, 1.0),
                                     _zeros_like(g, x))


def _d_shrink(g: GradBuilder, x: Value, y: Value, a: Mapping) -> Value:
    return _piecewise(g, x, 1.0, _zeros_like(g, x), 1.0, -a["lambd"], a["lambd"])


_DERIVATIVE: dict[str, D | None] = {
    "hard_sigmoid": _d_hard_sigmoid,
    "hard_swish": _d_hard_swish,
    "leaky_relu": lambda g, x, y, a: _where(g, _cmp(g, "mp.less", x, 0.0),
                                            _filled(g, x, a["alpha"]), _filled(g, x, 1.0)),
    "elu": _d_exp_branch(lambda a: 1.0, lambda a: a["alpha"], lambda a: 1.0),
    "selu": _d_exp_branch(lambda a: a["gamma"], lambda a: a["gamma"] * a["alpha"],
                          lambda a: 1.0),
    "celu": _d_exp_branch(lambda a: 1.0, lambda a: 1.0, lambda a: 1 / a["alpha"]),
    "mish": _d_mish,
    "softplus": lambda g, x, y, a: g.emit("mp.sigmoid", [x]),
    "softsign": _d_softsign,
    "thresholded_relu": _d_step(lambda a: a["alpha"]),
    "swish": _d_swish,
    "shrink": _d_shrink,
    "floor": None, "ceil": None, "round": None,
    "sin": lambda g, x, y, a: g.emit("mp.cos", [x]),
    "cos": lambda g, x, y, a: g.emit("mp.neg", [g.emit("mp.sin", [x])]),
    "tan": lambda g, x, y, a: _plus(g, _mul(g, y, y), 1.0),
    "asin": lambda g, x, y, a: g.emit("mp.rsqrt", [_one_minus(g, _mul(g, x, x))]),
    "acos": lambda g, x, y, a: g.emit("mp.neg", [g.emit("mp.rsqrt", [
        _one_minus(g, _mul(g, x, x))])]),
    "atan": lambda g, x, y, a: _d_inverse(g, _plus(g, _mul(g, x, x), 1.0)),
    "sinh": lambda g, x, y, a: g.emit("mp.cosh", [x]),
    "cosh": lambda g, x, y, a: g.emit("mp.sinh", [x]),
    "asinh": lambda g, x, y, a: g.emit("mp.rsqrt", [_plus(g, _mul(g, x, x), 1.0)]),
    "acosh": lambda g, x, y, a: g.emit("mp.rsqrt", [_plus(g, _mul(g, x, x), -1.0)]),
    "atanh": lambda g, x, y, a: _d_inverse(g, _one_minus(g, _mul(g, x, x))),
}


def _shrink_bounds(ins: Sequence[Interval], a: Mapping[str, Any]) -> Interval:
    """Shrink jumps at -lambd (from x + bias to 0) and at lambd (from 0 to x - bias)."""
    lo, hi = ins[0]
    lam, bias = a["lambd"], a["bias"]
    ys = [float(_shrink(np.array(v, np.float64), a)) if math.isfinite(v) else v
          for v in (lo, hi)]
    if lo <= lam and hi >= -lam:  # the flat middle
        ys.append(0.0)
    if lo < -lam <= hi:  # the left branch's end
        ys.append(-lam + bias)
    if lo <= lam < hi:  # the right branch's start
        ys.append(lam - bias)
    return min(ys), max(ys)


def _thresholded_bounds(ins: Sequence[Interval], a: Mapping[str, Any]) -> Interval:
    lo, hi = ins[0]
    alpha = a["alpha"]
    ys = [0.0] if lo <= alpha else []
    if hi > alpha:
        ys += [max(lo, alpha), hi]
    return min(ys), max(ys)


_A = AttrSpec  # the attribute tables below are long
_ALPHA = {"alpha": _A("float", default=1.0)}

# name, fn (float64 -> float64), attrs, doc, traits, flops per element, range rule (an _Image
# of fn, or a rule of its own)
_UNARY: list[tuple[str, Fn, dict, str, frozenset, int, _Image | Callable]] = [
    ("hard_sigmoid", _hard_sigmoid,
     {"alpha": _A("float", default=0.2), "beta": _A("float", default=0.5)},
     "max(0, min(1, alpha x + beta)) (ONNX HardSigmoid)", _ACTIVATION, 3,
     _Image()),
    ("hard_swish", _hard_swish, {}, "x max(0, min(1, x / 6 + 1 / 2)) (ONNX HardSwish)",
     _ACTIVATION, 4, _Image(lambda a: (-1.5,))),
    ("leaky_relu", _leaky_relu,
     {"alpha": _A("float", default=0.01)}, "x for x >= 0, else alpha x (ONNX LeakyRelu)",
     _ACTIVATION, 2, _Image(lambda a: (0.0,))),
    ("elu", lambda x, a: _elu(x, a["alpha"]), _ALPHA,
     "x for x > 0, else alpha (exp(x) - 1) (ONNX Elu)", _ACTIVATION, 4,
     _Image(lambda a: (0.0,))),
    ("selu", _selu,
     {"alpha": _A("float", default=1.67326319217681884765625),
      "gamma": _A("float", default=1.05070102214813232421875)},
     "gamma x for x > 0, else gamma alpha (exp(x) - 1) (ONNX Selu)", _ACTIVATION, 5,
     _Image(lambda a: (0.0,))),
    ("celu", _celu, _ALPHA, "max(0, x) + min(0, alpha (exp(x / alpha) - 1)) (ONNX Celu)",
     _ACTIVATION, 5, _Image(lambda a: (0.0,))),
    ("mish", lambda x, a: x * np.tanh(_softplus(x)), {}, "x tanh(softplus(x)) (ONNX Mish)",
     _ACTIVATION, 8, _Image(lambda a: (_MISH_MIN_AT,))),
    ("softplus", lambda x, a: _softplus(x), {}, "log(exp(x) + 1) (ONNX Softplus)",
     _ACTIVATION, 4, _Image()),
    ("softsign", lambda x, a: x / (1.0 + np.abs(x)), {}, "x / (1 + |x|) (ONNX Softsign)",
     _ACTIVATION, 3, _Image()),
    ("thresholded_relu", lambda x, a: np.where(x > a["alpha"], x, 0.0), _ALPHA,
     "x for x > alpha, else 0 (ONNX ThresholdedRelu)", _PICKS, 1, _thresholded_bounds),
    ("swish", _swish, _ALPHA, "x sigmoid(alpha x) (ONNX Swish)", _ACTIVATION, 5,
     _Image(_swish_critical)),
    ("shrink", _shrink, {"bias": _A("float", default=0.0), "lambd": _A("float", default=0.5)},
     "x + bias for x < -lambd, x - bias for x > lambd, else 0 (ONNX Shrink)", _ACTIVATION, 2,
     _shrink_bounds),
    ("floor", lambda x, a: np.floor(x), {}, "round toward -inf (ONNX Floor)", _ACTIVATION, 1,
     _Image()),
    ("ceil", lambda x, a: np.ceil(x), {}, "round toward +inf (ONNX Ceil)", _ACTIVATION, 1,
     _Image()),
    ("round", lambda x, a: np.round(x), {}, "round to nearest, ties to even (ONNX Round)",
     _ACTIVATION, 1, _Image()),
    ("sin", lambda x, a: np.sin(x), {}, "sine (ONNX Sin)", _ELEMENTWISE, 4,
     _periodic(math.pi / 2)),
    ("cos", lambda x, a: np.cos(x), {}, "cosine (ONNX Cos)", _ELEMENTWISE, 4, _periodic(0.0)),
    ("tan", lambda x, a: np.tan(x), {}, "tangent (ONNX Tan)", _ELEMENTWISE, 4, _tan_bounds),
    ("asin", lambda x, a: np.arcsin(x), {}, "arcsine (ONNX Asin)", _ELEMENTWISE, 4,
     _Image(domain=(-1.0, 1.0))),
    ("acos", lambda x, a: np.arccos(x), {}, "arccosine (ONNX Acos)", _ELEMENTWISE, 4,
     _Image(domain=(-1.0, 1.0))),
    ("atan", lambda x, a: np.arctan(x), {}, "arctangent (ONNX Atan)", _ELEMENTWISE, 4,
     _Image()),
    ("sinh", lambda x, a: np.sinh(x), {}, "hyperbolic sine (ONNX Sinh)", _ELEMENTWISE, 4,
     _Image()),
    ("cosh", lambda x, a: np.cosh(x), {}, "hyperbolic cosine (ONNX Cosh)", _ELEMENTWISE, 4,
     _Image(lambda a: (0.0,))),
    ("asinh", lambda x, a: np.arcsinh(x), {}, "inverse hyperbolic sine (ONNX Asinh)",
     _ELEMENTWISE, 4, _Image()),
    ("acosh", lambda x, a: np.arccosh(x), {}, "inverse hyperbolic cosine (ONNX Acosh)",
     _ELEMENTWISE, 4, _Image(domain=(1.0, _BIG))),
    ("atanh", lambda x, a: np.arctanh(x), {}, "inverse hyperbolic tangent (ONNX Atanh)",
     _ELEMENTWISE, 4, _Image(domain=(-1.0, 1.0))),
]


def _float_reference(fn: Fn) -> Callable:
    """fn on float64, rounded once to the operand's float type (f32, or f64 itself)."""
    def reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
        x = _fl(xs[0])
        return [fn(x.astype(np.float64), a).astype(x.dtype, copy=False)]
    return reference


for _name, _fn, _attrs, _doc, _traits, _k_flops, _range in _UNARY:
    _rule = _DERIVATIVE[_name]
    _bounds = _image(_fn, *_range) if isinstance(_range, _Image) else _range
    _def(_name,
         vjp=_derivative(_rule) if _rule is not None else _flat,
         operands=("x",),
         attrs=_attrs,
         infer=_unary_infer(_FLOATS, "a float"),
         reference=_float_reference(_fn),
         flops=_per_element(_k_flops),
         precisions=_VECTOR,
         doc=f"Elementwise {_doc}.",
         traits=_traits,
         bounds=_bounds)


# Integers are held as their int64 values; ops that wrap at the type's width (abs of the most
# negative value, NOT, shifts) compute in the integer type itself.


def _storage_of(x: np.ndarray, rt: tuple | None) -> np.ndarray:
    """`x` (integers held as int64) in the storage type of the result's element type."""
    if not rt:
        return x
    return x.astype(FORMATS[rt[0].elem].storage, copy=False)


# ---------------------------------------------------------------------------------------------
# abs and sign: floats and integers


def _abs_bounds(ins: Sequence[Interval], a: Mapping[str, Any]) -> Interval:
    lo, hi = ins[0]
    return (0.0 if lo <= 0 <= hi else min(abs(lo), abs(hi))), max(abs(lo), abs(hi))


def _abs_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x = xs[0]
    if x.dtype.kind in "iu":  # in the integer type itself: |-128| wraps to -128 in i8
        return [np.abs(_storage_of(x, rt))]
    return [np.abs(_fl(x))]


_def("abs",
     vjp=_derivative(lambda g, x, y, a: g.emit("mp.sign", [x])),
     operands=("x",),
     attrs={},
     infer=_unary_infer(_NUMERIC, "a numeric"),
     reference=_abs_reference,
     flops=_per_element(1),
     precisions=_VECTOR,
     doc="Elementwise |x| (ONNX Abs).",
     traits=_PICKS,
     bounds=_abs_bounds)

_def("sign",
     vjp=_flat,
     operands=("x",),
     attrs={},
     infer=_unary_infer(_NUMERIC, "a numeric"),
     reference=lambda xs, a, rt: [np.sign(_num(xs[0]))],
     flops=_per_element(1),
     precisions=_VECTOR,
     doc="Elementwise sign: -1, 0 or 1, NaN for NaN (ONNX Sign).",
     traits=_ACTIVATION,
     bounds=_image(lambda x, a: np.sign(x)))


# ---------------------------------------------------------------------------------------------
# clip and prelu


def _clip_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x = ins[0]
    _elem_of(ins, _NUMERIC, "a numeric")
    for i, t in enumerate(ins[1:], 1):
        if t.size != 1:
            raise OpError(f"operand #{i} must hold one value (a bound of the clip), got {t}",
                          operand=i)
    return [tensor(x.shape, x.elem)]


def _clip_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x, lo, hi = (_num(v) for v in xs)
    # min(max(x, lo), hi): a lower bound above the upper one gives the upper one (ONNX Clip).
    return [np.minimum(np.maximum(x, lo.reshape(())), hi.reshape(()))]


def _clip_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
              needs: Sequence[bool]) -> list[Value | None]:
    """dy to x where lo <= x <= hi, else to the bound that was taken."""
    x, lo, hi = xs
    below = g.emit("mp.less", [x, lo])
    above = g.emit("mp.greater", [x, hi])
    zero = _zeros_like(g, dy)
    to_lo = _where(g, below, dy, zero)
    to_hi = _where(g, above, dy, zero)
    to_x = _where(g, above, zero, _where(g, below, zero, dy))
    return [to_x if needs[0] else None,
            _sum_to(g, to_lo, g.type_of(lo).shape) if needs[1] else None,
            _sum_to(g, to_hi, g.type_of(hi).shape) if needs[2] else None]


def _clip_bounds(ins: Sequence[Interval], a: Mapping[str, Any]) -> Interval:
    (x_lo, x_hi), (lo_lo, lo_hi), (hi_lo, hi_hi) = ins
    return min(max(x_lo, lo_lo), hi_lo), min(max(x_hi, lo_hi), hi_hi)


_def("clip",
     vjp=_clip_vjp,
     operands=("x", "lo", "hi"),
     attrs={},
     infer=_clip_infer,
     reference=_clip_reference,
     flops=_per_element(2),
     precisions=_VECTOR,
     doc="Elementwise min(max(x, lo), hi) with one-value bounds lo and hi (ONNX Clip; the "
         "importer fills an absent bound with the type's extreme).",
     traits=_PICKS,
     bounds=_clip_bounds)


def _prelu_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    (y,) = _binary_infer(_NUMERIC, "a numeric")(ins, a, declared)
    if y.shape != ins[0].shape:
        raise OpError(f"the slope {ins[1]} must broadcast to the shape of x {ins[0]} "
                      "(unidirectional broadcasting)", operand=1)
    return [y]


def _prelu_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
               needs: Sequence[bool]) -> list[Value | None]:
    x, slope = xs
    neg = _cmp(g, "mp.less", x, 0.0)
    dx = _where(g, neg, g.emit("mp.mul", [dy, slope]), dy) if needs[0] else None
    ds = None
    if needs[1]:
        ds = _sum_to(g, _where(g, neg, g.emit("mp.mul", [dy, x]), _zeros_like(g, dy)),
                     g.type_of(slope).shape)
    return [dx, ds]


def _prelu_bounds(ins: Sequence[Interval], a: Mapping[str, Any]) -> Interval:
    (lo, hi), (s_lo, s_hi) = ins
    ys = [max(lo, 0.0), max(hi, 0.0)]
    if lo < 0:  # slope times the negative part [lo, min(hi, 0)]
        with np.errstate(invalid="ignore"):
            ys += [float(np.nan_to_num(v * s, nan=0.0))
                   for v in (lo, min(hi, 0.0)) for s in (s_lo, s_hi)]
    return min(ys), max(ys)


_def("prelu",
     vjp=_prelu_vjp,
     operands=("x", "slope"),
     attrs={},
     infer=_prelu_infer,
     reference=lambda xs, a, rt: [np.where(_num(xs[0]) < 0, _num(xs[0]) * _num(xs[1]),
                                           _num(xs[0]))],
     flops=_per_element(2),
     precisions=_VECTOR,
     doc="Elementwise x for x >= 0, else slope x, the slope broadcast to x (ONNX PRelu).",
     traits=_ACTIVATION,
     bounds=_prelu_bounds)


# ---------------------------------------------------------------------------------------------
# mod


def _mod_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x, d = _num(xs[0]), _num(xs[1])
    return [np.fmod(x, d) if a["fmod"] else np.mod(x, d)]


def _mod_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
             needs: Sequence[bool]) -> list[Value | None]:
    """y = a - b trunc(a / b): dy to a, -dy trunc(a / b) = -dy (a - y) / b to b."""
    x, d = xs
    dx = _sum_to(g, dy, g.type_of(x).shape) if needs[0] else None
    dd = None
    if needs[1]:
        q = g.emit("mp.div", [g.emit("mp.sub", [x, y]), d])
        dd = _sum_to(g, g.emit("mp.neg", [g.emit("mp.mul", [dy, q])]), g.type_of(d).shape)
    return [dx, dd]


def _mod_bounds(ins: Sequence[Interval], a: Mapping[str, Any]) -> Interval:
    (lo, hi), (d_lo, d_hi) = ins
    m = max(abs(d_lo), abs(d_hi))
    if a["fmod"]:  # the sign of the dividend, |y| < |d| and |y| <= |x|
        return max(min(lo, 0.0), -m), min(max(hi, 0.0), m)
    return (0.0 if d_lo >= 0 else -m), (0.0 if d_hi <= 0 else m)


_def("mod",
     vjp=_mod_vjp,
     operands=("a", "b"),
     attrs={"fmod": AttrSpec("bool", default=False)},
     infer=_binary_infer(_NUMERIC, "a numeric"),
     reference=_mod_reference,
     flops=_per_element(2),
     precisions=_VECTOR,
     doc="Elementwise remainder with numpy broadcasting: a - floor(a / b) b, with the sign "
         "of the divisor (fmod = false), or a - trunc(a / b) b, with the sign of the dividend "
         "(fmod = true, C's fmod) (ONNX Mod-28).",
     traits=_ELEMENTWISE,
     bounds=_mod_bounds)


# ---------------------------------------------------------------------------------------------
# hardmax


def _hardmax_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x = ins[0]
    _elem_of(ins, _FLOATS, "a float")
    _axis(a["axis"], x.rank)
    return [tensor(x.shape, x.elem)]


def _hardmax_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x = _fl(xs[0])
    axis = a["axis"] % x.ndim
    y = np.zeros_like(x)
    if x.size:  # 1 at the first largest element along the axis (a NaN counts as largest)
        np.put_along_axis(y, np.expand_dims(np.argmax(x, axis), axis), 1, axis)
    return [y]


_def("hardmax",
     vjp=_flat,
     operands=("x",),
     attrs={"axis": AttrSpec("int", default=-1)},
     infer=_hardmax_infer,
     reference=_hardmax_reference,
     flops=_per_input_element,
     precisions=_VECTOR,
     doc="1 at the first largest element along `axis`, 0 elsewhere (ONNX Hardmax-13).",
     traits=frozenset({Trait.ACTIVATION}),
     bounds=_within(0.0, 1.0))


# ---------------------------------------------------------------------------------------------
# Bitwise integer ops


def _bitwise_reference(fn: Callable[..., np.ndarray]) -> Callable:
    return lambda xs, a, rt: [fn(*(_storage_of(x, rt) for x in xs))]


for _name, _fn, _onnx in (("bitwise_and", np.bitwise_and, "BitwiseAnd"),
                          ("bitwise_or", np.bitwise_or, "BitwiseOr"),
                          ("bitwise_xor", np.bitwise_xor, "BitwiseXor")):
    _def(_name,
         operands=("a", "b"),
         attrs={},
         infer=_binary_infer(_BITS, "an integer"),
         reference=_bitwise_reference(_fn),
         flops=_per_element(1),
         precisions=_VECTOR,
         doc=f"Elementwise bitwise {_name.removeprefix('bitwise_')} of two integers with numpy "
             f"broadcasting (ONNX {_onnx}).",
         traits=_ELEMENTWISE)

_def("bitwise_not",
     operands=("x",),
     attrs={},
     infer=_unary_infer(_BITS, "an integer"),
     reference=_bitwise_reference(np.invert),
     flops=_per_element(1),
     precisions=_VECTOR,
     doc="Elementwise bitwise complement of an integer (ONNX BitwiseNot).",
     traits=_ELEMENTWISE)


def _shift_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    """ONNX BitShift-28: a right shift of a signed type is arithmetic; a left shift wraps
    (bits past the sign bit are lost); a shift by a negative amount or by the width or more
    leaves only the sign fill: -1 for a right shift of a negative value, else 0."""
    x, s = (_storage_of(v, rt) for v in xs)
    x, s = np.broadcast_arrays(x, s)
    width = x.dtype.itemsize * 8
    inside = (s >= 0) & (s < width)
    by = np.where(inside, s, 0).astype(np.uint8)
    if a["direction"] == "RIGHT":
        fill = np.where(x < 0, x.dtype.type(-1) if x.dtype.kind == "i" else 0, 0)
        y = np.right_shift(x, by.astype(x.dtype))
    else:
        fill = np.zeros_like(x)
        unsigned = x.view(np.dtype(f"u{x.dtype.itemsize}"))
        y = np.left_shift(unsigned, by.astype(unsigned.dtype)).view(x.dtype)
    return [np.where(inside, y, fill.astype(x.dtype))]


_def("bit_shift",
     operands=("x", "shift"),
     attrs={"direction": AttrSpec("str", required=True, choices=("LEFT", "RIGHT"))},
     infer=_binary_infer(_BITS, "an integer"),
     reference=_shift_reference,
     flops=_per_element(1),
     precisions=_VECTOR,
     doc="Elementwise shift of integers by `shift` bits, LEFT or RIGHT (arithmetic for a "
         "signed type), with numpy broadcasting (ONNX BitShift-28).",
     traits=_ELEMENTWISE)
