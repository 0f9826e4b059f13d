"""The compiled pooling and depthwise-conv kernels (issue 12) against numpy written out here:
the same bits as the numpy code they replace, for every thread count."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.opdef import OPS, check_attrs
from mplower.numerics import depthwise, pool

THREADS = sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)})


@pytest.fixture(params=THREADS, ids=lambda t: f"{t}thread")
def threads(request, monkeypatch):
    """Run with 1 and 2 threads, every size through the block-parallel path."""
    monkeypatch.setattr(pool, "_SERIAL_BELOW", 0)
    monkeypatch.setattr(pool, "_POOL3S2_SERIAL_BELOW", 0)
    monkeypatch.setattr(depthwise, "_SERIAL_BELOW", 0)
    before = numba.get_num_threads()
    numba.set_num_threads(request.param)
    yield request.param
    numba.set_num_threads(before)


def run_op(op: str, x: np.ndarray, **attrs) -> np.ndarray:
    opdef = OPS[op]
    return opdef.reference([x], check_attrs(opdef, attrs), None)[0]


def padded(x: np.ndarray, pad: tuple[int, int, int, int], fill=0) -> np.ndarray:
    pt, pl, pb, pr = pad
    return np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)), constant_values=fill)


def windows(x: np.ndarray, k, s) -> np.ndarray:
    return sliding_window_view(x, k, axis=(2, 3))[:, :, ::s[0], ::s[1]]


def random_pool_cases(rng: np.random.Generator, count: int):
    """Shapes, kernels up to 10 wide (numpy's pairwise sums start at 8), strides, paddings
    smaller than the kernel, and windows one output column wide."""
    cases = 0
    while cases < count:
        h, w = (int(v) for v in rng.integers(1, 13, 2))
        k = tuple(int(v) for v in rng.integers(1, 11, 2))
        s = tuple(int(v) for v in rng.integers(1, 4, 2))
        pad = tuple(int(rng.integers(0, k[i % 2])) for i in range(4))
        if k[0] <= h + pad[0] + pad[2] and k[1] <= w + pad[1] + pad[3]:
            cases += 1
            yield (2, 3, h, w), k, s, pad


def running_maximum(x: np.ndarray, k, s, pad, lowest=-np.inf) -> np.ndarray:
    """np.maximum folded over the kernel's shifted views of x padded with `lowest`, in
    row-major order."""
    xp = padded(x, pad, lowest)
    ho = (xp.shape[2] - k[0]) // s[0] + 1
    wo = (xp.shape[3] - k[1]) // s[1] + 1
    expect = None
    for i in range(k[0]):
        for j in range(k[1]):
            view = xp[:, :, i:i + s[0] * (ho - 1) + 1:s[0], j:j + s[1] * (wo - 1) + 1:s[1]]
            expect = view.copy() if expect is None else np.maximum(expect, view)
    return expect


def test_max_pool_is_the_running_np_maximum_over_window_taps_bit_for_bit(threads) -> None:
    """Today's kernel folded np.maximum over the kernel's shifted views in row-major order:
    ties between -0.0 and 0.0 take the later element, the first of two NaN payloads stays."""
    rng = np.random.default_rng(12)
    nans = np.array([0x7FC00001, 0xFFC00002], np.uint32).view(np.float32)
    values = np.concatenate([[0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, 0.5], nans]).astype(
        np.float32)
    for trial, (shape, k, s, pad) in enumerate(random_pool_cases(rng, 80)):
        for x in (rng.choice(values, size=shape), rng.choice(values, size=shape).astype(
                np.float64), rng.integers(-4, 4, shape)):
            lowest = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
            expect = running_maximum(x, k, s, pad, lowest)
            got = run_op("mp.max_pool2d", x, kernel=list(k), strides=list(s), padding=list(pad))
            assert got.dtype == expect.dtype and got.tobytes() == expect.tobytes(), (trial, k, s)


def test_3x3_stride_2_max_pool_folds_rows_with_the_bits_of_the_row_major_fold(threads) -> None:
    """The float32 3x3 stride-2 kernel folds each row's three columns, sixteen outputs at a
    time, then the three rows: against the row-major np.maximum fold on rows wider than a
    vector and narrower, odd and even, with every padding up to 2 on each side (the masked
    last step reads to the very end of the array), NaN payloads, signed zeros and
    infinities."""
    rng = np.random.default_rng(31)
    nans = np.array([0x7FC00001, 0xFFC00002, 0x7FA00003], np.uint32).view(np.float32)
    with np.errstate(invalid="ignore"):  # the NaNs go through float64 and back
        values = np.concatenate([[0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, 0.5, 2.0],
                                 nans]).astype(np.float32)
    shapes = [(2, 3, 111, 111), (1, 2, 112, 112), (2, 2, 27, 27), (1, 3, 13, 14), (1, 1, 3, 3),
              (1, 2, 5, 37), (2, 1, 34, 35), (1, 1, 2, 2), (1, 2, 40, 66), (1, 1, 9, 33)]
    for trial, shape in enumerate(shapes):
        for pad in [(0, 0, 0, 0), (1, 1, 1, 1), (0, 1, 1, 0), (2, 2, 2, 2), (1, 0, 0, 2)]:
            if 3 > shape[2] + pad[0] + pad[2] or 3 > shape[3] + pad[1] + pad[3]:
                continue
            x = rng.choice(values, size=shape)
            dense = rng.standard_normal(shape).astype(np.float32)
            for data in (x, dense):
                got = pool.max_pool2d(data, (3, 3), (2, 2), pad)
                expect = running_maximum(data, (3, 3), (2, 2), pad)
                assert got.dtype == np.float32 and got.tobytes() == expect.tobytes(), (trial,
                                                                                       pad)


def test_3x3_stride_2_avg_pool_sums_rows_with_the_bits_of_numpys_window_sums(threads) -> None:
    """The same kernel summing: each row's three columns from +0.0, then the three rows, over
    the count of input elements under the window, against numpy's sum over each window's two
    axes (pads included as zeros) divided by that count; magnitudes over 14 decades (so that
    another summation order shows), signed zeros (so that a sum of -0.0 where numpy's is +0.0
    shows), NaNs and infinities, every padding up to 2. A sum of two NaNs has a NaN, but
    which payload neither IEEE 754 nor numpy (the CPU's addition) nor LLVM (which may swap an
    addition's operands) pins: NaNs are compared as NaNs, every other output bit for bit."""
    rng = np.random.default_rng(32)
    nans = np.array([0x7FC00001, 0xFFC00002], np.uint32).view(np.float32)
    special = np.concatenate([[0.0, -0.0, np.inf, -np.inf], nans]).astype(np.float32)
    shapes = [(2, 3, 56, 56), (1, 2, 28, 28), (2, 2, 14, 14), (1, 3, 13, 14), (1, 1, 3, 3),
              (1, 2, 5, 37), (2, 1, 34, 35), (1, 1, 2, 2), (1, 2, 40, 66), (1, 1, 111, 111)]
    nans_seen = 0
    for trial, shape in enumerate(shapes):
        for pad in [(0, 0, 0, 0), (1, 1, 1, 1), (0, 1, 1, 0), (2, 2, 2, 2), (1, 0, 0, 2)]:
            if 3 > shape[2] + pad[0] + pad[2] or 3 > shape[3] + pad[1] + pad[3]:
                continue
            x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-7, 7, shape)).astype(
                np.float32)
            x[rng.random(shape) < 0.3] = -0.0
            with_special = x.copy()
            where = rng.random(shape) < 0.05
            with_special[where] = rng.choice(special, size=int(where.sum()))
            for data in (x, with_special):
                with np.errstate(invalid="ignore"):
                    sums = windows(padded(data, pad), (3, 3), (2, 2)).sum(axis=(-2, -1))
                ones = padded(np.ones((1, 1) + shape[2:], np.float32), pad)
                expect = sums / windows(ones, (3, 3), (2, 2)).sum(axis=(-2, -1))
                got = pool.avg_pool2d(data, (3, 3), (2, 2), pad)
                nan = np.isnan(expect)
                assert got.dtype == np.float32 and (np.isnan(got) == nan).all(), (trial, pad)
                assert got[~nan].tobytes() == expect[~nan].tobytes(), (trial, pad)
                nans_seen += int(nan.sum())
    assert nans_seen > 100


