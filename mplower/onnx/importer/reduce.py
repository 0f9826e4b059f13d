"""ONNX import handlers: reductions and arg-reductions."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.onnx.importer.core import (
    Const,
    _as_int64,
    _attrs,
    _axes,
    _Importer,
    handler,
)

# ---- reductions ------------------------------------------------------------------------------

_REDUCE = {"ReduceMean": ("mp.reduce_mean", 18), "ReduceSum": ("mp.reduce_sum", 13),
           "ReduceMax": ("mp.reduce_max", 18)}


@handler(*_REDUCE)
def _reduce(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    op, since = _REDUCE[node.op_type]
    a = _attrs(node)
    axes = _axes(imp, node, 1, since, x.type.rank)
    keep = bool(a.get("keepdims", 1))
    if not axes:
        if a.get("noop_with_empty_axes", 0):
            return [x]
        axes = []
    attrs = {"axes": tuple(axes), "keepdims": keep}
    reduced = axes or range(x.type.rank)
    if op == "mp.reduce_max" and any(x.type.shape[ax] == 0 for ax in reduced):
        # The maximum of nothing is ONNX's -inf (the lowest value): known from the shapes alone.
        shape = tuple(1 if k in reduced else d for k, d in enumerate(x.type.shape) if keep
                      or k not in reduced)
        dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
        low = -np.inf if dtype.kind == "f" else (False if dtype.kind == "b"
                                                 else np.iinfo(dtype).min)
        return [Const(np.full(shape, low, dtype))]
    if x.type.elem == "i1":  # reduce booleans as 0/1 bytes
        wide = imp.emit("mp.cast", [x], declared=x.type.with_elem("ui8"))
        y = imp.emit(op, [wide], attrs)
        return [imp.emit("mp.cast", [y], declared=y.type.with_elem("i1"), onnx_type=x.onnx_type)]
    return [imp.emit(op, [x], attrs, onnx_type=x.onnx_type)]


@handler("ArgMax", "ArgMin")
def _argmax(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    op = "mp.argmax" if node.op_type == "ArgMax" else "mp.argmin"
    a = _attrs(node)
    axis = int(a.get("axis", 0))
    keep = bool(a.get("keepdims", 1))
    if not -x.type.rank <= axis < x.type.rank:
        raise imp.error(f"axis {axis} is out of range for {x.type}")
    axis %= x.type.rank
    if not a.get("select_last_index", 0):
        idx = imp.emit(op, [x], {"axis": axis, "keepdims": keep})
        return [_as_int64(imp, idx)]
    # The last maximum (minimum) is the first one of the reversed axis, counted from the end.
    n = x.type.shape[axis]
    starts = [0] * x.type.rank
    ends = list(x.type.shape)
    steps = [1] * x.type.rank
    starts[axis], ends[axis], steps[axis] = -1, -(n + 1), -1
    rev = imp.emit("mp.slice", [x], {"starts": tuple(starts), "ends": tuple(ends),
                                     "steps": tuple(steps)}, hint=f"{node.input[0]}_reversed")
    idx = imp.emit(op, [rev], {"axis": axis, "keepdims": keep})
    last = imp.constant(np.array(n - 1, np.int32), "last_index")
    return [_as_int64(imp, imp.emit("mp.sub", [last, idx]))]
