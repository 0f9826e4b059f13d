"""The executor (mplower.backend.executor): exact formats, accumulators, fallbacks, determinism.

Expected values here never come from mplower's own kernels: they are numpy float16/int64
arithmetic, the ONNX formulas written out, constructed inputs whose counts are known by hand,
or the independent numpy reference of ir_examples/make_examples.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
from conftest import sequential_matmul
from mplower.passes.insert_casts import materialize

from mplower.backend.executor import Program
from mplower.ir.parser import parse
from mplower.pass_manager import PassContext, load_passes

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "ir_examples"


def program(text: str, path: Path | None = None, func: str | None = None,
            weights: str | None = None) -> Program:
    module = parse(text, str(path) if path else "<test>")
    module.path = str(path) if path else str(ROOT / "<test>")
    return Program(module, func, weights)


def example(name: str, *passes: tuple[str, dict]) -> Program:
    path = EXAMPLES / f"{name}.ir"
    module = parse(path.read_text(), str(path))
    module.path = str(path)
    registry = load_passes()
    for pass_name, options in passes:
        registry[pass_name](**options).run(module, PassContext())
    materialize(module)  # as `mplower run` does: a plan that is only annotations gets its casts
    return Program(module)


def example_inputs(name: str) -> list[np.ndarray]:
    with np.load(EXAMPLES / f"{name}_inputs.npz") as data:
        return [data["x"]]


def by_name(result, name: str):
    return next(r for r in result.ops if r.step.name == name)


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


# ---- the fp32 plan against independent numpy ---------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_fp32_plan_matches_independent_numpy_reference(name: str, cli, tmp_path) -> None:
    # make_examples.py computes these in float64 numpy, without mplower; for the MLP the saved
    # output_0 is scikit-learn's own predict_proba.
    res = cli("run", EXAMPLES / f"{name}.ir", "--inputs", EXAMPLES / f"{name}_inputs.npz",
              "--save-outputs", tmp_path / "out.npz", "--format", "json")
    assert res.rc == 0, res.err
    with np.load(EXAMPLES / f"{name}_expected.npz") as data, np.load(tmp_path / "out.npz") as out:
        expected = data["output_0"].astype(np.float64)
        got = out["output_0"].astype(np.float64)
    assert got.shape == expected.shape
    assert np.max(np.abs(got - expected)) / np.max(np.abs(expected)) < 1e-6
    summary = json.loads(res.out)["summary"]  # the f32 plan is its reference
    assert (summary["output_rel_l2"], summary["fallback_ops"]) == (0.0, 0)


def test_mlp_fp32_plan_agrees_with_sklearn_labels() -> None:
    result = example("mlp").run(example_inputs("mlp"))
    with np.load(EXAMPLES / "mlp_expected.npz") as data:
        proba, labels = data["output_0"], data["labels"]
    assert np.array_equal(np.argmax(result.outputs[0], -1), np.argmax(proba, -1))
    assert np.mean(np.argmax(result.outputs[0], -1) == labels) >= 0.9


# ---- exact counts ------------------------------------------------------------------------

COUNTS_IR = """
func.func @main(%x: tensor<10xf32>) -> (tensor<10xf16>, tensor<10xbf16>, tensor<10xf8E4M3FN>,
                                        tensor<10xf8E5M2>, tensor<10xf16>) {
  %h = mp.cast %x : (tensor<10xf32>) -> tensor<10xf16>
  %b = mp.cast %x : (tensor<10xf32>) -> tensor<10xbf16>
  %e4 = mp.cast %x : (tensor<10xf32>) -> tensor<10xf8E4M3FN>
  %e5 = mp.cast %x {saturate = false} : (tensor<10xf32>) -> tensor<10xf8E5M2>
  %d = mp.sub %h, %h : (tensor<10xf16>, tensor<10xf16>) -> tensor<10xf16>
  return %h, %b, %e4, %e5, %d : tensor<10xf16>, tensor<10xbf16>, tensor<10xf8E4M3FN>,
                                 tensor<10xf8E5M2>, tensor<10xf16>
}
"""
# f16: max 65504, 65520 is the first value rounding to inf; smallest subnormal 2^-24 ~ 5.96e-8,
# so 3e-8 (above half of it) survives. bf16 keeps f32's range but not its smallest subnormals
# (2^-149 -> 0). f8E4M3FN saturates (ONNX Cast default) at 448 and flushes below 2^-10;
# f8E5M2 with saturate = false overflows to inf above 61440 and flushes below 2^-17.
COUNTS_X = np.array([70000.0, -70000.0, 65520.0, 65519.0, 1e-10, -1e-10, 3e-8, 0.0, 1.0,
                     1e-45], dtype=np.float32)
EXPECTED_COUNTS = {  # (overflow, underflow, nan)
    "%h": (3, 3, 0),
    "%b": (0, 1, 0),
    "%e4": (4, 4, 0),
    "%e5": (4, 4, 0),
    "%d": (0, 0, 3),  # inf - inf and -inf - -inf
}


def test_overflow_underflow_nan_counts_are_exact_per_op() -> None:
    result = program(COUNTS_IR).run([COUNTS_X])
    counts = {r.step.name: (r.counts.overflow, r.counts.underflow, r.counts.nan)
              for r in result.ops}
    assert counts == EXPECTED_COUNTS


def test_report_summary_sums_the_exact_counts() -> None:
    from mplower.report.run import build_report

    report = build_report(program(COUNTS_IR).run([COUNTS_X]), {"max_overflow": 10})
    s = report["summary"]
    assert (s["overflow"], s["underflow"], s["nan"]) == (11, 12, 3)
    assert s["guardrails"]["max_overflow"] == {"limit": 10, "value": 11, "ok": False}
    assert s["verdict"] == "fail"
    assert s["output_rel_l2"] is None  # NaN outputs: not a finite drift


def test_quantize_counts_clamped_and_flushed_values() -> None:
    text = """
