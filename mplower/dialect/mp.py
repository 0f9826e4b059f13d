"""The mp op set: each op declared once with its signature, type rule, reference semantics and cost.

An `OpDef` is the single place that knows an op: how many operands it takes, which attributes
(with kinds and defaults), how its result types follow from its operands (`infer`), what it
computes (`reference`, numpy, ONNX semantics where ONNX has the op), how many FLOPs it costs,
which compute precisions it may be lowered to, and its traits (a contraction, a conversion, ...).
The verifier, the passes, the cost model and the backend all read these declarations; none of
them re-derives an op's rules, and the op categories they test for are computed from the traits
at the end of this module. The machinery (`OpDef`, the registry, attribute checking) is the IR
layer's (mplower.ir.opdef); importing this module registers the mp ops there.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mplower.ir.opdef import (
    OPS,
    AttrSpec,
    GradBuilder,
    OpDef,
    OpError,
    Trait,
    Value,
    Vjp,
    check_attr_values,
    define,
    ops_with,
    show_value,
)
from mplower.ir.types import (
    ELEMENT_TYPES,
    ENCODINGS,
    DenseAttr,
    TensorType,
    tensor,
    value_dtype,
)
from mplower.numerics.formats import COMPUTE_FORMATS, FLOATS, FORMATS, QUANT_FLOATS, QUANT_STORAGE

# ---------------------------------------------------------------------------------------------
# Type rules shared by several ops

_FLOATS = FLOATS
# i1 is a mask type: it may be moved around and compared but not computed with.
_NUMERIC = frozenset(n for n in ELEMENT_TYPES if n != "i1")
_ANY = frozenset(ELEMENT_TYPES)
_INT8 = frozenset({"i8", "ui8"})
_QUANT_TYPES = QUANT_STORAGE
# What mp.quantize produces and mp.dequantize reads: the integers, and the scaled floats.
_QUANTIZED = QUANT_STORAGE + QUANT_FLOATS


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
         num_results: int | None = 1) -> OpDef:
    op = f"mp.{name}"
    specs = dict(attrs)
    lo = sum(1 for n in operands if not n.endswith(("?", "...")))
    lo += any(n.endswith("...") for n in operands)  # a variadic list holds at least one value
    hi = None if any(n.endswith("...") for n in operands) else len(operands)

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
        operand_names=operands, vjp=vjp, num_results=num_results,
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


# ---------------------------------------------------------------------------------------------
# constant


def _constant_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    if ("name" in a) == ("value" in a):
        raise OpError("mp.constant needs exactly one of 'name' (a key of the weights file) or "
                      "'value' (dense elements)")
    t = _declared("mp.constant", declared)
    if "value" in a and a["value"].type.shape != t.shape:
        raise OpError(f"constant value has type {a['value'].type}, which does not have the "
                      f"shape of the result type {t}")
    return [t]


def _constant_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    if "value" not in a:
        raise OpError(f"mp.constant {{name = {show_value(a['name'])}}} is loaded from the weights file "
                      "by the executor; it has no reference value of its own")
    return [a["value"].array]


_def("constant",
     operands=(),
     attrs={"name": AttrSpec("str"), "value": AttrSpec("dense")},
     infer=_constant_infer,
     reference=_constant_reference,
     flops=_no_flops,
     precisions=_ANY,
     doc="A tensor from the weights file (`name`) or inline (`value`); its type is the result type.",
     traits=frozenset({Trait.TYPE_CARRYING}))


# ---------------------------------------------------------------------------------------------
# matmul and conv2d


def _matmul_shape(a: TensorType, b: TensorType) -> tuple[int, ...]:
    for i, t in enumerate((a, b)):
        if t.rank == 0:
            raise OpError(f"matmul operands must have rank >= 1, got {t}", operand=i)
    if b.encoding is not None and b.rank != 2:
        raise OpError(f"a sparse matmul operand must be 2-D, got {b}", operand=1)
    # np.matmul: a 1-D a is a row vector, a 1-D b a column vector; the added dim is dropped.
    sa = a.shape if a.rank >= 2 else (1,) + a.shape
    sb = b.shape if b.rank >= 2 else b.shape + (1,)
    if sa[-1] != sb[-2]:
        raise OpError(f"matmul contraction mismatch: {sa[-1]} vs {sb[-2]} ({a} @ {b})", operand=1)
    batch = _broadcast(sa[:-2], sb[:-2])
    if batch is None:
        raise OpError(f"matmul batch dimensions are not broadcast-compatible: {a} @ {b}",
                      operand=1)
    return batch + sa[-2:-1] * (a.rank >= 2) + sb[-1:] * (b.rank >= 2)


def _matmul_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    shape = _matmul_shape(ins[0], ins[1])
    return [tensor(shape, _contraction_elem("mp.matmul", ins[0], ins[1], declared))]


def _matmul_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    # mplower's own summation order, not BLAS's (mplower.numerics.gemm); imported here so
    # that parsing and verifying, which need this table but no numbers, do not load numba.
    from mplower.numerics.gemm import matmul

    return [matmul(_num(xs[0]), _num(xs[1]))]


def _matmul_flops(ins: Sequence[TensorType], a: dict) -> int:
    # One multiply and one add per (output element, contraction index).
    return 2 * _prod(_matmul_shape(ins[0], ins[1])) * ins[0].shape[-1]



def _swap_last(g: GradBuilder, v: Value) -> Value:
    r = g.type_of(v).rank
    return g.emit("mp.transpose", [v], {"perm": tuple(range(r - 2)) + (r - 1, r - 2)})


def _matmul_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
                needs: Sequence[bool]) -> list[Value | None]:
    ta, tb = g.type_of(xs[0]), g.type_of(xs[1])
    if ta.rank < 2 or tb.rank < 2:
        raise _no_rule("mp.matmul", "1-D operands (reshape them to 2-D)")
    da = db = None
    if needs[0]:  # dA = dY @ B^T, summed over the batch dims A was broadcast along
        da = _sum_to(g, g.emit("mp.matmul", [dy, _swap_last(g, xs[1])]), ta.shape)
    if needs[1]:  # dB = A^T @ dY
        db = _sum_to(g, g.emit("mp.matmul", [_swap_last(g, xs[0]), dy]), tb.shape)
    return [da, db]

_def("matmul",
     vjp=_matmul_vjp,
     operands=("a", "b"),
     attrs={},
     infer=_matmul_infer,
     reference=_matmul_reference,
     flops=_matmul_flops,
     precisions=_CONTRACTION,
     doc="Matrix product with numpy broadcasting over batch dimensions (np.matmul, ONNX MatMul).",
     traits=_GEMM,
     weight_operand=1,
     encoded_operands=frozenset({1}))

_WINDOW_ATTRS = {
    "strides": AttrSpec("ints", default=(1, 1), length=2, min=1),
    "padding": AttrSpec("ints", default=(0, 0, 0, 0), length=4, min=0),  # top, left, bottom, right
}


def _window_out(size: int, pad: int, extent: int, stride: int) -> int:
    return (size + pad - extent) // stride + 1


def _conv_geometry(ins: Sequence[TensorType], a: dict) -> tuple[int, int]:
    """(Hout, Wout) of a conv2d, after checking channels, groups and bias."""
    x, w = ins[0], ins[1]
    _need_rank(x, 4, 0, "NCHW")
    _need_rank(w, 4, 1, "OIHW")
    (_, c, h, wd), (o, cg, kh, kw) = x.shape, w.shape
    g = a["groups"]
    if c % g:
        raise OpError(f"conv2d input channels {c} are not divisible by groups {g}", operand=0)
    if cg * g != c:
        raise OpError(f"conv2d channel mismatch: input {x} has {c} channels but weight {w} "
                      f"expects {cg} x {g} group(s) = {cg * g}", operand=1)
    if o % g:
        raise OpError(f"conv2d output channels {o} are not divisible by groups {g}", operand=1)
    if len(ins) == 3 and ins[2].shape != (o,):
        raise OpError(f"conv2d bias must have shape ({o},), got {ins[2]}", operand=2)
    (sh, sw), (pt, pl, pb, pr), (dh, dw) = a["strides"], a["padding"], a["dilations"]
    eh, ew = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    if eh > h + pt + pb or ew > wd + pl + pr:
        raise OpError(f"conv2d kernel (dilated {eh}x{ew}) is larger than the padded input "
                      f"{h + pt + pb}x{wd + pl + pr}", operand=1)
    return _window_out(h, pt + pb, eh, sh), _window_out(wd, pl + pr, ew, sw)


def _conv_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    ho, wo = _conv_geometry(ins, a)
    x, w = ins[0], ins[1]
    elem = _contraction_elem("mp.conv2d", x, w, declared)
    if len(ins) == 3 and ins[2].elem not in (x.elem, elem):
        raise OpError(f"conv2d bias element type must be {x.elem} or {elem}, got {ins[2]}",
                      operand=2)
    return [tensor((x.shape[0], w.shape[0], ho, wo), elem)]


def _conv_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    # im2col on mplower's fixed-order GEMM (see _matmul_reference); integers exactly, without
    # widening them to int64 first (mplower.numerics.conv).
    from mplower.numerics.conv import conv2d

    integer = xs[0].dtype.kind in "iub" and xs[1].dtype.kind in "iub"
    x, w = (xs[0], xs[1]) if integer else (_num(xs[0]), _num(xs[1]))
    bias = _num(xs[2]) if len(xs) == 3 else None
    geometry = (a["strides"], a["padding"], a["dilations"], a["groups"])
    if not integer:  # the bias added as the GEMM stores each output: the same float sums
        return [conv2d(x, w, *geometry, bias=bias)]
    y = conv2d(x, w, *geometry)
    return [y if bias is None else y + bias.reshape(1, -1, 1, 1)]


def _conv_flops(ins: Sequence[TensorType], a: dict) -> int:
    # 2 * N * Cout * Hout * Wout * (Cin / groups) * KH * KW; the bias adds (one per output,
    # under 1/(2 * Cin/groups * KH * KW) of the total) are left out, as fvcore and ptflops do.
    ho, wo = _conv_geometry(ins, a)
    n, (o, cg, kh, kw) = ins[0].shape[0], ins[1].shape
    return 2 * n * o * ho * wo * cg * kh * kw



def _conv_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
              needs: Sequence[bool]) -> list[Value | None]:
    """Both gradients as forward convolutions (so a policy lowers them as it lowers conv2d):
    the input's is the correlation of the zero-stuffed dY with the flipped, channel-swapped
    weight; the weight's the correlation of x with dY, batch and channels swapped, strides and
    dilations exchanged. Grouped convolutions: the same per group, on channel slices, joined."""
    groups = a["groups"]
    if groups == 1:
        dx, dw = _conv_group_vjp(g, xs[0], xs[1], dy, a, needs[0], needs[1])
    else:
        cg, og = g.type_of(xs[1]).shape[1], g.type_of(xs[1]).shape[0] // groups
        parts = [_conv_group_vjp(g, _channels(g, xs[0], 1, i * cg, cg),
                                 _channels(g, xs[1], 0, i * og, og),
                                 _channels(g, dy, 1, i * og, og), a, needs[0], needs[1])
                 for i in range(groups)]
        dx = g.emit("mp.concat", [p[0] for p in parts], {"axis": 1}) if needs[0] else None
        dw = g.emit("mp.concat", [p[1] for p in parts], {"axis": 0}) if needs[1] else None
    out: list[Value | None] = [dx, dw]
    if len(xs) == 3:
        out.append(g.emit("mp.reduce_sum", [dy], {"axes": (0, 2, 3), "keepdims": False})
                   if needs[2] else None)
    return out


def _channels(g: GradBuilder, v: Value, axis: int, start: int, size: int) -> Value:
    shape = g.type_of(v).shape
    return g.emit("mp.slice", [v], {"starts": tuple(start if i == axis else 0
                                                    for i in range(len(shape))),
                                    "ends": tuple(start + size if i == axis else d
                                                  for i, d in enumerate(shape))})


def _conv_group_vjp(g: GradBuilder, x: Value, wv: Value, dy: Value, a: dict, need_x: bool,
                    need_w: bool) -> tuple[Value | None, Value | None]:
    """(dx, dw) of one group of a conv2d (see `_conv_vjp`)."""
    tx, tw, tdy = g.type_of(x), g.type_of(wv), g.type_of(dy)
    (n, c, h, w), (o, _, kh, kw), (ho, wo) = tx.shape, tw.shape, tdy.shape[2:]
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = a["strides"], a["dilations"], a["padding"]
    eh, ew = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    dx = dwt = None
    swap = {"perm": (1, 0, 2, 3)}
    if need_x:
        rem_h, rem_w = (h + pt + pb - eh) % sh, (w + pl + pr - ew) % sw
        pads = (eh - 1 - pt, ew - 1 - pl, eh - 1 - pb + rem_h, ew - 1 - pr + rem_w)
        if min(pads) < 0:
            raise _no_rule("mp.conv2d", "padding at least as large as the kernel")
        big = -(2 ** 31)  # ONNX Slice's "to the start" for a negative step
        flipped = g.emit("mp.slice", [wv], {"starts": (0, 0, kh - 1, kw - 1),
                                                "ends": (o, c, big, big), "steps": (1, 1, -1, -1)})
        wt = g.emit("mp.transpose", [flipped], swap)
        spread = dy
        if (sh, sw) != (1, 1):  # put stride - 1 zeros between the rows and columns of dY
            e = tdy.elem
            spread = g.emit("mp.reshape", [dy], result=tensor((n, o, ho, 1, wo, 1), e))
            if sh > 1:
                spread = g.emit("mp.concat", [spread, g.splat(0.0, (n, o, ho, sh - 1, wo, 1), e)],
                                {"axis": 3})
            if sw > 1:
                spread = g.emit("mp.concat", [spread, g.splat(0.0, (n, o, ho, sh, wo, sw - 1), e)],
                                {"axis": 5})
            spread = g.emit("mp.reshape", [spread], result=tensor((n, o, ho * sh, wo * sw), e))
            spread = g.emit("mp.slice", [spread], {"starts": (0, 0, 0, 0), "ends": (
                n, o, (ho - 1) * sh + 1, (wo - 1) * sw + 1)})
        dx = g.emit("mp.conv2d", [spread, wt], {"padding": pads, "dilations": (dh, dw)})
    if need_w:
        full = g.emit("mp.conv2d", [g.emit("mp.transpose", [x], swap),
                                    g.emit("mp.transpose", [dy], swap)],
                      {"strides": (dh, dw), "dilations": (sh, sw), "padding": (pt, pl, pb, pr)})
        if g.type_of(full).shape[2:] != (kh, kw):  # rows the strides never reached
            full = g.emit("mp.slice", [full], {"starts": (0, 0, 0, 0), "ends": (c, o, kh, kw)})
        dwt = g.emit("mp.transpose", [full], swap)
    return dx, dwt


_def("conv2d",
     vjp=_conv_vjp,
     operands=("x", "w", "bias?"),
     attrs={**_WINDOW_ATTRS, "dilations": AttrSpec("ints", default=(1, 1), length=2, min=1),
            "groups": AttrSpec("int", default=1, min=1)},
     infer=_conv_infer,
     reference=_conv_reference,
     flops=_conv_flops,
     precisions=_CONTRACTION,
     doc="2-D convolution, NCHW input, OIHW weight, optional bias (ONNX Conv with group).",
     traits=_GEMM,
     weight_operand=1)


# ---------------------------------------------------------------------------------------------
# Elementwise


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


# Where the reference's add and relu of float arrays run compiled (mplower.numerics.elementwise):
# below this numpy's own loop is as fast.
_COMPILED_FROM = 1 << 16


def _add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.shape == b.shape and a.dtype == b.dtype and a.dtype in (np.float32, np.float64) \
            and a.size >= _COMPILED_FROM:
        from mplower.numerics.elementwise import add  # np.add's bits, on two threads

        return add(a, b)
    return np.add(a, b)


_PICKS = _ELEMENTWISE | _PRESERVES  # each result is one of the operands' values (or its negation)

def _binary_vjp(rule: Callable[[GradBuilder, Value, Value, Value, Value], tuple]) -> Vjp:
    """A rule for a broadcasting binary op from its unbroadcast cotangents (da, db)."""
    def vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
            needs: Sequence[bool]) -> list[Value | None]:
        grads = rule(g, xs[0], xs[1], y, dy)
        return [_sum_to(g, d(), g.type_of(x).shape) if need else None
                for d, x, need in zip(grads, xs, needs)]
    return vjp


def _pick_vjp(larger: bool) -> Vjp:
    """maximum (`larger`) and minimum: dy to the operand picked, half to each on a tie (as
    JAX and PyTorch split it), from relu_grad's masks of a - b and b - a."""
    def rule(g: GradBuilder, a: Value, b: Value, y: Value, dy: Value) -> tuple:
        ahead, behind = g.emit("mp.sub", [a, b]), g.emit("mp.sub", [b, a])
        if not larger:
            ahead, behind = behind, ahead
        a_wins = g.emit("mp.relu_grad", [dy, ahead])
        b_wins = g.emit("mp.relu_grad", [dy, behind])
        rest = g.emit("mp.sub", [g.emit("mp.sub", [dy, a_wins]), b_wins])
        half_tie = _times(g, rest, 0.5)
        return (lambda: g.emit("mp.add", [a_wins, half_tie]),
                lambda: g.emit("mp.add", [b_wins, half_tie]))
    return _binary_vjp(rule)