def test_avg_pool_is_numpys_window_sum_over_the_count_bit_for_bit(threads) -> None:
    """Today's reference: numpy's sum over each window's two axes, divided by the number of
    input elements under it (count_include_pad=0); pads included as zeros in the sum."""
    rng = np.random.default_rng(13)
    for trial, (shape, k, s, pad) in enumerate(random_pool_cases(rng, 80)):
        for dtype in (np.float32, np.float64):
            # Magnitudes over 14 decades, so that a different summation order shows.
            x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-7, 7, shape)).astype(dtype)
            x[rng.random(shape) < 0.1] = -0.0
            sums = windows(padded(x, pad), k, s).sum(axis=(-2, -1))
            ones = padded(np.ones((1, 1) + shape[2:], dtype), pad)
            expect = sums / windows(ones, k, s).sum(axis=(-2, -1))
            got = run_op("mp.avg_pool2d", x, kernel=list(k), strides=list(s), padding=list(pad))
            assert got.dtype == expect.dtype and got.tobytes() == expect.tobytes(), (trial, k, s)


def pairwise(values: list) -> np.floating:
    """numpy's pairwise summation (numpy/_core/src/umath/loops_utils.h.src), written out."""
    t = type(values[0])
    n = len(values)
    if n < 8:
        total = t(0)
        for v in values:
            total = t(total + v)
        return total
    if n <= 128:
        r = list(values[:8])
        i = 8
        while i < n - n % 8:
            r = [t(r[j] + values[i + j]) for j in range(8)]
            i += 8
        total = t(t(t(r[0] + r[1]) + t(r[2] + r[3])) + t(t(r[4] + r[5]) + t(r[6] + r[7])))
        for v in values[i:]:
            total = t(total + v)
        return total
    half = n // 2 - (n // 2) % 8
    return t(pairwise(values[:half]) + pairwise(values[half:]))


