"""The implicit-GEMM convolution (mplower.numerics.conv) and the unit claiming it runs on
(mplower.numerics.workers.run_units).

Expected values are the im2col built with numpy (np.pad, sliding_window_view) times the
weights, summed as mplower promises with numpy elementwise operations
(conftest.sequential_matmul): k = (input channel, kernel row, kernel column) ascending, each
product and each sum rounded, never BLAS, never FMA.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from conftest import sequential_matmul
from numba import njit

from mplower.numerics import conv, conv_gemm, gemm
from mplower.numerics.conv import conv2d
from mplower.numerics.workers import claim, run_units


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def im2col(x: np.ndarray, kernel: tuple[int, int], strides, padding, dilations,
           groups: int) -> np.ndarray:
    """(N, G, Cg * KH * KW, Ho * Wo), row (c, ky, kx), from numpy alone."""
    pt, pl, pb, pr = padding
    x = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    (kh, kw), (sh, sw), (dh, dw) = kernel, strides, dilations
    win = np.lib.stride_tricks.sliding_window_view(x, (dh * (kh - 1) + 1, dw * (kw - 1) + 1),
                                                   axis=(2, 3))[:, :, ::sh, ::sw, ::dh, ::dw]
    n, c, ho, wo = win.shape[:4]
    return win.transpose(0, 1, 4, 5, 2, 3).reshape(n, groups, c // groups * kh * kw, ho * wo)


def sequential_conv(x, w, strides, padding, dilations, groups, bias=None, relu=False):
    o, cg, kh, kw = w.shape
    cols = im2col(x, (kh, kw), strides, padding, dilations, groups)
    wmat = w.reshape(groups, o // groups, cg * kh * kw)
    y = np.stack([np.concatenate([sequential_matmul(wmat[g], cols[i, g])
                                  for g in range(groups)]) for i in range(x.shape[0])])
    if bias is not None:
        y = y + bias.reshape(1, -1, 1)
    if relu:
        y = np.maximum(y, y.dtype.type(0))
    ho = (x.shape[2] + padding[0] + padding[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    return y.reshape(x.shape[0], o, ho, -1)


# (N, C, H, W), (O, KH, KW), strides, padding (top, left, bottom, right), dilations, groups:
# packed panels with strides, dilations and uneven padding, 1x1 stride-1 convs read in place
# (with a partial last panel, and padded), a strided 1x1, a kernel wider than tall, column
# strides 3 and 2 (the input's columns split into phases) with a column dilation of 3.
CASES = [((3, 6, 11, 13), (16, 3, 3), (2, 1), (1, 0, 2, 1), (1, 2), 2),
         ((2, 5, 9, 9), (20, 1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1),
         ((2, 8, 8, 8), (12, 1, 1), (1, 1), (1, 1, 1, 1), (1, 1), 1),
         ((2, 8, 9, 9), (24, 1, 1), (2, 2), (0, 0, 0, 0), (1, 1), 2),
         ((1, 3, 20, 17), (9, 3, 5), (2, 3), (2, 1, 0, 3), (1, 1), 1),
         ((4, 16, 7, 7), (64, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
         ((2, 4, 13, 12), (8, 3, 3), (1, 2), (0, 1, 1, 0), (2, 3), 1)]


def _threads():
    return range(1, min(2, numba.config.NUMBA_NUM_THREADS) + 1)


def _schedules(monkeypatch):
    """Each schedule in turn (the products as sized and forced onto the workers, on one and
    two threads), the thread count restored after."""
    threads = numba.get_num_threads()
    try:
        for serial_below in (gemm.SERIAL_BELOW, 0):
            monkeypatch.setattr(gemm, "SERIAL_BELOW", serial_below)
            for n in _threads():
                numba.set_num_threads(n)
                yield
    finally:
        numba.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[0] + c[1])))
def test_implicit_gemm_conv_equals_the_sequential_numpy_sum_bit_for_bit(monkeypatch, case,
                                                                         dtype) -> None:
    xs, (o, kh, kw), strides, padding, dilations, groups = case
    rng = np.random.default_rng(sum(xs) + o)
    x = rng.standard_normal(xs).astype(dtype)
    w = rng.standard_normal((o, xs[1] // groups, kh, kw)).astype(dtype)
    bias = rng.standard_normal(o).astype(dtype)
    plain = sequential_conv(x, w, strides, padding, dilations, groups)
    fused = sequential_conv(x, w, strides, padding, dilations, groups, bias, relu=True)
    for _ in _schedules(monkeypatch):
        got = conv2d(x, w, strides, padding, dilations, groups)
        assert got.dtype == dtype and bits(got) == bits(plain)
        got = conv2d(x, w, strides, padding, dilations, groups, bias=bias, relu=True)
        assert bits(got) == bits(fused)


@pytest.mark.parametrize("case", [c for c in CASES if c[1][1:] == (1, 1)],
                         ids=lambda c: "x".join(map(str, c[0] + c[1])))
def test_wide_1x1_convs_pack_their_panels_with_the_same_bits(monkeypatch, case) -> None:
    # Convs of conv_gemm._PACK_1X1_ROWS output channels or more copy their 1x1 panels instead of
    # reading them in place: the threshold lowered to 1 here, so that every 1x1 case does.
    xs, (o, kh, kw), strides, padding, dilations, groups = case
    rng = np.random.default_rng(sum(xs) + o + 2)
    x = rng.standard_normal(xs).astype(np.float32)
    w = rng.standard_normal((o, xs[1] // groups, kh, kw)).astype(np.float32)
    expect = sequential_conv(x, w, strides, padding, dilations, groups)
    monkeypatch.setattr(conv_gemm, "_PACK_1X1_ROWS", 1)
    for serial_below in (gemm.SERIAL_BELOW, 0):
        monkeypatch.setattr(gemm, "SERIAL_BELOW", serial_below)
        assert bits(conv2d(x, w, strides, padding, dilations, groups)) == bits(expect)


# 1x1 convs with spans of several full panels (64 panels or more in all, so that a span takes
# several): one image of 4096 pixels, two of 2025 (the panels run on across images: some
# spans lie in one image, some do not), two groups of three images.
SPAN_CASES = [((1, 8, 64, 64), 16, 1), ((2, 6, 45, 45), 24, 1), ((3, 12, 40, 40), 16, 2)]


@pytest.mark.parametrize("case", SPAN_CASES, ids=lambda c: "x".join(map(str, c[0])))
def test_deep_1x1_convs_pack_whole_spans_with_the_same_bits(monkeypatch, case) -> None:
    # A deep 1x1 conv whose input is beyond the caches (conv_gemm._PACK_1X1_DEEP, _PACK_1X1_BYTES;
    # both lowered here) copies each span's panels a plane at a time (`_convert_span`), as an
    # 8-bit input always does: the same sums as read in place.
    xs, o, groups = case
    rng = np.random.default_rng(sum(xs) + o)
    x = rng.standard_normal(xs).astype(np.float32)
    w = rng.standard_normal((o, xs[1] // groups, 1, 1)).astype(np.float32)
    bias = rng.standard_normal(o).astype(np.float32)
    expect = sequential_conv(x, w, (1, 1), (0, 0, 0, 0), (1, 1), groups, bias, relu=True)
    xq = rng.integers(0, 256, xs).astype(np.uint8)
    wq = rng.integers(-128, 128, w.shape).astype(np.int8)
    exact = integer_conv(xq, wq, (1, 1), (0, 0, 0, 0), (1, 1), groups)
    for deep, size in ((1 << 30, 1 << 62), (1, 0)):  # in place, then packed
        monkeypatch.setattr(conv_gemm, "_PACK_1X1_DEEP", deep)
        monkeypatch.setattr(conv_gemm, "_PACK_1X1_BYTES", size)
        for _ in _schedules(monkeypatch):
            got = conv2d(x, w, (1, 1), (0, 0, 0, 0), (1, 1), groups, bias=bias, relu=True)
            assert bits(got) == bits(expect)
            assert np.array_equal(conv2d(xq, wq, (1, 1), (0, 0, 0, 0), (1, 1), groups), exact)


def integer_conv(x, w, strides, padding, dilations, groups) -> np.ndarray:
    """The exact conv of integer operands: numpy's int64 im2col times the weights."""
    o, cg, kh, kw = w.shape
    cols = im2col(x.astype(np.int64), (kh, kw), strides, padding, dilations, groups)
    wmat = w.reshape(groups, o // groups, cg * kh * kw).astype(np.int64)
    y = np.matmul(wmat[None], cols).reshape(x.shape[0], o, -1)
    ho = (x.shape[2] + padding[0] + padding[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    return y.reshape(x.shape[0], o, ho, -1)


@pytest.mark.parametrize("activation", [np.uint8, np.int8])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[0] + c[1])))
def test_8bit_conv_packs_and_converts_the_integer_input_exactly(monkeypatch, case,
                                                                activation) -> None:
    # The padded input stays 8-bit and the panels convert it as they pack (a 1x1 stride-1
    # conv's panels too, which float inputs read in place); the weights as they are and as
    # IntegerWeights (their float32 copy made once). Extreme values in the first channels.
    xs, (o, kh, kw), strides, padding, dilations, groups = case
    rng = np.random.default_rng(sum(xs) + o + 1)
    info = np.iinfo(activation)
    x = rng.integers(info.min, int(info.max) + 1, xs).astype(activation)
    w = rng.integers(-128, 128, (o, xs[1] // groups, kh, kw)).astype(np.int8)
    x[:, 0], w[0] = info.min if activation == np.int8 else info.max, -128
    scale = (rng.random(o) * 1e-3).astype(np.float32)
    bias = rng.standard_normal(o).astype(np.float32)
    q = integer_conv(x, w, strides, padding, dilations, groups)
    fused = np.maximum(q.astype(np.float32) * scale.reshape(1, -1, 1, 1)
                       + bias.reshape(1, -1, 1, 1), np.float32(0))
    prepared = conv.IntegerWeights(w)
    assert prepared.float32.dtype == np.float32 and np.array_equal(prepared.float32, w)
    for _ in _schedules(monkeypatch):
        for weight in (w, prepared):
            got = conv2d(x, weight, strides, padding, dilations, groups)
            assert got.dtype == np.int64 and np.array_equal(got, q)
            got = conv2d(x, weight, strides, padding, dilations, groups, scale=scale,
                         bias=bias, relu=True)
            assert got.dtype == np.float32 and bits(got) == bits(fused)
    assert (fused == 0).any() and (fused > 0).any()


def test_integer_weights_chunk_is_the_longest_run_whose_sums_stay_exact() -> None:
    # Brute force over every run of every filter: the chunk fits, one more does not.
    rng = np.random.default_rng(14)
    for scale in (4, 40, 128):
        w = np.clip(rng.standard_normal((6, 40, 3, 3)) * scale, -128, 127).astype(np.int8)
        prepared = conv.IntegerWeights(w)
        flat = np.abs(w.reshape(6, -1).astype(np.int64))
        for x_bound in (255, 128, 1 << 14):
            def fits(c: int, x_bound: int = x_bound, flat: np.ndarray = flat) -> bool:
                return all(flat[r, k:k + c].sum() * x_bound <= gemm.F32_EXACT
                           for r in range(6) for k in range(flat.shape[1] - c + 1))
            c = prepared.chunk(x_bound)
            assert min(360, gemm.F32_EXACT // (x_bound * prepared.bound)) <= c <= 360
            assert fits(c)
            assert c == 360 or not fits(c + 1)


def test_a_chunk_at_the_limit_of_float32s_integers_is_exact() -> None:
    # Every product 255 * 101 is odd: a run one longer than the chunk would reach an odd sum
    # above 2^24, which float32 rounds. 4000 products: 6 chunks of 651, the sums in float64.
    x = np.full((1, 1000, 2, 2), 255, np.uint8)
    w = np.full((8, 1000, 2, 2), 101, np.int8)
    w[1:] = -101
    prepared = conv.IntegerWeights(w)
    assert prepared.chunk(255) == gemm.F32_EXACT // (255 * 101) == 651
    got = conv2d(x, prepared, (1, 1), (1, 1, 1, 1), (1, 1), 1)
    expect = integer_conv(x, w, (1, 1), (1, 1, 1, 1), (1, 1), 1)
    assert got.dtype == np.int64 and np.array_equal(got, expect)
    assert got[0, 0, 1, 1] == 4000 * 255 * 101 and got[0, 1, 1, 1] == -4000 * 255 * 101


def test_integer_weights_of_wider_types_give_the_exact_conv() -> None:
    # int64 weights of 8-bit values (an IR literal's): the bound, not the type, makes the
    # float32 copy; beyond float32's integers there is none, and the int64 path sums them.
    rng = np.random.default_rng(13)
    x = rng.integers(0, 256, (2, 8, 7, 7)).astype(np.uint8)
    for w in (rng.integers(-128, 128, (16, 8, 3, 3)),
              rng.integers(-2**40, 2**40, (16, 8, 3, 3))):
        prepared = conv.IntegerWeights(w)
        assert prepared.bound == np.abs(w).max() or prepared.bound == -w.min()
        assert (prepared.float32 is None) == (prepared.bound > gemm.F32_EXACT)
        expect = integer_conv(x, w, (1, 1), (1, 1, 1, 1), (1, 1), 1)
        got = conv2d(x, prepared, (1, 1), (1, 1, 1, 1), (1, 1), 1)
        assert got.dtype == np.int64 and np.array_equal(got, expect)
    for bad in (np.zeros((4, 2, 3, 3), np.float32), np.zeros((4, 18), np.int8)):
        with pytest.raises(ValueError, match="integer"):
            conv.IntegerWeights(bad)


def test_float16_operands_are_convolved_in_float32() -> None:
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 4, 6, 6)).astype(np.float16)
    w = rng.standard_normal((8, 4, 3, 3)).astype(np.float16)
    expect = sequential_conv(x.astype(np.float32), w.astype(np.float32), (1, 1), (1, 1, 1, 1),
                             (1, 1), 1)
    got = conv2d(x, w, (1, 1), (1, 1, 1, 1), (1, 1), 1)
    assert got.dtype == np.float32 and bits(got) == bits(expect)


def test_dense_conv_never_builds_the_im2col(monkeypatch) -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 8, 10, 10)).astype(np.float32)
    w = rng.standard_normal((16, 8, 3, 3)).astype(np.float32)
    expect = sequential_conv(x, w, (1, 1), (1, 1, 1, 1), (1, 1), 1)

    def refuse(*args, **kwargs):
        raise AssertionError("im2col materialized")

    for name in ("conv_windows", "matmul", "integer_matmul"):
        monkeypatch.setattr(conv, name, refuse)
    assert bits(conv2d(x, w, (1, 1), (1, 1, 1, 1), (1, 1), 1)) == bits(expect)