func.func @main(%x: tensor<6xf32>) -> tensor<6xi8> {
  %q = mp.quantize %x {scale = 0.01 : f32, zero_point = 0 : i8} : (tensor<6xf32>) -> tensor<6xi8>
  return %q : tensor<6xi8>
}
"""
    x = np.array([1000.0, -1000.0, 1.27, 1e-6, -4e-3, 0.0], dtype=np.float32)
    result = program(text).run([x])
    q = by_name(result, "%q")
    assert (q.counts.overflow, q.counts.underflow, q.counts.nan) == (2, 2, 0)
    np.testing.assert_array_equal(result.outputs[0], [127, -128, 127, 0, 0, 0])


# ---- accumulators ------------------------------------------------------------------------


def f16_sequential(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """acc = f16(acc + a[i, k] * b[k, j]) for k in order, with numpy float16 and float64 only.

    The operands are multiples of 2^-10 below 2 in magnitude, so every product and every sum
    here is exact in float64 and the cast to float16 is the one (nearest-even) rounding.
    """
    acc = np.zeros((a.shape[0], b.shape[1]), dtype=np.float16)
    for k in range(a.shape[1]):
        exact = acc.astype(np.float64) + np.outer(a[:, k].astype(np.float64),
                                                  b[k, :].astype(np.float64))
        acc = exact.astype(np.float16)
    return acc


F16_IR = """
func.func @main(%a: tensor<8x256xf16>, %b: tensor<256x16xf16>) -> tensor<8x16xf16> {
  %0 = mp.matmul %a, %b {mp.accum = f16} : (tensor<8x256xf16>, tensor<256x16xf16>) -> tensor<8x16xf16>
  return %0 : tensor<8x16xf16>
}
"""


def f16_operands(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = (rng.integers(-2047, 2048, (8, 256)) / 1024).astype(np.float16)
    b = (rng.integers(-2047, 2048, (256, 16)) / 1024).astype(np.float16)
    return a, b


def test_f16_accumulation_equals_sequential_float16_sum_bit_for_bit() -> None:
    a, b = f16_operands()
    result = program(F16_IR).run([a.astype(np.float32), b.astype(np.float32)])
    got = result.outputs[0].astype(np.float16)
    expected = f16_sequential(a, b)
    assert bits(got) == bits(expected)
    step = by_name(result, "%0").step
    assert step.executed == {"precision": "f16", "accum": "f16", "kernel": "dense"}
    # Really step by step: an f32 accumulator rounded once at the end differs somewhere.
    once = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
    assert np.any(once != expected)


def test_f16_accumulator_overflow_is_counted_and_sticks() -> None:
    text = """