@pytest.mark.parametrize("shape,k,s,pad", [
    ((1, 2, 9, 9), (3, 3), (2, 2), (1, 1, 1, 1)),  # rows of 3, in order from +0
    ((1, 2, 5, 20), (2, 10), (1, 3), (0, 0, 0, 0)),  # rows of 10: eight partial sums
    ((1, 2, 7, 7), (7, 7), (1, 1), (0, 0, 0, 0)),  # one output column: one run of 49
    ((1, 1, 13, 12), (13, 12), (1, 1), (0, 0, 0, 0)),  # one run of 156: split in halves
])
def test_avg_pool_sums_in_the_documented_pairwise_order(shape, k, s, pad) -> None:
    rng = np.random.default_rng(14)
    x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-7, 7, shape)).astype(np.float32)
    got = pool.avg_pool2d(x, k, s, pad)
    win = windows(padded(x, pad), k, s)
    counts = windows(padded(np.ones((1, 1) + shape[2:], np.float32), pad), k, s).sum(
        axis=(-2, -1))[0, 0]
    for index in np.ndindex(*got.shape):
        w = win[index]
        if got.shape[3] == 1:
            total = np.float32(0 + pairwise(list(w.reshape(-1))))
        else:
            total = np.float32(0)
            for row in w:
                total = np.float32(total + pairwise(list(row)))
        assert got[index].tobytes() == (total / counts[index[2:]]).tobytes(), index


def depthwise_loop(x, w, bias, s, pad, d, relu):
    """acc = +0, then acc + x * w over (ky, kx) in row-major order, each rounded in the
    operands' precision (numpy's float arithmetic), then + bias and np.maximum(., 0)."""
    xp = padded(x, pad)
    o, _, kh, kw = w.shape
    m = o // x.shape[1]
    ho = (xp.shape[2] - d[0] * (kh - 1) - 1) // s[0] + 1
    wo = (xp.shape[3] - d[1] * (kw - 1) - 1) // s[1] + 1
    acc = np.zeros((x.shape[0], o, ho, wo), x.dtype)
    for ky in range(kh):
        for kx in range(kw):
            tap = xp[:, :, ky * d[0]:ky * d[0] + s[0] * (ho - 1) + 1:s[0],
                     kx * d[1]:kx * d[1] + s[1] * (wo - 1) + 1:s[1]]
            with np.errstate(invalid="ignore"):  # 0 * inf in the padding is NaN, as intended
                acc = acc + np.repeat(tap, m, axis=1) * w[:, 0, ky, kx].reshape(1, -1, 1, 1)
    if bias is not None:
        acc = acc + bias.reshape(1, -1, 1, 1)
    return np.maximum(acc, 0) if relu else acc


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("s,pad,d,m", [((1, 1), (1, 1, 1, 1), (1, 1), 1),
                                       ((2, 2), (1, 1, 1, 1), (1, 1), 1),
                                       ((2, 1), (0, 2, 1, 0), (2, 1), 1),
                                       ((1, 2), (2, 0, 0, 1), (1, 2), 3)])
