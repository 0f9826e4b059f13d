"""ONNX import handlers: QuantizeLinear / DequantizeLinear."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.types import DenseAttr, tensor, value_dtype
from mplower.numerics.formats import FORMATS, QUANT_STORAGE, QUANT_WIDE
from mplower.onnx.importer.core import (
    ELEM_OF_ONNX,
    Run,
    _attrs,
    _Importer,
    handler,
    onnx_type_name,
)

# ---- quantization ----------------------------------------------------------------------------


def _quant_params(imp: _Importer, node: onnx.NodeProto, rank: int, blocked: bool = False):
    """(attributes, scale, zero point, axis); `blocked`: the caller takes block_size, whose
    scale and zero point have the input's rank (mp.quantize's blocked form)."""
    a = _attrs(node)
    if a.get("block_size", 0) and not blocked:
        raise imp.error("blocked quantization (block_size) to float8 is not supported")
    scale = imp.const(1, "the scale")
    zp = imp.const(2, "the zero point")
    axis = int(a.get("axis", 1))
    if a.get("block_size", 0):
        if not -rank <= axis < rank:
            raise imp.error(f"axis {axis} is out of range for rank {rank}")
        if scale.ndim != rank or (zp is not None and zp.shape != scale.shape):
            raise imp.error("blocked scale and zero point must have the rank of the input")
        return a, scale, zp, axis % rank
    if scale.ndim > 1 or (zp is not None and zp.ndim > 1):
        raise imp.error("scale and zero point must be scalars or 1-D (per axis)")
    if scale.size > 1:
        if not -rank <= axis < rank:
            raise imp.error(f"axis {axis} is out of range for rank {rank}")
        axis %= rank
    return a, scale, zp, axis


def _number_attr(arr: np.ndarray, elem: str) -> Any:
    arr = np.asarray(arr)
    if arr.size == 1:
        v = arr.reshape(-1)[0]
        return float(v) if FORMATS[elem].is_float else int(v)
    vals = arr.reshape(-1).astype(value_dtype(elem))
    return DenseAttr(vals, tensor(vals.shape, elem))


def _along(arr: np.ndarray, rank: int, axis: int) -> np.ndarray:
    if arr.size == 1:
        return arr.reshape(())
    shape = [1] * rank
    shape[axis] = arr.size
    return arr.reshape(shape)


@handler("QuantizeLinear")
def _quantize(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    zp0 = imp.const(2, "the zero point")  # its type is the quantized type
    q_elem = None if zp0 is None else ELEM_OF_ONNX.get(helper.np_dtype_to_tensor_dtype(zp0.dtype))
    integer = q_elem is None or (q_elem in FORMATS and FORMATS[q_elem].is_int)
    a, scale, zp, axis = _quant_params(imp, node, x.type.rank, blocked=integer)
    if zp is not None:
        qtype = helper.np_dtype_to_tensor_dtype(zp.dtype)
    else:
        qtype = int(a.get("output_dtype", 0)) or TensorProto.UINT8
    elem = ELEM_OF_ONNX.get(qtype)
    if elem is None or elem in ("f32", "f64", "f16", "bf16", "i32", "i1"):
        raise imp.error(f"quantization to {onnx_type_name(qtype)}: mplower quantizes to "
                        f"INT8, UINT8, INT4, INT16, UINT16, FLOAT8E4M3FN and FLOAT8E5M2")
    if elem.startswith("f8"):
        if zp is not None and np.any(zp.astype(np.float32) != 0):
            raise imp.error("a float8 zero point must be 0")
        s = imp.constant(_along(scale, x.type.rank, axis).astype(
            helper.tensor_dtype_to_np_dtype(x.onnx_type)), f"{node.input[1]}")
        q = imp.emit("mp.div", [x, s], hint=f"{node.output[0]}_scaled")
        attrs = {} if a.get("saturate", 1) else {"saturate": False}
        return [imp.emit("mp.cast", [q], attrs, declared=q.type.with_elem(elem),
                         onnx_type=qtype)]
    if a.get("block_size", 0):  # one scale per block along axis (ONNX opset 21)
        attrs = {"scale": DenseAttr(scale.astype(np.float32), tensor(scale.shape, "f32")),
                 "axis": axis, "block_size": int(a["block_size"])}
        if zp is not None:
            attrs["zero_point"] = DenseAttr(zp.astype(np.int64), tensor(zp.shape, elem))
        return [imp.emit("mp.quantize", [x], attrs, declared=x.type.with_elem(elem),
                         onnx_type=qtype)]
    attrs = {"scale": _number_attr(scale.astype(np.float32), "f32")}
    if zp is not None:
        attrs["zero_point"] = _number_attr(zp.astype(np.int64), elem)
    if scale.size > 1:
        attrs["axis"] = axis
    return [imp.emit("mp.quantize", [x], attrs, declared=x.type.with_elem(elem),
                     onnx_type=qtype)]


def _blocked_dequantize(imp: _Importer, node: onnx.NodeProto, x: Run) -> Run:
    """(x - zero_point) * scale with one scale per block of `block_size` elements along
    `axis`: the parameters repeated to x's shape, then plain f32 arithmetic (exact as ONNX)."""
    a = _attrs(node)
    block, rank = int(a["block_size"]), x.type.rank
    axis = int(a.get("axis", 1))
    if not -rank <= axis < rank:
        raise imp.error(f"axis {axis} is out of range for rank {rank}")
    axis %= rank
    scale = imp.const(1, "the scale")
    zp = imp.const(2, "the zero point")
    n = x.type.shape[axis]

    def expand(v: np.ndarray) -> np.ndarray:
        if v.ndim != rank:
            raise imp.error("blocked scale and zero point must have the rank of the input")
        return np.repeat(v, block, axis=axis).take(range(n), axis=axis)
    out_type = int(a.get("output_dtype", 0)) or helper.np_dtype_to_tensor_dtype(scale.dtype)
    out_elem = ELEM_OF_ONNX.get(out_type)
    if out_elem is None or not FORMATS[out_elem].is_float or not FORMATS[x.type.elem].is_int:
        raise imp.error("blocked dequantization takes an integer input and a float scale")
    dtype = helper.tensor_dtype_to_np_dtype(out_type)
    y = imp.emit("mp.cast", [x], declared=x.type.with_elem(out_elem), hint=f"{node.input[0]}_wide")
    if zp is not None and np.any(zp != 0):
        y = imp.emit("mp.sub", [y, imp.constant(expand(zp).astype(dtype), node.input[2])])
    s = imp.constant(expand(scale).astype(dtype), node.input[1])
    return imp.emit("mp.mul", [y, s], onnx_type=out_type)


