"""The run report: per op what was asked, what ran, what fell back and why, and the drift.

Schema (DESIGN §6; docs/report.md): `summary` with op and fallback counts, overflow/underflow/
NaN totals, the outputs' drift against the fp32 reference (rel_l2, max_abs, SQNR), guardrails
and a verdict; `ops`, one entry per executed op. Guardrails come from the module's policy
sheet (`mp.policy`, recorded by assign-precision) or from the command line. Drift leaves out
positions where result and reference hold the same inf/NaN (an attention mask) and counts every
other non-finite position as a `nonfinite_mismatch` (mplower.numerics.metrics.drift), which fails
the verdict whatever the guardrails (`NONFINITE`); non-finite figures (an op that overflowed to
inf) are written as null, so the JSON is strict. A reference that is itself inf or NaN where
every input is finite is no reference: `check_reference` makes it an error.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mplower.backend.executor import OpResult, RunResult, Step
from mplower.backend.scaled import ScaleStats
from mplower.dialect.plan import DENSE, Requested
from mplower.ir.diagnostics import DiagnosticError
from mplower.lowering.metrics import Metric, metric_figures, output_arrays
from mplower.lowering.policy import keep_f32_overrides
from mplower.numerics.metrics import allclose_ratio, finite_or_none
from mplower.numerics.metrics import drift as result_drift
from mplower.report.table import table

# The JSON Schema of the report, shipped as package data (tests validate every report with it).
SCHEMA_PATH = Path(__file__).with_name("report.schema.json")


def output_drift(result: RunResult) -> dict[str, float | None]:
    """Drift of all outputs together against the fp32 reference, and top-1 agreement.

    An output is compared where the reference has a counterpart of the same kind: a quantized
    (integer) output against a float reference, or one with no reference at all (see
    kernels.reference_kernel), is not, and without any comparable output the figures are None.
    """
    none = {"output_rel_l2": None, "output_max_abs": None, "sqnr_db": None,
            "nonfinite_mismatch": None, "top1_agreement": None}
    pairs = _output_pairs(result)
    if not sum(y.size for y, _ in pairs):  # no values: no drift to speak of (not 0, not NaN)
        return none
    d = result_drift(np.concatenate([a.astype(np.float64).ravel() for a, _ in pairs]),
                     np.concatenate([b.astype(np.float64).ravel() for _, b in pairs]))
    top1 = top1_agreement(*pairs[0])
    return {"output_rel_l2": d.rel_l2, "output_max_abs": d.max_abs, "sqnr_db": d.sqnr_db,
            "nonfinite_mismatch": d.nonfinite_mismatch, "top1_agreement": top1}


def _output_pairs(result: RunResult) -> list[tuple[np.ndarray, np.ndarray]]:
    """(output, reference) of every output that has a comparable reference (see output_drift)."""
    if result.reference is None:
        return []
    return [(np.asarray(y), np.asarray(r)) for y, r in zip(result.outputs, result.reference)
            if r is not None and (np.asarray(y).dtype.kind == "f") == (r.dtype.kind == "f")]


def nonfinite_weights(result: RunResult) -> list[dict[str, Any]]:
    """The constants holding NaN or ±inf as the lowered plan runs them, i.e. after the cast to
    their declared type (a finite f64 weight beyond f32's range is inf here): they are run as
    they are (a mask may mean -inf), and reported."""
    out = []
    for r in result.ops:
        c = r.step.constant
        if c is not None and c.dtype.kind == "f":
            nan, inf = int(np.count_nonzero(np.isnan(c))), int(np.count_nonzero(np.isinf(c)))
            if nan or inf:
                out.append({"name": r.step.name, "nan": nan, "inf": inf})
    return out


def class_axis(rank: int) -> int:
    """The class axis of a classifier output: 0 for one sample (C,), else 1, for (N, C) and
    (N, C, d1, ...) alike, as ONNX SoftmaxCrossEntropyLoss and torch.nn.CrossEntropyLoss
    lay out their input."""
    return 0 if rank == 1 else 1


def top1_agreement(y: np.ndarray, ref: np.ndarray) -> float | None:
    """Fraction of samples whose argmax over `class_axis` is a maximum of the reference's.

    A sample is one position of every other axis. The lowered argmax is numpy's (the first
    of its maxima); it agrees when the reference holds its row's maximum there, so ties in
    the reference agree with any of the tied classes. A NaN in a sample, on either side,
    never agrees. None where there are no classes to pick from: a scalar, a non-float output,
    a class axis of one entry.
    """
    if y.ndim == 0 or y.dtype.kind != "f" or y.shape[class_axis(y.ndim)] < 2 or not y.size:
        return None
    axis = class_axis(y.ndim)
    rows = np.moveaxis(y.astype(np.float64), axis, -1).reshape(-1, y.shape[axis])
    refs = np.moveaxis(ref.astype(np.float64), axis, -1).reshape(-1, y.shape[axis])
    picked = refs[np.arange(len(rows)), np.argmax(rows, axis=1)]
    with np.errstate(invalid="ignore"):
        agree = (picked == refs.max(axis=1)) & ~np.isnan(rows).any(axis=1)
    return float(np.mean(agree))


# A guardrail `max_X` / `min_X` (mplower.lowering.policy.GUARDRAILS) limits the summary's `X`,
# except that the summary names the outputs' rel-L2 `output_rel_l2`.
_SUMMARY_FIELD = {"max_rel_l2": "output_rel_l2"}
# `rtol` and `atol` are one elementwise check (numpy.allclose), reported as `max_allclose_ratio`:
# the worst |y - ref| / (atol + rtol |ref|) (summary `allclose_ratio`), which passes at 1.
ALLCLOSE = "max_allclose_ratio"
# Output values that are inf or NaN where the reference's are not (or the other way round):
# never a pass, whatever the guardrails, so this check is added wherever there is one, with
# limit 0, and named like a guardrail so that a reader of the JSON sees why the verdict failed.
NONFINITE = "max_nonfinite_mismatch"


def tolerance(limits: dict[str, float]) -> tuple[float, float] | None:
    """(rtol, atol) when the guardrails hold either (the other is then 0), else None."""
    if "rtol" not in limits and "atol" not in limits:
        return None
    return limits.get("rtol", 0.0), limits.get("atol", 0.0)


def evaluate_guardrails(limits: dict[str, float], summary: dict[str, Any]) -> dict[str, Any]:
    """Each guardrail of `limits` with its value in `summary` and whether it holds, and the
    `NONFINITE` check, failed, when the summary counts non-finite mismatches."""
    out = {}
    for key, limit in limits.items():
        if key in ("rtol", "atol"):
            rtol, atol = tolerance(limits)
            key, limit = ALLCLOSE, 1.0
        # A metric guardrail without a metric to measure (mplower.lowering.metrics) is None.
        v = summary.get(_SUMMARY_FIELD.get(key, key[len("max_"):]))
        if v is None:
            ok = False
        elif key.startswith("max_"):
            ok = v <= limit
        else:
            ok = v >= limit
        out[key] = {"limit": limit, "value": finite_or_none(v) if isinstance(v, float) else v, "ok": ok}
        if key == ALLCLOSE:
            out[key].update(rtol=rtol, atol=atol)
    if mismatch := summary.get("nonfinite_mismatch"):
        out[NONFINITE] = {"limit": 0, "value": mismatch, "ok": False}
    return out


def _nonfinite(a: Any) -> int:
    """How many values of a float array are inf or NaN (0 for None and non-float arrays)."""
    if a is None or (a := np.asarray(a)).dtype.kind != "f":
        return 0
    return int(a.size - np.count_nonzero(np.isfinite(a)))


def check_reference(steps: Sequence[Step], refs: Sequence[Any] | Callable[[], Sequence[Any]],
                    outputs: Sequence[Any], file: str | None = None) -> None:
    """A located error when the fp32 reference's `outputs` hold inf or NaN although every
    argument and constant is finite: the reference overflowed, and drift against it means
    nothing (where both hold NaN it would count as agreement). It names the first op whose
    reference result is non-finite from finite operands. `refs` holds every slot's reference
    value (Program.run_reference), or gives it when called (RunResult.all_refs: a run keeps
    only its live values, so the reference runs again, only where the outputs are not
    finite); `file` replaces the file
    of the location (a module parsed from a copy). Non-finite inputs or weights (an attention
    mask's -inf) may lawfully reach the outputs: then nothing is checked."""
    bad_outputs = sum(_nonfinite(r) for r in outputs)
    if not bad_outputs:
        return
    if callable(refs):
        refs = refs()
    produced = {s.output for s in steps}
    arguments = {i for s in steps for i in s.inputs} - produced
    if any(_nonfinite(refs[i]) for i in arguments) or any(
            _nonfinite(refs[s.output]) for s in steps if s.op == "mp.constant"):
        return
    for s in steps:
        if (bad := _nonfinite(refs[s.output])) and not any(_nonfinite(refs[i])
                                                            for i in s.inputs):
            loc = s.loc if file is None else dataclasses.replace(s.loc, file=file)
            raise DiagnosticError.at(loc, (
                f"the fp32 reference is not finite: {s.name} ({s.op}) makes {bad} inf or NaN "
                f"value{'s' * (bad != 1)} from finite operands, and the outputs hold "
                f"{bad_outputs}; no plan can be judged against that reference (scale the "
                f"inputs or weights into f32's range)"))


def verdict(guardrails: dict[str, Any]) -> str:
    """`pass` or `fail`; `unchecked` without guardrails, which is no claim of quality (a
    non-finite mismatch is a failed `NONFINITE` entry, so never unchecked)."""
    if not guardrails:
        return "unchecked"
    return "pass" if all(g["ok"] for g in guardrails.values()) else "fail"


def op_entry(r: OpResult) -> dict[str, Any]:
    s = r.step
    # A zero-size result has no drift to measure: null, as for a non-finite figure.
    empty = math.prod(s.out_type.shape) == 0
    drift = {k: None if empty else finite_or_none(v) for k, v in
             (("rel_l2", r.rel_l2), ("sqnr_db", r.sqnr_db), ("max_abs", r.max_abs))}
    return {
        "name": s.name, "op": s.op, "type": str(s.out_type),
        "requested": s.requested, "executed": s.executed,
        "fallback": s.reason is not None, "reason": s.reason,
        "overflow": r.counts.overflow, "underflow": r.counts.underflow, "nan": r.counts.nan,
        **drift, "nonfinite_mismatch": r.nonfinite_mismatch,
        "flops": s.flops,
        **({"scaling": scaling_entry(r.scale)} if r.scale is not None else {}),
    }


def scaling_entry(st: ScaleStats) -> dict[str, Any]:
    """What an mp.scaled_quant's recipe did in the run: its amax and scale, the fraction of the
    values that saturated or flushed to zero, and the bytes of scales per element."""
    return {"recipe": st.recipe, "scale_format": st.scale_format,
            "amax": finite_or_none(st.amax), "scale": finite_or_none(st.scale),
            "tensor_scale": finite_or_none(st.tensor_scale),
            "saturated_fraction": st.saturated, "flushed_fraction": st.flushed,
            "scale_bytes_per_element": st.scale_bytes_per_element}


def build_report(result: RunResult, guardrails: dict[str, float],
                 policy: str | None = None, function: str | None = None,
                 metric: Metric | None = None, eval: Mapping[str, np.ndarray] | None = None,
                 output_names: Sequence[str] | None = None) -> dict[str, Any]:
    """The report of one run (docs/report.md); `guardrails` maps keys of
    mplower.lowering.policy.GUARDRAILS to limits. With a task `metric`, the outputs and the
    fp32 reference are measured on the arrays `eval` (docs/metrics.md); `output_names` are the
    model's own names of its outputs (`mp.output_names`), which a metric may use."""
    if result.reference is not None:
        check_reference([r.step for r in result.ops], result.all_refs or result.refs,
                        result.reference)
    ops = [op_entry(r) for r in result.ops]
    # A row per result; an op with several results (mp.split) still counts once.
    counted = {r.step.node: r.step for r in result.ops if r.step.op != "mp.constant"}
    fallbacks = sum(1 for s in counted.values() if s.reason is not None)
    drift = output_drift(result)
    summary: dict[str, Any] = {
        "ops": len(counted), "fallback_ops": fallbacks,
        "fallback_rate": fallbacks / len(counted) if counted else 0.0,
        "overflow": sum(o["overflow"] for o in ops),
        "underflow": sum(o["underflow"] for o in ops),
        "nan": sum(o["nan"] for o in ops),
        "nonfinite_weights": nonfinite_weights(result),
        **drift,
    }
    detail: dict[str, Any] = {}
    if metric is not None:
        refs = result.reference
        ref = (output_arrays(refs, output_names)
               if refs is not None and all(r is not None for r in refs) else None)
        figures = metric_figures(metric, output_arrays(result.outputs, output_names), ref,
                                 eval or {})
        detail = {k: figures.pop(k) for k in ("metric_detail", "metric_reference_detail")
                  if k in figures}
        summary.update(figures)
    # Over every value the ops wrote (constants too, as `overflow` counts their rounding).
    written = sum(math.prod(r.step.out_type.shape) for r in result.ops)
    summary["overflow_rate"] = summary["overflow"] / written if written else 0.0
    if (tol := tolerance(guardrails)) is not None:
        pairs = _output_pairs(result)
        summary["allclose_ratio"] = finite_or_none(
            max(allclose_ratio(y, r, *tol) for y, r in pairs)) if pairs else None
    summary["guardrails"] = evaluate_guardrails(guardrails, summary)
    summary["verdict"] = verdict(summary["guardrails"])
    for key in ("output_rel_l2", "output_max_abs", "sqnr_db"):
        summary[key] = finite_or_none(summary[key])
    out = {"function": function, "policy": policy, "summary": summary, "ops": ops}
    if metric is not None:
        out["metric"] = {**metric.to_json(), **detail}
    return out


def _severity(op: dict[str, Any]) -> float:
    """Sort key for "worst first": drift, with overflowed ops (no finite drift) on top."""
    if op["rel_l2"] is not None:
        return op["rel_l2"]
    return math.inf if op["overflow"] or op["nan"] or op["nonfinite_mismatch"] else -1.0


def render(report: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(report, indent=2, allow_nan=False) + "\n"
    s = report["summary"]
    worst = sorted((o for o in report["ops"] if o["op"] != "mp.constant"),
                   key=lambda o: -_severity(o))
    header = ["name", "op", "requested", "executed", "fallback", "overflow", "underflow",
              "nan", "rel_l2", "sqnr_db"]

    def fmt_plan(p: dict) -> str:  # as mp.reason spells a plan: `bf16/f32 sparse_2_4`
        return str(Requested(p["precision"], p.get("accum"), p.get("kernel", DENSE)))

    def num(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    rows = [[o["name"], o["op"], fmt_plan(o["requested"]), fmt_plan(o["executed"]),
             o["reason"] or "-", str(o["overflow"]), str(o["underflow"]), str(o["nan"]),
             num(o["rel_l2"], ".3g"), num(o["sqnr_db"], ".1f")] for o in worst]
    g = ", ".join(f"{k} {_figure(v['value'], v['limit'])} "
                  f"{'<=' if k.startswith('max') else '>='} {_figure(v['limit'])} "
                  f"{'ok' if v['ok'] else 'FAILED'}" for k, v in s["guardrails"].items())
    lines = [f"verdict: {s['verdict']}" + (f" ({g})" if g else " (no guardrails)"),
             f"outputs: rel_l2 {num(s['output_rel_l2'], '.4g')}, max_abs "
             f"{num(s['output_max_abs'], '.4g')}, sqnr {num(s['sqnr_db'], '.2f')} dB"
             + (f", top-1 agreement {s['top1_agreement']:.4f}"
                if s["top1_agreement"] is not None else ""),
             *([_metric_line(report)] if "metric" in report else []),
             (f"ops: {s['ops']}, fallbacks: {s['fallback_ops']} "
              f"({100 * s['fallback_rate']:.1f}%), overflow {s['overflow']}, "
              f"underflow {s['underflow']}, nan {s['nan']}"), ""]
    if s["nonfinite_mismatch"] or s["nonfinite_weights"]:
        lines.insert(-1, _nonfinite_line(s))
    lines += table(header, rows, fmt)
    quant = report.get("quantization")
    if quant:
        qheader = ["name", "op", "weight_sqnr_db", "activation_sqnr_db",
                   "activation_local_sqnr_db", "local_sqnr_db"]
        qrows = [[q["name"], q["op"], *(num(q[k], ".1f") for k in qheader[2:])] for q in quant]
        if any("weight_quant" in q for q in quant):  # weight-only: the method and its error
            qheader = [*qheader, "weight_quant", "weight_rel_error"]
            for q, r in zip(quant, qrows):
                r += [q.get("weight_quant", ""), num(q.get("weight_rel_error"), ".4g")]
        lines += ["", "quantization error (worst first):", *table(qheader, qrows, fmt)]
    scaled = [o for o in report["ops"] if "scaling" in o]
    if scaled:
        sheader = ["name", "recipe", "scale_format", "amax", "scale", "saturated", "flushed",
                   "scale_bytes/elem"]
        srows = [[o["name"], c["recipe"], c["scale_format"], num(c["amax"], ".4g"),
                  num(c["scale"], ".4g"), f"{c['saturated_fraction']:.2%}",
                  f"{c['flushed_fraction']:.2%}", f"{c['scale_bytes_per_element']:.4g}"]
                 for o in scaled for c in [o["scaling"]]]
        lines += ["", "scaling (per scaled operand):", *table(sheader, srows, fmt)]
    b = report.get("bisect")
    if b is not None:
        kept = ", ".join(b["ops"]) or "nothing"
        met = "met" if b["met"] else "not met"
        lines += ["", f"bisect: keep in f32: {kept} ({b['runs']} runs; guardrails {met})"]
        if b["ops"]:
            lines += ["to keep them in f32 when lowering, add to the policy sheet:", "",
                      *keep_f32_overrides(b["ops"]).rstrip("\n").splitlines()]
    return "\n".join(lines) + "\n"


def _metric_line(report: dict[str, Any]) -> str:
    """`metric top1:labels (max): 0.8125, fp32 0.8438, drop 0.03125 (3.70%)`."""
    s, m = report["summary"], report["metric"]
    rel = s["metric_drop_rel"]
    return (f"metric {m['spec']} ({m['direction']}): {_figure(s['metric'])}, fp32 "
            f"{_figure(s['metric_reference'])}, drop {_figure(s['metric_drop'])}"
            + (f" ({rel:.2%})" if rel is not None else ""))


def _nonfinite_line(s: dict[str, Any]) -> str:
    weights = ", ".join(f"{w['name']} ({w['nan']} NaN, {w['inf']} inf)"
                        for w in s["nonfinite_weights"]) or "none"
    return (f"non-finite: {s['nonfinite_mismatch'] or 0} output values where the reference "
            f"differs; weights holding NaN/inf: {weights}")


def _figure(x: float | None, limit: float | None = None) -> str:
    """`x` to 3 significant digits for a reader (the JSON keeps every digit), more where 3
    would print a value that differs from its limit as the limit."""
    if x is None:
        return "-"
    if isinstance(x, int) or (float(x).is_integer() and abs(x) < 1e15):
        return str(int(x))
    for digits in range(3, 18):
        text = format(x, f".{digits}g")
        if limit is None or x == limit or text != format(limit, f".{digits}g"):
            return text
    return repr(x)

