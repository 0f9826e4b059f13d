"""`mplower export`: lowered modules as ONNX that onnx.checker accepts and onnxruntime runs,
computing what mplower's executor computes.

Agreement is measured in units in the last place (ULP) of the narrow format at each output
value (int8: in quantization steps): the exported model and mplower's execution of the same
plan round the same f32 results to the same narrow values, so they may differ only where f32
arithmetic of onnxruntime and numpy differ in the last f32 bit right at a rounding boundary.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest

from mplower.backend.executor import Program
from mplower.ir.diagnostics import DiagnosticError, Location
from mplower.ir.parser import parse
from mplower.ir.verifier import verify
from mplower.numerics.formats import FORMATS
from mplower.onnx.exporter import check_and_serialize, export_module
from mplower.pass_manager import PassContext, PassManager, parse_pipeline

ort = pytest.importorskip("onnxruntime")
EXAMPLES = Path(__file__).resolve().parent.parent / "ir_examples"
_rng = np.random.default_rng(0)


def ulps(a: np.ndarray, b: np.ndarray, elem: str) -> float:
    """Largest |a - b| in units in the last place of `elem` at the larger magnitude."""
    fmt = FORMATS[elem]
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    mag = np.maximum(np.maximum(np.abs(a), np.abs(b)), fmt.min_normal)
    ulp = 2.0 ** (np.floor(np.log2(mag)) - fmt.man_bits)
    return float(np.max(np.abs(a - b) / ulp)) if a.size else 0.0


def load_example(name: str, pipeline: str | None = None):
    path = EXAMPLES / f"{name}.ir"
    module = parse(path.read_text(), str(path))
    verify(module)
    if pipeline:
        PassManager(parse_pipeline(pipeline)).run(module, PassContext())
    return module


def run_both(module, inputs: list[np.ndarray], options: dict[str, str] | None = None,
             optimize: bool = True, weight_only: str = "matmulnbits"
             ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(mplower's outputs, onnxruntime's outputs of the exported model); `optimize=False` runs
    it node by node (ONNX's semantics), without onnxruntime's graph rewrites."""
    ours = Program(module).run(inputs, reference=False).outputs
    exported = export_module(module, weight_only=weight_only)
    data = check_and_serialize(exported.model, Location(module.path, 0, 0))
    so = ort.SessionOptions()
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for k, v in (options or {}).items():
        so.add_session_config_entry(k, v)
    session = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    theirs = session.run(None, {i.name: x for i, x in zip(session.get_inputs(), inputs)})
    return [np.asarray(y, np.float32) for y in ours], theirs


