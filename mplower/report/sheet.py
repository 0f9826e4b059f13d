"""The precision policy sheet of a (lowered) module: per op what it computes in, why, and its cost.

One row per operation: result name, op, compute format, accumulator, kernel, reason, FLOPs and
the roofline time the target's cost model gives it (mplower.lowering.target.Target.op_time); the
summary adds the total and the speedup against the same module run entirely in f32. The
compute format of an op is its `mp.precision`, or the element type it already has. A module
with sparse kernel decisions gets the sparse reality check too (mplower.report.sparse).
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, replace
from typing import Any

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.dialect.plan import Plan
from mplower.ir.graph import ARG, RETURN, Function, Module
from mplower.ir.opdef import OPS, check_attrs
from mplower.ir.types import TensorType
from mplower.lowering.target import Target
from mplower.numerics.formats import FORMATS
from mplower.report.sparse import sparse_lines, sparse_report
from mplower.report.table import table

COLUMNS = ("name", "op", "compute", "accum", "kernel", "reason", "flops", "modeled_time_s")


@dataclass(frozen=True)
class Row:
    name: str
    op: str
    compute: str
    accum: str | None
    kernel: str
    reason: str
    flops: int
    modeled_time_s: float
    fp32_time_s: float


def _wide(t: TensorType) -> TensorType:
    return t.with_elem("f32") if FORMATS[t.elem].is_float else t


def op_row(f: Function, n: int, target: Target) -> Row | None:
    d = f.data(n)
    op = d["op"]
    if op in (ARG, RETURN) or op == "mp.constant" or op not in OPS:
        return None
    opdef = OPS[op]
    attrs = d["attrs"]
    ins, outs = f.operand_types(n), d["types"]
    flops = int(opdef.flops(ins, outs, check_attrs(opdef, attrs)))
    plan = Plan.of(attrs)
    compute = plan.precision or (ins[0].elem if ins else outs[0].elem)
    accum, kernel = plan.accum, plan.kernel_or_dense
    try:
        time = target.op_time(flops, opdef.bytes_moved(ins, outs), compute, kernel)
    except ValueError:  # a format the target has no rate for (e.g. i1): price it as f32
        time = target.op_time(flops, opdef.bytes_moved(ins, outs), "f32")
    # The f32 plan has no casts: they exist only because of the lowering.
    fp32 = 0.0 if op == "mp.cast" else target.op_time(
        flops, opdef.bytes_moved([_wide(t) for t in ins], [_wide(t) for t in outs]), "f32")
    name = f.value_name((n, 0)) if outs else op
    return Row(name, op, compute, accum, kernel, plan.reason or "", flops, time, fp32)


def precision_sheet(module: Module, target: Target, func: str | None = None,
                    measure: bool = True) -> dict[str, Any]:
    """The sheet as a dict; with sparse decisions in the module, a `sparse` section too (the
    reality check of mplower.report.sparse.sparse_report; `measure` times the CPU kernels),
    whose modeled sparse times replace the type-only estimate of those ops' rows."""
    f = module.function(func)
    rows = [r for r in (op_row(f, n, target) for n in f.ops()) if r is not None]
    sparse = sparse_report(module, target, func, measure=measure)
    if sparse is not None:
        modeled = {e["name"]: e["modeled_sparse_s"] for e in sparse["ops"]
                   if "modeled_sparse_s" in e}
        rows = [replace(r, modeled_time_s=modeled[r.name]) if r.name in modeled else r
                for r in rows]
    total = sum(r.modeled_time_s for r in rows)
    fp32_total = sum(r.fp32_time_s for r in rows)
    return {
        "function": f.name,
        "target": target.name,
        "policy": module.attrs.get("mp.policy"),
        "ops": [{c: getattr(r, c) for c in COLUMNS} for r in rows],
        "summary": {
            "ops": len(rows),
            "lowered_ops": sum(1 for r in rows if r.compute not in ("f32", "f64")),
            "flops": sum(r.flops for r in rows),
            "modeled_time_s": total,
            "fp32_modeled_time_s": fp32_total,
            "modeled_speedup_vs_fp32": fp32_total / total if total else 1.0,
            "modeled_inferences_per_s": 1.0 / total if total else float("inf"),
        },
        **({"sparse": sparse} if sparse is not None else {}),
    }


def _cells(row: dict[str, Any]) -> list[str]:
    out = []
    for c in COLUMNS:
        v = row[c]
        if c == "modeled_time_s":
            out.append(f"{v * 1e6:.3f} us")
        elif v is None:
            out.append("-")
        else:
            out.append(str(v))
    return out


def _strict(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    return value


def render(sheet: dict[str, Any], fmt: str) -> str:
    s = sheet["summary"]
    if fmt == "json":  # strict JSON: an infinite figure (no ops to time) is null
        return json.dumps(_strict(sheet), indent=2, allow_nan=False) + "\n"
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(COLUMNS)
        for r in sheet["ops"]:
            w.writerow([r[c] if r[c] is not None else "" for c in COLUMNS])
        return buf.getvalue()
    header = ["name", "op", "compute", "accum", "kernel", "reason", "flops", "modeled time"]
    rows = [_cells(r) for r in sheet["ops"]]
    footer = (f"{s['ops']} ops, {s['lowered_ops']} lowered; modeled {s['modeled_time_s'] * 1e6:.3f}"
              f" us on {sheet['target']} ({s['modeled_inferences_per_s']:.1f} inferences/s), "
              f"{s['modeled_speedup_vs_fp32']:.2f}x the f32 plan")
    sparse = sparse_lines(sheet["sparse"], fmt) if "sparse" in sheet else []
    gap = "\n" if fmt == "markdown" else ""  # a blank line ends a markdown table
    return ("\n".join(table(header, rows, fmt, rule=True)) + f"\n{gap}{footer}\n"
            + "".join(f"{x}\n" for x in sparse))