def test_depthwise_conv_is_the_fixed_order_loop_and_the_gemm_conv_bit_for_bit(
        threads, dtype, s, pad, d, m) -> None:
    """mp.conv2d with groups = channels (and `m` output channels each) takes the direct
    kernel; its bits are the loop's and the grouped GEMM conv's (1 + 1 channels per group
    through the GEMM: the same (ky, kx) order)."""
    from mplower.numerics.conv import conv2d

    rng = np.random.default_rng(15)
    c = 5
    x = (rng.standard_normal((3, c, 9, 8)) * 10.0 ** rng.integers(-5, 5, (3, c, 9, 8))).astype(
        dtype)
    x[0, 0, 0, :3] = -0.0
    w = rng.standard_normal((c * m, 1, 3, 3)).astype(dtype)
    w[0, 0, 1, 1] = np.inf  # a zero of the padding times inf is NaN on both paths
    bias = rng.standard_normal(c * m).astype(dtype)
    attrs = {"strides": list(s), "padding": list(pad), "dilations": list(d), "groups": c}
    opdef = OPS["mp.conv2d"]
    for b, relu in ((None, False), (bias, False), (bias, True)):
        expect = depthwise_loop(x, w, b, s, pad, d, relu)
        got = conv2d(x, w, s, pad, d, c, bias=b, relu=relu)
        assert got.dtype == dtype and got.tobytes() == expect.tobytes()
        if b is not None and not relu:
            ref = opdef.reference([x, w, b], check_attrs(opdef, attrs), None)[0]
            assert ref.tobytes() == expect.tobytes()
    # The GEMM path: two channels per group, the second all zeros (x and w), sums the first
    # channel's taps in the same (ky, kx) order, then adds +0 products, which change nothing.
    x2 = np.repeat(x, 2, axis=1)
    x2[:, 1::2] = 0
    w2 = np.zeros((c * m, 2, 3, 3), dtype)
    w2[:, 0] = w[:, 0]
    gemm = conv2d(x2, w2, s, pad, d, c, bias=bias)
    assert gemm.tobytes() == depthwise_loop(x, w, bias, s, pad, d, False).tobytes()


@pytest.mark.parametrize("k,pad", [((3, 3), (1, 1, 1, 1)), ((5, 5), (2, 2, 2, 2)),
                                   ((3, 3), (0, 2, 2, 0)), ((1, 3), (0, 0, 0, 2)),
                                   ((3, 1), (2, 0, 0, 0)), ((2, 4), (1, 3, 0, 0))])
@pytest.mark.parametrize("stack", [1, 2 * 64, 4096])  # one, a few or all images per stack
def test_same_size_depthwise_convs_mask_the_columns_with_the_padded_bits(
        threads, monkeypatch, k, pad, stack) -> None:
    """Stride 1 with the output the input's size takes the unpadded-columns layout: a tap
    outside the plane's columns reads the next row's element there and adds +0, which gives
    the padding's bits. Infinities and NaN next to the border, -0 in the border columns."""
    rng = np.random.default_rng(21)
    n, c, h, wd, m = 3, 4, 7, 8, 2
    x = (rng.standard_normal((n, c, h, wd)) * 10.0 ** rng.integers(-5, 5, (n, c, h, wd))
         ).astype(np.float32)
    x[0, 0, :, 0], x[0, 1, :, -1] = np.inf, np.nan  # read through the wrap, then dropped
    x[1, 2, 3, :] = -np.inf
    x[2, :, :, :2] = -0.0
    w = rng.standard_normal((c * m, 1, *k)).astype(np.float32)
    w[1] = -w[1] * 0  # -0 and +0 weights: -0 products
    bias = rng.standard_normal(c * m).astype(np.float32)
    monkeypatch.setattr(depthwise, "_STACK", stack)
    channels = np.array([2, 0, 3, 1])
    for b, relu in ((None, False), (bias, True)):
        expect = depthwise_loop(x, w, b, (1, 1), pad, (1, 1), relu)
        got = depthwise.depthwise_conv2d(x, w, (1, 1), pad, (1, 1), bias=b, relu=relu)
        assert got.tobytes() == expect.tobytes()
        shuffled = depthwise.depthwise_conv2d(x, w, (1, 1), pad, (1, 1), bias=b, relu=relu,
                                              channels=channels)
        expect = depthwise_loop(x[:, channels], w, b, (1, 1), pad, (1, 1), relu)
        assert shuffled.tobytes() == expect.tobytes()


