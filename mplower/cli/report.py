"""`mplower report`: print the precision policy sheet of a module (see mplower/report/sheet.py)."""

from __future__ import annotations

import argparse

from mplower.cli.common import EXIT_OK, UsageError, read_module, write_output


def add_report(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="the precision policy sheet of a (lowered) module",
                       description="One row per op: compute format, accumulator, kernel, "
                                   "reason, FLOPs and modeled time on a target.")
    p.add_argument("input", help="IR file, or - for stdin")
    p.add_argument("--target", default=None,
                   help="target for the cost model (default: the module's mp.target, or generic)")
    p.add_argument("--format", choices=("table", "markdown", "csv", "json"), default="table")
    p.add_argument("--func", default=None, help="function to report (default: main or the only one)")
    p.add_argument("-o", dest="output", default="-", help="output file (default stdout)")
    p.add_argument("--seq-axis", type=int, default=None, metavar="AXIS",
                   help="axis of the first argument that holds the sequence: tokens/s counts "
                        "its dimensions up to this one (default: found from attention)")
    return p


def cmd_report(args: argparse.Namespace) -> int:
    import mplower.dialect  # noqa: F401  (registers the mp ops)
    from mplower.ir.opdef import OPS
    from mplower.lowering.target import module_target
    from mplower.lowering.throughput import SeqAxisError
    from mplower.report.sheet import precision_sheet, render

    module = read_module(args)
    target = module_target(module, args.target, known_ops=OPS)
    try:  # read_module checked the function
        sheet = precision_sheet(module, target, args.func, seq_axis=args.seq_axis)
    except SeqAxisError as e:
        raise UsageError(str(e)) from None
    write_output(args.output, render(sheet, args.format))
    return EXIT_OK

