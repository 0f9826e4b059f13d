"""Small CLI promises a new user relies on: `--version`, and the keys of `run --save-outputs`."""

from __future__ import annotations

import platform
from importlib.metadata import version

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator


def test_version_prints_mplower_and_its_numeric_libraries_and_exits_0(cli):
    r = cli("--version")
    assert r.rc == 0 and r.err == ""
    assert r.out == (f"mplower {version('mplower')}\n"
                     f"  with numpy {version('numpy')}, numba {version('numba')}, "
                     f"onnx {version('onnx')}, networkx {version('networkx')}, "
                     f"lark {version('lark')}; Python {platform.python_version()}\n")


def test_version_of_an_uninstalled_source_tree_says_so(cli, monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version

    def version_without_mplower(dist: str) -> str:
        if dist == "mplower":
            raise importlib.metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(importlib.metadata, "version", version_without_mplower)
    r = cli("--version")
    assert r.rc == 0
    assert r.out.split("\n")[0] == "mplower unknown (not installed)"


# ---- run --save-outputs keys -----------------------------------------------------------------

def _two_output_model(tmp_path):
    """Relu and Sigmoid of a MatMul, with output names an npz writer could trip on."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Relu", ["h"], ["logits/relu:0"]),
             helper.make_node("Sigmoid", ["h"], ["file"])]
    graph = helper.make_graph(
        nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("logits/relu:0", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("file", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "two.onnx")
    x = rng.standard_normal((2, 4)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    return model, x


def test_save_outputs_keys_results_by_their_onnx_names_on_request(tmp_path, cli):
    model, x = _two_output_model(tmp_path)
    r = cli("import", tmp_path / "two.onnx", "-o", tmp_path / "two.ir")
    assert r.rc == 0, r.err
    assert ('attributes {mp.output_names = ["logits/relu:0", "file"]}'
            in (tmp_path / "two.ir").read_text())
    out = tmp_path / "out.npz"
    r = cli("run", tmp_path / "two.ir", "--inputs", tmp_path / "in.npz",
            "--save-outputs", out, "--output-names", "onnx")
    assert r.rc == 0, r.err
    saved = np.load(out)
    assert list(saved.keys()) == ["logits/relu:0", "file"]
    expected = ReferenceEvaluator(model).run(None, {"x": x})
    for key, want in zip(saved.keys(), expected):
        np.testing.assert_allclose(saved[key], want, rtol=1e-6, atol=1e-7)


def test_save_outputs_keys_by_index_by_default(tmp_path, cli):
    _two_output_model(tmp_path)
    assert cli("import", tmp_path / "two.onnx", "-o", tmp_path / "two.ir").rc == 0
    default, index = tmp_path / "default.npz", tmp_path / "index.npz"
    for out, extra in ((default, ()), (index, ("--output-names", "index"))):
        r = cli("run", tmp_path / "two.ir", "--inputs", tmp_path / "in.npz",
                "--save-outputs", out, *extra)
        assert r.rc == 0, r.err
    assert list(np.load(default).keys()) == list(np.load(index).keys()) == [
        "output_0", "output_1"]


def test_onnx_output_names_of_a_module_not_imported_from_onnx_is_a_located_error(tmp_path, cli):
    src = tmp_path / "m.ir"
    src.write_text("func.func @main(%x: tensor<2xf32>) -> tensor<2xf32> {\n"
                   "  %0 = mp.relu %x : (tensor<2xf32>) -> tensor<2xf32>\n"
                   "  return %0 : tensor<2xf32>\n}\n")
    out = tmp_path / "out.npz"
    r = cli("run", src, "--save-outputs", out, "--output-names", "onnx")
    assert r.rc == 1
    assert r.err == (f"{src}:1:1: error: --output-names onnx: @main has no mp.output_names "
                     "(only `mplower import` records them); use --output-names index\n"
                     "func.func @main(%x: tensor<2xf32>) -> tensor<2xf32> {\n^\n")
    assert not out.exists()


def test_onnx_output_names_that_do_not_match_the_results_are_a_located_error(tmp_path, cli):
    src = tmp_path / "m.ir"
    src.write_text('func.func @main(%x: tensor<2xf32>) -> tensor<2xf32> attributes '
                   '{mp.output_names = ["a", "b"]} {\n'
                   "  %0 = mp.relu %x : (tensor<2xf32>) -> tensor<2xf32>\n"
                   "  return %0 : tensor<2xf32>\n}\n")
    r = cli("run", src, "--save-outputs", tmp_path / "out.npz", "--output-names", "onnx")
    assert r.rc == 1
    assert r.err.split("\n")[0] == (f"{src}:1:1: error: mp.output_names of @main must hold one "
                                    'distinct, non-empty string per result (1), got ["a", "b"]')
