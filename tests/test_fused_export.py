"""`mplower export` of fused plans: `mp.add_relu` and `mp.fused_matmul` export as the node
sequence of the ops they fuse, each rounded as the unfused export rounds it, so onnxruntime
gives the unfused plan's export's bits and agrees with mplower's `run` as the unfused export
does (tests/test_onnx_export.py: bit-identical for elementwise ops, 1 ULP of the narrow format
for matmul sums)."""

from __future__ import annotations

from collections import Counter

import ml_dtypes
import numpy as np
import onnx
import pytest

from mplower.ir.parser import parse
from mplower.ir.printer import print_module
from mplower.ir.verifier import verify
from mplower.onnx.exporter import export_module
from mplower.pass_manager import PassContext, PassManager, parse_pipeline

ort = pytest.importorskip("onnxruntime")
from test_fuse_pass import _MLP
from test_onnx_export import EXAMPLES, load_example, run_both, ulps

_rng = np.random.default_rng(7)


def _fused(module):
    """A copy of `module` after the fuse pass (printed and parsed back: what a file holds)."""
    copy = parse(print_module(module), module.path)
    PassManager(parse_pipeline("fuse")).run(copy, PassContext())
    return parse(print_module(copy), module.path)


def _ops(module) -> Counter:
    return Counter(n.op_type for n in export_module(module).model.graph.node)


def _export_and_run(module, inputs, optimize=True):
    onnx.checker.check_model(export_module(module).model, full_check=True)
    return run_both(module, inputs, optimize=optimize)


def _assert_agrees(ours, theirs, elem: str) -> None:
    """Equal NaN and infinity positions and values there; finite matmul sums within the
    unfused export's tolerance (test_onnx_export): 1 ULP of a narrow format, for f32
    test_exported_fp32_module_matches_the_expected_outputs's."""
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))
    finite = np.isfinite(ours) & np.isfinite(theirs)
    np.testing.assert_array_equal(ours[~finite & ~np.isnan(ours)],
                                  theirs[~finite & ~np.isnan(theirs)])
    if elem == "f32":
        np.testing.assert_allclose(theirs[finite], ours[finite], rtol=1e-5, atol=1e-7)
    else:
        assert ulps(ours[finite], theirs[finite], elem) <= 1.0


@pytest.mark.parametrize("pipeline,elem", [("canonicalize", "f32"),
                                           ("assign-precision{policy=bf16},insert-casts",
                                            "bf16")])
def test_a_fused_mlp_exports_with_the_unfused_exports_bits(pipeline, elem):
    plain = load_example("mlp", pipeline)
    fused = _fused(plain)
    assert print_module(fused).count("mp.fused_matmul") == 2
    x = np.load(EXAMPLES / "mlp_inputs.npz")["x"]
    ours_plain, theirs_plain = _export_and_run(plain, [x])
    ours, theirs = _export_and_run(fused, [x])
    # The same nodes (the bias's Cast to FLOAT comes before the MatMul, not after it).
    assert _ops(fused) == _ops(plain)
    assert theirs[0].tobytes() == theirs_plain[0].tobytes()
    assert ours[0].tobytes() == ours_plain[0].tobytes()
    _assert_agrees(ours[0], theirs[0], elem)


_RESIDUAL = _MLP  # matmul, bias add, residual add, relu (tests/test_fuse_pass.py)


@pytest.mark.parametrize("elem", ["f32", "bf16", "f16"])
def test_a_residual_add_relu_after_a_fused_bias_exports_with_the_unfused_bits(elem):
    w = (_rng.standard_normal((16, 32)) * 2).astype(np.float32)
    b = _rng.standard_normal(32).astype(np.float32)
    text = _RESIDUAL.replace("ELEM", elem).replace("WEIGHTS", str(w.tolist())).replace(
        "BIAS", str(b.tolist()))
    plain = parse(text, "residual.ir")
    verify(plain)
    fused = _fused(plain)
    printed = print_module(fused)
    assert "mp.add_relu" in printed and "mp.fused_matmul" in printed
    assert "mp.relu" not in printed and "mp.matmul" not in printed
    x = (_rng.standard_normal((8, 16)) * 30).astype(np.float32)
    s = (_rng.standard_normal((8, 32)) * 30).astype(np.float32)
    x[0, :3] = [np.nan, np.inf, -np.inf]
    s[1, :2] = [np.inf, -np.inf]
    with np.errstate(invalid="ignore", over="ignore"):
        ours_plain, theirs_plain = _export_and_run(plain, [x, s])
        ours, theirs = _export_and_run(fused, [x, s])
    assert _ops(fused) == _ops(plain)
    assert theirs[0].tobytes() == theirs_plain[0].tobytes()
    assert ours[0].tobytes() == ours_plain[0].tobytes()
    _assert_agrees(ours[0], theirs[0], elem)


