"""Elementwise mp ops: binary arithmetic, unary functions, gelu and erf."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from mplower.dialect.mp.common import (
    _ELEMENTWISE,
    _FLOATS,
    _NUMERIC,
    _PICKS,
    _VECTOR,
    _binary_infer,
    _binary_reference,
    _binary_vjp,
    _def,
    _fl,
    _ImplReference,
    _mul,
    _num,
    _one_minus,
    _per_element,
    _times,
    _unary_infer,
)
from mplower.ir.opdef import AttrSpec, GradBuilder, Value, Vjp

# ---------------------------------------------------------------------------------------------
# Elementwise


# Where the reference's add and relu of float arrays run compiled (mplower.numerics.elementwise):
# below this numpy's own loop is as fast.
_COMPILED_FROM = 1 << 16


def _add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.shape == b.shape and a.dtype == b.dtype and a.dtype in (np.float32, np.float64) \
            and a.size >= _COMPILED_FROM:
        from mplower.numerics.elementwise import add  # np.add's bits, on two threads

        return add(a, b)
    return np.add(a, b)


def _pick_vjp(larger: bool) -> Vjp:
    """maximum (`larger`) and minimum: dy to the operand picked, half to each on a tie (as
    JAX and PyTorch split it), from relu_grad's masks of a - b and b - a."""
    def rule(g: GradBuilder, a: Value, b: Value, y: Value, dy: Value) -> tuple:
        ahead, behind = g.emit("mp.sub", [a, b]), g.emit("mp.sub", [b, a])
        if not larger:
            ahead, behind = behind, ahead
        a_wins = g.emit("mp.relu_grad", [dy, ahead])
        b_wins = g.emit("mp.relu_grad", [dy, behind])
        rest = g.emit("mp.sub", [g.emit("mp.sub", [dy, a_wins]), b_wins])
        half_tie = _times(g, rest, 0.5)
        return (lambda: g.emit("mp.add", [a_wins, half_tie]),
                lambda: g.emit("mp.add", [b_wins, half_tie]))
    return _binary_vjp(rule)


_BINARY_VJP = {
    "maximum": _pick_vjp(larger=True),
    "minimum": _pick_vjp(larger=False),
    "add": _binary_vjp(lambda g, a, b, y, dy: (lambda: dy, lambda: dy)),
    "sub": _binary_vjp(lambda g, a, b, y, dy: (lambda: dy, lambda: g.emit("mp.neg", [dy]))),
    "mul": _binary_vjp(lambda g, a, b, y, dy: (lambda: g.emit("mp.mul", [dy, b]),
                                               lambda: g.emit("mp.mul", [dy, a]))),
    "div": _binary_vjp(lambda g, a, b, y, dy: (
        lambda: g.emit("mp.div", [dy, b]),
        lambda: g.emit("mp.neg", [g.emit("mp.div", [g.emit("mp.mul", [dy, y]), b])]))),
}


for _name, _fn, _allowed, _doc, _traits in (
    ("add", _add, _NUMERIC, "a + b", _ELEMENTWISE),
    ("sub", np.subtract, _NUMERIC, "a - b", _ELEMENTWISE),
    ("mul", np.multiply, _NUMERIC, "a * b", _ELEMENTWISE),
    # Integer division has no single convention (C truncates, numpy floors): floats only.
    ("div", np.divide, _FLOATS, "a / b (float types)", _ELEMENTWISE),
    ("maximum", np.maximum, _NUMERIC, "max(a, b), NaN propagating (ONNX Max)", _PICKS),
    ("minimum", np.minimum, _NUMERIC, "min(a, b), NaN propagating (ONNX Min)", _PICKS),
):
    _what = "a float" if _allowed is _FLOATS else "a numeric"
    _def(_name,
         vjp=_BINARY_VJP.get(_name),
         operands=("a", "b"),
         attrs={},
         infer=_binary_infer(_allowed, _what),
         reference=_binary_reference(_fn),
         flops=_per_element(1),
         precisions=_VECTOR,
         doc=f"Elementwise {_doc} with numpy broadcasting.",
         traits=_traits)