def test_implicit_int8_conv_sums_k_in_exact_chunks(monkeypatch) -> None:
    # |x| * |w| <= 255 * 128: float32 partial sums are exact for 514 products; K = 2700.
    rng = np.random.default_rng(8)
    x = rng.integers(0, 256, (2, 300, 6, 6)).astype(np.uint8)
    w = rng.integers(-128, 128, (16, 300, 3, 3)).astype(np.int8)
    x[0], w[0] = 255, -128  # output (0, 0, 2, 2) is -128 * 255 * 2700
    cols = im2col(x.astype(np.int64), (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1)
    expect = np.matmul(w.reshape(1, 16, -1).astype(np.int64), cols).reshape(2, 16, 6, 6)
    monkeypatch.setattr(conv, "integer_matmul", None)
    monkeypatch.setattr(gemm, "SERIAL_BELOW", 0)
    got = conv2d(x, w, (1, 1), (1, 1, 1, 1), (1, 1), 1)
    assert got.dtype == np.int64 and np.array_equal(got, expect)
    assert got[0, 0, 2, 2] == -128 * 255 * 2700  # far beyond float32's integers


@pytest.mark.determinism
def test_implicit_conv_completes_on_the_caller_when_no_helper_thread_ever_runs(
        monkeypatch, unscheduled_helpers) -> None:
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 16, 12, 12)).astype(np.float32)
    w = rng.standard_normal((32, 16, 3, 3)).astype(np.float32)
    expect = sequential_conv(x, w, (1, 1), (1, 1, 1, 1), (1, 1), 1)
    if numba.get_num_threads() < 2:
        pytest.skip("needs two numba threads")
    monkeypatch.setattr(gemm, "SERIAL_BELOW", 0)
    assert bits(conv2d(x, w, (1, 1), (1, 1, 1, 1), (1, 1), 1)) == bits(expect)
    assert len(unscheduled_helpers) == numba.get_num_threads() - 1


