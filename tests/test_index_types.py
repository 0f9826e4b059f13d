"""Index element types (i64, i16, ui16, ui32, ui64) and the ops that move and compare values.

Issue 16: exporters give token ids, positions and masks as INT64 (and ONNX's tests use the
other widths). Expected values come from numpy written out here, from onnxruntime running
the exported model, or from ONNX's own definitions; never from mplower's kernels.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mplower.backend.executor import Program
from mplower.ir.diagnostics import DiagnosticError, Location
from mplower.ir.parser import parse
from mplower.ir.printer import print_module
from mplower.ir.verifier import verify
from mplower.onnx.exporter import check_and_serialize, export_module
from mplower.onnx.importer import import_model

ort = pytest.importorskip("onnxruntime")

EXTREMES = """
func.func @main(%x: tensor<3xi64>) -> tensor<3xui64> {
  %c = mp.constant {value = dense<[18446744073709551615, 0, 7]> : tensor<3xui64>} : () -> tensor<3xui64>
  %d = mp.constant {value = dense<[-9223372036854775808, 9223372036854775807]> : tensor<2xi64>} : () -> tensor<2xi64>
  %e = mp.constant {value = dense<[-32768, 65535]> : tensor<2xui32>} : () -> tensor<2xui32>
  %0 = mp.cast %x : (tensor<3xi64>) -> tensor<3xui64>
  %1 = mp.maximum %0, %c : (tensor<3xui64>, tensor<3xui64>) -> tensor<3xui64>
  return %1 : tensor<3xui64>
}
"""


def test_index_types_print_and_parse_back_at_their_extremes():
    text = EXTREMES.replace("-32768, 65535", "0, 4294967295")
    module = parse(text)
    verify(module)
    assert print_module(parse(print_module(module))) == print_module(module)
    f = module.function()
    values = {f.value_name((n, 0)): f.data(n)["attrs"]["value"].array for n in f.ops()
              if f.op(n) == "mp.constant"}
    assert values["%c"].dtype == np.uint64 and int(values["%c"][0]) == 2 ** 64 - 1
    assert values["%d"].tolist() == [-2 ** 63, 2 ** 63 - 1]


@pytest.mark.parametrize(("literal", "elem", "col", "message"), [
    ("9223372036854775808", "i64", 35, ("integer value 9223372036854775808 is out of range for "
                                       "i64 (range [-9223372036854775808, 9223372036854775807])")),
    ("-1", "ui64", 35, ("integer value -1 is out of range for ui64 (range [0, "
                       "18446744073709551615])")),
    ("65536", "ui16", 35, "integer value 65536 is out of range for ui16 (range [0, 65535])"),
])
def test_an_index_literal_out_of_its_range_is_a_located_error(literal, elem, col, message):
    text = (f"func.func @main() -> tensor<{elem}> {{\n"
            f"  %c = mp.constant {{value = dense<{literal}> : tensor<{elem}>}} : () -> "
            f"tensor<{elem}>\n  return %c : tensor<{elem}>\n}}\n")
    with pytest.raises(DiagnosticError) as e:
        parse(text, "t.ir")
    d = e.value.diagnostics[0]
    assert (d.loc.line, d.loc.col, d.message) == (2, col, message)


def test_casts_between_index_types_and_floats_saturate_and_truncate():
    text = """
