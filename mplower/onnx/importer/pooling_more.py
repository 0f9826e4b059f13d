"""ONNX import handlers: GlobalMaxPool, LpPool, GlobalLpPool, MaxPool's Indices and MaxUnpool.

All are exact compositions of existing mp ops: global pools are reductions over the spatial
axes; an Lp pool is |x|^p summed over each window (a depthwise convolution with ones, one
spatial axis at a time) then the 1/p power; MaxPool with Indices is a running maximum over
the window's taps (strided slices of the padded input) that keeps, beside the value, the
flat input index of the first tap that reached it; MaxUnpool scatters into zeros.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import onnx
from onnx import helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.types import tensor
from mplower.onnx.importer import pooling
from mplower.onnx.importer.core import Run, _attrs, _Importer, _reshape_to, handler
from mplower.onnx.importer.padding import pad


def _spatial_axes(imp: _Importer, x: Run) -> tuple[int, ...]:
    if x.type.rank < 3:
        raise imp.error(f"pooling needs an (N, C, spatial...) input, got {x.type}")
    return tuple(range(2, x.type.rank))


def _power(imp: _Importer, x: Run, p: float, hint: str) -> Run:
    if p == 1:
        return x
    if p == 2:
        return imp.emit("mp.mul", [x, x], hint=hint, onnx_type=x.onnx_type)
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    e = imp.constant(np.array(p, dtype), "exponent")
    return imp.emit("mp.pow", [x, e], hint=hint, onnx_type=x.onnx_type)


def _abs_power(imp: _Importer, x: Run, p: float) -> Run:
    """|x|^p; |x| as max(x, -x), since even powers need no |.|."""
    if p != 2:
        x = imp.emit("mp.maximum", [x, imp.emit("mp.neg", [x])], hint="magnitude",
                     onnx_type=x.onnx_type)
    return _power(imp, x, p, "powered")


def _root(imp: _Importer, x: Run, p: float) -> Run:
    if p == 2:
        return imp.emit("mp.sqrt", [x], onnx_type=x.onnx_type)
    return _power(imp, x, 1.0 / p, "root")


def _p(imp: _Importer, node: onnx.NodeProto) -> float:
    p = _attrs(node).get("p", 2)
    if not p > 0:
        raise imp.error(f"p must be positive, got {p}")
    return float(p)


@handler("GlobalMaxPool")
def _global_max_pool(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    axes = _spatial_axes(imp, x)
    return [imp.emit("mp.reduce_max", [x], {"axes": axes, "keepdims": True},
                     onnx_type=x.onnx_type)]


@handler("GlobalLpPool")
def _global_lp_pool(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    axes = _spatial_axes(imp, x)
    p = _p(imp, node)
    total = imp.emit("mp.reduce_sum", [_abs_power(imp, x, p)], {"axes": axes, "keepdims": True},
                     onnx_type=x.onnx_type)
    return [_root(imp, total, p)]


def _window_sum_axis(imp: _Importer, x: Run, k: int, kernel: int, stride: int, begin: int,
                     end: int, dilation: int) -> Run:
    """Sums over the windows along spatial axis k (zeros outside), as a depthwise 2-D
    convolution with ones over (that axis, 1)."""
    n, c, *sp = x.type.shape
    mid, length, trail = c * math.prod(sp[:k]), sp[k], math.prod(sp[k + 1:])
    v = _reshape_to(imp, x, (n, mid, length, trail))
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    w = imp.constant(np.ones((mid, 1, kernel, 1), dtype), "ones")
    attrs = {"strides": (stride, 1), "padding": (begin, 0, end, 0),
             "dilations": (dilation, 1), "groups": mid}
    sums = imp.emit("mp.conv2d", [v, w], attrs, hint="window_sum", onnx_type=x.onnx_type)
    return _reshape_to(imp, sums, (n, c, *sp[:k], sums.type.shape[2], *sp[k + 1:]))


@handler("LpPool")
def _lp_pool(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    r = len(_spatial_axes(imp, x))
    kernel, strides, pads, dilations, extra = pooling._pool_geometry(imp, node, x)
    p = _p(imp, node)
    y = _abs_power(imp, x, p)
    for k in range(r):
        y = _window_sum_axis(imp, y, k, kernel[k], strides[k], pads[k], pads[k + r] + extra[k],
                             dilations[k])
    return [_root(imp, y, p)]


def _flat_index(shape: tuple[int, ...], column_major: bool) -> np.ndarray:
    """Each spatial position's index into one (n, c) plane, as MaxPool's Indices counts it."""
    idx = np.arange(math.prod(shape), dtype=np.int64)
    if column_major:
        return idx.reshape(shape[::-1]).transpose()
    return idx.reshape(shape)


# Registered after pooling's MaxPool (this module imports that one first), so this handler
# replaces it: it takes the Indices output and hands the plain pool back to pooling.
@handler("MaxPool")
def _max_pool(imp: _Importer, node: onnx.NodeProto) -> list:
    wants_indices = len(node.output) > 1 and node.output[1] and imp.consumers.get(node.output[1])
    if not wants_indices:
        return pooling._pool(imp, node)
    x = imp.run_input(0)
    r = len(_spatial_axes(imp, x))
    kernel, strides, pads, dilations, extra = pooling._pool_geometry(imp, node, x)
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    low = -np.inf if dtype.kind == "f" else np.iinfo(dtype).min
    ends = [pads[k + r] + extra[k] for k in range(r)]
    padded = pad(imp, x, [0, 0, *pads[:r]], [0, 0, *ends], "constant", np.asarray(low))
    n, c, *sp = x.type.shape
    out = [(padded.type.shape[2 + k] - ((kernel[k] - 1) * dilations[k] + 1)) // strides[k] + 1
           for k in range(r)]
    plane = _flat_index(tuple(sp), bool(_attrs(node).get("storage_order", 0)))
    # Padded positions get the index -1; with the lowest value they never beat a real tap.
    plane = np.pad(plane, [(b, e) for b, e in zip(pads[:r], ends)], constant_values=-1)
    best = where_ = None
    for tap in itertools.product(*(range(kk) for kk in kernel)):
        first = [t * d for t, d in zip(tap, dilations)]
        last = [f + (o - 1) * s + 1 for f, o, s in zip(first, out, strides)]
        attrs = {"starts": (0, 0, *first), "ends": (n, c, *last), "steps": (1, 1, *strides)}
        value = imp.emit("mp.slice", [padded], attrs, hint="tap", onnx_type=x.onnx_type)
        index = plane[tuple(slice(f, e, s) for f, e, s in zip(first, last, strides))]
        index = imp.constant(np.ascontiguousarray(index[None, None]), "tap_index")
        if best is None:
            best, where_ = value, imp.emit("mp.expand", [index], hint="tap_index",
                                           declared=tensor((n, c, *out), index.type.elem))
            continue
        # Strictly greater: the first tap in scan order keeps a tie, as ONNX's reference does.
        wins = imp.emit("mp.greater", [value, best], hint="wins")
        best = imp.emit("mp.where", [wins, value, best], hint="window_max",
                        onnx_type=x.onnx_type)
        where_ = imp.emit("mp.where", [wins, index, where_], hint="window_argmax",
                          onnx_type=where_.onnx_type)
    offsets = (np.arange(n * c, dtype=np.int64) * math.prod(sp)).reshape(n, c, *([1] * r))
    indices = imp.emit("mp.add", [where_, imp.constant(offsets, "plane_offset")],
                       hint=node.output[1], onnx_type=where_.onnx_type)
    return [best, indices]


@handler("MaxUnpool")
def _max_unpool(imp: _Importer, node: onnx.NodeProto) -> list:
    x, idx = imp.run_input(0), imp.run_input(1)
    r = len(_spatial_axes(imp, x))
    a = _attrs(node)
    kernel = list(a["kernel_shape"])
    strides = list(a.get("strides", [1] * r))
    pads = list(a.get("pads", [0] * (2 * r)))
    if len(kernel) != r or len(strides) != r or len(pads) != 2 * r:
        raise imp.error(f"kernel_shape, strides and pads must match the spatial rank of {x.type}")
    sp = [(d - 1) * s + kk - pads[k] - pads[k + r]
          for k, (d, s, kk) in enumerate(zip(x.type.shape[2:], strides, kernel))]
    inferred = (*x.type.shape[:2], *sp)
    shape = imp.const(2, "MaxUnpool's output_shape")
    # Indices count in the inferred shape; a given output_shape extends it with zeros at the
    # end of each axis (ONNX's reference).
    shape = inferred if shape is None else tuple(int(d) for d in np.asarray(shape).reshape(-1))
    if len(shape) != x.type.rank or shape[:2] != inferred[:2] \
            or any(o < i for o, i in zip(shape, inferred)):
        raise imp.error(f"output_shape {list(shape)} must be at least the inferred shape "
                        f"{list(inferred)} of the input {x.type}")
    if idx.type.shape != x.type.shape:
        raise imp.error(f"indices {idx.type} must have the shape of the input {x.type}")
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    zeros = imp.constant(np.zeros(math.prod(inferred), dtype), "unpooled")
    flat_idx = _reshape_to(imp, idx, (idx.type.size,))
    flat_x = _reshape_to(imp, x, (x.type.size,))
    out = imp.emit("mp.scatter_elements", [zeros, flat_idx, flat_x], {"axis": 0},
                   onnx_type=x.onnx_type)
    out = _reshape_to(imp, out, inferred)
    return [pad(imp, out, [0] * len(shape), [o - i for o, i in zip(shape, inferred)],
                "constant")]


@handler("Col2Im")
def _col2im(imp: _Importer, node: onnx.NodeProto) -> list:
    """Each column entry added onto the image position its block and offset cover (entries
    that land in the padding are dropped): a gather of the kept entries, then one scatter-add
    with a constant index map."""
    x = imp.run_input(0)
    image = [int(v) for v in np.asarray(imp.const(1, "Col2Im's image_shape")).reshape(-1)]
    block = [int(v) for v in np.asarray(imp.const(2, "Col2Im's block_shape")).reshape(-1)]
    r = len(image)
    a = _attrs(node)
    strides = list(a.get("strides", [1] * r))
    dilations = list(a.get("dilations", [1] * r))
    pads = list(a.get("pads", [0] * (2 * r)))
    if x.type.rank != 3 or len(block) != r or len(strides) != r or len(dilations) != r \
            or len(pads) != 2 * r or min(block, default=0) < 1:
        raise imp.error(f"input {x.type} must be (N, C*prod(block), L) with image_shape, "
                        f"block_shape, strides, dilations and pads of one spatial rank")
    n, cb, length = x.type.shape
    blocks = [(image[k] + pads[k] + pads[k + r] - dilations[k] * (block[k] - 1) - 1)
              // strides[k] + 1 for k in range(r)]
    if cb % math.prod(block) or math.prod(blocks) != length:
        raise imp.error(f"input {x.type} does not hold C*{math.prod(block)} rows of "
                        f"{math.prod(blocks)} blocks for image_shape {image} and block_shape "
                        f"{block}")
    c = cb // math.prod(block)
    # Position of every (block offset, block) entry along each spatial axis.
    offs = np.indices(block).reshape(r, -1)  # (r, B)
    where = np.indices(blocks).reshape(r, -1)  # (r, L)
    pos = (where[:, None, :] * np.array(strides)[:, None, None]
           - np.array(pads[:r])[:, None, None]
           + offs[:, :, None] * np.array(dilations)[:, None, None])  # (r, B, L)
    valid = np.all((pos >= 0) & (pos < np.array(image)[:, None, None]), axis=0)
    flat = np.ravel_multi_index(tuple(np.clip(pos, 0, None)), image, mode="clip")
    target = (np.arange(c)[:, None, None] * math.prod(image) + flat[None]).reshape(-1)
    kept = np.flatnonzero(np.broadcast_to(valid[None], (c, *valid.shape)).reshape(-1))
    entries = _reshape_to(imp, x, (n, cb * length))
    picked = imp.emit("mp.gather", [entries, imp.constant(kept.astype(np.int64), "kept")],
                      {"axis": 1}, hint="entries", onnx_type=x.onnx_type)
    index = imp.emit("mp.expand", [imp.constant(target[kept][None].astype(np.int64),
                                                "image_index")],
                     declared=tensor((n, kept.size), "i64"), hint="image_index")
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    zeros = imp.constant(np.zeros((n, c * math.prod(image)), dtype), "image")
    out = imp.emit("mp.scatter_elements", [zeros, index, picked],
                   {"axis": 1, "reduction": "add"}, onnx_type=x.onnx_type)
    return [_reshape_to(imp, out, (n, c, *image))]
