"""ONNX import handlers: the reductions beyond sum, mean and max, TopK, and the normalizations
defined by a norm (LpNormalization, MeanVarianceNormalization).

ReduceMin and ReduceProd become their mp ops. The norm-like reductions are written as the
arithmetic of their ONNX definitions (ReduceL2 = sqrt(reduce_sum(x * x)), ...), which numpy and
onnxruntime compute the same way, so they need no op of their own and their sums take a
precision and an accumulator like any reduce_sum. Every form imports: axes as an attribute
(before opset 18) or as an input, keepdims, and noop_with_empty_axes (no axes: the elementwise
part alone, as ONNX's reference computes it).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.types import tensor
from mplower.numerics.formats import FLOATS
from mplower.onnx.importer.core import (
    SPELLED_DEFAULTS,
    Const,
    Run,
    _attrs,
    _axes,
    _Importer,
    _scalar,
    handler,
)


def _abs(imp: _Importer, x: Run) -> Run:
    """|x| from the ops the IR has: max(x, -x) is exact (and NaN stays NaN)."""
    return imp.emit("mp.maximum", [x, imp.emit("mp.neg", [x])])


def _square(imp: _Importer, x: Run) -> Run:
    return imp.emit("mp.mul", [x, x])


def _sum(imp: _Importer, x: Run, axes: tuple[int, ...] | None, keep: bool) -> Run:
    """reduce_sum over `axes` (None: no reduction at all, noop_with_empty_axes)."""
    if axes is None:
        return x
    return imp.emit("mp.reduce_sum", [x], {"axes": axes, "keepdims": keep})


def _log_sum_exp(imp: _Importer, x: Run, axes: tuple[int, ...] | None, keep: bool) -> Run:
    """m + log(sum(exp(x - m))) with m the maximum (kept), as ONNX's reference computes it, so
    that large logits do not overflow exp."""
    if axes is None:
        return imp.emit("mp.log", [imp.emit("mp.exp", [x])])
    m = imp.emit("mp.reduce_max", [x], {"axes": axes, "keepdims": True})
    e = imp.emit("mp.exp", [imp.emit("mp.sub", [x, m])])
    s = imp.emit("mp.log", [imp.emit("mp.reduce_sum", [e], {"axes": axes, "keepdims": True})])
    y = imp.emit("mp.add", [s, m])
    if keep:
        return y
    reduced = axes or range(x.type.rank)
    return imp.emit("mp.reshape", [y], declared=tensor(
        tuple(d for k, d in enumerate(y.type.shape) if k not in reduced), y.type.elem))


# name: (the arithmetic over x, with the reduction given; floats only; value over no elements)
_Lowering = Callable[[_Importer, Run, "tuple[int, ...] | None", bool], Run]
_NORMS: dict[str, tuple[_Lowering, bool, float]] = {
    "ReduceL1": (lambda imp, x, ax, k: _sum(imp, _abs(imp, x), ax, k), False, 0.0),
    "ReduceL2": (lambda imp, x, ax, k: imp.emit("mp.sqrt", [_sum(imp, _square(imp, x), ax, k)]),
                 True, 0.0),
    "ReduceSumSquare": (lambda imp, x, ax, k: _sum(imp, _square(imp, x), ax, k), False, 0.0),
    "ReduceLogSum": (lambda imp, x, ax, k: imp.emit("mp.log", [_sum(imp, x, ax, k)]), True,
                     -np.inf),
    "ReduceLogSumExp": (_log_sum_exp, True, -np.inf),
}
_OWN_OPS = {"ReduceMin": "mp.reduce_min", "ReduceProd": "mp.reduce_prod"}


def _reduction(imp: _Importer, node: onnx.NodeProto, x: Run) -> tuple[
        tuple[int, ...] | None, bool]:
    """(axes, keepdims): axes None where noop_with_empty_axes leaves x unreduced, () for all."""
    a = _attrs(node)
    axes = _axes(imp, node, 1, 18, x.type.rank)
    keep = bool(a.get("keepdims", 1))
    if not axes and a.get("noop_with_empty_axes", 0):
        return None, keep
    return tuple(axes or ()), keep


def _empty_result(imp: _Importer, x: Run, axes: tuple[int, ...], keep: bool,
                  value: float) -> Const | None:
    """Over no elements, a reduction is its identity, known from the shapes alone."""
    reduced = axes or tuple(range(x.type.rank))
    if not any(x.type.shape[k] == 0 for k in reduced):
        return None
    shape = tuple(1 if k in reduced else d for k, d in enumerate(x.type.shape)
                  if keep or k not in reduced)
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    if dtype.kind in "iu" and not np.isfinite(value):
        value = np.iinfo(dtype).max if value > 0 else np.iinfo(dtype).min
    return Const(np.full(shape, value, dtype))


@handler(*_NORMS, *_OWN_OPS)
def _reduce(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    axes, keep = _reduction(imp, node, x)
    if node.op_type in _OWN_OPS:
        identity = np.inf if node.op_type == "ReduceMin" else 1.0
    else:
        lower, floats_only, identity = _NORMS[node.op_type]
        if floats_only and x.type.elem not in FLOATS:
            raise imp.error(f"{node.op_type} of {x.type}: mplower imports it for float "
                            f"tensors only (its square root or logarithm is not an integer)")
    if axes is not None:
        empty = _empty_result(imp, x, axes, keep, identity)
        if empty is not None:
            return [empty]
    if node.op_type in _OWN_OPS:
        if axes is None:
            return [x]
        attrs = {"axes": axes, "keepdims": keep}
        if x.type.elem == "i1":  # the minimum of booleans is their minimum as 0/1 bytes
            wide = imp.emit("mp.cast", [x], declared=x.type.with_elem("ui8"))
            y = imp.emit(_OWN_OPS[node.op_type], [wide], attrs)
            return [imp.emit("mp.cast", [y], declared=y.type.with_elem("i1"),
                             onnx_type=x.onnx_type)]
        return [imp.emit(_OWN_OPS[node.op_type], [x], attrs, onnx_type=x.onnx_type)]
    return [lower(imp, x, axes, keep)]


# ---- TopK ------------------------------------------------------------------------------------


@handler("TopK")
def _topk(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    a = _attrs(node)
    if imp.opset < 10:
        k = int(a["k"])
    else:
        raw = imp.const(1, "k (the number of elements to keep)")
        k = int(np.asarray(raw).reshape(-1)[0])
    axis = int(a.get("axis", -1))
    if not -x.type.rank <= axis < x.type.rank:
        raise imp.error(f"axis {axis} is out of range for {x.type}")
    if not 0 <= k <= x.type.shape[axis]:
        raise imp.error(f"k = {k} is not in [0, {x.type.shape[axis]}] (dimension {axis} of "
                        f"{x.type})")
    # sorted = 0 leaves the order to the implementation; the sorted one is such an order.
    attrs = {"k": k, "axis": axis % x.type.rank, "largest": bool(a.get("largest", 1))}
    wanted = [bool(name) and bool(imp.consumers.get(name)) for name in node.output]
    values = imp.emit("mp.topk", [x], attrs, onnx_type=x.onnx_type) if wanted[0] else None
    indices = imp.emit("mp.topk_indices", [x], attrs,
                       hint=node.output[1]) if len(wanted) > 1 and wanted[1] else None
    return [values, indices]


# ---- normalizations by a norm ----------------------------------------------------------------


@handler("LpNormalization")
def _lp_normalization(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    a = _attrs(node)
    p = int(a.get("p", 2))
    axis = int(a.get("axis", -1))
    if p not in (1, 2):
        raise imp.error(f"p = {p}: ONNX LpNormalization takes p = 1 or 2")
    if x.type.elem not in FLOATS:
        raise imp.error(f"LpNormalization of {x.type}: mplower imports it for float tensors")
    if not -x.type.rank <= axis < x.type.rank:
        raise imp.error(f"axis {axis} is out of range for {x.type}")
    axes = (axis % x.type.rank,)
    if p == 1:
        norm = _sum(imp, _abs(imp, x), axes, True)
    else:
        norm = imp.emit("mp.sqrt", [_sum(imp, _square(imp, x), axes, True)])
    # A zero norm gives zeros rather than 0/0 (onnxruntime and ONNX's reference agree).
    zero = _scalar(imp, 0.0, x)
    is_zero = imp.emit("mp.equal", [norm, zero])
    return [imp.emit("mp.where", [is_zero, zero, imp.emit("mp.div", [x, norm])],
                     onnx_type=x.onnx_type)]


SPELLED_DEFAULTS["MeanVarianceNormalization"] = {"axes": [0, 2, 3]}


@handler("MeanVarianceNormalization")
def _mean_variance_normalization(imp: _Importer, node: onnx.NodeProto) -> list:
    """ONNX's function body: (x - E[x]) / (sqrt(E[x^2] - E[x]^2) + 1e-9)."""
    x = imp.run_input(0)
    if x.type.elem not in FLOATS:
        raise imp.error(f"MeanVarianceNormalization of {x.type}: mplower imports it for float "
                        f"tensors")
    rank = x.type.rank
    raw = _attrs(node).get("axes", [0, 2, 3])
    if any(not -rank <= ax < rank for ax in raw):
        raise imp.error(f"axes {list(raw)} are out of range for {x.type}")
    axes = tuple(sorted({ax % rank for ax in raw}))
    attrs = {"axes": axes, "keepdims": True}
    mean = imp.emit("mp.reduce_mean", [x], attrs)
    mean_sq = imp.emit("mp.reduce_mean", [_square(imp, x)], attrs)
    var = imp.emit("mp.sub", [mean_sq, _square(imp, mean)])
    std = imp.emit("mp.add", [imp.emit("mp.sqrt", [var]), _scalar(imp, 1e-9, x)])
    return [imp.emit("mp.div", [imp.emit("mp.sub", [x, mean]), std], onnx_type=x.onnx_type)]
