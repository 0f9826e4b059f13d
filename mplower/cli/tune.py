"""`mplower tune`: search per-op formats for the best modeled objective that meets guardrails.

Reads the model, its calibration (`--data`) and evaluation (`--eval`, default the calibration
data) batches and optional slice ids, checks everything before any work (a located diagnostic
and exit 1 for bad input, exit 2 for a bad command line), runs the search of
mplower.tune.search serially or on dask.distributed, and releases OUT_DIR/policy.toml,
lowered.ir (+ weights), tune.json and pareto.png as one unit: built in a folder beside OUT_DIR,
then swapped in whole, so OUT_DIR is always one run's release. Exit 0 when a plan meets the
guardrails; 3 when none does (the new OUT_DIR then holds only tune.json and pareto.png, which
name the best rejected plan and why: no sheet or lowered module, not even an earlier run's). Progress (tqdm) goes to stderr, a short
table to stdout. docs/tune.md walks through it.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

from mplower.cli.common import (
    EXIT_GUARDRAIL,
    EXIT_OK,
    UsageError,
    read_module,
    seed,
    write_atomic,
)
from mplower.cli.run import add_metric_flags
from mplower.ir.diagnostics import DiagnosticError, Location

DEFAULT_FORMATS = "bf16,f16,f8E4M3FN,i8"
DEFAULT_GUARDRAILS = {"max_rel_l2": 0.01}


def add_tune(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="the fastest plan that meets the guardrails",
                       description="Search per-op and per-fused-kernel formats (and int8 with "
                                   "calibration, 2:4 sparsity) for the highest modeled "
                                   "throughput that meets every guardrail on the evaluation "
                                   "inputs; write OUT_DIR/policy.toml, lowered.ir, tune.json "
                                   "and pareto.png. Exit 3 when no plan meets them.")
    p.add_argument("input", help="IR file")
    p.add_argument("--target", required=True, help="built-in target name or target sheet")
    p.add_argument("--data", required=True, metavar="CALIB.npz",
                   help="calibration batches keyed by argument name (one batch or a stack)")
    p.add_argument("--eval", metavar="EVAL.npz",
                   help="evaluation batches (default: the calibration data)")
    p.add_argument("--guardrail", action="append", default=[], metavar="KEY=VALUE",
                   help="a guardrail every chosen plan meets (repeatable; default "
                        "max_rel_l2=0.01)")
    p.add_argument("--formats", default=DEFAULT_FORMATS,
                   help=f"compute formats to try (default {DEFAULT_FORMATS})")
    p.add_argument("--sparse", action="store_true", help="also try 2:4-pruned weights")
    p.add_argument("--budget", type=int, default=200, metavar="N",
                   help="at most N plan evaluations (default 200)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the search's tie-breaks")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--workers", type=int, default=0, metavar="N",
                       help="evaluate on a dask LocalCluster of N workers (0: in this process)")
    where.add_argument("--scheduler", metavar="ADDRESS",
                       help="evaluate on a running dask cluster (tcp://host:port)")
    p.add_argument("--slices", metavar="S.npz",
                   help="one slice id per evaluation sample; every guardrail holds per slice")
    p.add_argument("--objective", choices=("throughput", "energy"), default="throughput",
                   help="rank plans by modeled inferences/s or inferences/joule")
    p.add_argument("--min-gain", type=float, default=1.0, metavar="PCT",
                   help="release a faster plan only when it gains at least PCT percent modeled "
                        "objective over the most accurate passing plan within reach (the best "
                        "passing uniform sheet's among them); below it, the more accurate plan "
                        "is released (default 1; 0 releases the fastest)")
    p.add_argument("--seq-axis", type=int, default=None, metavar="AXIS",
                   help="axis of the first argument that holds the sequence: tokens/s counts "
                        "its dimensions up to this one (default: found from attention)")
    add_metric_flags(p, "the --eval file")
    p.add_argument("--func", default=None, help="function to tune (default: main or the only one)")
    p.add_argument("-o", dest="output", required=True, metavar="OUT_DIR", help="output folder")
    llm = p.add_argument_group("serving a decoder LLM (a module with @prefill and @decode: "
                               "docs/serving.md)")
    llm.add_argument("--phase", choices=("prefill", "decode"),
                     help="tune that function for serving points: one search and one release "
                          "per --batch, in OUT_DIR/b<B>/, and OUT_DIR/tune.json over them")
    llm.add_argument("--batch", type=_batches, metavar="B[,B...]",
                     help="the batch sizes to tune for (default: the module's)")
    llm.add_argument("--context", type=int, metavar="C",
                     help="cached positions of each decode step (default: the module's)")
    return p


def _batches(text: str) -> list[int]:
    try:
        out = [int(b) for b in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive batch sizes B[,B...], got {text!r}")
    return list(dict.fromkeys(out))


def _formats(text: str) -> list[str]:
    from mplower.lowering.target import COMPUTE_FORMATS

    out = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in out if f not in COMPUTE_FORMATS or f == "f32"]
    if not out or bad:
        raise UsageError(f"--formats takes narrow compute formats of "
                         f"{', '.join(f for f in COMPUTE_FORMATS if f != 'f32')}; "
                         f"got '{text}'")
    return list(dict.fromkeys(out))


def _slices(path: str, n_samples: int):
    """The slice id of every evaluation sample, from the only array of `path` (or `slice`)."""
    import numpy as np

    from mplower.io.npz import read_npz

    loc = Location(path, 0, 0)
    arrays = read_npz(Path(path), loc, "slice ids")
    if len(arrays) != 1 and "slice" not in arrays:
        raise DiagnosticError.at(loc, f"slice ids: expected one array (or one named 'slice'), "
                                      f"found {', '.join(sorted(arrays)) or 'none'}")
    ids = np.asarray(arrays.get("slice", next(iter(arrays.values()))))
    if ids.dtype.kind not in "iub":
        raise DiagnosticError.at(loc, f"slice ids must be integers or booleans, got {ids.dtype}")
    if ids.shape != (n_samples,):
        raise DiagnosticError.at(loc, f"slice ids have shape {list(ids.shape)}; the evaluation "
                                      f"data has {n_samples} samples (batches x the outputs' "
                                      f"first axis), one id each")
    return ids.astype(np.int64)


def cmd_tune(args: argparse.Namespace) -> int:
    from mplower.cli.run import _guardrail_flags, metric_flag

    formats = _formats(args.formats)
    guardrails = _guardrail_flags(args.guardrail) or dict(DEFAULT_GUARDRAILS)
    metric = metric_flag(args, guardrails)
    if args.budget < 1:
        raise UsageError("--budget must be at least 1 evaluation")
    if args.workers < 0:
        raise UsageError("--workers must be 0 (this process) or more")
    if not 0 <= args.min_gain < 1000:
        raise UsageError(f"--min-gain is a percentage in [0, 1000), got {args.min_gain:g}")
    if args.input == "-":  # its weights are found beside it, and its hash goes in the packet
        raise UsageError("tune reads the model from a file, not from stdin")
    if args.output == "-":
        raise UsageError("tune writes a release folder: -o needs a folder, not '-'")
    if args.phase is None and (args.batch or args.context is not None):
        raise UsageError("--batch and --context set serving points: they need --phase")
    if args.phase is not None:
        if args.func is not None:
            raise UsageError("--phase picks the function (@prefill or @decode); drop --func")
        if args.context is not None and args.context < 1:
            raise UsageError(f"--context must be at least 1, got {args.context}")
        args.func = args.phase
    out_dir = Path(args.output)
    _check_out_dir(out_dir, [args.input, args.data, args.eval, args.slices, args.target])
    started = time.perf_counter()

    import numpy as np

    from mplower.io.atomic import staged_folder
    from mplower.io.npz import read_npz, weights_file
    from mplower.ir.opdef import OPS
    from mplower.lowering.metrics import eval_samples
    from mplower.lowering.target import load_target
    from mplower.lowering.throughput import SeqAxisError, units
    from mplower.passes.calibrate import check_partial_batch, split_batches, split_samples
    from mplower.tune.evaluation import Problem
    from mplower.tune.packet import sha256_file, versions

    module = read_module(args)
    f = module.function(args.func)
    points: list[tuple[str, int, int | None] | None] = [None]
    if args.phase is not None:
        from mplower.lowering.serving import check_phase_function, written_for

        check_phase_function(module, args.phase)
        points = [(args.phase, b, args.context)
                  for b in args.batch or [written_for(f, args.phase)[0]]]
    try:  # before any work: a bad axis is a usage error
        units(f, args.seq_axis)
    except SeqAxisError as e:
        raise UsageError(str(e)) from None
    target = load_target(args.target, known_ops=OPS)
    builtin = target.source.startswith("builtin:")
    target_file = Path(target.source) if not builtin else builtin_sheet(target)
    if args.objective == "energy" and target.board_power_w is None:
        raise DiagnosticError.at(Location(str(target_file), 0, 0),
                                 f"--objective energy needs the target's board power: target "
                                 f"'{target.name}' has no board_power_w")
    calib = read_npz(Path(args.data), Location(args.data, 0, 0), "calibration data")
    # Located errors before any work; calibration takes any sample count where it can pad.
    if split_samples(f, calib, Location(args.data, 0, 0))[1] is not None:
        check_partial_batch(module, args.func, Location(args.data, 0, 0))
    eval_path = args.eval or args.data
    eval_arrays = read_npz(Path(eval_path), Location(eval_path, 0, 0), "evaluation data")
    batches = split_batches(f, eval_arrays, Location(eval_path, 0, 0), "evaluation")
    if metric is not None:
        metric.check_eval(eval_arrays)
    for i, a in enumerate(f.args):
        bad = sum(int(np.count_nonzero(~np.isfinite(b[i]))) for b in batches
                  if b[i].dtype.kind == "f")
        if bad:  # a NaN reference makes every drift figure vacuous: every plan would "pass"
            raise DiagnosticError.at(Location(eval_path, 0, 0), (
                f"evaluation data: argument '{f.data(a)['name']}' holds {bad} non-finite "
                f"value(s) (NaN or inf); the guardrails are judged against the fp32 outputs "
                f"on these inputs"))
    slices = None
    rows = {t.shape[0] if t.shape else 1 for t in f.result_types}
    if args.slices:
        if len(rows) != 1:
            raise DiagnosticError.at(f.loc, "--slices needs outputs with one sample axis "
                                            "(the same first dimension)")
        slices = _slices(args.slices, len(batches) * next(iter(rows)))
    weights_path = weights_file(module, None)
    weights = None
    if weights_path is not None and weights_path.is_file():
        rel = weights_path.resolve().relative_to(Path(module.path).resolve().parent)
        weights = (rel.as_posix(), weights_path.read_bytes())
    make_problem = partial(
        Problem, module_text=args._source, module_name=Path(module.path).name, weights=weights,
        calib=Path(args.data).read_bytes(), target=args.target,
        target_text=None if builtin else Path(target.source).read_text(encoding="utf-8"),
        batches=batches, slices=slices, guardrails=guardrails, func=args.func, metric=metric,
        seq_axis=args.seq_axis,
        eval=None if metric is None else eval_samples(
            eval_arrays, len(batches), next(iter(rows)) if len(rows) == 1 else None))
    inputs = {"model": sha256_file(args.input),
              "weights": sha256_file(weights_path) if weights else None,
              "data": sha256_file(args.data), "eval": sha256_file(eval_path),
              "slices": sha256_file(args.slices) if args.slices else None}
    provenance = {"versions": versions(), "target": target.name,
                  "target_sheet_sha256": sha256_file(target_file), "seed": args.seed,
                  "formats": formats, "sparse": args.sparse, "budget": args.budget,
                  "input_sha256": inputs}
    # The release is built in a folder beside OUT_DIR and swapped in whole (io.atomic): a run
    # that fails or is killed leaves the previous release as it was, and OUT_DIR never mixes
    # files of two runs. The files name OUT_DIR, where they will be, never the stage folder.
    packets = []
    with staged_folder(out_dir) as stage:
        for point in points:
            sub = "" if point is None else f"b{point[1]}"
            if sub:
                (stage / sub).mkdir()
            problem = make_problem(serving=point)
            outcome, results, evaluations, evaluator_text = _search(problem, args, formats)
            packet = _release(module, outcome, results, evaluations, evaluator_text, stage / sub,
                              out_dir / sub, args, target, guardrails, metric, slices,
                              provenance | ({} if point is None else {"serving": {
                                  "phase": point[0], "batch": point[1],
                                  "context": point[2]}}), started)
            packets.append((point, packet))
        if args.phase is not None:
            text = json.dumps(serving_packet(args.phase, packets), indent=2,
                              allow_nan=False) + "\n"
            write_atomic(stage / "tune.json", lambda fh: fh.write(text), "w")
    for point, packet in packets:
        if point is not None:
            sys.stdout.write(f"\n{point[0]} at batch {point[1]} (release b{point[1]}/):\n")
        sys.stdout.write(_table(packet))
    if args.phase is not None:
        sys.stdout.write("\n" + serving_table(serving_packet(args.phase, packets)))
    chosen = all(packet["chosen"] is not None for _, packet in packets)
    return EXIT_OK if chosen else EXIT_GUARDRAIL


def _release(module, outcome, results, evaluations, evaluator_text, stage: Path, out_dir: Path,
             args: argparse.Namespace, target, guardrails, metric, slices, provenance,
             started: float) -> dict[str, Any]:
    """Write one release (policy.toml, lowered.ir, tune.json, pareto.png) into `stage`, the
    folder that becomes `out_dir`; its packet."""
    from mplower.tune.evaluation import sheet_text
    from mplower.tune.packet import build_packet, candidate_of, pareto_png

    reproduce = None
    if outcome.chosen is not None:
        candidate = candidate_of(outcome.chosen)
        pipeline = _pipeline(candidate, str(out_dir / "policy.toml"), args)
        command = (f"mplower opt {args.input} --pass-pipeline='{pipeline}' "
                   f"-o {out_dir / 'lowered.ir'}")
        reproduce = {"pipeline": pipeline, "command": command}
        header = (f"Tuned by `mplower tune` for target {target.name}, objective "
                  f"{args.objective}, seed {args.seed}.\nlowered.ir is this sheet through:\n"
                  f"  {command}")
        if metric is not None:  # a sheet never names the metric (docs/metrics.md)
            header += (f"\nIts metric guardrails need the metric on the command line: "
                       f"mplower run ... --metric {metric.spec}")
        sheet = sheet_text(candidate, guardrails, header)
        write_atomic(stage / "policy.toml", lambda fh: fh.write(sheet), "w")
        lowered_text = _lower(module, _pipeline(candidate, str(stage / "policy.toml"), args),
                              stage / "lowered.ir")
        write_atomic(stage / "lowered.ir", lambda fh: fh.write(lowered_text), "w")
    packet = build_packet(outcome, results, objective=args.objective,
                          guardrails=guardrails, provenance=provenance, reproduce=reproduce,
                          evaluations=evaluations, slices=slices is not None,
                          metric=metric, min_gain=args.min_gain / 100)
    packet["timing"] = {"wall_s": time.perf_counter() - started, "evaluator": evaluator_text}
    text = json.dumps(packet, indent=2, allow_nan=False) + "\n"
    write_atomic(stage / "tune.json", lambda fh: fh.write(text), "w")
    pareto_png(stage / "pareto.png", packet["candidates"],
               outcome.chosen["key"] if outcome.chosen else None, args.objective,
               guardrails, _rejected_marks(packet))
    return packet


def _plan_name(r: dict[str, Any]) -> str:
    return r["plan"].get("sheet") or r["label"]


def serving_packet(phase: str, packets: list) -> dict[str, Any]:
    """OUT_DIR/tune.json of a --phase run: per serving point its release folder, the chosen
    plan and every passing uniform sheet's modeled tokens/s, and where the best one changes."""
    points = []
    for (_, batch, context), packet in packets:
        chosen = packet["chosen"]
        tokens = {_plan_name(r): r["modeled"]["tokens_per_s"] for r in packet["uniform"]
                  if r["verdict"] == "pass"}
        points.append({
            "batch": batch, "context": context, "release": f"b{batch}",
            "chosen": None if chosen is None else {
                "label": chosen["label"], "best_uniform": chosen["best_uniform"],
                "tokens_per_s": chosen["modeled"]["tokens_per_s"],
                "plan": f"b{batch}/lowered.ir"},
            "uniform_tokens_per_s": tokens,
            "best_uniform": max(tokens, key=tokens.__getitem__) if tokens else None})
    flips = [{"from_batch": a["batch"], "to_batch": b["batch"], "from": a["best_uniform"],
              "to": b["best_uniform"]} for a, b in pairwise(points)
             if a["best_uniform"] != b["best_uniform"]]
    return {"packet": "mplower-tune-serving/1", "phase": phase, "points": points,
            "flips": flips}