@pytest.mark.parametrize("example", ["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("policy,elem", [("bf16", "bf16"), ("fp16", "f16"), ("fp8", "f8E4M3FN")])
def test_exported_plan_agrees_with_mplower_within_one_ulp(example, policy, elem):
    module = load_example(example, f"assign-precision{{policy={policy}}},insert-casts")
    inputs = dict(np.load(EXAMPLES / f"{example}_inputs.npz"))
    f = module.function()
    arrays = [inputs[f.data(a)["name"]] for a in f.args]
    ours, theirs = run_both(module, arrays)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        assert ulps(a, b, elem) <= 1.0


def test_exported_fp32_module_matches_the_expected_outputs():
    module = load_example("cnn")
    inputs = dict(np.load(EXAMPLES / "cnn_inputs.npz"))
    expected = np.load(EXAMPLES / "cnn_expected.npz")["output_0"]
    ours, theirs = run_both(module, [inputs["x"]])
    np.testing.assert_allclose(theirs[0], expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(theirs[0], ours[0], rtol=1e-5, atol=1e-7)


def _dense(arr: np.ndarray, elem: str) -> str:
    dims = "x".join(map(str, arr.shape))
    return f"dense<{arr.tolist()}> : tensor<{dims}x{elem}>"


def _int8_module(integer_matmul: bool):
    """x -> quantize(i8) -> (i8 x i8 -> i32 matmul -> dequantize) or (dequantize -> f32 matmul)
    -> relu -> quantize/dequantize, weights stored as i8: what the quantize pass will build."""
    w = _rng.integers(-127, 128, (16, 4)).astype(np.int8)
    sx, sw, sy = 0.05, 0.02, 0.04
    if integer_matmul:
        body = f"""
    %acc = mp.matmul %q, %w : (tensor<8x16xi8>, tensor<16x4xi8>) -> tensor<8x4xi32>
    %mm = mp.dequantize %acc {{scale = {sx * sw}}} : (tensor<8x4xi32>) -> tensor<8x4xf32>"""
    else:
        body = f"""
    %dq = mp.dequantize %q {{scale = {sx}, zero_point = 3}} : (tensor<8x16xi8>) -> tensor<8x16xf32>
    %wd = mp.dequantize %w {{scale = {sw}}} : (tensor<16x4xi8>) -> tensor<16x4xf32>
    %mm = mp.matmul %dq, %wd : (tensor<8x16xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>"""
    zp = 0 if integer_matmul else 3
    text = f"""
func.func @main(%x: tensor<8x16xf32>) -> tensor<8x4xf32> {{
    %w = mp.constant {{value = {_dense(w, "i8")}}} : () -> tensor<16x4xi8>
    %q = mp.quantize %x {{scale = {sx}, zero_point = {zp}}} : (tensor<8x16xf32>) -> tensor<8x16xi8>{body}
    %r = mp.relu %mm : (tensor<8x4xf32>) -> tensor<8x4xf32>
    %yq = mp.quantize %r {{scale = {sy}, zero_point = -128}} : (tensor<8x4xf32>) -> tensor<8x4xi8>
    %y = mp.dequantize %yq {{scale = {sy}, zero_point = -128}} : (tensor<8x4xi8>) -> tensor<8x4xf32>
    return %y : tensor<8x4xf32>
}}"""
    module = parse(text, "int8.ir")
    verify(module)
    return module, sy


@pytest.mark.parametrize("integer_matmul", [False, True], ids=["qdq", "matmul-integer"])
def test_exported_int8_plan_agrees_within_one_quantization_step(integer_matmul):
    # Node by node: onnxruntime 1.32's fused QDQ MatMul (graph optimizations on) is off by up to
    # 51 steps on this model with an i8 activation zero point of 3, against numpy's transcription
    # of ONNX's QuantizeLinear/DequantizeLinear below, which mplower matches exactly.
    module, step = _int8_module(integer_matmul)
    x = _rng.normal(0, 2, (8, 16)).astype(np.float32)
    ours, theirs = run_both(module, [x], optimize=False)
    if not integer_matmul:
        w = export_module(module).model.graph.initializer[0]
        wd = onnx.numpy_helper.to_array(w).astype(np.float32) * np.float32(0.02)
        q = np.clip(np.rint(x / np.float32(0.05)) + 3, -128, 127)
        mm = ((q - 3) * np.float32(0.05)).astype(np.float32) @ wd
        yq = np.clip(np.rint(np.maximum(mm, 0) / np.float32(0.04)) - 128, -128, 127)
        np.testing.assert_array_equal(ours[0], ((yq + 128) * np.float32(0.04)).astype(np.float32))
    names = [n.op_type for n in export_module(module).model.graph.node]
    assert "QuantizeLinear" in names and "DequantizeLinear" in names
    assert ("MatMulInteger" in names) == integer_matmul
    assert np.max(np.abs(ours[0] - theirs[0])) <= step * (1 + 1e-6)


def test_narrow_graph_outputs_are_exchanged_as_float_unless_asked():
    text = """
func.func @main(%x: tensor<4x8xf32>) -> tensor<4x8xbf16> {
    %xb = mp.cast %x : (tensor<4x8xf32>) -> tensor<4x8xbf16>
    %e = mp.exp %xb : (tensor<4x8xbf16>) -> tensor<4x8xbf16>
    %y = mp.mul %e, %xb : (tensor<4x8xbf16>, tensor<4x8xbf16>) -> tensor<4x8xbf16>
    return %y : tensor<4x8xbf16>
}"""
    module = parse(text, "narrow.ir")
    x = _rng.normal(size=(4, 8)).astype(np.float32)
    ours, theirs = run_both(module, [x])
    assert theirs[0].dtype == np.float32
    assert ulps(ours[0], theirs[0], "bf16") <= 1.0
    graph = export_module(module, narrow_io=True).model.graph
    assert graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16


def test_tf32_exports_as_float_with_a_note():
    text = """
func.func @main(%x: tensor<2x3xf32>) -> tensor<2x3xf32> {
    %t = mp.cast %x : (tensor<2x3xf32>) -> tensor<2x3xtf32>
    %y = mp.cast %t : (tensor<2x3xtf32>) -> tensor<2x3xf32>
    return %y : tensor<2x3xf32>
}"""
    exported = export_module(parse(text, "tf32.ir"))
    assert any("tf32 has no ONNX type" in n for n in exported.notes)
    assert "tf32" in exported.model.doc_string
    onnx.checker.check_model(exported.model, full_check=True)


def test_cli_export_writes_a_checked_model(tmp_path, cli):
    out = tmp_path / "mlp.onnx"
    r = cli("export", EXAMPLES / "mlp.ir", "--format", "onnx", "-o", out)
    assert r.rc == 0, r.err
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    assert {i.name for i in model.graph.initializer} >= {"w1", "b1", "w2", "b2"}
    inputs = dict(np.load(EXAMPLES / "mlp_inputs.npz"))
    expected = np.load(EXAMPLES / "mlp_expected.npz")["output_0"]
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": inputs["x"]})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


def test_cli_export_failure_leaves_the_output_untouched(tmp_path, cli):
    ir = tmp_path / "q.ir"
    ir.write_text("""
func.func @main(%x: tensor<4xf32>) -> tensor<4xi32> {
    %q = mp.quantize %x {scale = 0.5} : (tensor<4xf32>) -> tensor<4xi32>
    return %q : tensor<4xi32>
}""")
    out = tmp_path / "q.onnx"
    out.write_bytes(b"previous")
    r = cli("export", ir, "-o", out)
    assert r.rc == 1 and "Traceback" not in r.err
    assert "mp.quantize to i32 has no ONNX QuantizeLinear form" in r.err
    assert out.read_bytes() == b"previous"
    r = cli("export", ir, "-o", out, "--func", "nope")  # a usage error, naming what there is
    assert r.rc == 2 and f"--func: {ir} has no function @nope (it has: @main)" in r.err


def test_missing_weights_are_a_located_diagnostic(tmp_path):
    text = (EXAMPLES / "mlp.ir").read_text()
    path = tmp_path / "mlp.ir"
    path.write_text(text)  # mlp.npz is not beside it
    module = parse(text, str(path))
    with pytest.raises(DiagnosticError, match="mlp.npz' does not exist"):
        export_module(module)


def test_import_export_round_trip_of_a_real_onnx_model(tmp_path, cli):
    """ONNX -> mplower import -> bf16 plan -> ONNX export: runs in onnxruntime, within 1 ULP."""
    light = Path(onnx.__file__).parent / "backend/test/data/light/light_squeezenet.onnx"
    ir = tmp_path / "sq.ir"
    assert cli("import", light, "-o", ir).rc == 0
    lowered = tmp_path / "sq.bf16.ir"
    r = cli("opt", ir, "--pass-pipeline=assign-precision{policy=bf16},insert-casts",
            "-o", lowered)
    assert r.rc == 0, r.err
    module = parse(lowered.read_text(), str(lowered))
    x = _rng.uniform(0, 1, (1, 3, 224, 224)).astype(np.float32)
    ours, theirs = run_both(module, [x])
    assert ulps(ours[0], theirs[0], "bf16") <= 1.0
    assert math.isclose(float(theirs[0].sum()), 1.0, rel_tol=1e-3)


def test_per_channel_weights_with_a_scalar_zero_point_export_as_one_d_parameters():
    scales = np.float32([0.01, 0.02, 0.05, 0.1])
    w = _rng.integers(-127, 128, (16, 4)).astype(np.int8)
    text = f"""
func.func @main(%x: tensor<8x16xf32>) -> tensor<8x4xf32> {{
    %w = mp.constant {{value = {_dense(w, "i8")}}} : () -> tensor<16x4xi8>
    %wd = mp.dequantize %w {{scale = {_dense(scales, "f32")}, axis = 1}} : (tensor<16x4xi8>) -> tensor<16x4xf32>
    %y = mp.matmul %x, %wd : (tensor<8x16xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>
    return %y : tensor<8x4xf32>
}}"""
    module = parse(text, "per_channel.ir")
    x = _rng.normal(size=(8, 16)).astype(np.float32)
    # A weight-only int8 matmul: onnxruntime's default optimizations would fuse it into
    # MatMulNBits, which quantizes x too; the exporter says so, and this option runs it as is.
    ours, theirs = run_both(module, [x], {"session.disable_quant_qdq": "1"}, weight_only="qdq")
    np.testing.assert_allclose(theirs[0], ours[0], rtol=1e-6, atol=1e-6)
    exported = export_module(module, weight_only="qdq")
    assert any("session.disable_quant_qdq=1" in n for n in exported.notes)
    zp = next(t for t in exported.model.graph.initializer if "zero_point" in t.name)
    assert list(zp.dims) == [4]