func.func @main(%x: tensor<6xf32>, %i: tensor<4xi64>) -> (tensor<6xi64>, tensor<4xi16>, tensor<4xui64>, tensor<4xf32>) {
  %0 = mp.cast %x : (tensor<6xf32>) -> tensor<6xi64>
  %1 = mp.cast %i : (tensor<4xi64>) -> tensor<4xi16>
  %2 = mp.cast %i : (tensor<4xi64>) -> tensor<4xui64>
  %3 = mp.cast %i : (tensor<4xi64>) -> tensor<4xf32>
  return %0, %1, %2, %3 : tensor<6xi64>, tensor<4xi16>, tensor<4xui64>, tensor<4xf32>
}
"""
    x = np.array([-2.7, 2.7, np.nan, np.inf, -np.inf, 1e30], np.float32)
    i = np.array([-40000, -1, 70000, 2 ** 40 + 1], np.int64)
    outs = Program(parse(text)).run([x, i], reference=False).outputs
    big, low = 2 ** 63 - 1, -2 ** 63
    assert outs[0].tolist() == [-2, 2, 0, big, low, big]  # trunc, NaN -> 0, saturated
    assert outs[1].tolist() == [-32768, -1, 32767, 32767]
    assert outs[2].dtype == np.uint64 and outs[2].tolist() == [0, 0, 70000, 2 ** 40 + 1]
    assert outs[3].tolist() == [-40000.0, -1.0, 70000.0, float(np.float32(2 ** 40 + 1))]


ALL_OPS = """
func.func @main(%x: tensor<2x4xf32>, %ids: tensor<3xi64>, %m: tensor<2x4xi1>, %j: tensor<2x4xi64>) -> (tensor<3x4xf32>, tensor<2x4xf32>, tensor<2x4xi1>, tensor<2x4xi1>, tensor<3x2x4xf32>, tensor<2x4xf32>, tensor<2x4xf32>, tensor<2x4xf32>, tensor<2xf32>, tensor<2x4xi1>) {
  %w = mp.constant {value = dense<[[1.0, -2.0, 3.0, 0.5], [4.0, 5.0, -6.0, 0.25], [7.0, 8.0, 9.0, -1.0], [0.0, 1.5, 2.5, 3.5], [-9.0, 1.0, 0.0, 2.0]]> : tensor<5x4xf32>} : () -> tensor<5x4xf32>
  %0 = mp.gather %w, %ids {axis = 0} : (tensor<5x4xf32>, tensor<3xi64>) -> tensor<3x4xf32>
  %1 = mp.gather_elements %x, %j {axis = 1} : (tensor<2x4xf32>, tensor<2x4xi64>) -> tensor<2x4xf32>
  %z = mp.constant {value = dense<0.0> : tensor<f32>} : () -> tensor<f32>
  %2 = mp.greater_equal %x, %z : (tensor<2x4xf32>, tensor<f32>) -> tensor<2x4xi1>
  %3 = mp.logical_xor %2, %m : (tensor<2x4xi1>, tensor<2x4xi1>) -> tensor<2x4xi1>
  %4 = mp.expand %x : (tensor<2x4xf32>) -> tensor<3x2x4xf32>
  %low = mp.constant {value = dense<-3.4028234663852886e+38> : tensor<f32>} : () -> tensor<f32>
  %5 = mp.where %3, %x, %low : (tensor<2x4xi1>, tensor<2x4xf32>, tensor<f32>) -> tensor<2x4xf32>
  %6 = mp.trilu %x {upper = false, k = 1} : (tensor<2x4xf32>) -> tensor<2x4xf32>
  %three = mp.constant {value = dense<3.0> : tensor<f32>} : () -> tensor<f32>
  %7 = mp.pow %x, %three : (tensor<2x4xf32>, tensor<f32>) -> tensor<2x4xf32>
  %8 = mp.cumsum %7 {axis = 1, exclusive = true, reverse = true} : (tensor<2x4xf32>) -> tensor<2x4xf32>
  %pairs = mp.constant {value = dense<[[0, 3], [1, -1]]> : tensor<2x2xi64>} : () -> tensor<2x2xi64>
  %9 = mp.gather_nd %x, %pairs : (tensor<2x4xf32>, tensor<2x2xi64>) -> tensor<2xf32>
  %inf = mp.isinf %5 {detect_positive = false} : (tensor<2x4xf32>) -> tensor<2x4xi1>
  %nan = mp.isnan %7 : (tensor<2x4xf32>) -> tensor<2x4xi1>
  %10 = mp.logical_or %inf, %nan : (tensor<2x4xi1>, tensor<2x4xi1>) -> tensor<2x4xi1>
  return %0, %1, %2, %3, %4, %5, %6, %8, %9, %10 : tensor<3x4xf32>, tensor<2x4xf32>, tensor<2x4xi1>, tensor<2x4xi1>, tensor<3x2x4xf32>, tensor<2x4xf32>, tensor<2x4xf32>, tensor<2x4xf32>, tensor<2xf32>, tensor<2x4xi1>
}
"""


def test_every_index_and_mask_op_exports_to_what_onnxruntime_computes_as_mplower_does():
    module = parse(ALL_OPS)
    verify(module)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 4)).astype(np.float32)
    ids = np.array([4, -1, 0], np.int64)  # negative: from the end, as ONNX Gather
    m = rng.integers(0, 2, (2, 4)).astype(np.bool_)
    j = np.array([[3, 0, -1, 1], [2, 2, 0, -4]], np.int64)
    ours = Program(module).run([x, ids, m, j], reference=False).outputs
    exported = export_module(module).model
    session = ort.InferenceSession(check_and_serialize(exported, Location("t", 0, 0)),
                                   providers=["CPUExecutionProvider"])
    theirs = session.run(None, dict(zip((i.name for i in session.get_inputs()),
                                        (x, ids, m, j))))
    ops = {n.op_type for n in exported.graph.node}
    assert {"Gather", "GatherElements", "GatherND", "GreaterOrEqual", "Xor", "Expand", "Where",
            "Trilu", "Pow", "CumSum", "IsInf", "IsNaN", "Or"} <= ops
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
    # The mask fill really is float32's lowest where the mask is off, in both.
    assert np.all((ours[5] == np.float32(-3.4028234663852886e38)) == ~ours[3])


def test_a_gather_index_out_of_range_is_a_located_error():
    module = parse(ALL_OPS, "t.ir")
    args = [np.zeros((2, 4), np.float32), np.array([5, 0, 0], np.int64),
            np.zeros((2, 4), np.bool_), np.zeros((2, 4), np.int64)]
    with pytest.raises(DiagnosticError) as e:
        Program(module).run(args, reference=False)
    d = e.value.diagnostics[0]
    assert (d.loc.line, d.message) == (4, ("'mp.gather' failed to execute: index 5 is out of "
                                          "range [-5, 5)"))


def test_imported_index_weights_are_int64_in_the_npz_and_ui16_inputs_run(tmp_path, cli):
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    perm = np.array([9, 0, 3, 3, 1, 2, 8, 7, 6, 5], np.int64)  # ONNX's indices: INT32/64
    graph = helper.make_graph(
        [helper.make_node("Cast", ["ids16"], ["ids"], to=TensorProto.INT64),
         helper.make_node("Add", ["ids", "ids"], ["twice"]),
         helper.make_node("Gather", ["table", "twice"], ["rows"], axis=0),
         helper.make_node("Gather", ["rows", "perm"], ["y"], axis=1)], "g",
        [helper.make_tensor_value_info("ids16", TensorProto.UINT16, [1, 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10, 4])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(perm, "perm")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "m.onnx")
    assert cli("import", tmp_path / "m.onnx", "-o", tmp_path / "m.ir").rc == 0
    weights = np.load(tmp_path / "m.npz")
    assert weights["perm"].dtype == np.int64 and weights["table"].dtype == np.float32
    ids = np.array([[4, 0, 1, 2, 3, 4, 0, 1, 2, 3]], np.uint16)
    np.savez(tmp_path / "in.npz", ids16=ids)
    r = cli("run", tmp_path / "m.ir", "--inputs", tmp_path / "in.npz", "--save-outputs",
            tmp_path / "out.npz")
    assert r.rc == 0, r.err
    expected = ort.InferenceSession(model.SerializeToString(), providers=[
        "CPUExecutionProvider"]).run(None, {"ids16": ids})[0]
    np.testing.assert_array_equal(np.load(tmp_path / "out.npz")["output_0"], expected)
    module = import_model(model).module
    assert [module.function().types(a)[0].elem for a in module.function().args] == ["ui16"]


def test_random_inputs_for_index_arguments_run(cli, tmp_path):
    (tmp_path / "m.ir").write_text("""