func.func @main(%a: tensor<1x3xf16>, %b: tensor<3x1xf16>) -> tensor<1x1xf16> {
  %0 = mp.matmul %a, %b {mp.accum = f16} : (tensor<1x3xf16>, tensor<3x1xf16>) -> tensor<1x1xf16>
  return %0 : tensor<1x1xf16>
}
"""
    a = np.ones((1, 3), np.float32)
    b = np.array([[60000.0], [60000.0], [-60000.0]], np.float32)
    result = program(text).run([a, b])
    assert result.outputs[0][0, 0] == np.inf  # 60000 + 60000 overflows the f16 accumulator
    assert result.reference[0][0, 0] == 60000.0
    assert by_name(result, "%0").counts.overflow == 1


def test_f16_accumulation_batched_and_conv_follow_the_same_order() -> None:
    a, b = f16_operands(1)
    a3 = np.stack([a, -a]).astype(np.float32)  # (2, 8, 256) @ (256, 16)
    text = """
func.func @main(%a: tensor<2x8x256xf16>, %b: tensor<256x16xf16>) -> tensor<2x8x16xf16> {
  %0 = mp.matmul %a, %b {mp.accum = f16} : (tensor<2x8x256xf16>, tensor<256x16xf16>) -> tensor<2x8x16xf16>
  return %0 : tensor<2x8x16xf16>
}
"""
    got = program(text).run([a3, b.astype(np.float32)]).outputs[0].astype(np.float16)
    assert bits(got[0]) == bits(f16_sequential(a, b))
    assert bits(got[1]) == bits(f16_sequential(-a, b))

    # A 1x1 convolution over 256 channels is the same sum per pixel, in channel order.
    conv = """
func.func @main(%x: tensor<1x256x2x4xf16>, %w: tensor<16x256x1x1xf16>) -> tensor<1x16x2x4xf16> {
  %0 = mp.conv2d %x, %w {mp.accum = f16} : (tensor<1x256x2x4xf16>, tensor<16x256x1x1xf16>) -> tensor<1x16x2x4xf16>
  return %0 : tensor<1x16x2x4xf16>
}
"""
    x = a.T.reshape(1, 256, 2, 4)
    w = b.T.reshape(16, 256, 1, 1)
    result = program(conv).run([x.astype(np.float32), w.astype(np.float32)])
    got = result.outputs[0].astype(np.float16).reshape(16, 8).T
    assert bits(got) == bits(f16_sequential(a, b))
    assert by_name(result, "%0").step.executed["accum"] == "f16"


def test_i8_matmul_accumulates_exactly_then_requantizes_as_onnx() -> None:
    text = """