def _unary_reference(fn: Callable[[np.ndarray], np.ndarray]) -> _ImplReference:
    return lambda xs, a, rt: [fn(_num(xs[0]))]


def _relu(x: np.ndarray) -> np.ndarray:
    if x.dtype in (np.float32, np.float64) and x.size >= _COMPILED_FROM:
        from mplower.numerics.elementwise import relu  # np.maximum's bits, on two threads

        return relu(x)
    return np.maximum(x, x.dtype.type(0))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # Both branches exponentiate a non-positive number, so neither overflows.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def _rsqrt(x: np.ndarray) -> np.ndarray:
    return np.reciprocal(np.sqrt(x))


def _unary_vjp(rule: Callable[[GradBuilder, Value, Value, Value], Value]) -> Vjp:
    return lambda g, xs, y, dy, a, needs: [rule(g, xs[0], y, dy)]


_UNARY_VJP = {
    "neg": _unary_vjp(lambda g, x, y, dy: g.emit("mp.neg", [dy])),
    "relu": _unary_vjp(lambda g, x, y, dy: g.emit("mp.relu_grad", [dy, x])),
    "sigmoid": _unary_vjp(lambda g, x, y, dy: _mul(g, dy, y, _one_minus(g, y))),
    "tanh": _unary_vjp(lambda g, x, y, dy: g.emit("mp.mul", [dy, _one_minus(g, _mul(g, y, y))])),
    "exp": _unary_vjp(lambda g, x, y, dy: g.emit("mp.mul", [dy, y])),
    "log": _unary_vjp(lambda g, x, y, dy: g.emit("mp.div", [dy, x])),
    "sqrt": _unary_vjp(lambda g, x, y, dy: g.emit("mp.div", [_times(g, dy, 0.5), y])),
    "rsqrt": _unary_vjp(lambda g, x, y, dy: _mul(g, _times(g, dy, -0.5), y, y, y)),
}


for _name, _fn, _allowed, _doc, _traits in (
    ("neg", np.negative, _NUMERIC, "-x (ONNX Neg)", _PICKS),
    ("relu", _relu, _NUMERIC, "max(x, 0) (ONNX Relu)", _PICKS),
    ("sigmoid", _sigmoid, _FLOATS, "1 / (1 + exp(-x)) (ONNX Sigmoid)", _ELEMENTWISE),
    ("tanh", np.tanh, _FLOATS, "tanh(x)", _ELEMENTWISE),
    ("exp", np.exp, _FLOATS, "exp(x)", _ELEMENTWISE),
    ("log", np.log, _FLOATS, "natural logarithm", _ELEMENTWISE),
    ("sqrt", np.sqrt, _FLOATS, "square root", _ELEMENTWISE),
    ("rsqrt", _rsqrt, _FLOATS, "1 / sqrt(x)", _ELEMENTWISE),
):
    _what = "a float" if _allowed is _FLOATS else "a numeric"
    _def(_name,
         vjp=_UNARY_VJP[_name],
         operands=("x",),
         attrs={},
         infer=_unary_infer(_allowed, _what),
         reference=_unary_reference(_fn),
         flops=_per_element(1),
         precisions=_VECTOR,
         doc=f"Elementwise {_doc}.",
         traits=_traits)

def _relu_grad_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    dy, x = _num(xs[0]), _num(xs[1])
    return [np.where(x > 0, dy, dy.dtype.type(0))]


_def("relu_grad",
     operands=("dy", "x"),
     attrs={},
     infer=_binary_infer(_FLOATS, "a float"),
     reference=_relu_grad_reference,
     flops=_per_element(1),
     precisions=_VECTOR,
     doc="The gradient of relu: dy where x > 0, else 0 (the backward of mp.relu).",
     traits=_PICKS)

_ERFC_COEFFS = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807,
                -1.13520398, 1.48851587, -0.82215223, 0.17087277)


