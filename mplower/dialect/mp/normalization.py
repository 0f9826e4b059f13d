"""Normalizations (softmax, log_softmax, lrn, layer_norm, rms_norm) and the reductions (reduce_sum,
reduce_mean, reduce_max, argmax).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from mplower.dialect.mp.common import (
    _FLOATS,
    _NUMERIC,
    _PRESERVES,
    _SUMS,
    _VECTOR,
    _axis,
    _broadcast_to,
    _def,
    _elem_of,
    _fl,
    _ImplInfer,
    _ImplReference,
    _mul,
    _num,
    _per_element,
    _per_input_element,
    _prod,
    _times,
)
from mplower.ir.opdef import AttrSpec, GradBuilder, OpError, Value, Vjp, show_value
from mplower.ir.types import TensorType, tensor

# ---------------------------------------------------------------------------------------------
# Sums of floats are accumulated in float64 and rounded once to the operand's precision. A float32
# running sum (numpy's order when the summed axis is not the innermost one) loses a few ulps per
# hundred terms; the float64 sum of float32 terms is exact to about 1e-16 relative in any order,
# so the rounded result is nearly always the correctly rounded sum (tests/test_fp32_sums.py),
# and it stays a fixed function of the terms: numpy's order, single-threaded. A layer norm
# written as E[x^2] - E[x]^2 (magika, docs/benchmarks.md) magnifies the sums' errors.


def _sum(x: np.ndarray, axis: int | tuple[int, ...] | None, keepdims: bool = False
         ) -> np.ndarray:
    if x.dtype.kind != "f" or x.dtype == np.float64:
        return np.sum(x, axis=axis, keepdims=keepdims)
    return np.sum(x, axis=axis, dtype=np.float64, keepdims=keepdims).astype(x.dtype)


def _mean(x: np.ndarray, axis: int | tuple[int, ...] | None, keepdims: bool = False
          ) -> np.ndarray:
    if x.dtype == np.float64:
        return np.mean(x, axis=axis, keepdims=keepdims)
    return np.mean(x, axis=axis, dtype=np.float64, keepdims=keepdims).astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# Normalizations


def _softmax_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    elem = _elem_of(ins, _FLOATS, "a float")
    _axis(a["axis"], ins[0].rank)
    return [tensor(ins[0].shape, elem)]


def _softmax_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x = _fl(xs[0])
    axis = a["axis"]
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return [e / _sum(e, axis, keepdims=True)]


def _softmax_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
                 needs: Sequence[bool]) -> list[Value | None]:
    dot = g.emit("mp.reduce_sum", [_mul(g, dy, y)], {"axes": (a["axis"],), "keepdims": True})
    return [g.emit("mp.mul", [y, g.emit("mp.sub", [dy, dot])])]

# Softmax: 5 operations per element (max, subtract, exp, sum, divide).
_def("softmax",
     vjp=_softmax_vjp,
     operands=("x",),
     attrs={"axis": AttrSpec("int", default=-1)},
     infer=_softmax_infer,
     reference=_softmax_reference,
     flops=_per_element(5),
     precisions=_VECTOR,
     doc="Softmax along one axis (ONNX Softmax, opset 13).")


def _log_softmax_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x = _fl(xs[0])
    d = x - np.max(x, axis=a["axis"], keepdims=True)
    return [d - np.log(_sum(np.exp(d), a["axis"], keepdims=True))]


def _log_softmax_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
                     needs: Sequence[bool]) -> list[Value | None]:
    total = g.emit("mp.reduce_sum", [dy], {"axes": (a["axis"],), "keepdims": True})
    return [g.emit("mp.sub", [dy, _mul(g, g.emit("mp.exp", [y]), total)])]

# LogSoftmax: 5 operations per element (max, subtract, exp, sum, subtract; one log per row).
_def("log_softmax",
     vjp=_log_softmax_vjp,
     operands=("x",),
     attrs={"axis": AttrSpec("int", default=-1)},
     infer=_softmax_infer,
     reference=_log_softmax_reference,
     flops=_per_element(5),
     precisions=_VECTOR,
     doc="log(softmax(x)) along one axis, computed as x - max - log(sum(exp(x - max))) "
         "(ONNX LogSoftmax, opset 13).")


def _lrn_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x = ins[0]
    if x.rank < 3:
        raise OpError(f"operand #0 must have rank >= 3 (N, C, spatial...), got {x}", operand=0)
    return [tensor(x.shape, _elem_of(ins, _FLOATS, "a float"))]


def _lrn_window(size: int) -> tuple[int, int]:
    """How many channels before and after c ONNX LRN's window of `size` reads."""
    return (size - 1) // 2, size - 1 - (size - 1) // 2