func.func @main(%x: tensor<4x2048xf32>, %w: tensor<2048x8xf32>) -> tensor<4x8xi8> {
  %xq = mp.quantize %x {scale = 0.05 : f32, zero_point = 0 : i8} : (tensor<4x2048xf32>) -> tensor<4x2048xi8>
  %wq = mp.quantize %w {scale = 0.02 : f32} : (tensor<2048x8xf32>) -> tensor<2048x8xi8>
  %acc = mp.matmul %xq, %wq : (tensor<4x2048xi8>, tensor<2048x8xi8>) -> tensor<4x8xi32>
  %y = mp.dequantize %acc {scale = 0.001 : f32} : (tensor<4x8xi32>) -> tensor<4x8xf32>
  %yq = mp.quantize %y {scale = 0.5 : f32, zero_point = 3 : i8} : (tensor<4x8xf32>) -> tensor<4x8xi8>
  return %yq : tensor<4x8xi8>
}
"""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 2048)).astype(np.float32)
    w = (rng.standard_normal((2048, 8)) * 0.3).astype(np.float32)
    x[0], w[:, 0] = -100.0, -3.0  # -128 * -128 * 2048 = 2^25: beyond f32's exact integers
    result = program(text).run([x, w])
    # ONNX QuantizeLinear / DequantizeLinear written out in numpy, int64 sums.
    xq = np.clip(np.rint(x / np.float32(0.05)), -128, 127).astype(np.int64)
    wq = np.clip(np.rint(w / np.float32(0.02)), -128, 127).astype(np.int64)
    acc = xq @ wq
    assert int(acc[0, 0]) == 2 ** 25
    y = acc.astype(np.float32) * np.float32(0.001)
    yq = np.clip(np.rint(y / np.float32(0.5)) + 3, -128, 127).astype(np.int64)
    assert np.array_equal(result.outputs[0].astype(np.int64), yq)
    step = by_name(result, "%acc").step
    assert np.array_equal(step.run([xq.astype(np.int8), wq.astype(np.int8)])[0], acc)
    assert step.executed == {"precision": "i8", "accum": "i32", "kernel": "dense"}
    assert by_name(result, "%xq").counts.overflow == 2048  # x[0] saturates
    # The reference has no quantize: there %acc is x @ w, which the dequantized sum tracks
    # closely once nothing saturates.
    x[0], w[:, 0] = x[1], w[:, 1]
    assert 0 < by_name(program(text).run([x, w]), "%y").rel_l2 < 0.05


def test_integer_operand_without_a_float_origin_has_no_reference_drift() -> None:
    from mplower.report.run import build_report

    text = """
func.func @main(%x: tensor<2x4xf32>, %w: tensor<4x3xi8>) -> tensor<2x3xf32> {
  %xq = mp.quantize %x {scale = 0.1 : f32} : (tensor<2x4xf32>) -> tensor<2x4xi8>
  %acc = mp.matmul %xq, %w : (tensor<2x4xi8>, tensor<4x3xi8>) -> tensor<2x3xi32>
  %y = mp.dequantize %acc {scale = 0.1 : f32} : (tensor<2x3xi32>) -> tensor<2x3xf32>
  return %y : tensor<2x3xf32>
}
"""
    x = np.ones((2, 4), np.float32)
    w = np.full((4, 3), 2, np.int8)
    report = build_report(program(text).run([x, w]), {"max_rel_l2": 0.1})
    y = next(o for o in report["ops"] if o["name"] == "%y")
    assert y["rel_l2"] is None
    assert report["summary"]["output_rel_l2"] is None
    assert report["summary"]["guardrails"]["max_rel_l2"]["ok"] is False  # cannot be shown


@pytest.mark.parametrize("ea, eb, k", [("i8", "i8", 1024), ("ui8", "ui8", 512),
                                       ("ui8", "i8", 4096)])
def test_integer_matmul_is_exact_at_the_f32_limit_and_beyond(ea: str, eb: str, k: int) -> None:
    lo = {"i8": -128, "ui8": 0}
    hi = {"i8": 127, "ui8": 255}
    text = f"""
