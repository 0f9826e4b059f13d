"""The runtime-speed kernels of issue 12 against independent references (numpy, math.erf)."""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.opdef import OPS, check_attrs
from mplower.numerics.gemm import integer_matmul
from mplower.numerics.special import SERIAL_BELOW, erf


def conv(*ins: np.ndarray, **attrs) -> np.ndarray:
    opdef = OPS["mp.conv2d"]
    return opdef.reference(list(ins), check_attrs(opdef, attrs), None)[0]


def conv_int64(x: np.ndarray, w: np.ndarray, stride: int, pad: int, dil: int,
               groups: int) -> np.ndarray:
    """Direct convolution in int64 with numpy's einsum, one group at a time."""
    x = np.pad(x.astype(np.int64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    w = w.astype(np.int64)
    o, cg, kh, kw = w.shape
    ho = (x.shape[2] - dil * (kh - 1) - 1) // stride + 1
    wo = (x.shape[3] - dil * (kw - 1) - 1) // stride + 1
    y = np.zeros((x.shape[0], o, ho, wo), np.int64)
    og = o // groups
    for g in range(groups):
        for i in range(kh):
            for j in range(kw):
                patch = x[:, g * cg:(g + 1) * cg, i * dil:i * dil + stride * (ho - 1) + 1:stride,
                          j * dil:j * dil + stride * (wo - 1) + 1:stride]
                y[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch,
                                                       w[g * og:(g + 1) * og, :, i, j])
    return y


@pytest.mark.parametrize("adtype", [np.int8, np.uint8])
def test_integer_matmul_splits_k_and_still_equals_numpys_int64_product(adtype) -> None:
    rng = np.random.default_rng(0)
    info = np.iinfo(adtype)
    a = rng.integers(info.min, info.max + 1, (2, 9, 3000)).astype(adtype)
    a[0, 0] = info.min if adtype == np.int8 else info.max  # the extreme row: -128 * -128 * K
    b = rng.integers(-128, 128, (3000, 7)).astype(np.int8)
    b[:, 0] = -128
    got = integer_matmul(a, b)
    assert got.dtype == np.int64
    assert np.array_equal(got, np.matmul(a.astype(np.int64), b.astype(np.int64)))
    assert got[0, 0, 0] == (-128 if adtype == np.int8 else 255) * -128 * 3000


def test_integer_matmul_of_wide_integers_falls_back_to_numpy() -> None:
    a = np.array([[1 << 20, 3]], np.int64)
    b = np.array([[1 << 20], [5]], np.int64)
    assert integer_matmul(a, b).tolist() == [[(1 << 40) + 15]]


@pytest.mark.parametrize("xdtype", [np.int8, np.uint8])
@pytest.mark.parametrize("stride,pad,dil,groups", [(1, 1, 1, 1), (2, 0, 1, 3), (1, 2, 2, 6)])
def test_int8_conv_is_exact_and_never_multiplies_in_int64(monkeypatch, stride, pad, dil,
                                                          groups, xdtype) -> None:
    rng = np.random.default_rng(1)
    info = np.iinfo(xdtype)
    x = rng.integers(info.min, info.max + 1, (2, 6 * 200, 7, 7)).astype(xdtype)  # K > 1024
    w = rng.integers(-128, 128, (12, 1200 // groups, 3, 3)).astype(np.int8)
    x[:, :, 3, 3], w[:, :, 1, 1] = info.min if xdtype == np.int8 else info.max, -128
    bias = rng.integers(-1000, 1000, 12).astype(np.int32)
    expect = conv_int64(x, w, stride, pad, dil, groups) + bias.reshape(1, -1, 1, 1)
    calls = []
    matmul = np.matmul

    def spy(a, b, *args, **kwargs):
        calls.append((np.asarray(a).dtype, np.asarray(b).dtype))
        return matmul(a, b, *args, **kwargs)

    monkeypatch.setattr(np, "matmul", spy)
    got = conv(x, w, bias, strides=[stride] * 2, padding=[pad] * 4, dilations=[dil] * 2,
               groups=groups)
    assert got.dtype == np.int64 and np.array_equal(got, expect)
    assert (np.dtype(np.int64), np.dtype(np.int64)) not in calls


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_erf_kernel_is_math_erf_rounded_once_bit_for_bit(dtype) -> None:
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(SERIAL_BELOW + 5) * 3,
                        [0.0, -0.0, 1e-30, -1e-38, 0.5, 0.84375, 5.9, -6.0, 30, np.inf,
                         -np.inf]]).astype(dtype)
    got = erf(x.reshape(-1, 16))
    expect = np.array([math.erf(float(v)) for v in x]).astype(dtype)
    assert got.dtype == dtype and got.shape == (x.size // 16, 16)
    assert got.reshape(-1).tobytes() == expect.tobytes()
    assert np.isnan(erf(np.array([np.nan], dtype)))[0]


@pytest.mark.determinism
def test_erf_kernel_bits_do_not_depend_on_thread_count() -> None:
    x = np.random.default_rng(3).standard_normal(4 * SERIAL_BELOW).astype(np.float32)
    threads = numba.get_num_threads()
    try:
        results = set()
        for n in range(1, min(2, numba.config.NUMBA_NUM_THREADS) + 1):
            numba.set_num_threads(n)
            results.add(erf(x).tobytes())
        assert len(results) == 1
    finally:
        numba.set_num_threads(threads)


# b 19 panels wide and read by 400 rows is read in place: the tiles are offered once; 7 panels
# wide it is packed: its panels are offered, then the tiles.
@pytest.mark.determinism
@pytest.mark.parametrize("width, offers", [(600, 1), (200, 2)])
def test_parallel_gemm_completes_on_the_caller_when_no_helper_thread_ever_runs(
        unscheduled_helpers, width, offers) -> None:
    """A helper the OS does not schedule (another process holds the core) must not stall
    the product: the caller claims every block, and the bits are those of one thread."""
    from mplower.numerics.gemm import matmul

    rng = np.random.default_rng(4)
    a = rng.standard_normal((2, 200, 300)).astype(np.float32)
    b = rng.standard_normal((300, width)).astype(np.float32)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = matmul(a, b).tobytes()
    finally:
        numba.set_num_threads(threads)
    if threads < 2:
        pytest.skip("needs two numba threads")
    assert matmul(a, b).tobytes() == one
    # Offered the work and never took it.
    assert len(unscheduled_helpers) == offers * (threads - 1)


def test_a_failing_block_is_raised_in_the_caller() -> None:
    from mplower.numerics.workers import run_blocks

    def kernel(start: int, stop: int) -> None:
        if start == 0:
            raise ValueError("block 0")

    with pytest.raises(ValueError, match="block 0"):
        run_blocks(kernel, 100)


def test_a_helper_woken_on_the_callers_cpu_moves_to_the_callers_other_cpus(monkeypatch) -> None:
    """A packing scheduler (sched_vcpu_pack) wakes the helper on the caller's CPU: the helper
    leaves it for the CPUs the caller may use, and every block is still done once."""
    import threading
    import time

    from mplower.numerics import workers

    if numba.get_num_threads() < 2:
        pytest.skip("needs two numba threads")
    on = {threading.get_ident(): 3}  # thread -> the CPU it runs on; all start on CPU 3
    moves: list[tuple[int, set[int]]] = []

    def getcpu() -> int:
        return on.get(threading.get_ident(), 3)

    def setaffinity(pid: int, cpus: set[int]) -> None:
        assert pid == 0  # only ever this thread
        moves.append((threading.get_ident(), set(cpus)))
        on[threading.get_ident()] = min(cpus)

    asked: list[int] = []

    def getaffinity(pid: int) -> set[int]:
        asked.append(pid)
        return {1, 3, 5}

    monkeypatch.setattr(workers, "_getcpu", getcpu)
    monkeypatch.setattr(workers.os, "sched_setaffinity", setaffinity)
    monkeypatch.setattr(workers.os, "sched_getaffinity", getaffinity)
    done: list[tuple[int, int]] = []

    def kernel(start: int, stop: int) -> None:
        done.append((start, stop))
        time.sleep(0.002)  # long enough for the helper to start and claim blocks too

    workers.run_blocks(kernel, 64)
    assert sorted(done) == [(64 * i // len(done), 64 * (i + 1) // len(done))
                            for i in range(len(done))]
    helpers = {t for t, _ in moves}
    assert threading.get_ident() not in helpers and len(helpers) >= 1
    assert asked == [threading.get_native_id()] * len(moves)  # the caller's allowed CPUs
    assert moves[0][1] == {1, 5}  # all but the caller's CPU 3
    # A helper already off the caller's CPU is left where it is.
    moves.clear()
    workers.run_blocks(kernel, 64)
    assert moves == []


@pytest.mark.determinism
def test_parallel_rounding_without_a_running_helper_is_numpys_f16_cast_with_exact_counts(
        unscheduled_helpers) -> None:
    from mplower.numerics import rounding

    x = (np.random.default_rng(5).standard_normal(3 * rounding.SERIAL_BELOW + 7) * 30000
         ).astype(np.float32)
    x[:3] = [np.nan, 70000, -1e-9]
    y, counts = rounding.round_to(x, "f16")
    with np.errstate(over="ignore"):
        expect = x.astype(np.float16).astype(np.float32)
    assert np.array_equal(y, expect, equal_nan=True)
    assert counts.overflow == int(np.count_nonzero(np.isinf(expect))) > 1000
    assert counts.nan == 1


def numpy_histograms(batches: list[np.ndarray], bins: int) -> tuple[np.ndarray, ...]:
    """The calibration histograms written with numpy in float64 (the pre-issue-12 code)."""
    x = np.concatenate([b.reshape(-1) for b in batches]).astype(np.float64)
    exp = int(np.frexp(np.abs(x).max())[1])
    index = np.floor(np.ldexp(np.abs(x), int(np.log2(bins)) - exp)).astype(np.int64)
    pos = np.bincount(index[x >= 0], minlength=bins)
    neg = np.bincount(index[x < 0], minlength=bins)
    nz = np.abs(x[x != 0])
    exps = np.bincount(np.frexp(nz)[1] + 160, minlength=300)
    return pos, neg, exps


def test_calibration_statistics_run_in_float32_with_numpys_float64_counts() -> None:
    import tracemalloc

    from mplower.lowering.calibration import TensorStats

    rng = np.random.default_rng(6)
    small = (rng.standard_normal(1000) * 1e-3).astype(np.float32)
    small[:4] = [0.0, -0.0, 1e-45, -1e-44]  # zeros and float32 subnormals
    big = (rng.standard_normal((64, 16384)) * 50).astype(np.float32)  # widens the range
    stats = TensorStats(bins=256)
    stats.add(small)
    # Compile the channel pass outside the measured window: numba's compiler allocates more
    # than the limit below when its cache is cold (a fresh clone).
    TensorStats(bins=256).add(big[:2, :16], channel_axis=0)
    tracemalloc.start()
    try:
        stats.add(big, channel_axis=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    pos, neg, exps = numpy_histograms([small, big], 256)
    assert np.array_equal(stats.pos, pos) and np.array_equal(stats.neg, neg)
    assert np.array_equal(stats.exponents, exps)
    assert stats.channel_absmax.dtype == np.float64
    assert np.array_equal(stats.channel_absmax, np.abs(big).max(axis=1).astype(np.float64))
    # No float64 copy (8 bytes an element): |x| for the channel maxima is the largest temporary.
    assert peak < 4.5 * big.size


def test_run_lowered_quantizes_a_constant_weight_once_with_the_same_bits(tmp_path,
                                                                         monkeypatch) -> None:
    from mplower.backend import executor, kernels
    from mplower.ir.parser import parse

    text = """func.func @main(%x: tensor<4x8xf32>) -> tensor<4x3xf32> {
  %w = mp.constant {value = dense<[[0.5, -1.0, 0.25], [1.5, 0.75, -0.5], [0.1, 0.2, 0.3],
    [-0.4, 0.5, -0.6], [0.7, -0.8, 0.9], [1.0, 1.1, -1.2], [0.3, 0.3, 0.3],
    [-0.9, 0.8, -0.7]]> : tensor<8x3xf32>} : () -> tensor<8x3xf32>
  %wq = mp.quantize %w {scale = 0.01} : (tensor<8x3xf32>) -> tensor<8x3xi8>
  %xq = mp.quantize %x {scale = 0.05} : (tensor<4x8xf32>) -> tensor<4x8xi8>
  %y = mp.matmul %xq, %wq : (tensor<4x8xi8>, tensor<8x3xi8>) -> tensor<4x3xi32>
  %d = mp.dequantize %y {scale = 0.0005} : (tensor<4x3xi32>) -> tensor<4x3xf32>
  return %d : tensor<4x3xf32>
}
"""
    calls = []
    make = kernels.quantizer  # each mp.quantize step's kernel (quant.quantizer)

    def counting(*args, **kwargs):
        run = make(*args, **kwargs)

        def counted(x):
            calls.append(x.shape)
            return run(x)
        return counted

    monkeypatch.setattr(kernels, "quantizer", counting)
    program = executor.Program(parse(text, "m.ir"))
    x = np.random.default_rng(7).standard_normal((4, 8)).astype(np.float32)
    expect = program.run([x], reference=False).outputs[0]
    calls.clear()
    prepared = program.prepare_inputs([x])
    first = program.run_lowered(prepared)[0]
    second = program.run_lowered(prepared)[0]
    assert calls == [(8, 3), (4, 8), (4, 8)]  # the weight once, the activation every run
    xq = np.clip(np.round(x / np.float32(0.05)), -128, 127)
    wq = np.clip(np.round(np.array(
        [[0.5, -1.0, 0.25], [1.5, 0.75, -0.5], [0.1, 0.2, 0.3], [-0.4, 0.5, -0.6],
         [0.7, -0.8, 0.9], [1.0, 1.1, -1.2], [0.3, 0.3, 0.3], [-0.9, 0.8, -0.7]],
        np.float32) / np.float32(0.01)), -128, 127)
    numpy_result = ((xq.astype(np.int64) @ wq.astype(np.int64)).astype(np.float32)
                    * np.float32(0.0005))
    assert first.tobytes() == second.tobytes() == expect.tobytes() == numpy_result.tobytes()


def test_max_pool_equals_numpys_window_max_including_signed_zeros_and_nan() -> None:
    from numpy.lib.stride_tricks import sliding_window_view

    opdef = OPS["mp.max_pool2d"]
    rng = np.random.default_rng(8)
    values = np.array([0.0, -0.0, 1.0, -1.0, np.nan, np.inf, -np.inf, 0.5], np.float32)
    for trial in range(60):
        x = rng.choice(values, size=(2, 3, int(rng.integers(4, 10)), int(rng.integers(4, 10))))
        k = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        s = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        pad = [int(rng.integers(0, 2)) for _ in range(2)]
        attrs = check_attrs(opdef, {"kernel": list(k), "strides": list(s),
                                    "padding": pad + pad})
        got = opdef.reference([x], attrs, None)[0]
        padded = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])),
                        constant_values=-np.inf)
        expect = sliding_window_view(padded, k, axis=(2, 3))[:, :, ::s[0], ::s[1]].max(
            axis=(-2, -1))
        assert got.tobytes() == expect.tobytes(), trial


@pytest.mark.parametrize("xdtype", [np.int8, np.uint8])
def test_int8_conv_epilogue_is_dequantize_add_relu_of_the_int32_sum_bit_for_bit(xdtype) -> None:
    from mplower.numerics.conv import conv2d

    rng = np.random.default_rng(8)
    info = np.iinfo(xdtype)
    x = rng.integers(info.min, info.max + 1, (2, 6 * 200, 5, 5)).astype(xdtype)  # K > 514
    w = rng.integers(-128, 128, (12, 400, 3, 3)).astype(np.int8)
    scale = (rng.random(12) * 1e-4).astype(np.float32)
    bias = rng.standard_normal(12).astype(np.float32)
    got = conv2d(x, w, (1, 1), (1, 1, 1, 1), (1, 1), 3, scale=scale, bias=bias, relu=True)
    # DequantizeLinear of the int32 sum, Add, Relu: numpy's float32 operations, in that order.
    q = conv_int64(x, w, 1, 1, 1, 3).astype(np.int32)
    expect = np.maximum(q.astype(np.float32) * scale.reshape(1, -1, 1, 1)
                        + bias.reshape(1, -1, 1, 1), np.float32(0))
    assert got.dtype == np.float32 and got.tobytes() == expect.tobytes()
    assert (got == 0).any() and (got > 0).any()


def test_float_conv_bias_and_relu_epilogue_are_numpys_add_and_maximum() -> None:
    from mplower.numerics.conv import conv2d

    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 6, 9, 9)).astype(np.float32)
    x[0, 0, 4, 4] = np.nan
    w = rng.standard_normal((10, 3, 3, 3)).astype(np.float32)
    bias = rng.standard_normal(10).astype(np.float32)
    bias[1] = -0.0
    w[1] = 0.0  # channel 1 is 0 + -0: +0 in IEEE; then relu
    plain = conv2d(x, w, (2, 1), (1, 0, 1, 2), (1, 1), 2)
    got = conv2d(x, w, (2, 1), (1, 0, 1, 2), (1, 1), 2, bias=bias, relu=True)
    expect = np.maximum(plain + bias.reshape(1, -1, 1, 1), np.float32(0))
    assert got.tobytes() == expect.tobytes()
    assert np.isnan(got).any()