_BINARY_VJP = {
    "maximum": _pick_vjp(larger=True),
    "minimum": _pick_vjp(larger=False),
    "add": _binary_vjp(lambda g, a, b, y, dy: (lambda: dy, lambda: dy)),
    "sub": _binary_vjp(lambda g, a, b, y, dy: (lambda: dy, lambda: g.emit("mp.neg", [dy]))),
    "mul": _binary_vjp(lambda g, a, b, y, dy: (lambda: g.emit("mp.mul", [dy, b]),
                                               lambda: g.emit("mp.mul", [dy, a]))),
    "div": _binary_vjp(lambda g, a, b, y, dy: (
        lambda: g.emit("mp.div", [dy, b]),
        lambda: g.emit("mp.neg", [g.emit("mp.div", [g.emit("mp.mul", [dy, y]), b])]))),
}


for _name, _fn, _allowed, _doc, _traits in (
    ("add", _add, _NUMERIC, "a + b", _ELEMENTWISE),
    ("sub", np.subtract, _NUMERIC, "a - b", _ELEMENTWISE),
    ("mul", np.multiply, _NUMERIC, "a * b", _ELEMENTWISE),
    # Integer division has no single convention (C truncates, numpy floors): floats only.
    ("div", np.divide, _FLOATS, "a / b (float types)", _ELEMENTWISE),
    ("maximum", np.maximum, _NUMERIC, "max(a, b), NaN propagating (ONNX Max)", _PICKS),
    ("minimum", np.minimum, _NUMERIC, "min(a, b), NaN propagating (ONNX Min)", _PICKS),
):
    _what = "a float" if _allowed is _FLOATS else "a numeric"
    _def(_name,
         vjp=_BINARY_VJP.get(_name),
         operands=("a", "b"),
         attrs={},
         infer=_binary_infer(_allowed, _what),
         reference=_binary_reference(_fn),
         flops=_per_element(1),
         precisions=_VECTOR,
         doc=f"Elementwise {_doc} with numpy broadcasting.",
         traits=_traits)


def _unary_infer(allowed: frozenset[str], what: str) -> _ImplInfer:
    def infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
        return [tensor(ins[0].shape, _elem_of(ins, allowed, what))]
    return infer


def _unary_reference(fn: Callable[[np.ndarray], np.ndarray]) -> _ImplReference:
    return lambda xs, a, rt: [fn(_num(xs[0]))]


def _relu(x: np.ndarray) -> np.ndarray:
    if x.dtype in (np.float32, np.float64) and x.size >= _COMPILED_FROM:
        from mplower.numerics.elementwise import relu  # np.maximum's bits, on two threads

        return relu(x)
    return np.maximum(x, x.dtype.type(0))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # Both branches exponentiate a non-positive number, so neither overflows.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def _rsqrt(x: np.ndarray) -> np.ndarray:
    return np.reciprocal(np.sqrt(x))


