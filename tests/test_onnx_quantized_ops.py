"""Already-quantized ONNX models: MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv,
DynamicQuantizeLinear and 16-bit QuantizeLinear/DequantizeLinear import with their integer
semantics kept exactly: bit for bit what onnxruntime (an independent implementation) computes,
with the products on 8-bit codes accumulating in i32 in the imported module.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mplower.ir.diagnostics import Location
from mplower.onnx import exporter
from mplower.onnx.backend import MplowerBackend
from mplower.onnx.importer import import_model

ort = pytest.importorskip("onnxruntime")
U8, I8, I32, F = TensorProto.UINT8, TensorProto.INT8, TensorProto.INT32, TensorProto.FLOAT
_rng = np.random.default_rng(11)


def _model(nodes, inputs, outputs, inits=(), opset=21) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                             ir_version=10)


def _vi(name, shape, t):
    return helper.make_tensor_value_info(name, t, shape)


def _init(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


def _same_as_onnxruntime(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = s.run(None, feeds)
    got = MplowerBackend.prepare(model).run(feeds)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert np.array_equal(g, w), f"{int((g != w).sum())} of {g.size} differ"
    return got


def _codes(shape, signed: bool, span: int = 256) -> np.ndarray:
    lo, hi = (-span // 2, span // 2) if signed else (0, span)
    return _rng.integers(lo, hi, shape).astype(np.int8 if signed else np.uint8)


def _ops(module) -> list[tuple[str, tuple[str, ...], str]]:
    f = module.function()
    return [(f.op(n), tuple(t.elem for t in f.operand_types(n)), f.types(n)[0].elem)
            for n in f.ops() if f.op(n) != "return"]


def _contractions(model: onnx.ModelProto) -> list[tuple[str, tuple[str, ...], str]]:
    f = import_model(model, "q.onnx").module.function()
    return [(f.op(n), tuple(t.elem for t in f.operand_types(n)), f.types(n)[0].elem)
            for n in f.ops() if f.op(n) in ("mp.matmul", "mp.conv2d")]


@pytest.mark.parametrize("a_signed,b_signed", [(False, True), (False, False), (True, True)])
@pytest.mark.parametrize("zero_points", ["none", "scalar", "per_column"])
def test_matmul_integer_is_exactly_onnxruntimes(a_signed, b_signed, zero_points) -> None:
    # onnxruntime's uint8 x int8 kernel on CPUs without VNNI adds pairs of products in int16
    # with saturation (vpmaddubsw); int8 codes in [-64, 64) keep it exact, so that it can
    # serve as the reference (the next test shows the saturating case).
    a = _codes((2, 5, 7), a_signed)
    b = _codes((7, 3), b_signed, span=128 if b_signed and not a_signed else 256)
    inputs, inits = ["a", "b"], []
    if zero_points != "none":
        za = _codes((), a_signed)  # onnxruntime takes one zero point for a
        zb = _codes((3,) if zero_points != "scalar" else (), b_signed)
        inputs += ["za", "zb"]
        inits += [_init("za", za), _init("zb", zb)]
    node = helper.make_node("MatMulInteger", inputs, ["y"])
    model = _model([node], [_vi("a", list(a.shape), I8 if a_signed else U8),
                            _vi("b", [7, 3], I8 if b_signed else U8)], [_vi("y", None, I32)],
                   inits, opset=10)
    _same_as_onnxruntime(model, {"a": a, "b": b})
    (op, operands, result), = _contractions(model)
    assert (op, result) == ("mp.matmul", "i32") and set(operands) <= {"i8", "ui8"}


def test_matmul_integer_of_full_range_codes_is_the_exact_integer_product() -> None:
    a, b = np.full((2, 4), 255, np.uint8), np.full((4, 3), 127, np.int8)
    a[1] = [255, 0, 17, 1]
    b[:, 1] = -128
    node = helper.make_node("MatMulInteger", ["a", "b"], ["y"])
    model = _model([node], [_vi("a", [2, 4], U8), _vi("b", [4, 3], I8)], [_vi("y", None, I32)],
                   opset=10)
    got = MplowerBackend.prepare(model).run({"a": a, "b": b})[0]
    assert np.array_equal(got, a.astype(np.int64) @ b.astype(np.int64))
    assert got[0].tolist() == [129540, -130560, 129540]
    # A zero point per row of a (which onnxruntime does not take) and per column of b.
    za, zb = np.array([3, 250], np.uint8), np.array([-5, 0, 127], np.int8)
    node = helper.make_node("MatMulInteger", ["a", "b", "za", "zb"], ["y"])
    model = _model([node], [_vi("a", [2, 4], U8), _vi("b", [4, 3], I8)], [_vi("y", None, I32)],
                   [_init("za", za), _init("zb", zb)], opset=10)
    got = MplowerBackend.prepare(model).run({"a": a, "b": b})[0]
    want = (a.astype(np.int64) - za[:, None]) @ (b.astype(np.int64) - zb)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("pads,group", [([0, 0, 0, 0], 1), ([1, 2, 1, 0], 1), ([1, 1, 1, 1], 2)])
@pytest.mark.parametrize("x_zp,w_zp", [(0, 0), (131, 0), (0, 7), (97, 3)])
def test_conv_integer_pads_with_the_zero_point_as_onnxruntime(pads, group, x_zp, w_zp) -> None:
    x = _codes((2, 4, 6, 5), False)
    w = _codes((6, 4 // group, 3, 2), False)
    node = helper.make_node("ConvInteger", ["x", "w", "zx", "zw"], ["y"], pads=pads,
                            group=group, strides=[1, 2])
    model = _model([node], [_vi("x", [2, 4, 6, 5], U8)], [_vi("y", None, I32)],
                   [_init("w", w), _init("zx", np.uint8(x_zp)), _init("zw", np.uint8(w_zp))],
                   opset=10)
    _same_as_onnxruntime(model, {"x": x})
    assert all(r == "i32" and set(o) <= {"i8", "ui8"} for _, o, r in _contractions(model))


def test_qlinear_matmul_requantizes_exactly_as_onnxruntime() -> None:
    a, b = _codes((4, 16), False), _codes((16, 5), True, span=128)  # see above: int16 pairs
    inits = [_init("sa", np.float32(0.02)), _init("za", np.uint8(120)),
             _init("b", b), _init("sb", np.float32(0.011)), _init("zb", np.int8(0)),
             _init("sy", np.float32(0.05)), _init("zy", np.uint8(128))]
    node = helper.make_node("QLinearMatMul", ["a", "sa", "za", "b", "sb", "zb", "sy", "zy"],
                            ["y"])
    model = _model([node], [_vi("a", [4, 16], U8)], [_vi("y", None, U8)], inits)
    got = _same_as_onnxruntime(model, {"a": a})[0]
    assert 0 < (got == 0).sum() + (got == 255).sum() < got.size  # some saturate, not all


@pytest.mark.parametrize("per_channel", [False, True])
def test_qlinear_conv_with_bias_is_exactly_onnxruntimes(per_channel) -> None:
    x = _codes((1, 3, 7, 7), False)
    w = _codes((4, 3, 3, 3), True, span=128)
    sw = (np.array([0.004, 0.006, 0.005, 0.003], np.float32) if per_channel
          else np.float32(0.005))
    bias = _rng.integers(-2000, 2000, 4).astype(np.int32)
    inits = [_init("sx", np.float32(0.03)), _init("zx", np.uint8(100)), _init("w", w),
             _init("sw", sw), _init("zw", np.zeros(4, np.int8) if per_channel else np.int8(0)),
             _init("sy", np.float32(0.07)), _init("zy", np.uint8(90)), _init("bias", bias)]
    node = helper.make_node("QLinearConv", ["x", "sx", "zx", "w", "sw", "zw", "sy", "zy",
                                            "bias"], ["y"], pads=[1, 1, 1, 1])
    model = _model([node], [_vi("x", [1, 3, 7, 7], U8)], [_vi("y", None, U8)], inits)
    _same_as_onnxruntime(model, {"x": x})


def test_dynamic_quantize_linear_feeding_matmul_integer() -> None:
    """What onnxruntime's dynamic quantization writes: DynamicQuantizeLinear of the activation,
    MatMulInteger with its zero point, then the i32 sum scaled back to float."""
    x = (_rng.standard_normal((3, 8)) * 2 + 0.5).astype(np.float32)
    w = _codes((8, 4), True, span=128)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"]),
             helper.make_node("MatMulInteger", ["q", "w", "z"], ["acc"]),
             helper.make_node("Cast", ["acc"], ["accf"], to=F),
             helper.make_node("Mul", ["s", "sw"], ["scale"]),
             helper.make_node("Mul", ["accf", "scale"], ["y"])]
    model = _model(nodes, [_vi("x", [3, 8], F)], [_vi("y", None, F), _vi("q", None, U8),
                                                  _vi("s", None, F), _vi("z", None, U8)],
                   [_init("w", w), _init("sw", np.float32(0.01))], opset=13)
    _same_as_onnxruntime(model, {"x": x})
    # The zero point is a runtime value: the module computes it, nothing was bound to x.
    ops = {op for op, _, _ in _ops(import_model(model, "d.onnx").module)}
    assert {"mp.dynamic_quantize", "mp.dynamic_quantize_zero_point", "mp.matmul"} <= ops


def test_dynamic_quantize_linear_feeding_a_padded_conv_integer() -> None:
    x = (_rng.standard_normal((1, 2, 5, 5)) - 0.7).astype(np.float32)  # zero point > 0
    w = _codes((3, 2, 3, 3), False)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"]),
             helper.make_node("ConvInteger", ["q", "w", "z", "zw"], ["y"], pads=[1, 1, 1, 1])]
    model = _model(nodes, [_vi("x", [1, 2, 5, 5], F)], [_vi("y", None, I32)],
                   [_init("w", w), _init("zw", np.uint8(9))], opset=13)
    _same_as_onnxruntime(model, {"x": x})
    ops = {op for op, _, _ in _ops(import_model(model, "d.onnx").module)}
    assert {"mp.dynamic_quantize_zero_point", "mp.expand", "mp.conv2d"} <= ops


@pytest.mark.parametrize("t,zp", [(TensorProto.INT16, np.int16(-300)),
                                  (TensorProto.UINT16, np.uint16(30000))])
def test_16_bit_quantize_dequantize_import_run_and_export(t, zp) -> None:
    x = (_rng.standard_normal((2, 6)) * 300).astype(np.float32)
    x[0, :3] = [1e9, -1e9, 0.5]  # saturating, and a tie rounded to even
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    model = _model(nodes, [_vi("x", [2, 6], F)], [_vi("q", None, t), _vi("y", None, F)],
                   [_init("s", np.float32(0.25)), _init("z", zp)])
    _same_as_onnxruntime(model, {"x": x})
    module = import_model(model, "q.onnx").module
    data = exporter.check_and_serialize(exporter.export_module(module).model,
                                        Location("q.ir", 0, 0))
    s = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    theirs = s.run(None, {s.get_inputs()[0].name: x})
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for a, b in zip(theirs, want):
        assert np.array_equal(a, b)