def test_run_lowered_runs_dequantize_bias_and_relu_in_the_conv_with_the_same_bits() -> None:
    from mplower.backend.executor import Program
    from mplower.ir.parser import parse

    def _fused(text: str):
        from mplower.pass_manager import PassContext
        from mplower.passes.fuse import Fuse

        module = parse(text, "m.ir")
        Fuse().run(module, PassContext())
        return module

    text = """func.func @main(%x: tensor<2x16x6x6xf32>) -> (tensor<2x8x6x6xf32>, tensor<2x8x6x6xf32>) {
  %w = mp.constant {value = dense<0.125> : tensor<8x16x3x3xf32>} : () -> tensor<8x16x3x3xf32>
  %b = mp.constant {value = dense<[-0.5, 0.25, -2.0, 1.0, 0.0, -1.0, 0.5, -0.25]> : tensor<8xf32>} : () -> tensor<8xf32>
  %b3 = mp.reshape %b : (tensor<8xf32>) -> tensor<8x1x1xf32>
  %wq = mp.quantize %w {scale = dense<[0.01, 0.02, 0.01, 0.03, 0.01, 0.02, 0.01, 0.05]> : tensor<8xf32>, axis = 0} : (tensor<8x16x3x3xf32>) -> tensor<8x16x3x3xi8>
  %xq = mp.quantize %x {scale = 0.02, zero_point = 0 : ui8} : (tensor<2x16x6x6xf32>) -> tensor<2x16x6x6xui8>
  %c = mp.conv2d %xq, %wq {padding = [1, 1, 1, 1]} : (tensor<2x16x6x6xui8>, tensor<8x16x3x3xi8>) -> tensor<2x8x6x6xi32>
  %d = mp.dequantize %c {scale = dense<[0.0002, 0.0004, 0.0002, 0.0006, 0.0002, 0.0004, 0.0002, 0.001]> : tensor<8xf32>, axis = 1} : (tensor<2x8x6x6xi32>) -> tensor<2x8x6x6xf32>
  %a = mp.add %d, %b3 : (tensor<2x8x6x6xf32>, tensor<8x1x1xf32>) -> tensor<2x8x6x6xf32>
  %r = mp.relu %a : (tensor<2x8x6x6xf32>) -> tensor<2x8x6x6xf32>
  %f = mp.conv2d %x, %w, %b {padding = [1, 1, 1, 1]} : (tensor<2x16x6x6xf32>, tensor<8x16x3x3xf32>, tensor<8xf32>) -> tensor<2x8x6x6xf32>
  %fr = mp.relu %f : (tensor<2x8x6x6xf32>) -> tensor<2x8x6x6xf32>
  return %r, %fr : tensor<2x8x6x6xf32>, tensor<2x8x6x6xf32>
}
"""
    program = Program(parse(text, "m.ir"))
    x = np.random.default_rng(10).standard_normal((2, 16, 6, 6)).astype(np.float32)
    # The separate ops (`run` of the unfused module), the fused ones in run_lowered.
    expect = program.run([x], reference=False).outputs
    program = Program(_fused(text))
    got = program.run_lowered(program.prepare_inputs([x]))
    assert [y.tobytes() for y in got] == [y.tobytes() for y in expect]
    assert [s.op for s in program._live] == ["mp.quantize", "mp.fused_conv2d",
                                              "mp.fused_conv2d"]
    assert (got[0] == 0).any() and (got[0] > 0).any()


