"""`insert-casts`: materialize the precision plan as `mp.cast` ops and narrower result types.

Every op annotated with a float `mp.precision` gets its float operands in that format and its
float results in the format it writes (mplower.dialect.plan.result_format: the compute format, or
the accumulator for tf32/fp8 matmuls). Wherever a value crosses into a different format one
`mp.cast` is inserted right after its producer and shared by every consumer that needs that
format (TVM's cast cache), so there is exactly one cast per (value, format). When the module's
policy sheet has a `[scaling]` table, the casts into a GEMM's fp8/fp4 operands then become
scaled quantization (mplower.passes.scale_recipes). Ops without an
annotation keep the operand types they had. With the module's `keep_io_types` (the default;
`mp.keep_io_types = false` comes from a sheet that says otherwise) the function signature is
untouched and returned values are cast back; otherwise arguments used only in one narrower
format and the results take the narrow types. Integer plans (`i8`) are left to `quantize`,
which needs calibrated scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mplower.passes.scale_recipes import apply_scaling

from mplower.dialect.plan import KEEP_IO_TYPES, float_formats, unmaterialized
from mplower.ir.graph import RETURN, Function, Module, Value
from mplower.lowering.policy import module_scaling
from mplower.numerics.formats import FLOATS, FORMATS
from mplower.pass_manager import Pass, PassContext, PassManager, register_pass


class _Casts:
    """The cast cache of one function: (value, element type) -> the value in that type."""

    def __init__(self, f: Function, ctx: PassContext):
        self.f, self.ctx = f, ctx
        self.cache: dict[tuple[Value, str], Value] = {}

    def get(self, value: Value, elem: str) -> Value:
        f = self.f
        t = f.type_of(value)
        if t.elem == elem:
            return value
        key = (value, elem)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        src = f.data(value[0])
        if src["op"] == "mp.cast":  # cast the original, not a cast of it
            (origin,) = f.operands(value[0])
            if f.type_of(origin).elem == elem:
                self.cache[key] = origin
                return origin
        base = src["name"] + (f"_{value[1]}" if len(src["types"]) > 1 else "")
        node = f.create_op("mp.cast", [value], [t.with_elem(elem)], after=value[0],
                           name_hint=f"{base}_{elem}")
        self.ctx.stat("casts-inserted")
        self.cache[key] = (node, 0)
        return (node, 0)


def _wanted(d: dict) -> str | None:
    """The float format an op (its node data) wants its float operands in, or None to keep them."""
    formats = float_formats(d["op"], d["attrs"])
    return None if formats is None else formats[0]


def materialize(module: Module, ctx: PassContext | None = None) -> bool:
    """Run insert-casts through the pass manager when a function's plan is only annotations
    (the first step of `mplower run`, `bench` and `export`); True if it ran."""
    if all(unmaterialized(f) is None for f in module.functions.values()):
        return False
    PassManager([InsertCasts()]).run(module, ctx)
    return True


def insert_casts(f: Function, ctx: PassContext, keep_io_types: bool) -> None:
    casts = _Casts(f, ctx)
    nodes = f.nodes
    # Element type each value had before this pass narrowed it: what unannotated users expect.
    original: dict[Value, str] = {}
    if not keep_io_types:
        _narrow_arguments(f, ctx, original)
    narrowed = 0
    for n in f.ops():
        d = nodes[n]
        op = d["op"]
        if op == RETURN:
            continue
        formats = float_formats(op, d["attrs"])
        want = None if formats is None else formats[0]
        for pos, u, r in f.operand_edges(n):
            elem = nodes[u]["types"][r].elem
            if elem not in FLOATS:
                continue
            target = want if want is not None else original.get((u, r), elem)
            if elem != target:
                f.set_operand(n, pos, casts.get((u, r), target))
        if formats is not None:
            out = formats[1]
            for i, t in enumerate(d["types"]):
                if t.elem in FLOATS and t.elem != out:
                    original[(n, i)] = t.elem
                    f.set_result_type(n, i, t.with_elem(out))
                    narrowed += 1
    ctx.stat("results-narrowed", narrowed)
    ret = f.return_node
    for pos, v in enumerate(f.operands(ret)):
        declared = f.result_types[pos]
        if keep_io_types:
            if f.type_of(v) != declared:
                f.set_operand(ret, pos, casts.get(v, declared.elem))
        else:
            f.result_types[pos] = f.type_of(v)


def _narrow_arguments(f: Function, ctx: PassContext, original: dict[Value, str]) -> None:
    """Without keep_io_types, an argument all of whose users want one narrower format takes it."""
    for a in f.args:
        t = f.type_of((a, 0))
        users = f.uses((a, 0))
        wants = {_wanted(f.data(u)) for u, _ in users}
        # Token ids and other integers are data, not values a float plan narrows.
        if users and len(wants) == 1 and None not in wants and FORMATS[t.elem].is_float:
            (elem,) = wants
            if elem != t.elem and FORMATS[elem].bits < FORMATS[t.elem].bits:
                original[(a, 0)] = t.elem
                f.set_result_type(a, 0, t.with_elem(elem))
                ctx.stat("arguments-narrowed")


@register_pass
@dataclass
class InsertCasts(Pass):
    """Materialize `mp.precision` annotations as `mp.cast` ops and narrower result types.

    One cast per (value, format), placed right after the value's producer and shared by all of
    its consumers. The function signature is kept unless the module says
    `mp.keep_io_types = false`. Run `canonicalize` afterwards to drop exact cast round trips.
    """

    name: ClassVar[str] = "insert-casts"
    statistics: ClassVar[dict[str, str]] = {
        "casts-inserted": "mp.cast ops created",
        "results-narrowed": "op results given a narrower type",
        "arguments-narrowed": "function arguments given a narrower type (keep_io_types off)",
        "casts-scaled": "casts scaled by the policy sheet's [scaling] (see scale-recipes)",
        "casts-kept": "narrow-float casts the sheet's [scaling] left plain",
        "biases-kept-wide": "conv biases the sheet's [scaling] moved into an f32 add",
    }

    def run(self, module: Module, ctx: PassContext) -> None:
        keep = module.attrs.get(KEEP_IO_TYPES, True) is not False
        scaling = module_scaling(module)
        for f in module.functions.values():
            insert_casts(f, ctx, keep)
            if scaling is not None:  # the sheet's [scaling]: scaled GEMM operands
                apply_scaling(f, ctx, scaling)