@pytest.mark.parametrize("elem", ["f32", "bf16", "f16", "f8E5M2"])
def test_add_relu_exports_with_mplowers_and_numpys_bits(elem):
    """Elementwise: onnxruntime gives mplower's bits exactly, and numpy's (ml_dtypes) rounding
    of max(round(x + y), 0), including NaN, infinities and overflow."""
    text = """func.func @main(%x: tensor<64xELEM>, %y: tensor<64xELEM>) -> tensor<64xELEM> {
  %a = mp.add %x, %y : (tensor<64xELEM>, tensor<64xELEM>) -> tensor<64xELEM>
  %r = mp.relu %a : (tensor<64xELEM>) -> tensor<64xELEM>
  return %r : tensor<64xELEM>
}""".replace("ELEM", elem)
    plain = parse(text, "add_relu.ir")
    fused = _fused(plain)
    assert "mp.add_relu" in print_module(fused)
    t = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16,
         "f8E5M2": ml_dtypes.float8_e5m2}[elem]
    top = float(ml_dtypes.finfo(t).max) if elem != "f32" else float(np.finfo(np.float32).max)
    x = (_rng.standard_normal(64) * 100).astype(np.float32)
    y = (_rng.standard_normal(64) * 100).astype(np.float32)
    x[:6] = [np.nan, np.inf, -np.inf, top, -top, 0.0]
    y[:6] = [1.0, 1.0, 1.0, top, -top, -0.0]

    def rounded(v):
        return v.astype(t).astype(np.float32)

    with np.errstate(invalid="ignore", over="ignore"):
        want = np.maximum(rounded(rounded(x) + rounded(y)), np.float32(0))
        if elem == "f16":  # onnxruntime exchanges FLOAT16 as numpy's float16
            x, y = x.astype(np.float16), y.astype(np.float16)
        ours, theirs = _export_and_run(fused, [x, y])
        _, theirs_plain = _export_and_run(plain, [x, y])
    assert theirs[0].tobytes() == theirs_plain[0].tobytes()
    # An f16 output is exchanged as float16, exactly; ours are its float32 values.
    assert theirs[0].astype(np.float32).tobytes() == ours[0].tobytes() == want.tobytes()


_INT8 = """func.func @main(%x: tensor<3x32xi8>) -> tensor<3x6xf32> {
  %w = mp.constant {value = dense<WEIGHT> : tensor<32x6xi8>} : () -> tensor<32x6xi8>
  %acc = mp.matmul %x, %w : (tensor<3x32xi8>, tensor<32x6xi8>) -> tensor<3x6xi32>
  %y = mp.dequantize %acc {scale = SCALE, zero_point = 0 : i32, axis = 1} : (tensor<3x6xi32>) -> tensor<3x6xf32>
  %b = mp.constant {value = dense<BIAS> : tensor<6xf32>} : () -> tensor<6xf32>
  %r = mp.add %y, %b : (tensor<3x6xf32>, tensor<6xf32>) -> tensor<3x6xf32>
  return %r : tensor<3x6xf32>
}
"""


@pytest.mark.parametrize("per_column", [True, False], ids=["per-column-scale", "one-scale"])
def test_a_fused_int8_matmul_exports_as_matmul_integer_dequantize_and_add(per_column):
    w = _rng.integers(-128, 128, (32, 6)).astype(np.int8)
    scale = (_rng.random(6) * 1e-2).astype(np.float32) if per_column else np.float32(3e-3)
    b = _rng.standard_normal(6).astype(np.float32)
    scale_attr = f"dense<{scale.tolist()}> : tensor<6xf32>" if per_column else f"{scale}"
    text = _INT8.replace("WEIGHT", str(w.tolist())) \
        .replace("SCALE", scale_attr).replace("BIAS", str(b.tolist()))
    plain = parse(text, "int8.ir")
    verify(plain)
    fused = _fused(plain)
    assert print_module(fused).count("mp.fused_matmul") == 1
    x = _rng.integers(-128, 128, (3, 32)).astype(np.int8)
    # Node by node: onnxruntime 1.32's fused QDQ MatMul is off (test_onnx_export).
    ours_plain, theirs_plain = _export_and_run(plain, [x], optimize=False)
    ours, theirs = _export_and_run(fused, [x], optimize=False)
    assert _ops(fused) == _ops(plain)
    assert {"MatMulInteger", "DequantizeLinear"} <= set(_ops(fused))
    assert theirs[0].tobytes() == theirs_plain[0].tobytes()
    # ONNX's MatMulInteger, DequantizeLinear and Add in numpy: exact i32 sums, one f32
    # product and one f32 sum each.
    acc = (x.astype(np.int64) @ w.astype(np.int64)).astype(np.int32)
    want = acc.astype(np.float32) * scale + b
    assert theirs[0].tobytes() == want.tobytes()
    assert ours[0].tobytes() == ours_plain[0].tobytes() == want.tobytes()