def serving_table(packet: dict[str, Any]) -> str:
    """The per-batch table: modeled tokens/s of each passing uniform sheet, the best one and
    the chosen plan, and the batches where the best sheet changes."""
    from mplower.report.table import table

    names = list(dict.fromkeys(n for p in packet["points"] for n in p["uniform_tokens_per_s"]))
    rows = []
    for p in packet["points"]:
        t = p["uniform_tokens_per_s"]
        chosen = p["chosen"]
        rows.append([str(p["batch"]), *[f"{t[n]:.4g}" if n in t else "-" for n in names],
                     p["best_uniform"] or "-",
                     "-" if chosen is None else f"{chosen['label']} ({chosen['plan']})"])
    lines = table(["batch", *[f"{n} tokens/s" for n in names], "best sheet", "chosen plan"],
                  rows, "table", rule=True)
    lines += [f"best sheet flips from {f['from']} at batch {f['from_batch']} to {f['to']} at "
              f"batch {f['to_batch']}" for f in packet["flips"]] or ["no flip of the best sheet"]
    return "\n".join(lines) + "\n"



def _rejected_marks(packet: dict[str, Any]) -> dict[str, str]:
    """The rejected plans the table shows, by key, as pareto.png marks them."""
    marks = {}
    for field, word in (("fastest_rejected", "fastest rejected"),
                        ("best_rejected", "closest rejected")):
        if packet[field] is not None:
            key = packet[field]["key"]
            marks[key] = f"{marks[key]}, {word}" if key in marks else word
    return marks


