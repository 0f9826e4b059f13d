"""`mplower train`: fine-tune a model's weights with forward and backward in the plan's formats.

The model's function returns its output (logits, or probabilities from a final softmax); the
command builds the training step (mplower.train.trainer), runs `--steps` (or `--epochs`) seeded
steps with loss scaling and an f32 optimizer, and writes the same module with its weights
file replaced by the trained one (`<stem>.npz` beside `-o`), the per-step report (`--report`)
and its plot (`--plot`). The outputs are checked before the first step and written at the
end as one set (mplower.io.atomic): all of them when the whole run succeeded, none otherwise.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

from mplower.cli.common import (
    EXIT_OK,
    UsageError,
    check_outputs,
    read_module,
    seed,
    weights_beside,
    write_atomic_all,
    write_output,
    writes_outputs,
)
from mplower.ir.diagnostics import DiagnosticError, Location


def add_train(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="train a model with forward and backward in a plan's formats",
                       description="Train the weights of a model: grad + the precision pipeline "
                                   "build one training step, run with loss scaling and an f32 "
                                   "optimizer; writes the trained module, its weights beside "
                                   "it, and a per-step overflow/underflow report.")
    p.add_argument("input", help="IR file, or - for stdin")
    p.add_argument("--data", required=True, metavar="TRAIN.npz",
                   help=".npz with the inputs keyed by argument name and the labels")
    p.add_argument("--eval", metavar="EVAL.npz", help="held-out data: accuracy after training")
    p.add_argument("--loss", choices=("cross_entropy", "mse"), default="cross_entropy")
    p.add_argument("--labels", default="y", help="key of the labels in the data (default y): "
                                                 "class indices for cross_entropy")
    plan = p.add_mutually_exclusive_group()
    plan.add_argument("--policy", help="precision policy (built-in name or .toml) for the "
                                       "step: assign-precision + insert-casts")
    plan.add_argument("--pass-pipeline", metavar="STR",
                      help="the pipeline that lowers the step instead of --policy")
    p.add_argument("--optimizer", default="sgd{lr=0.1}",
                   help="sgd{lr= momentum= weight_decay=} or adam{lr= beta1= beta2= eps= "
                        "weight_decay=} (default sgd{lr=0.1})")
    p.add_argument("--loss-scale", default="none",
                   help="dynamic (torch GradScaler), static=S or none (default)")
    p.add_argument("--loss-scale-init", type=float, default=2.0 ** 16, metavar="S",
                   help="dynamic: initial scale (default 65536)")
    p.add_argument("--loss-scale-growth", type=float, default=2.0, metavar="F",
                   help="dynamic: growth factor (default 2)")
    p.add_argument("--loss-scale-backoff", type=float, default=0.5, metavar="F",
                   help="dynamic: backoff factor on inf/NaN gradients (default 0.5)")
    p.add_argument("--loss-scale-interval", type=int, default=2000, metavar="N",
                   help="dynamic: finite steps before the scale grows (default 2000)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="training steps (default: one epoch)")
    length.add_argument("--epochs", type=int, help="passes over the data")
    p.add_argument("--batch", type=int, help="batch size (default: the model's, the first "
                                             "dimension of its first argument; another size "
                                             "retypes the model as the set-batch pass does)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the batch order (default 0)")
    p.add_argument("--weights", metavar="W.npz", help="initial weights instead of mp.weights")
    p.add_argument("--func", default=None, help="function to train (default: main)")
    p.add_argument("--report", metavar="train.json",
                   help="write the per-step report here ('-': print it on stdout)")
    p.add_argument("--plot", metavar="train.png", help="plot loss, loss scale and incidence (PNG; '-': stdout, through a pipe)")
    p.add_argument("-o", "--output", required=True, metavar="TRAINED.ir",
                   help="the trained module; its weights go to <stem>.npz beside it")
    return p


def _data(path: str, names: list[str], what: str):
    import numpy as np

    from mplower.io.npz import read_npz

    loc = Location(path, 0, 0)
    arrays = read_npz(Path(path), loc, what)
    missing = [n for n in names if n not in arrays]
    if missing:
        raise DiagnosticError.at(loc, f"{what} lacks {', '.join(repr(n) for n in missing)} "
                                      f"(it has: {', '.join(sorted(arrays)) or 'none'})")
    counts = {len(arrays[n]) for n in names if np.ndim(arrays[n])}
    if len(counts) != 1:
        raise DiagnosticError.at(loc, f"{what}: the arrays {', '.join(names)} must hold the same "
                                      f"number of samples along their first axis")
    return {n: arrays[n] for n in names}


@writes_outputs
def cmd_train(args: argparse.Namespace) -> int:
    import numpy as np

    from mplower.dialect.plan import WEIGHTS
    from mplower.io.atomic import path_from
    from mplower.io.npz import read_npz, save_npz, weights_file
    from mplower.ir.printer import print_module
    from mplower.pass_manager import PipelineError, parse_pipeline
    from mplower.train.optim import parse_optimizer
    from mplower.train.report import plot_training, training_report
    from mplower.train.scaler import parse_loss_scale
    from mplower.train.trainer import Trainer, store_inline

    try:
        optimizer = parse_optimizer(args.optimizer)
        scaler = parse_loss_scale(args.loss_scale, args.loss_scale_init, args.loss_scale_growth,
                                  args.loss_scale_backoff, args.loss_scale_interval)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.output == "-":  # the trained weights go to a file beside it, which '-' has not
        raise UsageError("train writes the module and its weights beside it: -o needs a file, "
                         "not '-'")
    for flag in ("steps", "epochs", "batch"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be at least 1")
    pipeline_text = args.pass_pipeline or (
        f"assign-precision{{policy={args.policy}}},insert-casts" if args.policy else "")
    try:
        pipeline = parse_pipeline(pipeline_text)
    except PipelineError as e:
        raise UsageError(str(e)) from None
    out_npz = weights_beside("-o", args.output)
    module = read_module(args)
    # Checked before any step: a missing folder, two outputs on one file, an output on an
    # input. In place (-o the input), the module and its weights are replaced as a whole.
    in_place = Path(args.output).resolve() == Path(args.input).resolve()
    try:
        initial = weights_file(module, args.weights)
    except DiagnosticError:  # a bad mp.weights is reported where the weights are read
        initial = None
    check_outputs({"-o": args.output, "the weights beside -o": out_npz,
                   "--report": args.report, "--plot": args.plot},
                  {"--data": args.data, "--eval": args.eval,
                   **({} if in_place else {"input": args.input, "weights": initial})},
                  binary=("--plot",))
    trainer = Trainer(module, args.loss, args.labels, pipeline, optimizer, scaler, args.func,
                      args.weights, args.batch)
    inputs = [n for n in trainer.eval_program.arg_names if n not in trainer.params]
    data = _data(args.data, [*inputs, args.labels], "training data")
    evaluation = _data(args.eval, [inputs[0], args.labels], "evaluation data") \
        if args.eval else None
    if evaluation is not None:  # checked before any step is spent
        try:
            eval_classes = trainer.class_labels(evaluation[args.labels])
        except ValueError as e:
            raise DiagnosticError.at(Location(args.eval, 0, 0), str(e)) from None
    n = len(data[args.labels])
    steps = args.steps or (args.epochs or 1) * (n // trainer.batch)
    per_epoch: list[dict] = []
    on_epoch = None
    if evaluation is not None:
        def on_epoch(epoch: int, step: int) -> None:
            per_epoch.append({"epoch": epoch, "step": step, "accuracy": trainer.accuracy(
                evaluation[inputs[0]], eval_classes)})
    try:
        rows = _fit_with_progress(trainer, data, steps, args.seed, on_epoch)
    except ValueError as e:
        raise DiagnosticError.at(Location(args.data, 0, 0), str(e)) from None
    accuracy = None
    if evaluation is not None:
        accuracy = {"samples": len(eval_classes),
                    "accuracy": trainer.accuracy(evaluation[inputs[0]], eval_classes),
                    "per_epoch": per_epoch}
    config = {"model": args.input, "plan": pipeline_text or "fp32", "loss": args.loss,
              "optimizer": args.optimizer, "loss_scale": args.loss_scale,
              "steps": steps, "batch": trainer.batch, "seed": args.seed}
    report = training_report(config, rows, accuracy)

    # Everything ran: write the weights, the module, then the report and the plot.
    inline = store_inline(module, args.func, trainer.params)  # LSQ scales (prepare-qat)
    source = weights_file(module, args.weights)
    arrays = read_npz(source, module.loc) if source is not None else {}
    arrays.update({k: v for k, v in trainer.params.items() if k not in inline})
    module.attrs[WEIGHTS] = path_from(Path(args.output).resolve().parent, out_npz.resolve())
    text = print_module(module)
    files = [(out_npz, lambda fh: save_npz(fh, {k: np.asarray(v) for k, v in arrays.items()}),
              "wb"), (args.output, lambda fh: fh.write(text), "w")]
    write_atomic_all(files)  # committed with the rest when the command returns
    if args.report:
        write_output(args.report, json.dumps(report, indent=1, allow_nan=False) + "\n")
    if args.plot:
        buf = io.BytesIO()
        plot_training(report, buf)
        write_output(args.plot, buf.getvalue())
    s = report["summary"]
    acc = f", eval accuracy {s['eval']['accuracy']:.4f}" if "eval" in s else ""
    loss = "not finite" if s["final_loss"] is None else f"{s['final_loss']:.4f}"
    print(f"mplower train: {s['steps']} steps, final loss {loss}, "
          f"{s['skipped']} skipped, underflow fwd {s['forward']['underflow']} / bwd "
          f"{s['backward']['underflow']}{acc}", file=sys.stderr)
    return EXIT_OK


def _fit_with_progress(trainer, data: dict, steps: int, seed: int, on_epoch=None) -> list:
    """fit, with a progress bar; `on_epoch(epoch, step)` after the last step of each whole
    epoch (the batches of `batches`: len // batch steps per epoch)."""
    from tqdm import tqdm

    from mplower.train.trainer import fit

    per_epoch = len(data[trainer.labels]) // trainer.batch
    with tqdm(total=steps, unit="step", file=sys.stderr, disable=None) as bar:
        def progress(i: int, row: dict) -> None:
            bar.set_postfix(loss=f"{row['loss']:.4f}", scale=row["loss_scale"], refresh=False)
            bar.update(1)
            if on_epoch is not None and per_epoch and (i + 1) % per_epoch == 0:
                on_epoch((i + 1) // per_epoch, i)
        return fit(trainer, data, steps, seed, progress)
