"""ONNX import handlers: matrix products, convolution, normalization and softmax."""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.types import tensor
from mplower.numerics.formats import FORMATS
from mplower.onnx.importer.core import (
    Const,
    Run,
    _attrs,
    _from_2d,
    _Importer,
    _reshape_to,
    _same_onnx,
    _scalar,
    _shape_of,
    _to_2d,
    _window_attrs,
    handler,
    onnx_type_name,
)

# ---- contractions ----------------------------------------------------------------------------


@handler("MatMul")
def _matmul(imp: _Importer, node: onnx.NodeProto) -> list:
    a, b = imp.run_input(0), imp.run_input(1)
    _same_onnx(imp, a, b)
    if not FORMATS[a.type.elem].is_float:
        raise imp.error(f"MatMul of {onnx_type_name(a.onnx_type)} tensors: mp.matmul takes "
                        f"float operands (int8 only as MatMulInteger)")
    return [imp.emit("mp.matmul", [a, b], onnx_type=a.onnx_type)]


@handler("Gemm")
def _gemm(imp: _Importer, node: onnx.NodeProto) -> list:
    at = _attrs(node)
    alpha, beta = float(at.get("alpha", 1.0)), float(at.get("beta", 1.0))
    operands = []
    for i, trans in ((0, at.get("transA", 0)), (1, at.get("transB", 0))):
        v = imp.need_tensor(i)
        if isinstance(v, Const):
            arr = v.array.T if trans else v.array
            if i == 1 and alpha != 1.0 and arr.dtype.kind == "f":
                arr = (arr.astype(np.float64) * alpha).astype(arr.dtype)
                alpha = 1.0
            operands.append(imp.constant(np.ascontiguousarray(arr), node.input[i]))
        else:
            operands.append(imp.emit("mp.transpose", [v], {"perm": (1, 0)},
                                     hint=f"{node.input[i]}_t", onnx_type=v.onnx_type)
                            if trans else v)
    a, b = operands
    _same_onnx(imp, a, b)
    y = imp.emit("mp.matmul", [a, b], onnx_type=a.onnx_type)
    if alpha != 1.0:
        y = imp.emit("mp.mul", [y, _scalar(imp, alpha, y)], onnx_type=y.onnx_type)
    c = imp.need_tensor(2) if imp.input(2) is not None else None
    if c is not None and beta != 0.0:
        if isinstance(c, Const):
            arr = c.array if beta == 1.0 else (c.array.astype(np.float64) * beta).astype(
                c.array.dtype)
            c = imp.constant(arr, node.input[2])
        elif beta != 1.0:
            c = imp.emit("mp.mul", [c, _scalar(imp, beta, c)], onnx_type=c.onnx_type)
        y = imp.emit("mp.add", [y, c], onnx_type=y.onnx_type)
    return [y]


@handler("Conv")
def _conv(imp: _Importer, node: onnx.NodeProto) -> list:
    x, w = imp.run_input(0), imp.need_tensor(1)
    rank = x.type.rank
    if rank not in (3, 4):
        raise imp.error(f"{rank - 2}-D convolution: mp.conv2d takes 1-D (as 2-D) and 2-D only")
    wshape = _shape_of(w)
    kernel = tuple(_attrs(node).get("kernel_shape", wshape[2:]))
    strides, pads, dilations = _window_attrs(imp, node, x.type.shape[2:], kernel)
    if rank == 3:
        x = _to_2d(imp, x, f"{node.input[0]}_2d")
        w = Const(w.array[:, :, None, :]) if isinstance(w, Const) else _to_2d(
            imp, w, f"{node.input[1]}_2d")
        strides, dilations = [1] + strides, [1] + dilations
        pads = [0, pads[0], 0, pads[1]]
    w = imp.as_run(w, node.input[1] if rank == 4 else f"{node.input[1]}_2d")
    operands = [x, w]
    if imp.input(2) is not None:
        operands.append(imp.run_input(2))
    for o in operands[1:]:
        _same_onnx(imp, x, o)
    attrs = {"strides": tuple(strides), "padding": (pads[0], pads[1], pads[2], pads[3]),
             "dilations": tuple(dilations), "groups": int(_attrs(node).get("group", 1))}
    y = imp.emit("mp.conv2d", operands, attrs, onnx_type=x.onnx_type)
    return [_from_2d(imp, y) if rank == 3 else y]


