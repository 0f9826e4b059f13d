"""ONNX import handlers of already-quantized models: MatMulInteger, ConvInteger, QLinearMatMul,
QLinearConv and DynamicQuantizeLinear.

Their integer semantics are kept exactly: the products run as mp.matmul / mp.conv2d on the
8-bit codes with an i32 accumulator (what the report shows as their precision), and the zero
points come off afterwards by the identity
    (a - za)(b - zb) summed = a.b - za * sum(b) - zb * sum(a) + K * za * zb,
all in i32 (as onnxruntime accumulates). A convolution whose input zero point is not 0 pads
its input with that zero point first, so that padded positions contribute nothing, as ONNX
says. The QLinear ops then requantize as onnxruntime does: the i32 sum as float32, times
a_scale * b_scale / y_scale (float32), rounded half to even, plus y's zero point, saturated.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.types import tensor
from mplower.onnx.importer.core import (
    ELEM_OF_ONNX,
    Const,
    Run,
    _attrs,
    _Importer,
    _reshape_to,
    _window_attrs,
    handler,
)

_CODES = ("i8", "ui8")
# What a contraction of codes is declared as: its accumulator's element type (the op's rule
# gives the shape).
_I32 = tensor((), "i32")


def _zero_point(imp: _Importer, i: int, what: str) -> np.ndarray | Run | None:
    """A zero point input: a constant as int64 (None if absent or all zero), or a runtime
    value in its own code type (DynamicQuantizeLinear's, in dynamically quantized models)."""
    v = imp.input(i)
    if v is None:
        return None
    if isinstance(v, Run):
        if v.type.elem not in _CODES or v.type.rank > 1:
            raise imp.error(f"{what} must be INT8 or UINT8, a scalar or 1-D, got {v.type}")
        return v
    zp = np.asarray(imp.const(i, what)).astype(np.int64)
    if zp.ndim > 1:
        raise imp.error(f"{what} must be a scalar or 1-D, got shape {list(zp.shape)}")
    return zp if np.any(zp != 0) else None


def _zp_i32(imp: _Importer, zp: np.ndarray | Run, shape: tuple[int, ...], hint: str) -> Run:
    """A zero point as i32, shaped `shape` to broadcast against the sums when it has one
    entry per row or channel, else a scalar."""
    if isinstance(zp, np.ndarray):
        return _i32(imp, zp.reshape(shape) if zp.size > 1 else zp.reshape(()), hint)
    wide = imp.emit("mp.cast", [zp], declared=zp.type.with_elem("i32"), hint=f"{hint}_i32")
    return _reshape_to(imp, wide, shape if zp.type.size > 1 else ())


def _both(imp: _Importer, k: int, za: np.ndarray | Run, zb: np.ndarray | Run,
          shapes: tuple[tuple[int, ...], tuple[int, ...]]) -> Run:
    """k * za * zb, the term both zero points add back (folded where both are constants)."""
    if isinstance(za, np.ndarray) and isinstance(zb, np.ndarray):
        a = za.reshape(shapes[0]) if za.size > 1 else za.reshape(())
        b = zb.reshape(shapes[1]) if zb.size > 1 else zb.reshape(())
        return _i32(imp, k * a * b, "zero_points")
    prod = imp.emit("mp.mul", [_zp_i32(imp, za, shapes[0], "za"),
                               _zp_i32(imp, zb, shapes[1], "zb")])
    return imp.emit("mp.mul", [prod, _i32(imp, np.array(k), "k")])


def _codes(imp: _Importer, i: int) -> Run:
    v = imp.run_input(i)
    if v.type.elem not in _CODES:
        raise imp.error(f"input '{imp.node.input[i]}' has {v.type}; the integer ops take "
                        f"INT8 or UINT8 codes")
    return v


def _i32(imp: _Importer, arr: np.ndarray, hint: str) -> Run:
    return imp.constant(np.asarray(arr).astype(np.int32), hint)


def _sum_i32(imp: _Importer, v: Run, axes: tuple[int, ...], hint: str) -> Run:
    """The sum of codes over `axes` (kept), in i32: folded where `v` is a constant."""
    arr = imp.const_of_node.get(v.value[0])
    if arr is not None:
        return _i32(imp, arr.astype(np.int64).sum(axis=axes, keepdims=True), hint)
    wide = imp.emit("mp.cast", [v], declared=v.type.with_elem("i32"), hint=f"{hint}_i32")
    return imp.emit("mp.reduce_sum", [wide], {"axes": axes, "keepdims": True}, hint=hint)


def _integer_matmul(imp: _Importer, a: Run, b: Run, za: np.ndarray | Run | None,
                    zb: np.ndarray | Run | None) -> Run:
    if a.type.rank < 2 or b.type.rank < 2:
        raise imp.error(f"integer matmul of {a.type} and {b.type}: mplower takes operands of "
                        f"rank 2 or more")
    k = a.type.shape[-1]
    y = imp.emit("mp.matmul", [a, b], declared=_I32)
    rows_of_a, cols_of_b = (a.type.shape[-2], 1), (b.type.shape[-1],)
    if za is not None:  # per row of a, or one for all
        cols = _sum_i32(imp, b, (b.type.rank - 2,), "colsum")
        y = imp.emit("mp.sub", [y, imp.emit("mp.mul", [
            cols, _zp_i32(imp, za, rows_of_a, "a_zero_point")])])
    if zb is not None:  # per column of b, or one for all
        rows = _sum_i32(imp, a, (a.type.rank - 1,), "rowsum")
        y = imp.emit("mp.sub", [y, imp.emit("mp.mul", [
            rows, _zp_i32(imp, zb, cols_of_b, "b_zero_point")])])
    if za is not None and zb is not None:
        y = imp.emit("mp.add", [y, _both(imp, k, za, zb, (rows_of_a, cols_of_b))])
    return y


def _pad_with(imp: _Importer, x: Run, pads: list[int], value: np.ndarray | Run) -> Run:
    """x (NCHW) with `value` around it: the zero point, which the shifted codes read as 0."""
    top, left, bottom, right = pads
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)

    def slab(shape: list[int]) -> Run:
        if isinstance(value, np.ndarray):
            return imp.constant(np.full(shape, value.reshape(-1)[0], dtype), "pad")
        one = _reshape_to(imp, value, (1, 1, 1, 1))
        return imp.emit("mp.expand", [one], declared=tensor(tuple(shape), x.type.elem),
                        onnx_type=x.onnx_type)

    for axis, before, after in ((2, top, bottom), (3, left, right)):
        shape = list(x.type.shape)
        parts = []
        for size in (before, after):
            shape[axis] = size
            parts.append(slab(shape) if size else None)
        pieces = [p for p in (parts[0], x, parts[1]) if p is not None]
        if len(pieces) > 1:
            x = imp.emit("mp.concat", pieces, {"axis": axis}, onnx_type=x.onnx_type)
    return x


