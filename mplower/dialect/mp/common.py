"""What the mp op families share: type rules, `_def` (which builds and registers an OpDef), the
gradient helpers, the trait sets and FLOP counters.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mplower.ir.opdef import (
    AttrSpec,
    Bounds,
    GradBuilder,
    OpDef,
    OpError,
    Trait,
    Value,
    Vjp,
    check_attr_values,
    define,
)
from mplower.ir.types import ELEMENT_TYPES, TensorType, tensor, value_dtype
from mplower.numerics.formats import (
    COMPUTE_FORMATS,
    FLOATS,
    QUANT_FLOATS,
    QUANT_STORAGE,
    QUANT_WIDE,
)

# ---------------------------------------------------------------------------------------------
# Type rules shared by several ops

_FLOATS = FLOATS
# i1 is a mask type: it may be moved around and compared but not computed with.
_NUMERIC = frozenset(n for n in ELEMENT_TYPES if n != "i1")
_ANY = frozenset(ELEMENT_TYPES)
_INT8 = frozenset({"i8", "ui8"})
_QUANT_TYPES = QUANT_STORAGE
# What mp.quantize produces and mp.dequantize reads: the integers, and the scaled floats.
_QUANTIZED = QUANT_STORAGE + QUANT_WIDE + QUANT_FLOATS


def _elem_of(ins: Sequence[TensorType], allowed: frozenset[str], what: str) -> str:
    """The one element type all `ins` share; it must be in `allowed` (`what` names that set)."""
    first = ins[0].elem
    for i, t in enumerate(ins):
        if t.elem not in allowed:
            raise OpError(f"operand #{i} must have {what} element type, got {t}", operand=i)
        if t.elem != first:
            raise OpError(f"operand #{i} has element type {t.elem} but operand #0 has {first}; "
                          "the operands of this op share one element type", operand=i)
    return first


def _need_rank(t: TensorType, rank: int, i: int, layout: str = "") -> None:
    if t.rank != rank:
        layout = f" ({layout})" if layout else ""
        raise OpError(f"operand #{i} must have rank {rank}{layout}, got {t}", operand=i)


def _axis(axis: int, rank: int, name: str = "axis", end_ok: bool = False) -> int:
    """`axis` normalized to [0, rank) (or [0, rank] with `end_ok`, as ONNX Flatten allows)."""
    hi = rank + 1 if end_ok else rank
    if not -rank <= axis < hi:
        raise OpError(f"attribute '{name}' = {axis} is out of range [{-rank}, {hi}) for an "
                      f"operand of rank {rank}", operand=0)
    return axis + rank if axis < 0 else axis


def _broadcast(s1: tuple[int, ...], s2: tuple[int, ...]) -> tuple[int, ...] | None:
    """numpy's broadcast shape, or None where the shapes are incompatible."""
    out = []
    for d1, d2 in itertools.zip_longest(reversed(s1), reversed(s2), fillvalue=1):
        if d1 == d2 or d2 == 1:
            out.append(d1)
        elif d1 == 1:
            out.append(d2)
        else:
            return None
    return tuple(reversed(out))


def _declared(op: str, declared: Sequence[TensorType]) -> TensorType:
    if not declared:
        raise OpError(f"{op} takes its result type from the declaration; none was given")
    return declared[0]


def _prod(dims: Sequence[int]) -> int:
    return math.prod(dims)


def _fl(x: np.ndarray) -> np.ndarray:
    """Float values to compute on: float64 stays, every narrower float is held in float32."""
    return x if x.dtype == np.float64 else x.astype(np.float32, copy=False)


def _num(x: np.ndarray) -> np.ndarray:
    """Like `_fl` for floats; integers widen to int64 so that sums and products do not wrap
    (uint64, whose values int64 cannot hold, stays)."""
    if x.dtype.kind in "iub":
        return x if x.dtype == np.uint64 else x.astype(np.int64, copy=False)
    return _fl(x)


def _contraction_elem(op: str, a: TensorType, b: TensorType,
                      declared: Sequence[TensorType]) -> str:
    """Result element type of matmul/conv2d: the operand type, f32 for float operands
    (accumulate-out), i32 for int8 operands; a declared one of these is echoed."""
    ea, eb = a.elem, b.elem
    if ea in _FLOATS and eb in _FLOATS:
        if ea != eb:
            raise OpError(f"operand #1 has element type {eb} but operand #0 has {ea}; "
                          "the operands of this op share one element type", operand=1)
        allowed = (ea, "f32") if ea != "f32" else ("f32",)
    elif ea in _INT8 and eb in _INT8:
        # ONNX MatMulInteger/ConvInteger mix signed and unsigned 8-bit operands.
        allowed = ("i32", ea) if ea == eb else ("i32",)
    else:
        raise OpError(f"{op} takes two float operands of one type or two 8-bit integer "
                      f"operands, got {a} and {b}", operand=1)
    if not declared:
        return allowed[0]
    d = declared[0].elem
    if d not in allowed:
        raise OpError(f"{op} result element type {d} is not allowed for {ea} x {eb} operands "
                      f"(expected {' or '.join(allowed)})")
    return d


