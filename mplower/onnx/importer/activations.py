"""ONNX import handlers: activations (Clip, HardSwish, Elu, ...), rounding, trigonometric and
hyperbolic functions, Mod, Hardmax, Mean, SwiGLU, the bitwise integer ops and EyeLike.

Each ONNX op is its mp op of mplower.dialect.mp.activations with the attributes that op
declares; Mean is the sum divided by the count and SwiGLU is Swish of the gate times the
value, as the ONNX definitions write them; EyeLike is a constant of the input's (static) shape.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.opdef import OPS
from mplower.ir.types import tensor
from mplower.numerics.formats import FORMATS
from mplower.onnx.importer.core import (
    _attrs,
    _Importer,
    _same_onnx,
    handler,
)

_UNARY = {
    "HardSigmoid": "mp.hard_sigmoid", "HardSwish": "mp.hard_swish", "LeakyRelu": "mp.leaky_relu",
    "Elu": "mp.elu", "Selu": "mp.selu", "Celu": "mp.celu", "Mish": "mp.mish",
    "Softplus": "mp.softplus", "Softsign": "mp.softsign", "ThresholdedRelu": "mp.thresholded_relu",
    "Swish": "mp.swish", "Shrink": "mp.shrink", "Abs": "mp.abs", "Sign": "mp.sign",
    "Floor": "mp.floor", "Ceil": "mp.ceil", "Round": "mp.round", "Sin": "mp.sin",
    "Cos": "mp.cos", "Tan": "mp.tan", "Asin": "mp.asin", "Acos": "mp.acos", "Atan": "mp.atan",
    "Sinh": "mp.sinh", "Cosh": "mp.cosh", "Asinh": "mp.asinh", "Acosh": "mp.acosh",
    "Atanh": "mp.atanh", "BitwiseNot": "mp.bitwise_not",
}


def _declared_attrs(node: onnx.NodeProto, op: str) -> dict:
    """The node's attributes that the mp op declares (older opsets carry others, such as
    Elu-1's `consumed_inputs`, that say nothing about the values)."""
    specs = OPS[op].attrs
    return {k: (float(v) if specs[k].kind == "float" else v)
            for k, v in _attrs(node).items() if k in specs}