def _integer_conv(imp: _Importer, node: onnx.NodeProto, x: Run, w: Run,
                  zx: np.ndarray | Run | None, zw: np.ndarray | Run | None) -> Run:
    if x.type.rank != 4 or w.type.rank != 4:
        raise imp.error(f"integer convolution of {x.type}: mplower takes 2-D (NCHW) ones")
    oc, cg, kh, kw = w.type.shape
    strides, pads, dilations = _window_attrs(imp, node, x.type.shape[2:], (kh, kw))
    groups = int(_attrs(node).get("group", 1))
    padding = (pads[0], pads[1], pads[2], pads[3])
    if zx is not None:
        if (zx.size if isinstance(zx, np.ndarray) else zx.type.size) != 1:
            raise imp.error("the input zero point of an integer convolution is one number")
        if isinstance(zx, Run) and zx.type.elem != x.type.elem:
            raise imp.error(f"x_zero_point {zx.type} and x {x.type} differ in type")
        if any(padding):
            x = _pad_with(imp, x, list(padding), zx)
            padding = (0, 0, 0, 0)
    attrs = {"strides": tuple(strides), "padding": padding, "dilations": tuple(dilations),
             "groups": groups}

    def conv(weights: Run) -> Run:
        return imp.emit("mp.conv2d", [x, weights], attrs, declared=_I32)

    y = conv(w)
    per_channel = (1, oc, 1, 1)
    if zx is not None:
        sums = _sum_i32(imp, w, (1, 2, 3), "weight_sums")  # (oc, 1, 1, 1)
        sums = imp.emit("mp.reshape", [sums], declared=tensor(per_channel, "i32"))
        y = imp.emit("mp.sub", [y, imp.emit("mp.mul", [
            sums, _zp_i32(imp, zx, (), "x_zero_point")])])
    if zw is not None:
        ones = imp.constant(np.ones(w.type.shape, np.int8), "ones")
        windows = conv(ones)  # the sum of the codes each output reads (its group's channels)
        y = imp.emit("mp.sub", [y, imp.emit("mp.mul", [
            windows, _zp_i32(imp, zw, per_channel, "w_zero_point")])])
        if zx is not None:
            y = imp.emit("mp.add", [y, _both(imp, cg * kh * kw, zx, zw, ((), per_channel))])
    return y


