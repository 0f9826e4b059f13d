"""What every `mplower` command shares: exit codes, usage errors, and the start and end of a run.

A command that works on an IR module starts with `read_module`: the file or `-` for stdin,
decoded, parsed and verified, every problem a located diagnostic. A command that writes is
wrapped in `writes_outputs`, checks its outputs with `check_outputs` before the work, and
writes with `write_output` or `write_atomic`, which stage the files (and stdout for `-`) until
the whole run has succeeded, then commit them together. Command modules import
these from here, never from `mplower.cli.main`, which imports them (and so cannot be imported
back without a cycle). Importing this module is cheap: the parser and the verifier load when a
command reads its input.
"""

from __future__ import annotations

import argparse
import errno
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from mplower.ir.diagnostics import (
    Diagnostic,
    DiagnosticError,
    DiagnosticRenderer,
    Location,
)

if TYPE_CHECKING:
    from mplower.ir.graph import Module

EXIT_OK, EXIT_INPUT, EXIT_USAGE, EXIT_GUARDRAIL = 0, 1, 2, 3
STDIN = "<stdin>"


class UsageError(Exception):
    """A command line that cannot run: usage and the message, exit 2."""


def input_name(path: str) -> str:
    """The name diagnostics give the input `path`: `<stdin>` for `-`."""
    return STDIN if path == "-" else path


def read_input(path: str) -> tuple[str, str]:
    """(text, display name) of a file or `-` (stdin); undecodable bytes are a located
    diagnostic."""
    from mplower.ir.parser import decode_source

    if path == "-":
        return decode_source(sys.stdin.buffer.read(), STDIN), STDIN
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise DiagnosticError(Diagnostic(Location(path, 0, 0),
                                         f"cannot read input: {e.strerror}")) from None
    return decode_source(data, path), path


def parse_module(text: str, name: str, line_offset: int = 0,
                 timings: list[tuple[str, float]] | None = None) -> Module:
    """The verified module of `text` read from `name`. Files it names (`mp.weights`,
    `mp.policy`, `mp.target`) are relative to its file's folder, for stdin the current one.
    `timings` gets the parser's and the verifier's wall time (`opt --timing`)."""
    import mplower.dialect  # noqa: F401  (registers the mp ops the verifier checks against)
    from mplower.ir.parser import parse
    from mplower.ir.verifier import verify

    t0 = time.perf_counter()
    module = parse(text, name, line_offset=line_offset)
    module.path = str(Path.cwd() / STDIN) if name == STDIN else name
    t1 = time.perf_counter()
    verify(module)
    if timings is not None:
        timings += [("Parser", t1 - t0), ("(verify)", time.perf_counter() - t1)]
    return module


def read_module(args: argparse.Namespace) -> Module:
    """The verified module of the command's `input` argument (a file or `-`). Its text is
    kept on `args` so that `main` shows source lines with later diagnostics. A command with
    `--func` learns here, before any work, that the function it would run is missing."""
    text, name = read_input(args.input)
    args._source = text
    module = parse_module(text, name)
    if "func" in vars(args):
        check_function(module, args.func, name)
    return module


def check_function(module: Module, func: str | None, name: str) -> None:
    """The function `--func` names (`func`), or by default `main` or the only one, exists in
    `module` read from `name`: an unknown `--func` is a usage error naming the functions there
    are; a file without a function, or with several and none `main`, a diagnostic at it."""
    from mplower.ir.diagnostics import did_you_mean

    have = ", ".join(f"@{f}" for f in module.functions) or "none"
    if func is not None:
        if func not in module.functions:
            raise UsageError(f"--func: {name} has no function @{func}"
                             f"{did_you_mean(func, module.functions)} (it has: {have})")
        return
    if "main" in module.functions or len(module.functions) == 1:
        return
    if not module.functions:
        raise DiagnosticError.at(Location(name, 1, 1), f"{name} holds no function "
                                                       f"(expected a func.func)")
    raise DiagnosticError.at(module.loc, f"{name} has several functions and none is @main "
                                         f"(it has: {have}); pick one with --func")


# What `run`, `bench` and `export` say when they run insert-casts on a plan that is only
# annotations (STYLE rule 8: a command that transforms the module names the step).
MATERIALIZED = ("materialized the plan with insert-casts (the module has mp.precision "
                "annotations but no casts; `mplower opt --pass=insert-casts` prints the module "
                "that ran)")


def materialize_and_say(module: Module, args: argparse.Namespace, command: str) -> bool:
    """Run insert-casts on `module` when its plan is only annotations, and say so on stderr
    (`FILE: note: COMMAND ...`); True if it ran."""
    from mplower.passes.insert_casts import materialize

    ran = materialize(module)
    if ran:
        sys.stderr.write(f"{input_name(args.input)}: note: {command} {MATERIALIZED}\n")
    return ran