def test_a_fused_matmul_rounds_each_step_to_its_listed_format():
    """`formats`: the product rounds to bf16, product + b to f16, + c to the f32 result."""
    text = """func.func @main(%x: tensor<4x8xf32>, %w: tensor<8x6xf32>, %b: tensor<6xf32>, %c: tensor<6xf32>) -> tensor<4x6xf32> {
  %y = mp.fused_matmul %x, %w, %b, %c {formats = [bf16, f16]} : (tensor<4x8xf32>, tensor<8x6xf32>, tensor<6xf32>, tensor<6xf32>) -> tensor<4x6xf32>
  return %y : tensor<4x6xf32>
}"""
    module = parse(text, "formats.ir")
    verify(module)
    # Exactly representable products and sums: the result is the roundings' alone.
    x = _rng.integers(-8, 9, (4, 8)).astype(np.float32)
    w = (_rng.integers(-8, 9, (8, 6)) / 8).astype(np.float32)
    b = (_rng.standard_normal(6) * 3).astype(np.float32)
    c = (_rng.standard_normal(6) * 1e-3).astype(np.float32)
    ours, theirs = _export_and_run(module, [x, w, b, c])
    y = (x @ w).astype(ml_dtypes.bfloat16).astype(np.float32)
    y = (y + b).astype(np.float16).astype(np.float32)
    want = y + c
    assert theirs[0].tobytes() == want.tobytes()
    assert ours[0].tobytes() == want.tobytes()
    names = [n.op_type for n in export_module(module).model.graph.node]
    assert names.count("Cast") == 4  # to bf16 and back, to f16 and back


def test_cli_exports_a_fused_plan(tmp_path, cli):
    """The regression: `export` of a fused file said "'mp.fused_matmul' has no ONNX export"."""
    fused = tmp_path / "mlp.fused.ir"
    r = cli("opt", EXAMPLES / "mlp.ir",
            "--pass-pipeline=assign-precision{policy=bf16},insert-casts,fuse", "-o", fused)
    assert r.rc == 0, r.err
    assert "mp.fused_matmul" in fused.read_text()
    out = tmp_path / "mlp.onnx"
    r = cli("export", fused, "--weights", EXAMPLES / "mlp.npz", "-o", out)
    assert r.rc == 0, r.err
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)
    x = np.load(EXAMPLES / "mlp_inputs.npz")["x"]
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    plain = load_example("mlp", "assign-precision{policy=bf16},insert-casts")
    assert got.tobytes() == run_both(plain, [x])[1][0].tobytes()


_CONV_BIAS_RELU = """func.func @main(%x: tensor<2x8x7x7xf32>) -> tensor<2x4x7x7xf32> {
  %w = mp.constant {value = dense<WEIGHT> : tensor<4x8x3x3xf32>} : () -> tensor<4x8x3x3xf32>
  %b = mp.constant {value = dense<BIAS> : tensor<1x4x1x1xf32>} : () -> tensor<1x4x1x1xf32>
  %c = mp.conv2d %x, %w {padding = [1, 1, 1, 1]} : (tensor<2x8x7x7xf32>, tensor<4x8x3x3xf32>) -> tensor<2x4x7x7xf32>
  %a = mp.add %c, %b : (tensor<2x4x7x7xf32>, tensor<1x4x1x1xf32>) -> tensor<2x4x7x7xf32>
  %r = mp.relu %a : (tensor<2x4x7x7xf32>) -> tensor<2x4x7x7xf32>
  return %r : tensor<2x4x7x7xf32>
}
"""


def test_a_fused_conv_exports_as_conv_bias_add_and_relu_with_the_unfused_bits():
    w = _rng.standard_normal((4, 8, 3, 3)).astype(np.float32)
    b = _rng.standard_normal((1, 4, 1, 1)).astype(np.float32)
    plain = parse(_CONV_BIAS_RELU.replace("WEIGHT", str(w.tolist())).replace(
        "BIAS", str(b.tolist())), "conv.ir")
    verify(plain)
    fused = _fused(plain)
    printed = print_module(fused)
    assert "mp.fused_conv2d" in printed and "mp.relu" not in printed
    x = _rng.standard_normal((2, 8, 7, 7)).astype(np.float32)
    ours_plain, theirs_plain = _export_and_run(plain, [x], optimize=False)
    ours, theirs = _export_and_run(fused, [x], optimize=False)
    assert {"Conv", "Add", "Relu"} <= set(_ops(fused))
    assert theirs[0].tobytes() == theirs_plain[0].tobytes()
    assert ours[0].tobytes() == ours_plain[0].tobytes()
    # Sums of 72 products in another order: near zero, cancellation leaves an absolute error.
    np.testing.assert_allclose(theirs[0], ours[0], rtol=1e-5, atol=1e-5)