def test_histogram_of_a_relu_output_counted_in_parts_equals_numpys_counts() -> None:
    """Half zeros (counted apart from bin 0), -0.0, subnormals (frexp's second pass) and a
    tensor large enough to be counted in parts on the worker threads."""
    from mplower.lowering.calibration import TensorStats
    from mplower.numerics.histogram import SERIAL_BELOW

    rng = np.random.default_rng(11)
    x = np.maximum(rng.standard_normal(3 * SERIAL_BELOW + 5), 0).astype(np.float32)
    x[:6] = [-0.0, 1e-45, 3e-39, -2e-40, -0.0, 0.0]
    stats = TensorStats(bins=512)
    stats.add(x)
    pos, neg, exps = numpy_histograms([x], 512)
    assert np.array_equal(stats.pos, pos) and np.array_equal(stats.neg, neg)
    assert np.array_equal(stats.exponents, exps)


@pytest.mark.parametrize("dtype, axis", [("ui8", None), ("i8", 1), ("i8", None), ("ui8", 0)])
def test_a_prepared_quantizer_gives_the_codes_and_counts_of_quantize(dtype, axis) -> None:
    """quant.quantizer (the executor's per-op quantize: checks and tables made once) against
    quantize itself, with NaN, infinities and saturating values; another shape falls back."""
    from mplower.numerics.quant import quantize, quantizer

    rng = np.random.default_rng(16)
    x = (rng.standard_normal((3, 5, 70)) * 40).astype(np.float32)
    x[0, 0, :4] = [np.nan, np.inf, -np.inf, 1e9]
    n = x.shape[axis] if axis is not None else 1
    scale = (rng.random(n) * 0.3 + 0.05).astype(np.float32)
    zp = rng.integers(-5, 5, n) + (128 if dtype == "ui8" else 0)
    prepared = quantizer(x.shape, scale, zp, dtype, axis)
    for v in (x, x[..., :30]):  # the prepared shape, and another one
        got, counts = prepared(np.ascontiguousarray(v))
        expect, expect_counts = quantize(np.ascontiguousarray(v), scale, zp, dtype, axis)
        assert got.dtype == expect.dtype and got.tobytes() == expect.tobytes()
        assert counts == expect_counts and counts.overflow > 0
