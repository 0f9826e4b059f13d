"""range-analysis and assign-precision{overflow_guard=true}, on constructed ranges.

Every expected interval is worked out by hand from the given ranges (written as `mp.range` /
`mp.observed` / `mp.tiny` attributes, as calibrate records them), so the tests need no data.
"""

from __future__ import annotations

import math

import pytest
from mplower.passes.range_analysis import Interval, flags, propagate

from mplower.backend.executor import reference_runner
from mplower.ir.parser import parse
from mplower.ir.types import tensor
from mplower.lowering.calibration import value_attrs
from mplower.pass_manager import PassContext, PassManager, parse_pipeline


def analyzed(text: str, pipeline: str = "range-analysis"):
    module = parse(text)
    ctx = PassContext(runner=reference_runner)
    PassManager(parse_pipeline(pipeline)).run(module, ctx)
    f = module.function()
    by_name = {f.value_name((n, 0)): n for n in f.ops() if f.data(n)["types"]}
    return f, by_name, ctx


MATMUL = """
func.func @main(%x: tensor<4x2xf32>) -> tensor<4x2xf32> attributes {arg_attrs = [{mp.range = [-100.0, 300.0]}]} {
  %w = mp.constant {value = dense<[[200.0, -1.0], [100.0, 2.0]]> : tensor<2x2xf32>} : () -> tensor<2x2xf32>
  %0 = mp.matmul %x, %w : (tensor<4x2xf32>, tensor<2x2xf32>) -> tensor<4x2xf32>
  %1 = mp.tanh %0 : (tensor<4x2xf32>) -> tensor<4x2xf32>
  %2 = mp.relu %x : (tensor<4x2xf32>) -> tensor<4x2xf32>
  %3 = mp.add %1, %2 : (tensor<4x2xf32>, tensor<4x2xf32>) -> tensor<4x2xf32>
  return %3 : tensor<4x2xf32>
}
"""


def test_matmul_against_known_weights_is_bounded_per_output_column():
    f, ops, ctx = analyzed(MATMUL)
    # Column 0: x0 * 200 + x1 * 100 over x in [-100, 300]^2: [-30000, 90000]; column 1:
    # [-300 - 200, 100 + 600] = [-500, 700]; the union over columns.
    attrs = f.attrs_of(ops["%0"])
    assert attrs["mp.bound"] == (-30000.0, 90000.0)
    assert attrs["mp.overflow"] == ("f16", "f8E4M3FN", "f8E5M2")
    assert f.attrs_of(ops["%1"])["mp.bound"] == (math.tanh(-30000.0), 1.0)
    assert f.attrs_of(ops["%2"])["mp.bound"] == (0.0, 300.0)
    assert f.attrs_of(ops["%3"])["mp.bound"] == (-1.0, 301.0)
    assert "mp.overflow" not in f.attrs_of(ops["%3"])
    assert "mp.overflow" not in value_attrs(f, (f.args[0], 0))  # 300 fits every format
    assert ctx.stats["overflow-predicted"] == 1 and ctx.stats["values-unbounded"] == 0


def test_overflow_guard_keeps_flagged_ops_in_bf16_with_the_reason():
    f, ops, ctx = analyzed(MATMUL, "range-analysis,assign-precision{policy=fp16 "
                                   "overflow_guard=true}")
    mm = f.attrs_of(ops["%0"])
    assert mm["mp.precision"].type == "bf16" and mm["mp.accum"].type == "f32"
    assert mm["mp.reason"] == "overflow-guard: f16 overflows (max 9e+04 > 65504)"
    assert ctx.stats["ops-guarded"] == 2  # the matmul and tanh, whose f16 input would overflow
    assert not f.attrs_of(ops["%2"])["mp.reason"].startswith("overflow-guard")  # relu
    unguarded, ops2, _ = analyzed(MATMUL, "range-analysis,assign-precision{policy=fp16}")
    assert unguarded.attrs_of(ops2["%0"])["mp.precision"].type == "f16"


def test_overflow_guard_falls_back_to_f32_where_bf16_overflows_too():
    text = """
func.func @main(%x: tensor<4x4xf32>) -> tensor<4x4xf32> attributes {arg_attrs = [{mp.range = [0.0, 1.0e30]}]} {
  %0 = mp.matmul %x, %x : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
  return %0 : tensor<4x4xf32>
}
"""
    f, ops, _ = analyzed(text, "range-analysis{formats=f16,bf16},assign-precision{policy=fp16 "
                               "overflow_guard=true}")
    attrs = f.attrs_of(ops["%0"])
    assert attrs["mp.overflow"] == ("f16", "bf16")
    assert attrs["mp.precision"].type == "f32"
    assert attrs["mp.reason"].startswith("overflow-guard: f16 overflows (max 4e+60")