def _erfc(x: np.ndarray) -> np.ndarray:
    """erfc on float64 with relative error below 1.2e-7 everywhere (Chebyshev fit of Press et
    al., Numerical Recipes, erfcc): exact to float32, numpy-only, and relative (not absolute)
    so that GELU's far negative tail keeps its digits."""
    z = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = np.zeros_like(t)
    for c in reversed(_ERFC_COEFFS):
        poly = c + t * poly
    r = t * np.exp(poly - z * z)
    return np.where(x >= 0, r, 2.0 - r)


def _gelu_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x = _fl(xs[0])
    x64 = x.astype(np.float64)
    if a["approximate"] == "tanh":
        inner = math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)
        y = 0.5 * x64 * (1 + np.tanh(inner))
    else:
        y = 0.5 * x64 * _erfc(-x64 / math.sqrt(2))  # 1 + erf(v) == erfc(-v), without cancellation
    return [y.astype(x.dtype)]


def _gelu_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
              needs: Sequence[bool]) -> list[Value | None]:
    x = xs[0]
    if a["approximate"] == "tanh":  # d/dx 0.5 x (1 + tanh u), u = c (x + k x^3)
        c, k = math.sqrt(2 / math.pi), 0.044715
        x2 = _mul(g, x, x)
        u = _times(g, g.emit("mp.add", [x, _times(g, _mul(g, x2, x), k)]), c)
        t = g.emit("mp.tanh", [u])
        du = _times(g, g.emit("mp.add", [g.splat(1.0, (), g.type_of(x).elem),
                                        _times(g, x2, 3 * k)]), c)
        sech2 = _one_minus(g, _mul(g, t, t))
        half = _times(g, g.emit("mp.add", [g.splat(1.0, (), g.type_of(x).elem), t]), 0.5)
        d = g.emit("mp.add", [half, _times(g, _mul(g, x, sech2, du), 0.5)])
    else:  # Phi(x) + x phi(x)
        cdf = _times(g, g.emit("mp.add", [g.splat(1.0, (), g.type_of(x).elem),
                                         g.emit("mp.erf", [_times(g, x, 1 / math.sqrt(2))])]),
                     0.5)
        pdf = _times(g, g.emit("mp.exp", [_times(g, _mul(g, x, x), -0.5)]),
                     1 / math.sqrt(2 * math.pi))
        d = g.emit("mp.add", [cdf, _mul(g, x, pdf)])
    return [g.emit("mp.mul", [dy, d])]

# GELU: about 8 operations per element for the tanh form (cube, two multiply-adds, tanh, add,
# two multiplies); the erf form is counted the same.
_def("gelu",
     vjp=_gelu_vjp,
     operands=("x",),
     attrs={"approximate": AttrSpec("str", default="none", choices=("none", "tanh"))},
     infer=_unary_infer(_FLOATS, "a float"),
     reference=_gelu_reference,
     flops=_per_element(8),
     precisions=_VECTOR,
     doc="GELU, exact (erf) or tanh approximation (ONNX Gelu).",
     traits=_ELEMENTWISE)


def _erf_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    # math.erf (correctly rounded in float64) per element in a compiled loop; an erfc-based fit
    # would lose relative precision near 0, where erf(x) ~ 1.13 x.
    from mplower.numerics.special import erf

    return [erf(_fl(xs[0]))]


def _erf_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
             needs: Sequence[bool]) -> list[Value | None]:
    x = xs[0]
    e = g.emit("mp.exp", [g.emit("mp.neg", [_mul(g, x, x)])])
    return [_times(g, g.emit("mp.mul", [dy, e]), 2 / math.sqrt(math.pi))]

_def("erf",
     vjp=_erf_vjp,
     operands=("x",),
     attrs={},
     infer=_unary_infer(_FLOATS, "a float"),
     reference=_erf_reference,
     flops=_per_element(8),
     precisions=_VECTOR,
     doc="Elementwise Gauss error function (ONNX Erf).",
     traits=_ELEMENTWISE)