@handler("DequantizeLinear")
def _dequantize(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    if _attrs(node).get("block_size", 0):
        return [_blocked_dequantize(imp, node, x)]
    a, scale, zp, axis = _quant_params(imp, node, x.type.rank)
    out_type = int(a.get("output_dtype", 0)) or helper.np_dtype_to_tensor_dtype(scale.dtype)
    out_elem = ELEM_OF_ONNX.get(out_type)
    if out_elem is None or not FORMATS[out_elem].is_float:
        raise imp.error(f"dequantization to {onnx_type_name(out_type)} is not supported")
    if x.type.elem.startswith("f8"):
        if zp is not None and np.any(zp.astype(np.float32) != 0):
            raise imp.error("a float8 zero point must be 0")
        wide = imp.emit("mp.cast", [x], declared=x.type.with_elem(out_elem),
                        hint=f"{node.input[0]}_wide")
        s = imp.constant(_along(scale, x.type.rank, axis).astype(
            helper.tensor_dtype_to_np_dtype(out_type)), f"{node.input[1]}")
        return [imp.emit("mp.mul", [wide, s], onnx_type=out_type)]
    if x.type.elem not in QUANT_STORAGE + QUANT_WIDE:
        raise imp.error(f"dequantization of {onnx_type_name(x.onnx_type)} is not supported")
    attrs = {"scale": _number_attr(scale.astype(np.float32), "f32")}
    if zp is not None:
        attrs["zero_point"] = _number_attr(zp.astype(np.int64), x.type.elem)
    if scale.size > 1:
        attrs["axis"] = axis
    return [imp.emit("mp.dequantize", [x], attrs, declared=x.type.with_elem(out_elem),
                     onnx_type=out_type)]