@handler("BatchNormalization")
def _batch_norm(imp: _Importer, node: onnx.NodeProto) -> list:
    a = _attrs(node)
    eps = float(a.get("epsilon", 1e-5))
    if a.get("training_mode", 0):
        if not imp.eval_mode:
            return _batch_norm_training(imp, node, eps, float(a.get("momentum", 0.9)))
        imp.eval_mode_note("training-mode batch normalization imported as inference (the "
                           "running mean and variance, not the batch's statistics)")
    if any(imp.consumers.get(o) for o in node.output[1:] if o):
        raise imp.error("the running mean/variance outputs exist in training mode only")
    x = imp.run_input(0)
    params = [imp.need_tensor(i) for i in range(1, 5)]
    c = x.type.shape[1]
    bshape = (c,) + (1,) * (x.type.rank - 2)
    if all(isinstance(p, Const) for p in params):
        scale, bias, mean, var = (p.array.astype(np.float64) for p in params)
        s = scale / np.sqrt(var + eps)
        t = bias - mean * s
        dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
        folded = _fold_into_conv(imp, x, s, t, dtype)
        if folded is not None:
            return [folded]
        sc = imp.constant(s.astype(dtype).reshape(bshape), f"{node.input[1]}_scale")
        sh = imp.constant(t.astype(dtype).reshape(bshape), f"{node.input[2]}_shift")
        y = imp.emit("mp.mul", [x, sc], hint=f"{node.output[0]}_scaled", onnx_type=x.onnx_type)
        return [imp.emit("mp.add", [y, sh], onnx_type=x.onnx_type)]
    scale, bias, mean, var = (
        imp.emit("mp.reshape", [imp.as_run(p, node.input[i + 1])],
                 declared=tensor(bshape, x.type.elem), hint=f"{node.input[i + 1]}_b")
        for i, p in enumerate(params))
    inv = imp.emit("mp.rsqrt", [imp.emit("mp.add", [var, _scalar(imp, eps, x)])])
    centered = imp.emit("mp.sub", [x, mean], hint=f"{node.output[0]}_centered")
    y = imp.emit("mp.mul", [centered, imp.emit("mp.mul", [inv, scale])])
    return [imp.emit("mp.add", [y, bias], onnx_type=x.onnx_type)]


def _batch_norm_training(imp: _Importer, node: onnx.NodeProto, eps: float,
                         momentum: float) -> list:
    """training_mode = 1: normalize with the batch statistics and return the updated running
    mean and variance (population variance, as ONNX defines it)."""
    x = imp.run_input(0)
    c, r = x.type.shape[1], x.type.rank
    bshape = (c,) + (1,) * (r - 2)
    axes = (0, *range(2, r))
    scale, bias = (imp.emit("mp.reshape", [imp.run_input(i)], declared=tensor(bshape, x.type.elem))
                   for i in (1, 2))
    mean = imp.emit("mp.reduce_mean", [x], {"axes": axes, "keepdims": True}, hint="batch_mean")
    d = imp.emit("mp.sub", [x, mean])
    var = imp.emit("mp.reduce_mean", [imp.emit("mp.mul", [d, d])],
                   {"axes": axes, "keepdims": True}, hint="batch_var")
    inv = imp.emit("mp.rsqrt", [imp.emit("mp.add", [var, _scalar(imp, eps, x)])])
    y = imp.emit("mp.add", [imp.emit("mp.mul", [d, imp.emit("mp.mul", [inv, scale])]), bias],
                 onnx_type=x.onnx_type)
    outs: list = [y]
    for stat, i in ((mean, 3), (var, 4)):
        running = imp.run_input(i)
        flat = _reshape_to(imp, stat, (c,))
        outs.append(imp.emit("mp.add", [
            imp.emit("mp.mul", [running, _scalar(imp, momentum, x)]),
            imp.emit("mp.mul", [flat, _scalar(imp, 1.0 - momentum, x)])],
            onnx_type=x.onnx_type))
    return outs


