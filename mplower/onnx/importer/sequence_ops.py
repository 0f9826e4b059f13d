"""ONNX import handlers: ReverseSequence, EyeLike, CumProd, TensorScatter, Det and
CausalConvWithState.

ReverseSequence is a gather along the time axis whose index map comes from the lengths (a
constant map when they are constants, a few integer ops when they are not). EyeLike depends
on its input's shape alone, so it is a constant. CumProd multiplies in sequence order, as
onnxruntime does, so float results round exactly as there.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.types import tensor
from mplower.onnx.importer.core import (
    Const,
    Run,
    _attrs,
    _Importer,
    _reshape_to,
    _shape_of,
    handler,
    onnx_type_name,
)


def _axis(imp: _Importer, axis: int, rank: int, what: str) -> int:
    if not -rank <= axis < rank:
        raise imp.error(f"{what} {axis} is out of range for rank {rank}")
    return axis % rank


@handler("ReverseSequence")
def _reverse_sequence(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    a = _attrs(node)
    rank = x.type.rank
    b_ax = _axis(imp, int(a.get("batch_axis", 1)), rank, "batch_axis")
    t_ax = _axis(imp, int(a.get("time_axis", 0)), rank, "time_axis")
    if b_ax == t_ax or rank < 2:
        raise imp.error(f"batch_axis and time_axis must be two different axes of {x.type}")
    batch, steps = x.type.shape[b_ax], x.type.shape[t_ax]
    lens = imp.need_tensor(1)
    if _shape_of(lens) != (batch,):
        raise imp.error(f"sequence_lens must have shape [{batch}] (the batch axis of "
                        f"{x.type}), got {list(_shape_of(lens))}")
    # The index map over (time, batch), laid out along the two axes with 1 elsewhere.
    view = [1] * rank
    view[t_ax], view[b_ax] = steps, batch
    t = np.arange(steps, dtype=np.int64)[:, None]
    if isinstance(lens, Const):
        n = np.asarray(lens.array).astype(np.int64)[None, :]
        if np.any((n < 1) | (n > steps)):
            raise imp.error(f"sequence_lens {n[0].tolist()} must lie in [1, {steps}]")
        index = np.where(t < n, n - 1 - t, t)
        if t_ax > b_ax:
            index = index.T
        idx = imp.constant(index.reshape(view), "reversed_index")
    else:
        n = imp.emit("mp.cast", [lens], declared=lens.type.with_elem("i64"))
        n = _reshape_to(imp, n, [batch if k == b_ax else 1 for k in range(rank)])
        tt = imp.constant(t.reshape([steps if k == t_ax else 1 for k in range(rank)]), "time")
        one = imp.constant(np.array(1, np.int64), "one")
        back = imp.emit("mp.sub", [imp.emit("mp.sub", [n, one]), tt], hint="reversed_time")
        inside = imp.emit("mp.less", [tt, n])
        idx = imp.emit("mp.where", [inside, back, tt], hint="reversed_index")
    full = imp.emit("mp.expand", [idx], declared=tensor(x.type.shape, "i64"), hint="index")
    return [imp.emit("mp.gather_elements", [x, full], {"axis": t_ax}, onnx_type=x.onnx_type)]


@handler("EyeLike")
def _eye_like(imp: _Importer, node: onnx.NodeProto) -> list:
    v = imp.need(0)
    shape = _shape_of(v)
    if len(shape) != 2:
        raise imp.error(f"EyeLike needs a 2-D input, got shape {list(shape)}")
    a = _attrs(node)
    like = v.array.dtype if isinstance(v, Const) else \
        helper.tensor_dtype_to_np_dtype(v.onnx_type)
    t = a.get("dtype")
    try:
        dtype = like if t is None else helper.tensor_dtype_to_np_dtype(int(t))
    except (KeyError, ValueError):
        raise imp.error(f"dtype {onnx_type_name(int(t))} is not a numeric ONNX type") from None
    return [Const(np.eye(shape[0], shape[1], k=int(a.get("k", 0)), dtype=dtype))]


# CumProd runs sequentially (one multiply per step); a longer axis is refused rather than
# written out as that many ops.
MAX_CUMPROD_STEPS = 1024


@handler("CumProd")
def _cum_prod(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    raw = imp.const(1, "CumProd's axis")
    if raw is None or np.asarray(raw).size != 1:
        raise imp.error("CumProd's axis must be one value")
    axis = _axis(imp, int(np.asarray(raw).reshape(-1)[0]), x.type.rank, "axis")
    a = _attrs(node)
    exclusive, reverse = bool(a.get("exclusive", 0)), bool(a.get("reverse", 0))
    n = x.type.shape[axis]
    if n > MAX_CUMPROD_STEPS:
        raise imp.error(f"CumProd along an axis of {n} elements is written out as one multiply "
                        f"per element; at most {MAX_CUMPROD_STEPS} are supported")
    if n == 0:
        return [x]
    rank = x.type.rank

    def step(i: int) -> Run:
        starts, ends = [0] * rank, list(x.type.shape)
        starts[axis], ends[axis] = i, i + 1
        return imp.emit("mp.slice", [x], {"starts": tuple(starts), "ends": tuple(ends),
                                          "steps": (1,) * rank}, hint="step",
                        onnx_type=x.onnx_type)

    order = range(n - 1, -1, -1) if reverse else range(n)
    outs: list[Run] = []
    acc = None
    for i in order:
        if exclusive:
            if acc is None:
                shape = list(x.type.shape)
                shape[axis] = 1
                dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
                outs.append(imp.constant(np.ones(shape, dtype), "ones"))
            else:
                outs.append(acc)
        s = step(i)
        acc = s if acc is None else imp.emit("mp.mul", [acc, s], hint="running_product",
                                             onnx_type=x.onnx_type)
        if not exclusive:
            outs.append(acc)
    if reverse:
        outs.reverse()
    if len(outs) == 1:
        return [outs[0]]
    return [imp.emit("mp.concat", outs, {"axis": axis}, onnx_type=x.onnx_type)]


@handler("TensorScatter")
def _tensor_scatter(imp: _Importer, node: onnx.NodeProto) -> list:
    """The KV-cache update (opset 24): each batch's update rows written into the cache from
    its write index on, one scatter_elements along `axis` whose index map is built from the
    write indices (wrapped at the cache length in circular mode)."""
    cache, update = imp.run_input(0), imp.run_input(1)
    a = _attrs(node)
    mode = a.get("mode", "linear")
    rank = cache.type.rank
    axis = _axis(imp, int(a.get("axis", -2)), rank, "axis")
    if mode not in ("linear", "circular") or axis == 0 or update.type.rank != rank or any(
            u != c for k, (u, c) in enumerate(zip(update.type.shape, cache.type.shape))
            if k != axis) or update.type.shape[axis] > cache.type.shape[axis]:
        raise imp.error(f"update {update.type} must match the cache {cache.type} but along "
                        f"axis {axis} (not the batch axis 0), mode linear or circular")
    batch, length, steps = cache.type.shape[0], cache.type.shape[axis], update.type.shape[axis]
    view = [batch] + [1] * (rank - 1)
    along = [steps if k == axis else 1 for k in range(rank)]
    offsets = imp.constant(np.arange(steps, dtype=np.int64).reshape(along), "row")
    written = imp.input(2)
    if written is None:
        start = imp.constant(np.zeros(view, np.int64), "write_index")
    else:
        w = imp.run_input(2)
        if w.type.shape != (batch,):
            raise imp.error(f"write_indices {w.type} must hold one index per batch ({batch})")
        start = _reshape_to(imp, imp.emit("mp.cast", [w], declared=w.type.with_elem("i64")),
                            view)
    index = imp.emit("mp.add", [start, offsets], hint="cache_row")
    if mode == "circular":
        # Write indices lie in [0, length): one wrap at most.
        size = imp.constant(np.array(length, np.int64), "cache_length")
        past = imp.emit("mp.greater_equal", [index, size])
        index = imp.emit("mp.where", [past, imp.emit("mp.sub", [index, size]), index],
                         hint="cache_row")
    index = imp.emit("mp.expand", [index], declared=tensor(update.type.shape, "i64"))
    return [imp.emit("mp.scatter_elements", [cache, index, update], {"axis": axis},
                     onnx_type=cache.onnx_type)]


# Det by cofactor expansion costs n! products: small matrices only (what models hold: 2x2
# and 3x3 transforms); a larger one is refused rather than expanded.
MAX_DET_SIZE = 4


@handler("Det")
def _det(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    shape = x.type.shape
    if x.type.rank < 2 or shape[-1] != shape[-2] or x.type.elem[0] not in "fb":
        raise imp.error(f"Det needs float square matrices (..., n, n), got {x.type}")
    n = shape[-1]
    if not 1 <= n <= MAX_DET_SIZE:
        raise imp.error(f"Det of {n}x{n} matrices: cofactor expansion is imported up to "
                        f"{MAX_DET_SIZE}x{MAX_DET_SIZE}")
    lead = shape[:-2]
    rank = x.type.rank

    entries: dict[tuple[int, int], Run] = {}

    def entry(i: int, j: int) -> Run:
        if (i, j) not in entries:
            starts = (0,) * (rank - 2) + (i, j)
            ends = (*lead, i + 1, j + 1)
            e = imp.emit("mp.slice", [x], {"starts": starts, "ends": ends,
                                           "steps": (1,) * rank}, hint="entry",
                         onnx_type=x.onnx_type)
            entries[i, j] = _reshape_to(imp, e, lead)
        return entries[i, j]

    memo: dict[tuple, Run] = {}

    def minor(rows: tuple[int, ...], cols: tuple[int, ...]) -> Run:
        if len(rows) == 1:
            return entry(rows[0], cols[0])
        if (rows, cols) not in memo:
            acc = None
            for k, col in enumerate(cols):
                term = imp.emit("mp.mul", [entry(rows[0], col),
                                           minor(rows[1:], cols[:k] + cols[k + 1:])],
                                hint="cofactor", onnx_type=x.onnx_type)
                if acc is None:
                    acc = term if k % 2 == 0 else imp.emit("mp.neg", [term],
                                                           onnx_type=x.onnx_type)
                else:
                    acc = imp.emit("mp.add" if k % 2 == 0 else "mp.sub", [acc, term],
                                   hint="det", onnx_type=x.onnx_type)
            memo[rows, cols] = acc
        return memo[rows, cols]

    return [minor(tuple(range(n)), tuple(range(n)))]


@handler("CausalConvWithState")
def _causal_conv_with_state(imp: _Importer, node: onnx.NodeProto) -> list:
    """Opset 27's stateful causal depthwise 1-D convolution: the past state (zeros when
    absent) concatenated before the input, a depthwise conv2d of height 1 over it, the
    optional SiLU (x * sigmoid(x)); the new state is the last k-1 positions."""
    x, w = imp.run_input(0), imp.run_input(1)
    act = _attrs(node).get("activation", "none")
    if x.type.rank != 3 or w.type.rank != 3 or w.type.shape[:2] != (x.type.shape[1], 1) \
            or act not in ("none", "silu", "swish"):
        raise imp.error(f"input {x.type} (B, C, L) needs a weight (C, 1, k), got {w.type}, "
                        f"and activation none, silu or swish, got '{act}'")
    b, c, length = x.type.shape
    k = w.type.shape[2]
    past = imp.input(3)
    if past is None:
        dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
        past = imp.constant(np.zeros((b, c, k - 1), dtype), "past_state")
    else:
        past = imp.run_input(3)
        if past.type.shape != (b, c, k - 1):
            raise imp.error(f"past_state {past.type} must be ({b}, {c}, {k - 1})")
    padded = imp.emit("mp.concat", [past, x], {"axis": 2}, hint="padded",
                      onnx_type=x.onnx_type) if k > 1 else x
    operands = [_reshape_to(imp, padded, (b, c, 1, length + k - 1)),
                _reshape_to(imp, w, (c, 1, 1, k))]
    if imp.input(2) is not None:
        operands.append(imp.run_input(2))
    attrs = {"strides": (1, 1), "padding": (0, 0, 0, 0), "dilations": (1, 1), "groups": c}
    y = imp.emit("mp.conv2d", operands, attrs, hint="causal_conv", onnx_type=x.onnx_type)
    y = _reshape_to(imp, y, (b, c, length))
    if act != "none":
        y = imp.emit("mp.mul", [y, imp.emit("mp.sigmoid", [y])], hint="silu",
                     onnx_type=x.onnx_type)
    state = imp.emit("mp.slice", [padded], {"starts": (0, 0, length), "ends": (b, c,
                                                                                length + k - 1),
                                            "steps": (1, 1, 1)}, hint="present_state",
                     onnx_type=x.onnx_type)
    return [y, state]