def _check_out_dir(out_dir: Path, inputs: list[str | None]) -> None:
    """Before any work: OUT_DIR can be replaced by a release folder, and replacing it loses
    no input and no file of the user's (tune swaps the whole folder)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise DiagnosticError.at(Location(str(out_dir), 0, 0),
                                 f"cannot write output: {os.strerror(errno.ENOTDIR)}")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / "tune.json").is_file():
        raise UsageError(f"-o {out_dir}: the folder holds files but no tune.json; tune replaces "
                         f"the whole folder with its release, so -o names a new folder, an "
                         f"empty one or an earlier release of tune")
    for path in inputs:
        if path is not None and Path(path).exists() and \
                Path(path).resolve().is_relative_to(out_dir.resolve()):
            raise UsageError(f"{path} is inside -o {out_dir}, which tune replaces whole; "
                             f"give the release another folder")
    existing = out_dir.resolve()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        code = errno.EACCES if existing.is_dir() else errno.ENOTDIR
        raise DiagnosticError.at(Location(str(out_dir), 0, 0),
                                 f"cannot write output: {os.strerror(code)}")


def builtin_sheet(target) -> Path:
    """The file of a built-in target sheet (its provenance hash is of these bytes)."""
    from mplower.lowering import target as targets
    from mplower.lowering.tomlsheet import locate

    return locate(target.source.removeprefix("builtin:"), "target", targets._BUILTIN_DIR,
                  None, "")[0]


def _pipeline(candidate, policy: str, args: argparse.Namespace) -> str:
    from mplower.tune.evaluation import pipeline_passes

    return pipeline_passes(policy, args.target, args.data,
                           int8=candidate.int8,
                           sparse=candidate.sparse, weight_only=False)


def _lower(module, pipeline: str, out: Path) -> str:
    """`mplower opt MODEL --pass-pipeline=PIPELINE -o OUT`'s text, as that command makes it."""
    import copy

    from mplower.backend.executor import reference_runner
    from mplower.ir.printer import print_module
    from mplower.pass_manager import PassContext, PassManager, load_passes, parse_pipeline

    load_passes()
    lowered = copy.deepcopy(module)
    PassManager(parse_pipeline(pipeline)).run(
        lowered, PassContext(output_path=str(out), runner=reference_runner))
    return print_module(lowered)