def _unary_vjp(rule: Callable[[GradBuilder, Value, Value, Value], Value]) -> Vjp:
    return lambda g, xs, y, dy, a, needs: [rule(g, xs[0], y, dy)]


def _mul(g: GradBuilder, *vs: Value) -> Value:
    out = vs[0]
    for v in vs[1:]:
        out = g.emit("mp.mul", [out, v])
    return out


_UNARY_VJP = {
    "neg": _unary_vjp(lambda g, x, y, dy: g.emit("mp.neg", [dy])),
    "relu": _unary_vjp(lambda g, x, y, dy: g.emit("mp.relu_grad", [dy, x])),
    "sigmoid": _unary_vjp(lambda g, x, y, dy: _mul(g, dy, y, _one_minus(g, y))),
    "tanh": _unary_vjp(lambda g, x, y, dy: g.emit("mp.mul", [dy, _one_minus(g, _mul(g, y, y))])),
    "exp": _unary_vjp(lambda g, x, y, dy: g.emit("mp.mul", [dy, y])),
    "log": _unary_vjp(lambda g, x, y, dy: g.emit("mp.div", [dy, x])),
    "sqrt": _unary_vjp(lambda g, x, y, dy: g.emit("mp.div", [_times(g, dy, 0.5), y])),
    "rsqrt": _unary_vjp(lambda g, x, y, dy: _mul(g, _times(g, dy, -0.5), y, y, y)),
}



for _name, _fn, _allowed, _doc, _traits in (
    ("neg", np.negative, _NUMERIC, "-x (ONNX Neg)", _PICKS),
    ("relu", _relu, _NUMERIC, "max(x, 0) (ONNX Relu)", _PICKS),
    ("sigmoid", _sigmoid, _FLOATS, "1 / (1 + exp(-x)) (ONNX Sigmoid)", _ELEMENTWISE),
    ("tanh", np.tanh, _FLOATS, "tanh(x)", _ELEMENTWISE),
    ("exp", np.exp, _FLOATS, "exp(x)", _ELEMENTWISE),
    ("log", np.log, _FLOATS, "natural logarithm", _ELEMENTWISE),
    ("sqrt", np.sqrt, _FLOATS, "square root", _ELEMENTWISE),
    ("rsqrt", _rsqrt, _FLOATS, "1 / sqrt(x)", _ELEMENTWISE),
):
    _what = "a float" if _allowed is _FLOATS else "a numeric"
    _def(_name,
         vjp=_UNARY_VJP[_name],
         operands=("x",),
         attrs={},
         infer=_unary_infer(_allowed, _what),
         reference=_unary_reference(_fn),
         flops=_per_element(1),
         precisions=_VECTOR,
         doc=f"Elementwise {_doc}.",
         traits=_traits)

def _relu_grad_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    dy, x = _num(xs[0]), _num(xs[1])
    return [np.where(x > 0, dy, dy.dtype.type(0))]


_def("relu_grad",
     operands=("dy", "x"),
     attrs={},
     infer=_binary_infer(_FLOATS, "a float"),
     reference=_relu_grad_reference,
     flops=_per_element(1),
     precisions=_VECTOR,
     doc="The gradient of relu: dy where x > 0, else 0 (the backward of mp.relu).",
     traits=_PICKS)

_ERFC_COEFFS = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807,
                -1.13520398, 1.48851587, -0.82215223, 0.17087277)


def _erfc(x: np.ndarray) -> np.ndarray:
    """erfc on float64 with relative error below 1.2e-7 everywhere (Chebyshev fit of Press et
    al., Numerical Recipes, erfcc): exact to float32, numpy-only, and relative (not absolute)
    so that GELU's far negative tail keeps its digits."""
    z = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = np.zeros_like(t)
    for c in reversed(_ERFC_COEFFS):
        poly = c + t * poly
    r = t * np.exp(poly - z * z)
    return np.where(x >= 0, r, 2.0 - r)


def _gelu_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x = _fl(xs[0])
    x64 = x.astype(np.float64)
    if a["approximate"] == "tanh":
        inner = math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)
        y = 0.5 * x64 * (1 + np.tanh(inner))
    else:
        y = 0.5 * x64 * _erfc(-x64 / math.sqrt(2))  # 1 + erf(v) == erfc(-v), without cancellation
    return [y.astype(x.dtype)]


def _gelu_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
              needs: Sequence[bool]) -> list[Value | None]:
    x = xs[0]
    if a["approximate"] == "tanh":  # d/dx 0.5 x (1 + tanh u), u = c (x + k x^3)
        c, k = math.sqrt(2 / math.pi), 0.044715
        x2 = _mul(g, x, x)
        u = _times(g, g.emit("mp.add", [x, _times(g, _mul(g, x2, x), k)]), c)
        t = g.emit("mp.tanh", [u])
        du = _times(g, g.emit("mp.add", [g.splat(1.0, (), g.type_of(x).elem),
                                        _times(g, x2, 3 * k)]), c)
        sech2 = _one_minus(g, _mul(g, t, t))
        half = _times(g, g.emit("mp.add", [g.splat(1.0, (), g.type_of(x).elem), t]), 0.5)
        d = g.emit("mp.add", [half, _times(g, _mul(g, x, sech2, du), 0.5)])
    else:  # Phi(x) + x phi(x)
        cdf = _times(g, g.emit("mp.add", [g.splat(1.0, (), g.type_of(x).elem),
                                         g.emit("mp.erf", [_times(g, x, 1 / math.sqrt(2))])]),
                     0.5)
        pdf = _times(g, g.emit("mp.exp", [_times(g, _mul(g, x, x), -0.5)]),
                     1 / math.sqrt(2 * math.pi))
        d = g.emit("mp.add", [cdf, _mul(g, x, pdf)])
    return [g.emit("mp.mul", [dy, d])]

# GELU: about 8 operations per element for the tanh form (cube, two multiply-adds, tanh, add,
# two multiplies); the erf form is counted the same.
_def("gelu",
     vjp=_gelu_vjp,
     operands=("x",),
     attrs={"approximate": AttrSpec("str", default="none", choices=("none", "tanh"))},
     infer=_unary_infer(_FLOATS, "a float"),
     reference=_gelu_reference,
     flops=_per_element(8),
     precisions=_VECTOR,
     doc="GELU, exact (erf) or tanh approximation (ONNX Gelu).",
     traits=_ELEMENTWISE)


def _erf_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    # math.erf (correctly rounded in float64) per element in a compiled loop; an erfc-based fit
    # would lose relative precision near 0, where erf(x) ~ 1.13 x.
    from mplower.numerics.special import erf

    return [erf(_fl(xs[0]))]


def _erf_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
             needs: Sequence[bool]) -> list[Value | None]:
    x = xs[0]
    e = g.emit("mp.exp", [g.emit("mp.neg", [_mul(g, x, x)])])
    return [_times(g, g.emit("mp.mul", [dy, e]), 2 / math.sqrt(math.pi))]

_def("erf",
     vjp=_erf_vjp,
     operands=("x",),
     attrs={},
     infer=_unary_infer(_FLOATS, "a float"),
     reference=_erf_reference,
     flops=_per_element(8),
     precisions=_VECTOR,
     doc="Elementwise Gauss error function (ONNX Erf).",
     traits=_ELEMENTWISE)


# ---------------------------------------------------------------------------------------------
# Normalizations


def _softmax_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    elem = _elem_of(ins, _FLOATS, "a float")
    _axis(a["axis"], ins[0].rank)
    return [tensor(ins[0].shape, elem)]


def _softmax_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x = _fl(xs[0])
    axis = a["axis"]
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return [e / np.sum(e, axis=axis, keepdims=True)]


def _softmax_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
                 needs: Sequence[bool]) -> list[Value | None]:
    dot = g.emit("mp.reduce_sum", [_mul(g, dy, y)], {"axes": (a["axis"],), "keepdims": True})
    return [g.emit("mp.mul", [y, g.emit("mp.sub", [dy, dot])])]

# Softmax: 5 operations per element (max, subtract, exp, sum, divide).
_def("softmax",
     vjp=_softmax_vjp,
     operands=("x",),
     attrs={"axis": AttrSpec("int", default=-1)},
     infer=_softmax_infer,
     reference=_softmax_reference,
     flops=_per_element(5),
     precisions=_VECTOR,
     doc="Softmax along one axis (ONNX Softmax, opset 13).")


def _log_softmax_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x = _fl(xs[0])
    d = x - np.max(x, axis=a["axis"], keepdims=True)
    return [d - np.log(np.sum(np.exp(d), axis=a["axis"], keepdims=True))]


def _log_softmax_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
                     needs: Sequence[bool]) -> list[Value | None]:
    total = g.emit("mp.reduce_sum", [dy], {"axes": (a["axis"],), "keepdims": True})
    return [g.emit("mp.sub", [dy, _mul(g, g.emit("mp.exp", [y]), total)])]

# LogSoftmax: 5 operations per element (max, subtract, exp, sum, subtract; one log per row).
_def("log_softmax",
     vjp=_log_softmax_vjp,
     operands=("x",),
     attrs={"axis": AttrSpec("int", default=-1)},
     infer=_softmax_infer,
     reference=_log_softmax_reference,
     flops=_per_element(5),
     precisions=_VECTOR,
     doc="log(softmax(x)) along one axis, computed as x - max - log(sum(exp(x - max))) "
         "(ONNX LogSoftmax, opset 13).")


def _lrn_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x = ins[0]
    if x.rank < 3:
        raise OpError(f"operand #0 must have rank >= 3 (N, C, spatial...), got {x}", operand=0)
    return [tensor(x.shape, _elem_of(ins, _FLOATS, "a float"))]


def _lrn_window(size: int) -> tuple[int, int]:
    """How many channels before and after c ONNX LRN's window of `size` reads."""
    return (size - 1) // 2, size - 1 - (size - 1) // 2


