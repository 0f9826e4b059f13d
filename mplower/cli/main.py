"""The `mplower` command: opt, passes (and the backend, frontend and report commands).

Conventions follow mlir-opt: the IR goes to stdout or `-o`, diagnostics and instrumentation to
stderr. Exit codes: 0 success, 1 bad input (located diagnostics were printed), 2 usage error,
3 a guardrail failed under `--check`. Outputs are written atomically and only when the whole
run succeeded, so a failing run never touches the `-o` file. No Python traceback reaches the
user; an internal error is reported as one and exits 1.
"""

from __future__ import annotations

import argparse
import difflib
import gc
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from mplower.ir.diagnostics import Diagnostic, DiagnosticError, Location, did_you_mean
from mplower.pass_manager import PluginError, PluginWarning

EXIT_OK, EXIT_INPUT, EXIT_USAGE, EXIT_GUARDRAIL = 0, 1, 2, 3


class UsageError(Exception):
    pass


class _PassAction(argparse.Action):
    """--pass, -p and --pass-pipeline append to one ordered list of pipeline pieces."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = getattr(namespace, "pipeline", None) or []
        items.append(values)
        namespace.pipeline = items


def _opt_parser(sub) -> None:
    p = sub.add_parser("opt", help="run passes over an IR file (mlir-opt style)",
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
    p.set_defaults(handler=cmd_opt)


def _passes_parser(sub) -> None:
    p = sub.add_parser("passes", help="list every pass with its options")
    p.add_argument("--format", choices=("text", "markdown"), default="text")
    p.set_defaults(handler=cmd_passes)


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that names the closest option when one is misspelt (`--print-ir-afer-all`)."""

    _argv: Sequence[str] = ()

    def parse_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            known = [s for a in self._command()._actions for s in a.option_strings]
            for arg in message[len(prefix):].split():
                close = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1)
                if arg.startswith("-") and close:
                    message += f"; did you mean '{close[0]}'?"
                    break
        super().error(message)

    def _command(self) -> argparse.ArgumentParser:
        """The parser of the subcommand on the command line, or this one."""
        for a in self._actions:
            if isinstance(a, argparse._SubParsersAction):
                for word in self._argv:
                    if word in a.choices:
                        return a.choices[word]
        return self


# The runtime dependencies whose versions change mplower's numbers or what it accepts.
_VERSIONED = ("numpy", "numba", "onnx", "networkx", "lark")


def version_text() -> str:
    """`mplower X.Y.Z` and, as mlir-opt names its LLVM, the versions it runs with."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:  # run from a source tree that was never installed
            return "unknown (not installed)"

    deps = ", ".join(f"{d} {of(d)}" for d in _VERSIONED)
    return f"mplower {of('mplower')}\n  with {deps}; Python {platform.python_version()}\n"


class _VersionAction(argparse.Action):
    """argparse's version action, but the versions are only looked up when asked for."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(version_text())
        parser.exit(EXIT_OK)


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog="mplower", description="Precision lowering for an MLIR-style IR.")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the versions of mplower and its numeric libraries and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _opt_parser(sub)
    _passes_parser(sub)
    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    """The other command groups, one module each in this package (docs/architecture.md)."""
    from mplower.cli import onnx, report, run

    return [report.register, run.register, onnx.register]


def read_input(path: str) -> tuple[str, str]:
    """(text, display name) of a file or stdin; undecodable bytes are a located diagnostic."""
    from mplower.ir.parser import decode_source

    if path == "-":
        return decode_source(sys.stdin.buffer.read(), "<stdin>"), "<stdin>"
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise DiagnosticError(Diagnostic(Location(path, 0, 0),
                                         f"cannot read input: {e.strerror}")) from None
    return decode_source(data, path), path


def write_output(path: str, text: str) -> None:
    from mplower.io.atomic import write_text_atomic

    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        try:
            write_text_atomic(path, text)
        except OSError as e:
            raise DiagnosticError(Diagnostic(Location(path, 0, 0),
                                             f"cannot write output: {e.strerror}")) from None


def _reference_runner(module, func, weights):
    """The backend's fp32 reference for calibrate, imported only when a pass runs the model."""
    from mplower.backend.executor import reference_runner

    return reference_runner(module, func, weights)


