"""mp.split, the op with several results, through every layer: IR round trip, verifier, executor
and run report, the precision passes, the precision sheet, the ONNX importer and exporter.

Values are checked against numpy.split, ml_dtypes and onnxruntime, never against mplower."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from test_onnx_transformers import SHAPES, feeds, gpt2

from mplower.backend.executor import Program, reference_runner
from mplower.ir.diagnostics import DiagnosticError, Location
from mplower.ir.parser import parse
from mplower.ir.printer import print_module
from mplower.ir.verifier import verify
from mplower.lowering.target import load_target
from mplower.onnx.exporter import check_and_serialize, export_module
from mplower.onnx.importer import import_model
from mplower.pass_manager import PassContext, PassManager, parse_pipeline
from mplower.report.run import build_report
from mplower.report.sheet import precision_sheet

ort = pytest.importorskip("onnxruntime")

SPLIT = """\
module {
  func.func @main(%x: tensor<2x6xf32>) -> (tensor<2x1xf32>, tensor<2x2xf32>, tensor<2x3xf32>) {
    %s:3 = mp.split %x {axis = 1, sizes = [1, 2, 3]} : (tensor<2x6xf32>) -> (tensor<2x1xf32>, tensor<2x2xf32>, tensor<2x3xf32>)
    %r = mp.relu %s#1 : (tensor<2x2xf32>) -> tensor<2x2xf32>
    return %s#0, %r, %s#2 : tensor<2x1xf32>, tensor<2x2xf32>, tensor<2x3xf32>
  }
}
"""

X = np.arange(-6, 6, dtype=np.float32).reshape(2, 6) / 4


def test_split_with_three_results_prints_as_it_parses():
    module = parse(SPLIT, "t.ir")
    verify(module)
    assert print_module(module) == SPLIT


@pytest.mark.parametrize(("attrs", "message"), [
    ("axis = 1, sizes = [1, 2, 2]",
     "'mp.split' sizes [1, 2, 2] add up to 5, not to dimension 1 of tensor<2x6xf32> (6)"),
    ("axis = 1, sizes = [1, 5]",
     "'mp.split' sizes [1, 5] make 2 results, but the op declares 3"),
    ("axis = 1, sizes = [-1, 4, 3]", "'mp.split' attribute 'sizes' must be >= 0, got [-1, 4, 3]"),
    ("axis = 2, sizes = [1, 2, 3]", ("'mp.split' attribute 'axis' = 2 is out of range [-2, 2) for an "
      "operand of rank 2")),
])
def test_split_sizes_that_do_not_cut_the_axis_are_a_located_error(attrs, message):
    text = SPLIT.replace("axis = 1, sizes = [1, 2, 3]", attrs)
    with pytest.raises(DiagnosticError) as e:
        verify(parse(text, "t.ir"))
    d = e.value.diagnostics[0]
    assert (d.loc.line, d.loc.col, d.message) == (3, 5, message)


def test_split_runs_like_numpy_split_with_a_report_row_per_result():
    result = Program(parse(SPLIT, "t.ir")).run([X])
    want = np.split(X, [1, 3], axis=1)
    for got, ref in zip(result.outputs, [want[0], np.maximum(want[1], 0), want[2]], strict=True):
        assert got.dtype == np.float32 and np.array_equal(got, ref)
    report = build_report(result, {})
    assert [(o["name"], o["op"], o["type"]) for o in report["ops"]] == [
        ("%s#0", "mp.split", "tensor<2x1xf32>"), ("%s#1", "mp.split", "tensor<2x2xf32>"),
        ("%s#2", "mp.split", "tensor<2x3xf32>"), ("%r", "mp.relu", "tensor<2x2xf32>")]
    assert report["summary"]["ops"] == 2  # the split counts once


MATMUL_SPLIT = """\
func.func @main(%x: tensor<4x8xf32>, %w: tensor<8x6xf32>) -> (tensor<4x2xf32>, tensor<4x4xf32>) {
  %m = mp.matmul %x, %w : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32>
  %s:2 = mp.split %m {axis = 1, sizes = [2, 4]} : (tensor<4x6xf32>) -> (tensor<4x2xf32>, tensor<4x4xf32>)
  %g = mp.mul %s#1, %s#1 : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
  return %s#0, %g : tensor<4x2xf32>, tensor<4x4xf32>
}
"""


def bf16_plan():
    module = parse(MATMUL_SPLIT, "t.ir")
    PassManager(parse_pipeline("assign-precision{policy=bf16},legalize,insert-casts")).run(
        module, PassContext())
    return module


def test_bf16_plan_splits_the_bf16_matmul_result_without_rounding_it_again():
    module = bf16_plan()
    f = module.function()
    (split,) = f.walk("mp.split")
    assert [str(t) for t in f.types(split)] == ["tensor<4x2xbf16>", "tensor<4x4xbf16>"]
    assert f.data(split)["attrs"]["mp.reason"] == "follow: inputs bf16"
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((4, 8), np.float32), rng.standard_normal((8, 6), np.float32)
    result = Program(module).run([x, w])
    bf = ml_dtypes.bfloat16
    m = (x.astype(bf).astype(np.float32) @ w.astype(bf).astype(np.float32)).astype(bf)
    a, b = np.split(m, [2], axis=1)
    assert np.array_equal(result.outputs[0], a.astype(np.float32))
    assert np.array_equal(result.outputs[1],
                          (b.astype(np.float32) * b.astype(np.float32)).astype(bf)
                          .astype(np.float32))
    rows = {o["name"]: o for o in build_report(result, {})["ops"]}
    assert rows["%s#1"]["executed"]["precision"] == "bf16" and rows["%s#1"]["rel_l2"] > 0


def test_precision_sheet_has_one_row_for_the_split_named_by_its_ssa_name():
    sheet = precision_sheet(bf16_plan(), load_target("generic"), measure=False)
    rows = [(r["name"], r["compute"]) for r in sheet["ops"] if r["op"] == "mp.split"]
    assert rows == [("%s", "bf16")]
    assert any("%s" in g["members"] for g in sheet["groups"])


def ort_outputs(module, inputs: list[np.ndarray]) -> tuple[onnx.ModelProto, list[np.ndarray]]:
    model = export_module(module).model
    session = ort.InferenceSession(check_and_serialize(model, Location("t", 0, 0)),
                                   providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return model, session.run(None, dict(zip(names, inputs, strict=True)))


def test_split_exports_as_onnx_split_with_its_sizes_input_and_runs_in_onnxruntime():
    module = parse(SPLIT, "t.ir")
    model, theirs = ort_outputs(module, [X])
    (node,) = [n for n in model.graph.node if n.op_type == "Split"]
    assert len(node.output) == 3 and model.opset_import[0].version >= 13
    sizes = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    assert sizes[node.input[1]].tolist() == [1, 2, 3]
    for got, ref in zip(Program(module).run([X]).outputs, theirs, strict=True):
        assert np.array_equal(got, ref)


def test_a_bf16_split_exports_and_matches_onnxruntime_bit_for_bit():
    module = bf16_plan()
    rng = np.random.default_rng(1)
    ins = [rng.standard_normal((4, 8), np.float32), rng.standard_normal((8, 6), np.float32)]
    _, theirs = ort_outputs(module, ins)
    for got, ref in zip(Program(module).run(ins).outputs, theirs, strict=True):
        assert np.array_equal(got, ref)


def test_onnx_split_with_an_unused_output_imports_as_one_mp_split():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])
    y = helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 3])
    sizes = onnx.numpy_helper.from_array(np.array([1, 2, 3], np.int64), "sizes")
    graph = helper.make_graph([helper.make_node("Split", ["x", "sizes"], ["", "a", "b"], axis=-1)],
                              "g", [x], [y], [sizes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    f = import_model(model, "m.onnx").module.function()
    (split,) = f.walk("mp.split")
    assert f.data(split)["attrs"] == {"axis": 1, "sizes": (1, 2, 3)}
    assert len(f.types(split)) == 3 and f.operands(f.return_node) == [(split, 2)]
    out = Program(import_model(model, "m.onnx").module).run([X], reference=False).outputs[0]
    assert np.array_equal(out, X[:, 3:])


def test_gpt2_export_pattern_splits_qkv_with_one_mp_split_and_matches_onnxruntime():
    model = gpt2()
    shapes = {i.name: SHAPES[i.name] for i in model.graph.input}
    imp = import_model(model, "gpt2.onnx", input_shapes=shapes, inline_weights=True)
    f = imp.module.function()
    splits = list(f.walk("mp.split"))
    assert len(splits) == 1 and len(f.types(splits[0])) == 3
    assert not list(f.walk("mp.slice"))
    x = feeds(model)
    ours = Program(imp.module).run([x[n] for n in imp.inputs], reference=False).outputs[0]
    theirs = ort.InferenceSession(model.SerializeToString(),
                                  providers=["CPUExecutionProvider"]).run(None, x)[0]
    assert float(np.max(np.abs(ours - theirs))) <= 1e-5
    report = build_report(Program(imp.module).run([x[n] for n in imp.inputs]), {})
    rows = [o for o in report["ops"] if o["op"] == "mp.split"]
    assert [o["type"] for o in rows] == ["tensor<2x8x16xf32>"] * 3
    assert all(o["rel_l2"] == 0.0 for o in rows)


def test_split_gradient_joins_the_part_cotangents_with_zeros_for_an_unused_part():
    pytest.importorskip("jax")
    import jax.numpy as jnp
    from test_grad import check, op, t

    x = (2, 7)
    parts = f"({t((2, 1))}, {t((2, 2))}, {t((2, 4))})"
    body = "\n".join([
        op(f"%s:3 = mp.split %x {{axis = -1, sizes = [1, 2, 4]}} : ({t(x)}) -> {parts}"),
        op(f"%e = mp.exp %s#2 : ({t((2, 4))}) -> {t((2, 4))}"),
        op(f"%y = mp.concat %s#0, %e {{axis = 1}} : ({t((2, 1))}, {t((2, 4))}) -> {t((2, 5))}"),
    ])
    check({"x": x}, body, (2, 5), lambda x: jnp.concatenate([x[:, :1], jnp.exp(x[:, 3:])], 1))


QUANT = """\
func.func @main(%x: tensor<4x8xf32>) -> tensor<4x3xf32> {
  %w0 = mp.constant {value = dense<0.125> : tensor<8x8xf32>} : () -> tensor<8x8xf32>
  %w = mp.constant {value = dense<0.5> : tensor<6x3xf32>} : () -> tensor<6x3xf32>
  %w2 = mp.constant {value = dense<0.25> : tensor<3x3xf32>} : () -> tensor<3x3xf32>
  %m0 = mp.matmul %x, %w0 : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
  %a = mp.add %m0, %x : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %s:2 = mp.split %a {axis = 1, sizes = [2, 6]} : (tensor<4x8xf32>) -> (tensor<4x2xf32>, tensor<4x6xf32>)
  %m = mp.matmul %s#1, %w : (tensor<4x6xf32>, tensor<6x3xf32>) -> tensor<4x3xf32>
  %m2 = mp.matmul %m, %w2 : (tensor<4x3xf32>, tensor<3x3xf32>) -> tensor<4x3xf32>
  return %m2 : tensor<4x3xf32>
}
"""


def test_calibration_records_each_split_result_and_int8_quantizes_with_its_own_range(tmp_path):
    x = np.ones((4, 8), np.float32)
    x[:, :2] = 100.0  # the first part is far wider: its range must not reach the second's scale
    x[:, 2:] = np.linspace(-1, 2, 24, dtype=np.float32).reshape(4, 6)
    np.savez(tmp_path / "calib.npz", x=x)
    module = parse(QUANT, "t.ir")
    PassManager(parse_pipeline(f"assign-precision{{policy=int8}},calibrate{{data="
                               f"{tmp_path / 'calib.npz'} method=minmax}},quantize,insert-casts")
                ).run(module, PassContext(runner=reference_runner))
    module = parse(print_module(module), "t.ir")  # the per-result ranges print and parse back
    f = module.function()
    a = x @ np.full((8, 8), 0.125, np.float32) + x
    parts = np.split(a, [2], axis=1)
    (split,) = f.walk("mp.split")
    ranges = [d["mp.range"] for d in f.attrs_of(split)["mp.result_attrs"]]
    # numpy's BLAS sums in its own order; mplower's is fixed: equal to f32 rounding.
    assert ranges == [pytest.approx((float(p.min()), float(p.max())), rel=1e-6) for p in parts]
    (q,) = [n for n in f.walk("mp.quantize") if f.operands(n) == [(split, 1)]]
    assert str(f.types(q)[0]) == "tensor<4x6xui8>"  # a one-sided range: unsigned
    assert f.attrs_of(q)["scale"] == pytest.approx(float(parts[1].max()) / 255, rel=1e-6)


RANGES = """\
func.func @main(%x: tensor<2x4xf32>) -> (tensor<2x1xf32>, tensor<2x3xf32>) attributes {arg_attrs = [{mp.range = [-3.0, 70000.0]}]} {
  %c = mp.constant {value = dense<[[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]> : tensor<2x4xf32>} : () -> tensor<2x4xf32>
  %cs:2 = mp.split %c {axis = 1, sizes = [1, 3]} : (tensor<2x4xf32>) -> (tensor<2x1xf32>, tensor<2x3xf32>)
  %a = mp.add %x, %c : (tensor<2x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
  %s:2 = mp.split %a {axis = 1, sizes = [1, 3]} : (tensor<2x4xf32>) -> (tensor<2x1xf32>, tensor<2x3xf32>)
  %m = mp.mul %s#1, %cs#1 : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
  return %s#0, %m : tensor<2x1xf32>, tensor<2x3xf32>
}
"""


def test_range_analysis_bounds_each_split_result_and_reads_each_part_of_a_constant_split():
    module = parse(RANGES, "t.ir")
    PassManager(parse_pipeline("range-analysis")).run(module, PassContext())
    f = module.function()
    _, s = f.walk("mp.split")
    (m,) = f.walk("mp.mul")
    # %s#1 in [-2, 70008] times %cs#1, the constant's second part [2, 8] (its first is [1, 5]).
    assert f.attrs_of(m)["mp.bound"] == (-16.0, 70008.0 * 8.0)
    # x + c reaches 70008 in both parts: beyond f16 (65504) and the fp8 formats, within bf16.
    assert [d["mp.overflow"] for d in f.attrs_of(s)["mp.result_attrs"]] == \
        [("f16", "f8E4M3FN", "f8E5M2")] * 2


def test_set_batch_retypes_every_split_result_and_refuses_a_split_of_the_batch_axis():
    module = parse(SPLIT, "t.ir")
    PassManager(parse_pipeline("set-batch{size=5}")).run(module, PassContext())
    f = module.function()
    (split,) = f.walk("mp.split")
    assert [str(t) for t in f.types(split)] == ["tensor<5x1xf32>", "tensor<5x2xf32>",
                                                "tensor<5x3xf32>"]
    module = parse("""\
func.func @main(%x: tensor<2x6xf32>) -> tensor<1x6xf32> {
  %s:2 = mp.split %x {axis = 0, sizes = [1, 1]} : (tensor<2x6xf32>) -> (tensor<1x6xf32>, tensor<1x6xf32>)
  return %s#1 : tensor<1x6xf32>
}
""", "t.ir")
    with pytest.raises(DiagnosticError) as e:
        PassManager(parse_pipeline("set-batch{size=5}")).run(module, PassContext())
    d = e.value.diagnostics[0]
    assert (d.loc.line, d.loc.col, d.message) == (2, 3, (
        "set-batch: cannot change the batch from 2 to 5: sizes [1, 1] add up to 2, not to "
        "dimension 0 of tensor<5x6xf32> (5)"))
