"""`mplower opt` (parse, verify, run a pass pipeline, print the IR; mlir-opt style) and
`mplower passes` (the pass library with its options).

`opt` writes the IR to stdout or `-o` and its instrumentation (`--timing`, `--statistics`,
`--print-ir-*`) to stderr. With `--split-input-file` each `// -----` chunk is a module of its
own; with `--verify-diagnostics` the diagnostics are checked against `// expected-error`
comments instead of printed, as in mlir-opt.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mplower.cli.common import (
    EXIT_INPUT,
    EXIT_OK,
    UsageError,
    check_outputs,
    parse_module,
    print_diagnostics,
    print_error_summary,
    read_input,
    weights_beside,
    write_output,
    writes_outputs,
)
from mplower.ir.diagnostics import (
    DEFAULT_ERROR_LIMIT,
    Diagnostic,
    DiagnosticError,
    DiagnosticRenderer,
    did_you_mean,
)


class _PassAction(argparse.Action):
    """--pass, -p and --pass-pipeline append to one ordered list of pipeline pieces."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = getattr(namespace, "pipeline", None) or []
        items.append(values)
        namespace.pipeline = items


def add_opt(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="run passes over an IR file (mlir-opt style)",
                       description="Parse, verify, run a pass pipeline and print the IR.")
    p.add_argument("input", help="IR file, or - for stdin")
    p.add_argument("--pass", "-p", dest="pipeline", action=_PassAction, metavar="NAME{k=v ...}",
                   help="run a pass (repeatable, in order)")
    p.add_argument("--pass-pipeline", dest="pipeline", action=_PassAction, metavar="PIPELINE",
                   help='comma-separated passes, e.g. "canonicalize,cse"')
    p.add_argument("-o", dest="output", default="-", help="output file (default stdout)")
    p.add_argument("--print-op-generic", action="store_true", help="print ops in generic form")
    p.add_argument("--print-ir-after-all", action="store_true")
    p.add_argument("--print-ir-before-all", action="store_true")
    p.add_argument("--print-ir-after", action="append", default=[], metavar="PASS")
    p.add_argument("--print-ir-before", action="append", default=[], metavar="PASS")
    p.add_argument("--verify-each", dest="verify_each", action="store_true", default=True,
                   help="verify after every pass (default)")
    p.add_argument("--no-verify-each", dest="verify_each", action="store_false")
    p.add_argument("--timing", action="store_true", help="per-pass wall time report")
    p.add_argument("--statistics", action="store_true", help="per-pass statistics report")
    p.add_argument("--split-input-file", action="store_true",
                   help="treat each '// -----' chunk as a separate input")
    p.add_argument("--verify-diagnostics", action="store_true",
                   help="check emitted diagnostics against // expected-error comments")
    p.add_argument("--weights", help="weights .npz to use instead of the module's mp.weights")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--workers", type=int, default=0, metavar="N",
                       help="run the sample shards of the passes that run the model "
                            "(calibrate) on a dask LocalCluster of N workers (0: in this "
                            "process); the output is the same")
    where.add_argument("--scheduler", metavar="ADDRESS",
                       help="run them on a running dask cluster (tcp://host:port)")
    p.add_argument("--error-limit", type=int, default=DEFAULT_ERROR_LIMIT, metavar="N",
                   help=f"stop showing errors after N (default {DEFAULT_ERROR_LIMIT}; 0: all)")
    return p


def add_passes(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="list every pass with its options")
    p.add_argument("--format", choices=("text", "markdown"), default="text")
    return p


def _reference_runner(module, func, weights):
    """The backend's fp32 reference for calibrate, imported only when a pass runs the model."""
    from mplower.backend.executor import reference_runner

    return reference_runner(module, func, weights)