func.func @main(%i: tensor<4xi64>, %u: tensor<4xui64>) -> tensor<4xi1> {
  %0 = mp.cast %u : (tensor<4xui64>) -> tensor<4xi64>
  %1 = mp.less %i, %0 : (tensor<4xi64>, tensor<4xi64>) -> tensor<4xi1>
  return %1 : tensor<4xi1>
}
""")
    r = cli("run", tmp_path / "m.ir", "--random-inputs", "--save-outputs", tmp_path / "o.npz")
    assert r.rc == 0, r.err
    assert np.load(tmp_path / "o.npz")["output_0"].dtype == np.bool_


@pytest.mark.parametrize(("line", "message"), [
    (("%0 = mp.where %c, %x, %x : (tensor<2x4xf32>, tensor<2x4xf32>, tensor<2x4xf32>) -> "
     "tensor<2x4xf32>"),
     "'mp.where' operand #0 (the condition) must have element type i1, got tensor<2x4xf32>"),
    ("%0 = mp.gather %x, %c : (tensor<2x4xf32>, tensor<2x4xf32>) -> tensor<2x4x4xf32>",
     ("'mp.gather' operand #1 holds indices and must have an integer element type, got "
     "tensor<2x4xf32>")),
    ("%0 = mp.expand %x : (tensor<2x4xf32>) -> tensor<3x4xf32>",
     "'mp.expand' tensor<2x4xf32> does not broadcast to the result shape [3, 4]"),
    ("%0 = mp.logical_and %x, %c : (tensor<2x4xf32>, tensor<2x4xf32>) -> tensor<2x4xi1>",
     "'mp.logical_and' operand #0 must have the i1 element type, got tensor<2x4xf32>"),
])
def test_index_and_mask_ops_refuse_wrong_operand_types_at_the_op(line, message):
    text = ("func.func @main(%x: tensor<2x4xf32>, %c: tensor<2x4xf32>) -> tensor<2x4xf32> {\n"
            f"  {line}\n  return %x : tensor<2x4xf32>\n}}\n")
    with pytest.raises(DiagnosticError) as e:
        verify(parse(text, "t.ir"))
    d = e.value.diagnostics[0]
    assert (d.loc.line, d.loc.col, d.message) == (2, 3, message)


def test_a_scalar_constant_result_keeps_its_rank_0_shape():
    # ONNX Size folds to a scalar constant; the executor used to hand it back as shape (1,).
    text = """
