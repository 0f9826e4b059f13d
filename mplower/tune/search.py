"""The search: the plan with the best modeled objective that meets every guardrail.

1. Units: the fused kernels of the fp32 plan (mplower.lowering.cost.fused_groups), a matmul
   with its epilogue, an elementwise chain, a normalization. Lowering a unit together is what
   buys time on a target that fuses (a bf16 matmul whose epilogue stays f32 still writes f32);
   each unit and format is one item: its ops that may take the format (the op's precisions,
   the target's kernels; i8 for quantizable ops only, the rest of the unit stays f32).
2. Gain and sensitivity, once per item: its gain is the modeled time (or energy) it saves
   against fp32 lowered alone (priced, not run); its sensitivity is what its ops lose
   themselves (mplower.report.quant's local SQNR, as a relative error) in one traced run of the
   plan that lowers every item of its format: one run per format, not one per op. An item
   that saves nothing is rejected.
3. Order by gain per unit of sensitivity (ties: a permutation drawn from the seed).
4. Greedy growth with bisection on failure: add the next `step` items at once (at first all
   of them, one per unit); if the grown plan passes, keep it and double `step`; if it fails,
   halve `step` and retry the first half; a single item that fails is rejected with the
   guardrails it broke. An item for a unit already in the plan replaces its format only when
   it saves more alone.
5. The built-in uniform sheets are evaluated as comparators; when one passes with a better
   objective than the grown plan and uses only the formats asked for, growth runs again from
   that sheet's plan.
6. With `sparse`, the best plan is tried with 2:4-pruned weights as well.
The chosen plan is the best passing per-op plan of all those evaluated (ties: the smaller
output rel-L2), unless a more accurate passing plan (the best passing uniform sheet's own
per-op plan among them) comes within `min_gain` of it: a gain that small is not worth the
extra error, and the more accurate plan is released, saying so (`Outcome.note`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mplower.dialect.mp import QUANTIZABLE, TYPE_CARRYING
from mplower.dialect.plan import Plan
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import RETURN, Function
from mplower.ir.opdef import OPS
from mplower.ir.types import DenseAttr
from mplower.lowering.cost import fused_groups
from mplower.lowering.target import Target
from mplower.numerics.formats import FORMATS
from mplower.pass_manager import PassContext, PassManager, parse_pipeline
from mplower.tune.distributed import Evaluator
from mplower.tune.evaluation import F32, Candidate, Workspace

# The built-in sheets a tuned plan is compared against (fp32 is the baseline).
UNIFORM = ("tf32", "bf16", "fp16", "fp8", "int8", "w8a16", "bf16-fp8", "bf16-int8")
OBJECTIVES = {"throughput": "inferences_per_s", "energy": "inferences_per_joule"}


@dataclass(frozen=True)
class Unit:
    """One fused kernel of the fp32 plan: its anchor op and member ops (result names)."""

    anchor: str
    ops: tuple[str, ...]


@dataclass
class Item:
    unit: Unit
    format: str
    formats: dict[str, str]  # op -> format: the unit's ops that take it
    gain: float = 0.0
    sensitivity: float = 0.0
    rank: int | None = None  # position in the order of gain per sensitivity (viable items)
    outcome: str = "pending"

    def to_json(self) -> dict[str, Any]:
        return {"unit": self.unit.anchor, "ops": list(self.formats), "format": self.format,
                "modeled_gain": self.gain if np.isfinite(self.gain) else None,
                "sensitivity_rel_l2": self.sensitivity, "rank": self.rank,
                "outcome": self.outcome}


@dataclass
class Outcome:
    chosen: dict[str, Any] | None
    best_rejected: dict[str, Any] | None  # the rejected plan closest to the guardrails
    baseline: dict[str, Any]
    uniform: list[dict[str, Any]]
    items: list[Item] = field(default_factory=list)
    fastest_rejected: dict[str, Any] | None = None
    # Why a faster plan than the chosen one was not released (`min_gain`), in words.
    note: str | None = None
    # The best passing uniform sheet's plan as per-op formats, where it was evaluated.
    uniform_plan_key: str | None = None


def names_in_order(f: Function) -> dict[str, int]:
    """Result name (without `%`) -> position in program order, for ops with results."""
    return {f.data(n)["name"]: i for i, n in enumerate(f.ops())
            if f.op(n) != RETURN and f.types(n)}


def can_take(f: Function, n: int, fmt: str, target: Target) -> bool:
    """Whether op `n` may compute in `fmt` on `target` without a fallback."""
    op = f.op(n)
    if op not in OPS or op in TYPE_CARRYING or not f.types(n):
        return False
    if not FORMATS[f.types(n)[0].elem].is_float or fmt not in OPS[op].precisions:
        return False
    # 8-bit formats are for the GEMMs (as the fp8 and int8 sheets have them): an fp8 GEMM
    # writes its f32 accumulator, so an 8-bit op after it would only add a conversion.
    if FORMATS[fmt].bits <= 8 and op not in QUANTIZABLE:
        return False
    return target.has_kernel(op, fmt)


def units(f: Function, target: Target) -> list[Unit]:
    return [Unit(g.anchor.removeprefix("%"), tuple(m.removeprefix("%") for m in g.members))
            for g in fused_groups(f, target, fp32=True)]


def items_for(f: Function, target: Target, formats: Sequence[str]) -> list[Item]:
    """Every (unit, format) that lowers at least one op. An 8-bit format is also tried with
    the first 16-bit format of `formats` on the unit's other ops (an fp8 or int8 GEMM with a
    bf16 epilogue, as the bf16-fp8 and bf16-int8 sheets have it), named `f8E4M3FN+bf16`."""
    node = {f.data(n)["name"]: n for n in f.ops() if f.op(n) != RETURN and f.types(n)}
    wide = next((fmt for fmt in formats if FORMATS[fmt].bits == 16), None)
    out = []
    for unit in units(f, target):
        for fmt in formats:
            taken = {m: fmt for m in unit.ops if m in node and can_take(f, node[m], fmt, target)}
            if not taken:
                continue
            out.append(Item(unit, fmt, taken))
            if FORMATS[fmt].bits == 8 and wide is not None:
                rest = {m: wide for m in unit.ops if m in node and m not in taken
                        and can_take(f, node[m], wide, target)}
                if rest:
                    out.append(Item(unit, f"{fmt}+{wide}", {**taken, **rest}))
    return out


class GainKeys:
    """What an item's modeled gain depends on, without names: the format each op of its unit
    takes, and the ops of its unit and of every unit that shares a value with it (the kernels
    whose reads and writes its conversions change), as op, attributes, operand sources, types
    and outside uses. Two items with one key have the same gain, up to the rounding of the
    whole-model sums and effects beyond the adjacent kernels (the gain only orders items):
    the time steps of an unrolled recurrence or a stack of identical layers are priced once.
    A slice's bounds and the order of a concat's operands do not change what they move, so
    they are not in the key."""

    def __init__(self, f: Function, units: Sequence[Unit]):
        self.f = f
        self.node = {f.data(n)["name"]: n for n in f.ops() if f.op(n) != RETURN and f.types(n)}
        self.unit_of = {m: u for u in units for m in u.ops}

    def _adjacent(self, unit: Unit) -> list[str]:
        f, ops = self.f, list(unit.ops)
        seen = {unit}
        for m in unit.ops:
            n = self.node.get(m)
            if n is None:
                continue
            near = [p for p, _ in f.operands(n)]
            near += [u for r in range(len(f.types(n))) for u, _ in f.uses((n, r))]
            for k in near:
                other = self.unit_of.get(f.data(k).get("name", ""))
                if other is not None and other not in seen:
                    seen.add(other)
                    ops += other.ops
        return ops

    def key(self, item: Item) -> tuple:
        f = self.f
        ops = self._adjacent(item.unit)
        local = {self.node[m]: i for i, m in enumerate(ops) if m in self.node}
        out = []
        for m in ops:
            n = self.node.get(m)
            if n is None:
                out.append(("?", m))
                continue
            op = f.op(n)
            attrs = () if op == "mp.slice" else tuple(sorted(
                (k, _attr_key(v)) for k, v in f.attrs_of(n).items() if k != "name"))
            srcs = [("in", local[p], r) if p in local else
                    ("out", f.op(p), f.type_of((p, r))) for p, r in f.operands(n)]
            if op == "mp.concat":
                srcs.sort(key=repr)
            outside = tuple(sum(1 for u, _ in f.uses((n, r)) if u not in local)
                            for r in range(len(f.types(n))))
            out.append((op, attrs, tuple(srcs), tuple(f.types(n)), outside,
                        item.formats.get(m)))
        return (item.format, tuple(out))


def _attr_key(v: Any) -> Any:
    """An attribute value as a key: a dense constant by its type (its values cost nothing)."""
    if isinstance(v, DenseAttr):
        return ("dense", v.type)
    if isinstance(v, list):
        return tuple(_attr_key(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _attr_key(x)) for k, x in v.items()))
    return v


def objective_value(result: dict[str, Any] | None, objective: str) -> float:
    if result is None or "modeled" not in result:
        return -np.inf
    v = result["modeled"][OBJECTIVES[objective]]
    return -np.inf if v is None else v


def failure(result: dict[str, Any]) -> str:
    """Which guardrails a result broke, with value and limit, overall or on the worst slice
    (`max_rel_l2 0.031 vs limit 0.02; min_top1_agreement 0.983 on slice 4 vs limit 0.99`)."""
    if result["verdict"] == "error":
        return f"error: {result['error']}"
    parts = []
    for key in result["failed"]:
        g = result["guardrails"].get(key)
        if g is not None and not g["ok"]:
            parts.append(f"{key} {_num(g['value'])} vs limit {_num(g['limit'])}")
            continue
        bad = {s: gs[key] for s, gs in result.get("slices", {}).items()
               if key in gs and not gs[key]["ok"]}
        if not bad:
            parts.append(key)
            continue
        s, worst = max(bad.items(), key=lambda kv: _excess(key, kv[1]))
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        parts.append(f"{key} {_num(worst['value'])} on slice {s}{more} vs limit "
                     f"{_num(worst['limit'])}")
    return "; ".join(parts)


def _excess(key: str, g: dict[str, Any]) -> float:
    """How far one guardrail's value lies beyond its limit, relative to the limit (0 when met;
    inf when there is no value)."""
    value, limit = g.get("value"), g["limit"]
    if g.get("ok", False):
        return 0.0
    if value is None or not np.isfinite(value):
        return np.inf
    over = value - limit if key.startswith("max_") else limit - value
    return max(over, 0.0) / abs(limit) if limit else over


def distance(result: dict[str, Any]) -> float:
    """How far a result is from passing: the largest relative excess over its guardrails, on
    all samples or on any slice (0 for a passing plan, inf for one that failed to run)."""
    if result["verdict"] == "error":
        return np.inf
    cells = [(k, g) for k, g in result["guardrails"].items()]
    cells += [(k, g) for gs in result.get("slices", {}).values() for k, g in gs.items()]
    return max((_excess(k, g) for k, g in cells), default=0.0)


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def uniform_plan(ws: Workspace, sheet: str, order: dict[str, int]) -> Candidate | None:
    """The per-op plan a built-in sheet assigns after legalize, as a candidate; None for a
    weight-only sheet, whose plan is not per-op formats."""
    from mplower.lowering.policy import load_policy

    if load_policy(sheet).weights is not None:
        return None
    module = copy.deepcopy(ws.module)
    PassManager(parse_pipeline(f"assign-precision{{policy={sheet}}},"
                               f"legalize{{target={ws.target_spec}}}")).run(module, PassContext())
    f = module.function(ws.problem.func)
    formats = {f.data(n)["name"]: p for n in f.ops() if f.op(n) != RETURN and f.types(n)
               and (p := Plan.at(f, n).precision) not in (None, F32)}
    return Candidate().with_formats(formats, order)


def search(ws: Workspace, evaluator: Evaluator, *, formats: Sequence[str], sparse: bool,
           seed: int, objective: str, min_gain: float = 0.0) -> Outcome:
    f = ws.module.function(ws.problem.func)
    order = names_in_order(f)

    def value(r: dict[str, Any] | None) -> float:
        return objective_value(r, objective)

    def cost(m: dict[str, Any]) -> float:  # what the objective minimizes per inference
        return m["joules_per_inference"] if objective == "energy" else m["time_s"]

    baseline = evaluator.evaluate([Candidate()])[0]
    uniform = [r for r in evaluator.evaluate([Candidate(sheet=s)
                                              for s in uniform_sheets(formats)])
               if r is not None]
    items = items_for(f, ws.target, formats)
    # Gain: each item lowered alone and priced, without a run; once per neighbourhood.
    keys = GainKeys(f, [it.unit for it in items])
    priced: dict[tuple, tuple[float, str | None]] = {}
    for it in items:
        key = keys.key(it)
        if key not in priced:
            try:
                priced[key] = (cost(baseline["modeled"]) - cost(ws.price(
                    Candidate().with_formats(it.formats, order))), None)
            except DiagnosticError as e:
                priced[key] = (-np.inf,
                               f"rejected: cannot be lowered: {e.diagnostics[0].message}")
        it.gain, why = priced[key]
        if why is not None:
            it.outcome = why
    # Sensitivity: one traced run per format, every item of that format lowered together.
    by_format: dict[str, dict[str, str]] = {}
    for it in items:
        by_format.setdefault(it.format, {}).update(it.formats)
    kinds = list(by_format)
    traced = evaluator.evaluate([Candidate().with_formats(by_format[k], order, trace=True)
                                 for k in kinds])
    viable = []
    for it in items:
        r = traced[kinds.index(it.format)]
        if r is None:
            it.outcome = "not evaluated: budget exhausted"
            continue
        local = r.get("local_error")
        if local is None:  # the whole format failed to lower or run: its message says why
            it.outcome = f"rejected: the {it.format} plan {failure(r)}"
            continue
        known = [local[op] for op in it.formats if op in local]
        worst_run = r["summary"]["output_rel_l2"]
        it.sensitivity = max(known) if known else (worst_run if worst_run is not None else 1.0)
        if it.outcome != "pending":
            continue
        if it.gain <= 0:
            it.outcome = "rejected: no modeled gain alone"
        else:
            viable.append(it)
    tie = np.random.default_rng(seed).permutation(len(viable))
    ranked = [viable[i] for i in sorted(
        range(len(viable)),
        key=lambda i: (-viable[i].gain / max(viable[i].sensitivity, 1e-12), tie[i]))]
    for i, it in enumerate(ranked):
        it.rank = i

    grown = _grow({}, ranked, evaluator, order)
    best_uniform = max((r for r in uniform if r["verdict"] == "pass"), key=value, default=None)
    if best_uniform is not None and value(best_uniform) > value(grown):
        seed_plan = uniform_plan(ws, best_uniform["plan"]["sheet"], order)
        # Only a plan in the formats asked for: `--formats i8` never releases a bf16 op.
        if seed_plan is not None and {fmt for _, fmt in seed_plan.formats} <= set(formats):
            _grow(dict(seed_plan.formats), ranked, evaluator, order)
    # The best passing uniform sheet as a per-op plan: the simple alternative a small gain
    # is weighed against (the same formats, released as a tuned sheet).
    uniform_key = None
    if best_uniform is not None and min_gain > 0:
        plan = uniform_plan(ws, best_uniform["plan"]["sheet"], order)
        if plan is not None and plan.formats and {fmt for _, fmt in plan.formats} <= set(formats):
            r = evaluator.evaluate([plan])[0]
            uniform_key = r["key"] if r is not None else None
    per_op = [r for r in evaluator.cache.results.values()
              if "formats" in r["plan"] and r["plan"]["formats"]]
    passing = [r for r in per_op if r["verdict"] == "pass"]

    def rel(r: dict[str, Any]) -> float:
        return r["summary"]["output_rel_l2"] or 0.0

    # Ties in the objective (ops whose lowering the model does not price: a transpose on a
    # launch-bound kernel) go to the smaller output error, then to the first evaluated.
    chosen = max(passing, key=lambda r: (value(r), -rel(r)), default=None)
    if sparse and chosen is not None:
        trial = Candidate(tuple(chosen["plan"]["formats"].items()), sparse=True)
        r = evaluator.evaluate([trial])[0]
        if r is not None and r["verdict"] == "pass" and value(r) > value(chosen):
            chosen = r
    note = None
    if chosen is not None and min_gain > 0:
        # A plan whose gain over a more accurate passing one is below min_gain is not worth
        # its extra error: release the most accurate plan within min_gain of the fastest
        # (ties: the uniform sheet's plan, the simpler one).
        near = [r for r in passing if value(chosen) <= value(r) * (1 + min_gain)]
        safest = min(near, key=lambda r: (rel(r), r["key"] != uniform_key, -value(r)))
        if safest["key"] != chosen["key"]:
            what = (f"the {best_uniform['plan']['sheet']} sheet's plan"
                    if safest["key"] == uniform_key else safest["label"])
            note = (f"released {what} (rel-L2 {_num(rel(safest))}): the faster "
                    f"{chosen['label']} gains only {(value(chosen) / value(safest) - 1) * 100:.2g}% "
                    f"modeled {objective} over it, below --min-gain {min_gain * 100:g}%, at rel-L2 "
                    f"{_num(rel(chosen))}")
            chosen = safest
    best_rejected = fastest_rejected = None
    if chosen is None:
        failed = [r for r in per_op if r["verdict"] != "pass"]
        # The rejected plan closest to passing (the smallest relative excess over its
        # guardrails, then the fewest broken, then the fastest), and the fastest rejected.
        best_rejected = min(failed, key=lambda r: (distance(r), len(r["failed"]), -value(r)),
                            default=None)
        fastest_rejected = max((r for r in failed if r["verdict"] != "error"), key=value,
                               default=None)
    return Outcome(chosen, best_rejected, baseline, uniform, items, fastest_rejected, note,
                   uniform_key)


def uniform_sheets(formats: Sequence[str]) -> list[str]:
    """The built-in sheets (UNIFORM) that use only `formats` (and f32): the plans a user with
    the same formats could have picked without a search."""
    from mplower.lowering.policy import load_policy

    out = []
    for name in UNIFORM:
        p = load_policy(name)
        used = {p.compute, *(o.compute for o in p.overrides if o.compute), *(
            [p.weights] if p.weights else [])} - {F32}
        if used <= set(formats):
            out.append(name)
    return out


def _grow(start: dict[str, str], ranked: list[Item], evaluator: Evaluator,
          order: dict[str, int]) -> dict[str, Any] | None:
    """Greedy growth with bisection on failure (module docstring, step 4), starting with every
    item at once; the last passing plan's result."""
    plan = dict(start)
    in_plan: dict[Unit, Item] = {}
    last = None
    if plan:
        last = evaluator.evaluate([Candidate().with_formats(plan, order)])[0]
        if last is None or last["verdict"] != "pass":
            return None
    pending = list(ranked)
    step = len(pending)
    while pending and evaluator.remaining > 0:
        batch: list[Item] = []
        for it in list(pending):
            held = in_plan.get(it.unit)
            if held is not None and held.gain >= it.gain:
                it.outcome = f"superseded: unit already {held.format}"
                pending.remove(it)
            elif all(plan.get(op) == fmt for op, fmt in it.formats.items()):
                it.outcome = "in the seed plan already"
                pending.remove(it)
            elif len(batch) < step and all(b.unit != it.unit for b in batch):
                batch.append(it)  # one item per unit in a trial; the others wait
        if not batch:
            break
        trial = dict(plan)
        for it in batch:
            held = in_plan.get(it.unit)
            for op in (held.formats if held else ()):
                trial.pop(op, None)
            trial.update(it.formats)
        r = evaluator.evaluate([Candidate().with_formats(trial, order)])[0]
        if r is None:
            break
        if r["verdict"] == "pass":
            plan, last = trial, r
            for it in batch:
                if (held := in_plan.get(it.unit)) is not None:
                    held.outcome = f"accepted, then replaced by {it.format}"
                in_plan[it.unit] = it
                it.outcome = "accepted"
                pending.remove(it)
            step *= 2
        elif len(batch) == 1:
            batch[0].outcome = f"rejected in the grown plan: {failure(r)}"
            pending.remove(batch[0])
            step = 1
        else:
            step = max(1, len(batch) // 2)
    for it in pending:
        if it.outcome == "pending":
            it.outcome = "not tried: budget exhausted"
    return last