@writes_outputs
def cmd_opt(args: argparse.Namespace) -> int:
    from mplower.ir import expected
    from mplower.ir.parser import split_source
    from mplower.ir.printer import print_module
    from mplower.lowering.sharding import executor_for
    from mplower.pass_manager import (
        Instrumentation,
        PassContext,
        PassManager,
        PipelineError,
        find_pass,
        format_statistics,
        format_timing,
        load_passes,
        parse_pipeline,
    )

    try:
        passes = [p for piece in (args.pipeline or []) for p in parse_pipeline(piece)]
    except PipelineError as e:
        raise UsageError(str(e)) from None
    for flag, names in (("--print-ir-before", args.print_ir_before),
                        ("--print-ir-after", args.print_ir_after)):
        for name in names:  # a misspelt name would silently print nothing
            if find_pass(name) is None:
                raise UsageError(f"{flag}: unknown pass '{name}'"
                                 f"{did_you_mean(name, load_passes())}")
    if args.error_limit < 0:
        raise UsageError("--error-limit must be a count of errors, or 0 for no limit")
    if args.workers < 0:
        raise UsageError("--workers must be 0 (this process) or more")
    if args.output != "-":  # a pass may write the weights beside it
        weights_beside("-o", args.output)
    in_place = args.output != "-" and args.input != "-" and \
        Path(args.output).resolve() == Path(args.input).resolve()
    # The input's weights are protected too, once a chunk is parsed; in place, the module and
    # its weights are replaced as a whole.
    check_outputs({"-o": args.output},
                  {} if in_place else {"input": args.input, "--weights": args.weights})
    renderer = DiagnosticRenderer(args.error_limit)
    timings: list[tuple[str, float]] = []
    t0 = time.perf_counter()
    text, name = read_input(args.input)
    timings.append(("Read input", time.perf_counter() - t0))
    chunks = split_source(text) if args.split_input_file else [(text, 0)]
    outputs: list[str] = []
    failed = False
    inst = Instrumentation(
        print_before=set(args.print_ir_before), print_after=set(args.print_ir_after),
        print_after_all=args.print_ir_after_all, print_before_all=args.print_ir_before_all,
        generic=args.print_op_generic, verify_each=args.verify_each)
    stats = {}
    # A LocalCluster starts (and dask is imported) only when a pass submits work to it; a
    # scheduler's address is checked before any pass runs.
    executor = executor_for(args.workers, args.scheduler)
    if args.scheduler is not None:
        executor.start()
    try:
        for chunk, offset in chunks:
            pm = PassManager(passes, inst)
            emitted: list[Diagnostic] = []
            source = text
            try:
                module = parse_module(chunk, name, offset, timings)
                if not in_place:
                    _protect_weights(module, args.weights)
                ctx = PassContext(output_path=None if args.output == "-" else args.output,
                                  weights_path=args.weights, runner=_reference_runner,
                                  executor=executor)
                pm.run(module, ctx)
                timings.extend(pm.timings)
                for k, v in pm.statistics.items():
                    stats.setdefault(k, type(v)()).update(v)
                t0 = time.perf_counter()
                outputs.append(print_module(module, args.print_op_generic))
                timings.append(("Output", time.perf_counter() - t0))
            except DiagnosticError as e:
                emitted = e.diagnostics
                source = e.source if e.source is not None else text  # a sheet's own text
            if args.verify_diagnostics:
                problems = expected.check(expected.collect(chunk, name, offset), emitted)
                if problems:
                    failed = True
                    print_diagnostics(problems, text, renderer)
            elif emitted:
                failed = True
                print_diagnostics(emitted, source, renderer)
    finally:
        executor.close()
    print_error_summary(renderer, args)
    if args.timing:
        sys.stderr.write(format_timing(timings))
    if args.statistics:
        sys.stderr.write(format_statistics(stats))
    if failed:
        return EXIT_INPUT
    if args.verify_diagnostics and args.output == "-":
        return EXIT_OK
    write_output(args.output, "// -----\n".join(outputs))
    return EXIT_OK


def _protect_weights(module, override: str | None) -> None:
    """No pass may write its new weights over the file the input module reads them from."""
    from mplower.io.atomic import active_output_set
    from mplower.io.npz import weights_file

    try:
        path = weights_file(module, override)
    except DiagnosticError:  # a bad mp.weights is an error only where the weights are read
        return
    outputs = active_output_set()
    if path is not None and outputs is not None:
        outputs.protect(path, "the weights file of the input module")


def cmd_passes(args: argparse.Namespace) -> int:
    from mplower.pass_manager import load_passes, pass_options

    passes = load_passes()
    if args.format == "markdown":
        from mplower.docgen import passes_markdown

        sys.stdout.write(passes_markdown())
        return EXIT_OK
    for name in sorted(passes):
        cls = passes[name]
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        print(f"{name}  -  {doc}")
        for opt, tname, default, help_ in pass_options(cls):
            print(f"    {opt}: {tname} = {default!r}  {help_}")
    return EXIT_OK