_SHUFFLED_INT8 = """func.func @main(%x: tensor<2x12x7x7xf32>) -> tensor<2x12x7x7xui8> {
  %w = mp.constant {value = dense<WEIGHT> : tensor<12x1x3x3xi8>} : () -> tensor<12x1x3x3xi8>
  %s = mp.reshape %x : (tensor<2x12x7x7xf32>) -> tensor<2x3x4x7x7xf32>
  %t = mp.transpose %s {perm = [0, 2, 1, 3, 4]} : (tensor<2x3x4x7x7xf32>) -> tensor<2x4x3x7x7xf32>
  %u = mp.reshape %t : (tensor<2x4x3x7x7xf32>) -> tensor<2x12x7x7xf32>
  %q = mp.quantize %u {scale = 0.05 : f32, zero_point = 3 : ui8} : (tensor<2x12x7x7xf32>) -> tensor<2x12x7x7xui8>
  %c = mp.conv2d %q, %w {padding = [1, 1, 1, 1], groups = 12} : (tensor<2x12x7x7xui8>, tensor<12x1x3x3xi8>) -> tensor<2x12x7x7xi32>
  %y = mp.dequantize %c {scale = 0.001 : f32} : (tensor<2x12x7x7xi32>) -> tensor<2x12x7x7xf32>
  %r = mp.relu %y : (tensor<2x12x7x7xf32>) -> tensor<2x12x7x7xf32>
  %o = mp.quantize %r {scale = 0.02 : f32, zero_point = 0 : ui8} : (tensor<2x12x7x7xf32>) -> tensor<2x12x7x7xui8>
  return %o : tensor<2x12x7x7xui8>
}
"""


def test_a_shuffled_int8_conv_with_its_epilogue_exports_with_the_unfused_exports_bits():
    """Shuffle, ConvInteger, dequantize, relu and quantize: onnxruntime gives the unfused
    export's integers, and mplower's (exact sums, the same float32 operations)."""
    w = _rng.integers(-128, 128, (12, 1, 3, 3)).astype(np.int8)
    plain = parse(_SHUFFLED_INT8.replace("WEIGHT", str(w.tolist())), "shuffled.ir")
    verify(plain)
    fused = _fused(plain)
    printed = print_module(fused)
    assert "mp.fused_conv2d" in printed and "shuffle = 3" in printed
    assert "mp.transpose" not in printed and "mp.dequantize" not in printed
    x = (_rng.standard_normal((2, 12, 7, 7)) * 4).astype(np.float32)
    _, theirs_plain = _export_and_run(plain, [x], optimize=False)
    ours, theirs = _export_and_run(fused, [x], optimize=False)
    assert {"ConvInteger", "Transpose", "QuantizeLinear"} <= set(_ops(fused))
    assert theirs[0].tobytes() == theirs_plain[0].tobytes()
    assert np.asarray(theirs[0]).astype(np.float32).tobytes() == ours[0].tobytes()


def test_a_fused_binary_exports_as_the_op_and_both_roundings_with_numpys_bits():
    text = """func.func @main(%x: tensor<4x6xbf16>, %y: tensor<6xbf16>) -> tensor<4x6xf16> {
  %m = mp.mul %x, %y : (tensor<4x6xbf16>, tensor<6xbf16>) -> tensor<4x6xbf16>
  %c = mp.cast %m : (tensor<4x6xbf16>) -> tensor<4x6xf16>
  return %c : tensor<4x6xf16>
}"""
    plain = parse(text, "binary.ir")
    verify(plain)
    fused = _fused(plain)
    assert "mp.fused_binary" in print_module(fused) and "mp.cast" not in print_module(fused)
    bf = ml_dtypes.bfloat16
    x = (_rng.standard_normal((4, 6)) * 300).astype(bf).astype(np.float32)
    y = (_rng.standard_normal(6) * 300).astype(bf).astype(np.float32)
    with np.errstate(over="ignore"):  # beyond f16's range: inf, as both roundings give
        want = (x * y).astype(bf).astype(np.float16)
    ours, theirs = _export_and_run(fused, [x, y])
    _, theirs_plain = _export_and_run(plain, [x, y])
    assert theirs[0].tobytes() == theirs_plain[0].tobytes() == want.tobytes()
    assert ours[0].tobytes() == want.astype(np.float32).tobytes()
