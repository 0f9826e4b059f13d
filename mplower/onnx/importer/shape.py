"""ONNX import handlers: shapes, constants and data movement."""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.types import tensor
from mplower.onnx.importer.core import (
    Const,
    Run,
    _attrs,
    _axes,
    _fill,
    _Importer,
    _reshape_to,
    _same_onnx,
    _shape_of,
    handler,
)


@handler("Shape")
def _shape(imp: _Importer, node: onnx.NodeProto) -> list:
    shape = _shape_of(imp.need(0))
    a = _attrs(node)
    r = len(shape)
    start, end = a.get("start", 0), a.get("end", r)
    start, end = (max(0, min(r, s + r if s < 0 else s)) for s in (start, end))
    return [Const(np.array(shape[start:end], np.int64))]


@handler("Constant")
def _constant(imp: _Importer, node: onnx.NodeProto) -> list:
    return [Const(_constant_value(imp, node))]


def _constant_value(imp: _Importer, node: onnx.NodeProto) -> np.ndarray:
    a = _attrs(node)
    if isinstance(a.get("value"), TensorProto):
        return imp._tensor_array(a["value"])
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32),
                       ("value_int", np.int64), ("value_ints", np.int64)):
        if key in a:
            return np.array(a[key], dtype)
    raise imp.error(f"Constant with {', '.join(a) or 'no value'} is not supported "
                    f"(numeric value, value_float(s), value_int(s) are)")


@handler("ConstantOfShape")
def _constant_of_shape(imp: _Importer, node: onnx.NodeProto) -> list:
    shape = imp.const(0, "the shape")
    return [Const(_fill(imp, node, shape))]


