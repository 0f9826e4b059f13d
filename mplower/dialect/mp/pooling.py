"""Pooling: max_pool2d, avg_pool2d, their gradients, global_avg_pool."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mplower.dialect.mp.common import (
    _FLOATS,
    _NUMERIC,
    _VECTOR,
    _WINDOW_ATTRS,
    _broadcast_to,
    _def,
    _elem_of,
    _fl,
    _ImplInfer,
    _need_rank,
    _num,
    _per_input_element,
    _prod,
    _times,
    _window_out,
)
from mplower.ir.opdef import AttrSpec, GradBuilder, OpError, Value, Vjp
from mplower.ir.types import TensorType, tensor

# ---------------------------------------------------------------------------------------------
# Pooling


_POOL_ATTRS = {"kernel": AttrSpec("ints", required=True, length=2, min=1), **_WINDOW_ATTRS}


def _pool_shape(x: TensorType, a: dict) -> tuple[int, ...]:
    _need_rank(x, 4, 0, "NCHW")
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = a["kernel"], a["strides"], a["padding"]
    # A pad at least as wide as the kernel would leave windows that see only padding.
    if max(pt, pb) >= kh or max(pl, pr) >= kw:
        raise OpError(f"attribute 'padding' {list(a['padding'])} must be smaller than the "
                      f"kernel {list(a['kernel'])}", operand=0)
    n, c, h, w = x.shape
    if kh > h + pt + pb or kw > w + pl + pr:
        raise OpError(f"pool kernel {kh}x{kw} is larger than the padded input "
                      f"{h + pt + pb}x{w + pl + pr}", operand=0)
    return n, c, _window_out(h, pt + pb, kh, sh), _window_out(w, pl + pr, kw, sw)


def _pool_infer(allowed: frozenset[str], what: str) -> _ImplInfer:
    def infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
        return [tensor(_pool_shape(ins[0], a), _elem_of(ins, allowed, what))]
    return infer


def _max_pool_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    from mplower.numerics.pool import max_pool2d

    return [max_pool2d(_num(xs[0]), a["kernel"], a["strides"], a["padding"])]


def _avg_pool_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    from mplower.numerics.pool import avg_pool2d

    return [avg_pool2d(_fl(xs[0]), a["kernel"], a["strides"], a["padding"])]


def _pool_flops(ins: Sequence[TensorType], a: dict) -> int:
    kh, kw = a["kernel"]
    return _prod(_pool_shape(ins[0], a)) * kh * kw  # one compare or add per window element


def _pool_vjp(grad_op: str) -> Vjp:
    return lambda g, xs, y, dy, a, needs: [g.emit(grad_op, [dy, xs[0]], {
        "kernel": a["kernel"], "strides": a["strides"], "padding": a["padding"]})]


def _pool_grad_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    dy, x = ins
    elem = _elem_of(ins, _FLOATS, "a float")
    if dy.shape != _pool_shape(x, a):
        raise OpError(f"operand #0 must have the pooled shape of x {_pool_shape(x, a)}, got {dy}",
                      operand=0)
    return [tensor(x.shape, elem)]


def _pool_grad_flops(ins: Sequence[TensorType], a: dict) -> int:
    kh, kw = a["kernel"]
    return ins[0].size * kh * kw  # one multiply-add per window element


def _scatter_windows(values: np.ndarray, x_shape: tuple, a: dict,
                     weights: np.ndarray) -> np.ndarray:
    """Sum `values` (N, C, Ho, Wo) times `weights` (.., Ho, Wo, KH, KW) into the padded input
    positions each window covers, in one fixed order, then strip the padding."""
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = a["kernel"], a["strides"], a["padding"]
    n, c, h, w = x_shape
    out = np.zeros((n, c, h + pt + pb, w + pl + pr), values.dtype)
    ho, wo = values.shape[2:]
    for i in range(kh):
        for j in range(kw):
            out[:, :, i:i + sh * ho:sh, j:j + sw * wo:sw] += values * weights[..., i, j]
    return out[:, :, pt:pt + h, pl:pl + w]


def _max_pool_grad_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    # numerics.windows also holds numba kernels: imported where a gradient needs it, so that
    # loading the dialect (every command does) does not import numba.
    from mplower.numerics.windows import conv_windows, pad_hw

    dy, x = _fl(xs[0]), _fl(xs[1])
    win = conv_windows(pad_hw(x, a["padding"], -np.inf), a["kernel"], a["strides"])
    flat = win.reshape(win.shape[:4] + (-1,))
    first = np.argmax(flat, axis=-1)  # the first maximum of a window takes its gradient
    onehot = np.arange(flat.shape[-1]) == first[..., None]
    return [_scatter_windows(dy, x.shape, a, onehot.reshape(win.shape).astype(dy.dtype))]


def _avg_pool_grad_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    from mplower.numerics.windows import conv_windows, pad_hw

    dy, x = _fl(xs[0]), _fl(xs[1])
    ones = pad_hw(np.ones((1, 1) + x.shape[2:], dy.dtype), a["padding"])
    inside = conv_windows(ones, a["kernel"], a["strides"])
    share = inside / inside.sum(axis=(-2, -1), keepdims=True)  # padding not counted
    return [_scatter_windows(dy, x.shape, a, share)]


_def("max_pool2d_grad",
     operands=("dy", "x"),
     attrs=_POOL_ATTRS,
     infer=_pool_grad_infer,
     reference=_max_pool_grad_reference,
     flops=_pool_grad_flops,
     precisions=_VECTOR,
     doc="The gradient of max_pool2d: each window's dy goes to its first maximum in x.")
_def("avg_pool2d_grad",
     operands=("dy", "x"),
     attrs=_POOL_ATTRS,
     infer=_pool_grad_infer,
     reference=_avg_pool_grad_reference,
     flops=_pool_grad_flops,
     precisions=_VECTOR,
     doc="The gradient of avg_pool2d: each window's dy shared by its non-padding elements "
         "(x gives the shape).")


_def("max_pool2d",
     vjp=_pool_vjp("mp.max_pool2d_grad"),
     operands=("x",),
     attrs=_POOL_ATTRS,
     infer=_pool_infer(_NUMERIC, "a numeric"),
     reference=_max_pool_reference,
     flops=_pool_flops,
     precisions=_VECTOR,
     # Not VALUE_PRESERVING, though it picks operand values: a window of padding alone yields
     # -inf, which f8E4M3FN cannot hold, so its results are rounded.
     doc="2-D max pooling over NCHW windows; padding never wins (ONNX MaxPool).")
_def("avg_pool2d",
     vjp=_pool_vjp("mp.avg_pool2d_grad"),
     operands=("x",),
     attrs=_POOL_ATTRS,
     infer=_pool_infer(_FLOATS, "a float"),
     reference=_avg_pool_reference,
     flops=_pool_flops,
     precisions=_VECTOR,
     doc="2-D average pooling, padding not counted (ONNX AveragePool, count_include_pad=0).")


def _global_pool_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
                     needs: Sequence[bool]) -> list[Value | None]:
    tx = g.type_of(xs[0])
    return [_broadcast_to(g, _times(g, dy, 1 / _prod(tx.shape[2:])), tx.shape)]

def _global_pool_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x = ins[0]
    if x.rank < 3:
        raise OpError(f"operand #0 must have rank >= 3 (N, C, spatial...), got {x}", operand=0)
    return [tensor(x.shape[:2] + (1,) * (x.rank - 2), _elem_of(ins, _FLOATS, "a float"))]


_def("global_avg_pool",
     vjp=_global_pool_vjp,
     operands=("x",),
     attrs={},
     infer=_global_pool_infer,
     reference=lambda xs, a, rt: [_fl(xs[0]).mean(axis=tuple(range(2, xs[0].ndim)), keepdims=True)],
     flops=_per_input_element,
     precisions=_VECTOR,
     doc="Mean over all spatial dimensions, keeping them as 1 (ONNX GlobalAveragePool).")
