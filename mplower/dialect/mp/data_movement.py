"""Data movement: reshape, transpose, concat, slice, flatten, sparse_encode (any element type, no
arithmetic).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mplower.dialect.mp.common import (
    _ANY,
    _MOVES,
    _axis,
    _declared,
    _def,
    _elem_of,
    _need_rank,
    _no_flops,
    _prod,
)
from mplower.ir.opdef import AttrSpec, GradBuilder, OpError, Trait, Value, show_value
from mplower.ir.types import ENCODINGS, DenseAttr, TensorType, tensor

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
