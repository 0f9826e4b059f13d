"""Per-op quantization error: SQNR of each op's weights and activations, worst first.

ONNX Runtime's qdq_loss_debug and ModelOpt's per-layer reports compare each quantized tensor
with its float counterpart; this does the same on a compiled `Program`. `trace` runs the
lowered plan and the fp32 reference side by side, as `Program.run` does, but keeps every
value. For every op that consumes converted values (an integer kernel, a QDQ op, a weight-only
matmul, an op whose operands were cast to a narrower float) `operand_sqnr` reports, per
operand:

* `weight_sqnr_db` / `activation_sqnr_db`: the value the op consumes (dequantized where it is
  an integer) against the fp32 reference of that value. For an activation this includes what
  went wrong upstream; for a weight it is the weight's quantization alone;
* `activation_local_sqnr_db`: the activation's own conversion only (the dequantized operand
  against the lowered value it was quantized or cast from);

`weight_quant` and `weight_rel_error` for a weight-only op: how quantize stored the weight
(method rtn, gptq or awq) and the relative reconstruction error ||X W - X W_hat|| / ||X W||
it measured on its calibration data (mplower.numerics.weight_only);

and `local_sqnr_db`, what the op itself loses: its float result (for an integer kernel, the
dequantized one) against the same op computed in f32 on the very values its operands were
converted from, taken per output channel and reported for the worst channel (a tensor-wide
figure hides channels that a shared scale wiped out under one large one). Error inherited from
upstream does not enter it; the rows are sorted by it, worst first, and `mplower.report.bisect`
ranks ops by it. A weight is an operand computed from constants only. Values are in dB; inf
where nothing was lost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mplower.backend.executor import Program
from mplower.dialect.mp import CONVERSIONS
from mplower.dialect.plan import QUANT_MARK, WEIGHT_ERROR, WEIGHT_QUANT
from mplower.ir.graph import Function, Value
from mplower.ir.opdef import attr_array
from mplower.lowering.calibration import CALIB, constant_nodes
from mplower.numerics.formats import FORMATS, INDEX_FORMATS
from mplower.numerics.metrics import channel_sqnr_db, finite_or_none, sqnr_db
from mplower.numerics.quant import dequantize
from mplower.passes.quantize import ZERO_POINT

MOVEMENT = frozenset({"mp.reshape", "mp.transpose"})


@dataclass
class Trace:
    """Every slot's value in one run: `values` lowered, `refs` fp32 reference (None: none)."""

    values: list[Any]
    refs: list[Any]
    slots: dict[Value, int] = field(default_factory=dict)


def trace(program: Program, inputs: list[np.ndarray]) -> Trace:
    """Run the lowered plan and the fp32 reference, keeping every value (Program.run's
    `keep=True`: the SQNR tables read operands, their float origins and results across the
    whole graph)."""
    result = program.run(inputs, keep=True)
    return Trace(result.values, result.refs, dict(program.slots))


def real_value(f: Function, v: Value, t: Trace) -> np.ndarray | None:
    """The value `v` stands for, as floats: dequantized where it is a quantize's integer."""
    x = t.values[t.slots[v]]
    if x is None:
        return None
    if np.asarray(x).dtype.kind == "f":
        return np.asarray(x, np.float32)
    d = f.data(v[0])
    if d["op"] != "mp.quantize":
        return None
    scale = attr_array(d["attrs"]["scale"]).astype(np.float32)
    zp = attr_array(d["attrs"].get("zero_point", 0))
    axis = d["attrs"].get("axis", 1) if scale.size > 1 else None
    storage = FORMATS[f.type_of(v).elem].storage
    return dequantize(np.asarray(x).astype(storage), scale, zp, axis)


def is_conversion(f: Function, node: int) -> bool:
    d = f.data(node)
    return d["op"] in CONVERSIONS or (d["op"] == "mp.sub" and d["attrs"].get(CALIB) == "shifted")


def float_origin(f: Function, v: Value, through_movement: bool = False) -> Value:
    """The float value `v` was converted from: back through quantize, dequantize, cast and
    quantize's shift (and reshape/transpose with `through_movement`, for weight-only group
    layouts), to the furthest float value of `v`'s shape; `v` itself if it is no conversion."""
    shape = f.type_of(v).shape
    best, cur, passed = v, v, False
    while True:
        node = cur[0]
        if is_conversion(f, node):
            passed = True
        elif not (through_movement and f.op(node) in MOVEMENT):
            return best
        cur = f.operands(node)[0]
        t = f.type_of(cur)
        if passed and t.shape == shape and FORMATS[t.elem].is_float:
            best = cur


_NOT_QUANTIZED = frozenset({"i1", *INDEX_FORMATS})  # element types no plan quantizes to