# ---------------------------------------------------------------------------------------------
# Declaring an op
#
# `_def` builds the OpDef and wraps its three functions so that each of them sees checked
# attributes (defaults filled, plain values) whichever dict the caller passes, and so that the
# operand count and the sparse-encoding rule are enforced once for every op.

_ImplInfer = Callable[[tuple[TensorType, ...], dict, tuple[TensorType, ...]], list[TensorType]]
_ImplReference = Callable[[list[np.ndarray], dict, tuple[TensorType, ...] | None],
                          list[np.ndarray]]
_ImplFlops = Callable[[Sequence[TensorType], dict], int]


def _def(name: str, *, operands: tuple[str, ...], attrs: Mapping[str, AttrSpec],
         infer: _ImplInfer, reference: _ImplReference, flops: _ImplFlops,
         precisions: frozenset[str], doc: str, traits: frozenset[Trait] = frozenset(),
         weight_operand: int | None = None,
         encoded_operands: frozenset[int] = frozenset(), vjp: Vjp | None = None,
         num_results: int | None = 1, bounds: Bounds | None = None) -> OpDef:
    op = f"mp.{name}"
    specs = dict(attrs)
    # `name?` is optional, `name...` a list of one or more, `name*` a list of zero or more.
    lo = sum(1 for n in operands if not n.endswith(("?", "...", "*")))
    lo += any(n.endswith("...") for n in operands)
    hi = None if any(n.endswith(("...", "*")) for n in operands) else len(operands)

    def checked_infer(ins: Sequence[TensorType], attrs: Mapping[str, Any],
                      declared: Sequence[TensorType] = ()) -> list[TensorType]:
        if len(ins) < lo or (hi is not None and len(ins) > hi):
            raise OpError(f"{op} takes {_count_text(lo, hi)}, got {len(ins)}")
        for i, t in enumerate(ins):
            if t.encoding is not None and i not in encoded_operands:
                raise OpError(f'operand #{i} has sparse encoding "{t.encoding}"; only the second '
                              "operand of mp.matmul may be encoded (and mp.cast's, which "
                              "keeps it)", operand=i)
        return infer(tuple(ins), check_attr_values(op, specs, attrs), tuple(declared))

    def prechecked_reference(inputs: Sequence[np.ndarray], attrs: Mapping[str, Any],
                             result_types: Sequence[TensorType] | None = None) -> list[np.ndarray]:
        arrays = [np.asarray(x) for x in inputs]
        types = tuple(result_types) if result_types else None
        outs = reference(arrays, attrs, types)
        if types is None:
            return outs
        return [np.asarray(o).astype(value_dtype(t.elem), copy=False)
                for o, t in zip(outs, types, strict=True)]

    def checked_reference(inputs: Sequence[np.ndarray], attrs: Mapping[str, Any],
                          result_types: Sequence[TensorType] | None = None) -> list[np.ndarray]:
        # Reference semantics are IEEE arithmetic: inf and NaN are results, not warnings.
        with np.errstate(all="ignore"):
            return prechecked_reference(inputs, check_attr_values(op, specs, attrs),
                                        result_types)

    def checked_flops(ins: Sequence[TensorType], outs: Sequence[TensorType],
                      attrs: Mapping[str, Any]) -> int:
        return int(flops(ins, check_attr_values(op, specs, attrs)))

    return define(OpDef(
        name=op, min_operands=lo, max_operands=hi, attrs=specs, infer=checked_infer,
        reference=checked_reference, reference_checked=prechecked_reference,
        flops=checked_flops, precisions=precisions,
        # Every mp op is a function of its operands and attributes.
        traits=traits | {Trait.PURE}, weight_operand=weight_operand, doc=doc,
        operand_names=operands, vjp=vjp, num_results=num_results, bounds=bounds,
    ))


def _count_text(lo: int, hi: int | None) -> str:
    if hi is None:
        return f"at least {lo} operand{'s' * (lo != 1)}"
    if lo == hi:
        return f"{lo} operand{'s' * (lo != 1)}" if lo else "no operands"
    return f"{lo} to {hi} operands"


# ---------------------------------------------------------------------------------------------
# Gradient rules: what every op's `vjp` builds the backward graph from (passes/grad.py). A rule
# gets the operands, the result and its cotangent `dy`, and returns each operand's cotangent,
# built from mp ops, so the backward graph is lowered, run and reported like the forward one.