def _lrn_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x = _fl(xs[0])
    size = a["size"]
    lo, hi = _lrn_window(size)
    sq = np.square(x.astype(np.float64))
    pads = [(0, 0)] * x.ndim
    pads[1] = (lo, hi)
    win = np.lib.stride_tricks.sliding_window_view(np.pad(sq, pads), size, axis=1)
    scale = a["bias"] + a["alpha"] / size * win.sum(axis=-1)
    return [(x / scale ** a["beta"]).astype(x.dtype)]


def _channel_window_sum(g: GradBuilder, v: Value, before: int, after: int) -> Value:
    """For each channel c, the sum of v over channels c - before .. c + after (clipped): the
    zero-padded channel axis sliced once per window position, the slices added."""
    t = g.type_of(v)
    channels = t.shape[1]

    def zeros(k: int) -> list[Value]:
        return [g.splat(0.0, t.shape[:1] + (k,) + t.shape[2:], t.elem)] if k else []
    parts = [*zeros(before), v, *zeros(after)]
    padded = g.emit("mp.concat", parts, {"axis": 1}) if len(parts) > 1 else v
    total = None
    for m in range(before + after + 1):
        starts = [0, m] + [0] * (t.rank - 2)
        part = g.emit("mp.slice", [padded], {"starts": starts,
                                             "ends": [t.shape[0], m + channels, *t.shape[2:]]})
        total = part if total is None else g.emit("mp.add", [total, part])
    return total


def _lrn_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
             needs: Sequence[bool]) -> list[Value | None]:
    """With s = bias + alpha/size * window_sum(x^2), y = x s^-beta:
    dx = dy s^-beta - 2 alpha beta / size * x * window_sum'(dy x s^(-beta-1)), where
    window_sum' sums over the channels whose window holds c (the window mirrored)."""
    x = xs[0]
    elem = g.type_of(x).elem
    size, beta = a["size"], a["beta"]
    lo, hi = _lrn_window(size)
    sq = _channel_window_sum(g, g.emit("mp.mul", [x, x]), lo, hi)
    s = g.emit("mp.add", [_times(g, sq, a["alpha"] / size), g.splat(a["bias"], (), elem)])
    s_beta = g.emit("mp.pow", [s, g.splat(-beta, (), elem)])
    direct = g.emit("mp.mul", [dy, s_beta])
    back = _mul(g, dy, x, g.emit("mp.div", [s_beta, s]))
    spread = _channel_window_sum(g, back, hi, lo)
    cross = _times(g, g.emit("mp.mul", [x, spread]), -2 * a["alpha"] * beta / size)
    return [g.emit("mp.add", [direct, cross])]


# LRN: a square and an add per window element, then scale, power and divide.
_def("lrn",
     vjp=_lrn_vjp,
     operands=("x",),
     attrs={"size": AttrSpec("int", required=True, min=1),
            "alpha": AttrSpec("float", default=1e-4),
            "beta": AttrSpec("float", default=0.75),
            "bias": AttrSpec("float", default=1.0)},
     infer=_lrn_infer,
     reference=_lrn_reference,
     flops=lambda ins, a: (2 * a["size"] + 3) * ins[0].size,
     precisions=_VECTOR,
     doc="Local response normalization across channels: x / (bias + alpha / size * "
         "sum of x^2 over `size` neighbouring channels)^beta (ONNX LRN).")


def _norm_infer(params: tuple[str, ...]) -> _ImplInfer:
    def infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
        elem = _elem_of(ins, _FLOATS, "a float")
        x = ins[0]
        axis = _axis(a["axis"], x.rank)
        want = tensor(x.shape[axis:], elem)
        for i, pname in enumerate(params, start=1):
            if ins[i].shape != want.shape:
                raise OpError(f"operand #{i} ({pname}) must have type {want} (the shape of x "
                              f"from axis {axis} on), got {ins[i]}", operand=i)
        return [tensor(x.shape, elem)]
    return infer


def _norm_axes(x: np.ndarray, axis: int) -> tuple[int, ...]:
    return tuple(range(axis % x.ndim, x.ndim))


def _layer_norm_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x, gamma, beta = (_fl(v) for v in xs)
    axes = _norm_axes(x, a["axis"])
    d = x - x.mean(axis=axes, keepdims=True)
    var = (d * d).mean(axis=axes, keepdims=True)
    return [d / np.sqrt(var + x.dtype.type(a["epsilon"])) * gamma + beta]


def _rms_norm_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x, gamma = (_fl(v) for v in xs)
    ms = (x * x).mean(axis=_norm_axes(x, a["axis"]), keepdims=True)
    return [x / np.sqrt(ms + x.dtype.type(a["epsilon"])) * gamma]


def _norm_vjp(centered: bool) -> Vjp:
    """layer_norm (`centered`) and rms_norm: recompute x-hat and 1/sigma, then
    dx = (dxhat - [mean(dxhat)] - xhat mean(dxhat xhat)) / sigma with dxhat = dy gamma."""
    def vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
            needs: Sequence[bool]) -> list[Value | None]:
        x, gamma = xs[0], xs[1]
        tx = g.type_of(x)
        axis = a["axis"] % tx.rank
        norm = {"axes": tuple(range(axis, tx.rank)), "keepdims": True}
        d = g.emit("mp.sub", [x, g.emit("mp.reduce_mean", [x], norm)]) if centered else x
        var = g.emit("mp.reduce_mean", [_mul(g, d, d)], norm)
        r = g.emit("mp.rsqrt", [g.emit("mp.add", [var, g.splat(a["epsilon"], (), tx.elem)])])
        xhat = g.emit("mp.mul", [d, r])
        out: list[Value | None] = [None] * len(xs)
        if needs[0]:
            dxhat = g.emit("mp.mul", [dy, gamma])
            inner = g.emit("mp.sub", [dxhat, _mul(g, xhat, g.emit(
                "mp.reduce_mean", [_mul(g, dxhat, xhat)], norm))])
            if centered:
                inner = g.emit("mp.sub", [inner, g.emit("mp.reduce_mean", [dxhat], norm)])
            out[0] = g.emit("mp.mul", [inner, r])
        lead = {"axes": tuple(range(axis)), "keepdims": False}

        def over_lead(v: Value) -> Value:
            return g.emit("mp.reduce_sum", [v], lead) if axis else v
        if needs[1]:
            out[1] = over_lead(g.emit("mp.mul", [dy, xhat]))
        if centered and needs[2]:
            out[2] = over_lead(dy)
        return out
    return vjp

_NORM_ATTRS = {"axis": AttrSpec("int", default=-1),
               "epsilon": AttrSpec("float", default=1e-5, min=0.0)}

# LayerNorm: 8 operations per element (mean, subtract, square, variance sum, normalize,
# scale, shift, and the rsqrt amortized); RMSNorm: 4 (square, sum, normalize, scale).
_def("layer_norm",
     vjp=_norm_vjp(centered=True),
     operands=("x", "gamma", "beta"),
     attrs=_NORM_ATTRS,
     infer=_norm_infer(("gamma", "beta")),
     reference=_layer_norm_reference,
     flops=_per_element(8),
     precisions=_VECTOR,
     doc="Layer normalization over the axes from `axis` on (ONNX LayerNormalization).")
_def("rms_norm",
     vjp=_norm_vjp(centered=False),
     operands=("x", "gamma"),
     attrs=_NORM_ATTRS,
     infer=_norm_infer(("gamma",)),
     reference=_rms_norm_reference,
     flops=_per_element(4),
     precisions=_VECTOR,
     doc="RMS normalization over the axes from `axis` on (ONNX RMSNormalization).")


# ---------------------------------------------------------------------------------------------
# Reductions


def _reduce_axes(a: dict, rank: int) -> tuple[int, ...]:
    axes = tuple(_axis(ax, rank, "axes") for ax in a["axes"])
    if len(set(axes)) != len(axes):
        raise OpError(f"attribute 'axes' repeats an axis: {show_value(a['axes'])}", operand=0)
    return axes or tuple(range(rank))  # ONNX: no axes reduces over all of them


def _reduced_shape(shape: tuple[int, ...], axes: tuple[int, ...], keep: bool) -> tuple:
    if keep:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _reduce_infer(allowed: frozenset[str], what: str) -> _ImplInfer:
    def infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
        elem = _elem_of(ins, allowed, what)
        axes = _reduce_axes(a, ins[0].rank)
        return [tensor(_reduced_shape(ins[0].shape, axes, a["keepdims"]), elem)]
    return infer


def _reduce_reference(fn: Callable[..., np.ndarray]) -> _ImplReference:
    def reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
        x = _num(xs[0])
        return [np.asarray(fn(x, axis=_reduce_axes(a, x.ndim), keepdims=a["keepdims"]))]
    return reference


def _reduce_vjp(mean: bool) -> Vjp:
    def vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
            needs: Sequence[bool]) -> list[Value | None]:
        tx = g.type_of(xs[0])
        axes = _reduce_axes(a, tx.rank)
        kept = tensor(_reduced_shape(tx.shape, axes, True), tx.elem)
        d = dy if a["keepdims"] else g.emit("mp.reshape", [dy], result=kept)
        if mean:
            d = _times(g, d, 1 / _prod(tx.shape[i] for i in axes))
        return [_broadcast_to(g, d, tx.shape)]
    return vjp


_REDUCE_VJP = {
    "reduce_sum": _reduce_vjp(False), "reduce_mean": _reduce_vjp(True),
    "reduce_max": lambda g, xs, y, dy, a, needs: [g.emit(
        "mp.reduce_max_grad", [dy, xs[0], y], {"axes": a["axes"], "keepdims": a["keepdims"]})],
}

_REDUCE_ATTRS = {"axes": AttrSpec("ints", default=()), "keepdims": AttrSpec("bool", default=True)}

_SUMS = frozenset({Trait.ACCUMULATES})

for _name, _fn, _allowed, _doc, _traits in (
    ("reduce_sum", np.sum, _NUMERIC, "Sum", _SUMS),
    ("reduce_mean", np.mean, _FLOATS, "Mean", _SUMS),
    ("reduce_max", np.max, _NUMERIC, "Maximum", _PRESERVES),
):
    _what = "a float" if _allowed is _FLOATS else "a numeric"
    _def(_name,
         vjp=_REDUCE_VJP.get(_name),
         operands=("x",),
         attrs=_REDUCE_ATTRS,
         infer=_reduce_infer(_allowed, _what),
         reference=_reduce_reference(_fn),
         flops=_per_input_element,
         precisions=_VECTOR,
         doc=f"{_doc} over `axes` (all when empty), optionally keeping them as 1 "
             f"(ONNX Reduce{_doc.capitalize().replace('Maximum', 'Max')}).",
         traits=_traits)


