"""The reductions and selections that ONNX has beyond sum, mean and max: reduce_min,
reduce_prod, argmin and top-k (its values and its indices, two single-result ops).

ReduceL1, ReduceL2, ReduceSumSquare, ReduceLogSum(Exp), LpNormalization and
MeanVarianceNormalization need no op of their own: the importer writes them as the arithmetic
their ONNX definitions spell out (mplower.onnx.importer.reductions), so their sums get an
accumulator and a precision like any other reduce_sum.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mplower.dialect.mp.common import (
    _NUMERIC,
    _PRESERVES,
    _VECTOR,
    _axis,
    _def,
    _elem_of,
    _num,
    _per_input_element,
    _zeros_like,
)
from mplower.dialect.mp.normalization import (
    _REDUCE_ATTRS,
    _reduce_infer,
    _reduce_reference,
    _reduced_shape,
)
from mplower.ir.opdef import AttrSpec, GradBuilder, OpError, Value
from mplower.ir.types import TensorType, tensor

# The minimum's cotangent goes where the maximum's would: to the elements equal to the result,
# shared among ties (reduce_max_grad asks only which elements equal y).
_def("reduce_min",
     vjp=lambda g, xs, y, dy, a, needs: [g.emit(
         "mp.reduce_max_grad", [dy, xs[0], y], {"axes": a["axes"], "keepdims": a["keepdims"]})],
     operands=("x",),
     attrs=_REDUCE_ATTRS,
     infer=_reduce_infer(_NUMERIC, "a numeric"),
     reference=_reduce_reference(np.min),
     flops=_per_input_element,
     precisions=_VECTOR,
     doc="Minimum over `axes` (all when empty), optionally keeping them as 1 (ONNX ReduceMin).",
     traits=_PRESERVES)


# No gradient rule: dy * y / x is wrong wherever x is zero, and the exact one (the product of
# the others) is no mp op.
_def("reduce_prod",
     operands=("x",),
     attrs=_REDUCE_ATTRS,
     infer=_reduce_infer(_NUMERIC, "a numeric"),
     reference=_reduce_reference(np.prod),
     flops=_per_input_element,
     precisions=_VECTOR,
     doc="Product over `axes` (all when empty; 1 over none), optionally keeping them as 1 "
         "(ONNX ReduceProd).")


def _argmin_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    _elem_of(ins, _NUMERIC, "a numeric")
    axis = _axis(a["axis"], ins[0].rank)
    # i32 as mp.argmax's, so that the importer treats the two alike.
    return [tensor(_reduced_shape(ins[0].shape, (axis,), a["keepdims"]), "i32")]


_def("argmin",
     operands=("x",),
     attrs={"axis": AttrSpec("int", default=0), "keepdims": AttrSpec("bool", default=True)},
     infer=_argmin_infer,
     reference=lambda xs, a, rt: [np.argmin(xs[0], axis=a["axis"], keepdims=a["keepdims"])],
     flops=_per_input_element,
     precisions=_VECTOR,
     doc="Index (i32) of the first minimum along `axis` (ONNX ArgMin).")


# ---------------------------------------------------------------------------------------------
# Top-k. ONNX's TopK has two results; here the values and the indices are two ops over the same
# selection (`_top_k`), so each is an ordinary single-result op for the passes and the report.

_TOPK_ATTRS = {"k": AttrSpec("int", required=True, min=0), "axis": AttrSpec("int", default=-1),
               "largest": AttrSpec("bool", default=True)}


def _topk_shape(ins: tuple, a: dict) -> tuple[int, ...]:
    _elem_of(ins, _NUMERIC, "a numeric")
    x = ins[0]
    axis = _axis(a["axis"], x.rank)
    if a["k"] > x.shape[axis]:
        raise OpError(f"k = {a['k']} is larger than dimension {axis} of {x}", operand=0)
    return x.shape[:axis] + (a["k"],) + x.shape[axis + 1:]


def _top_k(x: np.ndarray, a: dict) -> np.ndarray:
    """Indices of the k largest (smallest) elements along the axis, in that order; of equal
    elements the one with the lower index comes first (ONNX TopK)."""
    axis = a["axis"] % x.ndim
    x = _num(x)
    if a["largest"]:
        # A stable ascending sort of the reversed axis, read backwards: descending, and of
        # equal elements the lower original index first.
        n = x.shape[axis]
        order = n - 1 - np.flip(np.argsort(np.flip(x, axis), axis=axis, kind="stable"), axis)
    else:
        order = np.argsort(x, axis=axis, kind="stable")
    return np.take(order, np.arange(a["k"]), axis=axis)


def _topk_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x = xs[0]
    return [np.take_along_axis(x, _top_k(x, a), axis=a["axis"] % x.ndim)]


def _topk_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
              needs: Sequence[bool]) -> list[Value | None]:
    # Each value's cotangent goes back to the element it was taken from.
    idx = g.emit("mp.topk_indices", [xs[0]], dict(a))
    return [g.emit("mp.scatter_elements_add", [_zeros_like(g, xs[0]), idx, dy],
                   {"axis": a["axis"]})]


_def("topk",
     vjp=_topk_vjp,
     operands=("x",),
     attrs=_TOPK_ATTRS,
     infer=lambda ins, a, declared: [tensor(_topk_shape(ins, a), ins[0].elem)],
     reference=_topk_reference,
     flops=_per_input_element,
     precisions=_VECTOR,
     doc="The `k` largest (or smallest) elements along `axis`, in that order; of equal "
         "elements the lower index first (ONNX TopK's values).",
     traits=_PRESERVES)

_def("topk_indices",
     operands=("x",),
     attrs=_TOPK_ATTRS,
     infer=lambda ins, a, declared: [tensor(_topk_shape(ins, a), "i64")],
     reference=lambda xs, a, rt: [_top_k(xs[0], a)],
     flops=_per_input_element,
     precisions=_VECTOR,
     doc="Where along `axis` mp.topk takes its values from (i64; ONNX TopK's indices).")
