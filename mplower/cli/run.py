"""`mplower run` and `mplower bench`: execute a lowered module, report drift, time it.

Both read the module, materialize an annotated plan (insert-casts), compile it once and take
their inputs from `--inputs` or, by default, seeded random values. `run` executes the plan
beside its fp32 reference and prints the report (DESIGN §6, docs/report.md), with guardrails
from the module's policy sheet (`mp.policy`) overridden by `--guardrail`; `bench` times the
lowered plan alone and adds the cost model's figures for a target. The outputs of `run` are
checked before the work and committed as one set when it returns (mplower.io.atomic): nothing
is written unless the whole run succeeded. `-` is stdout for each of them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from mplower.cli.common import (
    EXIT_GUARDRAIL,
    EXIT_OK,
    UsageError,
    check_outputs,
    materialize_and_say,
    read_module,
    seed,
    write_output,
    writes_outputs,
)
from mplower.ir.diagnostics import Diagnostic, DiagnosticError, Location

if TYPE_CHECKING:  # numpy loads when a command runs: `import mplower.cli.main` stays cheap
    import numpy as np

    from mplower.ir.graph import Function


def _input_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="IR file, or - for stdin")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--inputs", metavar="IN.npz",
                        help=".npz keyed by argument name (x for %%x)")
    source.add_argument("--random-inputs", action="store_true",
                        help="seeded random inputs: standard normal floats, uniform integers "
                             "(the default when --inputs is not given)")
    p.add_argument("--seed", type=seed, default=0, help="seed for --random-inputs (default 0)")
    p.add_argument("--weights", metavar="W.npz",
                   help="weights .npz to use instead of the module's mp.weights")
    p.add_argument("--func", default=None, help="function to run (default: main or the only one)")


def add_run(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="execute a lowered module beside its fp32 reference",
                       description="Run the lowered function and its fp32 reference side by "
                                   "side; report per-op fallbacks, overflow and drift. A plan "
                                   "that is only annotations gets insert-casts first.")
    _input_flags(p)
    p.add_argument("--save-outputs", metavar="OUT.npz",
                   help="write the function's results ('-': stdout, through a pipe)")
    p.add_argument("--output-names", choices=("index", "onnx"), default="index",
                   help="keys of --save-outputs: output_0, output_1, ... (index, the default) "
                        "or the ONNX graph output names that `mplower import` recorded (onnx)")
    p.add_argument("--report", metavar="R.json",
                   help="write the JSON report here ('-': print it on stdout, in place of the "
                        "--format output)")
    p.add_argument("--format", choices=("table", "json", "markdown"), default="table",
                   help="format of the report printed on stdout")
    p.add_argument("--plot", metavar="DRIFT.png",
                   help="write a bar chart of each op's drift (rel_l2) and overflow count "
                        "(PNG; '-': stdout, through a pipe)")
    p.add_argument("--batch-inputs", action="store_true",
                   help="--inputs holds more rows than the function's batch: run them batch by "
                        "batch (the last, partial one at its own size) and report, save and "
                        "check over all rows; refused where an op mixes the batch axis")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--workers", type=int, default=0, metavar="N",
                       help="with --batch-inputs: run the batches on a dask LocalCluster of N "
                            "workers (0: in this process); the report is the same")
    where.add_argument("--scheduler", metavar="ADDRESS",
                       help="with --batch-inputs: run them on a running dask cluster "
                            "(tcp://host:port)")
    p.add_argument("--no-reference", action="store_true",
                   help="run the lowered plan alone, without the fp32 reference: outputs and "
                        "per-op overflow/underflow/NaN counts, no drift (a plain run, in "
                        "about half the memory); refused with guardrails, --metric, --plot "
                        "and --bisect, which all measure against the reference")
    p.add_argument("--check", action="store_true", help="exit 3 if a guardrail fails")
    p.add_argument("--bisect", action="store_true",
                   help="name the smallest set of ops whose return to f32 meets the guardrails")
    p.add_argument("--guardrail", action="append", default=[], metavar="KEY=VALUE",
                   help="a guardrail, e.g. max_rel_l2=0.01 (overrides the policy sheet's)")
    add_metric_flags(p, "the --inputs file")
    return p


def add_metric_flags(p: argparse.ArgumentParser, where: str) -> None:
    """`--metric` and `--metric-direction` (docs/metrics.md), for run and tune."""
    p.add_argument("--metric", metavar="NAME:ARRAY|pkg.mod:fn|file.py:fn",
                   help=f"a task metric measured on the outputs and the fp32 reference: a "
                        f"built-in over an array of {where} (top1:labels, top5:labels, "
                        f"class_accuracy:labels, perplexity:targets, bits_per_token:targets; "
                        f"options after commas, e.g. perplexity:labels,shift=1) or your "
                        f"function(outputs, eval) -> float; enables the min_metric, "
                        f"max_metric, max_metric_drop, max_metric_drop_rel guardrails")
    p.add_argument("--metric-direction", choices=("max", "min"), default=None,
                   help="whether your metric is better higher (max, the default) or lower")


def metric_flag(args: argparse.Namespace, limits: dict[str, float]):
    """The `Metric` of `--metric` (None without one), checked before any work: a bad spec is a
    usage error, a user function that cannot be imported a diagnostic. Metric guardrails in
    `limits` (the command line's) need it."""
    from mplower.lowering.metrics import METRIC_GUARDRAILS, MetricSpecError, parse_metric

    if args.metric is None:
        if args.metric_direction is not None:
            raise UsageError("--metric-direction needs --metric")
        if keys := [k for k in limits if k in METRIC_GUARDRAILS]:
            raise UsageError(f"--guardrail {keys[0]} needs a metric to measure: --metric "
                             f"NAME:ARRAY or pkg.module:function (docs/metrics.md)")
        return None
    try:
        metric = parse_metric(args.metric, args.metric_direction)
    except MetricSpecError as e:
        raise UsageError(str(e)) from None
    if metric.builtin is None:
        metric.load()  # the user's module imports now, not after the work
    return metric


def add_bench(sub, name: str) -> argparse.ArgumentParser:
    b = sub.add_parser(name, help="latency percentiles and inferences/s, measured and modeled",
                       description="Time the lowered plan on this CPU (emulated formats) and "
                                   "add the cost model's figures for a target. A plan that is "
                                   "only annotations gets insert-casts first.")
    _input_flags(b)
    b.add_argument("--warmup", type=int, default=3, help="untimed runs first (default 3)")
    b.add_argument("--samples", "-n", "--iterations", dest="samples", type=int, default=None,
                   help="timed runs: exactly this many (default: until 200 runs or the time "
                        "budget, whichever comes first)")
    b.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop timing after this long (default 10 s; with --samples, none)")
    b.add_argument("--seq-axis", type=int, default=None, metavar="AXIS",
                   help="axis of the first argument that holds the sequence: tokens/s counts "
                        "its dimensions up to this one (default: found from attention)")
    b.add_argument("--target", default=None,
                   help="target for the modeled figures (default: the module's mp.target, "
                        "else generic)")
    b.add_argument("--format", choices=("table", "json"), default="table")
    return b


def _random(rng: np.random.Generator, elem: str, shape: tuple[int, ...]) -> np.ndarray:
    import numpy as np

    from mplower.numerics.formats import FORMATS

    f = FORMATS[elem]
    if f.is_float:
        return rng.standard_normal(shape).astype(np.float64 if elem == "f64" else np.float32)
    if elem == "i1":
        return rng.integers(0, 2, shape).astype(np.bool_)
    from mplower.ir.types import value_dtype

    lo, hi = f.int_range
    return rng.integers(lo, hi, shape, dtype=value_dtype(elem), endpoint=True)


def _load(args: argparse.Namespace, command: str):
    """(module, program, input arrays) for the run and bench commands."""
    import numpy as np

    from mplower.backend.executor import Program
    from mplower.io.weights import load_inputs

    module = read_module(args)
    # The pipeline's first step: a plan still only annotations gets casts, and the user is told.
    materialize_and_say(module, args, command)
    program = Program(module, args.func, args.weights)
    if getattr(args, "batch_inputs", False):  # run's rows are read batch by batch (cli.batches)
        arrays = None
    elif args.inputs:
        arrays = load_inputs(args.inputs, program.arg_names, program.arg_types,
                             program.arg_locs)
    else:
        rng = np.random.default_rng(args.seed)
        arrays = [_random(rng, t.elem, t.shape) for t in program.arg_types]
    return module, program, arrays


def _guardrail_flags(flags: list[str]) -> dict[str, float]:
    from mplower.lowering.policy import GUARDRAIL_BOUNDS, GUARDRAILS

    limits: dict[str, float] = {}
    for flag in flags:
        key, sep, value = flag.partition("=")
        key = key.strip()
        if not sep or key not in GUARDRAILS:
            raise UsageError(f"--guardrail takes KEY=VALUE with KEY one of "
                             f"{', '.join(GUARDRAILS)}; got '{flag}'")
        try:
            limits[key] = float(value)
        except ValueError:
            raise UsageError(f"--guardrail {key} needs a number, got '{value}'") from None
        if (problem := GUARDRAIL_BOUNDS[key].problem(limits[key])) is not None:
            raise UsageError(f"--guardrail {key} {problem}")
    return limits


def _policy_guardrails(module) -> dict[str, float]:
    """The guardrails of the sheet assign-precision recorded on the module (`mp.policy`)."""
    from mplower.dialect.plan import POLICY
    from mplower.lowering.policy import load_policy

    policy = module.attrs.get(POLICY)
    if not isinstance(policy, str):
        return {}
    try:
        return dict(load_policy(policy, module=module).guardrails)
    except DiagnosticError as e:  # located in the sheet: show its lines, not the IR's
        sheet = Path(e.diagnostics[0].loc.file)
        if e.source is None and sheet.is_file():
            e.source = sheet.read_text(encoding="utf-8", errors="replace")
        # No line: the source shown with these diagnostics may be the sheet's, not the IR's.
        e.diagnostics.append(Diagnostic(Location(module.loc.file, 0, 0), (
            f"while reading the guardrails of policy '{policy}' (the module's mp.policy)"),
            "note"))
        raise


@writes_outputs
def cmd_run(args: argparse.Namespace) -> int:
    from mplower.dialect.plan import POLICY
    from mplower.lowering.metrics import METRIC_GUARDRAILS, recorded_output_names
    from mplower.report.quant import converted_ops, json_safe, operand_sqnr
    from mplower.report.run import build_report, render

    flags = _guardrail_flags(args.guardrail)  # usage errors before any work
    if args.metric is not None and not args.inputs:
        raise UsageError("--metric needs --inputs: the metric reads its arrays (labels, "
                         "targets) from that file")
    if args.no_reference:
        against = [f for f, on in (("--guardrail", flags), ("--metric", args.metric),
                                   ("--plot", args.plot), ("--bisect", args.bisect),
                                   ("--check", args.check)) if on]
        if against:
            raise UsageError(f"--no-reference: {', '.join(against)} measure"
                             f"{'s' * (len(against) == 1)} against the fp32 reference, which "
                             f"--no-reference does not run")
    metric = metric_flag(args, flags)
    if args.batch_inputs and not args.inputs:
        raise UsageError("--batch-inputs needs --inputs: it runs that file's rows batch by batch")
    if args.workers < 0:
        raise UsageError("--workers must be 0 (this process) or more")
    if (args.workers or args.scheduler is not None) and not args.batch_inputs:
        raise UsageError("--workers and --scheduler share out the batches of --batch-inputs: "
                         "give --batch-inputs")
    if args.batch_inputs and args.bisect:
        raise UsageError("--bisect runs one batch: give --inputs one batch without "
                         "--batch-inputs")
    outputs = {"--save-outputs": args.save_outputs, "--report": args.report,
               "--plot": args.plot}
    check_outputs(outputs, {"input": args.input, "--inputs": args.inputs,
                            "--weights": args.weights},
                  binary=("--save-outputs", "--plot"))
    module, program, arrays = _load(args, "run")
    _protect_weights(module, args.weights)
    keys = output_keys(program.function, args.output_names)
    limits = {**_policy_guardrails(module), **flags}
    if args.no_reference and limits:  # the sheet's limits are all on drift or the metric
        sys.stderr.write(f"{args.input}: note: the policy sheet's guardrails "
                         f"{', '.join(limits)} left out: --no-reference has no drift\n")
        limits = {}
    if metric is None and (sheet_metric := [k for k in limits if k in METRIC_GUARDRAILS]):
        # The sheet limits a metric that only the command line may name (docs/metrics.md).
        if args.check:
            raise UsageError(f"--check: the policy sheet's guardrail {sheet_metric[0]} needs "
                             f"the metric it limits: give --metric")
        sys.stderr.write(f"{args.input}: note: the policy sheet's "
                         f"{', '.join(sheet_metric)} left out: no --metric to measure\n")
        limits = {k: v for k, v in limits.items() if k not in METRIC_GUARDRAILS}
    for flag in ("check", "bisect"):  # neither means anything without a limit to meet
        if getattr(args, flag) and not limits:
            raise UsageError(f"--{flag} needs guardrails: the policy sheet's or "
                             f"--guardrail KEY=VALUE")
    eval_arrays = None
    if metric is not None:
        from mplower.io.npz import read_npz

        eval_arrays = read_npz(Path(args.inputs), Location(args.inputs, 0, 0), "inputs")
        metric.check_eval(eval_arrays)
    if args.batch_inputs:
        from mplower.cli.batches import run_batches, split_rows
        from mplower.lowering.sharding import executor_for

        batches, _ = split_rows(program, args.inputs)
        executor = executor_for(args.workers, args.scheduler)
        try:
            result = run_batches(module, program, batches, args.func, args.weights,
                                 reference=not args.no_reference, executor=executor)
        finally:
            executor.close()
        arrays = batches[0]  # the per-op quantization table below is of the first batch
    else:
        result = program.run(arrays, reference=not args.no_reference)
    report = build_report(result, limits, module.attrs.get(POLICY),
                          program.function.name, metric, eval_arrays,
                          recorded_output_names(program.function))
    if converted_ops(program.function) and not args.no_reference:
        # Per-op weight/activation SQNR: one traced run more, which keeps every value.
        report["quantization"] = json_safe(operand_sqnr(program, arrays))
    if args.bisect:
        from mplower.report.bisect import bisect

        report["bisect"] = bisect(module, arrays, limits, args.func, args.weights,
                                  metric=metric, eval=eval_arrays,
                                  output_names=recorded_output_names(program.function)).to_json()
    # All of these are committed together when the command returns; an output given as '-'
    # takes stdout in place of the --format output.
    if args.save_outputs:
        import io

        from mplower.io.npz import save_npz

        buf = io.BytesIO()
        save_npz(buf, dict(zip(keys, result.outputs)))
        write_output(args.save_outputs, buf.getvalue())
    if args.report:
        write_output(args.report, render(report, "json"))
    if args.plot:
        from mplower.report.drift_plot import plot_drift

        write_output(args.plot, plot_drift(report, f"@{program.function.name}").png)
    if "-" not in outputs.values():
        write_output("-", render(report, args.format))
    if args.check and report["summary"]["verdict"] != "pass":
        return EXIT_GUARDRAIL
    return EXIT_OK


def _protect_weights(module, override: str | None) -> None:
    from mplower.io.atomic import active_output_set
    from mplower.io.npz import weights_file

    outputs = active_output_set()
    if outputs is not None:
        outputs.protect(weights_file(module, override), "the module's weights file")


def output_keys(f: Function, names: str) -> list[str]:
    """The --save-outputs keys: `output_N`, or the function's `mp.output_names` (from ONNX)."""
    from mplower.dialect.plan import OUTPUT_NAMES

    n = len(f.result_types)
    if names == "index":
        return [f"output_{i}" for i in range(n)]
    recorded = f.attrs.get(OUTPUT_NAMES)
    if recorded is None:
        raise DiagnosticError.at(f.loc, f"--output-names onnx: @{f.name} has no mp.output_names "
                                        "(only `mplower import` records them); use "
                                        "--output-names index")
    if not (isinstance(recorded, tuple) and len(recorded) == n
            and all(isinstance(k, str) and k for k in recorded)
            and len(set(recorded)) == n):
        from mplower.ir.types import attr_to_str

        raise DiagnosticError.at(f.loc, f"mp.output_names of @{f.name} must hold one distinct, "
                                        f"non-empty string per result ({n}), got "
                                        f"{attr_to_str(recorded)}")
    return list(recorded)


# bench's default: 200 timed runs or 10 s, whichever comes first; a p99 over fewer than 100
# samples is (nearly) their maximum, and bench says so.
BENCH_SAMPLES, BENCH_SECONDS, MIN_P99_SAMPLES = 200, 10.0, 100


def cmd_bench(args: argparse.Namespace) -> int:
    import json

    import numpy as np

    import mplower.dialect  # noqa: F401  (registers the mp ops)
    from mplower.ir.opdef import OPS
    from mplower.lowering.target import module_target
    from mplower.lowering.throughput import SeqAxisError, rate_text, units
    from mplower.numerics.metrics import finite_or_none
    from mplower.report.sheet import precision_sheet

    samples = args.samples if args.samples is not None else BENCH_SAMPLES
    budget = args.time_budget if args.time_budget is not None else (
        None if args.samples is not None else BENCH_SECONDS)
    if samples < 1 or args.warmup < 0 or (budget is not None and not budget > 0):
        raise UsageError("--samples must be at least 1, --warmup at least 0 and --time-budget "
                         "positive")
    module, program, arrays = _load(args, "bench")
    target = module_target(module, args.target, known_ops=OPS)
    try:
        u = units(program.function, args.seq_axis)
    except SeqAxisError as e:
        raise UsageError(str(e)) from None
    prepared = program.prepare_inputs(arrays)
    for _ in range(args.warmup):
        program.run_lowered(prepared)
    times: list[float] = []
    start = time.perf_counter()
    while not times or (len(times) < samples
                        and (budget is None or time.perf_counter() - start < budget)):
        t0 = time.perf_counter()
        program.run_lowered(prepared)
        times.append(time.perf_counter() - t0)
    ms = np.array(times) * 1e3
    modeled = precision_sheet(module, target, program.function.name,
                              seq_axis=args.seq_axis)["summary"]
    measured_rate = float(1e3 / np.median(ms))
    out = {
        "function": program.function.name,
        "samples": len(times),
        "warmup": args.warmup,
        "time_budget_s": budget,
        "latency_ms": {p: float(np.percentile(ms, q)) for p, q in
                       (("p50", 50), ("p95", 95), ("p99", 99))},
        "inferences_per_s": measured_rate,
        "batch": u.samples,
        "tokens_per_inference": u.tokens,
        **u.rates(measured_rate),
        "modeled": {"target": target.name, "time_s": modeled["modeled_time_s"],
                    "inferences_per_s": finite_or_none(modeled["modeled_inferences_per_s"]),
                    **u.rates(finite_or_none(modeled["modeled_inferences_per_s"]))},
    }
    if len(times) < MIN_P99_SAMPLES:
        print(f"{args.input}: warning: p99 rests on {len(times)} samples (fewer than "
              f"{MIN_P99_SAMPLES}: it is near the maximum); give --samples or a longer "
              "--time-budget", file=sys.stderr)
    if args.format == "json":
        sys.stdout.write(json.dumps(out, indent=2, allow_nan=False) + "\n")
    else:
        lat = out["latency_ms"]
        sys.stdout.write(
            f"measured ({out['samples']} samples, emulated on this CPU): "
            f"p50 {lat['p50']:.3f} ms, p95 {lat['p95']:.3f} ms, p99 {lat['p99']:.3f} ms, "
            f"{rate_text(measured_rate, u)}\n"
            f"modeled on {target.name}: {out['modeled']['time_s'] * 1e6:.3f} us, "
            f"{rate_text(modeled['modeled_inferences_per_s'], u)}\n")
    return EXIT_OK