def _reduce_max_grad_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    dy, x, y = ins
    elem = _elem_of(ins, _FLOATS, "a float")
    want = _reduced_shape(x.shape, _reduce_axes(a, x.rank), a["keepdims"])
    for i, t in ((0, dy), (2, y)):
        if t.shape != want:
            raise OpError(f"operand #{i} must have the reduced shape {want} of x, got {t}",
                          operand=i)
    return [tensor(x.shape, elem)]


def _reduce_max_grad_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    dy, x, y = (_fl(v) for v in xs)
    axes = _reduce_axes(a, x.ndim)
    kept = _reduced_shape(x.shape, axes, True)
    hit = x == y.reshape(kept)
    share = hit / hit.sum(axis=axes, keepdims=True)  # tied maxima share the gradient, as JAX's
    return [(dy.reshape(kept) * share).astype(dy.dtype)]


_def("reduce_max_grad",
     operands=("dy", "x", "y"),
     attrs=_REDUCE_ATTRS,
     infer=_reduce_max_grad_infer,
     reference=_reduce_max_grad_reference,
     flops=lambda ins, a: 2 * ins[1].size,
     precisions=_VECTOR,
     doc="The gradient of reduce_max (y its result): dy to the elements equal to the maximum, "
         "shared equally among ties.")


def _argmax_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    _elem_of(ins, _NUMERIC, "a numeric")
    axis = _axis(a["axis"], ins[0].rank)
    # i32, as before the IR had i64 (plans and reports rely on it); the ONNX importer casts it
    # to ONNX's INT64.
    return [tensor(_reduced_shape(ins[0].shape, (axis,), a["keepdims"]), "i32")]


def _argmax_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    return [np.argmax(xs[0], axis=a["axis"], keepdims=a["keepdims"])]


_def("argmax",
     operands=("x",),
     attrs={"axis": AttrSpec("int", default=0),
            "keepdims": AttrSpec("bool", default=True)},
     infer=_argmax_infer,
     reference=_argmax_reference,
     flops=_per_input_element,
     precisions=_VECTOR,
     doc="Index (i32) of the first maximum along `axis` (ONNX ArgMax).")


# ---------------------------------------------------------------------------------------------
# Data movement: any element type, no arithmetic


def _reshape_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x, t = ins[0], _declared("mp.reshape", declared)
    if t.size != x.size:
        raise OpError(f"reshape changes the element count: {x} has {x.size} elements, "
                      f"{t} has {t.size}", operand=0)
    return [tensor(t.shape, x.elem)]


def _reshape_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    return [xs[0].reshape(_declared("mp.reshape", rt or ()).shape)]


def _reshape_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
                 needs: Sequence[bool]) -> list[Value | None]:
    return [g.emit("mp.reshape", [dy], result=g.type_of(xs[0]).with_elem(g.type_of(dy).elem))]

_def("reshape",
     vjp=_reshape_vjp,
     operands=("x",),
     attrs={},
     infer=_reshape_infer,
     reference=_reshape_reference,
     flops=_no_flops,
     precisions=_ANY,
     doc="Same elements in row-major order, in the shape of the result type (ONNX Reshape).",
     traits=_MOVES)


def _perm(a: dict, rank: int) -> tuple[int, ...]:
    perm = a.get("perm", tuple(reversed(range(rank))))  # ONNX: no perm reverses the axes
    if sorted(perm) != list(range(rank)):
        raise OpError(f"attribute 'perm' must be a permutation of {list(range(rank))}, "
                      f"got {list(perm)}", operand=0)
    return perm


def _transpose_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x = ins[0]
    return [tensor(tuple(x.shape[p] for p in _perm(a, x.rank)), x.elem)]


def _transpose_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
                   needs: Sequence[bool]) -> list[Value | None]:
    perm = _perm(a, g.type_of(xs[0]).rank)
    return [g.emit("mp.transpose", [dy], {"perm": tuple(int(i) for i in np.argsort(perm))})]

_def("transpose",
     vjp=_transpose_vjp,
     operands=("x",),
     attrs={"perm": AttrSpec("ints")},
     infer=_transpose_infer,
     reference=lambda xs, a, rt: [np.transpose(xs[0], _perm(a, xs[0].ndim))],
     flops=_no_flops,
     precisions=_ANY,
     doc="Permute the axes; `perm` defaults to reversing them (ONNX Transpose).",
     traits=_MOVES)


def _concat_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    elem = _elem_of(ins, _ANY, "any")
    first = ins[0]
    axis = _axis(a["axis"], first.rank)
    total = 0
    for i, t in enumerate(ins):
        if t.rank != first.rank:
            raise OpError(f"concat operands must have the same rank: operand #{i} is {t}, "
                          f"operand #0 is {first}", operand=i)
        if any(d != e for k, (d, e) in enumerate(zip(t.shape, first.shape)) if k != axis):
            raise OpError(f"concat operand #{i} {t} does not match operand #0 {first} in the "
                          f"dimensions other than axis {axis}", operand=i)
        total += t.shape[axis]
    return [tensor(first.shape[:axis] + (total,) + first.shape[axis + 1:], elem)]


def _concat_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
                needs: Sequence[bool]) -> list[Value | None]:
    shape = g.type_of(dy).shape
    axis = _axis(a["axis"], len(shape))
    out: list[Value | None] = []
    start = 0
    for x, need in zip(xs, needs):
        size = g.type_of(x).shape[axis]
        starts = tuple(start if i == axis else 0 for i in range(len(shape)))
        ends = tuple(start + size if i == axis else d for i, d in enumerate(shape))
        out.append(g.emit("mp.slice", [dy], {"starts": starts, "ends": ends}) if need else None)
        start += size
    return out

_def("concat",
     vjp=_concat_vjp,
     operands=("inputs...",),
     attrs={"axis": AttrSpec("int", required=True)},
     infer=_concat_infer,
     reference=lambda xs, a, rt: [np.concatenate(xs, axis=a["axis"])],
     flops=_no_flops,
     precisions=_ANY,
     doc="Join the operands along `axis` (ONNX Concat).",
     traits=_MOVES)


def _slices(shape: tuple[int, ...], a: dict) -> list[slice]:
    """ONNX Slice's clamping of starts/ends per dimension, as Python slices."""
    rank = len(shape)
    steps = a.get("steps", (1,) * rank)
    for name, v in (("starts", a["starts"]), ("ends", a["ends"]), ("steps", steps)):
        if len(v) != rank:
            raise OpError(f"attribute '{name}' must have one entry per dimension ({rank}), "
                          f"got {show_value(v)}", operand=0)
    if 0 in steps:
        raise OpError(f"attribute 'steps' must not contain 0, got {show_value(steps)}", operand=0)
    out = []
    for dim, start, end, step in zip(shape, a["starts"], a["ends"], steps):
        start += dim if start < 0 else 0
        end += dim if end < 0 else 0
        if step > 0:
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        else:  # backwards: start in [0, dim-1], end in [-1, dim-1] where -1 is "before 0"
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
        out.append(slice(start, end if end >= 0 else None, step))
    return out


