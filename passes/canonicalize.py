"""`canonicalize`: local simplifications to a fixed point, then dead-code elimination and CSE.

Patterns: fold elementwise ops whose operands are all inline constants (results that are f32,
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
from mplower.ir.opdef import OPS, OpError, attr_ints, check_attrs
from mplower.ir.types import DenseAttr, value_dtype
from mplower.numerics.formats import FORMATS, represents
from mplower.pass_manager import Pass, PassContext, option, register_pass

_FOLDABLE_ELEMS = {"f32", "f64", "i32", "i8", "ui8", "i1"}
_SIMPLIFIED = frozenset({"mp.reshape", "mp.transpose", "mp.cast"})
_ELEMENTWISE = frozenset(name for name, d in OPS.items() if d.elementwise and name != "mp.cast")


def _inline_value(f: Function, value: tuple[int, int]) -> DenseAttr | None:
    d = f.data(value[0])
    if d["op"] == "mp.constant":
        v = d["attrs"].get("value")
        if isinstance(v, DenseAttr):
            return v
    return None


def _fold(f: Function, n: int, max_elements: int) -> bool:
    d = f.data(n)
    opdef = OPS[d["op"]]
    if not opdef.elementwise or d["op"] == "mp.cast" or len(d["types"]) != 1:
        return False
    out = d["types"][0]
    if out.elem not in _FOLDABLE_ELEMS or out.encoding is not None:
        return False
    consts = [_inline_value(f, v) for v in f.operands(n)]
    if not consts or any(c is None for c in consts):
        return False
    splat = all(c.is_splat for c in consts)
    if out.size > max_elements and not splat:
        return False
    try:
        (result,) = opdef.reference([c.array for c in consts], check_attrs(opdef, d["attrs"]))
    except (OpError, FloatingPointError):
        return False
    fmt = FORMATS[out.elem]
    if fmt.is_int and out.elem != "i1" and np.size(result) and (
            np.min(result) < fmt.min_value or np.max(result) > fmt.max_finite):
        return False  # an integer result the type cannot hold: leave it to the op at run time
    array = np.broadcast_to(np.asarray(result), out.shape).astype(value_dtype(out.elem))
    attr = DenseAttr(np.array(array, order="C"), out)  # (ascontiguousarray makes 0-d 1-d)
    new = f.create_op("mp.constant", [], [out], {"value": attr}, before=n, name_hint=d["name"])
    f.replace_all_uses((n, 0), (new, 0))
    f.erase(n)
    return True


def _forward(f: Function, n: int, to: tuple[int, int]) -> None:
    f.replace_all_uses((n, 0), to)
    f.erase(n)


def _simplify(f: Function, n: int, ctx: PassContext) -> bool:
    d = f.data(n)
    op = d["op"]
    if op == "mp.reshape":
        (src,) = f.operands(n)
        if f.type_of(src) == d["types"][0]:
            _forward(f, n, src)
            ctx.stat("noop-removed")
            return True
    elif op == "mp.transpose":
        (src,) = f.operands(n)
        perm = attr_ints(d["attrs"]["perm"])
        if perm == tuple(range(len(perm))):
            _forward(f, n, src)
            ctx.stat("noop-removed")
            return True
        inner = f.data(src[0])
        if inner["op"] == "mp.transpose":
            # out[i] = mid[perm[i]] and mid[j] = x[inner_perm[j]], so out[i] = x[inner_perm[perm[i]]].
            inner_perm = attr_ints(inner["attrs"]["perm"])
            composed = tuple(inner_perm[p] for p in perm)
            (x,) = f.operands(src[0])
            if composed == tuple(range(len(composed))):
                _forward(f, n, x)
            else:
                f.set_operand(n, 0, x)
                f.set_attr(n, "perm", composed)
            ctx.stat("transposes-merged")
            return True
    elif op == "mp.cast":
        (src,) = f.operands(n)
        src_t, out_t = f.type_of(src), d["types"][0]
        if src_t == out_t:
            _forward(f, n, src)
            ctx.stat("casts-removed")
            return True
        inner = f.data(src[0])
        if inner["op"] == "mp.cast":
            (x,) = f.operands(src[0])
            x_t = f.type_of(x)
            if x_t == out_t and represents(src_t.elem, x_t.elem) and src_t.shape == x_t.shape:
                _forward(f, n, x)
                ctx.stat("casts-removed")
                return True
    return False


def canonicalize_function(f: Function, ctx: PassContext, max_elements: int,
                          max_iterations: int) -> None:
    nodes = f.nodes
    for _ in range(max_iterations):
        changed = False
        for n in f.ops():
            d = nodes.get(n)
            if d is None:  # erased earlier in this sweep
                continue
            op = d["op"]
            if op in _SIMPLIFIED and _simplify(f, n, ctx):
                changed = True
            elif (op in _ELEMENTWISE and all(nodes[u]["op"] == "mp.constant"
                                             for _, u, _ in f.operand_edges(n))
                  and _fold(f, n, max_elements)):
                ctx.stat("ops-folded")
                changed = True
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