@njit(nogil=True)
def _squares(out, counter, units):
    done = 0
    while True:
        u = claim(counter)
        if u >= units:
            return done
        if out[u] != 0:
            raise ValueError("a unit claimed twice")
        out[u] = u * u
        done += 1


def test_run_units_claims_every_unit_exactly_once_on_any_thread_count() -> None:
    threads = numba.get_num_threads()
    try:
        for n in _threads():
            numba.set_num_threads(n)
            out = np.zeros(1000, np.int64)
            run_units(_squares, out.size, out)
            assert out.tolist() == [u * u for u in range(1000)]
    finally:
        numba.set_num_threads(threads)


def test_run_units_raises_a_units_error_in_the_caller() -> None:
    out = np.ones(10, np.int64)
    with pytest.raises(ValueError, match="a unit claimed twice"):
        run_units(_squares, out.size, out)


@pytest.mark.parametrize("kernel", [1, 3])
def test_every_count_of_rows_past_the_last_full_tile_gives_the_sequential_sum(monkeypatch,
                                                                              kernel) -> None:
    # O/G = 9 .. 15 leave 1 .. 7 rows past a full tile (stored in blocks of 4, 2 and 1 rows);
    # 81 pixels: two full panels and a partial one; a NaN runs through the fused relu.
    rng = np.random.default_rng(10)
    x = rng.standard_normal((2, 6, 9, 9)).astype(np.float32)
    x[1, 2, 4, 4] = np.nan
    pad = (kernel // 2,) * 4
    for _ in _schedules(monkeypatch):
        for rows in range(9, 16):
            w = rng.standard_normal((2 * rows, 3, kernel, kernel)).astype(np.float32)
            bias = rng.standard_normal(2 * rows).astype(np.float32)
            expect = sequential_conv(x, w, (1, 1), pad, (1, 1), 2, bias, relu=True)
            got = conv2d(x, w, (1, 1), pad, (1, 1), 2, bias=bias, relu=True)
            assert bits(got) == bits(expect), rows
            assert np.isnan(got).any() and (got == 0).any()
            plain = sequential_conv(x, w, (1, 1), pad, (1, 1), 2)
            assert bits(conv2d(x, w, (1, 1), pad, (1, 1), 2)) == bits(plain), rows


def test_int8_conv_dequantize_epilogue_in_the_register_store_is_numpys_float32_arithmetic(
        ) -> None:
    # K = 144: one exact float32 chunk, so the tiles sum straight into the result and apply
    # scale, bias and relu there (12 channels: a full tile and 4 rows past it).
    rng = np.random.default_rng(11)
    x = rng.integers(0, 256, (2, 16, 7, 7)).astype(np.uint8)
    w = rng.integers(-128, 128, (12, 16, 3, 3)).astype(np.int8)
    scale = (rng.random(12) * 1e-3).astype(np.float32)
    bias = rng.standard_normal(12).astype(np.float32)
    cols = im2col(x.astype(np.int64), (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1)
    q = np.matmul(w.reshape(1, 12, -1).astype(np.int64), cols).reshape(2, 12, 7, 7)
    expect = np.maximum(q.astype(np.float32) * scale.reshape(1, -1, 1, 1)
                        + bias.reshape(1, -1, 1, 1), np.float32(0))
    got = conv2d(x, w, (1, 1), (1, 1, 1, 1), (1, 1), 1, scale=scale, bias=bias, relu=True)
    assert got.dtype == np.float32 and bits(got) == bits(expect)
    assert (got == 0).any() and (got > 0).any()


@pytest.mark.parametrize("kernel", [1, 3])
def test_units_spanning_several_panels_give_the_sequential_sum(monkeypatch, kernel) -> None:
    # 4 images of 41x41 pixels: 53 panels each (the last one partial), 212 in all, enough for
    # work units of 6 consecutive panels (conv_gemm._SPAN, at least conv_gemm._UNITS units), the
    # last span of each image 5 panels long; 1x1 panels read in place, 3x3 panels packed.
    rng = np.random.default_rng(12)
    x = rng.standard_normal((4, 4, 41, 41)).astype(np.float32)
    w = rng.standard_normal((20, 4, kernel, kernel)).astype(np.float32)
    bias = rng.standard_normal(20).astype(np.float32)
    pad = (kernel // 2,) * 4
    expect = sequential_conv(x, w, (1, 1), pad, (1, 1), 1, bias, relu=True)
    assert 212 // conv_gemm._UNITS == 6 < conv_gemm._SPAN
    for _ in _schedules(monkeypatch):
        got = conv2d(x, w, (1, 1), pad, (1, 1), 1, bias=bias, relu=True)
        assert bits(got) == bits(expect)


@pytest.mark.parametrize("kernel", [1, 3])
def test_panels_running_on_into_the_next_images_give_the_sequential_sum(monkeypatch,
                                                                        kernel) -> None:
    """With one group, the panels run over the pixels of all images in turn (an image's
    last panel takes the next images' first pixels): 7x7 images (49 pixels, a panel spanning
    two images), 4x4 (16: three images in a panel), 1x1 (32 images in a panel) and 9x9;
    12 channels (a full tile and 4 rows past it), the sums copied to each image through the
    epilogue, rounded in the tiles and measured (amax), against numpy's sequential sum."""
    from mplower.numerics.rounding import round_to

    rng = np.random.default_rng(13)
    threads = numba.get_num_threads()
    try:
        for hw, n in ((7, 5), (4, 7), (1, 40), (9, 3)):
            x = rng.standard_normal((n, 6, hw, hw)).astype(np.float32) * 40
            x[n - 1, 1, hw - 1, hw - 1] = np.nan
            w = rng.standard_normal((12, 6, kernel, kernel)).astype(np.float32)
            bias = rng.standard_normal(12).astype(np.float32)
            pad = (kernel // 2,) * 4
            expect = sequential_conv(x, w, (1, 1), pad, (1, 1), 1, bias, relu=True)
            rounded = round_to(np.ascontiguousarray(expect), "bf16")[0]
            for serial_below in (gemm.SERIAL_BELOW, 0):
                monkeypatch.setattr(gemm, "SERIAL_BELOW", serial_below)
                for threads_now in _threads():
                    numba.set_num_threads(threads_now)
                    got = conv2d(x, w, (1, 1), pad, (1, 1), 1, bias=bias, relu=True)
                    assert bits(got) == bits(expect), (hw, n)
                    found = []
                    got = conv2d(x, w, (1, 1), pad, (1, 1), 1, bias=bias, relu=True,
                                 rounding="bf16", amax=found)
                    assert bits(got) == bits(rounded) and np.isnan(found[0]), (hw, n)
                    y = np.full((n, 15, hw, hw), 7.0, np.float32)
                    conv2d(x, w, (1, 1), pad, (1, 1), 1, bias=bias, relu=True, into=(y, 2))
                    assert bits(y[:, 2:14]) == bits(expect) and (y[:, :2] == 7).all() \
                        and (y[:, 14:] == 7).all(), (hw, n)
    finally:
        numba.set_num_threads(threads)