func.func @main(%x: tensor<3x4xf32>) -> (tensor<i64>, tensor<f32>) {
  %n = mp.constant {value = dense<12> : tensor<i64>} : () -> tensor<i64>
  %h = mp.constant {value = dense<0.5> : tensor<f32>} : () -> tensor<f32>
  return %n, %h : tensor<i64>, tensor<f32>
}
"""
    outs = Program(parse(text)).run([np.zeros((3, 4), np.float32)], reference=False).outputs
    assert [(o.shape, o.tolist()) for o in outs] == [((), 12), ((), 0.5)]


def test_reductions_on_index_types_sum_exactly_in_their_type():
    text = """
func.func @main(%i: tensor<2x3xi64>, %u: tensor<2x3xui16>) -> (tensor<2xi64>, tensor<1x3xui16>, tensor<2x3xi64>) {
  %0 = mp.reduce_sum %i {axes = [1], keepdims = false} : (tensor<2x3xi64>) -> tensor<2xi64>
  %1 = mp.reduce_max %u {axes = [0]} : (tensor<2x3xui16>) -> tensor<1x3xui16>
  %2 = mp.cumsum %i {axis = 1} : (tensor<2x3xi64>) -> tensor<2x3xi64>
  return %0, %1, %2 : tensor<2xi64>, tensor<1x3xui16>, tensor<2x3xi64>
}
"""
    i = np.array([[2 ** 40, 3, -5], [7, 2 ** 50, 1]], np.int64)  # past f32 integers
    u = np.array([[65535, 0, 9], [1, 2, 65534]], np.uint16)
    outs = Program(parse(text)).run([i, u], reference=False).outputs
    assert outs[0].tolist() == [2 ** 40 - 2, 2 ** 50 + 8]
    assert outs[1].tolist() == [[65535, 2, 65534]]
    assert outs[2].tolist() == np.cumsum(i, axis=1).tolist()