def _slice_len(s: slice) -> int:
    end = -1 if s.stop is None else s.stop
    return max(0, -((s.start - end) // s.step))  # ceil((end - start) / step)


def _slice_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x = ins[0]
    return [tensor(tuple(_slice_len(s) for s in _slices(x.shape, a)), x.elem)]


def _slice_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
               needs: Sequence[bool]) -> list[Value | None]:
    """dY put back in place between zero blocks, one axis at a time; a strided axis adds its
    entries at the positions it picked."""
    tx = g.type_of(xs[0])
    d = dy
    for axis, s in enumerate(_slices(tx.shape, a)):
        shape = g.type_of(d).shape
        if s.step != 1:
            picked = np.arange(tx.shape[axis], dtype=np.int32)[s]
            line = tensor((1,) * axis + (picked.size,) + (1,) * (tx.rank - axis - 1), "i32")
            pos = g.emit("mp.constant", [], {"value": DenseAttr(picked.reshape(line.shape),
                                                                line)}, result=line)
            pos = g.emit("mp.expand", [pos], result=tensor(shape, "i32"))
            full = g.splat(0.0, shape[:axis] + (tx.shape[axis],) + shape[axis + 1:], tx.elem)
            d = g.emit("mp.scatter_elements_add", [full, pos, d], {"axis": axis})
            continue
        parts = []
        for lo, hi in ((0, s.start), (s.stop, tx.shape[axis])):
            if hi > lo:
                parts.append(g.splat(0.0, shape[:axis] + (hi - lo,) + shape[axis + 1:],
                                     tx.elem))
        if parts:
            pieces = [parts[0], d, *parts[1:]] if s.start > 0 else [d, *parts]
            d = g.emit("mp.concat", pieces, {"axis": axis})
    return [d]

_def("slice",
     vjp=_slice_vjp,
     operands=("x",),
     attrs={"starts": AttrSpec("ints", required=True),
            "ends": AttrSpec("ints", required=True), "steps": AttrSpec("ints")},
     infer=_slice_infer,
     reference=lambda xs, a, rt: [xs[0][tuple(_slices(xs[0].shape, a))]],
     flops=_no_flops,
     precisions=_ANY,
     doc="Strided slice, one start/end/step per dimension, clamped as ONNX Slice does.",
     traits=_MOVES)


def _flatten_shape(shape: tuple[int, ...], axis: int) -> tuple[int, int]:
    axis = _axis(axis, len(shape), end_ok=True)
    return _prod(shape[:axis]), _prod(shape[axis:])


_def("flatten",
     vjp=_reshape_vjp,
     operands=("x",),
     attrs={"axis": AttrSpec("int", default=1)},
     infer=lambda ins, a, d: [tensor(_flatten_shape(ins[0].shape, a["axis"]), ins[0].elem)],
     reference=lambda xs, a, rt: [xs[0].reshape(_flatten_shape(xs[0].shape, a["axis"]))],
     flops=_no_flops,
     precisions=_ANY,
     doc="Collapse to 2-D: dims before `axis` and dims from `axis` on (ONNX Flatten).",
     traits=_MOVES)


def _sparse_encode_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x, t = ins[0], _declared("mp.sparse_encode", declared)
    _need_rank(x, 2, 0)
    if t.encoding not in ENCODINGS:
        raise OpError(f"mp.sparse_encode result must carry an encoding "
                      f"({' or '.join(repr(e) for e in ENCODINGS)}), got {t}")
    return [tensor(x.shape, x.elem, t.encoding)]


_def("sparse_encode",
     operands=("w",),
     attrs={},
     infer=_sparse_encode_infer,
     reference=lambda xs, a, rt: [xs[0]],
     flops=_no_flops,
     precisions=_ANY,
     doc="Re-store a 2-D tensor in the sparse encoding of its result type; values unchanged.",
     traits=frozenset({Trait.TYPE_CARRYING, Trait.DATA_MOVEMENT}))


# ---------------------------------------------------------------------------------------------
# Pooling


_POOL_ATTRS = {"kernel": AttrSpec("ints", required=True, length=2, min=1), **_WINDOW_ATTRS}


def _pool_shape(x: TensorType, a: dict) -> tuple[int, ...]:
    _need_rank(x, 4, 0, "NCHW")
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = a["kernel"], a["strides"], a["padding"]
    # A pad at least as wide as the kernel would leave windows that see only padding.
    if max(pt, pb) >= kh or max(pl, pr) >= kw:
        raise OpError(f"attribute 'padding' {list(a['padding'])} must be smaller than the "
                      f"kernel {list(a['kernel'])}", operand=0)
    n, c, h, w = x.shape
    if kh > h + pt + pb or kw > w + pl + pr:
        raise OpError(f"pool kernel {kh}x{kw} is larger than the padded input "
                      f"{h + pt + pb}x{w + pl + pr}", operand=0)
    return n, c, _window_out(h, pt + pb, kh, sh), _window_out(w, pl + pr, kw, sw)


def _pool_infer(allowed: frozenset[str], what: str) -> _ImplInfer:
    def infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
        return [tensor(_pool_shape(ins[0], a), _elem_of(ins, allowed, what))]
    return infer


def _max_pool_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    from mplower.numerics.pool import max_pool2d

    return [max_pool2d(_num(xs[0]), a["kernel"], a["strides"], a["padding"])]


def _avg_pool_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    from mplower.numerics.pool import avg_pool2d

    return [avg_pool2d(_fl(xs[0]), a["kernel"], a["strides"], a["padding"])]


def _pool_flops(ins: Sequence[TensorType], a: dict) -> int:
    kh, kw = a["kernel"]
    return _prod(_pool_shape(ins[0], a)) * kh * kw  # one compare or add per window element


def _pool_vjp(grad_op: str) -> Vjp:
    return lambda g, xs, y, dy, a, needs: [g.emit(grad_op, [dy, xs[0]], {
        "kernel": a["kernel"], "strides": a["strides"], "padding": a["padding"]})]


def _pool_grad_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    dy, x = ins
    elem = _elem_of(ins, _FLOATS, "a float")
    if dy.shape != _pool_shape(x, a):
        raise OpError(f"operand #0 must have the pooled shape of x {_pool_shape(x, a)}, got {dy}",
                      operand=0)
    return [tensor(x.shape, elem)]


def _pool_grad_flops(ins: Sequence[TensorType], a: dict) -> int:
    kh, kw = a["kernel"]
    return ins[0].size * kh * kw  # one multiply-add per window element


def _scatter_windows(values: np.ndarray, x_shape: tuple, a: dict,
                     weights: np.ndarray) -> np.ndarray:
    """Sum `values` (N, C, Ho, Wo) times `weights` (.., Ho, Wo, KH, KW) into the padded input
    positions each window covers, in one fixed order, then strip the padding."""
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = a["kernel"], a["strides"], a["padding"]
    n, c, h, w = x_shape
    out = np.zeros((n, c, h + pt + pb, w + pl + pr), values.dtype)
    ho, wo = values.shape[2:]
    for i in range(kh):
        for j in range(kw):
            out[:, :, i:i + sh * ho:sh, j:j + sw * wo:sw] += values * weights[..., i, j]
    return out[:, :, pt:pt + h, pl:pl + w]


def _max_pool_grad_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    # numerics.windows also holds numba kernels: imported where a gradient needs it, so that
    # loading the dialect (every command does) does not import numba.
    from mplower.numerics.windows import conv_windows, pad_hw

    dy, x = _fl(xs[0]), _fl(xs[1])
    win = conv_windows(pad_hw(x, a["padding"], -np.inf), a["kernel"], a["strides"])
    flat = win.reshape(win.shape[:4] + (-1,))
    first = np.argmax(flat, axis=-1)  # the first maximum of a window takes its gradient
    onehot = np.arange(flat.shape[-1]) == first[..., None]
    return [_scatter_windows(dy, x.shape, a, onehot.reshape(win.shape).astype(dy.dtype))]


def _avg_pool_grad_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    from mplower.numerics.windows import conv_windows, pad_hw

    dy, x = _fl(xs[0]), _fl(xs[1])
    ones = pad_hw(np.ones((1, 1) + x.shape[2:], dy.dtype), a["padding"])
    inside = conv_windows(ones, a["kernel"], a["strides"])
    share = inside / inside.sum(axis=(-2, -1), keepdims=True)  # padding not counted
    return [_scatter_windows(dy, x.shape, a, share)]


_def("max_pool2d_grad",
     operands=("dy", "x"),
     attrs=_POOL_ATTRS,
     infer=_pool_grad_infer,
     reference=_max_pool_grad_reference,
     flops=_pool_grad_flops,
     precisions=_VECTOR,
     doc="The gradient of max_pool2d: each window's dy goes to its first maximum in x.")
_def("avg_pool2d_grad",
     operands=("dy", "x"),
     attrs=_POOL_ATTRS,
     infer=_pool_grad_infer,
     reference=_avg_pool_grad_reference,
     flops=_pool_grad_flops,
     precisions=_VECTOR,
     doc="The gradient of avg_pool2d: each window's dy shared by its non-padding elements "
         "(x gives the shape).")


_def("max_pool2d",
     vjp=_pool_vjp("mp.max_pool2d_grad"),
     operands=("x",),
     attrs=_POOL_ATTRS,
     infer=_pool_infer(_NUMERIC, "a numeric"),
     reference=_max_pool_reference,
     flops=_pool_flops,
     precisions=_VECTOR,
     # Not VALUE_PRESERVING, though it picks operand values: a window of padding alone yields
     # -inf, which f8E4M3FN cannot hold, so its results are rounded.
     doc="2-D max pooling over NCHW windows; padding never wins (ONNX MaxPool).")
_def("avg_pool2d",
     vjp=_pool_vjp("mp.avg_pool2d_grad"),
     operands=("x",),
     attrs=_POOL_ATTRS,
     infer=_pool_infer(_FLOATS, "a float"),
     reference=_avg_pool_reference,
     flops=_pool_flops,
     precisions=_VECTOR,
     doc="2-D average pooling, padding not counted (ONNX AveragePool, count_include_pad=0).")


def _global_pool_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
                     needs: Sequence[bool]) -> list[Value | None]:
    tx = g.type_of(xs[0])
    return [_broadcast_to(g, _times(g, dy, 1 / _prod(tx.shape[2:])), tx.shape)]

def _global_pool_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x = ins[0]
    if x.rank < 3:
        raise OpError(f"operand #0 must have rank >= 3 (N, C, spatial...), got {x}", operand=0)
    return [tensor(x.shape[:2] + (1,) * (x.rank - 2), _elem_of(ins, _FLOATS, "a float"))]


_def("global_avg_pool",
     vjp=_global_pool_vjp,
     operands=("x",),
     attrs={},
     infer=_global_pool_infer,
     reference=lambda xs, a, rt: [_fl(xs[0]).mean(axis=tuple(range(2, xs[0].ndim)), keepdims=True)],
     flops=_per_input_element,
     precisions=_VECTOR,
     doc="Mean over all spatial dimensions, keeping them as 1 (ONNX GlobalAveragePool).")


# ---------------------------------------------------------------------------------------------
# Conversions


def _cast_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    # Rounding keeps zeros zero, so a cast of a sparse-encoded weight keeps its encoding (the
    # plan casts a weight to its compute format after lower-sparse encoded it).
    return [tensor(ins[0].shape, _declared("mp.cast", declared).elem, ins[0].encoding)]


def _round_to_format(x: np.ndarray, elem: str) -> np.ndarray:
    """float32 values rounded to nearest-even in a narrower float format, held in float32.

    The rounding lives in mplower.numerics.rounding (tested bit-exact against ml_dtypes and
    numpy's float16 over every float32 input); the import is local so that ops.py stays
    importable without numba's compile step.
    """
    from mplower.numerics.rounding import round_to

    return round_to(np.ascontiguousarray(x, dtype=np.float32), elem)[0]


def _convert(x: np.ndarray, elem: str, saturate: bool) -> np.ndarray:
    """ONNX Cast semantics for values `x` to element type `elem`, as `value_dtype(elem)`."""
    fmt = FORMATS[elem]
    if elem == "i1":
        return x != 0
    if fmt.is_int:
        # ONNX truncates toward zero and leaves out-of-range values undefined; mplower
        # saturates them and maps NaN to 0 so that the reference is deterministic.
        return _saturate_int(x, elem)
    if elem == "f64":
        return x.astype(np.float64)
    x32 = x.astype(np.float32)
    if elem == "f32":
        return x32
    if saturate and elem.startswith("f8"):
        # ONNX saturate=1: finite values beyond the range go to +-max; E5M2 keeps its infinities.
        clipped = np.clip(x32, fmt.min_value, fmt.max_finite)
        x32 = np.where(np.isinf(x32), x32, clipped) if fmt.has_inf else clipped
    return _round_to_format(x32, elem)