def test_flush_to_zero_is_predicted_from_the_small_magnitudes():
    text = """
func.func @main(%x: tensor<2x8xf32>) -> tensor<2x8xf32> attributes {arg_attrs = [{mp.range = [-2.0, 2.0], mp.tiny = 1.0e-9}]} {
  %w = mp.constant {value = dense<0.5> : tensor<8x8xf32>} : () -> tensor<8x8xf32>
  %0 = mp.matmul %x, %w : (tensor<2x8xf32>, tensor<8x8xf32>) -> tensor<2x8xf32>
  %1 = mp.exp %x : (tensor<2x8xf32>) -> tensor<2x8xf32>
  return %1 : tensor<2x8xf32>
}
"""
    f, ops, _ = analyzed(text, "range-analysis,assign-precision{policy=fp16 overflow_guard=true}")
    x = value_attrs(f, (f.args[0], 0))
    # 1e-9 is below half of f16's (2^-25) and f8's smallest subnormals, above bf16's, and
    # below half an i8 step of the range [-2, 2].
    assert x["mp.underflow"] == ("f16", "f8E4M3FN", "f8E5M2", "i8")
    assert "mp.underflow" not in f.attrs_of(ops["%1"])  # exp(x) >= exp(-2)
    assert f.attrs_of(ops["%1"])["mp.bound"] == (math.exp(-2.0), math.exp(2.0))
    mm = f.attrs_of(ops["%0"])  # its operand %x flushes in f16, not in bf16
    assert mm["mp.precision"].type == "bf16"
    assert mm["mp.reason"].startswith("overflow-guard: f16 flushes to zero (1% of |x| at or "
                                      "below 1e-09 < 2.98e-08)")


def test_i8_saturation_is_predicted_where_calibration_clipped():
    text = """
func.func @main(%x: tensor<4x2xf32>) -> tensor<4x2xf32> attributes {arg_attrs = [{mp.range = [-3.0, 3.0], mp.observed = [-3.0, 40.0], mp.calib = "percentile"}]} {
  %w = mp.constant {value = dense<1.0> : tensor<2x2xf32>} : () -> tensor<2x2xf32>
  %0 = mp.matmul %x, %w : (tensor<4x2xf32>, tensor<2x2xf32>) -> tensor<4x2xf32>
  %1 = mp.matmul %0, %w : (tensor<4x2xf32>, tensor<2x2xf32>) -> tensor<4x2xf32>
  %2 = mp.matmul %1, %w : (tensor<4x2xf32>, tensor<2x2xf32>) -> tensor<4x2xf32>
  return %2 : tensor<4x2xf32>
}
"""
    f, ops, _ = analyzed(text, "range-analysis,assign-precision{policy=int8 overflow_guard=true}")
    assert value_attrs(f, (f.args[0], 0))["mp.overflow"] == ("i8",)
    # keep-first-last leaves %0 and %2 in f32; %1's input has no calibrated scale: not flagged.
    assert f.attrs_of(ops["%1"])["mp.precision"].type == "i8"
    text = text.replace("%0 = mp.matmul %x, %w", "%0 = mp.matmul %x, %w {mp.range = [-6.0, "
                                                 "6.0], mp.observed = [-6.0, 80.0]}")
    f, ops, _ = analyzed(text, "range-analysis,assign-precision{policy=int8 overflow_guard=true}")
    attrs = f.attrs_of(ops["%1"])
    assert attrs["mp.precision"].type == "bf16"
    assert attrs["mp.reason"] == "overflow-guard: i8 saturates (max 80 beyond the calibrated 6)"


@pytest.mark.parametrize("op, ins, expect", [
    ("mp.relu", [Interval(-3, 5)], (0, 5)),
    ("mp.neg", [Interval(-3, 5)], (-5, 3)),
    ("mp.sub", [Interval(0, 1), Interval(-2, 3)], (-3, 3)),
    ("mp.mul", [Interval(-2, 3), Interval(-1, 4)], (-8, 12)),
    ("mp.div", [Interval(1, 2), Interval(-1, 1)], (-math.inf, math.inf)),
    ("mp.div", [Interval(1, 2), Interval(2, 4)], (0.25, 1.0)),
    ("mp.maximum", [Interval(-3, 1), Interval(-1, 0)], (-1, 1)),
    ("mp.sigmoid", [Interval(0, 0)], (0.5, 0.5)),
    ("mp.concat", [Interval(-1, 1), Interval(0, 7)], (-1, 7)),
    ("mp.gelu", [Interval(-3, 1)], (-0.1699846, 0.8413447460685429)),
])
def test_propagation_rules(op, ins, expect):
    tt = tensor((4,), "f32")
    attrs = {"axis": 0, "approximate": "none"}
    got = propagate(op, ins, attrs, [tt] * len(ins), tt, [None] * len(ins))
    assert (got.lo, got.hi) == pytest.approx(expect, rel=1e-6)


def test_softmax_and_norms_are_bounded_without_knowing_the_input_well():
    tt = tensor((2, 10), "f32")
    sm = propagate("mp.softmax", [Interval(-5, 5)], {"axis": -1}, [tt], tt, [None])
    assert sm.hi == 1.0 and sm.tiny == pytest.approx(math.exp(-10) / 10)
    g = tensor((10,), "f32")
    ln = propagate("mp.layer_norm", [Interval(-1e6, 1e6), Interval(0.5, 2), Interval(-1, 1)],
                   {"axis": -1}, [tt, g, g], tt, [None] * 3)
    assert (ln.lo, ln.hi) == (-3 * 2 - 1, 3 * 2 + 1)  # |z| <= sqrt(10 - 1) = 3


def test_i8_flags_need_a_calibrated_scale():
    assert flags(Interval(-1, 1e6), "i8", None) == (False, False)
    assert flags(Interval(-1, 10, tiny=0.001), "i8", (-10.0, 10.0)) == (False, True)
    assert flags(Interval(-1, 10.05), "i8", (-10.0, 10.0)) == (True, False)
    assert flags(Interval(-1, 10.02), "i8", (-10.0, 10.0)) == (False, False)  # rounds down
