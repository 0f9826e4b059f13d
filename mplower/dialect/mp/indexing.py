"""Indexing, selection and masks (gather*, where, comparisons, predicates, expand, trilu, pow,
cumsum), the scatter-adds and split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from mplower.dialect.mp.common import (
    _ANY,
    _ELEMENTWISE,
    _FLOATS,
    _MOVES,
    _NUMERIC,
    _PICKS,
    _SUMS,
    _VECTOR,
    _axis,
    _binary_infer,
    _binary_reference,
    _binary_vjp,
    _broadcast,
    _declared,
    _def,
    _elem_of,
    _fl,
    _ImplInfer,
    _mul,
    _no_flops,
    _num,
    _per_element,
    _per_input_element,
    _sum_to,
    _unary_infer,
    _zeros_like,
)
from mplower.ir.opdef import AttrSpec, GradBuilder, OpError, Trait, Value, show_value
from mplower.ir.types import ELEMENT_TYPES, TensorType, tensor
from mplower.numerics.formats import FORMATS

# ---------------------------------------------------------------------------------------------
# Indexing, selection and masks: what torch.onnx exporters emit around transformers (embedding
# lookups, attention masks, causal masks, position ids). Index operands are integers of any
# width; these ops move values or compare them, and only pow and cumsum compute.

_INTS = frozenset(n for n in ELEMENT_TYPES if FORMATS[n].is_int and n != "i1")
_MASK = frozenset({"i1"})


def _index_elem(t: TensorType, i: int) -> None:
    if t.elem not in _INTS:
        raise OpError(f"operand #{i} holds indices and must have an integer element type, "
                      f"got {t}", operand=i)


def _checked_indices(idx: np.ndarray, dim: int) -> np.ndarray:
    """ONNX's negative indices counted from the end; an index outside [-dim, dim) is an error,
    as in onnxruntime (ONNX leaves it undefined)."""
    idx = idx.astype(np.int64)
    bad = (idx < -dim) | (idx >= dim)
    if np.any(bad):
        raise OpError(f"index {int(idx[bad].reshape(-1)[0])} is out of range [{-dim}, {dim})")
    return np.where(idx < 0, idx + dim, idx)


def _gather_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    data, idx = ins
    _index_elem(idx, 1)
    axis = _axis(a["axis"], data.rank)
    return [tensor(data.shape[:axis] + idx.shape + data.shape[axis + 1:], data.elem)]


def _gather_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    data, idx = xs
    axis = a["axis"] % data.ndim
    return [np.take(data, _checked_indices(idx, data.shape[axis]), axis=axis)]


def _gather_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
                needs: Sequence[bool]) -> list[Value | None]:
    """dY scattered back with an add, so rows picked twice (a token that occurs twice) sum:
    the index block flattened to one axis, then broadcast over the data's other axes as
    scatter_elements_add's one-index-per-update wants."""
    td, ti = g.type_of(xs[0]), g.type_of(xs[1])
    axis = a["axis"] % td.rank
    n = ti.size
    rows = td.shape[:axis] + (n,) + td.shape[axis + 1:]
    d = g.emit("mp.reshape", [dy], result=tensor(rows, td.elem))
    line = (1,) * axis + (n,) + (1,) * (td.rank - axis - 1)
    idx = g.emit("mp.reshape", [xs[1]], result=tensor(line, ti.elem))
    idx = g.emit("mp.expand", [idx], result=tensor(rows, ti.elem))
    return [g.emit("mp.scatter_elements_add", [g.splat(0.0, td.shape, td.elem), idx, d],
                   {"axis": axis}), None]


_def("gather",
     vjp=_gather_vjp,
     operands=("data", "indices"),
     attrs={"axis": AttrSpec("int", default=0)},
     infer=_gather_infer,
     reference=_gather_reference,
     flops=_no_flops,
     precisions=_ANY,
     doc="Entries of `data` along `axis` at integer `indices` (negative from the end): an "
         "embedding lookup (ONNX Gather).",
     traits=_MOVES)


def _gather_elements_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    data, idx = ins
    _index_elem(idx, 1)
    axis = _axis(a["axis"], data.rank)
    if idx.rank != data.rank or any(i > d for k, (i, d) in enumerate(zip(idx.shape, data.shape))
                                    if k != axis):
        raise OpError(f"indices {idx} must have the rank of data {data} and no larger "
                      f"dimension outside axis {axis}", operand=1)
    return [tensor(idx.shape, data.elem)]


