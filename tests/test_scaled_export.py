"""ONNX export of scaled fp8 and block-quantized int4/int8, run by onnxruntime against
mplower's executor; what ONNX or onnxruntime cannot run is a located export error."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest

from mplower.backend.executor import Program
from mplower.ir.parser import parse_file

WEIGHTED = """module attributes {{mp.weights = "w.npz"}} {{
func.func @main(%x: tensor<4x64xf32>) -> tensor<4x8xf32> {{
  %w = mp.constant {{name = "w"}} : () -> tensor<64x8xf32>
  %a = mp.scaled_quant %x {{{x_attrs}}} : (tensor<4x64xf32>) -> tensor<4x64x{elem}>
  %b = mp.scaled_quant %w {{{w_attrs}}} : (tensor<64x8xf32>) -> tensor<64x8x{elem}>
  %y = mp.matmul %a, %b : (tensor<4x64x{elem}>, tensor<64x8x{elem}>) -> tensor<4x8xf32>
  return %y : tensor<4x8xf32>
}}
}}"""


def export_and_run(cli, tmp_path, text: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    src, out = tmp_path / "m.ir", tmp_path / "m.onnx"
    src.write_text(text)
    r = cli("export", src, "--format", "onnx", "-o", out)
    assert r.rc == 0, r.err
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    return got, Program(parse_file(src)).run([x], reference=False).outputs[0]


def test_static_fp8_scaled_quant_exports_as_qdq_that_onnxruntime_runs_bit_for_bit(cli,
                                                                                   tmp_path):
    text = """func.func @main(%x: tensor<4x64xf32>) -> tensor<4x64xf8E4M3FN> {
  %a = mp.scaled_quant %x {recipe = "static", amax = 3.0} : (tensor<4x64xf32>) -> tensor<4x64xf8E4M3FN>
  return %a : tensor<4x64xf8E4M3FN>
}"""
    x = (np.random.default_rng(0).standard_normal((4, 64)) * 2).astype(np.float32)
    got, want = export_and_run(cli, tmp_path, text, x)
    # Within one ulp of E4M3 at the scale: onnxruntime divides by the scale, mplower (as
    # Transformer Engine) multiplies by its inverse; here no quotient lands on another code.
    scale = np.float32(1) / (np.float32(448) / np.float32(3))
    codes = [np.round(v / scale).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
             .astype(int) for v in (got, want)]
    assert np.max(np.abs(codes[0] - codes[1])) <= 1
    assert np.array_equal(got, want)


@pytest.mark.parametrize("pow2", ["false", "true"])
def test_current_scaling_exports_its_amax_and_scale_into_the_graph(cli, tmp_path, pow2):
    text = f"""func.func @main(%x: tensor<4x64xf32>) -> tensor<4x64xf8E4M3FN> {{
  %a = mp.scaled_quant %x {{recipe = "current", margin = 1, pow2 = {pow2}}} : (tensor<4x64xf32>) -> tensor<4x64xf8E4M3FN>
  return %a : tensor<4x64xf8E4M3FN>
}}"""
    for amax in (1e-3, 7.0, 3e6, 448.0 / 2 ** 20, 448.0 * 2 ** 30):
        x = np.random.default_rng(3).uniform(-1, 1, (4, 64)).astype(np.float32)
        x[0, 0] = amax
        got, want = export_and_run(cli, tmp_path, text, x)
        assert np.array_equal(got, want)


@pytest.mark.parametrize(("w_attrs", "elem"), [
    ('recipe = "block", block = [32, 1], scale_format = "e8m0"', "f8E4M3FN"),  # MXFP8 weights
    ('recipe = "block", block = [32, 8], scale_format = "f32"', "f8E4M3FN"),  # 2-D blocks
    ('recipe = "current"', "f8E5M2"),
])
def test_scaled_fp8_weights_export_with_block_size_and_agree_with_onnxruntime(
        cli, tmp_path, w_attrs, elem):
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "w.npz", w=rng.standard_normal((64, 8)).astype(np.float32))
    x = rng.standard_normal((4, 64)).astype(np.float32)
    text = WEIGHTED.format(x_attrs='recipe = "static", amax = 4.0', w_attrs=w_attrs, elem=elem)
    got, want = export_and_run(cli, tmp_path, text, x)
    # Same scaled operands; the f32 sums differ only in onnxruntime's summation order.
    assert np.allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_block_int4_quantize_dequantize_round_trips_through_onnxruntime(cli, tmp_path):
    scale = "dense<[[0.05, 0.1], [0.2, 0.05], [0.1, 0.1], [0.3, 0.02]]> : tensor<4x2xf32>"
    text = f"""func.func @main(%x: tensor<4x64xf32>) -> tensor<4x64xf32> {{
  %q = mp.quantize %x {{scale = {scale}, axis = 1, block_size = 32}} : (tensor<4x64xf32>) -> tensor<4x64xi4>
  %y = mp.dequantize %q {{scale = {scale}, axis = 1, block_size = 32}} : (tensor<4x64xi4>) -> tensor<4x64xf32>
  return %y : tensor<4x64xf32>
}}"""
    x = (np.random.default_rng(2).standard_normal((4, 64))).astype(np.float32)
    got, want = export_and_run(cli, tmp_path, text, x)
    assert np.array_equal(got, want)


@pytest.mark.parametrize(("x_attrs", "elem", "message"), [
    ('recipe = "delayed"', "f8E4M3FN",
     ('mp.scaled_quant with recipe "delayed" computes its scales from the data at run time '
     'and its history')),
    ('recipe = "block", block = [1, 32], scale_format = "e8m0"', "f8E4M3FN",
     ('mp.scaled_quant with recipe "block" computes its scales from the data at run time '
     'per block')),
    ('recipe = "static", amax = 4.0', "f4E2M1FN",
     ("'mp.scaled_quant' uses f4E2M1FN: it would be exported as FLOAT4E2M1 (ONNX opset 23), "
     "for which onnxruntime has no CPU kernel")),
    ('recipe = "static", amax = 4.0', "f6E2M3FN",
     "'mp.scaled_quant' uses f6E2M3FN, which has no ONNX type"),
])
def test_what_onnx_or_onnxruntime_cannot_run_is_a_located_export_error(cli, tmp_path, x_attrs,
                                                                      elem, message):
    np.savez(tmp_path / "w.npz", w=np.ones((64, 8), np.float32))
    src, out = tmp_path / "m.ir", tmp_path / "m.onnx"
    src.write_text(WEIGHTED.format(x_attrs=x_attrs, w_attrs='recipe = "current"', elem=elem))
    r = cli("export", src, "--format", "onnx", "-o", out)
    assert r.rc == 1 and not out.exists()
    assert r.err.startswith(f"{src}:4:3: error: {message}")


def test_per_channel_fp8_conv_weights_export_as_per_axis_quantize_linear(cli, tmp_path):
    import onnx

    rng = np.random.default_rng(5)
    w = (rng.standard_normal((6, 4, 3, 3)) * np.float32(2.0) ** -np.arange(6)[:, None, None, None]
         ).astype(np.float32)
    np.savez(tmp_path / "w.npz", w=w)
    text = """module attributes {mp.weights = "w.npz"} {
func.func @main(%x: tensor<1x4x5x5xf32>) -> tensor<1x6x3x3xf32> {
  %w = mp.constant {name = "w"} : () -> tensor<6x4x3x3xf32>
  %a = mp.scaled_quant %x {recipe = "static", amax = 4.0} : (tensor<1x4x5x5xf32>) -> tensor<1x4x5x5xf8E4M3FN>
  %b = mp.scaled_quant %w {recipe = "block", block = [1, 4, 3, 3]} : (tensor<6x4x3x3xf32>) -> tensor<6x4x3x3xf8E4M3FN>
  %y = mp.conv2d %a, %b : (tensor<1x4x5x5xf8E4M3FN>, tensor<6x4x3x3xf8E4M3FN>) -> tensor<1x6x3x3xf32>
  return %y : tensor<1x6x3x3xf32>
}
}"""
    x = rng.uniform(-4, 4, (1, 4, 5, 5)).astype(np.float32)
    got, want = export_and_run(cli, tmp_path, text, x)
    assert np.allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    model = onnx.load(str(tmp_path / "m.onnx"))
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    (q,) = [n for n in model.graph.node if n.op_type == "QuantizeLinear" and "w" in n.input[0]]
    assert [(a.name, a.i) for a in q.attribute] == [("axis", 0)]
    # TensorRT's per-channel fp8 weight scale: amax of each output channel / 448.
    want_scale = (np.abs(w).reshape(6, -1).max(1) / np.float32(448)).astype(np.float32)
    assert np.array_equal(inits[q.input[1]], want_scale)