@handler(*_UNARY)
def _unary(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    op = _UNARY[node.op_type]
    return [imp.emit(op, [x], _declared_attrs(node, op), onnx_type=x.onnx_type)]


def _extreme(dtype: np.dtype, upper: bool) -> np.ndarray:
    """The bound that clips nothing: +-inf for floats, the integer type's extreme."""
    if dtype.kind == "f" or dtype.kind == "V":  # "V": ml_dtypes' bfloat16
        return np.array(np.inf if upper else -np.inf, dtype)
    info = np.iinfo(dtype)
    return np.array(info.max if upper else info.min, dtype)


@handler("Clip")
def _clip(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    if imp.opset < 11:  # bounds are attributes, by default float's lowest and largest
        a = _attrs(node)
        big = float(np.finfo(np.float32).max)
        bounds = [imp.constant(np.array(a.get(k, d), dtype), f"{node.output[0]}_{k}")
                  for k, d in (("min", -big), ("max", big))]
    else:
        bounds = []
        for i, upper in ((1, False), (2, True)):
            if imp.input(i) is None:
                name = f"{node.output[0]}_{'max' if upper else 'min'}"
                bounds.append(imp.constant(_extreme(dtype, upper), name))
            else:
                b = imp.run_input(i)
                _same_onnx(imp, x, b)
                bounds.append(b)
    return [imp.emit("mp.clip", [x, *bounds], onnx_type=x.onnx_type)]


@handler("PRelu")
def _prelu(imp: _Importer, node: onnx.NodeProto) -> list:
    x, slope = imp.run_input(0), imp.run_input(1)
    _same_onnx(imp, x, slope)
    return [imp.emit("mp.prelu", [x, slope], onnx_type=x.onnx_type)]


@handler("Mod")
def _mod(imp: _Importer, node: onnx.NodeProto) -> list:
    a, b = imp.run_input(0), imp.run_input(1)
    _same_onnx(imp, a, b)
    fmod = bool(_attrs(node).get("fmod", 0))
    return [imp.emit("mp.mod", [a, b], {"fmod": fmod}, onnx_type=a.onnx_type)]


_BITWISE = {"BitwiseAnd": "mp.bitwise_and", "BitwiseOr": "mp.bitwise_or",
            "BitwiseXor": "mp.bitwise_xor"}


@handler(*_BITWISE, "BitShift")
def _bitwise(imp: _Importer, node: onnx.NodeProto) -> list:
    a, b = imp.run_input(0), imp.run_input(1)
    _same_onnx(imp, a, b)
    if node.op_type == "BitShift":
        attrs = {"direction": _attrs(node).get("direction", "")}
        return [imp.emit("mp.bit_shift", [a, b], attrs, onnx_type=a.onnx_type)]
    return [imp.emit(_BITWISE[node.op_type], [a, b], onnx_type=a.onnx_type)]


@handler("Hardmax")
def _hardmax(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    r = x.type.rank
    if imp.opset >= 13:
        axis = int(_attrs(node).get("axis", -1))
        return [imp.emit("mp.hardmax", [x], {"axis": axis}, onnx_type=x.onnx_type)]
    # Before opset 13 the input is coerced to 2-D, [prod(dims[:axis]), prod(dims[axis:])],
    # and the largest element is taken over the whole second dimension.
    axis = int(_attrs(node).get("axis", 1))
    if not -r <= axis <= r:
        raise imp.error(f"axis {axis} is out of range for an input of rank {r}")
    axis = axis + r if axis < 0 else axis
    if axis == r - 1:
        return [imp.emit("mp.hardmax", [x], {"axis": -1}, onnx_type=x.onnx_type)]
    shape = x.type.shape
    flat = imp.emit("mp.reshape", [x], declared=tensor(
        (math.prod(shape[:axis]), math.prod(shape[axis:])), x.type.elem),
        hint=f"{node.input[0]}_2d")
    y = imp.emit("mp.hardmax", [flat], {"axis": -1})
    return [imp.emit("mp.reshape", [y], declared=x.type, onnx_type=x.onnx_type)]


@handler("Mean")
def _mean(imp: _Importer, node: onnx.NodeProto) -> list:
    vals = [imp.run_input(i) for i in range(len(node.input)) if node.input[i]]
    acc = vals[0]
    for v in vals[1:]:
        _same_onnx(imp, acc, v)
        acc = imp.emit("mp.add", [acc, v], onnx_type=acc.onnx_type)
    if len(vals) == 1:
        return [acc]
    if not FORMATS[acc.type.elem].is_float:
        raise imp.error(f"Mean of {acc.type.elem} values: ONNX Mean takes float tensors")
    n = imp.constant(np.array(len(vals), helper.tensor_dtype_to_np_dtype(acc.onnx_type)),
                     f"{node.output[0]}_count")
    return [imp.emit("mp.div", [acc, n], onnx_type=acc.onnx_type)]


@handler("SwiGLU")
def _swiglu(imp: _Importer, node: onnx.NodeProto) -> list:
    gate, value = imp.run_input(0), imp.run_input(1)
    _same_onnx(imp, gate, value)
    if gate.type.shape != value.type.shape:
        raise imp.error(f"SwiGLU takes a gate and a value of one shape (no broadcasting), got "
                        f"{list(gate.type.shape)} and {list(value.type.shape)}")
    attrs = _declared_attrs(node, "mp.swish")
    s = imp.emit("mp.swish", [gate], attrs, hint=f"{node.output[0]}_gate")
    return [imp.emit("mp.mul", [s, value], onnx_type=gate.onnx_type)]
