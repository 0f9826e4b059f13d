"""ONNX import handlers: pooling windows."""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.onnx.importer.core import (
    Run,
    _attrs,
    _from_2d,
    _Importer,
    _reshape_to,
    _to_2d,
    _window_attrs,
    handler,
)

# ---- pooling ---------------------------------------------------------------------------------


def _pool_geometry(imp: _Importer, node: onnx.NodeProto, x: Run):
    a = _attrs(node)
    spatial = x.type.shape[2:]
    kernel = tuple(a["kernel_shape"])
    if len(kernel) != len(spatial):
        raise imp.error(f"kernel_shape {list(kernel)} does not match the input {x.type}")
    strides, pads, dilations = _window_attrs(imp, node, spatial, kernel)
    r = len(spatial)
    extra = [0] * r
    if a.get("ceil_mode", 0):
        for k in range(r):
            ek = (kernel[k] - 1) * dilations[k] + 1
            span = spatial[k] + pads[k] + pads[k + r] - ek
            out = -(-span // strides[k]) + 1
            if (out - 1) * strides[k] >= spatial[k] + pads[k]:
                out -= 1  # the last window would start in the end padding
            extra[k] = max(0, (out - 1) * strides[k] + ek - (spatial[k] + pads[k] + pads[k + r]))
    return kernel, strides, pads, dilations, extra


def _pool_counts(size: int, kernel: int, stride: int, dilation: int, begin: int, end: int,
                 extra: int) -> tuple[np.ndarray, np.ndarray]:
    """Per output position along one axis: window taps on real elements, and taps inside the
    padded extent (ceil mode's extra end padding excluded)."""
    out = (size + begin + end + extra - ((kernel - 1) * dilation + 1)) // stride + 1
    taps = np.arange(out)[:, None] * stride - begin + np.arange(kernel)[None, :] * dilation
    real = ((taps >= 0) & (taps < size)).sum(axis=1)
    padded = ((taps >= -begin) & (taps < size + end)).sum(axis=1)
    return real, padded


@handler("MaxPool", "AveragePool")
def _pool(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    if len(node.output) > 1 and node.output[1] and imp.consumers.get(node.output[1]):
        raise imp.error("the Indices output of MaxPool is not supported")
    r = x.type.rank - 2
    if r < 1:
        raise imp.error(f"pooling needs an (N, C, spatial...) input, got {x.type}")
    kernel, strides, pads, dilations, extra = _pool_geometry(imp, node, x)
    is_max = node.op_type == "MaxPool"
    ends = [pads[k + r] + extra[k] for k in range(r)]
    direct = r <= 2 and all(d == 1 for d in dilations) and all(
        max(pads[k], ends[k]) < kernel[k] for k in range(r))
    if direct:
        # mp's 2-D pools as they are (1-D as height 1): the common case keeps one op.
        lift = r == 1
        y = _to_2d(imp, x, f"{node.input[0]}_2d") if lift else x
        k2, s2 = ((1, *kernel), (1, *strides)) if lift else (tuple(kernel), tuple(strides))
        b2, e2 = ((0, pads[0]), (0, ends[0])) if lift else ((pads[0], pads[1]), tuple(ends))
        attrs = {"kernel": k2, "strides": s2, "padding": (b2[0], b2[1], e2[0], e2[1])}
        y = imp.emit("mp.max_pool2d" if is_max else "mp.avg_pool2d", [y], attrs,
                     onnx_type=x.onnx_type)
        y = _from_2d(imp, y) if lift else y
    else:
        # Max and average pooling are separable: one 1-D pass per spatial axis.
        y = x
        for k in range(r):
            if kernel[k] == strides[k] == 1 and pads[k] == ends[k] == 0:
                continue
            y = _pool_axis(imp, y, k, is_max, kernel[k], strides[k], pads[k], ends[k],
                           dilations[k])
    if not is_max and _attrs(node).get("count_include_pad", 0):
        real, padded = np.ones((1, 1)), np.ones((1, 1))
        for k in range(r):
            c = _pool_counts(x.type.shape[2 + k], kernel[k], strides[k], dilations[k], pads[k],
                             pads[k + r], extra[k])
            real, padded = np.multiply.outer(real, c[0]), np.multiply.outer(padded, c[1])
        ratio = real / padded  # mp pools divide by the real elements; ONNX by the padded window
        if not np.all(ratio == 1):
            dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
            y = imp.emit("mp.mul", [y, imp.constant(ratio.astype(dtype),
                                                    f"{node.output[0]}_divisor")],
                         onnx_type=x.onnx_type)
    return [y]


def _pool_axis(imp: _Importer, x: Run, k: int, is_max: bool, kernel: int, stride: int,
               begin: int, end: int, dilation: int) -> Run:
    """Pool spatial axis `k` of x alone, as a 2-D pool over (that axis, 1)."""
    shape = x.type.shape
    n, c, sp = shape[0], shape[1], shape[2:]
    mid, length, trail = c * math.prod(sp[:k]), sp[k], math.prod(sp[k + 1:])
    v = _reshape_to(imp, x, (n, mid, length, trail))
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    if dilation == 1 and max(begin, end) < kernel:
        attrs = {"kernel": (kernel, 1), "strides": (stride, 1), "padding": (begin, 0, end, 0)}
        y = imp.emit("mp.max_pool2d" if is_max else "mp.avg_pool2d", [v], attrs,
                     onnx_type=x.onnx_type)
    elif is_max:
        y = _dilated_max(imp, v, kernel, stride, begin, end, dilation, dtype)
    else:
        w = imp.constant(np.ones((mid, 1, kernel, 1), dtype), "ones")
        attrs = {"strides": (stride, 1), "padding": (begin, 0, end, 0),
                 "dilations": (dilation, 1), "groups": mid}
        sums = imp.emit("mp.conv2d", [v, w], attrs, hint="window_sum")
        out = sums.type.shape[2]
        taps = np.arange(out)[:, None] * stride - begin + np.arange(kernel)[None, :] * dilation
        real = ((taps >= 0) & (taps < length)).sum(axis=1)
        inv = imp.constant((1.0 / real).astype(dtype).reshape(1, 1, out, 1), "inv_count")
        y = imp.emit("mp.mul", [sums, inv], onnx_type=x.onnx_type)
    out_shape = (n, c, *sp[:k], y.type.shape[2], *sp[k + 1:])
    return _reshape_to(imp, y, out_shape)


def _dilated_max(imp: _Importer, v: Run, kernel: int, stride: int, begin: int, end: int,
                 dilation: int, dtype: np.dtype) -> Run:
    """Max over dilated windows along axis 2: pad with the lowest value, then the maximum of
    one strided slice per tap."""
    n, m, length, t = v.type.shape
    low = -np.inf if np.dtype(dtype).kind == "f" else np.iinfo(dtype).min
    parts = []
    if begin:
        parts.append(imp.constant(np.full((n, m, begin, t), low, dtype), "pad_low"))
    parts.append(v)
    if end:
        parts.append(imp.constant(np.full((n, m, end, t), low, dtype), "pad_low"))
    padded = imp.emit("mp.concat", parts, {"axis": 2}, hint="padded") if len(parts) > 1 else v
    total = length + begin + end
    out = (total - ((kernel - 1) * dilation + 1)) // stride + 1
    acc = None
    for j in range(kernel):
        first = j * dilation
        attrs = {"starts": (0, 0, first, 0), "ends": (n, m, first + (out - 1) * stride + 1, t),
                 "steps": (1, 1, stride, 1)}
        tap = imp.emit("mp.slice", [padded], attrs, hint="tap")
        acc = tap if acc is None else imp.emit("mp.maximum", [acc, tap], hint="window_max")
    return Run(acc.value, acc.type, v.onnx_type)


@handler("GlobalAveragePool")
def _global_avg_pool(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    return [imp.emit("mp.global_avg_pool", [x], onnx_type=x.onnx_type)]