@handler("Reshape")
def _reshape(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    if imp.opset < 5:
        target = list(_attrs(node)["shape"])
    else:
        target = [int(d) for d in imp.const(1, "the target shape")]
    allowzero = _attrs(node).get("allowzero", 0)
    shape = list(target)
    for k, d in enumerate(target):
        if d == 0 and not allowzero:
            if k >= x.type.rank:
                raise imp.error(f"target shape {target} copies dimension {k}, which the input "
                                f"{x.type} lacks")
            shape[k] = x.type.shape[k]
    if any(d < -1 for d in shape):
        raise imp.error(f"target shape {target} has a negative dimension other than -1")
    if shape.count(-1) > 1:
        raise imp.error(f"target shape {target} has more than one -1")
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        if known == 0 or x.type.size % known:
            raise imp.error(f"cannot reshape {x.type} to {target}")
        shape[shape.index(-1)] = x.type.size // known
    if math.prod(shape) != x.type.size:
        raise imp.error(f"cannot reshape {x.type} ({x.type.size} elements) to {target}")
    return [_reshape_to(imp, x, shape)]


@handler("Flatten")
def _flatten(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    axis = int(_attrs(node).get("axis", 1))
    return [imp.emit("mp.flatten", [x], {"axis": axis}, onnx_type=x.onnx_type)]


@handler("Squeeze")
def _squeeze(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    axes = _axes(imp, node, 1, 13, x.type.rank)
    shape = x.type.shape
    if axes is None:
        axes = [k for k, d in enumerate(shape) if d == 1]
    for ax in axes:
        if shape[ax] != 1:
            raise imp.error(f"cannot squeeze dimension {ax} of {x.type}: it is not 1")
    return [_reshape_to(imp, x, [d for k, d in enumerate(shape) if k not in axes])]


@handler("Unsqueeze")
def _unsqueeze(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    axes = imp.const(1, "axes") if imp.opset >= 13 else _attrs(node).get("axes")
    axes = [int(a) for a in np.asarray(axes).reshape(-1)]
    r = x.type.rank + len(axes)
    axes = sorted(a % r if -r <= a < r else a for a in axes)
    shape = list(x.type.shape)
    for ax in axes:
        if not 0 <= ax < r:
            raise imp.error(f"axis {ax} is out of range for output rank {r}")
        shape.insert(ax, 1)
    return [_reshape_to(imp, x, shape)]


@handler("Transpose")
def _transpose(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    perm = tuple(_attrs(node).get("perm", reversed(range(x.type.rank))))
    return [imp.emit("mp.transpose", [x], {"perm": perm}, onnx_type=x.onnx_type)]


@handler("Concat")
def _concat(imp: _Importer, node: onnx.NodeProto) -> list:
    vals = [imp.run_input(i) for i in range(len(node.input)) if node.input[i]]
    for v in vals[1:]:
        _same_onnx(imp, vals[0], v)
    axis = int(_attrs(node).get("axis", 1))  # required from opset 4 on; 1 before
    return [imp.emit("mp.concat", vals, {"axis": axis}, onnx_type=vals[0].onnx_type)]


@handler("Slice")
def _slice(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    shape = x.type.shape
    r = len(shape)
    if imp.opset < 10:
        a = _attrs(node)
        starts, ends = list(a["starts"]), list(a["ends"])
        axes = list(a.get("axes", range(len(starts))))
        steps = [1] * len(starts)
    else:
        starts = imp.const(1, "starts").reshape(-1).tolist()
        ends = imp.const(2, "ends").reshape(-1).tolist()
        axes_arr = imp.const(3, "axes")
        axes = axes_arr.reshape(-1).tolist() if axes_arr is not None else list(range(len(starts)))
        steps_arr = imp.const(4, "steps")
        steps = steps_arr.reshape(-1).tolist() if steps_arr is not None else [1] * len(starts)
    full_s, full_e, full_st = [0] * r, list(shape), [1] * r
    for ax, s, e, st in zip(axes, starts, ends, steps):
        if not -r <= ax < r:
            raise imp.error(f"axis {ax} is out of range for rank {r}")
        ax %= r
        if st == 0:
            raise imp.error("a slice step of 0")
        # Beyond +-(dim + 1) every bound clamps the same way: keep the attribute small.
        bound = shape[ax] + 1
        full_s[ax] = max(-bound, min(bound, int(s)))
        full_e[ax] = max(-bound, min(bound, int(e)))
        full_st[ax] = int(st)
    if full_s == [0] * r and full_e == list(shape) and full_st == [1] * r:
        return [x]
    attrs = {"starts": tuple(full_s), "ends": tuple(full_e), "steps": tuple(full_st)}
    return [imp.emit("mp.slice", [x], attrs, onnx_type=x.onnx_type)]


@handler("Expand")
def _expand(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    target = tuple(int(d) for d in imp.const(1, "the shape").reshape(-1))
    try:  # ONNX broadcasts both ways: a 1 in the target keeps x's dimension
        shape = np.broadcast_shapes(x.type.shape, target)
    except ValueError:
        raise imp.error(f"{x.type} does not broadcast with the shape {list(target)}") from None
    if shape == x.type.shape:
        return [x]
    return [imp.emit("mp.expand", [x], declared=tensor(shape, x.type.elem),
                     onnx_type=x.onnx_type)]


@handler("Trilu")
def _trilu(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    k = imp.const(1, "k")
    attrs = {"upper": bool(_attrs(node).get("upper", 1)),
             "k": int(k.reshape(-1)[0]) if k is not None else 0}
    return [imp.emit("mp.trilu", [x], attrs, onnx_type=x.onnx_type)]


@handler("CumSum")
def _cumsum(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    a = _attrs(node)
    attrs = {"axis": int(imp.const(1, "the axis").reshape(-1)[0]),
             "exclusive": bool(a.get("exclusive", 0)), "reverse": bool(a.get("reverse", 0))}
    return [imp.emit("mp.cumsum", [x], attrs, onnx_type=x.onnx_type)]


@handler("Split")
def _split(imp: _Importer, node: onnx.NodeProto) -> list:
    """One mp.split, a result per output (unused outputs too: the sizes say where the used
    ones start)."""
    x = imp.run_input(0)
    a = _attrs(node)
    r = x.type.rank
    axis = int(a.get("axis", 0))
    if not -r <= axis < r:
        raise imp.error(f"axis {axis} is out of range for rank {r}")
    axis %= r
    dim, parts = x.type.shape[axis], len(node.output)
    sizes = imp.const(1, "the split sizes") if imp.opset >= 13 else a.get("split")
    if sizes is not None and len(np.reshape(sizes, -1)):
        sizes = [int(s) for s in np.reshape(sizes, -1)]
        if len(sizes) != parts or sum(sizes) != dim or min(sizes) < 0:
            raise imp.error(f"split sizes {sizes} do not cut dimension {axis} ({dim}) into "
                            f"{parts} outputs")
    else:  # equal parts, the last one smaller (opset 18 num_outputs)
        step = -(-dim // parts)
        sizes = [max(0, min(step, dim - k * step)) for k in range(parts)]
    if parts == 1:
        return [x]
    first = imp.emit("mp.split", [x], {"axis": axis, "sizes": tuple(sizes)},
                     hint=next((o for o in node.output if o), "split"), onnx_type=x.onnx_type)
    split = first.value[0]
    return [Run((split, k), t, x.onnx_type) if name else None
            for k, (name, t) in enumerate(zip(node.output, imp.f.types(split)))]


@handler("Range")
def _range(imp: _Importer, node: onnx.NodeProto) -> list:
    """Position ids: the shape of a Range's result is its values, so it exists only as a
    constant (the walk folds a Range of constants; here one bound is a runtime value)."""
    start, limit, delta = (imp.const(i, what) for i, what in
                           enumerate(("Range's start", "Range's limit", "Range's delta")))
    return [Const(np.arange(start, limit, delta).astype(start.dtype))]


@handler("Size")
def _size(imp: _Importer, node: onnx.NodeProto) -> list:
    return [Const(np.array(math.prod(_shape_of(imp.need(0))), np.int64))]