def _fold_into_conv(imp: _Importer, x: Run, s: np.ndarray, t: np.ndarray,
                    dtype: np.dtype) -> Run | None:
    """BatchNormalization after a Conv whose weights are constants and whose result nothing
    else reads: one conv with scaled weights and a shifted bias."""
    f = imp.f
    conv = x.value[0]
    if f.op(conv) != "mp.conv2d" or imp.consumers.get(imp.node.input[0], 0) != 1:
        return None
    operands = f.operands(conv)
    consts = [imp.const_of_node.get(v[0]) for v in operands[1:]]
    if any(cst is None for cst in consts):
        return None
    w = consts[0].astype(np.float64)
    b = consts[1].astype(np.float64) if len(consts) > 1 else np.zeros(w.shape[0])
    w2 = (w * s.reshape(-1, 1, 1, 1)).astype(dtype)
    b2 = (b * s + t).astype(dtype)
    attrs = dict(f.attrs_of(conv))
    name = f.data(conv)["name"]
    f.erase(conv)
    for v in operands[1:]:
        if not f.has_uses(v[0]):  # the old weights, unless another op shares them
            imp.const_of_node.pop(v[0], None)
            key = f.attrs_of(v[0]).get("name")
            f.erase(v[0])
            if key is not None:
                imp.weights.pop(key, None)
            for name in [k for k, r in imp.materialized.items() if r.value == v]:
                del imp.materialized[name]
    wr = imp.constant(w2, f"{name}_weight_bn")
    br = imp.constant(b2, f"{name}_bias_bn")
    xin = Run(operands[0], f.type_of(operands[0]), x.onnx_type)
    return imp.emit("mp.conv2d", [xin, wr, br], attrs, hint=name, onnx_type=x.onnx_type)


@handler("LayerNormalization")
def _layer_norm(imp: _Importer, node: onnx.NodeProto) -> list:
    a = _attrs(node)
    x = imp.run_input(0)
    axis = int(a.get("axis", -1))
    eps = float(a.get("epsilon", 1e-5))
    r = x.type.rank
    if not -r <= axis < r:
        raise imp.error(f"axis {axis} is out of range for rank {r}")
    axis %= r
    norm_shape = x.type.shape[axis:]
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    params = []
    for i, default in ((1, 1.0), (2, 0.0)):
        p = imp.need_tensor(i) if imp.input(i) is not None else None
        if p is None:
            p = Const(np.full(norm_shape, default, dtype))
        if isinstance(p, Const) and p.array.shape != norm_shape:
            p = Const(np.broadcast_to(p.array, norm_shape).copy())
        params.append(imp.as_run(p, node.input[i] if i < len(node.input) and node.input[i]
                                 else ("ones" if i == 1 else "zeros")))
    y = imp.emit("mp.layer_norm", [x, *params], {"axis": axis, "epsilon": eps},
                 onnx_type=x.onnx_type)
    outs: list = [y]
    if any(imp.consumers.get(o) for o in node.output[1:] if o):
        axes = tuple(range(axis, r))
        mean = imp.emit("mp.reduce_mean", [x], {"axes": axes, "keepdims": True},
                        hint=node.output[1] or "mean")
        d = imp.emit("mp.sub", [x, mean])
        var = imp.emit("mp.reduce_mean", [imp.emit("mp.mul", [d, d])],
                       {"axes": axes, "keepdims": True})
        inv = imp.emit("mp.rsqrt", [imp.emit("mp.add", [var, _scalar(imp, eps, x)])],
                       hint=node.output[2] if len(node.output) > 2 and node.output[2]
                       else "inv_std")
        outs += [mean, inv]
    return outs


@handler("LRN")
def _lrn(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    a = _attrs(node)
    attrs = {"size": int(a["size"]), "alpha": float(a.get("alpha", 1e-4)),
             "beta": float(a.get("beta", 0.75)), "bias": float(a.get("bias", 1.0))}
    return [imp.emit("mp.lrn", [x], attrs, onnx_type=x.onnx_type)]


@handler("Softmax", "LogSoftmax")
def _softmax(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    op = "mp.softmax" if node.op_type == "Softmax" else "mp.log_softmax"
    r = x.type.rank
    if imp.opset >= 13:
        axis = int(_attrs(node).get("axis", -1))
        return [imp.emit(op, [x], {"axis": axis}, onnx_type=x.onnx_type)]
    # Before opset 13 the input is coerced to 2-D: [prod(dims[:axis]), prod(dims[axis:])].
    axis = int(_attrs(node).get("axis", 1))
    axis = axis + r if axis < 0 else axis
    if axis == r - 1:
        return [imp.emit(op, [x], {"axis": -1}, onnx_type=x.onnx_type)]
    shape = x.type.shape
    flat = imp.emit("mp.reshape", [x], declared=tensor(
        (math.prod(shape[:axis]), math.prod(shape[axis:])), x.type.elem),
        hint=f"{node.input[0]}_2d")
    y = imp.emit(op, [flat], {"axis": -1})
    return [imp.emit("mp.reshape", [y], declared=x.type, onnx_type=x.onnx_type)]
