"""`mplower target`: target sheets. `mplower target measure` times this machine and writes a
target sheet for it (mplower/backend/measure.py, docs/targets.md "Measured host target")."""

from __future__ import annotations

import argparse
import shlex

from mplower.cli.common import EXIT_OK, UsageError, check_outputs, write_output, writes_outputs


def add_target(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="target sheets: measure this machine",
                       description="Commands on target sheets (docs/targets.md).")
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    m = actions.add_parser("measure", help="time this machine and write its target sheet",
                           description="Time GEMM per format, conv, memory bandwidth and the "
                                       "per-op overhead of a runtime on this machine and write "
                                       "a target sheet that --target and legalize accept.")
    m.add_argument("-o", dest="output", default="-", help="output file (default stdout)")
    m.add_argument("--runtime", choices=("mplower", "onnxruntime"), default="mplower",
                   help="what the sheet describes: mplower's executor (default) or "
                        "onnxruntime's CPU provider running exported models")
    m.add_argument("--name", default="host", help="the target's name (default host)")
    m.add_argument("--quick", action="store_true",
                   help="tiny shapes, a fraction of a second (rates far below the real ones)")
    return p


@writes_outputs
def cmd_target(args: argparse.Namespace) -> int:
    from mplower.backend.measure import measure_host, onnxruntime_available, sheet_text
    from mplower.ir.opdef import OPS
    from mplower.lowering.target import parse_target

    if args.runtime == "onnxruntime" and not onnxruntime_available():
        raise UsageError("--runtime onnxruntime needs the onnxruntime package "
                         "(pip install onnxruntime)")
    if not args.name or not args.name.isprintable():  # it also goes in the header comment
        raise UsageError(f"--name must be one line of printable text, got {args.name!r}")
    check_outputs({"-o": args.output})  # before the minutes of measuring
    measured = measure_host(quick=args.quick)  # every runtime: the others for comparison
    flags = [f"--runtime {args.runtime}", f"--name {shlex.quote(args.name)}"] + \
        ["--quick"] * args.quick + ([f"-o {shlex.quote(args.output)}"] * (args.output != "-"))
    command = " ".join(["mplower target measure", *flags])
    text = sheet_text(measured, args.runtime, args.name, command=command)
    # What is written must load: checked by the loader itself before the file is touched.
    parse_target(text, args.output if args.output != "-" else "<stdout>", known_ops=OPS)
    write_output(args.output, text)
    return EXIT_OK