@pytest.mark.parametrize("stack", [144, 2 * 144, 4096])  # 1, 2 or all images per stack
def test_depthwise_results_do_not_depend_on_the_batch_or_the_stacking(monkeypatch,
                                                                       stack) -> None:
    rng = np.random.default_rng(16)
    x = rng.standard_normal((5, 6, 10, 10)).astype(np.float32)
    w = rng.standard_normal((6, 1, 3, 3)).astype(np.float32)
    monkeypatch.setattr(depthwise, "_STACK", stack)  # planes of 12x12 = 144 padded elements
    batch = depthwise.depthwise_conv2d(x, w, (1, 1), (1, 1, 1, 1), (1, 1))
    assert batch.tobytes() == depthwise_loop(x, w, None, (1, 1), (1, 1, 1, 1), (1, 1),
                                             False).tobytes()
    for i in range(5):
        one = depthwise.depthwise_conv2d(x[i:i + 1], w, (1, 1), (1, 1, 1, 1), (1, 1))
        assert one.tobytes() == batch[i:i + 1].tobytes()


@pytest.mark.parametrize("xdtype", [np.int8, np.uint8])
def test_integer_depthwise_conv_is_exact_and_its_epilogue_is_dequantize_add_relu(
        threads, xdtype) -> None:
    from mplower.numerics.conv import conv2d

    rng = np.random.default_rng(17)
    info = np.iinfo(xdtype)
    x = rng.integers(info.min, info.max + 1, (2, 4, 6, 6)).astype(xdtype)
    x[0, 0] = info.min if xdtype == np.int8 else info.max  # the extreme sums
    w = rng.integers(-128, 128, (8, 1, 3, 3)).astype(np.int8)
    w[0] = -128
    xp = padded(x.astype(np.int64), (1, 1, 1, 1))
    exact = np.zeros((2, 8, 6, 6), np.int64)
    for ky in range(3):
        for kx in range(3):
            exact += np.repeat(xp[:, :, ky:ky + 6, kx:kx + 6], 2, axis=1) * w[
                :, 0, ky, kx].astype(np.int64).reshape(1, -1, 1, 1)
    got = conv2d(x, w, (1, 1), (1, 1, 1, 1), (1, 1), 4)
    assert got.dtype == np.int64 and np.array_equal(got, exact)
    scale = (rng.random(8) * 1e-4).astype(np.float32)
    bias = rng.standard_normal(8).astype(np.float32)
    got = conv2d(x, w, (1, 1), (1, 1, 1, 1), (1, 1), 4, scale=scale, bias=bias, relu=True)
    # DequantizeLinear of the int32 sum, Add, Relu: numpy's float32 operations, in that order.
    expect = np.maximum(exact.astype(np.int32).astype(np.float32) * scale.reshape(1, -1, 1, 1)
                        + bias.reshape(1, -1, 1, 1), np.float32(0))
    assert got.dtype == np.float32 and got.tobytes() == expect.tobytes()
    assert (got == 0).any() and (got > 0).any()