def _gather_elements_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    data, idx = xs
    axis = a["axis"] % data.ndim
    idx = _checked_indices(idx, data.shape[axis])
    # take_along_axis wants data and indices of one shape outside the axis; ONNX reads the
    # leading corner of data where indices are smaller.
    corner = tuple(slice(None) if k == axis else slice(0, n) for k, n in enumerate(idx.shape))
    return [np.take_along_axis(data[corner], idx, axis=axis)]


_def("gather_elements",
     vjp=lambda g, xs, y, dy, a, needs: [g.emit(
         "mp.scatter_elements_add", [_zeros_like(g, xs[0]), xs[1], dy], {"axis": a["axis"]}),
         None],
     operands=("data", "indices"),
     attrs={"axis": AttrSpec("int", default=0)},
     infer=_gather_elements_infer,
     reference=_gather_elements_reference,
     flops=_no_flops,
     precisions=_ANY,
     doc="result[i][j][k] = data[indices[i][j][k]][j][k] for axis 0, and likewise for the "
         "others (ONNX GatherElements).",
     traits=_MOVES)


def _gather_nd_shape(data: TensorType, idx: TensorType, b: int) -> tuple[int, ...]:
    if not 0 <= b < min(data.rank, idx.rank):
        raise OpError(f"attribute 'batch_dims' = {b} must be below the ranks of data {data} "
                      f"and indices {idx}", operand=1)
    if data.shape[:b] != idx.shape[:b]:
        raise OpError(f"the first {b} (batch) dimensions of data {data} and indices {idx} "
                      f"differ", operand=1)
    k = idx.shape[-1]
    if not 1 <= k <= data.rank - b:
        raise OpError(f"indices {idx} address {k} dimensions; data {data} has "
                      f"{data.rank - b} after its {b} batch dimension(s)", operand=1)
    return idx.shape[:-1] + data.shape[b + k:]


def _gather_nd_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    data, idx = ins
    _index_elem(idx, 1)
    return [tensor(_gather_nd_shape(data, idx, a["batch_dims"]), data.elem)]


def _gather_nd_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    data, idx = xs
    b = a["batch_dims"]
    batch, k = data.shape[:b], idx.shape[-1]
    flat = data.reshape((math.prod(batch),) + data.shape[b:])
    rows = idx.reshape(flat.shape[:1] + (-1, k))
    coords = [_checked_indices(rows[..., i], flat.shape[1 + i]) for i in range(k)]
    picked = flat[(np.arange(flat.shape[0])[:, None], *coords)]
    return [picked.reshape(idx.shape[:-1] + data.shape[b + k:])]


_def("gather_nd",
     vjp=lambda g, xs, y, dy, a, needs: [g.emit(
         "mp.scatter_nd_add", [_zeros_like(g, xs[0]), xs[1], dy],
         {"batch_dims": a["batch_dims"]}), None],
     operands=("data", "indices"),
     attrs={"batch_dims": AttrSpec("int", default=0, min=0)},
     infer=_gather_nd_infer,
     reference=_gather_nd_reference,
     flops=_no_flops,
     precisions=_ANY,
     doc="Slices of `data` addressed by the last dimension of `indices`, after `batch_dims` "
         "shared batch dimensions (ONNX GatherND): what torch.export writes for tensor "
         "indexing.",
     traits=_MOVES)


def _where_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    cond, x, y = ins
    if cond.elem != "i1":
        raise OpError(f"operand #0 (the condition) must have element type i1, got {cond}",
                      operand=0)
    elem = _elem_of((x, y), _ANY, "any")
    shape = _broadcast(cond.shape, x.shape)
    shape = shape and _broadcast(shape, y.shape)
    if shape is None:
        raise OpError(f"operands are not broadcast-compatible: {cond}, {x} and {y}", operand=2)
    return [tensor(shape, elem)]


def _where_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
               needs: Sequence[bool]) -> list[Value | None]:
    """dY to x where the condition holds and to y elsewhere, each summed back to its shape."""
    zero = g.splat(0.0, (), g.type_of(dy).elem)
    branches = ([dy, zero], [zero, dy])
    return [None] + [_sum_to(g, g.emit("mp.where", [xs[0], *pick]), g.type_of(x).shape)
                     if need else None for x, pick, need in zip(xs[1:], branches, needs[1:])]


_def("where",
     vjp=_where_vjp,
     operands=("cond", "x", "y"),
     attrs={},
     infer=_where_infer,
     reference=lambda xs, a, rt: [np.where(xs[0], xs[1], xs[2])],
     flops=_no_flops,
     precisions=_ANY,
     doc="x where cond else y, with numpy broadcasting of all three (ONNX Where): the mask "
         "fill of attention.",
     traits=_PICKS)


