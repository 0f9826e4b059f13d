"""`fuse`: chains of ops that one kernel runs in one pass over memory become one fused op.

Patterns (mplower.ir.rewrite), each applied only where the fused kernel gives the separate
ops' bits: a residual add and its relu (`mp.add_relu`), an 8-bit integer matmul with the
dequantize of its exact sums and the adds of vectors along its columns, and a float matmul
with the bias adds that follow it in its own format (`mp.fused_matmul`). The fused ops are
declared in mplower.dialect.fused; what the pass printed is what `run` and `bench` execute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.dialect.fused import (
    F32_EXACT,
    PLAIN_FLOATS,
    RELU_BEFORE_ROUNDING,
    along_last_axis,
)
from mplower.dialect.plan import ACCUM, ACCUM_BITS, PRECISION, Plan, unmaterialized
from mplower.ir.graph import Function, Module
from mplower.ir.opdef import OPS, attr_array, check_attrs
from mplower.ir.rewrite import Pattern, apply_patterns, only_user, replace_op
from mplower.numerics.formats import FORMATS, f16_accum_emulated
from mplower.pass_manager import Pass, PassContext, register_pass


def _annotations(f: Function, node: int) -> dict[str, Any]:
    """The plan annotations (`mp.*`) of the op a fused op starts with: the report shows what
    was requested and executed for the fused op as for that one."""
    return {k: v for k, v in f.attrs_of(node).items() if "." in k}


# ---- add + relu -------------------------------------------------------------------------------


def _match_add_relu(f: Function, add: int) -> int | None:
    out = f.types(add)[0]
    relu = only_user(f, (add, 0), "mp.relu")
    if relu is None or f.types(relu)[0].elem != out.elem \
            or (out.elem != "f32" and out.elem not in RELU_BEFORE_ROUNDING):
        return None
    # The kernel reads two operands of the result's shape, each f32 or in the result's format.
    if any(t != out.with_elem(t.elem) or t.elem not in ("f32", out.elem)
           for t in f.operand_types(add)):
        return None
    return relu


def _rewrite_add_relu(f: Function, add: int, relu: int) -> None:
    replace_op(f, [add, relu], "mp.add_relu", f.operands(add), _annotations(f, add))


ADD_RELU = Pattern("add-relu", _match_add_relu, _rewrite_add_relu, ops=frozenset({"mp.add"}))


# ---- matmul + dequantize + column adds ------------------------------------------------------


def _magnitude(elem: str) -> float:
    f = FORMATS[elem]
    return max(abs(f.min_value), f.max_finite)


def _column_adds(f: Function, first: int, fits: Any) -> tuple[list[int], list[tuple]]:
    """The adds after `first` of a vector along the last axis (the other operand, for which
    `fits(add, its type)` holds), each the only reader of the op before: (their nodes, the
    vectors' values)."""
    chain, vectors, last = [], [], first
    shape = f.types(first)[0].shape
    while (add := only_user(f, (last, 0), "mp.add")) is not None:
        operands = f.operands(add)
        other = operands[1] if operands[0] == (last, 0) else operands[0]
        t = f.type_of(other)
        if not along_last_axis(t, shape) or not fits(add, t):
            break
        chain.append(add)
        vectors.append(other)
        last = add
    return chain, vectors


def _dequantize_scale(f: Function, dq: int, columns: int) -> Any:
    """The scale of an f32 dequantize of a matmul's i32 sums, if it is one value or one per
    column, with zero point 0 and no blocks; else None."""
    a = check_attrs(OPS["mp.dequantize"], f.attrs_of(dq))
    scale, zp = attr_array(a["scale"]), attr_array(a["zero_point"])
    rank = f.types(dq)[0].rank
    if f.types(dq)[0].elem != "f32" or np.any(zp != 0) or a["block_size"]:
        return None
    if scale.size == 1:
        return f.attrs_of(dq)["scale"]
    return f.attrs_of(dq)["scale"] if a["axis"] % rank == rank - 1 and scale.size == columns \
        else None


def _match_integer_matmul(f: Function, mm: int) -> tuple | None:
    x_t, w_t = f.operand_types(mm)
    out = f.types(mm)[0]
    if out.elem != "i32" or out.rank == 0 or ACCUM_BITS in f.attrs_of(mm) \
            or any(t.elem not in ("i8", "ui8") for t in (x_t, w_t)) \
            or _magnitude(x_t.elem) * _magnitude(w_t.elem) * x_t.shape[-1] > F32_EXACT:
        return None
    dq = only_user(f, (mm, 0), "mp.dequantize")
    scale = None if dq is None else _dequantize_scale(f, dq, out.shape[-1])
    if scale is None:
        return None
    chain, vectors = _column_adds(f, dq, lambda add, t: t.elem == "f32" and all(
        u.elem == "f32" for u in (*f.operand_types(add), *f.types(add))))
    return [dq, *chain], vectors, {"scale": scale}


def _match_float_matmul(f: Function, mm: int) -> tuple | None:
    ins, out = f.operand_types(mm), f.types(mm)[0]
    attrs = f.attrs_of(mm)
    if out.rank == 0 or ACCUM_BITS in attrs or ins[1].encoding is not None \
            or not all(t.elem in PLAIN_FLOATS for t in (*ins, out)):
        return None
    f16 = Plan.of(attrs).accum == "f16"
    if f16 and f16_accum_emulated(ins[0].elem):
        return None  # the fp16 accumulator's kernel
    chain, vectors = _column_adds(f, mm, lambda add, t: all(
        u.elem in PLAIN_FLOATS for u in (*f.operand_types(add), *f.types(add))))
    if not chain:
        return None
    # What the product and each add but the last round to, unless all are the result's.
    formats = [out.elem, *(f.types(add)[0].elem for add in chain[:-1])]
    last = f.types(chain[-1])[0].elem
    return chain, vectors, {} if set(formats) == {last} else {"formats": formats}


def _rewrite_matmul(f: Function, mm: int, match: tuple) -> None:
    chain, vectors, attrs = match
    replace_op(f, [mm, *chain], "mp.fused_matmul", [*f.operands(mm), *vectors],
               {**attrs, **_annotations(f, mm)})


FUSED = frozenset({"mp.add_relu", "mp.fused_matmul"})
MATMULS = (
    Pattern("matmul-dequantize", _match_integer_matmul, _rewrite_matmul,
            ops=frozenset({"mp.matmul"})),
    Pattern("matmul-bias", _match_float_matmul, _rewrite_matmul, ops=frozenset({"mp.matmul"})),
)


def fuse_function(f: Function, ctx: PassContext) -> None:
    # Residual adds first: an add that could close either chain is a residual's.
    for patterns in ((ADD_RELU,), MATMULS):
        apply_patterns(f, patterns, ctx.stat)
    # A fused op keeps the plan of the op its chain starts with, unless its other operands or
    # its result are in formats that plan does not describe (an fp8 matmul's f32 bias add):
    # then its compute format and accumulator are its operands' (what the report shows), so
    # the backend does not take the plan for one insert-casts has yet to materialize.
    while (n := unmaterialized(f)) is not None and f.op(n) in FUSED:
        f.del_attr(n, PRECISION)
        f.del_attr(n, ACCUM)


@register_pass
@dataclass
class Fuse(Pass):
    """Fuse chains of ops that one kernel runs in one pass over memory into fused ops, where
    the fused kernel gives the separate ops' bits.

    A residual add and its relu become `mp.add_relu`; an 8-bit integer matmul, the dequantize
    of its sums and the adds of vectors along its columns, or a float matmul and the bias
    adds in its format that follow it, become `mp.fused_matmul`. Run it last: the result
    prints, parses and runs (`mplower run`, `mplower bench`) like any other module, and the
    unfused module gives the same bits, more slowly.
    """

    name: ClassVar[str] = "fuse"
    statistics: ClassVar[dict[str, str]] = {
        "add-relu": "adds and their relu fused (mp.add_relu)",
        "matmul-dequantize": "integer matmuls fused with their dequantize and column adds",
        "matmul-bias": "float matmuls fused with their bias adds",
    }

    def run(self, module: Module, ctx: PassContext) -> None:
        for f in module.functions.values():
            fuse_function(f, ctx)
