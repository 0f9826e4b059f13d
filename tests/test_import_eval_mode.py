"""`mplower import --eval-mode` (issue 32, section 2): a model exported in training mode imports
as inference, one note per node it changed; without the flag the refusal says how to proceed.
A scikit-learn classifier refused for ArrayFeatureExtractor is told to ask for its probabilities.

Values are checked against numpy (BatchNormalization with the running statistics, Dropout as
the identity), never against mplower's own code.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent


def _vi(name: str, shape: list[int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _training_model(path: Path) -> dict[str, np.ndarray]:
    """x -> BatchNormalization(training_mode=1) -> Dropout(training_mode=True) -> y."""
    rng = np.random.default_rng(0)
    p = {"scale": rng.uniform(0.5, 2, 3), "bias": rng.standard_normal(3),
         "mean": rng.standard_normal(3), "var": rng.uniform(0.5, 2, 3)}
    p = {k: v.astype(np.float32) for k, v in p.items()}
    inits = [numpy_helper.from_array(v, k) for k, v in p.items()]
    inits += [numpy_helper.from_array(np.array(0.1, np.float32), "ratio"),
              numpy_helper.from_array(np.array(True), "training")]
    nodes = [helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"],
                              ["bn", "run_mean", "run_var"], name="bn0", training_mode=1,
                              epsilon=1e-5),
             helper.make_node("Dropout", ["bn", "ratio", "training"], ["y"], name="drop0")]
    graph = helper.make_graph(nodes, "g", [_vi("x", [2, 3, 4, 4])], [_vi("y", [2, 3, 4, 4])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    onnx.save(model, path)
    return p


def test_training_mode_dropout_refusal_names_eval_mode(cli, tmp_path: Path) -> None:
    model = tmp_path / "train.onnx"
    _training_model(model)
    r = cli("import", model, "-o", tmp_path / "m.ir")
    assert r.rc == 1
    assert "node 'drop0' (Dropout)" in r.err and "--eval-mode" in r.err
    assert "Traceback" not in r.err
    assert not (tmp_path / "m.ir").exists()


def test_eval_mode_imports_dropout_and_batchnorm_as_inference(cli, tmp_path: Path) -> None:
    model = tmp_path / "train.onnx"
    p = _training_model(model)
    r = cli("import", model, "-o", tmp_path / "m.ir", "--eval-mode")
    assert r.rc == 0, r.err
    notes = [line for line in r.err.splitlines() if "note: --eval-mode" in line]
    assert len(notes) == 2
    assert "node 'bn0' (BatchNormalization)" in notes[0]
    assert "node 'drop0' (Dropout)" in notes[1] and "ratio 0.1" in notes[1]
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 4)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    r = cli("run", tmp_path / "m.ir", "--inputs", tmp_path / "in.npz",
            "--save-outputs", tmp_path / "out.npz")
    assert r.rc == 0, r.err
    y = np.load(tmp_path / "out.npz")["output_0"]
    b = (1, 3, 1, 1)
    want = ((x.astype(np.float64) - p["mean"].reshape(b)) / np.sqrt(p["var"].reshape(b) + 1e-5)
            * p["scale"].reshape(b) + p["bias"].reshape(b))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_array_feature_extractor_refusal_hints_at_probabilities(cli, tmp_path: Path) -> None:
    """skl2onnx's classifier: ArgMax over the probabilities, then ArrayFeatureExtractor maps
    the index to a label."""
    classes = numpy_helper.from_array(np.array([3, 7], np.int64), "classes")
    nodes = [helper.make_node("Softmax", ["x"], ["probabilities"], axis=1),
             helper.make_node("ArgMax", ["probabilities"], ["idx"], axis=1),
             helper.make_node("ArrayFeatureExtractor", ["classes", "idx"], ["label"],
                              domain="ai.onnx.ml")]
    graph = helper.make_graph(nodes, "g", [_vi("x", [4, 2])],
                              [helper.make_tensor_value_info("label", TensorProto.INT64, None),
                               _vi("probabilities", [4, 2])], [classes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.onnx.ml", 3)])
    onnx.save(model, tmp_path / "clf.onnx")
    r = cli("import", tmp_path / "clf.onnx", "-o", tmp_path / "m.ir")
    assert r.rc == 1
    assert "ArrayFeatureExtractor" in r.err and "--outputs probabilities" in r.err
    r = cli("import", tmp_path / "clf.onnx", "-o", tmp_path / "m.ir",
            "--outputs", "probabilities")
    assert r.rc == 0, r.err