def _compare_infer(allowed: frozenset[str], what: str) -> _ImplInfer:
    def infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
        t = _binary_infer(allowed, what)(ins, a, declared)[0]
        return [t.with_elem("i1")]
    return infer


# Comparisons and predicates: their i1 result is what they are for, and they compare their
# operands as they arrive (type-carrying: the precision passes never lower them).
_PREDICATE = frozenset({Trait.ELEMENTWISE, Trait.TYPE_CARRYING})

for _name, _fn, _allowed, _onnx in (
    ("equal", np.equal, _ANY, "Equal"),
    ("less", np.less, _NUMERIC, "Less"),
    ("less_equal", np.less_equal, _NUMERIC, "LessOrEqual"),
    ("greater", np.greater, _NUMERIC, "Greater"),
    ("greater_equal", np.greater_equal, _NUMERIC, "GreaterOrEqual"),
):
    _def(_name,
         operands=("a", "b"),
         attrs={},
         infer=_compare_infer(_allowed, "any" if _allowed is _ANY else "a numeric"),
         reference=_binary_reference(_fn),
         flops=_per_element(1),
         precisions=_ANY,
         doc=f"Elementwise comparison to an i1 mask with numpy broadcasting (ONNX {_onnx}).",
         traits=_PREDICATE)

for _name, _fn, _onnx in (("logical_and", np.logical_and, "And"),
                          ("logical_or", np.logical_or, "Or"),
                          ("logical_xor", np.logical_xor, "Xor")):
    _def(_name,
         operands=("a", "b"),
         attrs={},
         infer=_binary_infer(_MASK, "the i1"),
         reference=_binary_reference(_fn),
         flops=_per_element(1),
         precisions=_MASK,
         doc=f"Elementwise {_onnx.lower()} of i1 masks with numpy broadcasting (ONNX {_onnx}).",
         traits=_ELEMENTWISE)

_def("logical_not",
     operands=("x",),
     attrs={},
     infer=_unary_infer(_MASK, "the i1"),
     reference=lambda xs, a, rt: [np.logical_not(xs[0])],
     flops=_per_element(1),
     precisions=_MASK,
     doc="Elementwise negation of an i1 mask (ONNX Not).",
     traits=_ELEMENTWISE)


def _predicate_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    _elem_of(ins, _FLOATS, "a float")
    return [tensor(ins[0].shape, "i1")]


def _isinf_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x = _fl(xs[0])
    return [(np.isposinf(x) & a["detect_positive"]) | (np.isneginf(x) & a["detect_negative"])]


_def("isnan",
     operands=("x",),
     attrs={},
     infer=_predicate_infer,
     reference=lambda xs, a, rt: [np.isnan(_fl(xs[0]))],
     flops=_per_element(1),
     precisions=_ANY,
     doc="Elementwise NaN test to an i1 mask (ONNX IsNaN).",
     traits=_PREDICATE)
_def("isinf",
     operands=("x",),
     attrs={"detect_negative": AttrSpec("bool", default=True),
            "detect_positive": AttrSpec("bool", default=True)},
     infer=_predicate_infer,
     reference=_isinf_reference,
     flops=_per_element(1),
     precisions=_ANY,
     doc="Elementwise infinity test to an i1 mask, either sign or one (ONNX IsInf).",
     traits=_PREDICATE)


def _expand_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x, t = ins[0], _declared("mp.expand", declared)
    if _broadcast(x.shape, t.shape) != t.shape:
        raise OpError(f"{x} does not broadcast to the result shape {list(t.shape)}", operand=0)
    return [tensor(t.shape, x.elem)]


def _expand_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    return [np.broadcast_to(xs[0], _declared("mp.expand", rt or ()).shape).copy()]


_def("expand",
     vjp=lambda g, xs, y, dy, a, needs: [_sum_to(g, dy, g.type_of(xs[0]).shape)],
     operands=("x",),
     attrs={},
     infer=_expand_infer,
     reference=_expand_reference,
     flops=_no_flops,
     precisions=_ANY,
     doc="Broadcast to the shape of the result type (ONNX Expand, its shape folded at import).",
     traits=_MOVES)


def _trilu_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x = ins[0]
    if x.rank < 2:
        raise OpError(f"operand #0 must have rank >= 2, got {x}", operand=0)
    return [x]


