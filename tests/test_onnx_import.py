"""`mplower import` and the ONNX frontend: static shapes, folding, pruning, diagnostics, fidelity.

Fidelity is judged by onnxruntime running the same ONNX model (code nobody here wrote); the
backend node tests are in test_onnx_conformance.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mplower.backend.executor import Program
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.parser import parse
from mplower.ir.verifier import verify
from mplower.onnx.backend import MplowerBackend
from mplower.onnx.importer import (
    StaticInputsNeeded,
    import_model,
    load_model,
    parse_input_shape,
)

ort = pytest.importorskip("onnxruntime")
F = TensorProto.FLOAT
_rng = np.random.default_rng(0)


def make_model(nodes, inputs, outputs, inits=(), opset=17, name="g") -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                             ir_version=8)


def vi(name, shape, t=F):
    return helper.make_tensor_value_info(name, t, shape)


def init(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


def run_ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def run_mplower(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return MplowerBackend.prepare(model).run(feeds)


def save(model: onnx.ModelProto, path: Path) -> Path:
    path.write_bytes(model.SerializeToString())
    return path


def ops_of(module) -> list[str]:
    f = module.function()
    return [f.op(n) for n in f.ops()]


# ---- a small CNN with random weights against onnxruntime ---------------------------------------

def _cnn() -> onnx.ModelProto:
    w1 = _rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32)
    b1 = _rng.normal(0, 0.1, 8).astype(np.float32)
    bn = [_rng.uniform(0.5, 1.5, 8), _rng.normal(0, 0.1, 8), _rng.normal(0, 0.1, 8),
          _rng.uniform(0.5, 1.5, 8)]
    w2 = _rng.normal(0, 0.2, (8, 8, 3, 3)).astype(np.float32)
    w3 = _rng.normal(0, 0.2, (4, 8, 1, 1)).astype(np.float32)
    fc = _rng.normal(0, 0.3, (10, 12)).astype(np.float32)
    fcb = _rng.normal(0, 0.1, 10).astype(np.float32)
    inits = [init("w1", w1), init("b1", b1), init("w2", w2), init("w3", w3), init("fc", fc),
             init("fcb", fcb)] + [init(n, v.astype(np.float32)) for n, v in
                                  zip(("s", "bb", "m", "v"), bn)]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "s", "bb", "m", "v"], ["n1"],
                         epsilon=1e-3),
        helper.make_node("Relu", ["n1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["p1", "w2"], ["c2"], auto_pad="SAME_UPPER"),
        helper.make_node("Add", ["c2", "p1"], ["res"]),
        helper.make_node("LRN", ["res"], ["l"], size=3, alpha=1e-3, beta=0.75, bias=1.0),
        helper.make_node("Conv", ["l", "w3"], ["c3"], strides=[2, 2], pads=[0, 0, 1, 1]),
        helper.make_node("AveragePool", ["l"], ["a"], kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1, 1, 1, 1], ceil_mode=1, count_include_pad=1),
        helper.make_node("Concat", ["c3", "a"], ["cat"], axis=1),
        helper.make_node("GlobalAveragePool", ["cat"], ["g"]),
        helper.make_node("Flatten", ["g"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fc", "fcb"], ["logits"], transB=1, alpha=0.5),
        helper.make_node("Softmax", ["logits"], ["prob"]),
    ]
    return make_model(nodes, [vi("x", ["N", 3, 16, 16])], [vi("prob", ["N", 10])], inits,
                      opset=13)


def test_cnn_with_random_weights_matches_onnxruntime():
    model = _cnn()
    x = _rng.normal(size=(2, 3, 16, 16)).astype(np.float32)
    ours = MplowerBackend.prepare(model).run([x])[0]
    theirs = run_ort(model, {"x": x})[0]
    assert ours.shape == (2, 10) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6)


def test_batchnorm_after_conv_is_folded_into_its_weights():
    imported = import_model(_cnn(), "cnn.onnx")
    ops = ops_of(imported.module)
    first_conv = ops.index("mp.conv2d")
    assert ops[first_conv + 1] == "mp.relu"  # no mul/add left between conv and relu
    assert "mp.mul" not in ops[:first_conv + 1]


def test_dynamic_batch_defaults_to_one_and_input_shape_fixes_it():
    model = _cnn()
    t = import_model(model, "cnn.onnx").module.function().types(
        import_model(model, "cnn.onnx").module.function().args[0])[0]
    assert t.shape == (1, 3, 16, 16)
    m = import_model(_cnn(), "cnn.onnx", input_shapes={"x": (4, 3, 16, 16)}).module
    f = m.function()
    assert f.types(f.args[0])[0].shape == (4, 3, 16, 16)
    assert f.result_types[0].shape == (4, 10)


def test_a_dynamic_inner_dimension_needs_input_shape():
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [1, "seq"])],
                       [vi("y", [1, "seq"])])
    with pytest.raises(DiagnosticError, match=r"dynamic dimension 1 \('seq'\).*--input-shape "
                                              r"x=1xN"):
        import_model(model, "m.onnx")
    f = import_model(model, "m.onnx", input_shapes={"x": (1, 7)}).module.function()
    assert f.result_types[0].shape == (1, 7)


def test_input_shape_errors_name_the_problem():
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [2, 3])],
                       [vi("y", [2, 3])])
    with pytest.raises(DiagnosticError, match="not an input of the model"):
        import_model(model, "m.onnx", input_shapes={"z": (2, 3)})
    with pytest.raises(DiagnosticError, match="sets dimension 1 to 4, but the model fixes it"):
        import_model(model, "m.onnx", input_shapes={"x": (2, 4)})
    assert parse_input_shape("a=b=1x2") == ("a=b", (1, 2))
    assert parse_input_shape("s=") == ("s", ())
    with pytest.raises(ValueError):
        parse_input_shape("x=1xq")


def test_constant_subgraphs_fold_into_one_constant():
    nodes = [
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(
            np.float32([1, 2, 3]))),
        helper.make_node("Mul", ["c", "c"], ["c2"]),
        helper.make_node("Add", ["c2", "one"], ["c3"]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("ConstantOfShape", ["shape"], ["zeros"],
                         value=numpy_helper.from_array(np.float32([0.5]))),
        helper.make_node("Add", ["x", "c3"], ["y0"]),
        helper.make_node("Mul", ["y0", "zeros"], ["y"]),
    ]
    model = make_model(nodes, [vi("x", [2, 3])], [vi("y", [2, 3])],
                       [init("one", np.float32(1))])
    module = import_model(model, "m.onnx").module
    assert ops_of(module) == ["mp.constant", "mp.add", "mp.constant", "mp.mul", "return"]
    x = _rng.normal(size=(2, 3)).astype(np.float32)
    np.testing.assert_allclose(run_mplower(model, {"x": x})[0], (x + [2, 5, 10]) * 0.5)


def test_outputs_keeps_only_what_feeds_them():
    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("ZipMap", ["x"], ["z"], domain="ai.onnx.ml",
                              classlabels_int64s=[0, 1]),
             helper.make_node("Sigmoid", ["x"], ["b"])]
    graph = helper.make_graph(nodes, "g", [vi("x", [1, 2])], [
        vi("a", [1, 2]), helper.make_tensor_value_info("z", TensorProto.UNDEFINED, None),
        vi("b", [1, 2])])
    model = helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)], ir_version=8)
    with pytest.raises(DiagnosticError, match=r"ai.onnx.ml::ZipMap \(1\)"):
        import_model(model, "m.onnx")
    imported = import_model(model, "m.onnx", outputs=["b", "a"])
    assert imported.outputs == ["b", "a"]
    assert ops_of(imported.module) == ["mp.relu", "mp.sigmoid", "return"]
    with pytest.raises(DiagnosticError, match="'c', which the model does not output"):
        import_model(model, "m.onnx", outputs=["c"])


def test_two_unsupported_op_types_get_one_diagnostic_naming_both(tmp_path, cli):
    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("RandomUniformLike", ["a"], ["b"]),
             helper.make_node("RandomUniformLike", ["b"], ["c"]),
             helper.make_node("Bernoulli", ["c"], ["y"])]
    model = make_model(nodes, [vi("x", [2, 3])], [vi("y", [2, 3])])
    path = save(model, tmp_path / "bad.onnx")
    r = cli("import", path, "-o", tmp_path / "bad.ir")
    assert r.rc == 1 and "Traceback" not in r.err
    assert r.err.count("error:") == 1
    assert "2 op type(s) that mplower cannot import: Bernoulli (1), RandomUniformLike (2)" in r.err
    assert not list(tmp_path.glob("bad.ir*")) and not list(tmp_path.glob("bad.npz"))


def test_cli_import_writes_ir_and_weights_that_run(tmp_path, cli):
    model = _cnn()
    path = save(model, tmp_path / "cnn.onnx")
    r = cli("import", path, "-o", tmp_path / "cnn.ir", "--input-shape", "x=2x3x16x16")
    assert r.rc == 0, r.err
    text = (tmp_path / "cnn.ir").read_text()
    assert 'mp.weights = "cnn.npz"' in text and (tmp_path / "cnn.npz").exists()
    module = parse(text, str(tmp_path / "cnn.ir"))
    verify(module)
    x = _rng.normal(size=(2, 3, 16, 16)).astype(np.float32)
    ours = Program(module).run([x], reference=False).outputs[0]
    np.testing.assert_allclose(ours, run_ort(model, {"x": x})[0], rtol=1e-4, atol=1e-6)


def test_cli_import_refuses_two_shapes_for_one_input(tmp_path, cli):
    path = save(_cnn(), tmp_path / "cnn.onnx")
    r = cli("import", path, "-o", tmp_path / "cnn.ir", "--input-shape", "x=2x3x16x16",
            "--input-shape", "x=4x3x16x16")
    assert r.rc != 0 and "Traceback" not in r.err
    assert "--input-shape gives input 'x' two shapes: 2x3x16x16 and 4x3x16x16" in r.err
    assert not (tmp_path / "cnn.ir").exists()
    r = cli("import", path, "-o", tmp_path / "cnn.ir", "--input-shape", "x=2x3x16x16",
            "--input-shape", "x=2x3x16x16")  # the same shape twice says nothing new
    assert r.rc == 0, r.err


def test_malformed_model_file_is_a_diagnostic(tmp_path, cli):
    bad = tmp_path / "junk.onnx"
    bad.write_bytes(b"\x08\x07\xff\xff\xff garbage")
    r = cli("import", bad, "-o", tmp_path / "junk.ir")
    assert r.rc == 1 and "Traceback" not in r.err
    assert f"{bad}: error: not a valid ONNX model" in r.err
    r = cli("import", tmp_path / "missing.onnx", "-o", tmp_path / "x.ir")
    assert r.rc == 1 and "no such file" in r.err
    assert not (tmp_path / "junk.ir").exists()


def test_external_data_outside_the_model_folder_is_refused(tmp_path):
    outside = tmp_path / "secret.bin"
    outside.write_bytes(np.ones(4, np.float32).tobytes())
    model = make_model([helper.make_node("Add", ["x", "w"], ["y"])], [vi("x", [4])],
                       [vi("y", [4])], [init("w", np.zeros(4, np.float32))])
    w = model.graph.initializer[0]
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    w.external_data.add(key="location", value="../secret.bin")
    (tmp_path / "models").mkdir()
    path = save(model, tmp_path / "models" / "m.onnx")
    with pytest.raises(DiagnosticError, match="outside the model's folder"):
        load_model(path)
    w.external_data[0].value = "w.bin"
    (tmp_path / "models" / "w.bin").write_bytes(np.full(4, 2, np.float32).tobytes())
    loaded = load_model(save(model, path))
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(run_mplower(loaded, {"x": x})[0], x + 2)


def test_opset_outside_the_supported_range_is_refused():
    from mplower.onnx.importer import MAX_OPSET

    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [2])], [vi("y", [2])],
                       opset=MAX_OPSET + 1)
    with pytest.raises(DiagnosticError, match=f"opset {MAX_OPSET + 1}; mplower imports "
                                              f"opsets 1 to {MAX_OPSET}"):
        import_model(model, "new.onnx")


def test_softmax_at_opset_6_imports_and_legacy_axis_broadcasting_is_refused():
    # Opsets before 9 used to be refused whole (issue 16: Softmax-6, And-7 node tests).
    x = _rng.normal(size=(2, 3, 4)).astype(np.float32)
    model = make_model([helper.make_node("Softmax", ["x"], ["y"], axis=1)], [vi("x", [2, 3, 4])],
                       [vi("y", [2, 3, 4])], opset=6)
    np.testing.assert_allclose(run_mplower(model, {"x": x})[0], run_ort(model, {"x": x})[0],
                               rtol=1e-6)
    legacy = make_model([helper.make_node("Add", ["x", "b"], ["y"], broadcast=1, axis=1)],
                        [vi("x", [2, 3, 4]), vi("b", [3])], [vi("y", [2, 3, 4])], opset=6)
    with pytest.raises(DiagnosticError, match=r"node 'y' \(Add\): legacy broadcasting along an "
                                              r"axis \(opset < 7\)"):
        import_model(legacy, "old.onnx")


def test_a_reshape_target_from_a_graph_input_names_that_input():
    model = make_model([helper.make_node("Reshape", ["x", "shape"], ["y"])],
                       [vi("x", [2, 3]), vi("shape", [2], TensorProto.INT64)], [vi("y", [3, 2])])
    with pytest.raises(StaticInputsNeeded, match=r"the target shape \('shape'\) must be a "
                                                 r"constant.*graph input\(s\) 'shape'") as e:
        import_model(model, "m.onnx")
    assert e.value.names == ["shape"]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = run_mplower(model, [x, np.array([3, -1], np.int64)])[0]
    np.testing.assert_array_equal(out, x.reshape(3, 2))


def test_gemm_every_attribute_against_onnxruntime():
    a = _rng.normal(size=(5, 3)).astype(np.float32)
    b = _rng.normal(size=(4, 5)).astype(np.float32)
    c = _rng.normal(size=(1, 4)).astype(np.float32)
    node = helper.make_node("Gemm", ["a", "b", "c"], ["y"], transA=1, transB=1, alpha=0.25,
                            beta=-2.0)
    for const_b in (False, True):
        inits = [init("b", b)] if const_b else []
        ins = [vi("a", [5, 3]), vi("c", [1, 4])] + ([] if const_b else [vi("b", [4, 5])])
        model = make_model([node], ins, [vi("y", [3, 4])], inits, opset=13)
        feeds = {"a": a, "c": c, **({} if const_b else {"b": b})}
        np.testing.assert_allclose(run_mplower(model, feeds)[0], run_ort(model, feeds)[0],
                                   rtol=1e-5, atol=1e-6)


def test_argmax_returns_int64_and_softmax_before_opset_13_coerces_to_2d():
    x = _rng.normal(size=(2, 3, 4)).astype(np.float32)
    model = make_model([helper.make_node("Softmax", ["x"], ["s"], axis=1),
                        helper.make_node("ArgMax", ["s"], ["i"], axis=2, select_last_index=1)],
                       [vi("x", [2, 3, 4])], [vi("s", [2, 3, 4]),
                                              vi("i", [2, 3, 1], TensorProto.INT64)], opset=12)
    ours = run_mplower(model, {"x": x})
    theirs = run_ort(model, {"x": x})
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5)
    assert ours[1].dtype == np.int64
    np.testing.assert_array_equal(ours[1], theirs[1])


def test_real_sklearn_models_give_sklearns_labels_on_the_whole_test_split(tmp_path, monkeypatch):
    import importlib.util
    import sys

    script = Path(__file__).resolve().parent.parent / "ir_examples" / "real_models.py"
    spec = importlib.util.spec_from_file_location("real_models", script)
    real_models = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "real_models", real_models)  # dataclasses look it up
    spec.loader.exec_module(real_models)
    for name in ("digits", "breast_cancer"):
        result = real_models.run_model(name, tmp_path)
        assert result.test_rows > 100 and result.accuracy > 0.9
        assert result.agreement == 1.0, f"{name}: labels differ from scikit-learn's"
        assert "ai.onnx.ml" not in (tmp_path / f"{name}.ir").read_text()


def test_batchnorm_folding_leaves_weights_shared_with_another_conv_alone():
    w = _rng.normal(0, 0.3, (3, 3, 1, 1)).astype(np.float32)
    bn = [init(n, v) for n, v in zip(("s", "b", "m", "v"), (
        np.float32([2, 1, 0.5]), np.float32([0.1, 0, -0.1]), np.float32([0, 1, 2]),
        np.float32([1, 2, 3])))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c1"]),
             helper.make_node("BatchNormalization", ["c1", "s", "b", "m", "v"], ["n1"]),
             helper.make_node("Conv", ["n1", "w"], ["y"])]
    model = make_model(nodes, [vi("x", [1, 3, 4, 4])], [vi("y", [1, 3, 4, 4])],
                       [init("w", w), *bn])
    ops = ops_of(import_model(model, "m.onnx").module)
    assert ops.count("mp.conv2d") == 2 and "mp.mul" not in ops
    x = _rng.normal(size=(1, 3, 4, 4)).astype(np.float32)
    np.testing.assert_allclose(run_mplower(model, {"x": x})[0], run_ort(model, {"x": x})[0],
                               rtol=1e-5, atol=1e-6)


# ---- models that lie about their shapes, their values' producers or their files ----------------


def assert_import_error(r, path: Path, message: str) -> None:
    assert r.rc == 1, r.err
    assert "Traceback" not in r.err and "internal error" not in r.err
    assert f"{path}: error: {message}" in r.err, r.err


@pytest.mark.parametrize("dims", [[-5, 4], [2, -5]])
def test_negative_input_dimension_is_refused_at_import(tmp_path, cli, dims):
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", dims)],
                       [vi("y", dims)])
    path = save(model, tmp_path / "neg.onnx")
    r = cli("import", path, "-o", tmp_path / "neg.ir")
    k = dims.index(-5)
    assert_import_error(r, path, f"input 'x' has a negative dimension {k} (-5); ONNX "
                                 f"dimensions are >= 0")
    assert not (tmp_path / "neg.ir").exists()


def test_initializer_with_a_negative_dimension_is_refused(tmp_path, cli):
    w = TensorProto(name="w", data_type=F, dims=[-1, 4],
                    raw_data=np.ones(4, np.float32).tobytes())
    model = make_model([helper.make_node("Add", ["x", "w"], ["y"])], [vi("x", [1, 4])],
                       [vi("y", [1, 4])], [w])
    path = save(model, tmp_path / "w.onnx")
    assert_import_error(cli("import", path, "-o", tmp_path / "w.ir"), path,
                        "tensor 'w' has negative dimensions [-1, 4]; ONNX dimensions are >= 0")


def test_computed_negative_shapes_for_reshape_and_constant_of_shape_are_refused():
    # Neg computes the shape at import time, where ONNX's shape inference cannot see it.
    shape = init("s", np.array([2, 3], np.int64))
    model = make_model([helper.make_node("Neg", ["s"], ["ns"]),
                        helper.make_node("Reshape", ["x", "ns"], ["y"], name="r")],
                       [vi("x", [2, 3])], [vi("y", None)], [shape])
    with pytest.raises(DiagnosticError, match=r"node 'r' \(Reshape\): target shape \[-2, -3\] "
                                              r"has a negative dimension other than -1"):
        import_model(model, "r.onnx")
    model = make_model([helper.make_node("Neg", ["s"], ["ns"]),
                        helper.make_node("ConstantOfShape", ["ns"], ["c"], name="c"),
                        helper.make_node("Add", ["x", "c"], ["y"])],
                       [vi("x", [1])], [vi("y", None)], [shape])
    with pytest.raises(DiagnosticError, match=r"node 'c' \(ConstantOfShape\): shape \[-2, -3\] "
                                              r"has a negative dimension"):
        import_model(model, "c.onnx")


def test_constant_of_shape_too_large_for_memory_names_the_node(tmp_path, cli):
    shape = init("s", np.array([2 ** 40], np.int64))  # 4 TiB of float32
    model = make_model([helper.make_node("ConstantOfShape", ["s"], ["c"], name="fill"),
                        helper.make_node("Add", ["x", "c"], ["y"])],
                       [vi("x", [1])], [vi("y", None)], [shape])
    path = save(model, tmp_path / "big.onnx")
    assert_import_error(cli("import", path, "-o", tmp_path / "big.ir"), path,
                        "node 'fill' (ConstantOfShape): shape [1099511627776] has "
                        "1099511627776 elements, more than the 2147483648 (2^31) that import "
                        "folds into a constant")


def test_two_nodes_writing_one_value_is_refused_naming_both(tmp_path, cli):
    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="first"),
                        helper.make_node("Neg", ["x"], ["y"], name="second")],
                       [vi("x", [2, 4])], [vi("y", [2, 4])])
    path = save(model, tmp_path / "dup.onnx")
    assert_import_error(cli("import", path, "-o", tmp_path / "dup.ir"), path,
                        "node 'second' (#1, Neg) writes 'y', which is already written by node "
                        "'first' (#0, Relu); a value must have one producer")
    assert not (tmp_path / "dup.ir").exists()


@pytest.mark.parametrize("shadowed, what", [("x", "a graph input"), ("w", "an initializer")])
def test_node_output_shadowing_an_input_or_initializer_is_refused(shadowed, what):
    model = make_model([helper.make_node("Relu", ["x"], [shadowed], name="r"),
                        helper.make_node("Add", ["x", "w"], ["y"])],
                       [vi("x", [4])], [vi("y", [4])], [init("w", np.zeros(4, np.float32))])
    with pytest.raises(DiagnosticError, match=rf"node 'r' \(#0, Relu\) writes '{shadowed}', "
                                              rf"which is already {what}; a value must have "
                                              rf"one producer"):
        import_model(model, "s.onnx")


def _external(model: onnx.ModelProto, location: str) -> onnx.ModelProto:
    w = model.graph.initializer[0]
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    del w.external_data[:]
    w.external_data.add(key="location", value=location)
    return model


def _add_w_model() -> onnx.ModelProto:
    return make_model([helper.make_node("Add", ["x", "w"], ["y"])], [vi("x", [4])],
                      [vi("y", [4])], [init("w", np.zeros(4, np.float32))])


def test_external_data_location_with_a_nul_byte_is_refused(tmp_path, cli):
    (tmp_path / "w.bin").write_bytes(np.ones(4, np.float32).tobytes())
    path = save(_external(_add_w_model(), "w.bin\0../../etc/passwd"), tmp_path / "m.onnx")
    assert_import_error(cli("import", path, "-o", tmp_path / "m.ir"), path,
                        "tensor 'w' keeps its data in 'w.bin\\x00../../etc/passwd', whose name "
                        "holds a NUL byte; refusing to read it")


@pytest.mark.parametrize("location", ["/etc/passwd", "sub/../../secret.bin", "link.bin"])
def test_external_data_escaping_the_model_folder_is_refused(tmp_path, location):
    (tmp_path / "secret.bin").write_bytes(np.ones(4, np.float32).tobytes())
    folder = tmp_path / "models"
    (folder / "sub").mkdir(parents=True)
    (folder / "link.bin").symlink_to(tmp_path / "secret.bin")
    path = save(_external(_add_w_model(), location), folder / "m.onnx")
    with pytest.raises(DiagnosticError, match=rf"tensor 'w' keeps its data in '{location}', "
                                              rf"outside the model's folder"):
        load_model(path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_as_model_or_external_data_is_refused_without_waiting(tmp_path):
    os.mkfifo(tmp_path / "w.bin")
    path = save(_external(_add_w_model(), "w.bin"), tmp_path / "m.onnx")
    os.mkfifo(tmp_path / "pipe.onnx")
    # In a child process: a read that blocks (the bug) fails the test instead of hanging it.
    external = "tensor 'w': external data file 'w.bin' is not a regular file"
    for model, message in ((path, external),
                           (tmp_path / "pipe.onnx", "cannot read model: not a regular file")):
        r = subprocess.run([sys.executable, "-m", "mplower", "import", str(model), "-o",
                            str(tmp_path / "m.ir")], check=False, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 1, r.stderr
        assert f"{model}: error: {message}" in r.stderr


def test_memory_error_reading_a_tensor_names_the_model_and_the_tensor(tmp_path, cli,
                                                                      monkeypatch):
    import onnx.external_data_helper

    def out_of_memory(*args, **kwargs):
        raise MemoryError

    model = _add_w_model()
    path = save(model, tmp_path / "m.onnx")
    monkeypatch.setattr(numpy_helper, "to_array", out_of_memory)
    assert_import_error(cli("import", path, "-o", tmp_path / "m.ir"), path,
                        "not enough memory to read tensor 'w' [4]")
    (tmp_path / "w.bin").write_bytes(np.ones(4, np.float32).tobytes())
    path = save(_external(model, "w.bin"), tmp_path / "ext.onnx")
    monkeypatch.setattr(onnx.external_data_helper, "load_external_data_for_tensor",
                        out_of_memory)
    assert_import_error(cli("import", path, "-o", tmp_path / "m.ir"), path,
                        "tensor 'w': not enough memory to read its external data 'w.bin'")


def test_initializers_named_like_savez_parameters_are_written_and_run(tmp_path, cli):
    # np.savez(fh, **weights) would take `file` as its own first parameter (TypeError) and
    # `allow_pickle` as its flag (the weight silently missing from the archive).
    w = _rng.normal(size=(64, 64)).astype(np.float32)
    b = _rng.normal(size=(64,)).astype(np.float32)
    model = make_model([helper.make_node("MatMul", ["x", "file"], ["h"]),
                        helper.make_node("Add", ["h", "allow_pickle"], ["y"])],
                       [vi("x", [4, 64])], [vi("y", [4, 64])],
                       [init("file", w), init("allow_pickle", b)])
    path = save(model, tmp_path / "m.onnx")
    r = cli("import", path, "-o", tmp_path / "m.ir")
    assert r.rc == 0, r.err
    with np.load(tmp_path / "m.npz", allow_pickle=False) as z:
        stored = {k: z[k] for k in z.files}
    assert any(np.array_equal(a, w) for a in stored.values())
    assert any(np.array_equal(a, b) for a in stored.values())
    module = parse((tmp_path / "m.ir").read_text(), str(tmp_path / "m.ir"))
    verify(module)
    x = _rng.normal(size=(4, 64)).astype(np.float32)
    ours = Program(module).run([x], reference=False).outputs[0]
    np.testing.assert_allclose(ours, run_ort(model, {"x": x})[0], rtol=1e-5, atol=1e-5)
