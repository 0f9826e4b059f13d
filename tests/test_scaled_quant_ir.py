"""mp.quantize / mp.dequantize with block scales (ONNX opset 21 block_size) and with f8 / f4
results, executed and checked against ONNX's reference evaluator."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.backend.executor import Program
from mplower.ir.opdef import OPS, OpError
from mplower.ir.parser import parse
from mplower.ir.types import DenseAttr, TensorType, tensor


def dense_text(a: np.ndarray) -> str:
    rows = np.array2string(a, separator=", ", floatmode="unique", threshold=10 ** 6)
    shape = "x".join(map(str, a.shape))
    return f"dense<{rows.replace(chr(10), '')}> : tensor<{shape}xf32>"


def run_qdq(x: np.ndarray, scale: np.ndarray, qelem: str, block: int,
            axis: int) -> tuple[np.ndarray, np.ndarray]:
    shape = "x".join(map(str, x.shape))
    attrs = f"scale = {dense_text(scale)}, axis = {axis}, block_size = {block}"
    text = f"""func.func @main(%x: tensor<{shape}xf32>) -> (tensor<{shape}x{qelem}>, tensor<{shape}xf32>) {{
  %q = mp.quantize %x {{{attrs}}} : (tensor<{shape}xf32>) -> tensor<{shape}x{qelem}>
  %y = mp.dequantize %q {{{attrs}}} : (tensor<{shape}x{qelem}>) -> tensor<{shape}xf32>
  return %q, %y : tensor<{shape}x{qelem}>, tensor<{shape}xf32>
}}"""
    q, y = Program(parse(text, "<test>")).run([x], reference=False).outputs
    return q, y


ONNX_TYPE = {"i8": TensorProto.INT8, "i4": TensorProto.INT4, "f8E4M3FN": TensorProto.FLOAT8E4M3FN,
             "f4E2M1FN": TensorProto.FLOAT4E2M1}
ZERO = {"i8": np.int8(0), "i4": np.array(0, ml_dtypes.int4),
        "f8E4M3FN": np.array(0, ml_dtypes.float8_e4m3fn),
        "f4E2M1FN": np.array(0, ml_dtypes.float4_e2m1fn)}


def onnx_qdq(x: np.ndarray, scale: np.ndarray, qelem: str, block: int, axis: int,
             opset: int = 23) -> tuple[np.ndarray, np.ndarray]:
    zp = np.broadcast_to(ZERO[qelem], scale.shape) if block else ZERO[qelem]
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=axis,
                          block_size=block),
         helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=axis,
                          block_size=block)],
        "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("q", ONNX_TYPE[qelem], x.shape),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, x.shape)],
        [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(np.array(zp), "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    q, y = ReferenceEvaluator(model).run(None, {"x": x})
    return q.astype(np.float32), y


@pytest.mark.parametrize(("qelem", "block"), [("i8", 16), ("i4", 32), ("f8E4M3FN", 16),
                                              ("f4E2M1FN", 16)])
def test_blocked_quantize_dequantize_equals_onnx_quantizelinear_block_size(qelem, block):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 72)) * 4).astype(np.float32)  # 72: a ragged last block
    scale = rng.uniform(0.01, 0.5, (3, -(-72 // block))).astype(np.float32)
    q, y = run_qdq(x, scale, qelem, block, axis=1)
    want_q, want_y = onnx_qdq(x, scale, qelem, block, axis=1)
    assert np.array_equal(q.astype(np.float32), want_q)
    assert np.array_equal(y.view(np.uint32), want_y.view(np.uint32))


def test_per_tensor_fp8_quantize_saturates_as_onnx():
    x = np.array([[1e4, -1e4, 3.3, 0.0004]], np.float32)
    scale = np.array(0.5, np.float32)
    text = """func.func @main(%x: tensor<1x4xf32>) -> tensor<1x4xf8E4M3FN> {
  %q = mp.quantize %x {scale = 0.5 : f32} : (tensor<1x4xf32>) -> tensor<1x4xf8E4M3FN>
  return %q : tensor<1x4xf8E4M3FN>
}"""
    res = Program(parse(text, "<test>")).run([x])
    want = onnx_qdq(x, scale, "f8E4M3FN", 0, 1, opset=21)[0]
    assert np.array_equal(res.outputs[0], want)
    assert res.outputs[0].tolist() == [[448.0, -448.0, 6.5, 0.0]]
    assert (res.ops[0].counts.overflow, res.ops[0].counts.underflow) == (2, 1)


def T(spec: str) -> TensorType:
    *dims, elem = spec.split("x")
    return tensor(tuple(int(d) for d in dims), elem)


@pytest.mark.parametrize(("attrs", "result", "message"), [
    ({"scale": DenseAttr(np.ones((4, 2), np.float32), T("4x2xf32")), "block_size": 32,
      "axis": 1}, "4x72xi8", ("blocked attribute 'scale' (block_size 32 on axis 1 of "
     "tensor<4x72xf32>) must have shape 4x3, got 4x2")),
    ({"scale": DenseAttr(np.ones(3, np.float32), T("3xf32")), "block_size": 32, "axis": 1},
     "4x72xi8", "must have shape 4x3, got 3"),
    ({"scale": 0.5, "zero_point": 1}, "4x72xf8E4M3FN",
     "attribute 'zero_point' must be 0 for f8E4M3FN (ONNX), got 1"),
    ({"scale": 0.5, "block_size": -1}, "4x72xi8", "attribute 'block_size' must be >= 0"),
])
def test_quantize_verifier_checks_block_scale_shapes(attrs, result, message):
    from mplower.ir.opdef import check_attrs

    with pytest.raises(OpError) as err:
        op = OPS["mp.quantize"]
        op.infer([T("4x72xf32")], check_attrs(op, attrs), [T(result)])
    assert message in err.value.message