def test_run_lowered_fuses_dequantize_bias_relu_into_depthwise_convs_with_the_same_bits() -> None:
    """The fused ops of the fuse pass (run_lowered) against the separate ops (run): an int8
    depthwise conv's dequantize, bias add and relu, and a float one's bias and relu."""
    from mplower.backend.executor import Program
    from mplower.ir.parser import parse

    def _fused(text: str):
        from mplower.pass_manager import PassContext
        from mplower.passes.fuse import Fuse

        module = parse(text, "m.ir")
        Fuse().run(module, PassContext())
        return module

    text = """func.func @main(%x: tensor<2x8x7x7xf32>, %w: tensor<16x1x3x3xf32>) -> (tensor<2x16x7x7xf32>, tensor<2x16x4x4xf32>) {
  %b = mp.constant {value = dense<[-0.5, 0.25, -2.0, 1.0, 0.0, -1.0, 0.5, -0.25, -0.5, 0.25, -2.0, 1.0, 0.0, -1.0, 0.5, -0.0]> : tensor<16xf32>} : () -> tensor<16xf32>
  %b3 = mp.reshape %b : (tensor<16xf32>) -> tensor<16x1x1xf32>
  %wq = mp.quantize %w {scale = 0.02, zero_point = 0 : i8} : (tensor<16x1x3x3xf32>) -> tensor<16x1x3x3xi8>
  %xq = mp.quantize %x {scale = 0.02, zero_point = 0 : ui8} : (tensor<2x8x7x7xf32>) -> tensor<2x8x7x7xui8>
  %c = mp.conv2d %xq, %wq {padding = [1, 1, 1, 1], groups = 8} : (tensor<2x8x7x7xui8>, tensor<16x1x3x3xi8>) -> tensor<2x16x7x7xi32>
  %d = mp.dequantize %c {scale = 0.0004, zero_point = 0 : i32} : (tensor<2x16x7x7xi32>) -> tensor<2x16x7x7xf32>
  %a = mp.add %d, %b3 : (tensor<2x16x7x7xf32>, tensor<16x1x1xf32>) -> tensor<2x16x7x7xf32>
  %r = mp.relu %a : (tensor<2x16x7x7xf32>) -> tensor<2x16x7x7xf32>
  %f = mp.conv2d %x, %w, %b {strides = [2, 2], padding = [1, 1, 1, 1], groups = 8} : (tensor<2x8x7x7xf32>, tensor<16x1x3x3xf32>, tensor<16xf32>) -> tensor<2x16x4x4xf32>
  %fr = mp.relu %f : (tensor<2x16x4x4xf32>) -> tensor<2x16x4x4xf32>
  return %r, %fr : tensor<2x16x7x7xf32>, tensor<2x16x4x4xf32>
}
"""
    program = Program(parse(text, "m.ir"))
    rng = np.random.default_rng(18)
    x = rng.random((2, 8, 7, 7)).astype(np.float32) * 5
    w = rng.standard_normal((16, 1, 3, 3)).astype(np.float32)
    # The separate ops (`run` of the unfused module), the fused ones in run_lowered.
    expect = program.run([x, w], reference=False).outputs
    program = Program(_fused(text))
    got = program.run_lowered(program.prepare_inputs([x, w]))
    assert [y.tobytes() for y in got] == [y.tobytes() for y in expect]
    assert [s.op for s in program._live] == ["mp.quantize", "mp.quantize", "mp.fused_conv2d",
                                              "mp.fused_conv2d"]
    assert all((y == 0).any() and (y > 0).any() for y in got)


def test_split_planes_put_every_window_tap_at_its_offset() -> None:
    """windows.split_plane + split_stack + tap_offsets (the layout the pooling and depthwise
    kernels compute on) against numpy's padded planes indexed directly: every tap of every
    window of every plane of a stack, for strides, dilations and paddings up to 3."""
    from mplower.numerics.windows import split_plane, split_shape, split_stack, tap_offsets

    rng = np.random.default_rng(19)
    for trial in range(60):
        h, w = (int(v) for v in rng.integers(1, 12, 2))
        k, s, d = (tuple(int(v) for v in rng.integers(1, 4, 2)) for _ in range(3))
        pad = tuple(int(v) for v in rng.integers(0, 4, 4))
        hp, wp = h + pad[0] + pad[2], w + pad[1] + pad[3]
        if d[0] * (k[0] - 1) >= hp or d[1] * (k[1] - 1) >= wp:
            continue
        ho, wo = (hp - d[0] * (k[0] - 1) - 1) // s[0] + 1, (wp - d[1] * (k[1] - 1) - 1) // s[1] + 1
        planes = int(rng.integers(1, 4))
        x = rng.standard_normal((planes, h, w)).astype(np.float32)
        hq, wq = split_shape((ho, wo), k, s, d)
        rows = np.full((s[0], planes * hq, wq * s[1]), -7.0, np.float32)
        cols = np.full((s[1], s[0] * planes * hq * wq), -7.0, np.float32)
        for g in range(planes):
            split_plane(x[g], rows, cols, hq, g, pad[0], pad[1])
        flat = split_stack(rows, cols)
        taps = tap_offsets(k, s, d, (hq, wq), planes)
        xp = np.pad(x, ((0, 0), (pad[0], pad[2]), (pad[1], pad[3])), constant_values=-7.0)
        for g, oy, ox, ky, kx in np.ndindex(planes, ho, wo, *k):
            got = flat[(g * hq + oy) * wq + ox + taps[ky * k[1] + kx]]
            assert got == xp[g, oy * s[0] + ky * d[0], ox * s[1] + kx * d[1]], (trial, k, s, d)


