"""quantize / dequantize against onnx.reference running one QuantizeLinear / DequantizeLinear."""

import warnings

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from mplower.numerics.quant import dequantize, quantize
from mplower.numerics.rounding import Counts

ONNX_TYPE = {"i8": TensorProto.INT8, "ui8": TensorProto.UINT8, "i4": TensorProto.INT4,
             "i32": TensorProto.INT32, "f8E4M3FN": TensorProto.FLOAT8E4M3FN,
             "f8E5M2": TensorProto.FLOAT8E5M2}
ONNX_NUMPY = {"i8": np.int8, "ui8": np.uint8, "i4": ml_dtypes.int4, "i32": np.int32,
              "f8E4M3FN": ml_dtypes.float8_e4m3fn, "f8E5M2": ml_dtypes.float8_e5m2}


def run_onnx(op: str, x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, axis: int,
             out_type: int, **attrs) -> np.ndarray:
    in_type = TensorProto.FLOAT if op == "QuantizeLinear" else ONNX_TYPE_OF[x.dtype]
    inputs = [helper.make_tensor_value_info("x", in_type, None),
              helper.make_tensor_value_info("s", TensorProto.FLOAT, None),
              helper.make_tensor_value_info("z", ONNX_TYPE_OF[zero_point.dtype], None)]
    node = helper.make_node(op, ["x", "s", "z"], ["y"], axis=axis, **attrs)
    graph = helper.make_graph([node], "g", inputs,
                              [helper.make_tensor_value_info("y", out_type, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ReferenceEvaluator(model).run(None, {"x": x, "s": scale, "z": zero_point})[0]


ONNX_TYPE_OF = {np.dtype(t): ONNX_TYPE[k] for k, t in ONNX_NUMPY.items()}


def onnx_quantize(x, scale, zero_point, dtype, axis) -> np.ndarray:
    zp = np.asarray(zero_point).astype(ONNX_NUMPY[dtype])
    q = run_onnx("QuantizeLinear", x, np.asarray(scale, np.float32), zp,
                 1 if axis is None else axis, ONNX_TYPE[dtype])
    return q.astype(np.int32)


def onnx_dequantize(q, scale, zero_point, dtype, axis) -> np.ndarray:
    zp = np.asarray(zero_point).astype(ONNX_NUMPY[dtype])
    return run_onnx("DequantizeLinear", q.astype(ONNX_NUMPY[dtype]),
                    np.asarray(scale, np.float32), zp, 1 if axis is None else axis,
                    TensorProto.FLOAT)


RANGE = {"i8": (-128, 127), "ui8": (0, 255), "i4": (-8, 7), "i32": (-2**31, 2**31 - 1)}


def data(rng: np.random.Generator, shape, spread: float) -> np.ndarray:
    """Values spanning zero, ties (x/scale = k + 1/2 for power-of-two scales) and saturation."""
    x = rng.standard_normal(shape) * spread
    x.flat[::7] = (rng.integers(-40, 40, x.flat[::7].size) + 0.5) / 4
    return x.astype(np.float32)


CASES = [(dtype, axis) for dtype in ("i8", "ui8", "i4") for axis in (None, 0, 1, -1)]


@pytest.mark.parametrize(("dtype", "axis"), CASES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_matches_onnx_reference(dtype, axis, symmetric):
    rng = np.random.default_rng(3)
    x = data(rng, (6, 5, 33), 40.0 if dtype != "i4" else 4.0)
    lo, hi = RANGE[dtype]
    n = 1 if axis is None else x.shape[axis]
    scale = np.exp2(rng.integers(-3, 2, n)).astype(np.float32)  # power of two: exact ties
    scale[::2] *= np.float32(0.3)  # and some that are not
    zp = np.zeros(n, np.int64) if symmetric else rng.integers(lo, hi + 1, n)
    if axis is None:
        scale, zp = scale[0], zp[0]
    q, counts = quantize(x, scale, zp, dtype, axis=axis)
    assert q.dtype == (np.uint8 if dtype == "ui8" else np.int8)
    assert np.array_equal(q.astype(np.int32), onnx_quantize(x, scale, zp, dtype, axis))
    shape = [1] * x.ndim
    if axis is not None:
        shape[axis] = n
    rounded = np.rint(x / np.reshape(scale, shape))
    unclamped = rounded + np.reshape(zp, shape)
    assert counts == Counts(overflow=int(((unclamped < lo) | (unclamped > hi)).sum()),
                            underflow=int(((rounded == 0) & (x != 0)).sum()), nan=0)
    assert counts.overflow > 0 and counts.underflow > 0


@pytest.mark.parametrize(("shape", "axis"), [((5, 30001), 0), ((30001, 5), 1)])
def test_per_axis_quantization_is_exact_across_parallel_chunk_boundaries(shape, axis):
    # Channel runs of 30001 elements, and a period of 5, both straddle the 2^16-element chunks.
    rng = np.random.default_rng(13)
    x = data(rng, shape, 30.0)
    scale = (rng.random(shape[axis]) + 0.1).astype(np.float32)
    zp = rng.integers(-20, 20, shape[axis])
    q, _ = quantize(x, scale, zp, "i8", axis=axis)
    assert np.array_equal(q.astype(np.int32), onnx_quantize(x, scale, zp, "i8", axis))
    got = dequantize(q, scale, zp, axis=axis)
    want = onnx_dequantize(q.astype(np.int32), scale, zp, "i8", axis)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_quantize_rounds_half_to_even():
    x = np.array([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5], np.float32)
    q, counts = quantize(x, np.float32(1.0), 0, "i8")
    assert q.tolist() == [0, 2, 2, 4, 0, -2, -2, -4]
    assert counts == Counts(overflow=0, underflow=2, nan=0)


@pytest.mark.parametrize(("dtype", "zp", "want"), [
    ("i8", 0, [127, -128, 127, -128, 127, 0, 0]),
    ("ui8", 128, [255, 0, 255, 0, 255, 128, 128]),
    ("i4", -1, [7, -8, 7, -8, 7, -1, -1]),
])
def test_quantize_saturates_every_out_of_range_value(dtype, zp, want):
    # 1e30 / scale lies beyond int32, where onnx.reference wraps; the ONNX spec saturates.
    x = np.array([1000.0, -1000.0, 1e30, -np.inf, np.inf, 0.01, np.nan], np.float32)
    q, counts = quantize(x, np.float32(0.5), zp, dtype)
    assert q.astype(np.int32).tolist() == want
    assert counts == Counts(overflow=5, underflow=1, nan=1)


def test_quantize_counts_on_constructed_input():
    x = np.array([[0.0, 0.04, -0.05, 0.06, 13.0], [-0.0, 0.2, -0.2, 0.26, 13.0]], np.float32)
    # row 0: scale 0.1 -> 0, 0 (underflow), -0 (tie, underflow), 1, 127 (130 saturates)
    # row 1: scale 1.0 -> 0, 0 (underflow), -0 (underflow), 0 (underflow), 13
    q, counts = quantize(x, np.array([0.1, 1.0], np.float32), 0, "i8", axis=0)
    assert q.tolist() == [[0, 0, 0, 1, 127], [0, 0, 0, 0, 13]]
    assert counts == Counts(overflow=1, underflow=5, nan=0)


@pytest.mark.parametrize("dtype", ["f8E4M3FN", "f8E5M2"])
@pytest.mark.parametrize("saturate", [True, False])
def test_quantize_to_f8_matches_onnx_reference(dtype, saturate):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4, 64)) * np.exp2(rng.uniform(-12, 20, (4, 64)))).astype(
        np.float32)
    scale = np.array([0.5, 3.0, 1e-3, 7.0], np.float32)
    q, _ = quantize(x, scale, 0, dtype, axis=0, saturate=saturate)
    want = run_onnx("QuantizeLinear", x, scale, np.zeros(4, ONNX_NUMPY[dtype]), 0,
                    ONNX_TYPE[dtype], saturate=int(saturate))
    got_f, want_f = q.view(ONNX_NUMPY[dtype]).astype(np.float32), want.astype(np.float32)
    assert np.array_equal(np.isnan(got_f), np.isnan(want_f))
    assert np.array_equal(got_f[~np.isnan(want_f)], want_f[~np.isnan(want_f)])


@pytest.mark.parametrize(("dtype", "axis"), CASES + [("i32", None), ("i32", 1)])
def test_dequantize_matches_onnx_reference(dtype, axis):
    rng = np.random.default_rng(11)
    lo, hi = RANGE[dtype]
    q = rng.integers(lo, hi + 1, (3, 4, 17)).astype(np.int32)
    if dtype == "i32":
        q.flat[::3] = rng.integers(2**24, 2**31 - 1, q.flat[::3].size)  # not exact in f32
    n = 1 if axis is None else q.shape[axis]
    scale = (rng.random(n) * 0.1 + 1e-3).astype(np.float32)
    zp = np.zeros(n, np.int64) if dtype == "i32" else rng.integers(lo, hi + 1, n)
    if axis is None:
        scale, zp = scale[0], zp[0]
    stored = q.astype({"ui8": np.uint8, "i32": np.int32}.get(dtype, np.int8))
    got = dequantize(stored, scale, zp, axis=axis)
    want = onnx_dequantize(q, scale, zp, dtype, axis)
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_dequantize_of_f8_codes_matches_onnx_reference():
    codes = np.arange(256, dtype=np.uint8).reshape(2, 128)
    scale = np.array([0.25, 3.0], np.float32)
    got = dequantize(codes, scale, axis=0, dtype="f8E5M2")
    want = run_onnx("DequantizeLinear", codes.view(ml_dtypes.float8_e5m2), scale,
                    np.zeros(2, ml_dtypes.float8_e5m2), 0, TensorProto.FLOAT)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(want)], want[~np.isnan(want)])


