"""`mplower run` and `mplower bench`: execute a lowered module, report drift, time it."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np


def _input_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="IR file, or - for stdin")
    p.add_argument("--inputs", help=".npz keyed by argument name (x for %%x)")
    p.add_argument("--random-inputs", action="store_true",
                   help="standard-normal inputs (the default when --inputs is not given)")
    p.add_argument("--seed", type=int, default=0, help="seed for --random-inputs")
    p.add_argument("--weights", help="weights .npz to use instead of the module's mp.weights")
    p.add_argument("--func", default=None, help="function to run (default: main or the only one)")


def register(sub) -> None:
    p = sub.add_parser("run", help="execute a lowered module beside its fp32 reference",
                       description="Run the lowered function and its fp32 reference side by "
                                   "side; report per-op fallbacks, overflow and drift.")
    _input_flags(p)
    p.add_argument("--save-outputs", metavar="OUT.npz", help="write output_0, output_1, ...")
    p.add_argument("--report", metavar="R.json", help="write the JSON report here")
    p.add_argument("--format", choices=("table", "json", "markdown"), default="table",
                   help="format of the report printed on stdout")
    p.add_argument("--check", action="store_true", help="exit 3 if a guardrail fails")
    p.add_argument("--guardrail", action="append", default=[], metavar="KEY=VALUE",
                   help="a guardrail, e.g. max_rel_l2=0.01 (overrides the policy sheet's)")
    p.set_defaults(handler=cmd_run)

    b = sub.add_parser("bench", help="latency percentiles and inferences/s, measured and modeled")
    _input_flags(b)
    b.add_argument("--warmup", type=int, default=3)
    b.add_argument("--iterations", "-n", type=int, default=20)
    b.add_argument("--target", default=None, help="target for the modeled figures")
    b.add_argument("--format", choices=("table", "json"), default="table")
    b.set_defaults(handler=cmd_bench)


def _load(args: argparse.Namespace):
    from mplower.backend.executor import Program
    from mplower.backend.weights import check_finite, load_inputs
    from mplower.cli import read_input
    from mplower.ir.parser import parse
    from mplower.ir.verifier import verify

    text, name = read_input(args.input)
    args._source = text
    module = parse(text, name)
    if name == "<stdin>":
        module.path = str(Path.cwd() / "<stdin>")
    verify(module)
    program = Program(module, args.func, args.weights)
    if args.inputs:
        arrays = load_inputs(args.inputs, program.arg_names, [t.shape for t in program.arg_types])
    else:
        rng = np.random.default_rng(args.seed)
        arrays = [rng.standard_normal(t.shape).astype(np.float32) for t in program.arg_types]
    for n, a in zip(program.arg_names, arrays):
        check_finite(n, a)
    return module, program, arrays


def _guardrails(module, flags: list[str]) -> dict[str, float]:
    from mplower.backend.report import GUARDRAIL_KEYS
    from mplower.cli import UsageError
    from mplower.policy import load_policy

    limits: dict[str, float] = {}
    policy = module.attrs.get("mp.policy")
    if isinstance(policy, str):
        limits.update(load_policy(policy, search_dir=Path(module.path).parent).guardrails)
    for flag in flags:
        key, sep, value = flag.partition("=")
        if not sep or key not in GUARDRAIL_KEYS:
            raise UsageError(f"--guardrail takes KEY=VALUE with KEY one of "
                             f"{', '.join(GUARDRAIL_KEYS)}; got '{flag}'")
        try:
            limits[key] = float(value)
        except ValueError:
            raise UsageError(f"--guardrail {key} needs a number, got '{value}'") from None
    return limits


def cmd_run(args: argparse.Namespace) -> int:
    from mplower.backend.report import build_report, render
    from mplower.cli import EXIT_GUARDRAIL, EXIT_OK, write_output
    from mplower.fileio import atomic_output

    module, program, arrays = _load(args)
    limits = _guardrails(module, args.guardrail)
    result = program.run(arrays)
    report = build_report(result, limits, module.attrs.get("mp.policy"))
    if args.save_outputs:
        with atomic_output(args.save_outputs, "wb") as fh:
            np.savez(fh, **{f"output_{i}": y for i, y in enumerate(result.outputs)})
    if args.report:
        write_output(args.report, render(report, "json"))
    sys.stdout.write(render(report, args.format))
    if args.check and report["summary"]["verdict"] != "pass":
        return EXIT_GUARDRAIL
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    import json

    from mplower.ops import OPS
    from mplower.report import precision_sheet
    from mplower.target import load_target

    module, program, arrays = _load(args)
    prepared = program.prepare_inputs(arrays)
    for _ in range(max(args.warmup, 0)):
        program.run_lowered(prepared)
    times = []
    for _ in range(max(args.iterations, 1)):
        t0 = time.perf_counter()
        program.run_lowered(prepared)
        times.append(time.perf_counter() - t0)
    ms = np.array(times) * 1e3
    target = load_target(args.target or module.attrs.get("mp.target", "generic"), known_ops=OPS)
    modeled = precision_sheet(module, target, args.func)["summary"]
    out = {
        "iterations": len(times),
        "latency_ms": {p: float(np.percentile(ms, q)) for p, q in
                       (("p50", 50), ("p95", 95), ("p99", 99))},
        "inferences_per_s": float(1e3 / np.median(ms)),
        "modeled": {"target": target.name, "time_s": modeled["modeled_time_s"],
                    "inferences_per_s": modeled["modeled_inferences_per_s"]},
    }
    if args.format == "json":
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    else:
        lat = out["latency_ms"]
        sys.stdout.write(
            f"measured ({out['iterations']} iterations, emulated on this CPU): "
            f"p50 {lat['p50']:.3f} ms, p95 {lat['p95']:.3f} ms, p99 {lat['p99']:.3f} ms, "
            f"{out['inferences_per_s']:.1f} inferences/s\n"
            f"modeled on {target.name}: {out['modeled']['time_s'] * 1e6:.3f} us, "
            f"{out['modeled']['inferences_per_s']:.1f} inferences/s\n")
    return 0