def seed(text: str) -> int:
    """argparse type of `--seed`: numpy's generators take no negative seed."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: '{text}'") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def writes_outputs(cmd: Callable[[argparse.Namespace], int]
                   ) -> Callable[[argparse.Namespace], int]:
    """Run the command `cmd` with every output it writes (through `write_output`,
    `write_atomic`, a pass's weights) staged in one output set (mplower.io.atomic), committed
    together when it returns 0 or 3 (a guardrail verdict is a result) and discarded otherwise:
    a failed, interrupted or terminated run changes no existing file and prints nothing on
    stdout for `-`. Two outputs on one path, or an output on an input, are a usage error."""

    @functools.wraps(cmd)
    def run(args: argparse.Namespace) -> int:
        from mplower.io.atomic import CommitError, OutputCollision, output_set

        try:
            with output_set() as outputs:
                rc = cmd(args)
                if rc in (EXIT_OK, EXIT_GUARDRAIL):
                    outputs.commit()
                return rc
        except OutputCollision as e:
            raise UsageError(str(e)) from None
        except CommitError as e:
            raise DiagnosticError.at(Location(str(e.filename), 0, 0),
                                     f"cannot write output: {e.strerror}") from None
    return run


def check_outputs(outputs: dict[str, str | Path | None],
                  inputs: dict[str, str | Path | None] | None = None,
                  binary: Sequence[str] = ()) -> None:
    """Before any work: every output `flag -> path` can be written, and none is another's
    path or an input's. `-` is stdout for every output: at most one may take it, and one of
    the `binary` flags only when stdout is not a terminal. A missing or unwritable folder is
    the diagnostic the write itself would give; the rest are usage errors."""
    from mplower.io.atomic import active_output_set

    dashes = [flag for flag, path in outputs.items() if path is not None and str(path) == "-"]
    if len(dashes) > 1:
        raise UsageError(f"{' and '.join(dashes)} both write to stdout ('-'); give all but one "
                         f"of them a file")
    for flag in dashes:
        if flag in binary and sys.stdout.isatty():
            raise UsageError(f"{flag} -: binary output goes to stdout only through a pipe or a "
                             f"redirection, not to a terminal")
    files = {flag: Path(path) for flag, path in outputs.items()
             if path is not None and str(path) != "-"}
    for flag, path in files.items():
        check_writable(path)
    seen: dict[Path, str] = {}
    for flag, path in files.items():
        key = Path(os.path.normcase(path.resolve()))
        if key in seen:
            raise UsageError(f"{seen[key]} and {flag} are the same file ({path}); one would "
                             f"replace the other")
        seen[key] = flag
    outputs_set = active_output_set()
    for flag, path in (inputs or {}).items():
        if path is None or str(path) == "-":
            continue
        key = Path(os.path.normcase(Path(path).resolve()))
        if key in seen:
            raise UsageError(f"{seen[key]} {path} is the input {flag}; mplower does not write "
                             f"over an input of the command")
        if outputs_set is not None:  # a pass's weights beside -o must not land there either
            outputs_set.protect(path, f"the input {flag}")


def check_writable(path: str | Path) -> None:
    """A located diagnostic now, not after the work, when `path` cannot be written: its folder
    is missing or not writable, or `path` is a folder."""
    path = Path(path)
    parent = path.parent
    if path.is_dir():
        code = errno.EISDIR
    elif not parent.is_dir():
        code = errno.ENOTDIR if parent.exists() else errno.ENOENT
    elif not os.access(parent, os.W_OK | os.X_OK):
        code = errno.EACCES
    else:
        return
    raise DiagnosticError.at(Location(str(path), 0, 0),
                             f"cannot write output: {os.strerror(code)}")


def weights_beside(flag: str, path: str) -> Path:
    """The weights file that goes beside the IR output `path`, `<stem>.npz`; refused when it
    is `path` itself (`-o NAME.npz`), which would leave the IR text where the weights were."""
    from mplower.io.npz import beside

    weights = beside(path)
    if os.path.normcase(weights.name) == os.path.normcase(Path(path).name):
        raise UsageError(f"{flag} {path}: the module's weights go to <stem>.npz beside it, which "
                         f"is this file; name the IR file {weights.with_suffix('.ir').name}")
    return weights


def write_output(path: str | Path, data: str | bytes) -> None:
    """`data` (text or bytes) to stdout (`-`) or, atomically, to the file `path`; inside a
    command both wait for its commit."""
    from mplower.io.atomic import active_output_set

    raw = data.encode("utf-8") if isinstance(data, str) else data
    if str(path) != "-":
        write_atomic(path, lambda fh: fh.write(raw))
        return
    outputs = active_output_set()
    if outputs is not None:
        outputs.stdout(raw)
    elif isinstance(data, str):
        sys.stdout.write(data)
        sys.stdout.flush()
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()


def write_atomic(path: str | Path, write: Callable[[IO[Any]], object], mode: str = "wb") -> None:
    """Call `write` with a stage file that becomes `path` when the command commits (or at once
    outside a command); an OS error is a diagnostic at the file."""
    write_atomic_all([(path, write, mode)])


def write_atomic_all(files: Sequence[tuple[str | Path, Callable[[IO[Any]], object], str]]
                     ) -> None:
    """Write every `(path, write, mode)` as `write_atomic` does, all or none: each goes to a
    stage file first, and only when all of them are written are they renamed into place (by
    the command's commit), so a bad path among them leaves every file as it was."""
    import contextlib

    from mplower.io.atomic import atomic_output

    path: str | Path = ""  # the file being opened or written when an error comes
    try:
        with contextlib.ExitStack() as stack:
            for path, write, mode in files:
                write(stack.enter_context(atomic_output(path, mode)))
    except OSError as e:
        raise DiagnosticError.at(Location(str(path), 0, 0),
                                 f"cannot write output: {e.strerror or e}") from None


def print_diagnostics(diags: Sequence[Diagnostic], source: str | None,
                      renderer: DiagnosticRenderer | None = None) -> None:
    """Render to stderr through `renderer`, which counts errors against its limit across
    calls (a fresh one with the default limit when none is given)."""
    sys.stderr.write((renderer or DiagnosticRenderer()).render(diags, source))


def print_error_summary(renderer: DiagnosticRenderer, args: argparse.Namespace) -> None:
    """`mplower: N more errors not shown` when the renderer left some out."""
    summary = renderer.summary()
    if summary is not None:  # only `opt` has the flag; other commands show the default
        hint = "; --error-limit=0 shows all" if hasattr(args, "error_limit") else ""
        sys.stderr.write(f"mplower: {summary}{hint}\n")