def _search(problem, args: argparse.Namespace, formats: list[str]):
    from tqdm import tqdm

    from mplower.tune.distributed import Evaluator
    from mplower.tune.evaluation import drop_workspace, workspace
    from mplower.tune.search import search

    bar = tqdm(total=args.budget, desc="tune", unit="plan", file=sys.stderr, leave=False,
               disable=None)
    evaluator = Evaluator(problem, args.budget, workers=args.workers, scheduler=args.scheduler,
                          progress=bar.update)
    try:
        outcome = search(workspace(problem), evaluator, formats=formats, sparse=args.sparse,
                         seed=args.seed, objective=args.objective,
                         min_gain=args.min_gain / 100)
    finally:
        evaluator.close()
        bar.close()
        drop_workspace(problem)
    results = list(evaluator.cache.results.values())
    evaluations = {"count": len(evaluator.cache), "cache_hits": evaluator.cache.hits,
                   "budget": args.budget}
    return outcome, results, evaluations, evaluator.description


def _table(packet: dict[str, Any]) -> str:
    """The stdout summary: one row per plan (fp32, the uniform sheets, the chosen plan or the
    rejected ones closest to the guardrails and fastest), each with why it failed or what it
    is; then what the chosen plan buys over the best passing uniform sheet."""
    from mplower.report.table import table

    metric = packet["metric"]
    tokens = any(r.get("modeled", {}).get("tokens_per_s") is not None
                 for r in [packet["baseline"], *packet["uniform"]])

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.4g}"

    def row(label: str, r: dict[str, Any] | None) -> list[str]:
        cols = 4 + tokens + bool(metric)
        if r is None or "modeled" not in r:
            return [label, *["-"] * cols, r["verdict"] if r else "-",
                    (r or {}).get("why") or ""]
        m, q = r["modeled"], r["quality"]
        value = [] if not metric else [num(q["metric"])]
        return [label, num(m["inferences_per_s"]), num(m.get("samples_per_s")),
                *([num(m.get("tokens_per_s"))] if tokens else []),
                f"{m['speedup_vs_fp32']:.3f}x",
                "-" if q["output_rel_l2"] is None else f"{q['output_rel_l2']:.3g}", *value,
                r["verdict"], r.get("why") or ""]

    rows = [row("fp32 (baseline)", packet["baseline"])]
    rows += [row(r["label"], r) for r in packet["uniform"]]
    chosen = packet["chosen"]
    if chosen is not None:
        mark = f" (the {chosen['best_uniform']} sheet's)" if chosen["is_best_uniform_plan"] else ""
        rows.append(row("chosen: " + chosen["label"] + mark, chosen))
    closest, fastest = packet["best_rejected"], packet["fastest_rejected"]
    if closest is not None:
        rows.append(row("closest rejected: " + closest["label"], closest))
    if fastest is not None and (closest is None or fastest["key"] != closest["key"]):
        rows.append(row("fastest rejected: " + fastest["label"], fastest))
    header = ["plan", "inferences/s", "samples/s", *(["tokens/s"] if tokens else []),
              "vs fp32", "rel_l2", *([f"metric ({metric['spec']})"] if metric else []),
              "verdict", "why"]
    lines = table(header, rows, "table", rule=True)
    ev = packet["evaluations"]
    lines.append(f"{ev['count']} evaluations ({ev['cache_hits']} cache hits), budget "
                 f"{ev['budget']}")
    objective = "inferences/J" if packet["objective"] == "energy" else "inferences/s"
    if chosen is not None:
        best = next((u for u in packet["uniform"] if u["plan"]["sheet"]
                     == chosen["best_uniform"]), None)
        if best is None:
            lines.append("no uniform sheet meets the guardrails: the chosen plan is the only "
                         "way to lower this model within them")
        else:
            gain = chosen["speedup_vs_best_uniform"] - 1.0
            rel = best["quality"]["output_rel_l2"]
            plan = ("the chosen plan is that sheet's own" if chosen["is_best_uniform_plan"]
                    else f"the chosen plan buys {gain:+.2%} modeled {objective}")
            lines.append(f"best passing uniform sheet: {chosen['best_uniform']} "
                         f"({num(best['modeled']['inferences_per_s'])} inferences/s, rel_l2 "
                         f"{num(rel)}); {plan}")
        if chosen["min_gain_note"]:
            lines.append(chosen["min_gain_note"])
    else:
        why = (closest["why"] if closest else
               f"the budget of {ev['budget']} evaluations ran out before a per-op plan was tried")
        lines.append(f"no plan meets the guardrails: {why}")
        if packet["baseline"]["verdict"] == "pass":
            lines.append("(fp32 meets them, but it lowers nothing: it is the reference, not a "
                         "release)")
    return "\n".join(lines) + "\n"
