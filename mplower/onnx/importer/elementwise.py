"""ONNX import handlers: arithmetic, activations, comparisons and casts."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.numerics.formats import FORMATS
from mplower.onnx.importer.core import (
    ELEM_OF_ONNX,
    Const,
    Run,
    Unbound,
    _attrs,
    _Importer,
    _same_onnx,
    handler,
    onnx_type_name,
)

_BINARY = {"Add": "mp.add", "Sub": "mp.sub", "Mul": "mp.mul", "Div": "mp.div"}


@handler("Add", "Sub", "Mul", "Div")
def _binary(imp: _Importer, node: onnx.NodeProto) -> list:
    a, b = imp.run_input(0), imp.run_input(1)
    _same_onnx(imp, a, b)
    if node.op_type == "Div" and FORMATS[a.type.elem].is_int:
        # ONNX integer division truncates toward zero. In f64 the quotient of two integers
        # below 2^31 never rounds across an integer, and mp.cast truncates: exact.
        fa = imp.emit("mp.cast", [a], declared=a.type.with_elem("f64"), hint=node.input[0])
        fb = imp.emit("mp.cast", [b], declared=b.type.with_elem("f64"), hint=node.input[1])
        q = imp.emit("mp.div", [fa, fb])
        return [imp.emit("mp.cast", [q], declared=q.type.with_elem(a.type.elem),
                         onnx_type=a.onnx_type)]
    return [imp.emit(_BINARY[node.op_type], [a, b], onnx_type=a.onnx_type)]


_VARIADIC = {"Sum": "mp.add", "Max": "mp.maximum", "Min": "mp.minimum"}


@handler("Sum", "Max", "Min")
def _variadic(imp: _Importer, node: onnx.NodeProto) -> list:
    vals = [imp.run_input(i) for i in range(len(node.input)) if node.input[i]]
    acc = vals[0]
    for v in vals[1:]:
        _same_onnx(imp, acc, v)
        acc = imp.emit(_VARIADIC[node.op_type], [acc, v], onnx_type=acc.onnx_type)
    return [acc]


_UNARY = {"Neg": "mp.neg", "Relu": "mp.relu", "Sigmoid": "mp.sigmoid", "Tanh": "mp.tanh",
          "Exp": "mp.exp", "Log": "mp.log", "Sqrt": "mp.sqrt", "Erf": "mp.erf"}


@handler(*_UNARY)
def _unary(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    return [imp.emit(_UNARY[node.op_type], [x], onnx_type=x.onnx_type)]


@handler("Reciprocal")
def _reciprocal(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    one = imp.constant(np.ones((), helper.tensor_dtype_to_np_dtype(x.onnx_type)), "one")
    return [imp.emit("mp.div", [one, x], onnx_type=x.onnx_type)]


@handler("Gelu")
def _gelu(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    approx = _attrs(node).get("approximate", "none")
    return [imp.emit("mp.gelu", [x], {"approximate": approx}, onnx_type=x.onnx_type)]


@handler("Identity")
def _identity(imp: _Importer, node: onnx.NodeProto) -> list:
    return [imp.need(0)]


@handler("Dropout")
def _dropout(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.need_tensor(0)
    a = _attrs(node)
    training = bool(a.get("is_test", 1) == 0) if imp.opset < 7 else False
    if imp.opset >= 12:
        t = imp.const(2, "training_mode")
        training = bool(t) if t is not None else False
        ratio = imp.const(1, "ratio")
        ratio = float(ratio) if ratio is not None else 0.5
    else:
        ratio = float(a.get("ratio", 0.5))
    if training and ratio > 0:
        if not imp.eval_mode:
            raise imp.error("training-mode dropout is random; mplower imports inference "
                            "graphs: export the model in eval mode, or import it with "
                            "--eval-mode to take this Dropout as the identity")
        imp.eval_mode_note(f"training-mode dropout (ratio {ratio:g}) imported as the identity")
    shape = x.array.shape if isinstance(x, Const) else x.type.shape
    return [x, Const(np.ones(shape, np.bool_))]


@handler("Cast", "CastLike")
def _cast(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    a = _attrs(node)
    if node.op_type == "Cast":
        to = a["to"]
    else:  # the element type of the second input (the expanded function graphs use it)
        like = imp.need(1)
        to = like.onnx_type if isinstance(like, (Run, Unbound)) else \
            helper.np_dtype_to_tensor_dtype(like.array.dtype)
    elem = ELEM_OF_ONNX.get(to)
    if elem is None:
        raise imp.error(f"Cast to {onnx_type_name(to)}: the IR has no such element type")
    if to == x.onnx_type:
        return [x]
    attrs = {}
    if elem.startswith("f8") and not a.get("saturate", 1):
        attrs["saturate"] = False
    return [imp.emit("mp.cast", [x], attrs, declared=x.type.with_elem(elem), onnx_type=to)]


@handler("Where")
def _where(imp: _Importer, node: onnx.NodeProto) -> list:
    cond, x, y = (imp.run_input(i) for i in range(3))
    _same_onnx(imp, x, y)
    return [imp.emit("mp.where", [cond, x, y], onnx_type=x.onnx_type)]


_COMPARE = {"Equal": "mp.equal", "Less": "mp.less", "LessOrEqual": "mp.less_equal",
            "Greater": "mp.greater", "GreaterOrEqual": "mp.greater_equal",
            "And": "mp.logical_and", "Or": "mp.logical_or", "Xor": "mp.logical_xor"}


@handler(*_COMPARE)
def _compare(imp: _Importer, node: onnx.NodeProto) -> list:
    a, b = imp.run_input(0), imp.run_input(1)
    _same_onnx(imp, a, b)
    return [imp.emit(_COMPARE[node.op_type], [a, b], onnx_type=TensorProto.BOOL)]


@handler("Not")
def _not(imp: _Importer, node: onnx.NodeProto) -> list:
    return [imp.emit("mp.logical_not", [imp.run_input(0)], onnx_type=TensorProto.BOOL)]


@handler("IsNaN", "IsInf")
def _is_special(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    if node.op_type == "IsNaN":
        return [imp.emit("mp.isnan", [x], onnx_type=TensorProto.BOOL)]
    a = _attrs(node)
    attrs = {"detect_negative": bool(a.get("detect_negative", 1)),
             "detect_positive": bool(a.get("detect_positive", 1))}
    return [imp.emit("mp.isinf", [x], attrs, onnx_type=TensorProto.BOOL)]


@handler("Pow")
def _pow(imp: _Importer, node: onnx.NodeProto) -> list:
    a, b = imp.run_input(0), imp.need_tensor(1)
    dtype = helper.tensor_dtype_to_np_dtype(a.onnx_type)
    if isinstance(b, Const):  # a mixed-type exponent (x ** 3 of GELU-tanh is INT64 or FLOAT)
        b = imp.constant(b.array.astype(dtype), node.input[1])
    elif b.onnx_type != a.onnx_type:
        b = imp.emit("mp.cast", [b], declared=b.type.with_elem(a.type.elem), hint=node.input[1])
    return [imp.emit("mp.pow", [a, b], onnx_type=a.onnx_type)]
