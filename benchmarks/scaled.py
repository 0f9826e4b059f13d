"""Scaled low precision on real networks: every scale recipe and block format against fp32.

Models: the onnx wheel's light ResNet-50 as shipped (its weights are constants, so activations
grow to ~1e10), the same network with seeded random weights (benchmarks/runtime.py:
He-normal, activations near 1), one BERT-base encoder layer (benchmarks/runtime.py, sequence
128) and the digits MLP 64-256-128-10 (benchmarks/quant.py's digits-mlp-deep, trained with
scikit-learn). Plans, all with the built-in sheets' op lists (keep-first-last included):

* fp8 plain: the fp8 sheet without its [scaling] table, a saturating cast (mplower before
  issue 14);
* fp8 static / delayed / current: per-tensor activation scales from calibrate's amax, from
  Transformer Engine's amax history (16 steps, max; it starts from the calibrated amax and
  advances once per evaluated sample) or from each tensor's own amax (the fp8 sheet's default),
  weights scaled per output channel (the default of the sheet and of scale-recipes);
* fp8-block (1x128 activations, 128x128 weights, f32 scales), mxfp8, mxfp4, nvfp4: their sheets;
* int8: static w8a8 (`assign-precision{policy=int8},calibrate,quantize`).

Calibration uses `--calib` seeded samples, evaluation `--samples` others (run one at a time,
in order). Reported per plan against the fp32 reference: SQNR in dB of the logits (the input
of the final softmax, whose output is flat for the shipped ResNet-50 weights; the output where
there is no softmax) over all evaluated samples, top-1 agreement of the outputs, and the values
that saturated (overflow) and flushed to zero (underflow) in the whole run. Run from the
repository root: `python benchmarks/scaled.py [--models ...] [--write docs/benchmarks.md]`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from mplower.backend.executor import Program, reference_runner
from mplower.ir.graph import RETURN
from mplower.ir.parser import parse_file
from mplower.pass_manager import PassContext, PassManager, parse_pipeline

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant
import runtime
from docblock import replace_block

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out" / "scaled"
MODELS = ("resnet50-shipped", "resnet50", "bert", "digits-mlp")
TITLES = {"resnet50-shipped": "ResNet-50 (light, shipped constant weights)",
          "resnet50": "ResNet-50 (light, seeded random weights)",
          "bert": "BERT-base layer (seq 128)", "digits-mlp": "digits MLP 64-256-128-10"}
CALIBRATE = "calibrate{{data={calib}}}"
PLANS = {
    "fp8 plain": "assign-precision{{policy={plain}}},insert-casts",
    "fp8 static": ("assign-precision{{policy=fp8}}," + CALIBRATE
                   + ",insert-casts,scale-recipes{{recipe=static}}"),
    "fp8 delayed": ("assign-precision{{policy=fp8}}," + CALIBRATE
                    + ",insert-casts,scale-recipes{{recipe=delayed history=16}}"),
    "fp8 current": "assign-precision{{policy=fp8}},insert-casts",
    "fp8 current pow2": "assign-precision{{policy=fp8}},insert-casts,scale-recipes{{pow2=true}}",
    "fp8-block": "assign-precision{{policy=fp8-block}},insert-casts",
    "mxfp8": "assign-precision{{policy=mxfp8}},insert-casts",
    "mxfp4": "assign-precision{{policy=mxfp4}},insert-casts",
    "nvfp4": "assign-precision{{policy=nvfp4}},insert-casts",
    "int8": "assign-precision{{policy=int8}}," + CALIBRATE + ",quantize",
}


def plain_fp8_sheet() -> Path:
    """The built-in fp8 sheet without its [scaling] table."""
    text = (ROOT / "mplower" / "policies" / "fp8.toml").read_text()
    head, _, rest = text.partition("[scaling]")
    path = OUT / "fp8_plain.toml"
    path.write_text(head + rest[rest.index("[guardrails]"):])
    return path


def model_ir(name: str) -> tuple[Path, list[np.ndarray], list[np.ndarray]]:
    """The model's IR, calibration inputs and evaluation inputs (each a list of one array)."""
    if name == "digits-mlp":
        m = quant.MODELS["digits-mlp-deep"]()
        folder = OUT / "digits"
        folder.mkdir(parents=True, exist_ok=True)
        ir = quant.write_ir(m, folder, 1)
        pick = np.random.default_rng(0)
        calib = [m.x_train[i:i + 1] for i in pick.choice(len(m.x_train), 64, replace=False)]
        return ir, calib, [m.x_test[i:i + 1] for i in range(len(m.x_test))]
    if name == "resnet50-shipped":
        path = OUT / "resnet50_shipped.onnx"
        if not path.exists():
            shutil.copy(runtime.LIGHT / "light_resnet50.onnx", path)
        model = runtime.onnx.load(str(path))
    else:
        path = runtime.onnx_model(name, 1)
        model = runtime.onnx.load(str(path))
    ir = runtime.mplower_ir(path)
    return ir, runtime.samples(model, ARGS.calib, seed=2), runtime.samples(
        model, ARGS.samples, seed=1)