def _saturate_int(x: np.ndarray, elem: str) -> np.ndarray:
    """Values `x` (any numeric dtype) truncated toward zero and clamped to the integer type
    `elem`, NaN as 0, as `value_dtype(elem)`. The bounds of the 64-bit types are not floats
    and not all of them fit one numpy integer dtype, so each source kind is clamped apart."""
    lo, hi = FORMATS[elem].int_range
    dtype = value_dtype(elem)
    if x.dtype.kind == "f":
        x = np.trunc(np.nan_to_num(x.astype(np.float64), nan=0.0, posinf=np.inf, neginf=-np.inf))
        # float(hi) of a 64-bit type rounds up past hi: such values saturate explicitly.
        over = x >= float(hi)
        y = np.clip(np.where(over, 0.0, x), float(lo), float(hi)).astype(dtype)
        y[over] = hi
        return y
    if x.dtype == np.uint64:  # never below any type's lowest value
        return np.minimum(x, np.uint64(hi)).astype(dtype)
    x = x.astype(np.int64, copy=False)
    return np.clip(x, lo, min(hi, (1 << 63) - 1)).astype(dtype)  # ui64's hi is past int64


def _cast_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    return [_convert(xs[0], _declared("mp.cast", rt or ()).elem, a["saturate"])]


def _cast_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
              needs: Sequence[bool]) -> list[Value | None]:
    tx = g.type_of(xs[0])
    if not FORMATS[tx.elem].is_float:
        return [None]
    return [g.emit("mp.cast", [dy], result=g.type_of(dy).with_elem(tx.elem))]

_def("cast",
     vjp=_cast_vjp,
     operands=("x",),
     attrs={"saturate": AttrSpec("bool", default=True)},
     infer=_cast_infer,
     reference=_cast_reference,
     flops=_no_flops,
     precisions=_ANY,
     doc="Convert to the result's element type: round to nearest even, truncate to integers, "
         "saturate fp8 unless saturate = false (ONNX Cast); an encoded operand keeps its "
         "encoding.",
     traits=_CONVERSION,
     encoded_operands=frozenset({0}))

_QUANT_ATTRS = {"scale": AttrSpec("number", required=True),
                "zero_point": AttrSpec("number", default=0),
                "axis": AttrSpec("int", default=1),  # ONNX's default quantization axis
                # > 0: one scale per block of this many elements along axis (ONNX opset 21)
                "block_size": AttrSpec("int", default=0, min=0)}


def _check_quant(x: TensorType, a: dict, qelem: str) -> None:
    scale, zp = a["scale"], a["zero_point"]
    if not np.all(scale > 0):
        raise OpError(f"attribute 'scale' must be positive, got {show_value(scale)}")
    fmt = FORMATS[qelem]
    if fmt.is_float and np.any(zp != 0):
        raise OpError(f"attribute 'zero_point' must be 0 for {qelem} (ONNX), "
                      f"got {show_value(zp)}")
    if np.any(zp != np.round(zp)) or np.any(zp < fmt.min_value) or np.any(zp > fmt.max_finite):
        raise OpError(f"attribute 'zero_point' must hold integers in the range of {qelem} "
                      f"[{int(fmt.min_value)}, {int(fmt.max_finite)}], got {show_value(zp)}")
    if a.get("block_size"):  # the gradient and LSQ ops have no blocks
        from mplower.numerics.quant import blocked_scale_shape

        axis = _axis(a["axis"], x.rank)
        want = blocked_scale_shape(x.shape, axis, a["block_size"])
        for name, v in (("scale", scale), ("zero_point", zp)):
            if v.size > 1 and v.shape != want:
                raise OpError(f"blocked attribute '{name}' (block_size {a['block_size']} on "
                              f"axis {axis} of {x}) must have shape {'x'.join(map(str, want))}"
                              f", got {'x'.join(map(str, v.shape)) or 'a scalar'}", operand=0)
    elif scale.size > 1 or zp.size > 1:
        axis = _axis(a["axis"], x.rank)
        for name, v in (("scale", scale), ("zero_point", zp)):
            if v.size > 1 and v.shape != (x.shape[axis],):
                raise OpError(f"per-axis attribute '{name}' must have {x.shape[axis]} entries "
                              f"(dimension {axis} of {x}), got {v.size}", operand=0)


def _along(v: np.ndarray, shape: tuple[int, ...], a: dict) -> np.ndarray:
    """A per-axis or blocked parameter shaped to broadcast against an operand of `shape`."""
    if v.size == 1:
        return v.reshape(())
    axis = a["axis"] % len(shape)
    if a.get("block_size"):  # one entry per block: repeat it over the block's elements
        v = np.repeat(v, a["block_size"], axis=axis)
        return v[tuple(slice(0, d) for d in shape)]
    bshape = [1] * len(shape)
    bshape[axis] = v.size
    return v.reshape(bshape)


def _quantize_values(x: np.ndarray, a: dict, qelem: str) -> np.ndarray:
    """ONNX QuantizeLinear: saturate(round_half_even(x / scale) + zero_point), as float64;
    to a float format, the f32 quotient rounded to it, saturating."""
    scale = _along(a["scale"], x.shape, a).astype(x.dtype)  # divide in x's precision
    if FORMATS[qelem].is_float:
        return _convert(x / scale, qelem, saturate=True).astype(np.float64)
    zp = _along(a["zero_point"], x.shape, a)
    q = np.rint(x / scale).astype(np.float64) + zp
    q = np.where(np.isnan(q), zp, q)  # NaN has no integer code; it quantizes to zero
    fmt = FORMATS[qelem]
    return np.clip(q, fmt.min_value, fmt.max_finite)


def _dequantize_values(q: np.ndarray, a: dict, dtype: np.dtype) -> np.ndarray:
    """ONNX DequantizeLinear: (q - zero_point) * scale, computed in the result's precision."""
    scale = _along(a["scale"], q.shape, a).astype(dtype)
    zp = _along(a["zero_point"], q.shape, a).astype(dtype)
    return (q.astype(dtype) - zp) * scale


def _quantize_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x = ins[0]
    _elem_of(ins, _FLOATS, "a float")
    qelem = _declared("mp.quantize", declared).elem
    if qelem not in _QUANTIZED:
        raise OpError(f"mp.quantize result element type must be one of "
                      f"{', '.join(_QUANTIZED)}, got {qelem}")
    _check_quant(x, a, qelem)
    return [tensor(x.shape, qelem)]


def _quantize_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    qelem = _declared("mp.quantize", rt or ()).elem
    return [_quantize_values(_fl(xs[0]), a, qelem).astype(value_dtype(qelem))]


def _dequantize_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x = ins[0]
    _elem_of(ins, frozenset(_QUANTIZED), f"a quantized type ({', '.join(_QUANTIZED)})")
    out = _declared("mp.dequantize", declared).elem
    if out not in _FLOATS:
        raise OpError(f"mp.dequantize result element type must be a float type, got {out}")
    _check_quant(x, a, x.elem)
    return [tensor(x.shape, out)]


def _dequantize_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    out = _declared("mp.dequantize", rt or ()).elem
    return [_dequantize_values(xs[0], a, value_dtype(out))]


def _fake_quant_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    elem = _elem_of(ins, _FLOATS, "a float")
    _check_quant(ins[0], a, a["dtype"])
    return [tensor(ins[0].shape, elem)]


def _fake_quant_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x = _fl(xs[0])
    return [_dequantize_values(_quantize_values(x, a, a["dtype"]), a, x.dtype)]


def _fake_quant_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
                    needs: Sequence[bool]) -> list[Value | None]:
    return [g.emit("mp.fake_quant_grad", [dy, xs[0]],
                   {k: a[k] for k in ("scale", "zero_point", "axis", "dtype")})]


def _fake_quant_grad_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    """The straight-through estimator clipped to the quantization range (PyTorch's
    fake_quantize backward): dy where round(x / scale) + zero_point is in range, else 0."""
    dy, x = _fl(xs[0]), _fl(xs[1])
    per_axis = {"axis": a["axis"], "block_size": 0}  # fake_quant has no blocks
    scale = _along(a["scale"], x.shape, per_axis).astype(x.dtype)
    q = np.rint(x / scale).astype(np.float64) + _along(a["zero_point"], x.shape, per_axis)
    fmt = FORMATS[a["dtype"]]
    return [np.where((q >= fmt.min_value) & (q <= fmt.max_finite), dy, dy.dtype.type(0))]


def _fake_quant_grad_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    (out,) = _binary_infer(_FLOATS, "a float")(ins, a, declared)
    if out.shape != ins[1].shape:
        raise OpError(f"operand #0 must have the shape of x, got {ins[0]}", operand=0)
    _check_quant(ins[1], a, a["dtype"])
    return [out]

# Quantize: 2 operations per element (scale, shift; rounding and saturation are the
# conversion); dequantize: 2 (shift, scale); fake_quant: both. Cast is pure conversion: 0,
# its cost is the bytes it moves.
_def("quantize",
     operands=("x",),
     attrs=_QUANT_ATTRS,
     infer=_quantize_infer,
     reference=_quantize_reference,
     flops=_per_element(2),
     precisions=_ANY,
     doc="Float to integer: saturate(round_half_even(x / scale) + zero_point), per tensor, "
         "per `axis`, or per block of `block_size` along `axis` (scale of x's shape with "
         "ceil(D / block_size) on axis); to f8/f4: the quotient rounded, saturating, zero "
         "point 0 (ONNX QuantizeLinear, opset 21+ blocks).",
     traits=_CONVERSION)
_def("dequantize",
     operands=("x",),
     attrs=_QUANT_ATTRS,
     infer=_dequantize_infer,
     reference=_dequantize_reference,
     flops=_per_element(2),
     precisions=_ANY,
     doc="Integer or f8/f4 to float: (x - zero_point) * scale, per tensor, per `axis` or "
         "per block of `block_size` along `axis` (ONNX DequantizeLinear).",
     traits=_CONVERSION)
