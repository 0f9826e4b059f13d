"""`assign-precision`: annotate each op with the compute format, accumulator and reason from a policy.

For every op in program order the policy sheet decides (mplower.lowering.policy.Policy.decide): allow-list
ops are lowered, follow ops are lowered when one of their float inputs already is, deny-list
ops stay f32, overrides and keep-first-last adjust that. The pass records the decision as
`mp.precision`, `mp.accum` (matmul, conv, reductions) and `mp.reason`, and the sheet on the
module (`mp.policy`, for the guardrails of `mplower run`). It changes no type: `insert-casts`
materializes the plan. With `overflow_guard=true` an op whose result or operands
range-analysis flags (overflow or flush to zero in the chosen format) is kept in bf16 where
bf16 holds it, else f32, with the hazard as its reason. A module that the sheet lowers
nowhere (the fp32 sheet) is left untouched, so that pipeline is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import networkx as nx
import numpy as np
from mplower.passes.range_analysis import hazard

from mplower.dialect.mp import ACCUMULATING, COMPUTE_HEAVY, TYPE_CARRYING
from mplower.dialect.plan import KEEP_IO_TYPES, POLICY, SCALING, Plan, result_format
from mplower.io.atomic import module_folder, path_from
from mplower.ir.graph import RETURN, Function, Module
from mplower.ir.opdef import OPS
from mplower.ir.types import DenseAttr, float_fits
from mplower.lowering.policy import (
    Decision,
    Policy,
    load_policy,
)
from mplower.numerics.formats import FLOATS, FORMATS, NARROW_FLOATS
from mplower.pass_manager import Pass, PassContext, option, register_pass


def guarded(f: Function, n: int, decision: Decision) -> Decision:
    """`decision`, or a safe format where range-analysis predicts that the op's result or an
    operand overflows or flushes to zero in it: bf16 where bf16 is safe (it has f32's range),
    else f32; the reason names the hazard."""
    op = f.op(n)
    compute = decision.compute
    if compute in ("f32", "f64"):
        return decision

    def hazards(fmt: str) -> list[str]:
        out_fmt = result_format(op, fmt, "f32" if op in ACCUMULATING else None)
        found = []
        if out_fmt not in ("f32", "f64"):
            found.append(hazard(f, (n, 0), out_fmt))
        for _, u, r in f.operand_edges(n):
            if f.type_of((u, r)).elem in FLOATS:
                found.append(hazard(f, (u, r), fmt))
        return [h for h in found if h is not None]

    found = hazards(compute)
    if not found:
        return decision
    safe = "bf16" if (compute != "bf16" and "bf16" in OPS[op].precisions
                      and not hazards("bf16")) else "f32"
    return Decision(safe, "f32" if op in ACCUMULATING else None, f"overflow-guard: {found[0]}")


def fill_guarded(f: Function, n: int, decision: Decision) -> Decision:
    """`decision`, or a format that holds the op's inline constants: a mask fill of float32's
    lowest value (-3.4e38, what exporters write for torch.finfo(float32).min) would become
    -inf in f16 and bf16. As autocast runs an op with an f32 operand in f32, the op keeps bf16
    where bf16 holds the constant, else f32; the reason names the constant."""
    compute = decision.compute
    if compute not in NARROW_FLOATS:
        return decision
    amax = 0.0
    for _, u, _r in f.operand_edges(n):
        value = f.data(u)["attrs"].get("value") if f.op(u) == "mp.constant" else None
        if isinstance(value, DenseAttr) and FORMATS[value.type.elem].is_float:
            finite = value.array[np.isfinite(value.array)]
            amax = max(amax, float(np.max(np.abs(finite))) if finite.size else 0.0)
    if float_fits(amax, compute):
        return decision
    safe = "bf16" if (compute != "bf16" and "bf16" in OPS[f.op(n)].precisions
                      and float_fits(amax, "bf16")) else "f32"
    return Decision(safe, decision.accum and "f32",
                    f"fill-overflow: constant {amax:.4g} overflows {compute}")


def plan_function(f: Function, policy: Policy,
                  overflow_guard: bool = False) -> dict[int, Decision]:
    """The policy's decision for every op that takes one, in program order; `overflow_guard`
    applies `guarded` (range-analysis's flags) to each."""
    nodes = f.nodes
    order = f.ops()
    # First and last among the ops that reach a result: dead code (which canonicalize will
    # remove) must not decide, or the plan would change once it is gone.
    live = nx.ancestors(f.graph, f.return_node)
    heavy = [n for n in order if nodes[n]["op"] in COMPUTE_HEAVY and n in live]
    first_last = {heavy[0], heavy[-1]} if heavy else set()
    out_format: dict[int, str] = {}  # node -> element type of its float results under the plan
    plan: dict[int, Decision] = {}
    for a in f.args:
        out_format[a] = nodes[a]["types"][0].elem
    for n in order:
        d = nodes[n]
        op = d["op"]
        if op == RETURN:
            continue
        if op in TYPE_CARRYING or op not in OPS or not d["types"] or not any(
                t.elem in FLOATS for t in (*f.operand_types(n), *d["types"])):
            # Conversions carry their type; index computations (token ids, positions, masks
            # as integers or i1) have no float to lower.
            out_format[n] = d["types"][0].elem if d["types"] else "f32"
            continue
        # TVM's FOLLOW rule: lowered when every float input that is not a constant is.
        lowered = None
        for _, u, r in f.operand_edges(n):
            src = nodes[u]
            if src["op"] == "mp.constant" or src["types"][r].elem not in FLOATS:
                continue
            lowered = (lowered is not False) and out_format[u] in NARROW_FLOATS
        decision = policy.decide(op, d["name"], bool(lowered), n in first_last)
        if decision.compute not in OPS[op].precisions:
            decision = Decision("f32", decision.accum and "f32",
                                f"{op} has no {decision.compute} form")
        decision = fill_guarded(f, n, decision)
        if overflow_guard:
            decision = guarded(f, n, decision)
        plan[n] = decision
        out_format[n] = result_format(op, decision.compute, decision.accum)
    return plan


@register_pass
@dataclass
class AssignPrecision(Pass):
    """Assign each op a compute format, accumulator and reason from a precision policy sheet.

    The sheet is a built-in name (`mplower.lowering.policy.builtin_policies()`: fp32, tf32, bf16, fp16,
    fp8, int8, w8a16, ...) or a path to a TOML sheet (docs/policy.md). Annotations:
    `mp.precision`, `mp.accum`, `mp.reason`; the module gets `mp.policy`. Types are not
    changed; run `insert-casts` (after `legalize`) to materialize the plan. With
    `overflow_guard=true` (after `range-analysis`), an op whose result or operands are
    predicted to overflow or flush to zero in its format is kept in bf16 where bf16 holds
    them, else f32, with reason `overflow-guard: <format> overflows (max ... > ...)`.
    """

    name: ClassVar[str] = "assign-precision"
    statistics: ClassVar[dict[str, str]] = {
        "ops-lowered": "ops assigned a format narrower than f32",
        "ops-kept-wide": "ops kept in f32 (deny-list, keep-first-last, not listed, ...)",
        "ops-guarded": "ops moved to bf16 or f32 by overflow_guard (range-analysis's flags)",
    }
    policy: str = option("bf16", "built-in policy sheet name or path to a .toml sheet")
    overflow_guard: bool = option(False, "keep ops that range-analysis flags (overflow or "
                                         "flush to zero in their format) in bf16, else f32")

    def run(self, module: Module, ctx: PassContext) -> None:
        policy = load_policy(self.policy, known_ops=OPS)
        plans = {name: plan_function(f, policy, self.overflow_guard)
                 for name, f in module.functions.items()}
        # An f32 sheet that lowers nothing here leaves the module exactly as it was. A narrow
        # sheet that lowers nothing (keep-first-last on two matmuls) still records its plan,
        # so that quantize quantizes nothing and `run` applies the sheet's guardrails.
        if policy.compute == "f32" and not any(
                d.compute != "f32" or d.reason.startswith("overflow-guard")
                for plan in plans.values() for d in plan.values()):
            return
        for name, f in module.functions.items():
            lowered = 0
            for n, d in plans[name].items():
                Plan.decide_at(f, n, d.compute, d.accum, d.reason)
                lowered += d.compute != "f32"
            ctx.stat("ops-lowered", lowered)
            ctx.stat("ops-kept-wide", len(plans[name]) - lowered)
            if self.overflow_guard:
                ctx.stat("ops-guarded", sum(d.reason.startswith("overflow-guard")
                                            for d in plans[name].values()))
        # A built-in by its name; a sheet by its path from the module's folder (mplower run
        # reads it from there; `opt -o` carries it to the output's folder).
        module.attrs[POLICY] = (
            policy.source.removeprefix("builtin:") if policy.source.startswith("builtin:")
            else path_from(module_folder(module), Path(policy.source)))
        if not policy.keep_io_types:
            module.attrs[KEEP_IO_TYPES] = False
        # insert-casts and legalize read the sheet's [scaling] from here (lowering.scaling).
        if policy.scaling is not None:
            module.attrs[SCALING] = policy.scaling.attr()
        else:
            module.attrs.pop(SCALING, None)

