"""Accuracy retention of int8: post-training quantization against quantization-aware training.

For three digits models (the MLP of ir_examples/mlp.ir, 64-64-10; the CNN of
ir_examples/training/digits_cnn.ir; a wider MLP 64-256-128-10) the script trains an fp32 baseline from
seeded He-normal weights with `mplower train`'s Trainer (Adam, fp32), then measures top-1 on the
test split of benchmarks/quant.py (digits, 25 %, stratified, random_state 0; pixels / 16):

* int8 PTQ: calibrate{method=M} (minmax, percentile, entropy, mse; 8 batches of training
  images) + quantize (w8a8, weights per channel), every matmul and conv quantized;
* int8 QAT: calibrate with the best PTQ method, prepare-qat, `QAT_EPOCHS` epochs of SGD through
  the fake-quant ops, then quantize, which keeps the trained grids; with the calibrated scales
  frozen, and with them learned (prepare-qat{scales=lsq}).

Retention is top-1 over the fp32 baseline's. Run from the repository root:
`python benchmarks/training.py [--out report.md]` (about two minutes on two cores).
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant import digits_split

from mplower.backend.executor import Program, reference_runner
from mplower.ir.parser import parse, parse_file
from mplower.ir.printer import print_module
from mplower.pass_manager import PassContext, PassManager, parse_pipeline
from mplower.train.optim import SGD, Adam
from mplower.train.scaler import parse_loss_scale
from mplower.train.trainer import Trainer, fit, predict, store_inline

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out" / "training"
METHODS = ("minmax", "percentile", "entropy", "mse")
F32 = np.float32
EPOCHS, QAT_EPOCHS = 20, 3


def mlp_ir(hidden: tuple[int, ...], batch: int = 32) -> tuple[str, dict[str, np.ndarray]]:
    """An MLP 64-hidden...-10 returning logits, with He-normal weights from default_rng(0)."""
    rng = np.random.default_rng(0)
    t = lambda *s: "tensor<" + "".join(f"{d}x" for d in s) + "f32>"
    lines, weights, h, width = [], {}, "%x", 64
    for i, n_out in enumerate((*hidden, 10), start=1):
        weights[f"fc{i}.weight"] = (rng.standard_normal((width, n_out))
                                    * math.sqrt(2 / width)).astype(F32)
        weights[f"fc{i}.bias"] = np.zeros(n_out, F32)
        lines += [f'    %w{i} = mp.constant {{name = "fc{i}.weight"}} : () -> {t(width, n_out)}',
                  f'    %b{i} = mp.constant {{name = "fc{i}.bias"}} : () -> {t(n_out)}',
                  (f"    %m{i} = mp.matmul {h}, %w{i} : ({t(batch, width)}, {t(width, n_out)}) -> "
                  f"{t(batch, n_out)}"),
                  (f"    %a{i} = mp.add %m{i}, %b{i} : ({t(batch, n_out)}, {t(n_out)}) -> "
                  f"{t(batch, n_out)}")]
        h = f"%a{i}"
        if n_out != 10:
            lines.append(f"    %r{i} = mp.relu {h} : ({t(batch, n_out)}) -> {t(batch, n_out)}")
            h = f"%r{i}"
        width = n_out
    text = (f'module attributes {{mp.weights = "init.npz"}} {{\n'
            f"  func.func @main(%x: {t(batch, 64)}) -> {t(batch, 10)} {{\n"
            + "\n".join(lines) + f"\n    return {h} : {t(batch, 10)}\n  }}\n}}\n")
    return text, weights


def cnn_ir() -> tuple[str, dict[str, np.ndarray]]:
    text = (ROOT / "ir_examples" / "training" / "digits_cnn.ir").read_text()
    with np.load(ROOT / "ir_examples" / "training" / "digits_cnn.npz") as w:
        weights = dict(w)
    return text.replace('"digits_cnn.npz"', '"init.npz"'), weights


MODELS = {
    "digits-mlp": ("MLP 64-64-10 (ir_examples/mlp.ir's layers)", lambda: mlp_ir((64,)),
                   Adam(lr=3e-3)),
    "digits-cnn": ("CNN conv8-pool-conv16-fc (ir_examples/training/digits_cnn.ir)", cnn_ir,
                   Adam(lr=3e-3)),
    "digits-mlp-wide": ("MLP 64-256-128-10", lambda: mlp_ir((256, 128)), Adam(lr=1e-3)),
}


def accuracy(module, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.argmax(predict(Program(module), x), axis=-1) == y))


def save(folder: Path, name: str, module, weights: dict[str, np.ndarray]) -> Path:
    inline = store_inline(module, None, weights)
    np.savez(folder / f"{name}.npz", **{k: v for k, v in weights.items() if k not in inline})
    module.attrs["mp.weights"] = f"{name}.npz"
    path = folder / f"{name}.ir"
    path.write_text(print_module(module))
    return path


def lowered(path: Path, pipeline: str):
    module = parse_file(path)
    PassManager(parse_pipeline(pipeline)).run(module, PassContext(runner=reference_runner))
    return module


def run_model(key: str, split, folder: Path) -> dict:
    description, make, optimizer = MODELS[key]
    folder.mkdir(parents=True, exist_ok=True)
    text, init = make()
    image = key == "digits-cnn"
    x_train, x_test, y_train, y_test = split
    shape = (-1, 1, 8, 8) if image else (-1, 64)
    x_train = (x_train / 16).astype(F32).reshape(shape)
    x_test = (x_test / 16).astype(F32).reshape(shape)
    np.savez(folder / "init.npz", **init)
    (folder / "init.ir").write_text(text)
    module = parse(text, str(folder / "init.ir"))
    module.path = str(folder / "init.ir")
    batch = module.function().types(module.function().args[0])[0].shape[0]
    steps = EPOCHS * (len(y_train) // batch)
    trainer = Trainer(module, "cross_entropy", "y", [], optimizer, parse_loss_scale("none"))
    fit(trainer, {"x": x_train, "y": y_train}, steps, seed=0)
    fp32 = trainer.accuracy(x_test, y_test)
    fp32_path = save(folder, "fp32", module, trainer.params)
    np.savez(folder / "calib.npz", x=x_train[:8 * batch].reshape((8, batch) + x_train.shape[1:]))
    calib = folder / "calib.npz"
    ptq = {m: accuracy(lowered(fp32_path, f"calibrate{{data={calib} method={m}}},quantize"),
                       x_test, y_test) for m in METHODS}
    best = max(METHODS, key=lambda m: (ptq[m], -METHODS.index(m)))
    qat_acc = {}
    for scales in ("frozen", "lsq"):
        qat_module = lowered(fp32_path, f"calibrate{{data={calib} method={best}}},"
                                        f"prepare-qat{{scales={scales}}}")
        qat = Trainer(qat_module, "cross_entropy", "y", [], SGD(lr=0.01, momentum=0.9),
                      parse_loss_scale("none"))
        fit(qat, {"x": x_train, "y": y_train}, QAT_EPOCHS * (len(y_train) // batch), seed=1)
        qat_path = save(folder, f"qat_{scales}", qat_module, qat.params)
        qat_acc[scales] = accuracy(lowered(qat_path, "quantize"), x_test, y_test)
    return {"model": key, "description": description, "fp32": fp32, "ptq": ptq, "best": best,
            "qat": qat_acc, "epochs": EPOCHS, "qat_epochs": QAT_EPOCHS}


def table(rows: list[dict]) -> str:
    out = [("| model | fp32 top-1 | PTQ minmax | PTQ best (method) | QAT frozen scales | "
           "QAT LSQ |"), "|---|---|---|---|---|---|"]
    for r in rows:
        f = r["fp32"]

        def cell(a: float, f: float = f) -> str:
            return f"{100 * a:.2f} % ({100 * a / f:.1f} %)"
        out.append(f"| {r['model']}: {r['description']} | {100 * f:.2f} % | "
                   f"{cell(r['ptq']['minmax'])} | {cell(r['ptq'][r['best']])} ({r['best']}) | "
                   f"{cell(r['qat']['frozen'])} | {cell(r['qat']['lsq'])} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the markdown report here")
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    split = digits_split()
    rows = [run_model(k, split, OUT / k) for k in args.models.split(",")]
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    report = (f"`python benchmarks/training.py` on {platform.machine()} "
              f"({platform.processor() or 'cpu'}), Python {platform.python_version()}, {date}; "
              f"fp32 trained {EPOCHS} epochs (Adam), QAT {QAT_EPOCHS} epochs (SGD lr 0.01, "
              f"momentum 0.9). Cells: top-1 on the test split (retention vs fp32).\n\n"
              + table(rows) + "\n\nPTQ top-1 by method: " + "; ".join(
                  f"{r['model']}: " + ", ".join(f"{m} {100 * r['ptq'][m]:.2f} %" for m in METHODS)
                  for r in rows) + "\n")
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
