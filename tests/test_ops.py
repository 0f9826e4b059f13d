"""The mp op set: type rules, attribute checking, reference semantics and FLOP counts.

Reference semantics are checked against `onnx.reference.ReferenceEvaluator` running a one-node
(or QDQ two-node) ONNX model of the same op, so the oracle is code nobody here wrote.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.opdef import (
    OPS,
    OpError,
    attr_array,
    attr_bool,
    attr_float,
    attr_int,
    attr_ints,
    attr_type,
    check_attrs,
    op_signature_table,
)
from mplower.ir.types import DenseAttr, TensorType, TypeAttr, TypedFloat, TypedInt, tensor

ALL_OPS = [
    "constant", "matmul", "conv2d", "add", "sub", "mul", "div", "maximum", "minimum", "neg",
    "relu", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "gelu", "softmax", "layer_norm",
    "rms_norm", "reduce_sum", "reduce_mean", "reduce_max", "argmax", "reshape", "transpose",
    "concat", "slice", "flatten", "max_pool2d", "avg_pool2d", "global_avg_pool", "cast",
    "quantize", "dequantize", "fake_quant", "sparse_encode", "erf", "log_softmax", "lrn",
    "gather", "gather_elements", "gather_nd", "where", "equal", "less", "less_equal",
    "greater", "greater_equal", "logical_and", "logical_or", "logical_xor", "logical_not",
    "isnan", "isinf", "expand", "split", "trilu", "pow", "cumsum",
    # ONNX's further reductions, scatters and dynamic quantization (issue 32)
    "reduce_min", "reduce_prod", "argmin", "topk", "topk_indices", "scatter_elements",
    "scatter_nd", "dynamic_quantize", "dynamic_quantize_scale", "dynamic_quantize_zero_point",
    # the backward ops of the gradient rules (passes/grad.py)
    "relu_grad", "max_pool2d_grad", "avg_pool2d_grad", "fake_quant_grad", "reduce_max_grad",
    "fake_quant_lsq", "lsq_grad", "scatter_elements_add", "scatter_nd_add",
    "scaled_quant",
    # the fused ops of the `fuse` pass (mplower.dialect.fused)
    "add_relu", "fused_matmul", "fused_conv2d", "fused_binary",
    # activations and elementwise math (mplower.dialect.mp.activations)
    "hard_sigmoid", "hard_swish", "leaky_relu", "elu", "selu", "celu", "mish", "softplus",
    "softsign", "thresholded_relu", "swish", "shrink", "floor", "ceil", "round", "sin", "cos",
    "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "abs", "sign",
    "clip", "prelu", "mod", "hardmax", "bitwise_and", "bitwise_or", "bitwise_xor",
    "bitwise_not", "bit_shift",
]


def T(spec: str, encoding: str | None = None) -> TensorType:
    """`T("4x8xf32")` is tensor<4x8xf32>; `T("f32")` the scalar."""
    *dims, elem = spec.split("x")
    return tensor(tuple(int(d) for d in dims), elem, encoding)


def infer(op: str, operands: list, attrs: dict | None = None, declared: list | None = None):
    types = [T(o) if isinstance(o, str) else o for o in operands]
    decl = [T(d) if isinstance(d, str) else d for d in declared or []]
    return OPS[f"mp.{op}"].infer(types, attrs or {}, decl)


def dense(values, elem: str) -> DenseAttr:
    arr = np.asarray(values, dtype=np.float32 if elem.startswith("f") else np.int64)
    return DenseAttr(arr, tensor(arr.shape, elem))


def test_every_op_of_the_design_table_is_defined():
    assert sorted(OPS) == sorted(f"mp.{n}" for n in ALL_OPS)


def test_operand_counts_follow_the_signature():
    counts = {n: (OPS[n].min_operands, OPS[n].max_operands) for n in OPS}
    assert counts["mp.constant"] == (0, 0)
    assert counts["mp.conv2d"] == (2, 3)
    assert counts["mp.concat"] == (1, None)
    assert counts["mp.layer_norm"] == (3, 3)
    assert counts["mp.rms_norm"] == (2, 2)
    assert counts["mp.add"] == (2, 2)
    assert counts["mp.relu"] == (1, 1)


def test_flags_and_precisions():
    assert all(op.pure for op in OPS.values())
    assert OPS["mp.add"].elementwise and OPS["mp.cast"].elementwise
    assert OPS["mp.quantize"].elementwise and OPS["mp.fake_quant"].elementwise
    assert not OPS["mp.matmul"].elementwise and not OPS["mp.softmax"].elementwise
    assert OPS["mp.matmul"].precisions == {"f32", "tf32", "bf16", "f16", "f8E4M3FN", "f8E5M2",
                                           "f6E2M3FN", "f6E3M2FN", "f4E2M1FN", "i8"}
    assert OPS["mp.conv2d"].precisions == OPS["mp.matmul"].precisions
    assert OPS["mp.add"].precisions == {"f32", "bf16", "f16"}
    assert OPS["mp.softmax"].precisions == {"f32", "bf16", "f16"}
    assert "f8E4M3FN" in OPS["mp.transpose"].precisions
    assert "i4" in OPS["mp.cast"].precisions


def test_signature_table_has_one_documented_row_per_op():
    rows = {r[0]: r for r in op_signature_table()}
    assert set(rows) == set(OPS)
    assert all(r[3] for r in rows.values())
    assert rows["mp.conv2d"][1] == "x, w, bias?"
    assert rows["mp.conv2d"][2] == ("strides: ints = [1, 1], padding: ints = [0, 0, 0, 0], "
                                    "dilations: ints = [1, 1], groups: int = 1")
    assert rows["mp.gelu"][2] == 'approximate: "none" | "tanh" = "none"'
    assert rows["mp.concat"][1] == "inputs..."
    assert rows["mp.fake_quant"][2].endswith("dtype: i8 | ui8 | i4 | i32")


# ---------------------------------------------------------------------------------------------
# Attributes


def test_check_attrs_fills_defaults():
    assert check_attrs(OPS["mp.conv2d"], {}) == {
        "strides": (1, 1), "padding": (0, 0, 0, 0), "dilations": (1, 1), "groups": 1}
    assert check_attrs(OPS["mp.layer_norm"], {}) == {"axis": -1, "epsilon": 1e-5}
    assert check_attrs(OPS["mp.reduce_sum"], {}) == {"axes": (), "keepdims": True}


def test_check_attrs_accepts_typed_spellings():
    got = check_attrs(OPS["mp.layer_norm"], {"axis": TypedInt(1, "i64"),
                                             "epsilon": TypedFloat(1e-3, "f32")})
    assert got == {"axis": 1, "epsilon": 1e-3}
    assert check_attrs(OPS["mp.transpose"], {"perm": (TypedInt(1, "i64"), 0)}) == {"perm": (1, 0)}
    assert check_attrs(OPS["mp.reduce_max"], {"keepdims": 0})["keepdims"] is False
    assert check_attrs(OPS["mp.fake_quant"], {"scale": 0.5, "dtype": TypeAttr("i8")})["dtype"] \
        == "i8"


def test_check_attrs_keeps_discardable_attributes_unchanged():
    attrs = {"mp.precision": TypeAttr("bf16"), "mp.reason": "keep-wide", "axis": 0}
    got = check_attrs(OPS["mp.softmax"], attrs)
    assert got == {"mp.precision": TypeAttr("bf16"), "mp.reason": "keep-wide", "axis": 0}


def test_check_attrs_is_idempotent():
    op = OPS["mp.quantize"]
    once = check_attrs(op, {"scale": dense([0.5, 0.25], "f32"), "zero_point": TypedInt(3, "i8")})
    twice = check_attrs(op, once)
    assert set(once) == set(twice) == {"scale", "zero_point", "axis", "block_size"}
    np.testing.assert_array_equal(twice["scale"], [0.5, 0.25])
    assert twice["zero_point"].dtype == np.int64 and int(twice["zero_point"]) == 3


@pytest.mark.parametrize("op,attrs,message", [
    pytest.param("softmax", {"axs": 1}, "unknown attribute 'axs' for mp.softmax; did you mean "
                 "'axis'?", id="unknown-suggests"),
    pytest.param("matmul", {"transpose_b": True}, "mp.matmul takes no attribute 'transpose_b'",
                 id="no-attrs"),
    pytest.param("softmax", {"axis": 1.5}, "attribute 'axis' must be an integer, got 1.5",
                 id="int-kind"),
    pytest.param("softmax", {"axis": True}, "attribute 'axis' must be an integer, got true",
                 id="bool-is-not-int"),
    pytest.param("transpose", {"perm": (0, 1.0)}, "attribute 'perm' must be an array of "
                 "integers, got [0, 1.0]", id="ints-kind"),
    pytest.param("concat", {}, "mp.concat needs attribute 'axis' (an integer)", id="required"),
    pytest.param("conv2d", {"strides": (1, 1, 1)}, "attribute 'strides' must have 2 entries, "
                 "got [1, 1, 1]", id="length"),
    pytest.param("conv2d", {"strides": (0, 1)}, "attribute 'strides' must be >= 1, got [0, 1]",
                 id="min"),
    pytest.param("conv2d", {"groups": 0}, "attribute 'groups' must be >= 1, got 0", id="min-int"),
    pytest.param("gelu", {"approximate": "exact"}, 'attribute \'approximate\' must be one of '
                 '"none", "tanh"; got "exact"', id="choices"),
    pytest.param("fake_quant", {"scale": 1.0, "dtype": TypeAttr("f16")}, "attribute 'dtype' "
                 "must be one of i8, ui8, i4, i32; got f16", id="type-choices"),
    pytest.param("reduce_sum", {"keepdims": 2}, "attribute 'keepdims' must be true or false, "
                 "got 2", id="bool-kind"),
    pytest.param("quantize", {"scale": "0.1"}, "attribute 'scale' must be a number or dense "
                 "elements", id="number-kind"),
    pytest.param("layer_norm", {"epsilon": -1.0}, "attribute 'epsilon' must be >= 0.0",
                 id="min-float"),
])
def test_check_attrs_rejects(op, attrs, message):
    with pytest.raises(OpError) as err:
        check_attrs(OPS[f"mp.{op}"], attrs)
    assert message in err.value.message


def test_attr_helpers_accept_typed_and_plain_forms():
    assert attr_int(TypedInt(7, "i64")) == 7 and attr_int(np.int64(7)) == 7
    assert attr_float(TypedFloat(0.5, "f32")) == 0.5 and attr_float(2) == 2.0
    assert attr_ints(dense([1, 2], "i32")) == (1, 2)
    assert attr_ints([]) == ()
    assert attr_bool(TypedInt(1, "i1")) is True
    assert attr_type("bf16") == "bf16" and attr_type(TypeAttr("i8")) == "i8"
    assert attr_array(TypedInt(-3, "i8")).tolist() == -3
    assert attr_array(dense([0.5, 2.0], "f32")).dtype == np.float64
    with pytest.raises(OpError, match="expected an element type"):
        attr_type("float32")
    with pytest.raises(OpError, match="expected an array of integers"):
        attr_ints(dense([0.5], "f32"))


# ---------------------------------------------------------------------------------------------
# Type rules: the exact inferred type


VALID = [
    ("constant", [], {"name": "fc1.weight"}, ["64x128xbf16"], "64x128xbf16"),
    ("constant", [], {"value": dense(np.zeros(128), "f32")}, ["128xf32"], "128xf32"),
    ("matmul", ["32x64xf32", "64x128xf32"], {}, [], "32x128xf32"),
    ("matmul", ["2x1x4x5xf32", "3x5x6xf32"], {}, [], "2x3x4x6xf32"),
    ("matmul", ["5xf32", "2x5x3xf32"], {}, [], "2x3xf32"),
    ("matmul", ["2x3x5xf32", "5xf32"], {}, [], "2x3xf32"),
    ("matmul", ["5xf16", "5xf16"], {}, [], "f16"),
    ("matmul", ["32x64xbf16", "64x128xbf16"], {}, ["32x128xf32"], "32x128xf32"),
    ("matmul", ["32x64xbf16", "64x128xbf16"], {}, ["32x128xbf16"], "32x128xbf16"),
    ("matmul", ["32x64xi8", "64x16xi8"], {}, [], "32x16xi32"),
    ("matmul", ["32x64xui8", "64x16xi8"], {}, ["32x16xi32"], "32x16xi32"),
    ("matmul", ["16x64xbf16", T("64x32xbf16", "2:4")], {}, [], "16x32xbf16"),
    ("conv2d", ["1x3x32x32xf32", "8x3x3x3xf32", "8xf32"],
     {"padding": (1, 1, 1, 1), "strides": (2, 2)}, [], "1x8x16x16xf32"),
    ("conv2d", ["2x4x9x8xf32", "6x2x3x3xf32"], {"strides": (2, 1), "padding": (1, 0, 2, 1),
                                                "dilations": (1, 2), "groups": 2}, [],
     "2x6x5x5xf32"),
    ("conv2d", ["1x4x8x8xbf16", "4x1x3x3xbf16", "4xf32"], {"groups": 4}, ["1x4x6x6xf32"],
     "1x4x6x6xf32"),
    ("conv2d", ["1x4x8x8xi8", "4x4x1x1xi8", "4xi32"], {}, [], "1x4x8x8xi32"),
    *[(op, ["3x1x5xf32", "4x1xf32"], {}, [], "3x4x5xf32")
      for op in ("add", "sub", "mul", "div", "maximum", "minimum")],
    ("add", ["4xi32", "i32"], {}, [], "4xi32"),
    *[(op, ["2x3xbf16"], {}, [], "2x3xbf16")
      for op in ("neg", "relu", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "gelu")],
    ("gelu", ["2x3xf16"], {"approximate": "tanh"}, [], "2x3xf16"),
    ("softmax", ["2x3x4xf32"], {"axis": 1}, [], "2x3x4xf32"),
    ("layer_norm", ["3x4x5xf32", "4x5xf32", "4x5xf32"], {"axis": 1}, [], "3x4x5xf32"),
    ("rms_norm", ["2x8xbf16", "8xbf16"], {}, [], "2x8xbf16"),
    ("reduce_sum", ["3x4x5xf32"], {"axes": (0, 2)}, [], "1x4x1xf32"),
    ("reduce_mean", ["3x4x5xf32"], {"axes": (-1,), "keepdims": False}, [], "3x4xf32"),
    ("reduce_max", ["3x4x5xi8"], {"keepdims": False}, [], "i8"),
    ("argmax", ["3x4x5xf32"], {"axis": 1, "keepdims": False}, [], "3x5xi32"),
    ("argmax", ["3x4x5xf32"], {}, [], "1x4x5xi32"),
    ("reshape", ["2x3x4xf32"], {}, ["6x4xf32"], "6x4xf32"),
    ("transpose", ["2x3x4xf32"], {"perm": (2, 0, 1)}, [], "4x2x3xf32"),
    ("transpose", ["2x3x4xf8E4M3FN"], {}, [], "4x3x2xf8E4M3FN"),
    ("concat", ["2x3xf32", "2x5xf32", "2x1xf32"], {"axis": 1}, [], "2x9xf32"),
    ("concat", ["2x3xf32", "4x3xf32"], {"axis": -2}, [], "6x3xf32"),
    ("slice", ["4x5x6xf32"], {"starts": (1, -100, 0), "ends": (3, -100, 100),
                              "steps": (1, -1, 2)}, [], "2x1x3xf32"),
    ("slice", ["4x5x6xf32"], {"starts": (0, 0, 0), "ends": (9, 2, -1)}, [], "4x2x5xf32"),
    ("flatten", ["2x3x4x5xf32"], {"axis": 2}, [], "6x20xf32"),
    ("flatten", ["2x3x4x5xf32"], {"axis": 0}, [], "1x120xf32"),
    ("flatten", ["2x3x4x5xf32"], {"axis": 4}, [], "120x1xf32"),
    ("max_pool2d", ["1x3x32x32xf32"], {"kernel": (3, 3), "strides": (2, 2),
                                       "padding": (1, 1, 1, 1)}, [], "1x3x16x16xf32"),
    ("avg_pool2d", ["2x3x7x6xf16"], {"kernel": (2, 3)}, [], "2x3x6x4xf16"),
    ("global_avg_pool", ["2x3x5x4xf32"], {}, [], "2x3x1x1xf32"),
    ("cast", ["4x8xf32"], {}, ["4x8xbf16"], "4x8xbf16"),
    ("cast", ["4x8xi8"], {"saturate": False}, ["4x8xf32"], "4x8xf32"),
    ("quantize", ["4x8xf32"], {"scale": 0.1, "zero_point": TypedInt(3, "i8")}, ["4x8xi8"],
     "4x8xi8"),
    ("quantize", ["4x3xf32"], {"scale": dense([0.1, 0.2, 0.3], "f32"), "axis": 1}, ["4x3xui8"],
     "4x3xui8"),
    ("dequantize", ["4x8xi8"], {"scale": 0.1}, ["4x8xbf16"], "4x8xbf16"),
    ("fake_quant", ["4x8xf16"], {"scale": 0.1, "dtype": TypeAttr("i4")}, [], "4x8xf16"),
    ("sparse_encode", ["64x32xbf16"], {}, [T("64x32xbf16", "csr")], '64x32xbf16, "csr"'),
]


@pytest.mark.parametrize("op,operands,attrs,declared,expected", [
    pytest.param(*case, id=f"{case[0]}-{i}") for i, case in enumerate(VALID)])
def test_infer_gives_the_exact_type(op, operands, attrs, declared, expected):
    got = infer(op, operands, attrs, declared)
    assert [str(t) for t in got] == [f"tensor<{expected}>"]


INVALID = [
    ("broadcast", "add", ["4x8xf32", "3xf32"], {}, [],
     "operands are not broadcast-compatible: tensor<4x8xf32> and tensor<3xf32>", 1),
    ("elem-mismatch", "mul", ["4xf32", "4xbf16"], {}, [],
     "operand #1 has element type bf16 but operand #0 has f32", 1),
    ("float-only", "exp", ["4xi8"], {}, [],
     "operand #0 must have a float element type, got tensor<4xi8>", 0),
    ("int-div", "div", ["4xi32", "4xi32"], {}, [], "must have a float element type", 0),
    ("arity", "add", ["4xf32", "4xf32", "4xf32"], {}, [], "mp.add takes 2 operands, got 3", None),
    ("contraction", "matmul", ["32x64xf32", "32x128xf32"], {}, [],
     "matmul contraction mismatch: 64 vs 32", 1),
    ("matmul-batch", "matmul", ["2x4x5xf32", "3x5x6xf32"], {}, [],
     "matmul batch dimensions are not broadcast-compatible", 1),
    ("matmul-scalar", "matmul", ["f32", "4xf32"], {}, [], "matmul operands must have rank >= 1",
     0),
    ("matmul-result-elem", "matmul", ["4x4xbf16", "4x4xbf16"], {}, ["4x4xf16"],
     ("mp.matmul result element type f16 is not allowed for bf16 x bf16 operands "
     "(expected bf16 or f32)"), None),
    ("matmul-mixed", "matmul", ["4x4xf32", "4x4xi8"], {}, [],
     "takes two float operands of one type or two 8-bit integer operands", 1),
    ("matmul-sparse-a", "matmul", [T("4x4xf32", "2:4"), "4x4xf32"], {}, [],
     'operand #0 has sparse encoding "2:4"', 0),
    ("sparse-elementwise", "relu", [T("4x4xf32", "csr")], {}, [],
     "only the second operand of mp.matmul may be encoded", 0),
    ("perm", "transpose", ["2x3x4xf32"], {"perm": (0, 0, 2)}, [],
     "attribute 'perm' must be a permutation of [0, 1, 2], got [0, 0, 2]", 0),
    ("perm-short", "transpose", ["2x3x4xf32"], {"perm": (1, 0)}, [],
     "attribute 'perm' must be a permutation of [0, 1, 2]", 0),
    ("softmax-axis", "softmax", ["2x3xf32"], {"axis": 2}, [],
     "attribute 'axis' = 2 is out of range [-2, 2) for an operand of rank 2", 0),
    ("argmax-axis", "argmax", ["2x3xf32"], {"axis": -3}, [], ("attribute 'axis' = -3 is out of "
     "range"), 0),
    ("reduce-axes", "reduce_sum", ["2x3x4xf32"], {"axes": (3,)}, [],
     "attribute 'axes' = 3 is out of range [-3, 3)", 0),
    ("reduce-repeat", "reduce_mean", ["2x3x4xf32"], {"axes": (1, -2)}, [],
     "attribute 'axes' repeats an axis: [1, -2]", 0),
    ("reshape-count", "reshape", ["4x8xf32"], {}, ["5x7xf32"],
     ("reshape changes the element count: tensor<4x8xf32> has 32 elements, tensor<5x7xf32> has "
     "35"), 0),
    ("reshape-undeclared", "reshape", ["4x8xf32"], {}, [],
     "mp.reshape takes its result type from the declaration", None),
    ("concat-dims", "concat", ["2x3xf32", "2x5xf32", "3x1xf32"], {"axis": 1}, [],
     ("concat operand #2 tensor<3x1xf32> does not match operand #0 tensor<2x3xf32> in the "
     "dimensions other than axis 1"), 2),
    ("concat-rank", "concat", ["2x3xf32", "2x3x1xf32"], {"axis": 0}, [],
     "concat operands must have the same rank", 1),
    ("concat-elem", "concat", ["2x3xf32", "2x3xf16"], {"axis": 0}, [],
     "operand #1 has element type f16 but operand #0 has f32", 1),
    ("conv-channels", "conv2d", ["1x8x9x9xf32", "16x3x3x3xf32"], {"groups": 2}, [],
     ("conv2d channel mismatch: input tensor<1x8x9x9xf32> has 8 channels but weight "
     "tensor<16x3x3x3xf32> expects 3 x 2 group(s) = 6"), 1),
    ("conv-groups", "conv2d", ["1x6x9x9xf32", "8x1x3x3xf32"], {"groups": 4}, [],
     "conv2d input channels 6 are not divisible by groups 4", 0),
    ("conv-out-groups", "conv2d", ["1x4x9x9xf32", "6x1x3x3xf32"], {"groups": 4}, [],
     "conv2d output channels 6 are not divisible by groups 4", 1),
    ("conv-bias", "conv2d", ["1x3x9x9xf32", "8x3x3x3xf32", "3xf32"], {}, [],
     "conv2d bias must have shape (8,), got tensor<3xf32>", 2),
    ("conv-kernel", "conv2d", ["1x3x4x4xf32", "8x3x3x3xf32"], {"dilations": (2, 2)}, [],
     "conv2d kernel (dilated 5x5) is larger than the padded input 4x4", 1),
    ("conv-rank", "conv2d", ["3x9x9xf32", "8x3x3x3xf32"], {}, [],
     "operand #0 must have rank 4 (NCHW), got tensor<3x9x9xf32>", 0),
    ("slice-entries", "slice", ["4x5xf32"], {"starts": (0,), "ends": (1, 1)}, [],
     "attribute 'starts' must have one entry per dimension (2), got [0]", 0),
    ("slice-step", "slice", ["4x5xf32"], {"starts": (0, 0), "ends": (1, 1), "steps": (1, 0)}, [],
     "attribute 'steps' must not contain 0", 0),
    ("flatten-axis", "flatten", ["2x3xf32"], {"axis": 3}, [],
     "attribute 'axis' = 3 is out of range [-2, 3)", 0),
    ("layer-norm-gamma", "layer_norm", ["2x8xf32", "4xf32", "8xf32"], {}, [],
     ("operand #1 (gamma) must have type tensor<8xf32> (the shape of x from axis 1 on), "
     "got tensor<4xf32>"), 1),
    ("pool-padding", "max_pool2d", ["1x1x8x8xf32"], {"kernel": (2, 2), "padding": (2, 0, 0, 0)},
     [], "attribute 'padding' [2, 0, 0, 0] must be smaller than the kernel [2, 2]", 0),
    ("pool-kernel", "avg_pool2d", ["1x1x2x2xf32"], {"kernel": (3, 3)}, [],
     "pool kernel 3x3 is larger than the padded input 2x2", 0),
    ("global-pool-rank", "global_avg_pool", ["2x3xf32"], {}, [],
     "operand #0 must have rank >= 3", 0),
    ("quantize-result", "quantize", ["4xf32"], {"scale": 0.1}, ["4xf32"],
     ("mp.quantize result element type must be one of i8, ui8, i4, i32, i16, ui16, "
      "f8E4M3FN, f8E5M2, f4E2M1FN, got f32"), None),
    ("quantize-scale", "quantize", ["4xf32"], {"scale": -0.1}, ["4xi8"],
     "attribute 'scale' must be positive, got -0.1", None),
    ("quantize-zero-point", "quantize", ["4xf32"], {"scale": 0.1, "zero_point": 300}, ["4xi8"],
     "attribute 'zero_point' must hold integers in the range of i8 [-128, 127], got 300", None),
    ("quantize-per-axis", "quantize", ["4x3xf32"], {"scale": dense([0.1, 0.2], "f32")},
     ["4x3xi8"], ("per-axis attribute 'scale' must have 3 entries (dimension 1 of "
     "tensor<4x3xf32>), got 2"), 0),
    ("quantize-int-input", "quantize", ["4xi8"], {"scale": 0.1}, ["4xi8"],
     "operand #0 must have a float element type", 0),
    ("dequantize-float-input", "dequantize", ["4xf32"], {"scale": 0.1}, ["4xf32"],
     ("operand #0 must have a quantized type (i8, ui8, i4, i32, i16, ui16, f8E4M3FN, f8E5M2, "
      "f4E2M1FN) element type"), 0),
    ("dequantize-result", "dequantize", ["4xi8"], {"scale": 0.1}, ["4xi32"],
     "mp.dequantize result element type must be a float type, got i32", None),
    ("sparse-encode-plain", "sparse_encode", ["4x4xf32"], {}, ["4x4xf32"],
     "mp.sparse_encode result must carry an encoding ('2:4' or '1:2' or 'csr')", None),
    ("constant-both", "constant", [], {"name": "w", "value": dense([1.0], "f32")}, ["1xf32"],
     "mp.constant needs exactly one of 'name'", None),
    ("constant-shape", "constant", [], {"value": dense([1.0, 2.0], "f32")}, ["3xf32"],
     ("constant value has type tensor<2xf32>, which does not have the shape of the result type "
     "tensor<3xf32>"), None),
    ("cast-undeclared", "cast", ["4xf32"], {}, [],
     "mp.cast takes its result type from the declaration", None),
]


@pytest.mark.parametrize("op,operands,attrs,declared,message,operand", [
    pytest.param(*case[1:], id=case[0]) for case in INVALID])
def test_infer_rejects(op, operands, attrs, declared, message, operand):
    with pytest.raises(OpError) as err:
        infer(op, operands, attrs, declared)
    assert message in err.value.message
    assert err.value.operand == operand


# ---------------------------------------------------------------------------------------------
# Reference semantics against ONNX's reference evaluator

_rng = np.random.default_rng(0)


def rand(*shape: int, lo: float = -3.0, hi: float = 3.0) -> np.ndarray:
    return _rng.uniform(lo, hi, shape).astype(np.float32)


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def node(op_type: str, n_inputs: int, **attrs) -> list:
    return [helper.make_node(op_type, [f"in{i}" for i in range(n_inputs)], ["out"], **attrs)]


def onnx_eval(nodes: list, inputs: list[np.ndarray], opset: int) -> np.ndarray:
    names = [f"in{i}" for i in range(len(inputs))]
    graph = helper.make_graph(
        nodes, "case",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
         for n, a in zip(names, inputs)],
        [helper.make_tensor_value_info("out", TensorProto.UNDEFINED, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return ReferenceEvaluator(model).run(None, dict(zip(names, inputs)))[0]


def case(name, op, inputs, attrs, onnx_nodes, *, extra=(), opset=21, result=None):
    """`extra`: ONNX-only inputs (shape, axes, scale...) that mplower carries as attributes."""
    return pytest.param(op, inputs, attrs, onnx_nodes, list(extra), opset, result, id=name)


_CONV_X, _CONV_W, _CONV_B = rand(2, 4, 9, 8), rand(6, 2, 3, 3), rand(6)
_POOL_ATTRS = {"kernel": (3, 2), "strides": (2, 1), "padding": (1, 0, 1, 1)}
_POOL_ONNX = {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1]}
_TIES = (np.arange(-8, 8, dtype=np.float32) + 0.5) * 0.5  # x / 0.5 lands exactly on .5
_QX = np.concatenate([_TIES, rand(16, lo=-200, hi=200)]).reshape(4, 8)
_Q8 = _rng.integers(-128, 128, (4, 8)).astype(np.int8)
_U8 = _rng.integers(0, 256, (3, 4)).astype(np.uint8)
_PER_AXIS_SCALE = np.array([0.5, 0.05, 1.5, 0.2], np.float32)
_PER_AXIS_ZP = np.array([0, 3, -5, 127], np.int8)
_SLICE_X = rand(4, 5, 6)
_SIGNS = np.array([[1], [-1], [1], [-1]], np.float32)  # divisors away from zero, both signs

REFERENCE_CASES = [
    case("matmul-2d", "matmul", [rand(4, 5), rand(5, 3)], {}, node("MatMul", 2)),
    case("matmul-batch-broadcast", "matmul", [rand(2, 1, 4, 5), rand(3, 5, 6)], {},
         node("MatMul", 2)),
    case("matmul-vector-matrix", "matmul", [rand(5), rand(2, 5, 3)], {}, node("MatMul", 2)),
    case("matmul-matrix-vector", "matmul", [rand(2, 3, 5), rand(5)], {}, node("MatMul", 2)),
    case("conv2d-groups-strides-pads-dilations", "conv2d", [_CONV_X, _CONV_W, _CONV_B],
         {"strides": (2, 1), "padding": (1, 0, 2, 1), "dilations": (1, 2), "groups": 2},
         node("Conv", 3, strides=[2, 1], pads=[1, 0, 2, 1], dilations=[1, 2], group=2)),
    case("conv2d-depthwise", "conv2d", [rand(1, 3, 7, 7), rand(3, 1, 3, 3)],
         {"padding": (1, 1, 1, 1), "groups": 3}, node("Conv", 2, pads=[1, 1, 1, 1], group=3)),
    case("conv2d-pointwise", "conv2d", [rand(1, 3, 6, 5), rand(4, 3, 1, 1), rand(4)], {},
         node("Conv", 3)),
    *[case(op, op, [rand(3, 1, 5), rand(4, 1)], {}, node(onnx_op, 2))
      for op, onnx_op in (("add", "Add"), ("sub", "Sub"), ("mul", "Mul"), ("maximum", "Max"),
                          ("minimum", "Min"))],
    case("div", "div", [rand(3, 1, 5), rand(4, 1, lo=0.5, hi=2.0) * _SIGNS], {}, node("Div", 2)),
    *[case(op, op, [rand(3, 4) * 10], {}, node(onnx_op, 1))
      for op, onnx_op in (("neg", "Neg"), ("relu", "Relu"), ("sigmoid", "Sigmoid"),
                          ("tanh", "Tanh"), ("exp", "Exp"))],
    case("log", "log", [rand(3, 4, lo=0.01, hi=10)], {}, node("Log", 1)),
    case("sqrt", "sqrt", [rand(3, 4, lo=0.0, hi=10)], {}, node("Sqrt", 1)),
    case("rsqrt", "rsqrt", [rand(3, 4, lo=0.01, hi=10)], {},
         [helper.make_node("Sqrt", ["in0"], ["root"]),
          helper.make_node("Reciprocal", ["root"], ["out"])]),
    case("gelu-erf", "gelu", [rand(4, 6) * 3], {}, node("Gelu", 1), opset=20),
    case("gelu-tanh", "gelu", [rand(4, 6) * 3], {"approximate": "tanh"},
         node("Gelu", 1, approximate="tanh"), opset=20),
    case("softmax-axis1", "softmax", [rand(3, 4, 5) * 5], {"axis": 1}, node("Softmax", 1, axis=1),
         opset=13),
    case("softmax-last", "softmax", [rand(3, 4, 5) * 5], {}, node("Softmax", 1), opset=13),
    case("erf", "erf", [np.vstack([rand(3, 4) * 3, np.float32([[1e-8, -1e-6, 0.0, 5.0]])])], {},
         node("Erf", 1)),
    case("log_softmax-axis1", "log_softmax", [rand(3, 4, 5) * 5], {"axis": 1},
         node("LogSoftmax", 1, axis=1), opset=13),
    case("log_softmax-last", "log_softmax", [rand(2, 6) * 5], {}, node("LogSoftmax", 1),
         opset=13),
    case("layer_norm", "layer_norm", [rand(3, 4, 5), rand(4, 5), rand(4, 5)],
         {"axis": 1, "epsilon": 1e-3}, node("LayerNormalization", 3, axis=1, epsilon=1e-3),
         opset=17),
    case("rms_norm", "rms_norm", [rand(3, 4, 5), rand(5)], {},
         node("RMSNormalization", 2, axis=-1, epsilon=1e-5), opset=23),
    case("reduce_sum", "reduce_sum", [rand(3, 4, 5)], {"axes": (0, 2)}, node("ReduceSum", 2),
         extra=[i64(0, 2)], opset=18),
    case("reduce_mean", "reduce_mean", [rand(3, 4, 5)], {"axes": (-1,), "keepdims": False},
         node("ReduceMean", 2, keepdims=0), extra=[i64(-1)], opset=18),
    case("reduce_max-all", "reduce_max", [rand(3, 4, 5)], {"keepdims": False},
         node("ReduceMax", 1, keepdims=0), opset=18),
    case("argmax-keepdims", "argmax", [rand(3, 4, 5)], {"axis": 1}, node("ArgMax", 1, axis=1),
         opset=13),
    case("argmax-last", "argmax", [rand(3, 4, 5)], {"axis": -1, "keepdims": False},
         node("ArgMax", 1, axis=-1, keepdims=0), opset=13),
    case("reshape", "reshape", [rand(2, 3, 4)], {}, node("Reshape", 2), extra=[i64(4, 6)],
         result="4x6xf32"),
    case("transpose", "transpose", [rand(2, 3, 4)], {"perm": (2, 0, 1)},
         node("Transpose", 1, perm=[2, 0, 1])),
    case("transpose-default", "transpose", [rand(2, 3, 4)], {}, node("Transpose", 1)),
    case("concat", "concat", [rand(2, 3, 4), rand(2, 1, 4), rand(2, 2, 4)], {"axis": 1},
         node("Concat", 3, axis=1)),
    case("slice-clamped", "slice", [_SLICE_X],
         {"starts": (1, 10, -100), "ends": (3, -100, 100), "steps": (1, -1, 2)},
         node("Slice", 5), extra=[i64(1, 10, -100), i64(3, -100, 100), i64(0, 1, 2),
                                  i64(1, -1, 2)]),
    case("slice-backwards", "slice", [_SLICE_X],
         {"starts": (-1, 0, 5), "ends": (-1000, 5, 1), "steps": (-2, 1, -1)},
         node("Slice", 5), extra=[i64(-1, 0, 5), i64(-1000, 5, 1), i64(0, 1, 2),
                                  i64(-2, 1, -1)]),
    case("flatten-axis2", "flatten", [rand(2, 3, 4, 5)], {"axis": 2}, node("Flatten", 1, axis=2)),
    case("flatten-axis0", "flatten", [rand(2, 3, 4, 5)], {"axis": 0}, node("Flatten", 1, axis=0)),
    case("max_pool2d", "max_pool2d", [rand(2, 3, 9, 8)], _POOL_ATTRS,
         node("MaxPool", 1, **_POOL_ONNX)),
    case("avg_pool2d", "avg_pool2d", [rand(2, 3, 9, 8)], _POOL_ATTRS,
         node("AveragePool", 1, **_POOL_ONNX)),
    case("global_avg_pool", "global_avg_pool", [rand(2, 3, 5, 4)], {},
         node("GlobalAveragePool", 1)),
    case("cast-f16", "cast", [rand(4, 8) * 1e3], {}, node("Cast", 1, to=TensorProto.FLOAT16),
         result="4x8xf16"),
    case("cast-bf16", "cast", [rand(4, 8) * 1e3], {}, node("Cast", 1, to=TensorProto.BFLOAT16),
         result="4x8xbf16"),
    case("cast-f8E4M3FN-saturate", "cast", [rand(4, 8) * 300], {},
         node("Cast", 1, to=TensorProto.FLOAT8E4M3FN), result="4x8xf8E4M3FN"),
    case("cast-f8E4M3FN-no-saturate", "cast", [rand(4, 8) * 300], {"saturate": False},
         node("Cast", 1, to=TensorProto.FLOAT8E4M3FN, saturate=0), result="4x8xf8E4M3FN"),
    case("cast-f8E5M2", "cast", [rand(4, 8) * 1e5], {},
         node("Cast", 1, to=TensorProto.FLOAT8E5M2), result="4x8xf8E5M2"),
    case("cast-i32-truncates", "cast", [rand(4, 8) * 100], {},
         node("Cast", 1, to=TensorProto.INT32), result="4x8xi32"),
    case("cast-i8-to-f32", "cast", [_Q8], {}, node("Cast", 1, to=TensorProto.FLOAT),
         result="4x8xf32"),
    case("quantize-i8-ties-saturate", "quantize", [_QX],
         {"scale": 0.5, "zero_point": TypedInt(3, "i8")}, node("QuantizeLinear", 3),
         extra=[np.float32(0.5), np.int8(3)], result="4x8xi8"),
    case("quantize-ui8", "quantize", [_QX], {"scale": TypedFloat(0.75, "f32"),
                                             "zero_point": 128},
         node("QuantizeLinear", 3), extra=[np.float32(0.75), np.uint8(128)], result="4x8xui8"),
    case("quantize-per-axis", "quantize", [_QX.reshape(8, 4)],
         {"scale": dense(_PER_AXIS_SCALE, "f32"), "zero_point": dense(_PER_AXIS_ZP, "i8")},
         node("QuantizeLinear", 3, axis=1), extra=[_PER_AXIS_SCALE, _PER_AXIS_ZP],
         result="8x4xi8"),
    case("dequantize-i8", "dequantize", [_Q8], {"scale": 0.05, "zero_point": -7},
         node("DequantizeLinear", 3), extra=[np.float32(0.05), np.int8(-7)], result="4x8xf32"),
    case("dequantize-per-axis-ui8", "dequantize", [_U8],
         {"scale": dense(_PER_AXIS_SCALE, "f32"), "zero_point": dense([0, 3, 5, 127], "ui8"),
          "axis": -1},
         node("DequantizeLinear", 3, axis=-1),
         extra=[_PER_AXIS_SCALE, np.array([0, 3, 5, 127], np.uint8)], result="3x4xf32"),
    case("fake_quant", "fake_quant", [_QX], {"scale": 0.5, "zero_point": 3,
                                             "dtype": TypeAttr("i8")},
         [helper.make_node("QuantizeLinear", ["in0", "in1", "in2"], ["q"]),
          helper.make_node("DequantizeLinear", ["q", "in1", "in2"], ["out"])],
         extra=[np.float32(0.5), np.int8(3)]),
]

_ELEM_OF_DTYPE = {np.dtype(np.float32): "f32", np.dtype(np.int8): "i8", np.dtype(np.uint8): "ui8"}


@pytest.mark.parametrize("op,inputs,attrs,onnx_nodes,extra,opset,result", REFERENCE_CASES)
def test_reference_matches_onnx(op, inputs, attrs, onnx_nodes, extra, opset, result):
    opdef = OPS[f"mp.{op}"]
    declared = [T(result)] if result else []
    ours = opdef.reference(inputs, attrs, declared or None)[0]
    theirs = np.asarray(onnx_eval(onnx_nodes, inputs + extra, opset)).astype(np.float64)
    types = [tensor(x.shape, _ELEM_OF_DTYPE[x.dtype]) for x in inputs]
    assert ours.shape == theirs.shape == opdef.infer(types, attrs, declared)[0].shape
    np.testing.assert_allclose(ours.astype(np.float64), theirs, rtol=1e-5, atol=1e-6)


def test_slice_clamps_a_far_negative_backward_start_to_zero_as_the_onnx_spec_says():
    # The spec clamps a backward start to [0, dim-1], so start=-100 still takes element 0;
    # onnxruntime agrees, while onnx's ReferenceEvaluator uses Python slicing and returns none.
    ort = pytest.importorskip("onnxruntime")
    x = np.arange(5, dtype=np.float32)
    bounds = [i64(-100), i64(-100), i64(0), i64(-1)]
    graph = helper.make_graph(
        node("Slice", 5), "slice",
        [helper.make_tensor_value_info("in0", TensorProto.FLOAT, [5])]
        + [helper.make_tensor_value_info(f"in{i}", TensorProto.INT64, [1]) for i in range(1, 5)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = session.run(None, dict(zip([f"in{i}" for i in range(5)], [x, *bounds])))[0]
    attrs = {"starts": (-100,), "ends": (-100,), "steps": (-1,)}
    ours = OPS["mp.slice"].reference([x], attrs)[0]
    assert ours.tolist() == theirs.tolist() == [0.0]
    assert infer("slice", ["5xf32"], attrs) == [T("1xf32")]


def test_log_softmax_stays_finite_where_log_of_softmax_underflows():
    # 1e4 apart: softmax underflows to 0 in f32 and onnx's ReferenceEvaluator returns -inf.
    x = np.float32([[0.0, 1e4, -1e4]])
    ours = OPS["mp.log_softmax"].reference([x], {})[0]
    np.testing.assert_array_equal(ours, np.float32([[-1e4, 0.0, -2e4]]))


@pytest.mark.parametrize("size,attrs", [(3, {}), (5, {"alpha": 0.02, "beta": 0.5, "bias": 2.0}),
                                        (1, {"alpha": 1.0})])
def test_lrn_matches_onnxruntime(size, attrs):
    # onnx's ReferenceEvaluator LRN loops over the batch instead of the channels, so the oracle
    # here is onnxruntime (the backend node tests' own numpy loop agrees with it).
    ort = pytest.importorskip("onnxruntime")
    x = rand(2, 6, 3, 4)
    graph = helper.make_graph(
        [helper.make_node("LRN", ["in0"], ["out"], size=size, **attrs)], "lrn",
        [helper.make_tensor_value_info("in0", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = session.run(None, {"in0": x})[0]
    ours = OPS["mp.lrn"].reference([x], {"size": size, **attrs})[0]
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_reference_returns_the_value_dtype_of_the_declared_result():
    x = rand(4, 8)
    assert OPS["mp.cast"].reference([x], {}, [T("4x8xbf16")])[0].dtype == np.float32
    assert OPS["mp.cast"].reference([x], {}, [T("4x8xf64")])[0].dtype == np.float64
    q = OPS["mp.quantize"].reference([x], {"scale": 0.1}, [T("4x8xi8")])[0]
    assert q.dtype == np.int64
    assert OPS["mp.matmul"].reference([x, x.T], {}, [T("4x4xf32")])[0].dtype == np.float32


def test_int8_matmul_accumulates_exactly():
    a = np.full((2, 1000), 127, np.int8)
    b = np.full((1000, 3), -128, np.int8)
    out = OPS["mp.matmul"].reference([a, b], {}, [T("2x3xi32")])[0]
    assert out.tolist() == [[-16256000] * 3] * 2


def test_cast_to_tf32_rounds_to_nearest_even():
    x = np.array([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-10 + 2**-12), 3.4028235e38, np.nan],
                 np.float32)
    got = OPS["mp.cast"].reference([x], {}, [T("5xtf32")])[0]
    np.testing.assert_array_equal(got[:4], [1.0, 1 + 2**-9, -(1 + 2**-10), np.inf])
    assert np.isnan(got[4])


def test_cast_saturates_out_of_range_integers():
    x = np.array([-300.7, -2.9, 2.9, 127.5, 1e9, np.nan], np.float32)
    got = OPS["mp.cast"].reference([x], {}, [T("6xi8")])[0]
    assert got.tolist() == [-128, -2, 2, 127, 127, 0]


def test_quantize_i4_saturates_and_nan_goes_to_zero_point():
    x = np.array([-100.0, -3.25, 0.26, 100.0, np.nan], np.float32)
    got = OPS["mp.quantize"].reference([x], {"scale": 0.5, "zero_point": 1}, [T("5xi4")])[0]
    assert got.tolist() == [-8, -5, 2, 7, 1]


def test_gelu_exact_keeps_relative_precision_in_the_negative_tail():
    x = np.array([-12.0, -8.0, -5.0, -1.0, 0.0, 2.5], np.float32)
    want = [0.5 * v * math.erfc(-v / math.sqrt(2)) for v in x.tolist()]
    got = OPS["mp.gelu"].reference([x], {})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def test_conv2d_int8_matches_float_conv_on_integers():
    x = _rng.integers(-128, 128, (1, 4, 6, 6)).astype(np.int8)
    w = _rng.integers(-128, 128, (4, 2, 3, 3)).astype(np.int8)
    attrs = {"groups": 2, "padding": (1, 1, 1, 1)}
    got = OPS["mp.conv2d"].reference([x, w], attrs, [T("1x4x6x6xi32")])[0]
    want = OPS["mp.conv2d"].reference([x.astype(np.float64), w.astype(np.float64)], attrs)[0]
    np.testing.assert_array_equal(got, want)


def test_constant_reference_is_its_value_and_named_constants_have_none():
    value = dense([[1.0, 2.0], [3.0, 4.0]], "f32")
    got = OPS["mp.constant"].reference([], {"value": value}, [T("2x2xf32")])[0]
    np.testing.assert_array_equal(got, [[1.0, 2.0], [3.0, 4.0]])
    with pytest.raises(OpError, match="loaded from the weights file"):
        OPS["mp.constant"].reference([], {"name": "fc1.weight"}, [T("2x2xf32")])


def test_reshape_reference_needs_the_declared_result():
    with pytest.raises(OpError, match="takes its result type from the declaration"):
        OPS["mp.reshape"].reference([rand(2, 3)], {})


def test_sparse_encode_keeps_values():
    w = rand(8, 4)
    got = OPS["mp.sparse_encode"].reference([w], {}, [T("8x4xf32", "2:4")])[0]
    np.testing.assert_array_equal(got, w)


def test_reference_accepts_checked_attrs():
    raw = {"groups": TypedInt(2, "i64"), "strides": (2, 1)}
    checked = check_attrs(OPS["mp.conv2d"], raw)
    x, w = _CONV_X, _CONV_W
    np.testing.assert_array_equal(OPS["mp.conv2d"].reference([x, w], raw)[0],
                                  OPS["mp.conv2d"].reference([x, w], checked)[0])


# ---------------------------------------------------------------------------------------------
# FLOP counts


@pytest.mark.parametrize("op,operands,attrs,flops", [
    pytest.param("matmul", ["32x64xf32", "64x128xf32"], {}, 2 * 32 * 128 * 64, id="matmul-2d"),
    pytest.param("matmul", ["2x3x4x5xbf16", "5x6xbf16"], {}, 2 * (2 * 3 * 4 * 6) * 5,
                 id="matmul-batched"),
    pytest.param("matmul", ["5xf32", "5xf32"], {}, 10, id="matmul-dot"),
    pytest.param("conv2d", ["1x3x32x32xf32", "8x3x3x3xf32", "8xf32"],
                 {"padding": (1, 1, 1, 1), "strides": (2, 2)}, 2 * 1 * 8 * 16 * 16 * 3 * 3 * 3,
                 id="conv2d"),
    pytest.param("conv2d", ["2x4x9x8xf32", "6x2x3x3xf32"],
                 {"strides": (2, 1), "padding": (1, 0, 2, 1), "dilations": (1, 2), "groups": 2},
                 2 * 2 * 6 * 5 * 5 * 2 * 3 * 3, id="conv2d-grouped"),
    pytest.param("add", ["3x1x5xf32", "4x1xf32"], {}, 60, id="add-broadcast"),
    pytest.param("softmax", ["4x10xf32"], {}, 5 * 40, id="softmax"),
    pytest.param("max_pool2d", ["1x3x32x32xf32"], {"kernel": (2, 2), "strides": (2, 2)},
                 3 * 16 * 16 * 4, id="max_pool2d"),
    pytest.param("reduce_sum", ["4x10xf32"], {"axes": (1,)}, 40, id="reduce_sum"),
    pytest.param("transpose", ["4x10xf32"], {}, 0, id="transpose"),
    pytest.param("cast", ["4x10xf32"], {}, 0, id="cast"),
])
def test_flops(op, operands, attrs, flops):
    types = [T(o) for o in operands]
    assert OPS[f"mp.{op}"].flops(types, [], attrs) == flops