@pytest.mark.parametrize("s,pad", [((1, 1), (1, 1, 1, 1)), ((2, 2), (0, 0, 0, 0)),
                                   ((2, 2), (1, 1, 1, 1)), ((3, 2), (2, 1, 0, 1))])
def test_window_kernels_on_planes_larger_than_a_stack_keep_the_numpy_bits(threads, s,
                                                                          pad) -> None:
    """Planes of more padded elements than a stack (`_STACK`, one plane per work unit): 3x3
    max and average pooling and depthwise conv against numpy written out."""
    rng = np.random.default_rng(20)
    x = (rng.standard_normal((2, 3, 67, 66)) * 10.0 ** rng.integers(-5, 5, (2, 3, 67, 66))
         ).astype(np.float32)
    x[0, 0, :4, :4] = np.nan
    xp = padded(x, pad, -np.inf)
    expect = windows(xp, (3, 3), s).max(axis=(-2, -1))
    got = pool.max_pool2d(x, (3, 3), s, pad)
    assert got.tobytes() == expect.tobytes()
    x[0, 0, :4, :4] = 0.5
    sums = windows(padded(x, pad), (3, 3), s).sum(axis=(-2, -1))
    ones = padded(np.ones((1, 1, 67, 66), np.float32), pad)
    expect = sums / windows(ones, (3, 3), s).sum(axis=(-2, -1))
    assert pool.avg_pool2d(x, (3, 3), s, pad).tobytes() == expect.tobytes()
    w = rng.standard_normal((3, 1, 3, 3)).astype(np.float32)
    bias = rng.standard_normal(3).astype(np.float32)
    expect = depthwise_loop(x, w, bias, s, pad, (1, 1), True)
    got = depthwise.depthwise_conv2d(x, w, s, pad, (1, 1), bias=bias, relu=True)
    assert got.tobytes() == expect.tobytes()


def test_depthwise_rounding_and_requantize_refuse_what_they_do_not_apply_to() -> None:
    """rounding takes a float32 result in a round_to format other than the MX ones;
    requantize one scale and zero point per output channel in an integer format, and only a
    depthwise conv (conv2d refuses it elsewhere)."""
    from mplower.numerics.conv import conv2d

    x = np.ones((1, 2, 4, 4), np.float32)
    w = np.ones((2, 1, 3, 3), np.float32)
    geometry = ((1, 1), (1, 1, 1, 1), (1, 1))
    with pytest.raises(ValueError, match="rounding applies to a float32 result"):
        depthwise.depthwise_conv2d(x.astype(np.float64), w, *geometry, rounding="bf16")
    with pytest.raises(ValueError, match="rounding applies to a float32 result"):
        depthwise.depthwise_conv2d(x, w, *geometry, rounding="f4E2M1FN")
    scales = np.full(2, 0.5, np.float32)
    with pytest.raises(ValueError, match="one scale and zero point per output channel"):
        depthwise.depthwise_conv2d(x, w, *geometry, requantize=(scales[:1], [0], "i8"))
    with pytest.raises(ValueError, match="in an integer format"):
        depthwise.depthwise_conv2d(x, w, *geometry, requantize=(scales, [0, 0], "f8E4M3FN"))
    got = depthwise.depthwise_conv2d(x, w, *geometry, requantize=(scales, [0, 0], "i8"))
    assert np.array_equal(got[0, 0, 1:3, 1:3], np.full((2, 2), 9, np.float32))  # 9 / 0.5 fits
    with pytest.raises(ValueError, match="depthwise conv only"):
        conv2d(x, np.ones((2, 2, 3, 3), np.float32), *geometry, 1,
               requantize=(scales, [0, 0], "i8"))
