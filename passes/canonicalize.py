"""`canonicalize`: local simplifications to a fixed point, then dead-code elimination and CSE.

Patterns (mplower.ir.rewrite), each a match and a rewrite: fold elementwise ops whose operands are all inline constants (results that are f32,
f64 or integer and small enough to print inline); drop reshapes and transposes that change
nothing; merge a transpose of a transpose; drop casts to the same type and cast pairs whose
round trip is exact (bf16 -> f32 -> bf16), never a lossy one (f32 -> bf16 -> f32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from mplower.passes.cse import eliminate_common_subexpressions
from mplower.passes.dce import eliminate_dead_ops

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.graph import Function, Module
from mplower.ir.opdef import OPS, OpError, Trait, attr_ints, check_attrs
from mplower.ir.rewrite import Pattern, apply_patterns
from mplower.ir.types import DenseAttr, value_dtype
from mplower.numerics.formats import FORMATS, represents
from mplower.pass_manager import Pass, PassContext, option, register_pass

_FOLDABLE_ELEMS = {"f32", "f64", "i32", "i8", "ui8", "i1"}


def _inline_value(f: Function, value: tuple[int, int]) -> DenseAttr | None:
    d = f.data(value[0])
    if d["op"] == "mp.constant":
        v = d["attrs"].get("value")
        if isinstance(v, DenseAttr):
            return v
    return None


def _forward(f: Function, n: int, to: tuple[int, int]) -> None:
    f.replace_all_uses((n, 0), to)
    f.erase(n)


# ---- folding ----------------------------------------------------------------------------------


def _folder(max_elements: int) -> Pattern:
    """Fold an elementwise op whose operands are all inline constants into one (a result
    the type holds, small enough to print inline unless it is a splat)."""

    def match(f: Function, n: int) -> DenseAttr | None:
        d = f.data(n)
        opdef = OPS[d["op"]]
        if d["op"] == "mp.cast" or len(d["types"]) != 1:
            return None
        out = d["types"][0]
        if out.elem not in _FOLDABLE_ELEMS or out.encoding is not None:
            return None
        consts = [_inline_value(f, v) for v in f.operands(n)]
        if not consts or any(c is None for c in consts):
            return None
        if out.size > max_elements and not all(c.is_splat for c in consts):
            return None
        try:
            (result,) = opdef.reference([c.array for c in consts],
                                        check_attrs(opdef, d["attrs"]))
        except (OpError, FloatingPointError):
            return None
        fmt = FORMATS[out.elem]
        if fmt.is_int and out.elem != "i1" and np.size(result) and (
                np.min(result) < fmt.min_value or np.max(result) > fmt.max_finite):
            return None  # an integer result the type cannot hold: left to the op at run time
        array = np.broadcast_to(np.asarray(result), out.shape).astype(value_dtype(out.elem))
        return DenseAttr(np.array(array, order="C"), out)  # (ascontiguousarray makes 0-d 1-d)

    def rewrite(f: Function, n: int, attr: DenseAttr) -> None:
        d = f.data(n)
        new = f.create_op("mp.constant", [], list(d["types"]), {"value": attr}, before=n,
                          name_hint=d["name"])
        _forward(f, n, (new, 0))

    return Pattern("ops-folded", match, rewrite, trait=Trait.ELEMENTWISE)


# ---- reshapes, transposes and casts ---------------------------------------------------------


def _same_type(f: Function, n: int) -> tuple[int, int] | None:
    """A reshape or cast whose result type is its operand's: that operand."""
    (src,) = f.operands(n)
    return src if f.type_of(src) == f.types(n)[0] else None


def _identity_transpose(f: Function, n: int) -> tuple[int, int] | None:
    perm = attr_ints(f.attrs_of(n)["perm"])
    return f.operands(n)[0] if perm == tuple(range(len(perm))) else None


def _transpose_of_transpose(f: Function, n: int) -> tuple | None:
    src = f.operands(n)[0]
    if f.op(src[0]) != "mp.transpose":
        return None
    # out[i] = mid[perm[i]] and mid[j] = x[inner_perm[j]], so out[i] = x[inner_perm[perm[i]]].
    perm, inner = (attr_ints(f.attrs_of(k)["perm"]) for k in (n, src[0]))
    return f.operands(src[0])[0], tuple(inner[p] for p in perm)


def _merge_transposes(f: Function, n: int, match: tuple) -> None:
    x, composed = match
    if composed == tuple(range(len(composed))):
        _forward(f, n, x)
    else:
        f.set_operand(n, 0, x)
        f.set_attr(n, "perm", composed)


def _exact_round_trip(f: Function, n: int) -> tuple[int, int] | None:
    """A cast back to the type a cast came from, where the middle type holds every value of
    that type (bf16 -> f32 -> bf16, never f32 -> bf16 -> f32): the first cast's operand."""
    src = f.operands(n)[0]
    if f.op(src[0]) != "mp.cast":
        return None
    x = f.operands(src[0])[0]
    src_t, x_t = f.type_of(src), f.type_of(x)
    return x if x_t == f.types(n)[0] and represents(src_t.elem, x_t.elem) \
        and src_t.shape == x_t.shape else None


SIMPLIFICATIONS = (
    Pattern("noop-removed", _same_type, _forward, ops=frozenset({"mp.reshape"})),
    Pattern("noop-removed", _identity_transpose, _forward, ops=frozenset({"mp.transpose"})),
    Pattern("transposes-merged", _transpose_of_transpose, _merge_transposes,
            ops=frozenset({"mp.transpose"})),
    Pattern("casts-removed", _same_type, _forward, ops=frozenset({"mp.cast"})),
    Pattern("casts-removed", _exact_round_trip, _forward, ops=frozenset({"mp.cast"})),
)


def canonicalize_function(f: Function, ctx: PassContext, max_elements: int,
                          max_iterations: int) -> None:
    patterns = (*SIMPLIFICATIONS, _folder(max_elements))
    for _ in range(max_iterations):
        changed = apply_patterns(f, patterns, ctx.stat, max_sweeps=1)
        dead = eliminate_dead_ops(f)
        merged = eliminate_common_subexpressions(f)
        ctx.stat("ops-erased", dead)
        ctx.stat("cse-eliminated", merged)
        if not (changed or dead or merged):
            return


@register_pass
@dataclass
class Canonicalize(Pass):
    """Local simplifications to a fixed point, then dead-code elimination and CSE.

    Patterns: fold elementwise ops whose operands are all inline `dense` constants into a
    constant (results that are f32, f64 or integer; non-splat results up to
    `max_fold_elements`); drop reshapes and transposes that change nothing; merge a transpose
    of a transpose; drop casts to the same type and cast pairs whose round trip is exact
    (bf16 -> f32 -> bf16), never a lossy one (f32 -> bf16 -> f32). Then erase unused pure ops
    and merge duplicates (the `dce` and `cse` passes).
    """

    name: ClassVar[str] = "canonicalize"
    statistics: ClassVar[dict[str, str]] = {
        "ops-folded": "elementwise ops folded into constants",
        "noop-removed": "reshapes and transposes that changed nothing",
        "transposes-merged": "transpose pairs merged",
        "casts-removed": "casts to the same type and exact cast round trips removed",
        "ops-erased": "dead operations erased",
        "cse-eliminated": "duplicate operations merged",
    }
    max_fold_elements: int = option(1024, "largest non-splat result folded into an inline constant")
    max_iterations: int = option(10, "rounds of pattern application before giving up")

    def run(self, module: Module, ctx: PassContext) -> None:
        for f in module.functions.values():
            canonicalize_function(f, ctx, self.max_fold_elements, self.max_iterations)