def test_quantize_then_dequantize_is_within_half_a_step():
    rng = np.random.default_rng(2)
    x = rng.uniform(-10, 10, (8, 300)).astype(np.float32)
    scale = np.float32(20 / 255)
    q, counts = quantize(x, scale, 0, "i8")
    assert counts.overflow == 0
    assert np.max(np.abs(dequantize(q, scale, 0) - x)) <= scale / 2 * (1 + 1e-6)


def test_quantize_rejects_bad_arguments():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="length"):
        quantize(x, np.ones(2, np.float32), 0, "i8", axis=1)
    with pytest.raises(ValueError, match="per-tensor"):
        quantize(x, np.ones(3, np.float32), 0, "i8")
    with pytest.raises(ValueError, match="zero point"):
        quantize(x, np.float32(1), 1, "f8E4M3FN")
    with pytest.raises(ValueError, match="range"):
        quantize(x, np.float32(1), 200, "i8")
    with pytest.raises(ValueError, match="unsupported"):
        quantize(x, np.float32(1), 0, "i32")
    with pytest.raises(ValueError, match="int32"):
        dequantize(np.zeros(3, np.int32), np.float32(1), 5)


def test_parallel_and_serial_quant_kernels_agree(monkeypatch):
    """Small tensors run on one thread (quant.SERIAL_BELOW); both paths give the same bits."""
    import mplower.numerics.quant as quant_mod

    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, 70_001)) * 40).astype(np.float32)  # chunk-crossing rows
    x[0, :5] = [np.nan, 0.5, 1.5, -2.5, 1e-9]
    scale = np.array([0.25, 0.5, 1.0], np.float32)
    zp = np.array([0, 3, -2], np.int64)
    results = []
    for threshold in (0, 1 << 40):  # everything parallel, everything serial
        monkeypatch.setattr(quant_mod, "SERIAL_BELOW", threshold)
        q, counts = quant_mod.quantize(x, scale, zp, "i8", axis=0)
        y = quant_mod.dequantize(q, scale, zp, axis=0)
        results.append((q, counts, y))
    (q0, c0, y0), (q1, c1, y1) = results
    assert np.array_equal(q0, q1) and c0 == c1 and c0.nan == 1
    assert np.array_equal(y0.view(np.uint32), y1.view(np.uint32))
