"""The executor: runs a lowered function with every number format emulated exactly.

A function is compiled once into a schedule (one step per op, in program order, with its
operand slots, checked attributes and the way it runs). Tensors are numpy arrays of values:
float formats narrower than f32 are held as the float32 values they represent (so fp32 BLAS
can consume them: products of two such values are exact in f32), integer formats as integers.
Each step computes in f32 and rounds its result to the result's element type, counting
overflow, underflow and NaN in the same pass (mplower.numerics.rounding); casts round;
quantize/dequantize follow ONNX (mplower.numerics.quant). Matmul and conv honour the
accumulator: f32 BLAS on exactly representable inputs for an f32 accumulator, the step-by-step
f16 accumulator of `matmul_f16_accum`, and exact integer accumulation for i8 x i8 -> i32.

The fp32 reference is the same schedule run with every cast and quantize/dequantize pair
removed and nothing rounded; `run` executes both side by side and keeps per-op statistics.
An op/format pair the backend has no kernel for (a sparse kernel, an f16-accumulated conv, an
integer plan that was never quantized) runs on the nearest wider path and is reported as a
fallback with its reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mplower.backend.weights import Weights
from mplower.ir.diagnostics import Diagnostic, DiagnosticError, Location
from mplower.ir.graph import ARG, RETURN, Function, Module
from mplower.ir.types import DenseAttr, TensorType, value_dtype
from mplower.numerics.formats import FORMATS
from mplower.numerics.quant import dequantize, quantize
from mplower.numerics.rounding import ROUNDING_FORMATS, Counts, matmul_f16_accum, round_to
from mplower.ops import OPS, OpError, attr_array, attr_type, check_attrs

NO_COUNTS = Counts()
# Largest contraction length for which i8 x i8 sums stay exact in float32 (|a*b| <= 2^14,
# so K * 2^14 <= 2^24); longer ones accumulate in float64, exact to 2^53.
_EXACT_F32_K = 1 << 10


@dataclass
class Step:
    node: int
    name: str  # the result's SSA name, e.g. "%3"
    op: str
    inputs: list[int]  # slot of each operand
    output: int  # slot of the (single) result
    run: Callable[[list[np.ndarray]], tuple[np.ndarray, Counts]]
    reference: Callable[[list[np.ndarray]], np.ndarray]
    requested: dict[str, str]
    executed: dict[str, str]
    reason: str | None  # why executed differs from requested
    flops: int
    out_type: TensorType


@dataclass
class OpResult:
    step: Step
    counts: Counts
    rel_l2: float | None = None
    sqnr_db: float | None = None
    max_abs: float | None = None


@dataclass
class RunResult:
    outputs: list[np.ndarray]
    reference: list[np.ndarray] | None
    ops: list[OpResult] = field(default_factory=list)


def _rounded(x: np.ndarray, elem: str, saturate: bool = False) -> tuple[np.ndarray, Counts]:
    """Values rounded to `elem` (a float format), with counts; integers pass through."""
    if elem in ROUNDING_FORMATS:
        if x.dtype != np.float32:
            x = x.astype(np.float32)
        return round_to(np.ascontiguousarray(x), elem, saturate)
    if elem == "f64":
        return x.astype(np.float64), NO_COUNTS
    return x.astype(value_dtype(elem)), NO_COUNTS


def _f32(x: np.ndarray) -> np.ndarray:
    return x if x.dtype == np.float32 else x.astype(np.float32)


def _wide(t: TensorType) -> TensorType:
    return t.with_elem("f32") if FORMATS[t.elem].is_float and t.elem != "f64" else t


def _stats_of(d: dict) -> tuple[str | None, str | None, str]:
    attrs = d["attrs"]
    precision = attr_type(attrs["mp.precision"]) if "mp.precision" in attrs else None
    accum = attr_type(attrs["mp.accum"]) if "mp.accum" in attrs else None
    return precision, accum, attrs.get("mp.kernel", "dense")


class Program:
    """A function compiled for execution; `run` may be called any number of times."""

    def __init__(self, module: Module, func: str | None = None, weights: str | None = None):
        if any("mp.precision" in module.function(func).attrs_of(n)
               for n in module.function(func).ops()):
            # A plan that was never materialized: insert-casts is idempotent, so always run it.
            from mplower.pass_manager import PassContext, load_passes

            load_passes()["insert-casts"]().run(module, PassContext())
        self.module = module
        self.function: Function = module.function(func)
        self.weights = Weights(module, weights)
        f = self.function
        self.arg_names = [f.data(a)["name"] for a in f.args]
        self.arg_types = [f.types(a)[0] for a in f.args]
        slot: dict[tuple[int, int], int] = {}
        for i, a in enumerate(f.args):
            slot[(a, 0)] = i
        self.steps: list[Step] = []
        self.constants: dict[int, tuple[np.ndarray, Counts, np.ndarray]] = {}
        for n in f.ops():
            d = f.data(n)
            if d["op"] == RETURN:
                self.outputs = [slot[v] for v in f.operands(n)]
                continue
            if len(d["types"]) != 1:
                raise DiagnosticError.at(d["loc"], f"'{d['op']}' with several results cannot "
                                                   f"be executed")
            out = len(slot)
            slot[(n, 0)] = out
            self.steps.append(self._compile(f, n, [slot[v] for v in f.operands(n)], out))
        self.num_slots = len(slot)

    # ---- compiling one op ------------------------------------------------------------------
    def _compile(self, f: Function, n: int, inputs: list[int], out: int) -> Step:
        d = f.data(n)
        op, loc = d["op"], d["loc"]
        opdef = OPS.get(op)
        if opdef is None or op == ARG:
            raise DiagnosticError.at(loc, f"cannot execute unknown operation '{op}'")
        attrs = check_attrs(opdef, d["attrs"])
        in_types = f.operand_types(n)
        out_t = d["types"][0]
        precision, accum, kernel = _stats_of(d)
        float_ins = [t.elem for t in in_types if FORMATS[t.elem].is_float]
        ran_in = float_ins[0] if float_ins else out_t.elem
        requested = {"precision": precision or ran_in, "accum": accum, "kernel": kernel}
        if "mp.requested" in d["attrs"]:  # legalize's fallback: report what the policy asked
            text = d["attrs"]["mp.requested"]
            fmt, _, knl = text.partition(" ")
            prec, _, acc = fmt.partition("/")
            requested = {"precision": prec, "accum": acc or None, "kernel": knl or "dense"}
        executed = {"precision": ran_in, "accum": accum, "kernel": "dense"}
        reasons = []
        if "mp.fallback" in d["attrs"]:
            reasons.append(d["attrs"]["mp.fallback"])
        if kernel != "dense":
            reasons.append("no-sparse-kernel")  # the CPU backend runs structured sparsity densely
        if precision is not None and precision != ran_in and FORMATS[precision].is_int \
                and op in ("mp.matmul", "mp.conv2d") and not FORMATS[ran_in].is_int:
            reasons.append("not-quantized")  # an i8 plan needs calibrate + quantize first
        flops = int(opdef.flops(in_types, d["types"], attrs))
        wide_rt = [_wide(out_t)]

        def reference(xs: list[np.ndarray], _ref=opdef.reference, _a=attrs) -> np.ndarray:
            return _ref([_f32(x) if x.dtype.kind == "f" else x for x in xs], _a, wide_rt)[0]

        runner: Callable[[list[np.ndarray]], tuple[np.ndarray, Counts]]
        if op == "mp.constant":
            lowered, counts, ref = self._constant(d, attrs, out_t, loc)
            self.constants[n] = (lowered, counts, ref)
            runner = lambda xs, _v=lowered: (_v, NO_COUNTS)  # noqa: E731
            reference = lambda xs, _r=ref: _r  # noqa: E731
        elif op == "mp.cast":
            runner = self._cast(out_t, attrs, in_types[0])
            if FORMATS[in_types[0].elem].is_float and FORMATS[out_t.elem].is_float:
                reference = lambda xs: xs[0]  # noqa: E731  (the f32 plan has no casts)
        elif op in ("mp.quantize", "mp.dequantize", "mp.fake_quant"):
            runner = self._quant(op, attrs, in_types[0], out_t)
            reference = lambda xs: _f32(xs[0]) if xs[0].dtype.kind == "f" else xs[0]  # noqa: E731
            if op == "mp.dequantize":
                reference = lambda xs: xs[0].astype(np.float32)  # noqa: E731
        elif op == "mp.matmul":
            if accum == "f16" and not all(len(t.shape) == 2 for t in in_types):
                reasons.append("no-f16-accum-batched")
                executed["accum"] = "f32"
            runner = self._matmul(out_t, in_types, executed["accum"] or "f32")
        elif op == "mp.conv2d":
            if accum == "f16":
                reasons.append("no-f16-accum-conv")
                executed["accum"] = "f32"
            runner = self._generic(opdef.reference, attrs, out_t)
        else:
            runner = self._generic(opdef.reference, attrs, out_t)
        reason = ",".join(dict.fromkeys(reasons)) or None
        return Step(n, f.value_name((n, 0)), op, inputs, out, runner, reference, requested,
                    executed, reason, flops, out_t)

    def _constant(self, d: dict, attrs: dict, t: TensorType,
                  loc: Location) -> tuple[np.ndarray, Counts, np.ndarray]:
        if "value" in attrs and isinstance(attrs["value"], DenseAttr):
            raw = attrs["value"].array
        elif "name" in attrs:
            raw = self.weights.get(attrs["name"], t.shape, loc)
        else:
            raise DiagnosticError.at(loc, "mp.constant needs a 'value' or a 'name'")
        ref = raw.astype(np.float32) if FORMATS[t.elem].is_float and t.elem != "f64" else raw
        lowered, counts = _rounded(np.ascontiguousarray(raw), t.elem)
        return lowered, counts, ref

    def _cast(self, out_t: TensorType, attrs: dict, in_t: TensorType):
        elem = out_t.elem
        saturate = bool(attrs.get("saturate", True)) and elem.startswith("f8")
        if FORMATS[elem].is_float:
            return lambda xs: _rounded(xs[0], elem, saturate)
        from mplower.ops import OPS as _OPS

        ref = _OPS["mp.cast"].reference
        return lambda xs: (ref([xs[0]], attrs, [out_t])[0], NO_COUNTS)

    def _quant(self, op: str, attrs: dict, in_t: TensorType, out_t: TensorType):
        scale = attr_array(attrs["scale"]).astype(np.float32)
        zp = attr_array(attrs.get("zero_point", 0))
        axis = attrs.get("axis") if scale.size > 1 else None
        if op == "mp.quantize":
            elem = out_t.elem
            return lambda xs: quantize(_f32(xs[0]), scale, zp, elem, axis)
        if op == "mp.dequantize":
            storage = FORMATS[in_t.elem].storage
            return lambda xs: (dequantize(xs[0].astype(storage), scale, zp, axis), NO_COUNTS)
        qelem = attr_type(attrs["dtype"])

        def fake(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts]:
            q, counts = quantize(_f32(xs[0]), scale, zp, qelem, axis)
            return dequantize(q, scale, zp, axis), counts
        return fake

    def _generic(self, reference, attrs: dict, out_t: TensorType):
        rt = [out_t]
        elem = out_t.elem

        def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts]:
            y = reference([_f32(x) if x.dtype.kind == "f" and x.dtype != np.float64 else x
                           for x in xs], attrs, rt)[0]
            return _rounded(np.asarray(y), elem)
        return run

    def _matmul(self, out_t: TensorType, in_types: list[TensorType], accum: str):
        elem = out_t.elem
        a_t, b_t = in_types
        if FORMATS[a_t.elem].is_int and FORMATS[b_t.elem].is_int:
            k = a_t.shape[-1]
            work = np.float32 if k <= _EXACT_F32_K else np.float64

            def run_int(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts]:
                y = np.matmul(xs[0].astype(work), xs[1].astype(work))
                return y.astype(value_dtype(elem)), NO_COUNTS
            return run_int
        if accum == "f16":
            def run_f16(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts]:
                return _rounded(matmul_f16_accum(_f32(xs[0]), _f32(xs[1])), elem)
            return run_f16

        def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts]:
            return _rounded(np.matmul(_f32(xs[0]), _f32(xs[1])), elem)
        return run

    # ---- running -------------------------------------------------------------------------
    def prepare_inputs(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Arguments in their declared formats (rounded when the signature is narrow)."""
        out = []
        for name, t, arr in zip(self.arg_names, self.arg_types, arrays):
            if tuple(arr.shape) != t.shape:
                raise DiagnosticError(Diagnostic(self.function.loc, (
                    f"input '{name}' has shape {list(arr.shape)} but the function takes "
                    f"{list(t.shape)}")))
            out.append(_rounded(np.asarray(arr), t.elem)[0])
        return out

    def run(self, inputs: list[np.ndarray], reference: bool = True) -> RunResult:
        values: list[Any] = [None] * self.num_slots
        refs: list[Any] = [None] * self.num_slots if reference else []
        for i, x in enumerate(self.prepare_inputs(inputs)):
            values[i] = x
            if reference:
                refs[i] = _f32(np.asarray(inputs[i])) if FORMATS[self.arg_types[i].elem].is_float \
                    else np.asarray(inputs[i])
        results = []
        for step in self.steps:
            xs = [values[i] for i in step.inputs]
            try:
                y, counts = step.run(xs)
            except (OpError, ValueError, TypeError) as e:
                raise DiagnosticError.at(self.function.data(step.node)["loc"],
                                         f"'{step.op}' failed to execute: {e}") from None
            if step.op == "mp.constant":
                counts = self.constants[step.node][1]
            values[step.output] = y
            res = OpResult(step, counts)
            if reference:
                ref = step.reference([refs[i] for i in step.inputs])
                refs[step.output] = ref
                _drift(res, y, ref)
            results.append(res)
        outs = [values[i] for i in self.outputs]
        return RunResult(outs, [refs[i] for i in self.outputs] if reference else None, results)

    def run_lowered(self, prepared: list[np.ndarray]) -> list[np.ndarray]:
        """The lowered plan only, on inputs from `prepare_inputs` (what `mplower bench` times)."""
        values: list[Any] = [None] * self.num_slots
        values[:len(prepared)] = prepared
        for step in self.steps:
            values[step.output] = step.run([values[i] for i in step.inputs])[0]
        return [values[i] for i in self.outputs]


def _drift(res: OpResult, y: np.ndarray, ref: np.ndarray) -> None:
    """rel_l2 = ||y - ref|| / ||ref|| and SQNR against the fp32 reference (inf: not finite)."""
    if y.dtype.kind != "f" or ref.dtype.kind != "f" or y.shape != ref.shape:
        return
    r = ref.astype(np.float64)
    diff = y.astype(np.float64) - r
    if not np.all(np.isfinite(diff)):
        res.rel_l2 = res.max_abs = float("inf")
        res.sqnr_db = float("-inf")
        return
    signal = float(np.sum(r * r))
    noise = float(np.sum(diff * diff))
    res.rel_l2 = float(np.sqrt(noise / signal)) if signal > 0 else (0.0 if noise == 0
                                                                    else float("inf"))
    res.sqnr_db = float(10 * np.log10(signal / noise)) if noise > 0 else float("inf")
    res.max_abs = float(np.max(np.abs(diff))) if diff.size else 0.0


def compile_module(module: Module, func: str | None = None,
                   weights: str | None = None) -> Program:
    return Program(module, func, weights)
