"""The executor: runs a lowered function with every number format emulated exactly.

A function is compiled once into a schedule (one step per op, in program order, with its
operand slots, checked attributes and the kernel it runs). Tensors are numpy arrays of values:
float formats narrower than f32 are held as the float32 values they represent (so an f32 matmul
can consume them: the product of two such values is exact in f32), integer formats as integers.
Each step computes in f32 and rounds its result to the result's element type, counting
overflow, underflow and NaN in the same pass (mplower.numerics.rounding); casts round;
quantize/dequantize follow ONNX (mplower.numerics.quant). Matmul and conv honour the
accumulator: mplower's fixed-order f32 product (mplower.numerics.gemm, never the BLAS
library's order, so results are the same on every machine, thread count and batch grouping) for
an f32 accumulator, the step-by-step fp16 accumulator of `matmul_f16_accum`, and exact integer
sums for i8 x i8 -> i32.

The fp32 reference is the same schedule with every cast and quantize/dequantize removed and
nothing rounded; `run` executes both side by side and keeps per-op statistics, `run_lowered`
only the lowered plan (what `mplower bench` times), with its constant-only ops run once and
fusions that give the same bits as the separate ops (which `run` keeps for its statistics): a
conv's dequantize, bias add, relu and rounding run as the conv stores each output, a residual
add and its relu in one pass, a channel shuffle read in place by its depthwise conv, convs
written into their concatenation, an integer quantize -> dequantize pair in one pass, and a
scaled_quant's amax taken by the conv or add that computed its operand. An op/format pair the
backend has no kernel for runs on the nearest wider path and is reported as a fallback with its
reason code: a sparse kernel (`no-sparse-kernel`: run densely), an integer plan that was never
quantized (`not-quantized`: its float operands run in their own format), an fp16 accumulator
over operands whose products do not fit it exactly (`no-f16-accum`: f32). Legalize's fallbacks
(`mp.fallback`, `mp.requested`) are reported as the pass recorded them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np

from mplower.backend.memory import keep_freed_memory
from mplower.backend.scaled import ScaleStats, limited_accum_matmul, scaled_quant_kernel
from mplower.backend.sparse import sparse_runner
from mplower.dialect.fused import PLAIN_FLOATS, RELU_BEFORE_ROUNDING
from mplower.dialect.mp import CONTRACTIONS, CONVERSIONS, VALUE_PRESERVING
from mplower.dialect.plan import DENSE, Plan, Requested
from mplower.io.weights import Weights
from mplower.ir.diagnostics import Diagnostic, DiagnosticError, Location
from mplower.ir.graph import ARG, RETURN, Function, Module, Value
from mplower.ir.opdef import OPS, OpDef, OpError, attr_array, attr_int, attr_type, check_attrs
from mplower.ir.types import DenseAttr, TensorType, value_dtype
from mplower.lowering.materialized import check_materialized
from mplower.lowering.scaling import ACCUM_BITS, PROMOTE_EVERY
from mplower.lowering.target import NO_F16_ACCUM, NO_SPARSE_KERNEL
from mplower.numerics.conv import IntegerWeights
from mplower.numerics.elementwise import add_relu, binary_rounded, round_add_columns
from mplower.numerics.formats import FORMATS
from mplower.numerics.gemm import TILE_ROWS, PackedMatrix, matmul
from mplower.numerics.metrics import drift
from mplower.numerics.quant import dequantize, fake_quantizer, quantize, quantizer
from mplower.numerics.rounding import (
    ROUNDING_FORMATS,
    Counts,
    decode,
    matmul_f16_accum,
    round_to,
)
from mplower.numerics.windows import conv_windows, pad_hw

NOT_QUANTIZED = "not-quantized"
NO_COUNTS = Counts()
# An integer sum stays exact in a float accumulator while every partial sum is below 2^(p+1)
# for a p-bit mantissa: f32 BLAS takes i8 x i8 up to K = 2^24 / 2^14 = 1024, f64 up to 2^39.
_F32_EXACT = 2.0 ** 24
# The fp16 accumulator adds each product to an f16 value in float64 (matmul_f16_accum). Near an
# f16 tie that sum must be exact: the product's bits reach 11 + (its significant bits) below
# the accumulator's leading bit, within f64's 53 for operands of up to 15 significant bits
# (f16, bf16, tf32, fp8: products of up to 30 bits), not for f32 operands (48-bit products).
_F16_ACCUM_MAX_BITS = 15
# What an op runs on when it returns a result together with what rounding it did (None: the
# result passed through unrounded; `run` counts its NaNs, `run_lowered` does not need to).
Kernel = Callable[[list[np.ndarray]], tuple[np.ndarray, Counts | None]]


@dataclass
class Step:
    node: int
    name: str  # the result's SSA name, e.g. "%3"
    op: str
    inputs: list[int]  # slot of each operand
    output: int  # slot of its result (an op with several results has a step per result)
    run: Kernel
    reference: Callable[[list[np.ndarray]], np.ndarray | None]
    requested: dict[str, str | None]
    executed: dict[str, str | None]
    reason: str | None  # why executed differs from requested (reason codes joined by ",")
    flops: int
    out_type: TensorType
    loc: Location
    constant: np.ndarray | None = None  # the lowered value of an mp.constant, rounded once
    constant_counts: Counts = NO_COUNTS
    scale_stats: list[ScaleStats] | None = None  # mp.scaled_quant: its last step's account
    attrs: dict = field(default_factory=dict)  # checked attributes
    in_types: list[TensorType] = field(default_factory=list)
    # A depthwise conv's input channel c is channel channels[c] of its operand (run_lowered's
    # shuffle fusion, _fuse_shuffles).
    channels: np.ndarray | None = None
    # A conv's fused epilogue (scale, bias, relu, rounded format), as _fuse_epilogues built it.
    epilogue: tuple | None = None
    # A conv writing its channels of a concatenation (_fuse_concats): (channel0, shape, first,
    # last).
    concat: tuple | None = None
    # This step's kernel, built to also leave the amax of its result in a box (_fuse_amax).
    amax_kernel: Callable[[Any], Kernel] | None = None


@dataclass
class OpResult:
    step: Step
    counts: Counts
    rel_l2: float | None = None
    sqnr_db: float | None = None
    max_abs: float | None = None
    nonfinite_mismatch: int | None = None  # see `drift`; None where there is no drift
    scale: ScaleStats | None = None  # mp.scaled_quant: recipe, amax, scale, saturation


@dataclass
class RunResult:
    outputs: list[np.ndarray]
    # The fp32 reference's outputs (None without a reference run; an entry is None where the
    # lowered graph has no fp32 counterpart, see `_reference`).
    reference: list[np.ndarray | None] | None
    ops: list[OpResult] = field(default_factory=list)
    # Every value of the run by slot (Program.slots maps a Value to its slot): the lowered
    # plan's, and the fp32 reference's (None where there is none), for per-tensor analyses.
    values: list[Any] = field(default_factory=list)
    refs: list[Any] = field(default_factory=list)


def _f32(x: np.ndarray) -> np.ndarray:
    return x if x.dtype == np.float32 else x.astype(np.float32)


def _finish(y: np.ndarray, elem: str, saturate: bool = False) -> tuple[np.ndarray, Counts | None]:
    """A computed result in the values of `elem`: rounded (with counts) or converted."""
    if elem in ROUNDING_FORMATS and elem != "f32":
        # np.ascontiguousarray makes a 0-d array 1-d: the rounded scalar gets its shape back.
        rounded, counts = round_to(np.ascontiguousarray(_f32(y)), elem, saturate)
        return rounded.reshape(np.shape(y)), counts
    if FORMATS[elem].is_float:
        with np.errstate(over="ignore"):  # float64 beyond float32's range is inf, as IEEE
            return y.astype(value_dtype(elem), copy=False), None
    return y.astype(value_dtype(elem), copy=False), NO_COUNTS


def _nan_counts(y: np.ndarray) -> Counts:
    return Counts(nan=int(np.count_nonzero(np.isnan(y)))) if y.dtype.kind == "f" else NO_COUNTS


def _wide(t: TensorType) -> TensorType:
    return t.with_elem("f32") if FORMATS[t.elem].is_float and t.elem != "f64" else t


def _significant_bits(elem: str) -> int:
    f = FORMATS[elem]
    return f.man_bits + 1 if f.is_float else f.bits


def _magnitude(elem: str) -> float:
    """The largest |value| of an integer format (128 for i8)."""
    f = FORMATS[elem]
    return max(abs(f.min_value), f.max_finite)


class Program:
    """A function compiled for execution; `run` may be called any number of times.

    The module is compiled as it is and never changed. One whose plan is still only
    annotations (assign-precision without insert-casts) is an error: materialize it first
    (mplower.passes.insert_casts.materialize, as `mplower run` does). `reference_only` compiles
    for `run_reference` alone, which ignores the plan, so it takes such a module as well.
    """

    def __init__(self, module: Module, func: str | None = None, weights: str | None = None,
                 *, reference_only: bool = False):
        try:
            f = module.function(func)
        except KeyError:
            have = ", ".join(f"@{n}" for n in module.functions) or "none"
            what = f"no function @{func}" if func else "several functions and none is @main"
            raise DiagnosticError.at(module.loc, f"the module has {what} (it has: {have}); "
                                                 f"pick one with --func") from None
        if not reference_only:
            check_materialized(f)
        self.module = module
        self.function: Function = f
        self.weights = Weights(module, weights)
        self.arg_names = [f.data(a)["name"] for a in f.args]
        self.arg_types = [f.types(a)[0] for a in f.args]
        self.arg_locs = [f.data(a)["loc"] for a in f.args]
        slot: dict[tuple[int, int], int] = {(a, 0): i for i, a in enumerate(f.args)}
        self.steps: list[Step] = []
        self.outputs: list[int] = []
        for n in f.ops():
            d = f.data(n)
            if d["op"] == RETURN:
                self.outputs = [slot[v] for v in f.operands(n)]
                continue
            inputs = [slot[v] for v in f.operands(n)]
            # An op with several results (mp.split) runs as one step per result, so every
            # value has its own slot, counts and drift, and the report a row per result.
            for k in range(len(d["types"])):
                slot[(n, k)] = len(slot)
                self.steps.append(self._compile(f, n, inputs, slot[(n, k)], k))
        self.num_slots = len(slot)
        self.slots: dict[tuple[int, int], int] = slot  # value -> slot, for RunResult.values
        self._runtime = [s for s in self.steps if s.constant is None]
        self._folded: list[Any] | None = None  # run_lowered's constants, folded on first use
        self._ref_constants: dict[int, Any] | None = None  # run_reference's, likewise
        self._live: list[Step] = []
        self._initial: list[Any] = [None] * self.num_slots
        for s in self.steps:
            if s.constant is not None:
                self._initial[s.output] = s.constant

    # ---- compiling one op ------------------------------------------------------------------
    def _compile(self, f: Function, n: int, inputs: list[int], out: int, k: int = 0) -> Step:
        d = f.data(n)
        op, loc = d["op"], d["loc"]
        opdef = OPS.get(op)
        if opdef is None or op == ARG:
            raise DiagnosticError.at(loc, f"cannot execute unknown operation '{op}'")
        in_types = f.operand_types(n)
        out_t = d["types"][k]
        try:
            attrs = check_attrs(opdef, d["attrs"])
            plan = _Plan(op, d["attrs"], in_types, out_t)
        except OpError as e:  # e.g. `mp.precision = "x"`, which the verifier leaves alone
            raise DiagnosticError.at(loc, f"'{op}': {e.message}") from None
        # An op's FLOPs go to its first result's step, so that per-step sums count them once.
        flops = int(opdef.flops(in_types, d["types"], attrs)) if k == 0 else 0
        reference = _reference(opdef.reference, attrs, op, d["types"], k)
        constant, constant_counts, scale_stats, amax_kernel = None, NO_COUNTS, None, None
        run: Kernel
        if op == "mp.constant":
            constant, constant_counts, ref = self._constant(attrs, out_t, loc)
            run = lambda xs, _v=constant: (_v, NO_COUNTS)
            reference = lambda xs, _r=ref: _r
        elif op == "mp.cast":
            run = _cast_kernel(out_t, attrs, opdef.reference)
            if FORMATS[in_types[0].elem].is_float and FORMATS[out_t.elem].is_float:
                reference = lambda xs: xs[0]  # the f32 plan has no casts
        elif op in ("mp.quantize", "mp.fake_quant"):
            run = _quant_kernel(op, attrs, in_types[0], out_t)
            reference = lambda xs: _f32(xs[0]) if xs[0].dtype.kind == "f" else xs[0]
        elif op == "mp.dequantize":
            # Removed in the reference, where the value it dequantizes is still a float; an
            # integer that never was one (an i8 constant or argument) is dequantized for real.
            run = _quant_kernel(op, attrs, in_types[0], out_t)
            reference = lambda xs, _q=run: xs[0] if xs[0].dtype.kind == "f" else _q(xs)[0]
        elif op == "mp.scaled_quant":
            run, scale_stats = scaled_quant_kernel(attrs, out_t)
            reference = lambda xs: _f32(xs[0])  # the f32 plan has no scaling
        elif op == "mp.matmul" and d["attrs"].get(ACCUM_BITS):
            gemm = limited_accum_matmul(attr_int(d["attrs"][ACCUM_BITS]),
                                        attr_int(d["attrs"].get(PROMOTE_EVERY, 128)))
            run = lambda xs, _g=gemm, _e=out_t.elem: _finish(_g(_f32(xs[0]), _f32(xs[1])), _e)
        elif op == "mp.matmul":
            run = _matmul_kernel(plan, in_types, out_t)
        elif op == "mp.fused_matmul":
            run = _fused_matmul_kernel(opdef, attrs, in_types, out_t)
        elif op == "mp.add_relu" and (rounded := _add_relu_rounding(in_types, out_t)):
            run = _add_relu_kernel(rounded[0])
            amax_kernel = partial(_add_relu_kernel, rounded[0])
        elif op == "mp.conv2d" and plan.executed["accum"] == "f16":
            run = _conv_f16_kernel(attrs, out_t)
        else:
            exact = op in VALUE_PRESERVING and all(
                t.elem == out_t.elem for t in in_types if FORMATS[t.elem].is_float)
            run = _generic_kernel(opdef, attrs, d["types"], k, exact)
        return Step(n, f.value_name((n, k)), op, inputs, out, run, reference, plan.requested,
                    plan.executed, plan.reason, flops, out_t, loc, constant, constant_counts,
                    scale_stats, attrs, in_types, amax_kernel=amax_kernel)

    def _constant(self, attrs: dict, t: TensorType,
                  loc: Location) -> tuple[np.ndarray, Counts, np.ndarray]:
        if isinstance(attrs.get("value"), DenseAttr):
            raw = attrs["value"].array
        elif "name" in attrs:
            raw = self.weights.get(attrs["name"], t, loc)
        else:
            raise DiagnosticError.at(loc, "mp.constant needs a 'value' or a 'name'")
        is_float = FORMATS[t.elem].is_float
        with np.errstate(over="ignore"):  # beyond float32's range is inf: the report lists it
            ref = raw.astype(np.float32) if is_float and t.elem != "f64" else raw
        # ascontiguousarray makes a 0-d array 1-d: a scalar constant keeps its shape.
        lowered, counts = _finish(np.ascontiguousarray(raw).reshape(t.shape), t.elem)
        return lowered, counts if counts is not None else _nan_counts(lowered), ref

    # ---- running -------------------------------------------------------------------------
    def prepare_inputs(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Arguments in their declared formats (rounded when the signature is narrow).

        NaN and ±inf that the caller wrote are kept (an attention mask holds -inf); a finite
        value that the argument's type cannot hold, and would turn into inf or NaN, is an
        error at the argument: that is checked after the cast, in the declared format.
        """
        out = []
        for name, t, arr, loc in zip(self.arg_names, self.arg_types, arrays, self.arg_locs,
                                     strict=True):
            arr = np.asarray(arr)
            if tuple(arr.shape) != t.shape:
                raise DiagnosticError(Diagnostic(self.function.loc, (
                    f"input '{name}' has shape {list(arr.shape)} but the function takes "
                    f"{list(t.shape)}")))
            with np.errstate(all="ignore"):  # the overflow is what is checked below
                x = _finish(arr, t.elem)[0]
            if arr.dtype.kind == "f" and x.dtype.kind == "f":
                lost = np.isfinite(arr) & ~np.isfinite(x)
                if (bad := int(np.count_nonzero(lost))):
                    raise DiagnosticError.at(loc, (
                        f"input '{name}' has {bad} finite value{'s' * (bad != 1)} that {t.elem} "
                        f"cannot hold (largest magnitude {np.max(np.abs(arr[lost])):g}, "
                        f"{t.elem} ends at {FORMATS[t.elem].max_finite:g}); they would become "
                        f"inf or NaN"))
            out.append(x)
        return out

    def run(self, inputs: list[np.ndarray], reference: bool = True) -> RunResult:
        """The lowered plan and (with `reference`) the fp32 reference, with per-op statistics."""
        values = list(self._initial)
        refs: list[Any] = [None] * self.num_slots
        for i, x in enumerate(self.prepare_inputs(inputs)):
            values[i] = x
            raw = np.asarray(inputs[i])
            refs[i] = _f32(raw) if FORMATS[self.arg_types[i].elem].is_float else raw
        results = []
        for step in self.steps:
            if step.constant is not None:
                y, counts = step.constant, step.constant_counts
            else:
                y, counts = self._execute(step, values)
                values[step.output] = y
            res = OpResult(step, counts if counts is not None else _nan_counts(y),
                           scale=step.scale_stats[0] if step.scale_stats else None)
            if reference:
                ref_in = [refs[i] for i in step.inputs]
                ref = None
                if all(r is not None for r in ref_in):  # None: no fp32 counterpart upstream
                    with np.errstate(all="ignore"):
                        ref = step.reference(ref_in)
                    if step.op != "mp.quantize":  # its values are x / scale, its reference x
                        _drift(res, y, ref)
                refs[step.output] = ref
            results.append(res)
        outs = [values[i] for i in self.outputs]
        return RunResult(outs, [refs[i] for i in self.outputs] if reference else None, results,
                         values, refs)

    def run_reference(self, inputs: list[np.ndarray],
                      observe: Callable[[int, Any], None] | None = None) -> list[Any]:
        """Every slot's value in the fp32 reference alone (what calibration observes). With
        `observe`, each slot's value goes to observe(slot, value) once computed and is dropped
        after its last use, so that only the live values are held (calibration on many
        samples at once); the slots returned are then empty. Ops whose operands are all
        constants (a weight's transpose or quantize) run on the first call only, as in
        run_lowered."""
        keep_freed_memory()
        if self._ref_constants is None:
            self._ref_constants = {}
            with np.errstate(all="ignore"):
                for step in self.steps:
                    if all(i in self._ref_constants for i in step.inputs):
                        ins = [self._ref_constants[i] for i in step.inputs]
                        self._ref_constants[step.output] = step.reference(ins) \
                            if all(r is not None for r in ins) else None
        constants = self._ref_constants
        refs: list[Any] = [None] * self.num_slots
        for i, (x, t) in enumerate(zip(inputs, self.arg_types)):
            x = np.asarray(x)
            refs[i] = _f32(x) if FORMATS[t.elem].is_float else x
            if observe is not None:
                observe(i, refs[i])
        last = {i: k for k, step in enumerate(self.steps) for i in step.inputs} if observe \
            else {}
        with np.errstate(all="ignore"):
            for k, step in enumerate(self.steps):
                if step.output in constants:
                    refs[step.output] = constants[step.output]
                else:
                    ins = [refs[i] for i in step.inputs]
                    refs[step.output] = step.reference(ins) \
                        if all(r is not None for r in ins) else None
                if observe is not None:
                    observe(step.output, refs[step.output])
                    for i in {*step.inputs, step.output}:
                        if last.get(i, -1) <= k:
                            refs[i] = None
        return refs

    def run_lowered(self, prepared: list[np.ndarray]) -> list[np.ndarray]:
        """The lowered plan only, on inputs from `prepare_inputs` (what `mplower bench` times).

        Ops whose operands are all constants (a weight's quantize, a bias reshape) give the
        same value every run: they run once, on the first call, as a deployed plan holds its
        quantized weights; the kernels are deterministic, so the results are the same bits.
        A conv's dequantize, bias add and relu run as the conv stores each output
        (`_fuse_epilogues`), with the bits the separate ops give; the fused ops of the `fuse`
        pass (mp.add_relu, mp.fused_matmul) run as the module has them."""
        keep_freed_memory()
        if self._folded is None:
            folded, live = list(self._initial), []
            known = {s.output for s in self.steps if s.constant is not None}
            for step in self._runtime:
                if step.inputs and all(i in known for i in step.inputs):
                    self._run_steps([step], folded)
                    known.add(step.output)
                else:
                    live.append(step)
            self._folded = folded
            constants = {i: folded[i] for i in known}
            fused = _round_matmuls_in_place(_fuse_epilogues(live, constants, self.outputs))
            fused = _fuse_concats(_fuse_shuffles(fused, self.outputs), self.outputs)
            fused = _fuse_amax(_fuse_fake_quants(fused, self.outputs), self.outputs)
            fused = _fuse_quantized_outputs(fused, self.outputs)
            fused = _fuse_rounded_binaries(fused, constants, self.outputs)
            self._live = _pack_weights(fused, constants)
        values = list(self._folded)
        values[:len(prepared)] = prepared
        self._run_steps(self._live, values)
        return [values[i] for i in self.outputs]

    def _run_steps(self, steps: list[Step], values: list[Any]) -> None:
        try:
            with np.errstate(all="ignore"):  # inf and NaN are results here, not warnings
                for step in steps:
                    values[step.output] = step.run([values[i] for i in step.inputs])[0]
        except (OpError, ValueError, TypeError) as e:
            raise _failed(step, e) from None

    def _execute(self, step: Step, values: list[Any]) -> tuple[np.ndarray, Counts | None]:
        try:
            with np.errstate(all="ignore"):  # inf and NaN are results here, counted, not raised
                return step.run([values[i] for i in step.inputs])
        except (OpError, ValueError, TypeError) as e:
            raise _failed(step, e) from None


