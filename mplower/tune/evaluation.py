"""One candidate plan, lowered through the ordinary pass pipeline, run and priced.

A candidate is a set of per-op compute formats (every other op stays f32), optionally with 2:4
sparse weights, or a built-in policy sheet taken as it is (the uniform plans it is compared
against). It is written as a policy sheet (`sheet_text`: `[[override]]` tables by result
name) and lowered by the pipeline `pipeline_passes` names, the same pipeline that turns the
written `policy.toml` into `lowered.ir`, so an evaluated plan and the released one cannot
differ. `evaluate` runs the lowered module on the evaluation batches (the fp32 reference is
run once per workspace, and an error where it is not finite from finite inputs), measures drift,
top-1 agreement and overflow on all samples and on every slice, checks the guardrails (output
values non-finite where the reference's are not fail every plan, mplower.report.run.NONFINITE)
and prices the plan with `mplower.lowering.cost.plan_cost`.

A `Workspace` is the files of one tuning problem (module, weights, calibration data, target
sheet) written into a private folder: the same code runs in this process and on a dask
worker, which receives the problem once (scattered) and builds its workspace on first use.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.backend.executor import Program, RunResult, reference_runner
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import Function, Module
from mplower.ir.parser import parse
from mplower.ir.verifier import verify
from mplower.lowering.cost import plan_cost
from mplower.lowering.metrics import (
    METRIC_FIGURES,
    Metric,
    metric_figures,
    output_arrays,
    recorded_output_names,
)
from mplower.lowering.policy import load_policy
from mplower.lowering.serving import PREFILL, price_function
from mplower.lowering.target import Target, load_target
from mplower.lowering.throughput import Units, units
from mplower.lowering.tomlsheet import toml_string
from mplower.numerics.formats import FORMATS
from mplower.numerics.metrics import allclose_ratio, drift, finite_or_none
from mplower.pass_manager import PassContext, PassManager, load_passes, parse_pipeline
from mplower.report.run import (
    check_reference,
    evaluate_guardrails,
    tolerance,
    top1_agreement,
    verdict,
)

F32 = "f32"


@dataclass(frozen=True)
class Candidate:
    """A plan: `formats` maps result names (without `%`) to a compute format, in program
    order; `sparse` prunes weights to 2:4 first; `sheet` names a built-in sheet evaluated as
    it is instead (then `formats` is empty)."""

    formats: tuple[tuple[str, str], ...] = ()
    sparse: bool = False
    sheet: str | None = None
    trace: bool = False  # also measure what each op loses itself (search step 2)

    def to_json(self) -> dict[str, Any]:
        if self.sheet is not None:
            return {"sheet": self.sheet}
        out: dict[str, Any] = {"formats": dict(self.formats), "sparse": self.sparse}
        return {**out, "trace": True} if self.trace else out

    @property
    def label(self) -> str:
        """A short name for tables and the plot: `uniform bf16`, `fp32`, `5 ops: 3 i8, 2 bf16`."""
        if self.sheet is not None:
            return f"uniform {self.sheet}"
        if not self.formats:
            return "fp32"
        counts: dict[str, int] = {}
        for _, fmt in self.formats:
            counts[fmt] = counts.get(fmt, 0) + 1
        parts = ", ".join(f"{n} {fmt}" for fmt, n in sorted(counts.items()))
        return f"{len(self.formats)} ops: {parts}" + (" +2:4" if self.sparse else "")

    def with_formats(self, formats: Mapping[str, str], order: Mapping[str, int],
                     trace: bool = False) -> Candidate:
        items = sorted(((n, f) for n, f in formats.items() if f != F32),
                       key=lambda item: order[item[0]])
        return Candidate(tuple(items), self.sparse, trace=trace)

    @property
    def int8(self) -> bool:
        return any(FORMATS[fmt].is_int for _, fmt in self.formats)


def _glob_literal(name: str) -> str:
    """`name` as an fnmatch pattern that matches it alone (`*`, `?`, `[` bracketed)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def sheet_text(candidate: Candidate, guardrails: Mapping[str, float], header: str = "") -> str:
    """The policy sheet that makes assign-precision reproduce `candidate`: nothing listed (every
    op f32, `not-listed`) and one `[[override]]` per lowered op, by its exact result name."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines += ["", "[policy]", 'name = "tuned"',
              'description = "mplower tune: per-op formats, f32 elsewhere"',
              'compute = "f32"', 'accum = "f32"', "keep_io_types = true",
              "keep_first_last = false", ""]
    for name, fmt in candidate.formats:
        lines += ["[[override]]", f"name = {toml_string(_glob_literal(name))}",
                  f"compute = {toml_string(fmt)}", ""]
    if guardrails:
        lines.append("[guardrails]")
        lines += [f"{k} = {v!r}" for k, v in guardrails.items()]
        lines.append("")
    return "\n".join(lines).lstrip("\n")


def pipeline_passes(policy: str, target: str, calib: str, *, int8: bool, sparse: bool,
                    weight_only: bool) -> str:
    """The pass pipeline that lowers a module under the sheet `policy` on `target`: prune (2:4),
    calibrate on the pruned model when an op computes in i8, assign, legalize, choose sparse
    kernels, quantize (w8a8, or weight-only for a `weights = "i8"` sheet), materialize."""
    steps = []
    if sparse:
        steps.append("sparsify{pattern=2:4}")
    if int8:
        steps.append(f"calibrate{{data={calib}}}")
    steps += [f"assign-precision{{policy={policy}}}", f"legalize{{target={target}}}"]
    if sparse:
        steps.append(f"lower-sparse{{target={target}}}")
    if int8:
        steps.append("quantize")
    elif weight_only:
        steps.append("quantize{scheme=w8a16}")
    steps.append("insert-casts")
    return ",".join(steps)


def digest(*parts: bytes | str) -> str:
    """sha256 over the parts, each length-prefixed so that no two splits collide."""
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


@dataclass
class Problem:
    """Everything an evaluation needs, as plain data that pickles (what a worker receives once):
    the module's text and file name, its weights file (path relative to the module, bytes),
    calibration data bytes, the target (a built-in name, or a sheet's text), the evaluation
    batches, slice ids per sample and the guardrails. `key` is their digest."""

    module_text: str
    module_name: str
    weights: tuple[str, bytes] | None
    calib: bytes
    target: str
    target_text: str | None
    batches: list[list[np.ndarray]]
    slices: np.ndarray | None
    guardrails: dict[str, float]
    func: str | None = None
    # A task metric (mplower.lowering.metrics) and the evaluation arrays it reads, one row per
    # sample (`eval_samples`): the user's function is named, not pickled, so a worker imports
    # it itself.
    metric: Metric | None = None
    eval: dict[str, np.ndarray] | None = None
    seq_axis: int | None = None  # the first argument's sequence axis (tokens/s), `--seq-axis`
    # A serving point (phase, batch, context): the plan is priced as that phase's function at
    # that batch and context (mplower.lowering.serving), its quality judged on the data as is.
    serving: tuple[str, int, int | None] | None = None
    key: str = field(init=False)

    def __post_init__(self) -> None:
        arrays = [a for batch in self.batches for a in batch]
        if self.slices is not None:
            arrays.append(self.slices)
        for name, a in sorted((self.eval or {}).items()):
            arrays.append(np.frombuffer(name.encode(), np.uint8))
            arrays.append(a)
        self.key = digest(self.module_text, self.module_name,
                          *(self.weights or ("", b"")), self.calib, self.target,
                          self.target_text or "", json.dumps(self.guardrails, sort_keys=True),
                          self.func or "",
                          json.dumps(repr(self.metric)), repr(self.seq_axis),
                          repr(self.serving),
                          *(f"{a.dtype.str}{a.shape}".encode() + np.ascontiguousarray(a).tobytes()
                            for a in arrays))


class Workspace:
    """A problem's files in a private folder, the parsed module and the fp32 reference outputs
    of every evaluation batch (computed once)."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self._dir = tempfile.TemporaryDirectory(prefix="mplower-tune-")
        root = Path(self._dir.name)
        self.module_path = root / problem.module_name
        self.module_path.write_text(problem.module_text, encoding="utf-8")
        if problem.weights is not None:
            rel, data = problem.weights
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
        self.calib_path = root / "calib.npz"
        self.calib_path.write_bytes(problem.calib)
        if problem.target_text is not None:
            path = root / "target.toml"
            path.write_text(problem.target_text, encoding="utf-8")
            self.target_spec = str(path)
        else:
            self.target_spec = problem.target
        self.target: Target = load_target(self.target_spec)
        self.root = root
        self.module = self.parse()
        self._calibrated: Module | DiagnosticError | None = None
        base = Program(self.module, problem.func, reference_only=True)
        self.references = []
        for batch in problem.batches:
            refs = base.run_reference(batch)
            outputs = [refs[i] for i in base.outputs]
            # The fp32 baseline that every plan is judged against: an overflowed one is the
            # user's error (at the op, in their file: the module is a copy of it), not a pass.
            check_reference(base.steps, refs, outputs, problem.module_name)
            self.references.append(outputs)
        self.output_names = recorded_output_names(self.module.function(problem.func))
        if problem.metric is not None:  # the user's function fails here, before any plan
            self._metric(self.references, None)

    def parse(self) -> Module:
        module = parse(self.problem.module_text, str(self.module_path))
        module.path = str(self.module_path)
        verify(module)
        return module

    def calibrated(self) -> Module:
        """The module after `calibrate{data=...}`, computed once: the first pass of every int8
        pipeline without pruning, whose result does not depend on the plan."""
        # Cached only once it succeeded, and a failure is cached as the failure: the module a
        # failed calibrate left half done is no calibrated module, and every int8 plan after
        # the first would otherwise be told to run the calibrate it did run.
        if isinstance(self._calibrated, DiagnosticError):
            raise self._calibrated
        if self._calibrated is None:
            module = copy.deepcopy(self.module)
            try:
                PassManager(parse_pipeline(f"calibrate{{data={self.calib_path}}}")).run(
                    module, PassContext(runner=reference_runner))
            except DiagnosticError as e:
                self._calibrated = e
                raise
            self._calibrated = module
        return self._calibrated

    def lower(self, candidate: Candidate) -> tuple[Module, PassContext]:
        """The module lowered under `candidate` by `pipeline_passes`, and the context the
        pipeline ran with (its sheet and any pruned weights are written in the workspace)."""
        tag = digest(json.dumps(candidate.to_json(), sort_keys=True))[:16]
        if candidate.sheet is not None:
            policy = candidate.sheet
            sheet = load_policy(policy)
            int8 = sheet.compute == "i8" or any(o.compute == "i8" for o in sheet.overrides)
            weight_only = sheet.weights is not None
        else:
            path = self.root / f"policy-{tag}.toml"
            path.write_text(sheet_text(candidate, self.problem.guardrails), "utf-8")
            policy, int8, weight_only = str(path), candidate.int8, False
        load_passes()
        steps = parse_pipeline(pipeline_passes(policy, self.target_spec, str(self.calib_path),
                                               int8=int8, sparse=candidate.sparse,
                                               weight_only=weight_only))
        if int8 and not candidate.sparse:  # calibrate comes first: start from its result
            module, steps = copy.deepcopy(self.calibrated()), steps[1:]
        else:
            module = copy.deepcopy(self.module)
        ctx = PassContext(output_path=str(self.root / f"lowered-{tag}.ir"),
                          runner=reference_runner)
        PassManager(steps).run(module, ctx)
        return module, ctx

    def price(self, candidate: Candidate) -> dict[str, float | None]:
        """The modeled figures of `candidate` without running it."""
        module, _ = self.lower(candidate)
        return self._modeled(module.function(self.problem.func))

    def evaluate(self, candidate: Candidate) -> dict[str, Any]:
        """The figures of one candidate (module docstring); a pipeline or run that fails is a
        candidate with verdict `error` and the message."""
        try:
            module, ctx = self.lower(candidate)
            program = Program(module, self.problem.func, ctx.weights_path)
            # A traced evaluation keeps every value of its first batch's run (with the fp32
            # reference beside it): that run is also the first of its quality figures.
            runs = [program.run(batch, reference=candidate.trace and i == 0,
                                keep=candidate.trace and i == 0)
                    for i, batch in enumerate(self.problem.batches)]
            local = self._local_error(program, runs[0]) if candidate.trace else None
        except DiagnosticError as e:
            d = e.diagnostics[0]
            return {"plan": candidate.to_json(), "label": candidate.label, "verdict": "error",
                    "error": d.message, "guardrails": {}, "failed": ["error"]}
        f = program.function
        summary, per_slice = self._quality(runs)
        guardrails = evaluate_guardrails(self.problem.guardrails, summary)
        slices = {s: evaluate_guardrails(self.problem.guardrails, {**summary, **q})
                  for s, q in per_slice.items()}
        failed = sorted({k for k, g in guardrails.items() if not g["ok"]}
                        | {k for g in slices.values() for k, v in g.items() if not v["ok"]})
        out = {"plan": candidate.to_json(), "label": candidate.label,
               "lowered_ops": lowered_ops(f), "modeled": self._modeled(f),
               "kept_f32": kept_reasons(f),
               "summary": summary, "guardrails": guardrails, "slices": slices,
               "failed": failed,
               "verdict": "fail" if failed else verdict(guardrails) if guardrails else "pass"}
        if self.problem.metric is not None and per_slice:  # the packet's metric per slice
            out["slice_metric"] = {s: {k: q[k] for k in METRIC_FIGURES if k in q}
                                   for s, q in per_slice.items()}
        return {**out, "local_error": local} if local is not None else out

    def _local_error(self, program: Program, first: RunResult) -> dict[str, float]:
        """What each converted op loses itself on the first evaluation batch, as a relative
        error (10^(-SQNR/20) of mplower.report.quant's `local_severity`): the sensitivity of
        every op of a plan from one traced run instead of one run per op."""
        from mplower.report.quant import Trace, local_severity, operand_sqnr

        def relative(db: float) -> float:  # NaN (a NaN output) counts as the worst
            return 10.0 ** (-min(max(db, -400.0), 400.0) / 20.0) if not math.isnan(db) else 1e20

        traced = Trace(first.values, first.refs, dict(program.slots))
        rows = operand_sqnr(program, self.problem.batches[0], traced)
        return {r["name"].removeprefix("%"): relative(local_severity(r)) for r in rows}

    def _modeled(self, f: Function) -> dict[str, float | None]:
        if self.problem.serving is not None:
            phase, batch, context = self.problem.serving
            step = price_function(f, phase, self.target, batch, context)
            cost = step.cost
            per_call = Units(batch, batch * (step.tokens if phase == PREFILL else 1))
        else:
            cost = plan_cost(f, self.target, baseline=False)
            per_call = units(f, self.problem.seq_axis)
        joules = self.target.joules(cost.time_s)
        per_s = 1.0 / cost.time_s if cost.time_s else None
        # Speedups are taken against the evaluated fp32 plan (mplower.tune.packet), not the
        # cost model's in-plan baseline, which prices a quantized graph's extra ops in f32.
        return {"time_s": cost.time_s, "inferences_per_s": per_s,
                **per_call.rates(per_s),
                "joules_per_inference": joules,
                "inferences_per_joule": 1.0 / joules if joules else None}

    def _quality(self, runs: list) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """Drift, top-1 agreement and overflow counts over every batch, and the output figures
        of every slice (rows of the outputs' first axis, batches in order)."""
        outs = [[np.asarray(y) for y in r.outputs] for r in runs]
        floats = [i for i, r in enumerate(self.references[0])
                  if r is not None and np.asarray(r).dtype.kind == "f"
                  and outs[0][i].dtype.kind == "f"]
        ys = [np.concatenate([b[i] for b in outs]) if outs[0][i].ndim else outs[0][i]
              for i in floats]
        refs = [np.concatenate([b[i] for b in self.references]) if outs[0][i].ndim
                else self.references[0][i] for i in floats]
        written = sum(math.prod(o.step.out_type.shape) for o in runs[0].ops) * len(runs)
        counts = {k: sum(getattr(o.counts, k) for r in runs for o in r.ops)
                  for k in ("overflow", "underflow", "nan")}
        tol = tolerance(self.problem.guardrails)
        summary = {**_output_figures(ys, refs, tol), **counts,
                   "overflow_rate": counts["overflow"] / written if written else 0.0,
                   **self._metric(outs, None)}
        per_slice: dict[str, dict[str, Any]] = {}
        if self.problem.slices is not None:
            ids = self.problem.slices
            for s in sorted(set(ids.tolist()), key=lambda v: (str(type(v)), v)):
                rows = ids == s
                per_slice[str(s)] = {**_output_figures([y[rows] for y in ys],
                                                       [r[rows] for r in refs], tol),
                                     **self._metric(outs, rows)}
        return summary, per_slice

    def _metric(self, outs: list[list[np.ndarray]], rows: np.ndarray | None) -> dict[str, Any]:
        """The task metric's figures (mplower.lowering.metrics.metric_figures) of the outputs of
        every batch `outs` against the fp32 references, on the samples `rows` (all: None)."""
        metric = self.problem.metric
        if metric is None:
            return {}
        ys, refs = _samples(outs, rows), _samples(self.references, rows)
        eval = {k: a[rows] if rows is not None and a.ndim and len(a) == len(rows) else a
                for k, a in (self.problem.eval or {}).items()}
        figures = metric_figures(metric, output_arrays(ys, self.output_names),
                                 output_arrays(refs, self.output_names), eval)
        figures.pop("metric_reference_detail", None)
        return figures


def _samples(batches: list[list[np.ndarray]], rows: np.ndarray | None) -> list[np.ndarray]:
    """Every output over all batches (stacked along the sample axis, the first), the rows
    `rows` of them where given; a scalar output is the first batch's."""
    out = []
    for i, first in enumerate(batches[0]):
        y = np.concatenate([np.asarray(b[i]) for b in batches]) if np.ndim(first) else first
        out.append(y[rows] if rows is not None and np.ndim(y) else y)
    return out


def _output_figures(ys: list[np.ndarray], refs: list[np.ndarray],
                    tol: tuple[float, float] | None) -> dict[str, Any]:
    """The run report's output figures (mplower.report.run.output_drift) on these arrays, and
    `allclose_ratio` under the tolerance `tol` (rtol, atol) where the guardrails give one."""
    close = {} if tol is None else {"allclose_ratio": finite_or_none(
        max((allclose_ratio(y, r, *tol) for y, r in zip(ys, refs)), default=None))}
    if not ys:
        return {"output_rel_l2": None, "output_max_abs": None, "sqnr_db": None,
                "nonfinite_mismatch": None, "top1_agreement": None, **close}
    d = drift(np.concatenate([y.astype(np.float64).ravel() for y in ys]),
              np.concatenate([r.astype(np.float64).ravel() for r in refs]))
    return {"output_rel_l2": finite_or_none(d.rel_l2), "output_max_abs": finite_or_none(d.max_abs),
            "sqnr_db": finite_or_none(d.sqnr_db), "nonfinite_mismatch": d.nonfinite_mismatch,
            "top1_agreement": top1_agreement(ys[0], refs[0]), **close}


def kept_reasons(f: Function) -> dict[str, int]:
    """Why the ops left in f32 stayed there (assign-precision's and legalize's `mp.reason`),
    with how many ops each: what a plan that lowers nothing tells its user."""
    from mplower.dialect.plan import Plan

    out: dict[str, int] = {}
    for n in f.ops():
        plan = Plan.at(f, n)
        if plan.precision in (None, F32) and plan.reason:
            out[plan.reason] = out.get(plan.reason, 0) + 1
    return out


def lowered_ops(f: Function) -> int:
    """Ops that compute in a format narrower than f32 (the count `assign-precision` reports)."""
    from mplower.dialect.plan import Plan

    return sum(1 for n in f.ops() if Plan.at(f, n).precision not in (None, F32, "f64"))


_WORKSPACES: dict[str, Workspace] = {}


def workspace(problem: Problem) -> Workspace:
    """This process's workspace for `problem`, built on first use (one per dask worker)."""
    ws = _WORKSPACES.get(problem.key)
    if ws is None:
        ws = _WORKSPACES[problem.key] = Workspace(problem)
    return ws


def drop_workspace(problem: Problem) -> None:
    """Forget this process's workspace of `problem` and delete its folder."""
    ws = _WORKSPACES.pop(problem.key, None)
    if ws is not None:
        ws._dir.cleanup()


def evaluate(problem: Problem, candidate: Candidate) -> dict[str, Any]:
    """`Workspace.evaluate` in this process's workspace of `problem` (what dask tasks call)."""
    return workspace(problem).evaluate(candidate)