def _sum_to(g: GradBuilder, v: Value, shape: tuple[int, ...]) -> Value:
    """A broadcast cotangent summed back to the shape of the operand that was broadcast."""
    t = g.type_of(v)
    if t.shape == shape:
        return v
    lead = t.rank - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape)
                                      if d == 1 and t.shape[lead + i] != 1)
    s = g.emit("mp.reduce_sum", [v], {"axes": axes, "keepdims": True}) if axes else v
    if g.type_of(s).shape == shape:
        return s
    return g.emit("mp.reshape", [s], result=tensor(shape, t.elem))


def _broadcast_to(g: GradBuilder, v: Value, shape: tuple[int, ...]) -> Value:
    """`v` broadcast to `shape` (numpy rules), as the sum with a zero splat."""
    t = g.type_of(v)
    if t.shape == shape:
        return v
    return g.emit("mp.add", [v, g.splat(0.0, shape, t.elem)])


def _times(g: GradBuilder, v: Value, k: float) -> Value:
    return g.emit("mp.mul", [v, g.splat(k, (), g.type_of(v).elem)])


def _one_minus(g: GradBuilder, v: Value) -> Value:
    return g.emit("mp.sub", [g.splat(1.0, (), g.type_of(v).elem), v])


def _zeros_like(g: GradBuilder, v: Value) -> Value:
    t = g.type_of(v)
    return g.splat(0.0, t.shape, t.elem)


def _no_rule(op: str, why: str) -> OpError:
    return OpError(f"{op} has no gradient rule for {why}")


# Compute formats an op may be assigned. Contractions run on tensor cores in every format the
# targets know; vector work (elementwise, normalization, reductions) in the 16/32-bit floats.
# Whether softmax, norms, exp/log and reductions stay in f32 is a policy decision, not the op's.
_CONTRACTION = frozenset(COMPUTE_FORMATS)
_VECTOR = frozenset({"f32", "bf16", "f16"})

# matmul and conv2d: the GEMMs, which hold nearly all the FLOPs, choose an accumulator, and
# which the quantize pass rewrites to integer arithmetic.
_GEMM = frozenset({Trait.CONTRACTION, Trait.ACCUMULATES, Trait.COMPUTE_HEAVY, Trait.QUANTIZABLE})
_ELEMENTWISE = frozenset({Trait.ELEMENTWISE})
_PRESERVES = frozenset({Trait.VALUE_PRESERVING})
_MOVES = frozenset({Trait.VALUE_PRESERVING, Trait.DATA_MOVEMENT})
# Conversions: their result type is what they compute, so no precision is assigned to them.
_CONVERSION = frozenset({Trait.ELEMENTWISE, Trait.TYPE_CARRYING, Trait.CONVERSION})


def _elementwise_size(ins: Sequence[TensorType]) -> int:
    shape = ins[0].shape
    for t in ins[1:]:
        shape = _broadcast(shape, t.shape) or shape
    return _prod(shape)


def _per_element(k: int) -> _ImplFlops:
    return lambda ins, a: k * _elementwise_size(ins)


def _per_input_element(ins: Sequence[TensorType], a: dict) -> int:
    return ins[0].size


def _no_flops(ins: Sequence[TensorType], a: dict) -> int:
    return 0


_WINDOW_ATTRS = {
    "strides": AttrSpec("ints", default=(1, 1), length=2, min=1),
    "padding": AttrSpec("ints", default=(0, 0, 0, 0), length=4, min=0),  # top, left, bottom, right
}


def _window_out(size: int, pad: int, extent: int, stride: int) -> int:
    return (size + pad - extent) // stride + 1


def _binary_infer(allowed: frozenset[str], what: str) -> _ImplInfer:
    def infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
        elem = _elem_of(ins, allowed, what)
        shape = _broadcast(ins[0].shape, ins[1].shape)
        if shape is None:
            raise OpError(f"operands are not broadcast-compatible: {ins[0]} and {ins[1]}",
                          operand=1)
        return [tensor(shape, elem)]
    return infer


def _binary_reference(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> _ImplReference:
    return lambda xs, a, rt: [fn(_num(xs[0]), _num(xs[1]))]


_PICKS = _ELEMENTWISE | _PRESERVES  # each result is one of the operands' values (or its negation)


def _binary_vjp(rule: Callable[[GradBuilder, Value, Value, Value, Value], tuple]) -> Vjp:
    """A rule for a broadcasting binary op from its unbroadcast cotangents (da, db)."""
    def vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
            needs: Sequence[bool]) -> list[Value | None]:
        grads = rule(g, xs[0], xs[1], y, dy)
        return [_sum_to(g, d(), g.type_of(x).shape) if need else None
                for d, x, need in zip(grads, xs, needs)]
    return vjp


def _unary_infer(allowed: frozenset[str], what: str) -> _ImplInfer:
    def infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
        return [tensor(ins[0].shape, _elem_of(ins, allowed, what))]
    return infer


def _mul(g: GradBuilder, *vs: Value) -> Value:
    out = vs[0]
    for v in vs[1:]:
        out = g.emit("mp.mul", [out, v])
    return out


_SUMS = frozenset({Trait.ACCUMULATES})