def _lrn_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x = _fl(xs[0])
    size = a["size"]
    lo, hi = _lrn_window(size)
    sq = np.square(x.astype(np.float64))
    pads = [(0, 0)] * x.ndim
    pads[1] = (lo, hi)
    win = np.lib.stride_tricks.sliding_window_view(np.pad(sq, pads), size, axis=1)
    scale = a["bias"] + a["alpha"] / size * win.sum(axis=-1)
    return [(x / scale ** a["beta"]).astype(x.dtype)]


def _channel_window_sum(g: GradBuilder, v: Value, before: int, after: int) -> Value:
    """For each channel c, the sum of v over channels c - before .. c + after (clipped): the
    zero-padded channel axis sliced once per window position, the slices added."""
    t = g.type_of(v)
    channels = t.shape[1]

    def zeros(k: int) -> list[Value]:
        return [g.splat(0.0, t.shape[:1] + (k,) + t.shape[2:], t.elem)] if k else []
    parts = [*zeros(before), v, *zeros(after)]
    padded = g.emit("mp.concat", parts, {"axis": 1}) if len(parts) > 1 else v
    total = None
    for m in range(before + after + 1):
        starts = [0, m] + [0] * (t.rank - 2)
        part = g.emit("mp.slice", [padded], {"starts": starts,
                                             "ends": [t.shape[0], m + channels, *t.shape[2:]]})
        total = part if total is None else g.emit("mp.add", [total, part])
    return total


def _lrn_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
             needs: Sequence[bool]) -> list[Value | None]:
    """With s = bias + alpha/size * window_sum(x^2), y = x s^-beta:
    dx = dy s^-beta - 2 alpha beta / size * x * window_sum'(dy x s^(-beta-1)), where
    window_sum' sums over the channels whose window holds c (the window mirrored)."""
    x = xs[0]
    elem = g.type_of(x).elem
    size, beta = a["size"], a["beta"]
    lo, hi = _lrn_window(size)
    sq = _channel_window_sum(g, g.emit("mp.mul", [x, x]), lo, hi)
    s = g.emit("mp.add", [_times(g, sq, a["alpha"] / size), g.splat(a["bias"], (), elem)])
    s_beta = g.emit("mp.pow", [s, g.splat(-beta, (), elem)])
    direct = g.emit("mp.mul", [dy, s_beta])
    back = _mul(g, dy, x, g.emit("mp.div", [s_beta, s]))
    spread = _channel_window_sum(g, back, hi, lo)
    cross = _times(g, g.emit("mp.mul", [x, spread]), -2 * a["alpha"] * beta / size)
    return [g.emit("mp.add", [direct, cross])]


# LRN: a square and an add per window element, then scale, power and divide.
_def("lrn",
     vjp=_lrn_vjp,
     operands=("x",),
     attrs={"size": AttrSpec("int", required=True, min=1),
            "alpha": AttrSpec("float", default=1e-4),
            "beta": AttrSpec("float", default=0.75),
            "bias": AttrSpec("float", default=1.0)},
     infer=_lrn_infer,
     reference=_lrn_reference,
     flops=lambda ins, a: (2 * a["size"] + 3) * ins[0].size,
     precisions=_VECTOR,
     doc="Local response normalization across channels: x / (bias + alpha / size * "
         "sum of x^2 over `size` neighbouring channels)^beta (ONNX LRN).")


def _norm_infer(params: tuple[str, ...]) -> _ImplInfer:
    def infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
        elem = _elem_of(ins, _FLOATS, "a float")
        x = ins[0]
        axis = _axis(a["axis"], x.rank)
        want = tensor(x.shape[axis:], elem)
        for i, pname in enumerate(params, start=1):
            if ins[i].shape != want.shape:
                raise OpError(f"operand #{i} ({pname}) must have type {want} (the shape of x "
                              f"from axis {axis} on), got {ins[i]}", operand=i)
        return [tensor(x.shape, elem)]
    return infer


def _norm_axes(x: np.ndarray, axis: int) -> tuple[int, ...]:
    return tuple(range(axis % x.ndim, x.ndim))