# ---- packed weights (run_lowered) ----------------------------------------------------------
# A matmul whose b is a constant matrix (a weight) reads it converted to the product's working
# precision and packed into panels (mplower.numerics.gemm.PackedMatrix), made once here: on
# every call that was a pass over b, and for an integer weight a float copy too.

# An integer conv's constant weight likewise: its magnitude bound and float32 copy, which the
# implicit GEMM reads (IntegerWeights), are made once.

def _pack_weights(steps: list[Step], constants: dict[int, Any]) -> list[Step]:
    out = []
    for s in steps:
        w = constants.get(s.inputs[1]) if len(s.inputs) >= 2 else None
        dtype = getattr(s.run, "weight_dtype", None)
        if (s.op == "mp.matmul" and len(s.inputs) == 2 or s.op == "mp.fused_matmul") \
                and dtype is not None and isinstance(w, np.ndarray) and w.ndim == 2:
            s = replace(s, run=partial(_with_weight, s.run, PackedMatrix(w, dtype)))
        elif s.op == "mp.conv2d" and getattr(s.run, "integer_weights", False) \
                and isinstance(w, np.ndarray) and w.ndim == 4 and w.dtype.kind in "iu":
            s = replace(s, run=partial(_with_weight, s.run, IntegerWeights(w)))
        out.append(s)
    return out