def logits_slot(prog: Program) -> int:
    """The slot of the final softmax's input, or of the first output without one."""
    f = prog.function
    (ret,) = [n for n in f.ops() if f.op(n) == RETURN]
    out = f.operands(ret)[0]
    if f.op(out[0]) == "mp.softmax":
        out = f.operands(out[0])[0]
    return prog.slots[out]


def sqnr_db(y: np.ndarray, ref: np.ndarray) -> float:
    y, ref = y.astype(np.float64), ref.astype(np.float64)
    noise = float(np.sum((y - ref) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(float(np.sum(ref ** 2)) / noise)


def evaluate(ir: Path, pipeline: str, calib: list[np.ndarray],
             samples: list[np.ndarray]) -> dict[str, float]:
    module = parse_file(ir)
    npz = OUT / f"{ir.stem}_calib.npz"
    f = module.function()
    np.savez(npz, **{f.data(f.args[0])["name"]: np.stack(calib)})
    steps = pipeline.format(calib=npz, plain=plain_fp8_sheet())
    PassManager(parse_pipeline(steps)).run(module, PassContext(runner=reference_runner))
    prog = Program(module)
    slot = logits_slot(prog)
    ys, refs, agree, over, under = [], [], [], 0, 0
    for x in samples:
        r = prog.run([x])
        ys.append(r.values[slot])
        refs.append(r.refs[slot])
        out, ref = r.outputs[0], r.reference[0]
        agree.append(float(np.mean(np.argmax(out, -1) == np.argmax(ref, -1))))
        over += sum(o.counts.overflow for o in r.ops)
        under += sum(o.counts.underflow for o in r.ops)
    return {"sqnr": sqnr_db(np.concatenate([y.ravel() for y in ys]),
                            np.concatenate([y.ravel() for y in refs])),
            "top1": float(np.mean(agree)), "overflow": over, "underflow": under}


def header() -> list[str]:
    cmd = shlex.join(["python", *sys.argv])
    machine = f"{platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return [("## Scaled formats: recipes and block formats on real networks "
            "(benchmarks/scaled.py)"), "", f"- command: `{cmd}`", f"- machine: {machine}",
            (f"- date: {date}; calibration: {ARGS.calib} seeded samples; evaluation: "
            f"{ARGS.samples} other samples (the digits MLP: its whole test split)"), ""]


def main(argv: list[str] | None = None) -> int:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--calib", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--write", type=Path,
                    help="markdown file whose scaled.py section to replace")
    ARGS = ap.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    lines = header()
    models, plans = ARGS.models.split(","), ARGS.plans.split(",")
    results: dict[str, dict[str, dict]] = {plan: {} for plan in plans}
    for name in models:
        ir, calib, samples = model_ir(name)
        for plan in plans:
            t0 = time.perf_counter()
            r = results[plan][name] = evaluate(ir, PLANS[plan], calib, samples)
            print(f"{name} {plan}: SQNR {r['sqnr']:.1f} dB, top-1 {r['top1']:.3f}, "
                  f"saturated {r['overflow']}, flushed {r['underflow']} "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    # One row per plan, one column per network: the recipes compare across a row.
    head = ["| plan | " + " | ".join(TITLES[name] for name in models) + " |",
            "|---|" + "---:|" * len(models)]
    lines += ["Logits SQNR dB / top-1 agreement with the fp32 reference:", "", *head]
    lines += [f"| {plan} | " + " | ".join(f"{r['sqnr']:.1f} / {r['top1']:.3f}"
                                         for r in results[plan].values()) + " |"
              for plan in plans]
    lines += ["", "Values saturated / flushed to 0 in the whole run:", "", *head]
    lines += [f"| {plan} | " + " | ".join(f"{r['overflow']} / {r['underflow']}"
                                         for r in results[plan].values()) + " |"
              for plan in plans]
    text = "\n".join(lines) + "\n"
    print(text)
    if ARGS.write:
        replace_block(ARGS.write, lines, "<!-- scaled.py begin -->", "<!-- scaled.py end -->")
    return 0


ARGS: argparse.Namespace

if __name__ == "__main__":
    sys.exit(main())
