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

Each op runs on the kernel its entry in the op table gives (mplower.backend.kernels.KERNELS;
the op's reference rounded to its result type where it has none), the fused ops of the `fuse`
pass included.

The fp32 reference is the same schedule with every cast and quantize/dequantize removed and
nothing rounded; `run` executes both side by side and keeps per-op statistics, `run_lowered`
only the lowered plan (what `mplower bench` times): the same ops, with its constant-only ops
run once, on kernels that keep no counts and with buffers shared where that saves a pass
(mplower.backend.lowered), the same bits; fusing ops is the `fuse` pass's, never the
executor's. An op/format pair the
backend has no kernel for runs on the nearest wider path and is reported as a fallback with its
reason code: a sparse kernel (`no-sparse-kernel`: run densely), an integer plan that was never
quantized (`not-quantized`: its float operands run in their own format), an fp16 accumulator
over operands whose products do not fit it exactly (`no-f16-accum`: f32). Legalize's fallbacks
(`mp.fallback`, `mp.requested`) are reported as the pass recorded them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mplower.backend.fused import KERNELS  # noqa: F401  (adds the fused ops' kernels)
from mplower.backend.kernels import (
    NO_COUNTS,
    Chosen,
    OpToRun,
    choose_kernel,
    f32,
    finish,
    nan_counts,
    reference_kernel,
)
from mplower.backend.lowered import Step, lowered_steps
from mplower.backend.memory import keep_freed_memory
from mplower.backend.scaled import ScaleStats
from mplower.backend.sparse import sparse_runner
from mplower.dialect.mp import CONTRACTIONS, CONVERSIONS
from mplower.dialect.plan import DENSE, Plan, Requested, check_materialized
from mplower.io.weights import Weights
from mplower.ir.diagnostics import Diagnostic, DiagnosticError, Location
from mplower.ir.graph import ARG, RETURN, Function, Module, Value
from mplower.ir.opdef import OPS, OpError, attr_type, check_attrs
from mplower.ir.types import DenseAttr, TensorType
from mplower.lowering.target import NO_F16_ACCUM, NO_SPARSE_KERNEL
from mplower.numerics.formats import FORMATS, f16_accum_emulated
from mplower.numerics.metrics import drift
from mplower.numerics.rounding import (
    Counts,
)

NOT_QUANTIZED = "not-quantized"


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
    # lowered graph has no fp32 counterpart, see `reference_kernel`).
    reference: list[np.ndarray | None] | None
    ops: list[OpResult] = field(default_factory=list)
    # The values of the run by slot (Program.slots maps a Value to its slot): the lowered
    # plan's, and the fp32 reference's (None where there is none), for per-tensor analyses.
    # Only the slots the run was asked to keep (`Program.run`'s `keep`) and the outputs are
    # held; every other entry is None, freed after its last reader.
    values: list[Any] = field(default_factory=list)
    refs: list[Any] = field(default_factory=list)
    # Every slot's fp32 reference on demand (the kept `refs` where they are all kept, else the
    # reference run again): what a diagnosis of a non-finite reference needs, and only then.
    all_refs: Callable[[], list[Any]] | None = None


class Program:
    """A function compiled for execution; `run` may be called any number of times.

    The module is compiled as it is and never changed. One whose plan is still only
    annotations (assign-precision without insert-casts) is an error: materialize it first
    (mplower.passes.insert_casts.materialize, as `mplower run` does). `reference_only` compiles
    for `run_reference` alone, which ignores the plan, so it takes such a module as well.
    """

    def __init__(self, module: Module, func: str | None = None,
                 weights: str | Mapping[str, np.ndarray] | None = None,
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
        # The step after which `run` may free a slot: its last reader's (-1: never read).
        self._last_read: list[int] = [-1] * self.num_slots
        for k, s in enumerate(self.steps):
            for i in s.inputs:
                self._last_read[i] = k
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
        reference = reference_kernel(opdef.reference, attrs, op, d["types"], k)
        if op == "mp.constant":
            constant, counts, ref = self._constant(attrs, out_t, loc)
            chosen = Chosen(lambda xs: (constant, NO_COUNTS), lambda xs: ref)
        else:
            constant, counts = None, NO_COUNTS
            chosen = choose_kernel(OpToRun(opdef, attrs, d["attrs"], in_types, d["types"], k,
                                           plan.executed["accum"], plan.sparse))
        return Step(n, f.value_name((n, k)), op, inputs, out, chosen.run,
                    chosen.reference or reference, plan.requested, plan.executed, plan.reason,
                    flops, out_t, loc, constant, counts, chosen.scale_stats, attrs, in_types,
                    amax_kernel=chosen.amax_kernel, fast=chosen.fast, conv=chosen.conv)

    def _constant(self, attrs: dict, t: TensorType,
                  loc: Location) -> tuple[np.ndarray, Counts, np.ndarray]:
        if isinstance(attrs.get("value"), DenseAttr):
            raw = attrs["value"].array
        elif "name" in attrs:
            raw = self.weights.get(attrs["name"], t, loc)
        else:
            raise DiagnosticError.at(loc, "mp.constant needs a 'value' or a 'name'")
        is_float = FORMATS[t.elem].is_float
        # copy=False: an f32 weight (a memory-mapped file's view) is its own reference, not a
        # second copy of every weight.
        with np.errstate(over="ignore"):  # beyond float32's range is inf: the report lists it
            ref = raw.astype(np.float32, copy=False) if is_float and t.elem != "f64" else raw
        # ascontiguousarray makes a 0-d array 1-d: a scalar constant keeps its shape.
        lowered, counts = finish(np.ascontiguousarray(raw).reshape(t.shape), t.elem)
        return lowered, counts if counts is not None else nan_counts(lowered), ref

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
                x = finish(arr, t.elem)[0]
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

    def run(self, inputs: list[np.ndarray], reference: bool = True,
            keep: Collection[int] | bool = (),
            reference_inputs: list[np.ndarray] | None = None) -> RunResult:
        """The lowered plan and (with `reference`) the fp32 reference, with per-op statistics.

        Each op's drift is taken as soon as its value and its reference exist; both are then
        dropped after their last reader, so that a run holds only its live tensors (with the
        reference, about twice the plan's). RunResult.values/refs hold the outputs and the
        slots in `keep`; `keep=True` keeps every slot (a per-tensor analysis of the whole run,
        mplower.report.quant's `trace`). `reference_inputs` start the reference from other
        arguments than the plan's (one block of a model run block by block, whose reference
        continues the fp32 reference of the blocks before it)."""
        values = list(self._initial)
        refs: list[Any] = [None] * self.num_slots
        for i, x in enumerate(self.prepare_inputs(inputs)):
            values[i] = x
            raw = np.asarray((reference_inputs or inputs)[i])
            refs[i] = f32(raw) if FORMATS[self.arg_types[i].elem].is_float else raw
        held = set(self.outputs) | (set() if isinstance(keep, bool) else set(keep))
        last = self._last_read
        results = []
        for k, step in enumerate(self.steps):
            if step.constant is not None:
                y, counts = step.constant, step.constant_counts
            else:
                y, counts = self._execute(step, values)
                values[step.output] = y
            res = OpResult(step, counts if counts is not None else nan_counts(y),
                           scale=step.scale_stats[0] if step.scale_stats else None)
            if reference:
                ref_in = [refs[i] for i in step.inputs]
                ref = None
                if all(r is not None for r in ref_in):  # None: no fp32 counterpart upstream
                    with np.errstate(all="ignore"):
                        ref = step.reference(ref_in)
                    if step.op != "mp.quantize":  # its values are x / scale, its reference x
                        _drift(res, y, ref)
                    if _same_bits(y, ref):  # an f32 op on f32 operands: hold one copy
                        ref = y
                refs[step.output] = ref
                del ref_in, ref
            del y
            results.append(res)
            if keep is not True:
                for i in (*step.inputs, step.output):
                    if last[i] <= k and i not in held:
                        values[i] = refs[i] = None
        outs = [values[i] for i in self.outputs]
        if not reference:
            every = None
        elif keep is True:
            every = lambda: refs
        else:
            every = lambda: self.run_reference(inputs)
        return RunResult(outs, [refs[i] for i in self.outputs] if reference else None, results,
                         values, refs, every)

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
            refs[i] = f32(x) if FORMATS[t.elem].is_float else x
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
        The ops are the module's, fused only where the `fuse` pass fused them; each runs on
        its uncounted kernel where it has one, and results share buffers where that saves a
        pass (mplower.backend.lowered)."""
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
            self._live = lowered_steps(live, constants, self.outputs)
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
            if f16_accum_emulated(ran):  # legalize decides; hand-written IR may skip it
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


def _drift(res: OpResult, y: np.ndarray, ref: np.ndarray) -> None:
    """The drift of one op's result against the fp32 reference (float results that have one:
    a fused op whose integer operand never was a float has none)."""
    if ref is None or y.dtype.kind != "f" or ref.dtype.kind != "f" or y.shape != ref.shape:
        return
    d = drift(y, ref)
    res.rel_l2, res.sqnr_db, res.max_abs = d.rel_l2, d.sqnr_db, d.max_abs
    res.nonfinite_mismatch = d.nonfinite_mismatch


def _same_bits(y: Any, ref: Any) -> bool:
    """Whether the reference is the plan's value bit for bit (an op the plan runs in f32 on
    operands equal to the reference's), so that the run holds one array for both: the full
    report of an fp32 module then holds what the plain run holds, not twice as much."""
    if not (isinstance(y, np.ndarray) and isinstance(ref, np.ndarray)) or y is ref:
        return y is ref
    if y.dtype != ref.dtype or y.shape != ref.shape:
        return False
    if y.dtype.kind == "f":  # bits, not values: -0.0 is not 0.0 to 1/x, NaNs are compared too
        u = np.dtype(f"u{y.dtype.itemsize}")
        return bool(np.array_equal(y.view(u), ref.view(u)))
    return bool(np.array_equal(y, ref))
