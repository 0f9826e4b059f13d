"""The `mplower` command: its command table, exit codes and the handling of every error.

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
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from mplower.cli import blocks, onnx, opt, perplexity, report, run, target, train, tune
from mplower.cli.common import (
    EXIT_INPUT,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    print_diagnostics,
    print_error_summary,
)
from mplower.ir.diagnostics import DEFAULT_ERROR_LIMIT, DiagnosticError, DiagnosticRenderer
from mplower.pass_manager import PluginError, PluginWarning

# Every command: the function that adds its subparser (given the name) and its handler, in the
# order `mplower --help` lists them. One module per command group; each imports what it shares
# from mplower.cli.common, and what is heavy (numpy, the parser, the passes) only when it runs.
COMMANDS: dict[str, tuple[Callable[[Any, str], argparse.ArgumentParser],
                          Callable[[argparse.Namespace], int]]] = {
    "opt": (opt.add_opt, opt.cmd_opt),
    "passes": (opt.add_passes, opt.cmd_passes),
    "report": (report.add_report, report.cmd_report),
    "run": (run.add_run, run.cmd_run),
    "bench": (run.add_bench, run.cmd_bench),
    "import": (onnx.add_import, onnx.cmd_import),
    "quantize-ckpt": (blocks.add_quantize_ckpt, blocks.cmd_quantize_ckpt),
    "export": (onnx.add_export, onnx.cmd_export),
    "perplexity": (perplexity.add_perplexity, perplexity.cmd_perplexity),
    "target": (target.add_target, target.cmd_target),
    "train": (train.add_train, train.cmd_train),
    "tune": (tune.add_tune, tune.cmd_tune),
}


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


def _one_blas_thread(args: argparse.Namespace) -> None:
    """Load numpy's OpenBLAS with one thread unless the user or the command wants more.

    mplower computes no float product through BLAS (numerics/gemm.py has its own; integers
    stay off BLAS), yet OpenBLAS starts a thread pool when numpy loads, about 0.1 s of CPU
    per command on this project's 2-core machine. `target measure` times numpy's BLAS as
    the host's reference and keeps the pool. Set before numpy loads, or never: a process
    that already has numpy (the Python API, tests calling main) keeps what it has.
    """
    if "numpy" in sys.modules or args.handler is COMMANDS["target"][1]:
        return
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog="mplower", description="Precision lowering for an MLIR-style IR.")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the versions of mplower and its numeric libraries and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (add, handler) in COMMANDS.items():
        add(sub, name).set_defaults(handler=handler)
    return parser


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
    _one_blas_thread(args)
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
        renderer = DiagnosticRenderer(getattr(args, "error_limit", DEFAULT_ERROR_LIMIT))
        print_diagnostics(e.diagnostics, source, renderer)
        print_error_summary(renderer, args)
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
        from mplower.numerics.cpu import jit_disabled

        if jit_disabled():
            sys.stderr.write(f"mplower: error: mplower's kernels run only compiled; unset "
                             f"NUMBA_DISABLE_JIT ({type(e).__name__}: {e})\n")
            return EXIT_USAGE
        sys.stderr.write(f"mplower: internal error: {type(e).__name__}: {e}\n"
                         "(set MPLOWER_TRACEBACK=1 to see where; please report it)\n")
        return EXIT_INPUT