_def("fake_quant",
     vjp=_fake_quant_vjp,
     operands=("x",),
     attrs={**_QUANT_ATTRS, "dtype": AttrSpec("type", required=True, choices=_QUANT_TYPES)},
     infer=_fake_quant_infer,
     reference=_fake_quant_reference,
     flops=_per_element(4),
     precisions=_VECTOR,
     doc="Quantize to `dtype` and dequantize back, in x's float type (QDQ pair).",
     traits=_CONVERSION)

_def("fake_quant_grad",
     operands=("dy", "x"),
     attrs={**_QUANT_ATTRS, "dtype": AttrSpec("type", required=True, choices=_QUANT_TYPES)},
     infer=_fake_quant_grad_infer,
     reference=_fake_quant_grad_reference,
     flops=_per_element(3),
     precisions=_VECTOR,
     doc="The gradient of fake_quant (straight-through, clipped): dy where x quantizes "
         "inside the range of `dtype`, else 0.",
     traits=_PICKS)


# Learned step size quantization (LSQ, Esser et al., ICLR 2020, arXiv:1902.08153): fake_quant
# whose scale is an operand, so that training learns it with the weights (prepare-qat).


def _lsq_attrs(a: dict, scale: np.ndarray) -> dict:
    """fake_quant's attributes with the scale operand's values (kept positive) as `scale`."""
    return {**a, "scale": np.maximum(np.abs(scale.astype(np.float64)).reshape(-1),
                                     np.finfo(np.float32).tiny)}


def _lsq_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x, scale = ins
    elem = _elem_of(ins, _FLOATS, "a float")
    if scale.rank > 1 or (scale.size > 1 and scale.shape != (x.shape[_axis(a["axis"], x.rank)],)):
        raise OpError(f"the scale must be a scalar or hold one entry per index of axis "
                      f"{a['axis']} of {x}, got {scale}", operand=1)
    _check_quant(x, {**a, "scale": np.ones(1)}, a["dtype"])
    return [tensor(x.shape, elem)]


def _lsq_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x = _fl(xs[0])
    b = _lsq_attrs(a, xs[1])
    return [_dequantize_values(_quantize_values(x, b, a["dtype"]), b, x.dtype)]


def _lsq_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
             needs: Sequence[bool]) -> list[Value | None]:
    attrs = {k: a[k] for k in ("zero_point", "axis", "dtype")}
    return [g.emit("mp.lsq_grad", [dy, *xs], {**attrs, "wrt": wrt}) if need else None
            for wrt, need in zip(("x", "scale"), needs)]


def _lsq_grad_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    dy, x, scale = ins
    _lsq_infer((x, scale), a, ())
    if dy.shape != x.shape:
        raise OpError(f"operand #0 must have the shape of x, got {dy}", operand=0)
    return [tensor((x if a["wrt"] == "x" else scale).shape, _elem_of(ins, _FLOATS, "a float"))]


def _lsq_grad_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    """LSQ's gradients: x's is the clipped straight-through estimator; the scale's is
    dy ((q - z) - x / s) inside the range and dy (q - z) where q saturates, summed over the
    elements that share the scale and multiplied by LSQ's gradient scale 1 / sqrt(N qmax)."""
    dy, x = _fl(xs[0]), _fl(xs[1])
    b = _lsq_attrs(a, xs[2])
    per_axis = {"axis": a["axis"], "block_size": 0}  # LSQ scales are per tensor or per axis
    s = _along(b["scale"], x.shape, per_axis).astype(x.dtype)
    zp = _along(a["zero_point"], x.shape, per_axis)
    v = x / s
    q = np.rint(v).astype(np.float64) + zp
    fmt = FORMATS[a["dtype"]]
    inside = (q >= fmt.min_value) & (q <= fmt.max_finite)
    if a["wrt"] == "x":
        return [np.where(inside, dy, dy.dtype.type(0))]
    step = np.clip(q, fmt.min_value, fmt.max_finite) - zp - np.where(inside, v, 0)
    per = dy.astype(np.float64) * step
    if xs[2].size > 1:
        axis = a["axis"] % x.ndim
        total = per.sum(axis=tuple(i for i in range(x.ndim) if i != axis))
    else:
        total = per.sum().reshape(xs[2].shape)
    shared = x.size // max(xs[2].size, 1)
    return [(total / math.sqrt(shared * fmt.max_finite)).astype(dy.dtype)]


_LSQ_ATTRS = {"zero_point": _QUANT_ATTRS["zero_point"], "axis": _QUANT_ATTRS["axis"],
              "dtype": AttrSpec("type", required=True, choices=_QUANT_TYPES)}

_def("fake_quant_lsq",
     vjp=_lsq_vjp,
     operands=("x", "scale"),
     attrs=_LSQ_ATTRS,
     infer=_lsq_infer,
     reference=_lsq_reference,
     flops=_per_element(4),
     precisions=_VECTOR,
     doc="fake_quant with a learnable scale operand (LSQ): quantize x to `dtype` with "
         "|scale| per tensor or per `axis` and dequantize back.")
_def("lsq_grad",
     operands=("dy", "x", "scale"),
     attrs={**_LSQ_ATTRS, "wrt": AttrSpec("str", required=True, choices=("x", "scale"))},
     infer=_lsq_grad_infer,
     reference=_lsq_grad_reference,
     flops=_per_element(5),
     precisions=_VECTOR,
     doc="The gradient of fake_quant_lsq with respect to x (clipped straight-through) or its "
         "scale (LSQ's, with its 1 / sqrt(N qmax) gradient scale).")


# Scaled narrow floats (issue 14): a recipe chooses the scale at run time or from calibration.
SCALE_RECIPES = ("static", "current", "delayed", "block")
SCALE_FORMATS = ("f32", "e8m0", "nvfp4")
_SCALED_TYPES = ("f8E4M3FN", "f8E5M2", "f6E2M3FN", "f6E3M2FN", "f4E2M1FN")


def _scaled_quant_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x = ins[0]
    _elem_of(ins, _FLOATS, "a float")
    elem = _declared("mp.scaled_quant", declared).elem
    if elem not in _SCALED_TYPES:
        raise OpError(f"mp.scaled_quant result element type must be one of "
                      f"{', '.join(_SCALED_TYPES)}, got {elem}")
    block, recipe, fmt = tuple(a["block"]), a["recipe"], a["scale_format"]
    if (recipe == "block") != bool(block):
        raise OpError("attribute 'block' (one size per axis) goes with recipe = \"block\" and "
                      "only with it")
    if block and len(block) != x.rank:
        raise OpError(f"attribute 'block' = {list(block)} needs one size per axis of {x}",
                      operand=0)
    if fmt != "f32" and recipe != "block":
        raise OpError(f"scale_format = \"{fmt}\" scales blocks: it needs recipe = \"block\"")
    if fmt == "nvfp4" and elem != "f4E2M1FN":
        raise OpError(f"scale_format = \"nvfp4\" quantizes to f4E2M1FN, not {elem}")
    if recipe == "static" and not a["amax"] > 0:
        raise OpError("recipe = \"static\" needs the calibrated 'amax' (> 0); run calibrate")
    return [tensor(x.shape, elem)]


def _scaled_quant_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    """The scaled values q * s of one step (a delayed recipe's first: scale 1, or the one
    from 'amax' when calibrated); mplower.numerics.mx defines the recipes."""
    from mplower.numerics import mx

    elem = _declared("mp.scaled_quant", rt or ()).elem
    x = np.ascontiguousarray(_fl(xs[0]), dtype=np.float32)
    if a["recipe"] == "block":
        return [mx.quantize_blocked(x, elem, tuple(a["block"]), a["scale_format"]).values]
    amax = float(np.max(np.abs(x))) if a["recipe"] == "current" and x.size else a["amax"]
    sf = mx.encode_factor(amax, elem, a["margin"], pow2=a["pow2"])
    return [mx.quantize_per_tensor(x, elem, sf).values]


_def("scaled_quant",
     operands=("x",),
     attrs={"recipe": AttrSpec("str", default="current", choices=SCALE_RECIPES),
            "scale_format": AttrSpec("str", default="f32", choices=SCALE_FORMATS),
            "block": AttrSpec("ints", default=()),
            "amax": AttrSpec("float", default=0.0, min=0.0),
            "margin": AttrSpec("int", default=0),
            "pow2": AttrSpec("bool", default=False),
            "history": AttrSpec("int", default=1024, min=1),
            "amax_compute": AttrSpec("str", default="max", choices=("max", "most_recent"))},
     infer=_scaled_quant_infer,
     reference=_scaled_quant_reference,
     flops=_per_element(4),
     precisions=_ANY,
     doc="A scaled narrow float: x quantized to the result type with a scale and held as the "
         "scaled values q * s. `recipe`: static (scale from the calibrated `amax`), current "
         "(the tensor's amax), delayed (Transformer Engine's amax history of `history` steps, "
         "`amax_compute`, `margin`), block (one scale per `block`, in `scale_format` f32, "
         "e8m0 (MX) or nvfp4); `pow2` rounds a per-tensor scale down to a power of two.",
     traits=_CONVERSION)

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


# ---------------------------------------------------------------------------------------------
# Op categories: every set of ops the lowering, the passes and the backend test for, derived
# from the traits declared above and nowhere else written out.

CONTRACTIONS = ops_with(Trait.CONTRACTION)
CONVERSIONS = ops_with(Trait.CONVERSION)
DATA_MOVEMENT = ops_with(Trait.DATA_MOVEMENT)
ACCUMULATING = ops_with(Trait.ACCUMULATES)  # ops whose precision Decision carries an accumulator
COMPUTE_HEAVY = ops_with(Trait.COMPUTE_HEAVY)  # the first and last stay f32 (keep_first_last)
QUANTIZABLE = ops_with(Trait.QUANTIZABLE)
TYPE_CARRYING = ops_with(Trait.TYPE_CARRYING)
VALUE_PRESERVING = ops_with(Trait.VALUE_PRESERVING)
# The ops with a weight operand, in declaration order (pass options print them).
WEIGHTED: tuple[str, ...] = tuple(n for n, op in OPS.items() if op.weight_operand is not None)
# Their weight operand: one index for all of them (sparsify and lower-sparse index operands with
# it), which this unpacking checks when the dialect is imported.
(WEIGHT_OPERAND,) = {OPS[n].weight_operand for n in WEIGHTED}