def _with_weight(run: Kernel, weight: PackedMatrix | IntegerWeights,
                 xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
    return run([xs[0], weight, *xs[2:]])


# ---- epilogue fusion (run_lowered) ---------------------------------------------------------
# A conv is followed, in a network, by ops that touch each output once: the dequantize of an
# integer conv, the add of a per-channel bias, a relu. run_lowered runs them as the GEMM stores
# each output (mplower.numerics.conv's epilogue), which computes each with the float32
# operation the op's kernel uses, so the bits are the same and two to four passes over memory
# (and their Python calls) are saved. Only where the intermediate values are used by nothing
# else, and every value in the chain is f32 except the conv's exact i32 sum.

# |sum| below 2^31: the exact sum is the int32 that dequantize would read.
_I32_LIMIT = 2 ** 31


def _only_user_of(steps: list[Step], outputs: list[int]):
    """only_user(s, op): the one step that reads s's result, if it is an `op` that reads it
    once and the result is not a function output; else None."""
    uses: dict[int, list[Step]] = {}
    for s in steps:
        for i in s.inputs:
            uses.setdefault(i, []).append(s)
    kept = set(outputs)

    def only_user(s: Step, op: str) -> Step | None:
        users = uses.get(s.output, [])
        if len(users) == 1 and users[0].op == op and s.output not in kept \
                and users[0].inputs.count(s.output) == 1:
            return users[0]
        return None
    return only_user


def _fuse_epilogues(steps: list[Step], constants: dict[int, Any],
                    outputs: list[int]) -> list[Step]:
    only_user = _only_user_of(steps, outputs)

    def bias_add(s: Step) -> Step:
        """The add of a per-channel f32 constant to s, if it is s's only use, into the chain
        and `bias`; the last step of the chain."""
        nonlocal bias
        add = only_user(s, "mp.add")
        if add is not None:
            other = add.inputs[1 - add.inputs.index(s.output)]
            bias = _channel_bias(constants.get(other), add, s.out_type.shape[1])
            if bias is not None:
                chain.append(add)
                return add
        return s

    fused: dict[int, Step] = {}  # step index (its node) -> the step that replaces it
    gone: set[int] = set()
    for conv in steps:
        if conv.op != "mp.conv2d" or conv.executed["accum"] not in ("f32", "i32") \
                or conv.executed["kernel"] != DENSE:
            continue
        channels = conv.out_type.shape[1]
        chain: list[Step] = []
        scale = bias = None
        last = conv
        if conv.out_type.elem == "i32":
            x_t, w_t = conv.in_types[:2]
            k = w_t.shape[1] * w_t.shape[2] * w_t.shape[3]
            if len(conv.inputs) != 2 or FORMATS[x_t.elem].bits != 8 \
                    or FORMATS[w_t.elem].bits != 8 \
                    or _magnitude(x_t.elem) * _magnitude(w_t.elem) * k >= _I32_LIMIT \
                    or (dq := only_user(conv, "mp.dequantize")) is None:
                continue
            scale = _dequantize_scale(dq, channels)
            if scale is None:
                continue
            chain.append(dq)
            last = bias_add(dq)
        elif conv.out_type.elem == "f32":
            # A conv without a bias operand (an fp8 plan's) takes the f32 add of one.
            last = bias_add(conv) if len(conv.inputs) == 2 else conv
        elif conv.out_type.elem not in RELU_BEFORE_ROUNDING:
            continue
        relu = only_user(last, "mp.relu")
        rounded = conv.out_type.elem if conv.out_type.elem in RELU_BEFORE_ROUNDING else None
        if relu is not None and relu.out_type.elem == last.out_type.elem:
            chain.append(relu)
            last = relu
        if not chain:
            # A rounded result alone (ShuffleNet's second grouped 1x1 conv of a unit, its bias
            # an operand) is rounded as the conv stores its tiles too, not in a pass after it.
            epilogue = _rebuildable(conv) if rounded is not None else None
            if epilogue is not None:
                fused[conv.node] = replace(conv, run=_fused_conv_kernel(conv, *epilogue),
                                           epilogue=epilogue)
            continue
        fused[conv.node] = replace(conv, name=last.name, output=last.output, out_type=last.out_type,
                                   run=_fused_conv_kernel(conv, scale, bias, relu is not None,
                                                          rounded),
                                   epilogue=(scale, bias, relu is not None, rounded))
        gone.update(s.node for s in chain)
    return [fused.get(s.node, s) for s in steps if s.node not in gone]


# ---- a float matmul's rounding (run_lowered) --------------------------------------------------
# A bf16/fp16 matmul's kernel rounds its float32 product into a new array and counts what the
# rounding did; run_lowered keeps no counts, so it rounds in place (round_add_columns with no
# adds: round_to's bits), one array and one pass fewer. Its bias adds are the `fuse` pass's
# mp.fused_matmul.

def _round_matmuls_in_place(steps: list[Step]) -> list[Step]:
    return [replace(s, run=_rounded_matmul_kernel(s.out_type.elem, []))
            if s.op == "mp.matmul" and len(s.inputs) == 2 and s.out_type.elem != "f32"
            and getattr(s.run, "weight_dtype", None) == np.float32
            and all(_plain_float(t.elem) for t in (*s.in_types, s.out_type)) else s
            for s in steps]


def _plain_float(elem: str) -> bool:
    return elem in PLAIN_FLOATS


def _fused_matmul_kernel(opdef: OpDef, attrs: dict, in_types: list[TensorType],
                         out_t: TensorType) -> Kernel:
    """mp.fused_matmul: an 8-bit integer product's exact sums times the column scale, or a
    float product rounded to the result's format, then each addend (a vector along the last
    axis) added and rounded, in one pass over the result in place: the bits of the separate
    ops' kernels (the fuse pass makes the op only where they are). Integer sums that float32
    does not hold exactly run the op's reference."""
    a_t, b_t = in_types[:2]
    elem, addends = out_t.elem, len(in_types) - 2
    if "scale" in attrs and all(t.elem in ("i8", "ui8") for t in (a_t, b_t)) \
            and _magnitude(a_t.elem) * _magnitude(b_t.elem) * a_t.shape[-1] <= _F32_EXACT \
            and elem == "f32" and all(t.elem == "f32" for t in in_types[2:]):
        scale = np.ascontiguousarray(np.broadcast_to(
            attr_array(attrs["scale"]).astype(np.float32).reshape(-1), (out_t.shape[-1],)))
        return _dequantized_matmul_kernel(scale, addends)
    if "scale" not in attrs:  # the product's format, then each add's (the last: the result's)
        formats = [*(attrs.get("formats") or [elem] * addends), elem]
        return _rounded_matmul_kernel(formats[0], formats[1:])
    return _generic_kernel(opdef, attrs, [out_t], 0, False)  # sums beyond float32's exact


def _columns(addends: list[np.ndarray], columns: int) -> list[np.ndarray]:
    """Each addend (a float vector along the last axis) as a float32 vector of `columns`."""
    return [np.ascontiguousarray(np.broadcast_to(_f32(v).reshape(-1), (columns,)))
            for v in addends]


def _rounded_matmul_kernel(elem: str, formats: list[str]) -> Kernel:
    """A float matmul's result rounded to `elem`, then each addend added and rounded to its
    entry of `formats`: the bits of the matmul's kernel and of the adds' (float32 adds, then
    round_to), in one pass over the result, in place."""
    def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        y = matmul(_f32(xs[0]), _weight(xs[1], np.float32))
        round_add_columns(y, elem, list(zip(_columns(xs[2:], y.shape[-1]), formats,
                                            strict=True)))
        return y, None  # fused: no counts
    run.weight_dtype = np.dtype(np.float32)  # type: ignore[attr-defined]
    return run


def _dequantized_matmul_kernel(scale: np.ndarray, addends: int) -> Kernel:
    """An 8-bit integer matmul's exact sums in float32 (products of 8-bit values, |sum| below
    2^24: the GEMM's float32 sums are the integers, so float32(int32(y)) * s is y * s), times
    `scale` and plus each addend, each a float32 operation in place."""
    def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        y = matmul(xs[0].astype(np.float32), _weight(xs[1], np.float32))
        np.multiply(y, scale, out=y)
        for vector in _columns(xs[2:], y.shape[-1]):
            np.add(y, vector, out=y)
        return y, None  # fused: no counts
    run.weight_dtype = np.dtype(np.float32)  # type: ignore[attr-defined]
    return run


def _add_relu_rounding(in_types: list[TensorType], out_t: TensorType) -> tuple | None:
    """(the rounded format or None,) where mp.add_relu runs on add_relu's one-pass kernel:
    operands of the result's shape, each f32 or in its format, a format that takes its relu
    before the rounding (mplower.numerics.elementwise.add_relu); else None."""
    elem = out_t.elem
    if (elem != "f32" and elem not in RELU_BEFORE_ROUNDING) \
            or any(t != out_t.with_elem(t.elem) or t.elem not in ("f32", elem) for t in in_types):
        return None
    return (None if elem == "f32" else elem,)


def _along_last_axis(value: Any, shape: tuple[int, ...], columns: int) -> np.ndarray | None:
    """A float32 constant that numpy broadcasts to `shape` along its last axis only (one value
    per column, or one for all), as a vector of `columns`, or None."""
    if not isinstance(value, np.ndarray) or value.dtype != np.float32 \
            or value.ndim > len(shape) or any(d != 1 for d in value.shape[:-1]) \
            or value.ndim and value.shape[-1] not in (1, columns):
        return None
    if tuple(np.broadcast_shapes(value.shape, shape)) != shape:
        return None
    return np.ascontiguousarray(np.broadcast_to(value.reshape(-1), (columns,)))


# ---- a bf16/fp16 plan's elementwise add, sub or mul and its rounding (run_lowered) ---------
# Their kernels run numpy's float32 op, then round_to over its result: two passes over memory
# and two new arrays. elementwise.binary_rounded does both in one pass, with their bits, and
# also the rounding of a cast that is the result's only reader (BERT's GELU casts its f32
# products to bf16).

_BINARY_OPS = {"mp.add": "add", "mp.sub": "sub", "mp.mul": "mul"}


def _fuse_rounded_binaries(steps: list[Step], constants: dict[int, Any],
                           outputs: list[int]) -> list[Step]:
    only_user = _only_user_of(steps, outputs)
    fused: dict[int, Step] = {}
    gone: set[int] = set()
    for s in steps:
        if s.op not in _BINARY_OPS or not getattr(s.run, "generic", False) \
                or len(s.inputs) != 2 or s.node in gone \
                or not all(_plain_float(t.elem) for t in (*s.in_types, s.out_type)):
            continue
        shape = s.out_type.shape
        operands: list[np.ndarray | None] = []  # None: the step's input as it comes
        for i, t in zip(s.inputs, s.in_types, strict=True):
            vector = None if t.shape == shape or not shape \
                else _along_last_axis(constants.get(i), shape, shape[-1])
            if t.shape != shape and vector is None:
                break
            operands.append(vector)
        if len(operands) != 2 or all(v is not None for v in operands):
            continue
        chain, cast = [s], only_user(s, "mp.cast")
        if cast is not None and _plain_float(cast.out_type.elem) \
                and not (cast.attrs["saturate"] and cast.out_type.elem.startswith("f8")):
            chain.append(cast)
        formats, last = tuple(c.out_type.elem for c in chain), chain[-1]
        if all(f == "f32" for f in formats):
            continue
        gone.update(c.node for c in chain[1:])
        fused[s.node] = replace(s, name=last.name, output=last.output, out_type=last.out_type,
                                run=_rounded_binary_kernel(_BINARY_OPS[s.op], operands,
                                                           formats))
    return [fused.get(s.node, s) for s in steps if s.node not in gone]


def _rounded_binary_kernel(op: str, operands: list[np.ndarray | None],
                           formats: tuple[str, ...]) -> Kernel:
    def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        a, b = (_f32(x) if v is None else v for x, v in zip(xs, operands, strict=True))
        return binary_rounded(op, a, b, formats), None  # run_lowered keeps no counts
    return run


def _readers(steps: list[Step]) -> dict[int, int]:
    """How many steps read each slot."""
    readers: dict[int, int] = {}
    for s in steps:
        for i in s.inputs:
            readers[i] = readers.get(i, 0) + 1
    return readers


def _rebuildable(conv: Step) -> tuple | None:
    """The (scale, bias, relu, rounded) with which `_fused_conv_kernel` computes what a conv
    step's kernel computes (so that it can be rebuilt reading another channel order, or
    writing into a concatenation), or None where its kernel is another (an integer result,
    float64, the f16 accumulator, a sparse kernel)."""
    if conv.epilogue is not None:
        return conv.epilogue
    out = conv.out_type.elem
    if not getattr(conv.run, "generic", False) or conv.executed["accum"] != "f32" \
            or conv.executed["kernel"] != DENSE \
            or out != "f32" and out not in ROUNDING_FORMATS \
            or not all(FORMATS[t.elem].is_float and t.elem != "f64" for t in conv.in_types):
        return None
    return None, None, False, None if out == "f32" else out


# ---- a channel shuffle read by a depthwise conv (run_lowered) ------------------------------
# ShuffleNet's channel shuffle (reshape to (N, g, C/g, H, W), swap axes 1 and 2, reshape back)
# copies the tensor, and a depthwise conv, which reads each input channel as one plane, is its
# only reader: the conv reads the planes in the shuffled order instead (`Step.channels`,
# numerics.depthwise), the same values, so the same bits, without the copy. Per-tensor
# elementwise ops in between (a lowered plan's quantize, scaled_quant or cast) run on the
# unshuffled tensor: each element gets the same operation, and the scale of a per-tensor
# recipe (the amax of the tensor) does not depend on the order of the elements.

def _per_tensor(s: Step) -> bool:
    if s.op == "mp.cast":
        return True
    if s.op == "mp.quantize":
        return attr_array(s.attrs["scale"]).size == 1 and not s.attrs["block_size"]
    return s.op == "mp.scaled_quant" and s.attrs["recipe"] != "block"


def _fuse_shuffles(steps: list[Step], outputs: list[int]) -> list[Step]:
    producer = {s.output: s for s in steps}
    readers, kept = _readers(steps), set(outputs)

    def only_reader(slot: int) -> Step | None:
        """The step that computes `slot`, where one step reads it and it is not an output."""
        return None if readers.get(slot) != 1 or slot in kept else producer.get(slot)

    fused: dict[int, Step] = {}
    gone: set[int] = set()
    for conv in steps:
        x_t = conv.in_types[0]
        if conv.op != "mp.conv2d" or x_t.rank != 4 or conv.attrs["groups"] != x_t.shape[1] \
                or conv.in_types[1].shape[1] != 1 or conv.node in fused \
                or (epilogue := _rebuildable(conv)) is None:
            continue
        chain, back = [], only_reader(conv.inputs[0])
        while back is not None and back.op != "mp.reshape" and _per_tensor(back) \
                and back.in_types[0].shape == x_t.shape and back.node not in fused:
            chain.append(back)
            back = only_reader(back.inputs[0])
        swap = back and back.op == "mp.reshape" and only_reader(back.inputs[0])
        split = swap and swap.op == "mp.transpose" and only_reader(swap.inputs[0])
        if not split or split.op != "mp.reshape" or tuple(swap.attrs["perm"]) != (0, 2, 1, 3, 4) \
                or split.in_types[0].shape != x_t.shape \
                or len({s.out_type.elem for s in (back, swap, split)}) != 1:
            continue
        # back's channel i * g + j is swap's (i, j), split's (j, i): input channel j * a + i.
        a, g = swap.out_type.shape[1], swap.out_type.shape[2]
        c = np.arange(a * g)
        channels = (c % g) * a + c // g
        first = chain[-1] if chain else conv  # the step that read the shuffled tensor
        fused[first.node] = replace(first, inputs=[split.inputs[0], *first.inputs[1:]])
        conv = replace(fused.get(conv.node, conv), channels=channels)
        fused[conv.node] = replace(conv, run=_fused_conv_kernel(conv, *epilogue))
        gone.update((back.node, swap.node, split.node))
    return [fused.get(s.node, s) for s in steps if s.node not in gone]


# ---- convs that write their channels of a concatenation (run_lowered) ----------------------
# A concat along channels of conv results that nothing else reads (SqueezeNet's fire modules,
# Inception's branches) copies every one of them once more: each conv writes its channels of
# the concatenation instead (conv2d's `into`). The first conv to run allocates the result, each
# later one takes it as an extra operand and adds its channels, and the last one's value is the
# concat's. The same sums and epilogue, stored elsewhere: the same bits.

def _fuse_concats(steps: list[Step], outputs: list[int]) -> list[Step]:
    position = {s.output: i for i, s in enumerate(steps)}
    readers, kept = _readers(steps), set(outputs)
    fused: dict[int, Step] = {}
    gone: set[int] = set()
    for cat in steps:
        t = cat.out_type
        if cat.op != "mp.concat" or t.rank != 4 or cat.attrs["axis"] % 4 != 1 \
                or len(set(cat.inputs)) != len(cat.inputs):
            continue
        convs = [steps[position[i]] if i in position else None for i in cat.inputs]
        if not all(c is not None and _writes_into(c) and c.out_type.elem == t.elem
                   and readers.get(c.output) == 1 and c.output not in kept
                   and c.node not in fused for c in convs):
            continue
        offsets = np.cumsum([0] + [c.out_type.shape[1] for c in convs])[:-1]
        order = sorted(range(len(convs)), key=lambda j: position[convs[j].output])
        previous = None
        for j in order:
            conv, first = convs[j], previous is None
            concat = (int(offsets[j]), t.shape, first, j == order[-1])
            new = replace(conv, run=_fused_conv_kernel(conv, *_rebuildable(conv), concat),
                          inputs=conv.inputs if first else [*conv.inputs, previous.output],
                          concat=concat)
            if j == order[-1]:
                new = replace(new, name=cat.name, output=cat.output, out_type=t)
            fused[conv.node] = previous = new
        gone.add(cat.node)
    return [fused.get(s.node, s) for s in steps if s.node not in gone]


# ---- an integer quantize read only by its dequantize (run_lowered) -------------------------
# A QDQ pair in front of an op that runs in float32 (the int8 plan's fallbacks: ShuffleNet's
# grouped 1x1 convs) stores the integers and reads them straight back: one pass computes the
# dequantized values instead (quant.fake_quantizer), the same float32 bits.

def _fuse_fake_quants(steps: list[Step], outputs: list[int]) -> list[Step]:
    producer = {s.output: s for s in steps}
    readers, kept = _readers(steps), set(outputs)
    fused: dict[int, Step] = {}
    gone: set[int] = set()
    for dq in steps:
        q = producer.get(dq.inputs[0]) if dq.op == "mp.dequantize" else None
        if q is None or q.op != "mp.quantize" or readers.get(q.output) != 1 \
                or q.output in kept or dq.out_type.elem != "f32" \
                or q.attrs["block_size"] or dq.attrs["block_size"]:
            continue
        scale, zp = (attr_array(q.attrs[a]) for a in ("scale", "zero_point"))
        axis = q.attrs["axis"] if scale.size > 1 else None
        if not np.array_equal(scale, attr_array(dq.attrs["scale"])) \
                or not np.array_equal(zp, attr_array(dq.attrs["zero_point"])) \
                or axis is not None and axis % q.out_type.rank != dq.attrs["axis"] % q.out_type.rank \
                or (run := fake_quantizer(q.in_types[0].shape, scale.astype(np.float32), zp,
                                          q.out_type.elem, axis)) is None:
            continue
        conv = producer.get(q.inputs[0])
        channels = q.in_types[0].shape[1] if q.in_types[0].rank == 4 else 0
        if conv is not None and _requantizable(conv) and readers.get(conv.output) == 1 \
                and conv.output not in kept and (axis is None or axis % 4 == 1):
            # The depthwise conv that computes q's operand quantizes and dequantizes each
            # output as it stores it: one pass fewer again.
            per_channel = (np.broadcast_to(scale.astype(np.float32).reshape(-1), (channels,)),
                           np.broadcast_to(zp.reshape(-1), (channels,)), q.out_type.elem)
            # epilogue=None: no later fusion rebuilds it without the requantize.
            fused[conv.node] = replace(conv, name=dq.name, output=dq.output,
                                       out_type=dq.out_type, epilogue=None, run=_fused_conv_kernel(
                                           conv, *_rebuildable(conv), requantize=per_channel))
            gone.update((q.node, dq.node))
            continue
        fused[q.node] = replace(q, name=dq.name, output=dq.output, out_type=dq.out_type,
                                run=lambda xs, run=run: (run(_f32(xs[0])), None))
        gone.add(dq.node)
    return [fused.get(s.node, s) for s in steps if s.node not in gone]


def _requantizable(conv: Step) -> bool:
    """Whether a conv step is a depthwise conv whose kernel (numerics.depthwise) can also
    quantize and dequantize its float32 result as it stores it (`depthwise_conv2d`'s
    `requantize`): float operands, or 8-bit integers with a dequantize epilogue."""
    if conv.op != "mp.conv2d" or conv.concat is not None or conv.out_type.elem != "f32" \
            or (epilogue := _rebuildable(conv)) is None or epilogue[3] is not None:
        return False
    x_t, w_t = conv.in_types[:2]
    if x_t.rank != 4 or conv.attrs["groups"] != x_t.shape[1] or w_t.shape[1] != 1:
        return False
    ints = [FORMATS[t.elem].is_int for t in (x_t, w_t)]
    return not any(ints) or all(ints) and epilogue[0] is not None \
        and all(FORMATS[t.elem].bits == 8 for t in (x_t, w_t))


# ---- a conv's float32 result read only by its quantize (run_lowered) -----------------------
# A static int8 plan quantizes each activation for the next integer conv: the conv stores its
# float32 result, and the quantize reads it back from memory for a second pass and writes the
# integers. The implicit GEMM quantizes each tile instead, as it stores it (conv2d's
# `quantize`: quant._quantize_one on the same float32 values, the same integers), so the
# result is read back from L1, and the step and its pass are gone.

def _fuse_quantized_outputs(steps: list[Step], outputs: list[int]) -> list[Step]:
    only_user = _only_user_of(steps, outputs)
    fused: dict[int, Step] = {}
    gone: set[int] = set()
    producer = {s.output: s for s in steps}
    for q in steps:
        # A residual add + relu whose result the next block's conv reads quantized and the
        # next residual add reads as it is: the add_relu pass quantizes it as well, and the
        # quantize step takes its integers from the box (two passes fewer over the result).
        p = producer.get(q.inputs[0]) if q.op == "mp.quantize" and q.inputs else None
        if p is None or p.op != "mp.add_relu" or p.amax_kernel is None or p.node in fused \
                or p.out_type.elem != "f32" or q.attrs["block_size"] \
                or (quantize := _per_tensor_8bit(q)) is None:
            continue
        box = threading.local()
        fused[p.node] = replace(p, run=_add_relu_kernel(None, box, quantize))
        fused[q.node] = replace(q, run=lambda xs, box=box: (box.q, None))
    steps = [fused.get(s.node, s) for s in steps]
    for conv in steps:
        if conv.op != "mp.conv2d" or conv.concat is not None or conv.out_type.elem != "f32" \
                or (epilogue := _rebuildable(conv)) is None or epilogue[3] is not None \
                or (q := only_user(conv, "mp.quantize")) is None or q.attrs["block_size"]:
            continue
        quantize = _per_tensor_8bit(q)
        if quantize is None:
            continue
        # epilogue=None: no later fusion rebuilds it without the quantize.
        fused[conv.node] = replace(conv, name=q.name, output=q.output, out_type=q.out_type,
                                   epilogue=None, run=_fused_conv_kernel(
                                       conv, *epilogue, quantize=quantize))
        gone.add(q.node)
    return [fused.get(s.node, s) for s in steps if s.node not in gone]


def _per_tensor_8bit(q: Step) -> tuple | None:
    """(scale, zero point, format) of a per-tensor quantize to an 8-bit integer format, else
    None."""
    f = FORMATS[q.out_type.elem]
    scale, zp = (attr_array(q.attrs[a]) for a in ("scale", "zero_point"))
    if not f.is_int or f.bits != 8 or scale.size != 1 or zp.size != 1 \
            or not f.min_value <= zp.reshape(()) <= f.max_finite:
        return None
    return scale.astype(np.float32).reshape(()), zp.reshape(()), q.out_type.elem


# ---- the amax a scaled_quant reads, taken by the step that computes its operand -----------
# A per-tensor mp.scaled_quant (an fp8 plan's current scaling) reads its whole operand once for
# its amax before it rounds. Where the operand comes from a conv or a residual add + relu, that
# kernel takes the amax as it stores each output (conv2d's and add_relu's `amax`) and leaves it
# in a box the scaled_quant reads instead: the same value (max is exact in any order), one pass
# over the tensor fewer. The box is per thread, as each run_lowered runs its steps in turn.
# Knowing the amax also lets the rounding skip NaN and infinity handling where there are none,
# and where the scaled_quant is the operand's only reader it writes over the operand: on
# ShuffleNet batch 8, fp8 went from 1.38x to 1.17-1.24x of fp32 (docs/benchmarks.md).

def _fuse_amax(steps: list[Step], outputs: list[int]) -> list[Step]:
    producer = {s.output: s for s in steps}
    readers, kept = _readers(steps), set(outputs)
    fused: dict[int, Step] = {}
    for sq in steps:
        if sq.op != "mp.scaled_quant" or sq.attrs["recipe"] not in ("current", "static"):
            continue
        p = producer.get(sq.inputs[0])
        if p is None or p.node in fused or p.out_type.elem != "f32":
            continue
        box = threading.local()
        if p.amax_kernel is not None:
            run = p.amax_kernel(box)
        elif p.op == "mp.conv2d" and p.concat is None and (epilogue := _rebuildable(p)):
            run = _fused_conv_kernel(p, *epilogue, box=box)
        else:
            continue
        fused[p.node] = replace(p, run=run, amax_kernel=None)  # taken: box.amax is set
        # The conv or add has just allocated its result: where the scaled_quant is its only
        # reader, the scaled values can take its place.
        alone = readers.get(p.output) == 1 and p.output not in kept
        # run_lowered keeps no counts: the rounding takes none (scale_round's `counted`).
        fused[sq.node] = replace(sq, run=scaled_quant_kernel(
            sq.attrs, sq.out_type, amax_of=lambda box=box: box.amax, overwrite=alone,
            counted=False)[0])
    return [fused.get(s.node, s) for s in steps]


def _writes_into(conv: Step) -> bool:
    """Whether a conv step's kernel can write its result into a concatenation: one group of
    at least a register tile of output channels on the implicit GEMM, float32 sums or an
    integer conv with its dequantize, rebuilt by `_fused_conv_kernel`."""
    epilogue = _rebuildable(conv)
    return conv.op == "mp.conv2d" and conv.attrs["groups"] == 1 \
        and conv.in_types[1].shape[0] >= TILE_ROWS and epilogue is not None \
        and (epilogue[0] is None or conv.executed["accum"] == "i32")


def _add_relu_kernel(rounded: str | None, box: Any = None,
                     quantize: tuple | None = None) -> Kernel:
    """mp.add of two operands of the result's shape, then mp.relu, in one pass; a rounded
    result takes its relu before the rounding (see RELU_BEFORE_ROUNDING: the same bits).
    With a `box` (_fuse_amax), box.amax is set to the result's amax, from the same pass; with
    `quantize` (scale, zero point, format; _fuse_quantized_outputs) box.q to the result's
    integers."""
    def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        found = None if box is None or quantize is not None else []
        q: list = []
        y = add_relu(_f32(xs[0]), _f32(xs[1]), rounded, amax=found,
                     quantize=None if quantize is None else (*quantize, q))
        if found is not None:
            box.amax = found[0]
        if quantize is not None:
            box.q = q[0]
        return y, None  # run_lowered keeps no counts
    return run


def _dequantize_scale(dq: Step, channels: int, axis: int = 1) -> np.ndarray | None:
    """The per-channel float32 scale of an f32 dequantize of an i32 result whose channels
    lie along `axis` (a conv's: 1; a matmul's output columns: -1): a scalar or one per
    channel of that axis, zero point 0, no blocks; else None."""
    scale = attr_array(dq.attrs["scale"]).astype(np.float32)
    zp = attr_array(dq.attrs["zero_point"])
    rank = len(dq.in_types[0].shape)
    if dq.out_type.elem != "f32" or np.any(zp != 0) or dq.attrs.get("block_size"):
        return None
    if scale.size == 1:
        return np.full(channels, scale.reshape(()), np.float32)
    if dq.attrs["axis"] % rank != axis % rank or scale.size != channels:
        return None
    return scale.reshape(-1)


def _channel_bias(value: Any, add: Step, channels: int) -> np.ndarray | None:
    """A float32 constant that adds one value per channel of an NCHW result, as a vector."""
    if not isinstance(value, np.ndarray) or value.dtype != np.float32 \
            or add.out_type.elem != "f32" or value.ndim > 4:
        return None
    shape = (1,) * (4 - value.ndim) + value.shape
    if shape[0] != 1 or shape[2:] != (1, 1) or shape[1] not in (1, channels):
        return None
    return np.ascontiguousarray(np.broadcast_to(value.reshape(-1), (channels,)))


def _fused_conv_kernel(conv: Step, scale: np.ndarray | None, bias: np.ndarray | None,
                       relu: bool, rounded: str | None,
                       concat: tuple[int, tuple[int, ...], bool, bool] | None = None,
                       box: Any = None, requantize: tuple | None = None,
                       quantize: tuple | None = None) -> Kernel:
    """The conv with its fused epilogue, reading its input channels in `conv.channels` order.
    `concat` = (channel0, shape, first, last) writes the result into channels channel0.. of a
    concatenation of `shape` (_fuse_concats): the `first` conv allocates it, the others take
    it as their last operand, and each rounds its own channels as it stores them.
    With a `box` (_fuse_amax, no concat), box.amax is set to the result's amax, which the
    conv kernels take as they store it; with `requantize` (_fuse_fake_quants, a depthwise
    conv) the result is quantized and dequantized as it is stored; with `quantize`
    (_fuse_quantized_outputs) it is quantized, and the integers are the result."""
    from mplower.numerics.conv import conv2d

    a, channels, operands = conv.attrs, conv.channels, len(conv.inputs)
    geometry = (a["strides"], a["padding"], a["dilations"], a["groups"])

    def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        x, w, into = xs[0], xs[1], None
        if concat is not None:
            into = (np.empty(concat[1], np.float32) if concat[2] else xs[-1], concat[0])
        found = None if box is None else []
        if scale is None:  # a float conv: its own bias operand or the added one, the relu
            b = _f32(xs[2]) if operands == 3 else bias
            # The rounding too as the conv stores its tiles (conv2d's rounding: round_to's
            # kernel, the same bits; run_lowered keeps no counts), of its own channels where
            # it writes into a concatenation.
            y = conv2d(_f32(x), _f32(w), *geometry, bias=b, relu=relu, channels=channels,
                       into=into, rounding=rounded, amax=found, requantize=requantize,
                       quantize=quantize)
        else:
            y = conv2d(x, w, *geometry, scale=scale, bias=bias, relu=relu, channels=channels,
                       into=into, amax=found, requantize=requantize, quantize=quantize)
        if box is not None:
            box.amax = found[0]
        return y, None
    if scale is not None:  # an integer conv: its constant weight can be an IntegerWeights
        run.integer_weights = True  # type: ignore[attr-defined]
    return run


def reference_runner(module: Module, func: str | None = None,
                     weights: str | None = None) -> Callable[..., dict[Value, Any]]:
    """The function's fp32 reference as `PassContext.runner` (mplower.pass_manager) needs it:
    one batch of argument arrays in, the reference value of every value of the function out
    (or, with `observe`, handed to observe(value, array) one by one as they are computed).
    The module is compiled as it is (a plan that is only annotations does not matter to the
    reference) and not changed."""
    program = Program(module, func, weights, reference_only=True)
    slots = program.slots
    values = {i: v for v, i in slots.items()}

    def run(batch: list[Any],
            observe: Callable[[Value, Any], None] | None = None) -> dict[Value, Any]:
        if observe is not None:  # each value as it is computed, none kept (run_reference)
            program.run_reference(batch, lambda i, y: observe(values[i], y))
            return {}
        refs = program.run_reference(batch)
        return {v: refs[i] for v, i in slots.items()}
    return run


def _failed(step: Step, e: Exception) -> DiagnosticError:
    return DiagnosticError.at(step.loc, f"'{step.op}' failed to execute: {e}")


class _Plan:
    """What an op was asked to run in, what the backend runs it in, and why they differ."""

    def __init__(self, op: str, attrs: dict, in_types: list[TensorType], out_t: TensorType):
        plan = Plan.of(attrs)
        precision, accum, kernel = plan.precision, plan.accum, plan.kernel_or_dense
        floats = [t.elem for t in in_types if FORMATS[t.elem].is_float]
        if op in CONVERSIONS:  # a conversion runs in the format it produces
            ran = attr_type(attrs["dtype"]) if op == "mp.fake_quant" else out_t.elem
        else:
            ran = floats[0] if floats else (in_types[0].elem if in_types else out_t.elem)
        ran_accum = None
        if op in CONTRACTIONS:
            ran_accum = "i32" if FORMATS[ran].is_int else "f32"
        reasons = []
        reasons.extend(plan.fallback)
        if precision is not None and FORMATS[precision].is_int and floats \
                and op not in CONVERSIONS:
            reasons.append(NOT_QUANTIZED)  # an integer plan needs calibrate + quantize first
        if accum == "f16" and op in CONTRACTIONS:
            if FORMATS[ran].is_float and _significant_bits(ran) <= _F16_ACCUM_MAX_BITS:
                ran_accum = "f16"
            else:
                reasons.append(NO_F16_ACCUM)
        # A sparse kernel runs when the weight arrives encoded (mp.sparse_encode, which
        # lower-sparse inserts after checking the pattern) and backend/sparse.py has a kernel
        # for the operands (float, f32 accumulator, 2-D weight); otherwise the op runs densely.
        self.sparse = None
        if kernel != DENSE:
            encoded = len(in_types) > 1 and in_types[1].encoding is not None
            if op == "mp.matmul" and ran_accum == "f32" and encoded:
                self.sparse = sparse_runner(kernel, in_types[0], in_types[1], out_t)
            if self.sparse is None:
                reasons.append(NO_SPARSE_KERNEL)
        # A pass's fallback (legalize, quantize): report what the policy asked for.
        asked = plan.requested or Requested(precision or ran, accum or ran_accum, kernel)
        self.requested: dict[str, str | None] = asked.as_dict()
        self.executed: dict[str, str | None] = {
            "precision": ran, "accum": ran_accum,
            "kernel": kernel if self.sparse is not None else DENSE}
        self.reason = ",".join(dict.fromkeys(r for code in reasons for r in code.split(","))) \
            or None


# ---- kernels -------------------------------------------------------------------------------


def _reference(reference: Callable, attrs: dict, op: str, out_types: list[TensorType],
               k: int) -> Callable:
    """The op's result `k` in the fp32 reference: its numpy semantics on f32 values, results
    kept wide."""
    out_t = out_types[k]
    wide = [_wide(t) for t in out_types]
    as_f32 = [t.with_elem("f32") for t in out_types]

    def run(xs: list[np.ndarray]) -> np.ndarray | None:
        xs = [_f32(x) if x.dtype.kind == "f" and x.dtype != np.float64 else x for x in xs]
        rt = wide
        if op == "mp.fused_matmul" and "scale" in attrs \
                and len({x.dtype.kind == "f" for x in xs[:2]}) == 2:
            return None  # as its matmul's: an integer operand that never was a float
        if op in CONTRACTIONS and not FORMATS[out_t.elem].is_float:
            kinds = {x.dtype.kind == "f" for x in xs[:2]}
            if kinds == {True, False}:
                # An integer operand that never was a float (an i8 constant or argument fed
                # straight to the matmul): its scale is unknown, so there is no fp32 value.
                return None
            if kinds == {True}:
                rt = as_f32  # an integer plan whose quantize was removed: the reference is float
        return reference(xs, attrs, rt)[k]
    return run


def _generic_kernel(opdef: OpDef, attrs: dict, out_types: list[TensorType], k: int,
                    exact: bool) -> Kernel:
    """The op's numpy reference in f32 (integers as they are) for result `k`, rounded to
    its type unless it is `exact`: a value-preserving op on operands already in that type.
    Its attributes are checked here, once (steps run under np.errstate: _run_steps, _execute)."""
    rt = [_wide(t) for t in out_types]
    elem = out_types[k].elem
    reference = opdef.reference
    if opdef.reference_checked is not None:
        reference, attrs = opdef.reference_checked, check_attrs(opdef, attrs)

    def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        y = reference([_f32(x) if x.dtype.kind == "f" and x.dtype != np.float64 else x
                       for x in xs], attrs, rt)[k]
        return (y, None) if exact else _finish(y, elem)
    run.generic = True  # type: ignore[attr-defined]  # the op's own reference: _rebuildable
    return run


def _cast_kernel(out_t: TensorType, attrs: dict, reference: Callable) -> Kernel:
    elem = out_t.elem
    if not FORMATS[elem].is_float:
        return lambda xs: (reference([xs[0]], attrs, [out_t])[0], NO_COUNTS)
    saturate = bool(attrs["saturate"]) and elem.startswith("f8")  # ONNX Cast: fp8 only
    return lambda xs: _finish(xs[0], elem, saturate)


def _quant_kernel(op: str, attrs: dict, in_t: TensorType, out_t: TensorType) -> Kernel:
    scale = attr_array(attrs["scale"]).astype(np.float32)
    zp = attr_array(attrs["zero_point"])
    axis = attrs["axis"] if scale.size > 1 else None
    block = attrs["block_size"]
    if op == "mp.quantize":
        elem = out_t.elem
        # The checks and scale tables once, not per call (in_t's shape is every call's).
        quantized = quantizer(in_t.shape, scale, zp, elem, axis, block_size=block)

        def run_q(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
            q, counts = quantized(_f32(xs[0]))
            return (decode(q, elem) if FORMATS[elem].is_float else q), counts  # f8/f4: values
        return run_q
    if op == "mp.dequantize":
        # f8/f4 operands arrive as their float32 values, integers as int64.
        fl = FORMATS[in_t.elem].is_float
        storage, dtype, out = FORMATS[in_t.elem].storage, in_t.elem if fl else None, out_t.elem
        return lambda xs: _finish(dequantize(xs[0] if fl else xs[0].astype(storage, copy=False), scale, zp,
                                             axis, dtype, block_size=block), out)
    qelem, out = attr_type(attrs["dtype"]), out_t.elem

    def fake(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        q, counts = quantize(_f32(xs[0]), scale, zp, qelem, axis, block_size=block)
        y, rounded = _finish(dequantize(q, scale, zp, axis, block_size=block), out)
        return y, counts + rounded if rounded is not None else counts
    return fake


def _matmul_kernel(plan: _Plan, in_types: list[TensorType], out_t: TensorType) -> Kernel:
    elem = out_t.elem
    a_t, b_t = in_types
    if FORMATS[a_t.elem].is_int and FORMATS[b_t.elem].is_int:
        # Exact: every partial sum of integer products is an integer below the bound, which a
        # float sum represents exactly in any order. It runs on mplower's GEMM all the same:
        # no BLAS anywhere means no BLAS thread pool spinning against numba's on the same cores.
        bound = _magnitude(a_t.elem) * _magnitude(b_t.elem) * a_t.shape[-1]
        work = np.float32 if bound <= _F32_EXACT else np.float64
        fmt = FORMATS[elem]  # i32 (storage int32: half of int64's bytes), or an 8-bit result

        def run_int(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
            y = matmul(xs[0].astype(work), _weight(xs[1], work))
            if elem == "i32":
                return y.astype(fmt.storage), NO_COUNTS
            # A narrower result saturates, as the clamp of a requantization would.
            over = int(np.count_nonzero((y < fmt.min_value) | (y > fmt.max_finite)))
            return np.clip(y, fmt.min_value, fmt.max_finite).astype(fmt.storage), Counts(over)
        run_int.weight_dtype = np.dtype(work)  # type: ignore[attr-defined]
        return run_int
    if plan.executed["accum"] == "f16":
        def run_f16(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
            y, overflow = _matmul_f16(_f32(xs[0]), _f32(xs[1]))
            y, counts = _finish(y, elem)
            return y, Counts(overflow) + (counts or _nan_counts(y))
        return run_f16

    if plan.sparse is not None:
        def run_sparse(xs: list[np.ndarray], _kernel=plan.sparse) -> tuple[np.ndarray,
                                                                            Counts | None]:
            return _finish(_kernel([_f32(xs[0]), _f32(xs[1])]), elem)
        return run_sparse

    def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        return _finish(matmul(_f32(xs[0]), _weight(xs[1], np.float32)), elem)
    run.weight_dtype = np.dtype(np.float32)  # type: ignore[attr-defined]
    return run


def _weight(b: np.ndarray | PackedMatrix, dtype: type) -> np.ndarray | PackedMatrix:
    """A matmul's b in the product's working precision: a PackedMatrix (`_pack_weights`) as
    it is, it was made in that precision."""
    return b if isinstance(b, PackedMatrix) else b.astype(dtype, copy=False)


def _matmul_f16(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int]:
    """np.matmul (batch broadcasting, 1-D operands) with the fp16 accumulator, and how many
    results the accumulator overflowed (inf/NaN from finite operands)."""
    a2 = a if a.ndim > 1 else a[None, :]
    b2 = b if b.ndim > 1 else b[:, None]
    batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    a3 = np.broadcast_to(a2, batch + a2.shape[-2:]).reshape(-1, *a2.shape[-2:])
    b3 = np.broadcast_to(b2, batch + b2.shape[-2:]).reshape(-1, *b2.shape[-2:])
    y = np.stack([matmul_f16_accum(x, w) for x, w in zip(a3, b3)])
    y = y.reshape(batch + y.shape[-2:])
    if a.ndim == 1:
        y = y[..., 0, :]
    if b.ndim == 1:
        y = y[..., 0]
    finite = np.isfinite(a).all() and np.isfinite(b).all()
    return y, int(np.count_nonzero(~np.isfinite(y))) if finite else 0


def _conv_f16_kernel(attrs: dict, out_t: TensorType) -> Kernel:
    """conv2d with the fp16 accumulator: im2col, then per image and group the f16-accumulated
    matmul over (input channel, kernel row, kernel column); the bias is the last addition."""
    elem = out_t.elem

    def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        x, w = _f32(xs[0]), _f32(xs[1])
        n, (o, cg, kh, kw), g = x.shape[0], w.shape, attrs["groups"]
        win = conv_windows(pad_hw(x, attrs["padding"]), (kh, kw), attrs["strides"],
                           attrs["dilations"])
        ho, wo = win.shape[2:4]
        cols = (win.reshape(n, g, cg, ho, wo, kh, kw).transpose(0, 1, 3, 4, 2, 5, 6)
                .reshape(n, g, ho * wo, cg * kh * kw))
        wmat = w.reshape(g, o // g, cg * kh * kw).transpose(0, 2, 1)
        if len(xs) == 3:  # the bias as one more term with weight 1
            ones = np.ones((n, g, ho * wo, 1), np.float32)
            cols = np.concatenate([cols, ones], axis=-1)
            wmat = np.concatenate([wmat, _f32(xs[2]).reshape(g, 1, o // g)], axis=1)
        y, overflow = _matmul_f16(cols, wmat)
        y = y.transpose(0, 1, 3, 2).reshape(n, o, ho, wo)
        y, counts = _finish(y, elem)
        return y, Counts(overflow) + (counts or _nan_counts(y))
    return run


def _drift(res: OpResult, y: np.ndarray, ref: np.ndarray) -> None:
    """The drift of one op's result against the fp32 reference (float results only)."""
    if y.dtype.kind != "f" or ref.dtype.kind != "f" or y.shape != ref.shape:
        return
    d = drift(y, ref)
    res.rel_l2, res.sqnr_db, res.max_abs = d.rel_l2, d.sqnr_db, d.max_abs
    res.nonfinite_mismatch = d.nonfinite_mismatch