func.func @main(%a: tensor<3x{k}x{ea}>, %b: tensor<{k}x2x{eb}>) -> tensor<3x2xi32> {{
  %0 = mp.matmul %a, %b : (tensor<3x{k}x{ea}>, tensor<{k}x2x{eb}>) -> tensor<3x2xi32>
  return %0 : tensor<3x2xi32>
}}
"""
    rng = np.random.default_rng(2)
    a = rng.integers(lo[ea], hi[ea] + 1, (3, k))
    b = rng.integers(lo[eb], hi[eb] + 1, (k, 2))
    a[0], b[:, 0] = lo[ea] or hi[ea], lo[eb] or hi[eb]  # the largest products everywhere
    a[1] = a[1] | 1  # odd values: a lost low bit would show
    result = program(text).run([a, b])
    assert np.array_equal(result.outputs[0], a @ b)
    assert by_name(result, "%0").step.executed == {"precision": ea, "accum": "i32",
                                                   "kernel": "dense"}


# ---- fallbacks ---------------------------------------------------------------------------

FALLBACK_IR = """
func.func @main(%a: tensor<4x8xf32>, %b: tensor<8x3xf32>) -> tensor<4x3xf32> {
  %s = mp.matmul %a, %b {mp.kernel = "sparse_2_4"} : (tensor<4x8xf32>, tensor<8x3xf32>) -> tensor<4x3xf32>
  %i = mp.matmul %a, %b {mp.precision = i8, mp.accum = i32} : (tensor<4x8xf32>, tensor<8x3xf32>) -> tensor<4x3xf32>
  %h = mp.matmul %a, %b {mp.accum = f16} : (tensor<4x8xf32>, tensor<8x3xf32>) -> tensor<4x3xf32>
  %0 = mp.add %s, %i : (tensor<4x3xf32>, tensor<4x3xf32>) -> tensor<4x3xf32>
  %1 = mp.add %0, %h : (tensor<4x3xf32>, tensor<4x3xf32>) -> tensor<4x3xf32>
  return %1 : tensor<4x3xf32>
}
"""


def test_fallbacks_run_the_wider_path_and_say_why() -> None:
    from mplower.report.run import build_report

    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 8)).astype(np.float32)
    b = rng.standard_normal((8, 3)).astype(np.float32)
    result = program(FALLBACK_IR).run([a, b])
    ops = {o["name"]: o for o in build_report(result, {})["ops"]}
    assert {k: ops["%s"][k] for k in ("requested", "executed", "fallback", "reason")} == {
        "requested": {"precision": "f32", "accum": "f32", "kernel": "sparse_2_4"},
        "executed": {"precision": "f32", "accum": "f32", "kernel": "dense"},
        "fallback": True, "reason": "no-sparse-kernel"}
    assert {k: ops["%i"][k] for k in ("requested", "executed", "fallback", "reason")} == {
        "requested": {"precision": "i8", "accum": "i32", "kernel": "dense"},
        "executed": {"precision": "f32", "accum": "f32", "kernel": "dense"},
        "fallback": True, "reason": "not-quantized"}
    # An f16 accumulator cannot take f32 products exactly: f32 accumulation.
    assert (ops["%h"]["executed"]["accum"], ops["%h"]["reason"]) == ("f32", "no-f16-accum")
    assert (ops["%0"]["fallback"], ops["%0"]["reason"]) == (False, None)
    expected = sequential_matmul(a, b)  # mplower's summation order, not BLAS's
    for name in ("%s", "%i", "%h"):
        assert np.array_equal(result.ops[[r.step.name for r in result.ops].index(name)]
                              .step.run([a, b])[0], expected)
    s = build_report(result, {})["summary"]
    assert (s["ops"], s["fallback_ops"], s["fallback_rate"]) == (5, 3, 0.6)


def test_legalize_fallback_reports_what_the_policy_asked_for() -> None:
    prog = example("transformer", ("assign-precision", {"policy": "fp8"}),
                   ("legalize", {"target": "a100"}))
    result = prog.run(example_inputs("transformer"))
    matmul = by_name(result, "%k_proj").step
    assert matmul.requested == {"precision": "f8E4M3FN", "accum": "f32", "kernel": "dense"}
    assert matmul.executed == {"precision": "bf16", "accum": "f32", "kernel": "dense"}
    assert matmul.reason == "no-fp8-kernel"


# ---- plans, materialization, determinism ------------------------------------------------


def test_annotated_module_is_materialized_before_it_runs() -> None:
    x = example_inputs("transformer")
    annotated = example("transformer", ("assign-precision", {"policy": "bf16"}))
    explicit = example("transformer", ("assign-precision", {"policy": "bf16"}),
                       ("insert-casts", {}))
    assert any(s.op == "mp.cast" for s in annotated.steps)
    assert [s.name for s in annotated.steps] == [s.name for s in explicit.steps]
    assert bits(annotated.run(x).outputs[0]) == bits(explicit.run(x).outputs[0])


def test_bf16_plan_drift_starts_at_the_first_rounding_and_stays_small() -> None:
    result = example("transformer", ("assign-precision", {"policy": "bf16"})).run(
        example_inputs("transformer"))
    out, ref = result.outputs[0], result.reference[0]
    assert 0 < np.linalg.norm(out - ref) / np.linalg.norm(ref) < 0.02
    drifting = [r for r in result.ops if r.rel_l2]
    assert drifting
    first = result.ops.index(drifting[0])
    assert all(r.rel_l2 in (0.0, None) for r in result.ops[:first])
    assert drifting[0].step.out_type.elem == "bf16"  # a value rounded to bf16 starts it


@pytest.mark.determinism
def test_run_and_run_lowered_agree() -> None:
    prog = example("transformer", ("assign-precision", {"policy": "fp8"}))
    x = example_inputs("transformer")
    assert bits(prog.run(x).outputs[0]) == bits(prog.run_lowered(prog.prepare_inputs(x))[0])


DETERMINISM_IR = """
func.func @main(%a: tensor<320x256xf32>, %b: tensor<256x288xf32>, %c: tensor<2048x2048xf32>)
    -> (tensor<320x288xf32>, tensor<320x288xf16>, tensor<2048x2048xbf16>) {
  %cb = mp.cast %c : (tensor<2048x2048xf32>) -> tensor<2048x2048xbf16>
  %ab = mp.cast %a : (tensor<320x256xf32>) -> tensor<320x256xbf16>
  %bb = mp.cast %b : (tensor<256x288xf32>) -> tensor<256x288xbf16>
  %p = mp.matmul %ab, %bb : (tensor<320x256xbf16>, tensor<256x288xbf16>) -> tensor<320x288xbf16>
  %y = mp.cast %p : (tensor<320x288xbf16>) -> tensor<320x288xf32>
  %ah = mp.cast %a : (tensor<320x256xf32>) -> tensor<320x256xf16>
  %bh = mp.cast %b : (tensor<256x288xf32>) -> tensor<256x288xf16>
  %h = mp.matmul %ah, %bh {mp.accum = f16} : (tensor<320x256xf16>, tensor<256x288xf16>) -> tensor<320x288xf16>
  return %y, %h, %cb : tensor<320x288xf32>, tensor<320x288xf16>, tensor<2048x2048xbf16>
}
"""


def _all_bits(prog: Program, inputs: list[np.ndarray]) -> list[bytes]:
    result = prog.run(inputs)
    return [bits(y) for y in result.outputs] + [bits(r) for r in result.reference]


@pytest.mark.determinism
def test_results_are_bit_identical_across_runs_and_thread_counts() -> None:
    threadpoolctl = pytest.importorskip("threadpoolctl")
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((320, 256)).astype(np.float32),
              rng.standard_normal((256, 288)).astype(np.float32),
              rng.standard_normal((2048, 2048)).astype(np.float32)]
    prog = program(DETERMINISM_IR)  # %cb: 4M values, the rounding kernel's parallel path
    transformer = example("transformer", ("assign-precision", {"policy": "bf16"}))
    x = example_inputs("transformer")
    first = _all_bits(prog, inputs) + _all_bits(transformer, x)
    assert _all_bits(prog, inputs) + _all_bits(transformer, x) == first
    threads = numba.get_num_threads()
    try:
        for n in sorted({1, max(2, threads)} & set(range(1, numba.config.NUMBA_NUM_THREADS + 1))):
            numba.set_num_threads(n)
            with threadpoolctl.threadpool_limits(limits=n, user_api="blas"):
                assert _all_bits(prog, inputs) + _all_bits(transformer, x) == first
    finally:
        numba.set_num_threads(threads)


@pytest.mark.determinism
def test_results_are_bit_identical_in_processes_with_one_and_two_threads(tmp_path) -> None:
    ir = tmp_path / "m.ir"
    ir.write_text(DETERMINISM_IR)
    outs = []
    for n in ("1", "2"):
        env = {**os.environ, "OMP_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n,
               "MKL_NUM_THREADS": n, "NUMBA_NUM_THREADS": n}
        out = tmp_path / f"out{n}.npz"
        done = subprocess.run([sys.executable, "-m", "mplower", "run", str(ir), "--seed", "7",
                               "--save-outputs", str(out)],
                              env=env, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        with np.load(out) as data:
            outs.append([bits(data[k]) for k in sorted(data.files)])
    assert outs[0] == outs[1]


def batched(name: str, batch: int, size: int, policy: str) -> Program:
    """An example with its batch dimension (`batch` in the file) set to `size`, under `policy`."""
    path = EXAMPLES / f"{name}.ir"
    module = parse(path.read_text().replace(f"tensor<{batch}x", f"tensor<{size}x"), str(path))
    module.path = str(path)
    load_passes()["assign-precision"](policy=policy).run(module, PassContext())
    materialize(module)
    return Program(module)


@pytest.mark.determinism
@pytest.mark.parametrize("name, batch, shape", [("mlp", 32, (64,)), ("cnn", 1, (1, 8, 8))])
@pytest.mark.parametrize("policy", ["fp32", "bf16", "fp16"])
def test_a_sample_gives_the_same_bits_alone_and_anywhere_in_a_batch(name, batch, shape,
                                                                    policy) -> None:
    # Lowered outputs, every intermediate value and the fp32 reference: the products of matmul
    # and conv are summed in mplower's order, so a sample's neighbours cannot change its bits.
    x = np.random.default_rng(8).uniform(0, 4, (6,) + shape).astype(np.float32)
    whole = batched(name, batch, 6, policy).run([x], keep=True)
    alone = batched(name, batch, 1, policy)
    for i in (0, 3, 5):
        one = alone.run([x[i:i + 1]], keep=True)
        pairs = [(got, full) for got, full in zip(one.values + one.refs, whole.values + whole.refs)
                 if isinstance(got, np.ndarray) and got.ndim and full.shape[0] == 6]
        assert len(pairs) >= 10  # every activation, lowered and reference
        for got, full in pairs:
            assert bits(got) == bits(full[i:i + 1])
    reordered = batched(name, batch, 6, policy).run([x[::-1]])
    assert bits(reordered.outputs[0]) == bits(whole.outputs[0][::-1])
    assert bits(reordered.reference[0]) == bits(whole.reference[0][::-1])


def test_scalar_constants_and_rounded_scalars_keep_rank_zero():
    # np.ascontiguousarray turns a 0-d array into a 1-d one; a loss is a scalar.
    from mplower.backend.executor import Program
    from mplower.ir.parser import parse

    module = parse("""func.func @main(%x: tensor<f32>) -> (tensor<f32>, tensor<bf16>) {
  %c = mp.constant {value = dense<0.5> : tensor<f32>} : () -> tensor<f32>
  %y = mp.mul %x, %c : (tensor<f32>, tensor<f32>) -> tensor<f32>
  %b = mp.cast %y : (tensor<f32>) -> tensor<bf16>
  return %y, %b : tensor<f32>, tensor<bf16>
}
""")
    y, b = Program(module).run([np.float32(3.0)], reference=False).outputs
    assert (y.shape, b.shape, float(y), float(b)) == ((), (), 1.5, 1.5)
