"""`mplower quantize-ckpt`: calibrate, quantize and evaluate a checkpoint folder one
transformer block at a time (mplower.hf.blocks), for models bigger than memory.

The pipeline is given as to `mplower opt` (`--pass`, `-p`, `--pass-pipeline`) and runs on each
block; a `calibrate` pass calibrates on the block's inputs (its `data` is the command's
`--data`, taken through the blocks before it). The report is `mplower run`'s (docs/report.md):
every op of every block, its name prefixed by the block's (`layers.3/%matmul_2`), and the
logits' drift against the checkpoint's fp32 reference. Outputs are written atomically, only
when the whole run succeeded.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mplower.cli.common import (
    EXIT_OK,
    UsageError,
    check_outputs,
    write_output,
    writes_outputs,
)
from mplower.cli.opt import _PassAction
from mplower.ir.diagnostics import DiagnosticError, Location


def add_quantize_ckpt(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="calibrate, quantize and evaluate a checkpoint folder block "
                                  "by block (models bigger than memory)",
                       description="Run a pass pipeline on an HF checkpoint folder one "
                                   "transformer block at a time: each block's weights are read "
                                   "from the memory-mapped safetensors when it runs and freed "
                                   "after it; the calibration sequences' activations go from "
                                   "block to block. Prints mplower run's report.")
    p.add_argument("input", metavar="CKPT_DIR", help="HF checkpoint folder (Llama family)")
    p.add_argument("--data", required=True, metavar="CALIB.npz",
                   help="input_ids [sequences, tokens]: the calibration (and evaluation) set")
    p.add_argument("--pass", "-p", dest="pipeline", action=_PassAction, metavar="NAME{k=v ...}",
                   help="run a pass on each block (repeatable, in order)")
    p.add_argument("--pass-pipeline", dest="pipeline", action=_PassAction, metavar="PIPELINE",
                   help='comma-separated passes, e.g. "quantize{scheme=w4a16 group=128}"')
    p.add_argument("--no-eval", action="store_true",
                   help="calibrate and quantize only: no plan is run, no report of drift")
    p.add_argument("--report", metavar="R.json", help="write the JSON report")
    p.add_argument("--timing", action="store_true",
                   help="wall time per block on stderr (mlir-opt's -mlir-timing report)")
    p.add_argument("--format", choices=["table", "json", "markdown"], default="table")
    return p


@writes_outputs
def cmd_quantize_ckpt(args: argparse.Namespace) -> int:
    import numpy as np

    from mplower.hf.blocks import Blocks, run_blocks
    from mplower.io.npz import read_npz
    from mplower.lowering.calibration import Progress
    from mplower.pass_manager import PipelineError, format_timing, parse_pipeline
    from mplower.report.run import build_report, render

    try:
        passes = [p for piece in (args.pipeline or []) for p in parse_pipeline(piece)]
    except PipelineError as e:
        raise UsageError(str(e)) from None
    if args.no_eval and args.report:
        raise UsageError("--report: --no-eval runs no plan, so there is nothing to report")
    check_outputs({"--report": args.report}, {"--data": args.data})
    if not Path(args.input).is_dir():
        raise DiagnosticError.at(Location(args.input, 0, 0), "not a checkpoint folder")
    loc = Location(args.data, 0, 0)
    arrays = read_npz(Path(args.data), loc, "calibration data")
    ids = arrays.get("input_ids")
    if ids is None or ids.ndim != 2 or ids.dtype.kind not in "iu":
        have = {k: list(v.shape) for k, v in arrays.items()}
        raise DiagnosticError.at(loc, f"calibration data needs 'input_ids', integers "
                                      f"[sequences, tokens] (it has: {have})")
    blocks = Blocks(args.input, *ids.shape)
    vocab = blocks.model.vocab
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise DiagnosticError.at(loc, f"input_ids hold tokens in [{ids.min()}, {ids.max()}], "
                                      f"outside the vocabulary [0, {vocab})")
    progress = Progress(len(blocks), "quantize-ckpt")  # drawn on a terminal, after 0.5 s
    times: list[tuple[str, float]] = []
    clock = [time.perf_counter()]

    def done(block, run) -> None:
        now = time.perf_counter()
        times.append((block.name, now - clock[0]))
        clock[0] = now
        progress.update()

    try:
        result = run_blocks(blocks, ids.astype(np.int64), passes, on_block=done,
                            evaluate=not args.no_eval)
    finally:
        progress.close()
    if args.timing:
        sys.stderr.write(format_timing(times))
    if args.no_eval:
        quantized = sum(len(b.quantized) for b in result.blocks)
        sys.stdout.write(f"{len(result.blocks)} blocks, {quantized} weights quantized\n")
        return EXIT_OK
    report = build_report(result.run_result(), {}, function="prefill",
                          output_names=["logits"])
    if args.report:
        write_output(args.report, render(report, "json"))
    if args.report != "-":
        write_output("-", render(report, args.format))
    return EXIT_OK