@handler("MatMulInteger")
def _matmul_integer(imp: _Importer, node: onnx.NodeProto) -> list:
    a, b = _codes(imp, 0), _codes(imp, 1)
    za = _zero_point(imp, 2, "a_zero_point")
    zb = _zero_point(imp, 3, "b_zero_point")
    return [_integer_matmul(imp, a, b, za, zb)]


@handler("ConvInteger")
def _conv_integer(imp: _Importer, node: onnx.NodeProto) -> list:
    x, w = _codes(imp, 0), _codes(imp, 1)
    zx = _zero_point(imp, 2, "x_zero_point")
    zw = _zero_point(imp, 3, "w_zero_point")
    return [_integer_conv(imp, node, x, w, zx, zw)]


def _requantize(imp: _Importer, acc: Run, multiplier: np.ndarray, i_scale: int,
                i_zp: int) -> Run:
    """acc (i32) as y's codes: round(float32(acc) * multiplier) + zero point, saturated."""
    ys = np.asarray(imp.const(i_scale, "y_scale"))
    yzp = imp.const(i_zp, "y_zero_point")
    if yzp is None:
        raise imp.error("mplower needs y_zero_point to know the result's type")
    yzp = np.asarray(yzp)
    elem = ELEM_OF_ONNX.get(helper.np_dtype_to_tensor_dtype(yzp.dtype))
    if elem not in _CODES or yzp.size != 1 or ys.size != 1:
        raise imp.error("y_scale and y_zero_point must be one number each, the zero point "
                        "INT8 or UINT8")
    mult = (multiplier.astype(np.float32) / np.float32(ys.reshape(()))).astype(np.float32)
    wide = imp.emit("mp.cast", [acc], declared=acc.type.with_elem("f32"))
    scaled = imp.emit("mp.mul", [wide, imp.constant(mult, "requant_scale")])
    return imp.emit("mp.quantize", [scaled], {"scale": 1.0,
                                              "zero_point": int(yzp.reshape(-1)[0])},
                    declared=scaled.type.with_elem(elem),
                    onnx_type=helper.np_dtype_to_tensor_dtype(yzp.dtype))


def _scale(imp: _Importer, i: int, what: str) -> np.ndarray:
    s = imp.const(i, what)
    if s is None:
        raise imp.error(f"{what} is required")
    return np.asarray(s, np.float32)


@handler("QLinearMatMul")
def _qlinear_matmul(imp: _Importer, node: onnx.NodeProto) -> list:
    a, b = _codes(imp, 0), _codes(imp, 3)
    sa, sb = _scale(imp, 1, "a_scale"), _scale(imp, 4, "b_scale")
    za = _zero_point(imp, 2, "a_zero_point")
    zb = _zero_point(imp, 5, "b_zero_point")
    acc = _integer_matmul(imp, a, b, za, zb)
    mult = sa.reshape(-1, 1) if sa.size > 1 else sa.reshape(())
    mult = mult * (sb.reshape(-1) if sb.size > 1 else sb.reshape(()))
    return [_requantize(imp, acc, mult, 6, 7)]


@handler("QLinearConv")
def _qlinear_conv(imp: _Importer, node: onnx.NodeProto) -> list:
    x, w = _codes(imp, 0), _codes(imp, 3)
    sx, sw = _scale(imp, 1, "x_scale"), _scale(imp, 4, "w_scale")
    zx = _zero_point(imp, 2, "x_zero_point")
    zw = _zero_point(imp, 5, "w_zero_point")
    acc = _integer_conv(imp, node, x, w, zx, zw)
    if imp.input(8) is not None:  # the bias: int32 codes at scale x_scale * w_scale
        bias = imp.run_input(8)
        if bias.type.elem != "i32" or bias.type.rank != 1:
            raise imp.error(f"the bias must be 1-D INT32, got {bias.type}")
        bias = imp.emit("mp.reshape", [bias], declared=tensor((1, bias.type.shape[0], 1, 1),
                                                               "i32"))
        acc = imp.emit("mp.add", [acc, bias])
    shape = (1, sw.size, 1, 1) if sw.size > 1 else ()
    return [_requantize(imp, acc, (sx.reshape(()) * sw).reshape(shape), 6, 7)]


@handler("DynamicQuantizeLinear")
def _dynamic_quantize_linear(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    if x.type.elem != "f32":
        raise imp.error(f"DynamicQuantizeLinear takes FLOAT, got {x.type}")
    outs: list[Run | Const | None] = []
    for name, op in zip(node.output, ("mp.dynamic_quantize", "mp.dynamic_quantize_scale",
                                      "mp.dynamic_quantize_zero_point")):
        wanted = bool(name) and bool(imp.consumers.get(name))
        outs.append(imp.emit(op, [x], hint=name) if wanted else None)
    return outs