def converted_ops(f: Function) -> list[int]:
    """Ops (other than conversions and constants) that consume converted values or write a
    narrower float than f32: what a precision plan or quantization changed."""
    out = []
    for n in f.ops():
        d = f.data(n)
        if d["op"] in ("return", "mp.constant") or is_conversion(f, n) or d["op"] in MOVEMENT:
            continue
        if d["attrs"].get(QUANT_MARK) == ZERO_POINT:  # part of the quantized op it follows
            continue
        narrow = any(FORMATS[t.elem].is_float and FORMATS[t.elem].bits < 32 for t in d["types"])
        through = WEIGHT_QUANT in d["attrs"]
        # A mask or an index cast from a float (an attention mask's `where`) changed no precision.
        # A weight-only op whose weight quantize stored as integers (GPTQ, AWQ) has no float
        # origin to trace back to, but is converted all the same.
        if narrow or through or any(f.type_of(v).elem not in _NOT_QUANTIZED
                         and float_origin(f, v, through) != v for v in f.operands(n)):
            out.append(n)
    return out


def result_float(f: Function, n: int) -> Value:
    """The float value that stands for op `n`'s result: its own, or for an integer kernel the
    dequantize of its result (then quantize's zero-point add, where there is one)."""
    v = (n, 0)
    if FORMATS[f.type_of(v).elem].is_float:
        return v
    users = f.uses(v)
    if len(users) != 1 or f.op(users[0][0]) != "mp.dequantize":
        return v
    v = (users[0][0], 0)
    users = f.uses(v)
    if len(users) == 1 and f.attrs_of(users[0][0]).get(QUANT_MARK) == ZERO_POINT:
        v = (users[0][0], 0)
    return v


def operand_sqnr(program: Program, inputs: list[np.ndarray],
                 traced: Trace | None = None) -> list[dict[str, Any]]:
    """Per converted op: weight / activation / own-output SQNR (module docstring), worst first."""
    f = program.function
    t = traced or trace(program, inputs)
    consts = constant_nodes(f)
    steps = {s.node: s for s in program.steps}
    rows = []
    for n in converted_ops(f):
        through = WEIGHT_QUANT in f.attrs_of(n)
        row: dict[str, Any] = {"name": f.value_name((n, 0)), "op": f.op(n),
                               "weight_sqnr_db": None, "activation_sqnr_db": None,
                               "activation_local_sqnr_db": None, "local_sqnr_db": None}
        origins = []
        for v in f.operands(n):
            origin = float_origin(f, v, through)
            origins.append(origin)
            y = real_value(f, v, t)
            if origin == v or y is None:
                continue
            if origin[0] in consts:
                row["weight_sqnr_db"] = _worst(row["weight_sqnr_db"],
                                               sqnr_db(y, t.refs[t.slots[v]]))
            else:
                row["activation_sqnr_db"] = _worst(row["activation_sqnr_db"],
                                                   sqnr_db(y, t.refs[t.slots[v]]))
                row["activation_local_sqnr_db"] = _worst(
                    row["activation_local_sqnr_db"],
                    sqnr_db(y, np.asarray(t.values[t.slots[origin]], np.float32)))
        # The op's own loss: its float result against the op in f32 on the very values its
        # operands were converted from, per output channel.
        lowered_origins = [t.values[t.slots[o]] for o in origins]
        out = t.values[t.slots[result_float(f, n)]]
        if all(x is not None and np.asarray(x).dtype.kind == "f" for x in lowered_origins) \
                and np.asarray(out).dtype.kind == "f":
            with np.errstate(all="ignore"):
                local = steps[n].reference([np.asarray(x, np.float32) for x in lowered_origins])
            axis = 1 if f.op(n) == "mp.conv2d" else -1
            row["local_sqnr_db"] = channel_sqnr_db(out, local, axis)
        attrs = f.attrs_of(n)
        if through:  # what quantize did to the weight, and what it left on its data
            row["weight_quant"] = attrs[WEIGHT_QUANT]
            if WEIGHT_ERROR in attrs:
                row["weight_rel_error"] = float(attrs[WEIGHT_ERROR])
        rows.append(row)
    rows.sort(key=local_severity)
    return rows


def _worst(a: float | None, b: float | None) -> float | None:
    vals = [x for x in (a, b) if x is not None]
    return min(vals) if vals else None


def local_severity(row: dict[str, Any]) -> float:
    """Sort key, worst first: the op's own loss (`local_sqnr_db`), else its weights' and its
    activations' own conversion, whichever is lower."""
    if row.get("local_sqnr_db") is not None:
        return row["local_sqnr_db"]
    vals = [row[k] for k in ("weight_sqnr_db", "activation_local_sqnr_db")
            if row.get(k) is not None]
    return min(vals) if vals else math.inf


def json_safe(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with non-finite figures as None (the run report's JSON convention)."""
    return [{k: (finite_or_none(v) if isinstance(v, float) else v) for k, v in r.items()}
            for r in rows]
