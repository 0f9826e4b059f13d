"""Real models through the ONNX frontend: scikit-learn MLPs -> skl2onnx -> `mplower import`.

For each bundled scikit-learn data set (digits: 10 classes, softmax head; breast cancer: two
classes, logistic head; wine: 3 classes) the script trains an MLPClassifier, converts it with
skl2onnx (ZipMap off), imports it with `mplower import --outputs probabilities --input-shape
X=<test rows>x<features>` (the label branch uses ai.onnx.ml ops and is pruned away), runs the
module on mplower's executor in fp32 over the whole test split, and checks that the argmax
labels equal scikit-learn's `predict` on every row. Everything is seeded.

    python ir_examples/real_models.py [--keep DIR]

prints one line per model and exits 1 if any label differs. `--keep DIR` leaves the .onnx,
.ir and .npz files there (by default they go to a temporary folder).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from skl2onnx import to_onnx
from sklearn.datasets import load_breast_cancer, load_digits, load_wine
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier

from mplower.backend.executor import Program
from mplower.cli.main import main as mplower_main
from mplower.ir.parser import parse
from mplower.ir.verifier import verify

DATASETS = {
    # name: (loader, hidden layers, standardize the features first)
    "digits": (load_digits, (64,), False),
    "breast_cancer": (load_breast_cancer, (32,), True),
    "wine": (load_wine, (16,), True),
}


@dataclass
class Result:
    name: str
    test_rows: int
    accuracy: float  # scikit-learn's, on the test split
    agreement: float  # fraction of test rows where mplower's label equals scikit-learn's
    max_prob_diff: float  # largest |p_mplower - p_sklearn| over the test split


def run_model(name: str, workdir: Path) -> Result:
    loader, hidden, standardize = DATASETS[name]
    x, y = loader(return_X_y=True)
    x = x.astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.3, random_state=0,
                                                        stratify=y)
    if standardize:  # preprocessing outside the model: the model is the MLP itself
        mean, std = x_train.mean(axis=0), x_train.std(axis=0) + 1e-6
        x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf = MLPClassifier(hidden_layer_sizes=hidden, max_iter=400, random_state=0)
        clf.fit(x_train, y_train)
    onx = to_onnx(clf, x_train[:1], options={"zipmap": False}, target_opset=17)
    onnx_path = workdir / f"{name}.onnx"
    onnx_path.write_bytes(onx.SerializeToString())
    ir_path = workdir / f"{name}.ir"
    rows, features = x_test.shape
    rc = mplower_main(["import", str(onnx_path), "-o", str(ir_path), "--outputs",
                       "probabilities", "--input-shape", f"X={rows}x{features}"])
    if rc != 0:
        raise SystemExit(f"{name}: mplower import failed (exit {rc})")
    module = parse(ir_path.read_text(), str(ir_path))
    verify(module)
    probs = Program(module).run([x_test], reference=False).outputs[0]
    labels = clf.classes_[np.argmax(probs, axis=1)]
    expected = clf.predict(x_test)
    return Result(name, rows, float(np.mean(expected == y_test)),
                  float(np.mean(labels == expected)),
                  float(np.max(np.abs(probs - clf.predict_proba(x_test)))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", type=Path, help="folder to leave the .onnx/.ir/.npz files in")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        results = [run_model(name, workdir) for name in DATASETS]
    ok = True
    for r in results:
        same = r.agreement == 1.0
        ok &= same
        print(f"{r.name:14s} {r.test_rows:4d} test rows  sklearn accuracy {r.accuracy:.3f}  "
              f"mplower fp32 labels {'==' if same else '!='} sklearn "
              f"({r.agreement:.4f})  max |dp| {r.max_prob_diff:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
