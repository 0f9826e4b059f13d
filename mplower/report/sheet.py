"""The precision policy sheet of a (lowered) module: per op what it computes in, why, and its cost.

One row per operation: result name, op, compute format, accumulator, kernel, reason, FLOPs and
the modeled time of the fused kernel it anchors (mplower.lowering.cost: the other members of a
group, folded conversions and deploy-time constants show 0); the `groups` section lists the
fused kernels and what bounds each; the summary adds the total and the speedup against the
fp32 plan of the same module, priced the same way. The compute format of an op is its
`mp.precision`, or the element type it already has. A module with sparse kernel decisions gets
the sparse reality check too (mplower.report.sparse).
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.dialect.plan import POLICY, Plan
from mplower.ir.graph import ARG, RETURN, Function, Module
from mplower.ir.opdef import OPS, check_attrs
from mplower.lowering.cost import Cost, compute_format, plan_cost
from mplower.lowering.target import Target
from mplower.lowering.throughput import Units, rate_text, units
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
    group: int | None  # the fused kernel (cost.Group.id) it belongs to, if any


def op_row(f: Function, n: int, times: dict[str, float], groups: dict[str, int]) -> Row | None:
    """The row of op `n`; `times` has the modeled time of each group's anchor, `groups` the
    group of each op in one (mplower.lowering.cost.Cost.group_of)."""
    d = f.data(n)
    op = d["op"]
    if op in (ARG, RETURN) or op == "mp.constant" or op not in OPS:
        return None
    opdef = OPS[op]
    attrs = d["attrs"]
    ins, outs = f.operand_types(n), d["types"]
    flops = int(opdef.flops(ins, outs, check_attrs(opdef, attrs)))
    plan = Plan.of(attrs)
    compute = compute_format(f, n)
    accum, kernel = plan.accum, plan.kernel_or_dense
    name = f.op_name(n) if outs else op
    return Row(name, op, compute, accum, kernel, plan.reason or "", flops,
               times.get(name, 0.0), groups.get(name))


def precision_sheet(module: Module, target: Target, func: str | None = None,
                    measure: bool = True, seq_axis: int | None = None, *,
                    function: Function | None = None, cost: Cost | None = None
                    ) -> dict[str, Any]:
    """The sheet as a dict; with sparse decisions in the module, a `sparse` section too (the
    reality check of mplower.report.sparse.sparse_report; `measure` times the CPU kernels).
    Throughput is per call (`inferences`), per sample (the first argument's leading
    dimension) and per token (mplower.lowering.throughput; `seq_axis` names the axis).
    `function` and its `cost` replace @func where the caller priced a re-shaped copy of it
    (mplower.report.serving)."""
    f = function or module.function(func)
    u = units(f, seq_axis)
    cost = cost or plan_cost(f, target)
    times = {g.anchor: g.time_s for g in cost.groups}
    rows = [r for r in (op_row(f, n, times, dict(cost.group_of)) for n in f.ops())
            if r is not None]
    sparse = sparse_report(module, target, func, measure=measure)
    total, fp32_total = cost.time_s, cost.fp32_time_s
    return {
        "function": f.name,
        "target": target.name,
        "policy": module.attrs.get(POLICY),
        "ops": [{c: getattr(r, c) for c in (*COLUMNS, "group")} for r in rows],
        "groups": [{**asdict(g), "members": list(g.members)} for g in cost.groups],
        "summary": {
            "ops": len(rows),
            "lowered_ops": sum(1 for r in rows if r.compute not in ("f32", "f64")),
            "flops": sum(r.flops for r in rows),
            "modeled_time_s": total,
            "kernels": len(cost.groups),
            "fp32_modeled_time_s": fp32_total,
            "modeled_speedup_vs_fp32": fp32_total / total if total else 1.0,
            "modeled_inferences_per_s": 1.0 / total if total else float("inf"),
            "samples_per_inference": u.samples,
            "tokens_per_inference": u.tokens,
            **{f"modeled_{k}": v for k, v in u.rates(1.0 / total if total else None).items()},
            "board_power_w": target.board_power_w,
            "modeled_joules_per_inference": (joules := target.joules(total)),
            "modeled_inferences_per_joule": 1.0 / joules if joules else None,
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
    rate = rate_text(s["modeled_inferences_per_s"], Units(s["samples_per_inference"],
                                                          s["tokens_per_inference"]))
    footer = (f"{s['ops']} ops, {s['lowered_ops']} lowered; modeled {s['modeled_time_s'] * 1e6:.3f}"
              f" us on {sheet['target']} ({rate}), "
              f"{s['modeled_speedup_vs_fp32']:.2f}x the f32 plan")
    if s["modeled_joules_per_inference"] is not None:
        per_joule = s["modeled_inferences_per_joule"]  # None where nothing takes time
        footer += (f"; {s['modeled_joules_per_inference']:.4g} J/inference, "
                   f"{'-' if per_joule is None else format(per_joule, '.4g')} inferences/J at "
                   f"{s['board_power_w']:g} W")
    sparse = sparse_lines(sheet["sparse"], fmt) if "sparse" in sheet else []
    if "phase" in s:  # a serving point (mplower.report.serving)
        sparse.append(serving_line(s))
    gap = "\n" if fmt == "markdown" else ""  # a blank line ends a markdown table
    # The summary is the last line (`| tail -1`), after the fused kernels and sparse sections.
    return ("\n".join(table(header, rows, fmt, rule=True)) + "\n"
            + "".join(f"{x}\n" for x in [*group_lines(sheet["groups"], fmt, gap), *sparse])
            + f"{gap}{footer}\n")


def serving_line(s: dict[str, Any]) -> str:
    """The serving figures of a --phase report, one line."""
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.4g} ms"
    point = (f"batch {s['batch']}, prompt {s['prompt']}, {s['generate']} tokens generated"
             if s.get("generate") else f"batch {s['batch']}, context {s['context']}")
    return (f"{s['phase']} at {point}: {s['tokens_per_s']:.4g} tokens/s, TTFT {ms(s['ttft_s'])}, "
            f"ITL {ms(s['itl_s'])}; weights {s['weight_bytes'] / 1e9:.4g} GB, KV cache "
            f"{s['kv_cache_bytes_per_token']} bytes/token")


def group_lines(groups: list[dict[str, Any]], fmt: str, gap: str) -> list[str]:
    """The fused-kernel section of the table and markdown renderings."""
    rows = [[str(g["id"]), g["anchor"], g["compute"], g["bound"], f"{g['time_s'] * 1e6:.3f} us",
             " ".join(g["members"])] for g in groups]
    return [f"{gap}fused kernels: {len(groups)}",
            *table(["group", "anchor", "compute", "bound", "modeled time", "ops"], rows, fmt,
                   rule=True)]
