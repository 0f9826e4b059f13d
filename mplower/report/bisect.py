"""Bisect a lowered module: the smallest set of ops whose return to f32 meets the guardrails.

ONNX Runtime's quantization debugger and ModelOpt's per-layer sensitivity find the layer that
hurts; this closes the loop and names the ops to keep wide. On a lowered module (quantized,
or with a narrow float plan) and one set of inputs:

1. run it; if the guardrails pass, the answer is the empty set;
2. rank the ops that a plan or quantization changed (`report.quant.converted_ops`) by what
   each loses itself, from one traced run: its result against the op in f32 on the values
   its operands were converted from, for its worst output channel (`report.quant`'s
   `local_sqnr_db`). Error measured this way does not count what an op inherits from
   upstream, and a channel wiped out by a shared scale is not hidden by a large one;
3. binary-search the shortest prefix of that ranking whose return to f32 passes (log2(n) + 1
   runs; it assumes, as all such tools do, that keeping more ops wide does not hurt);
4. prune: try dropping each op of that prefix, least harmful first, and keep it out where the
   guardrails still pass. The result is 1-minimal (no single op can be dropped from it), not
   necessarily the global minimum, which would need a search over subsets.

`keep_f32` is the rewrite that returns ops to f32 in a copy of the module: the op is recomputed
in f32 from the float values its operands were converted from (`report.quant.float_origin`,
undoing quantize's shift of asymmetric activations), replaces the float value that stood for
its result (its own result, or the dequantize of an i32 kernel and quantize's zero-point
correction), and consumers that expect another format get a cast. Dead conversions are removed.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mplower.backend.executor import Program
from mplower.dialect.mp import ACCUMULATING
from mplower.dialect.plan import PLAN_ATTRS, QUANT_MARK, WEIGHT_QUANT, Plan
from mplower.ir.graph import Function, Module, Value
from mplower.numerics.formats import FORMATS
from mplower.passes.dce import eliminate_dead_ops
from mplower.report.quant import (
    converted_ops,
    float_origin,
    local_severity,
    operand_sqnr,
    result_float,
    trace,
)
from mplower.report.run import build_report

_PLAN_KEYS = (*PLAN_ATTRS, WEIGHT_QUANT, QUANT_MARK)


@dataclass
class BisectResult:
    ops: list[str]  # the ops to keep in f32, most harmful first
    met: bool  # whether returning them to f32 meets the guardrails
    runs: int  # program runs it took, the baseline included
    ranking: list[tuple[str, float]]  # every candidate and its local SQNR (dB), worst first
    baseline: dict[str, Any]  # the report summaries before and after
    final: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"ops": self.ops, "met": self.met, "runs": self.runs,
                "ranking": [{"name": n, "local_sqnr_db": s if math.isfinite(s) else None}
                            for n, s in self.ranking],
                "baseline_verdict": self.baseline.get("verdict"),
                "final": self.final}


def keep_f32(module: Module, names: Iterable[str], func: str | None = None) -> Module:
    """A copy of `module` in which the ops with these result names compute in f32."""
    out = copy.deepcopy(module)
    f = out.function(func)
    wanted = {n if n.startswith("%") else f"%{n}" for n in names}
    by_name = {f.value_name((n, 0)): n for n in f.ops() if f.data(n)["types"]}
    missing = wanted - set(by_name)
    if missing:
        raise KeyError(f"no op named {', '.join(sorted(missing))}")
    restored: dict[Value, Value] = {}  # a restored op's float result -> its f32 replacement
    for n in f.ops():  # in program order: producers before their consumers
        if n in by_name.values() and f.value_name((n, 0)) in wanted:
            _restore(f, n, restored)
    eliminate_dead_ops(f)
    return out


def _restore(f: Function, n: int, restored: dict[Value, Value]) -> None:
    d = f.data(n)
    through = WEIGHT_QUANT in d["attrs"]
    operands = []
    for v in f.operands(n):
        o = float_origin(f, v, through)
        o = restored.get(o, o)
        t = f.type_of(o)
        if FORMATS[t.elem].is_float and t.elem not in ("f32", "f64"):
            o = (f.create_op("mp.cast", [o], [t.with_elem("f32")], after=o[0],
                             name_hint=f"{f.data(o[0])['name']}_f32"), 0)
        operands.append(o)
    result = result_float(f, n)
    out_t = d["types"][0].with_elem("f32")
    attrs = {k: v for k, v in d["attrs"].items() if k not in _PLAN_KEYS}
    attrs.update(Plan("f32", "f32" if d["op"] in ACCUMULATING else None,
                      reason="bisect: kept f32").attrs())
    new = (f.create_op(d["op"], operands, [out_t], attrs, before=n, name_hint=d["name"]), 0)
    restored[result] = new
    casts: dict[str, Value] = {}
    for user, pos in f.uses(result):
        want = f.type_of(result)
        if f.op(user) == "mp.cast" and f.types(user)[0].elem == "f32":
            f.replace_all_uses((user, 0), new)  # a cast back up: the f32 value itself
            continue
        if want.elem == "f32":
            f.set_operand(user, pos, new)
            continue
        if want.elem not in casts:
            casts[want.elem] = (f.create_op("mp.cast", [new], [want], after=new[0],
                                            name_hint=f"{d['name']}_{want.elem}"), 0)
        f.set_operand(user, pos, casts[want.elem])


def evaluate(module: Module, inputs: list[np.ndarray], guardrails: dict[str, float],
             func: str | None = None, weights: str | None = None,
             **metric: Any) -> dict[str, Any]:
    """The run report's summary (verdict and guardrails) of one module on `inputs`; `metric`
    is build_report's task metric (metric=, eval=, output_names=), where the guardrails
    limit one."""
    program = Program(module, func, weights)
    return build_report(program.run(inputs), guardrails, **metric)["summary"]


def rank(module: Module, inputs: list[np.ndarray], func: str | None = None,
         weights: str | None = None) -> list[tuple[str, float]]:
    """Candidate ops, most harmful first, by the SQNR of what each loses itself."""
    program = Program(module, func, weights)
    rows = operand_sqnr(program, inputs, trace(program, inputs))
    ranked = [(r["name"], local_severity(r)) for r in rows]
    ranked.sort(key=lambda item: item[1])
    return ranked


def bisect(module: Module, inputs: list[np.ndarray], guardrails: dict[str, float],
           func: str | None = None, weights: str | None = None,
           **metric: Any) -> BisectResult:
    """The smallest set of ops to keep in f32 so that `guardrails` pass (module docstring)."""
    if not guardrails:
        raise ValueError("bisect needs guardrails to meet (a policy sheet's or --guardrail)")
    runs = 0

    def passes(names: list[str]) -> tuple[bool, dict[str, Any]]:
        nonlocal runs
        runs += 1
        summary = evaluate(keep_f32(module, names, func) if names else module, inputs,
                           guardrails, func, weights, **metric)
        return summary["verdict"] == "pass", summary

    ok, baseline = passes([])
    ranking = rank(module, inputs, func, weights)
    if ok:
        return BisectResult([], True, runs, ranking, baseline, baseline)
    names = [n for n, _ in ranking]
    ok, final = passes(names)
    if not ok:
        return BisectResult(names, False, runs, ranking, baseline, final)
    lo, hi = 0, len(names)  # the prefix of length hi passes; lo is known to fail
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok, summary = passes(names[:mid])
        if ok:
            hi, final = mid, summary
        else:
            lo = mid
    chosen = names[:hi]
    for name in reversed(names[:hi]):  # least harmful first
        if len(chosen) == 1:
            break
        trial = [c for c in chosen if c != name]
        ok, summary = passes(trial)
        if ok:
            chosen, final = trial, summary
    return BisectResult(chosen, True, runs, ranking, baseline, final)


__all__ = ["BisectResult", "bisect", "converted_ops", "evaluate", "keep_f32", "rank"]