def cmd_opt(args: argparse.Namespace) -> int:
    from mplower.ir import expected
    from mplower.ir.parser import parse, split_source
    from mplower.ir.printer import print_module
    from mplower.ir.verifier import verify
    from mplower.pass_manager import (
        Instrumentation,
        PassContext,
        PassManager,
        PipelineError,
        format_statistics,
        format_timing,
        load_passes,
        parse_pipeline,
    )

    try:
        passes = [p for piece in (args.pipeline or []) for p in parse_pipeline(piece)]
    except PipelineError as e:
        raise UsageError(str(e)) from None
    known = load_passes()
    for flag, names in (("--print-ir-before", args.print_ir_before),
                        ("--print-ir-after", args.print_ir_after)):
        for name in names:  # a misspelt name would silently print nothing
            if name not in known:
                raise UsageError(f"{flag}: unknown pass '{name}'{did_you_mean(name, known)}")
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
    for chunk, offset in chunks:
        pm = PassManager(passes, inst)
        emitted: list[Diagnostic] = []
        try:
            t0 = time.perf_counter()
            module = parse(chunk, name, line_offset=offset)
            module.path = name if name != "<stdin>" else str(Path.cwd() / "<stdin>")
            timings.append(("Parser", time.perf_counter() - t0))
            t0 = time.perf_counter()
            verify(module)
            timings.append(("(verify)", time.perf_counter() - t0))
            ctx = PassContext(output_path=None if args.output == "-" else args.output,
                              weights_path=args.weights, runner=_reference_runner)
            pm.run(module, ctx)
            timings.extend(pm.timings)
            for k, v in pm.statistics.items():
                stats.setdefault(k, type(v)()).update(v)
            t0 = time.perf_counter()
            outputs.append(print_module(module, args.print_op_generic))
            timings.append(("Output", time.perf_counter() - t0))
        except DiagnosticError as e:
            emitted = e.diagnostics
        if args.verify_diagnostics:
            problems = expected.check(expected.collect(chunk, name, offset), emitted)
            if problems:
                failed = True
                _print_diags(problems, text)
        elif emitted:
            failed = True
            _print_diags(emitted, text)
    if args.timing:
        sys.stderr.write(format_timing(timings))
    if args.statistics:
        sys.stderr.write(format_statistics(stats))
    if failed:
        return EXIT_INPUT
    if args.verify_diagnostics and args.output == "-":
        return EXIT_OK
    t0 = time.perf_counter()
    write_output(args.output, "// -----\n".join(outputs))
    return EXIT_OK


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


def _print_diags(diags: Sequence[Diagnostic], source: str | None) -> None:
    for d in diags:
        sys.stderr.write(d.render(source) + "\n")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A skipped plugin is one `mplower: warning:` line, not Python's two-line warning."""
    if issubclass(category, PluginWarning):
        sys.stderr.write(f"mplower: warning: {message}\n")
    else:
        _python_show_warning(message, category, filename, lineno, file, line)


_python_show_warning = warnings.showwarning


def main(argv: Sequence[str] | None = None) -> int:
    warnings.showwarning = _show_warning
    # The IR's graphs and tensors hold no reference cycles, so the cyclic collector has
    # nothing to reclaim in a command's short life; each of its full passes costs time
    # proportional to the heap (a third of `opt` on a 100k-op module).
    gc.disable()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except UsageError as e:
        parser.print_usage(sys.stderr)
        sys.stderr.write(f"mplower: error: {e}\n")
        return EXIT_USAGE
    except PluginError as e:
        sys.stderr.write(f"mplower: error: {e}\n")
        return EXIT_INPUT
    except DiagnosticError as e:
        source = e.source if e.source is not None else getattr(args, "_source", None)
        _print_diags(e.diagnostics, source)
        return EXIT_INPUT
    except KeyboardInterrupt:
        sys.stderr.write("mplower: interrupted\n")
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (RecursionError, MemoryError) as e:
        sys.stderr.write(f"mplower: error: input too large or too deeply nested "
                         f"({type(e).__name__})\n")
        return EXIT_INPUT
    except Exception as e:  # a bug in mplower: say so, without a traceback
        if os.environ.get("MPLOWER_TRACEBACK"):
            raise
        sys.stderr.write(f"mplower: internal error: {type(e).__name__}: {e}\n"
                         "(set MPLOWER_TRACEBACK=1 to see where; please report it)\n")
        return EXIT_INPUT
