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
    llm = p.add_argument_group("serving a decoder LLM (a module with @prefill and @decode: "
                               "docs/serving.md)")
    llm.add_argument("--phase", choices=("prefill", "decode"),
                     help="report @prefill (time to first token) or one @decode step "
                          "(inter-token latency, tokens/s)")
    llm.add_argument("--batch", type=_positive, metavar="B",
                     help="sequences per call (default: the module's)")
    llm.add_argument("--context", type=_positive, metavar="C",
                     help="cached positions a decode step reads (default: the module's)")
    llm.add_argument("--prompt", type=_positive, metavar="P",
                     help="prompt tokens (the module's @prefill length: import --seq P)")
    llm.add_argument("--generate", type=_positive, metavar="G",
                     help="tokens generated per request: an end-to-end figure (TTFT + the "
                          "decode steps at growing context)")
    return p


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def cmd_report(args: argparse.Namespace) -> int:
    import mplower.dialect  # noqa: F401  (registers the mp ops)
    from mplower.ir.opdef import OPS
    from mplower.lowering.target import module_target
    from mplower.lowering.throughput import SeqAxisError
    from mplower.report.sheet import precision_sheet, render

    point = [f"--{k}" for k in ("batch", "context", "prompt", "generate")
             if getattr(args, k) is not None]
    if args.phase is None and point:
        raise UsageError(f"{point[0]} sets a serving point: it needs --phase prefill|decode")
    if args.phase is not None and args.func is not None:
        raise UsageError("--phase picks the function (@prefill or @decode); drop --func")
    if args.phase is not None:
        args.func = args.phase
    module = read_module(args)
    target = module_target(module, args.target, known_ops=OPS)
    if args.phase is not None:
        from mplower.report.serving import serving_sheet

        sheet = serving_sheet(module, target, args.phase, batch=args.batch,
                              context=args.context, prompt=args.prompt, generate=args.generate)
        write_output(args.output, render(sheet, args.format))
        return EXIT_OK
    try:  # read_module checked the function
        sheet = precision_sheet(module, target, args.func, seq_axis=args.seq_axis)
    except SeqAxisError as e:
        raise UsageError(str(e)) from None
    write_output(args.output, render(sheet, args.format))
    return EXIT_OK