def _trilu_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x, k = xs[0], a["k"]
    rows, cols = x.shape[-2:]
    # np.triu/np.tril with a k beyond the matrix are fine; the mask keeps any dtype's zero.
    keep = np.triu(np.ones((rows, cols), np.bool_), k) if a["upper"] else \
        np.tril(np.ones((rows, cols), np.bool_), k)
    return [np.where(keep, x, np.zeros((), x.dtype))]


_def("trilu",
     vjp=lambda g, xs, y, dy, a, needs: [g.emit("mp.trilu", [dy], a)],
     operands=("x",),
     attrs={"upper": AttrSpec("bool", default=True), "k": AttrSpec("int", default=0)},
     infer=_trilu_infer,
     reference=_trilu_reference,
     flops=_no_flops,
     precisions=_ANY,
     doc="Upper (or lower) triangle of the last two dimensions from diagonal `k` on, zeros "
         "elsewhere (ONNX Trilu).",
     traits=_MOVES)


def _pow_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    base, exp = _num(xs[0]), _num(xs[1])
    if base.dtype.kind in "iu":  # numpy refuses negative integer powers; ONNX truncates
        return [np.trunc(np.power(base.astype(np.float64), exp.astype(np.float64)))]
    return [np.power(base, exp.astype(base.dtype))]


def _pow_vjp_rule(g: GradBuilder, a: Value, b: Value, y: Value, dy: Value) -> tuple:
    """d(a^b)/da = b a^(b-1) and d(a^b)/db = a^b log a, with JAX's exception: at a = 0 the
    log is taken of 1, so db is 0 there, not 0 * -inf (a negative base gives NaN, as in JAX)."""
    one = g.splat(1.0, (), g.type_of(a).elem)

    def db() -> Value:
        a_zero = g.emit("mp.equal", [a, g.splat(0.0, (), g.type_of(a).elem)])
        return _mul(g, dy, y, g.emit("mp.log", [g.emit("mp.where", [a_zero, one, a])]))
    return (lambda: _mul(g, dy, b, g.emit("mp.pow", [a, g.emit("mp.sub", [b, one])])), db)


_pow_vjp = _binary_vjp(_pow_vjp_rule)

_def("pow",
     vjp=_pow_vjp,
     operands=("a", "b"),
     attrs={},
     infer=_binary_infer(_NUMERIC, "a numeric"),
     reference=_pow_reference,
     flops=_per_element(1),
     precisions=_VECTOR,
     doc="Elementwise a ** b with numpy broadcasting, one element type (ONNX Pow; the "
         "importer casts a mixed-type exponent).",
     traits=_ELEMENTWISE)


def _cumsum_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    elem = _elem_of(ins, _NUMERIC, "a numeric")
    _axis(a["axis"], ins[0].rank)
    return [tensor(ins[0].shape, elem)]


def _cumsum_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x = _num(xs[0])
    axis = a["axis"] % x.ndim
    if a["reverse"]:
        x = np.flip(x, axis)
    y = np.cumsum(x, axis=axis, dtype=x.dtype)
    if a["exclusive"] and x.shape[axis]:  # shift by one along the axis: the sums before
        y = np.concatenate([np.zeros_like(np.take(y, [0], axis=axis)),
                            np.take(y, range(x.shape[axis] - 1), axis=axis)], axis=axis)
    return [np.flip(y, axis) if a["reverse"] else y]


_def("cumsum",
     # Each x feeds the sums after it (after and at, inclusive): the cumsum the other way.
     vjp=lambda g, xs, y, dy, a, needs: [g.emit("mp.cumsum", [dy], {**a,
                                                                    "reverse": not a["reverse"]})],
     operands=("x",),
     attrs={"axis": AttrSpec("int", required=True),
            "exclusive": AttrSpec("bool", default=False),
            "reverse": AttrSpec("bool", default=False)},
     infer=_cumsum_infer,
     reference=_cumsum_reference,
     flops=_per_input_element,
     precisions=_VECTOR,
     doc="Running sum along `axis`, optionally exclusive and/or from the end (ONNX CumSum, "
         "its axis folded at import).",
     traits=_SUMS)


# ---------------------------------------------------------------------------------------------
# Scatter-adds: the gradients of the gathers (and of strided slices). Indices picked twice add
# up, as a gradient needs; ONNX ScatterElements and ScatterND with reduction = "add".