def _layer_norm_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x, gamma, beta = (_fl(v) for v in xs)
    axes = _norm_axes(x, a["axis"])
    d = x - _mean(x, axes, keepdims=True)
    var = _mean(d * d, axes, keepdims=True)
    return [d / np.sqrt(var + x.dtype.type(a["epsilon"])) * gamma + beta]


def _rms_norm_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x, gamma = (_fl(v) for v in xs)
    ms = _mean(x * x, _norm_axes(x, a["axis"]), keepdims=True)
    return [x / np.sqrt(ms + x.dtype.type(a["epsilon"])) * gamma]


def _norm_vjp(centered: bool) -> Vjp:
    """layer_norm (`centered`) and rms_norm: recompute x-hat and 1/sigma, then
    dx = (dxhat - [mean(dxhat)] - xhat mean(dxhat xhat)) / sigma with dxhat = dy gamma."""
    def vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
            needs: Sequence[bool]) -> list[Value | None]:
        x, gamma = xs[0], xs[1]
        tx = g.type_of(x)
        axis = a["axis"] % tx.rank
        norm = {"axes": tuple(range(axis, tx.rank)), "keepdims": True}
        d = g.emit("mp.sub", [x, g.emit("mp.reduce_mean", [x], norm)]) if centered else x
        var = g.emit("mp.reduce_mean", [_mul(g, d, d)], norm)
        r = g.emit("mp.rsqrt", [g.emit("mp.add", [var, g.splat(a["epsilon"], (), tx.elem)])])
        xhat = g.emit("mp.mul", [d, r])
        out: list[Value | None] = [None] * len(xs)
        if needs[0]:
            dxhat = g.emit("mp.mul", [dy, gamma])
            inner = g.emit("mp.sub", [dxhat, _mul(g, xhat, g.emit(
                "mp.reduce_mean", [_mul(g, dxhat, xhat)], norm))])
            if centered:
                inner = g.emit("mp.sub", [inner, g.emit("mp.reduce_mean", [dxhat], norm)])
            out[0] = g.emit("mp.mul", [inner, r])
        lead = {"axes": tuple(range(axis)), "keepdims": False}

        def over_lead(v: Value) -> Value:
            return g.emit("mp.reduce_sum", [v], lead) if axis else v
        if needs[1]:
            out[1] = over_lead(g.emit("mp.mul", [dy, xhat]))
        if centered and needs[2]:
            out[2] = over_lead(dy)
        return out
    return vjp

_NORM_ATTRS = {"axis": AttrSpec("int", default=-1),
               "epsilon": AttrSpec("float", default=1e-5, min=0.0)}

# LayerNorm: 8 operations per element (mean, subtract, square, variance sum, normalize,
# scale, shift, and the rsqrt amortized); RMSNorm: 4 (square, sum, normalize, scale).
_def("layer_norm",
     vjp=_norm_vjp(centered=True),
     operands=("x", "gamma", "beta"),
     attrs=_NORM_ATTRS,
     infer=_norm_infer(("gamma", "beta")),
     reference=_layer_norm_reference,
     flops=_per_element(8),
     precisions=_VECTOR,
     doc="Layer normalization over the axes from `axis` on (ONNX LayerNormalization).")
_def("rms_norm",
     vjp=_norm_vjp(centered=False),
     operands=("x", "gamma"),
     attrs=_NORM_ATTRS,
     infer=_norm_infer(("gamma",)),
     reference=_rms_norm_reference,
     flops=_per_element(4),
     precisions=_VECTOR,
     doc="RMS normalization over the axes from `axis` on (ONNX RMSNormalization).")


# ---------------------------------------------------------------------------------------------
# Reductions


def _reduce_axes(a: dict, rank: int) -> tuple[int, ...]:
    axes = tuple(_axis(ax, rank, "axes") for ax in a["axes"])
    if len(set(axes)) != len(axes):
        raise OpError(f"attribute 'axes' repeats an axis: {show_value(a['axes'])}", operand=0)
    return axes or tuple(range(rank))  # ONNX: no axes reduces over all of them


def _reduced_shape(shape: tuple[int, ...], axes: tuple[int, ...], keep: bool) -> tuple:
    if keep:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _reduce_infer(allowed: frozenset[str], what: str) -> _ImplInfer:
    def infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
        elem = _elem_of(ins, allowed, what)
        axes = _reduce_axes(a, ins[0].rank)
        return [tensor(_reduced_shape(ins[0].shape, axes, a["keepdims"]), elem)]
    return infer