def _scatter_elements_add_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    data, idx, updates = ins
    elem = _elem_of((data, updates), _NUMERIC, "a numeric")
    if updates.shape != idx.shape:
        raise OpError(f"updates {updates} must have the shape of indices {idx}", operand=2)
    _gather_elements_infer((data, idx), a, ())
    return [tensor(data.shape, elem)]


def _scatter_elements_add_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    data, idx, updates = xs
    axis = a["axis"] % data.ndim
    where = list(np.indices(idx.shape, sparse=True))
    where[axis] = _checked_indices(idx, data.shape[axis])
    out = data.copy()
    np.add.at(out, tuple(where), updates)
    return [out]


# The cotangent passes to data as it is and to each update from where it was added.
_def("scatter_elements_add",
     vjp=lambda g, xs, y, dy, a, needs: [
         dy, None, g.emit("mp.gather_elements", [dy, xs[1]], {"axis": a["axis"]})],
     operands=("data", "indices", "updates"),
     attrs={"axis": AttrSpec("int", default=0)},
     infer=_scatter_elements_add_infer,
     reference=_scatter_elements_add_reference,
     flops=lambda ins, a: ins[2].size,
     precisions=_VECTOR,
     doc="data with each update added at its own position but along `axis` at its index: "
         "the gradient of gather and gather_elements (ONNX ScatterElements, reduction add).",
     traits=_SUMS)


def _scatter_nd_add_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    data, idx, updates = ins
    elem = _elem_of((data, updates), _NUMERIC, "a numeric")
    _index_elem(idx, 1)
    want = _gather_nd_shape(data, idx, a["batch_dims"])
    if updates.shape != want:
        raise OpError(f"updates {updates} must have shape {list(want)} (what gather_nd of "
                      f"{data} at {idx} gives)", operand=2)
    return [tensor(data.shape, elem)]


def _scatter_nd_add_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    data, idx, updates = xs
    b = a["batch_dims"]
    k = idx.shape[-1]
    flat = data.reshape((math.prod(data.shape[:b]),) + data.shape[b:]).copy()
    rows = idx.reshape(flat.shape[:1] + (-1, k))
    coords = [_checked_indices(rows[..., i], flat.shape[1 + i]) for i in range(k)]
    np.add.at(flat, (np.arange(flat.shape[0])[:, None], *coords),
              updates.reshape(rows.shape[:2] + data.shape[b + k:]))
    return [flat.reshape(data.shape)]


_def("scatter_nd_add",
     vjp=lambda g, xs, y, dy, a, needs: [
         dy, None, g.emit("mp.gather_nd", [dy, xs[1]], {"batch_dims": a["batch_dims"]})],
     operands=("data", "indices", "updates"),
     attrs={"batch_dims": AttrSpec("int", default=0, min=0)},
     infer=_scatter_nd_add_infer,
     reference=_scatter_nd_add_reference,
     flops=lambda ins, a: ins[2].size,
     precisions=_VECTOR,
     doc="data with each slice of `updates` added where gather_nd with the same `indices` and "
         "`batch_dims` reads it: its gradient (ONNX ScatterND, reduction add, for "
         "batch_dims = 0).",
     traits=_SUMS)


def _split_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x = ins[0]
    axis = _axis(a["axis"], x.rank)
    sizes = a["sizes"]
    if sum(sizes) != x.shape[axis]:
        raise OpError(f"sizes {show_value(sizes)} add up to {sum(sizes)}, not to dimension "
                      f"{axis} of {x} ({x.shape[axis]})", operand=0)
    if declared and len(declared) != len(sizes):
        raise OpError(f"sizes {show_value(sizes)} make {len(sizes)} results, but the op "
                      f"declares {len(declared)}")
    return [tensor(x.shape[:axis] + (n,) + x.shape[axis + 1:], x.elem) for n in sizes]


def _split_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x = xs[0]
    cuts = np.cumsum(a["sizes"])[:-1]
    return list(np.split(x, cuts, axis=_axis(a["axis"], x.ndim)))


_def("split",
     # The cotangents of the parts, unused ones zero, joined where the parts were cut.
     vjp=lambda g, xs, y, dys, a, needs: [g.emit("mp.concat", list(dys), {"axis": a["axis"]})],
     operands=("x",),
     attrs={"axis": AttrSpec("int", default=0), "sizes": AttrSpec("ints", required=True, min=0)},
     infer=_split_infer,
     reference=_split_reference,
     flops=_no_flops,
     precisions=_ANY,
     doc="Cut `x` along `axis` into one result per entry of `sizes` (ONNX Split with its "
         "`split` input); the only op with several results.",
     traits=_MOVES,
     num_results=None)