def _reduce_reference(fn: Callable[..., np.ndarray]) -> _ImplReference:
    def reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
        x = _num(xs[0])
        return [np.asarray(fn(x, axis=_reduce_axes(a, x.ndim), keepdims=a["keepdims"]))]
    return reference


def _reduce_vjp(mean: bool) -> Vjp:
    def vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
            needs: Sequence[bool]) -> list[Value | None]:
        tx = g.type_of(xs[0])
        axes = _reduce_axes(a, tx.rank)
        kept = tensor(_reduced_shape(tx.shape, axes, True), tx.elem)
        d = dy if a["keepdims"] else g.emit("mp.reshape", [dy], result=kept)
        if mean:
            d = _times(g, d, 1 / _prod(tx.shape[i] for i in axes))
        return [_broadcast_to(g, d, tx.shape)]
    return vjp


_REDUCE_VJP = {
    "reduce_sum": _reduce_vjp(False), "reduce_mean": _reduce_vjp(True),
    "reduce_max": lambda g, xs, y, dy, a, needs: [g.emit(
        "mp.reduce_max_grad", [dy, xs[0], y], {"axes": a["axes"], "keepdims": a["keepdims"]})],
}

_REDUCE_ATTRS = {"axes": AttrSpec("ints", default=()), "keepdims": AttrSpec("bool", default=True)}

for _name, _fn, _allowed, _doc, _traits in (
    ("reduce_sum", _sum, _NUMERIC, "Sum", _SUMS),
    ("reduce_mean", _mean, _FLOATS, "Mean", _SUMS),
    ("reduce_max", np.max, _NUMERIC, "Maximum", _PRESERVES),
):
    _what = "a float" if _allowed is _FLOATS else "a numeric"
    _def(_name,
         vjp=_REDUCE_VJP.get(_name),
         operands=("x",),
         attrs=_REDUCE_ATTRS,
         infer=_reduce_infer(_allowed, _what),
         reference=_reduce_reference(_fn),
         flops=_per_input_element,
         precisions=_VECTOR,
         doc=f"{_doc} over `axes` (all when empty), optionally keeping them as 1 "
             f"(ONNX Reduce{_doc.capitalize().replace('Maximum', 'Max')}).",
         traits=_traits)


def _reduce_max_grad_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    dy, x, y = ins
    elem = _elem_of(ins, _FLOATS, "a float")
    want = _reduced_shape(x.shape, _reduce_axes(a, x.rank), a["keepdims"])
    for i, t in ((0, dy), (2, y)):
        if t.shape != want:
            raise OpError(f"operand #{i} must have the reduced shape {want} of x, got {t}",
                          operand=i)
    return [tensor(x.shape, elem)]


def _reduce_max_grad_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    dy, x, y = (_fl(v) for v in xs)
    axes = _reduce_axes(a, x.ndim)
    kept = _reduced_shape(x.shape, axes, True)
    hit = x == y.reshape(kept)
    share = hit / hit.sum(axis=axes, keepdims=True)  # tied maxima share the gradient, as JAX's
    return [(dy.reshape(kept) * share).astype(dy.dtype)]


_def("reduce_max_grad",
     operands=("dy", "x", "y"),
     attrs=_REDUCE_ATTRS,
     infer=_reduce_max_grad_infer,
     reference=_reduce_max_grad_reference,
     flops=lambda ins, a: 2 * ins[1].size,
     precisions=_VECTOR,
     doc="The gradient of reduce_max (y its result): dy to the elements equal to the maximum, "
         "shared equally among ties.")


def _argmax_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    _elem_of(ins, _NUMERIC, "a numeric")
    axis = _axis(a["axis"], ins[0].rank)
    # i32, as before the IR had i64 (plans and reports rely on it); the ONNX importer casts it
    # to ONNX's INT64.
    return [tensor(_reduced_shape(ins[0].shape, (axis,), a["keepdims"]), "i32")]


def _argmax_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    return [np.argmax(xs[0], axis=a["axis"], keepdims=a["keepdims"])]


_def("argmax",
     operands=("x",),
     attrs={"axis": AttrSpec("int", default=0),
            "keepdims": AttrSpec("bool", default=True)},
     infer=_argmax_infer,
     reference=_argmax_reference,
     flops=_per_input_element,
     precisions=_VECTOR,
     doc="Index (i32) of the first maximum along `axis` (ONNX ArgMax).")
