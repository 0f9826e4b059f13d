"""Calibration: mergeable statistics, the range estimators, and the calibrate pass.

The central promise is determinism: the same samples give bit-identical ranges however they
are split into batches and in whatever order the batches come. Estimator tests use
distributions whose answer is known in closed form (uniform, a point mass plus outliers).
"""

from __future__ import annotations

import io
import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from mplower.backend.executor import reference_runner
from mplower.ir.parser import parse
from mplower.ir.printer import print_module
from mplower.lowering.calibration import (
    RANGE,
    Progress,
    TensorStats,
    channel_absmax_of,
    entropy_threshold,
    estimate_range,
    mse_threshold,
    percentile_threshold,
    range_of,
    value_attrs,
)
from mplower.pass_manager import PassContext, PassManager, parse_pipeline


def stats_of(chunks: list[np.ndarray], bins: int = 256) -> TensorStats:
    s = TensorStats(bins)
    for c in chunks:
        s.add(c, channel_axis=1 if c.ndim == 2 else None)
    return s


def same_stats(a: TensorStats, b: TensorStats) -> bool:
    return (a.exp == b.exp and a.min == b.min and a.max == b.max and a.count == b.count
            and np.array_equal(a.pos, b.pos) and np.array_equal(a.neg, b.neg)
            and np.array_equal(a.exponents, b.exponents)
            and np.array_equal(a.channel_absmax, b.channel_absmax))


def test_tensor_stats_are_identical_for_any_split_and_order():
    rng = np.random.default_rng(0)
    # Magnitudes grow across the data, so the histogram range widens (and rebins) on the way.
    x = (rng.standard_normal((42, 5)) * np.geomspace(1e-3, 1e3, 42)[:, None]).astype(np.float32)
    whole = stats_of([x])
    for parts in (3, 7):
        chunks = np.array_split(x, parts)
        for order in itertools.islice(itertools.permutations(range(parts)), 12):
            assert same_stats(stats_of([chunks[i] for i in order]), whole)
    # Merging separately gathered statistics is the same as adding the data in one go.
    left, right = stats_of([x[:20]]), stats_of([x[20:]])
    right.merge(left)
    assert same_stats(right, whole)


def test_histogram_bins_match_a_direct_count_on_the_final_grid():
    rng = np.random.default_rng(1)
    x = rng.uniform(-3, 5, 10_000)
    s = stats_of([x[:10], x[10:]], bins=64)
    assert s.exp == 3  # max |x| < 8 = 2**3
    width = 8 / 64
    expect_pos = np.bincount((x[x >= 0] / width).astype(int), minlength=64)
    expect_neg = np.bincount((-x[x < 0] / width).astype(int), minlength=64)
    assert np.array_equal(s.pos, expect_pos) and np.array_equal(s.neg, expect_neg)


@pytest.mark.parametrize("histogram", [True, False])
def test_relu_statistics_follow_exactly_from_those_of_its_input(histogram):
    # Negatives on a wider range than the positives (the input's grid is coarser than the
    # relu's), zeros of both signs, subnormals, and a channel that never goes positive.
    rng = np.random.default_rng(13)
    x = rng.standard_normal((6, 5, 7)) * np.array([0.5, 2.0, 1e-3, 3.0, 1.0])[:, None]
    x = x.astype(np.float32)
    x[0, 0, :4] = [-0.0, 0.0, 1e-45, -3e-39]
    x[:, 3] = -np.abs(x[:, 3]) * 100
    y = np.maximum(x, np.float32(0))
    counted, seen = TensorStats(256, histogram), TensorStats(256, histogram)
    for part in np.array_split(np.arange(6), 3):
        seen.add(x[part], channel_axis=1)
        counted.add(y[part], channel_axis=1)
    derived = seen.relu()
    assert same_stats(derived, counted)
    assert derived.tiny() == counted.tiny()
    assert (derived.min, derived.max) == (0.0, float(y.max()))
    assert derived.channel_absmax[3] == 0.0 and str(derived.channel_absmax[3]) == "0.0"


def test_range_of_data_with_negative_zero_is_the_same_in_any_order():
    # min(0.0, -0.0) keeps whichever came first: ranges are kept as +0.0, never -0.0.
    a = np.array([[-0.0], [1.0]], np.float32)
    b = np.array([[0.0], [2.0]], np.float32)
    for order in ((a, b), (b, a)):
        s = stats_of(list(order))
        assert (str(s.min), str(s.max)) == ("0.0", "2.0")
        assert str(estimate_range(s, "minmax")[0]) == "0.0"


def test_tiny_is_a_power_of_two_at_or_below_the_first_percentile():
    x = np.concatenate([np.full(5, 1e-6), np.full(995, 0.5), np.zeros(100)])
    s = stats_of([x.reshape(-1, 1)])
    assert s.tiny() == 0.5  # 1% of 1000 non-zero values is 10 > 5 tiny ones: the 10th is 0.5
    assert stats_of([np.zeros((3, 1))]).tiny() is None


def test_percentile_keeps_the_requested_share_of_magnitudes():
    hist = np.zeros(1000, np.int64)
    hist[:990] = 1  # 990 values spread over [0, 0.99); 10 outliers at the top
    hist[999] = 10
    assert percentile_threshold(hist, 0.001, 99.0) == pytest.approx(0.990)
    assert percentile_threshold(hist, 0.001, 100.0) == pytest.approx(1.0)


def test_entropy_and_percentile_clip_a_few_far_outliers():
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(200_000), [60.0, -55.0]])
    s = stats_of([x.reshape(-1, 1)], bins=2048)
    for method in ("entropy", "percentile"):
        lo, hi = estimate_range(s, method)
        assert 2.0 < hi < 20.0 and -20.0 < lo < -2.0, method  # well inside [-55, 60]
    assert estimate_range(s, "minmax") == (-55.0, 60.0)
    # MSE keeps them: clipping two values by ~50 costs more than 200k rounding errors gain.
    assert estimate_range(s, "mse")[1] > 30.0


def test_mse_threshold_minimizes_the_quantization_error_it_predicts():
    rng = np.random.default_rng(3)
    x = np.abs(rng.laplace(size=50_000))
    s = stats_of([x.reshape(-1, 1)], bins=1024)
    hist, width = s.pos + s.neg, s.bin_width
    t = mse_threshold(hist, width, 127)

    def error(threshold: float) -> float:
        step = threshold / 127
        return float(np.mean((x - np.minimum(np.rint(x / step), 127) * step) ** 2))

    assert error(t) < error(x.max())
    assert error(t) <= 1.05 * min(error(c) for c in np.linspace(t * 0.5, t * 2, 41))


def test_entropy_threshold_keeps_everything_when_it_fits_the_levels():
    hist = np.zeros(2048, np.int64)
    hist[:100] = 7
    assert entropy_threshold(hist, 0.5, 128) == 50.0


MODEL = """
func.func @main(%x: tensor<{b}x4xf32>) -> tensor<{b}x3xf32> {{
  %w = mp.constant {{value = dense<[[0.5, -1.0, 2.0], [1.5, 0.25, -0.5], [-2.0, 1.0, 0.75],
                                    [0.125, 3.0, -1.25]]> : tensor<4x3xf32>}} : () -> tensor<4x3xf32>
  %0 = mp.matmul %x, %w : (tensor<{b}x4xf32>, tensor<4x3xf32>) -> tensor<{b}x3xf32>
  %1 = mp.relu %0 : (tensor<{b}x3xf32>) -> tensor<{b}x3xf32>
  %2 = mp.tanh %1 : (tensor<{b}x3xf32>) -> tensor<{b}x3xf32>
  return %2 : tensor<{b}x3xf32>
}}
"""


def calibrated(tmp_path: Path, batch: int, data: np.ndarray, options: str = "") -> dict:
    """The calibration attributes of every value, keyed by value name."""
    path = tmp_path / f"calib_{batch}_{abs(hash(data.tobytes()))}.npz"
    np.savez(path, x=data)
    module = parse(MODEL.format(b=batch))
    PassManager(parse_pipeline(f"calibrate{{data={path} {options}}}")).run(module, PassContext(runner=reference_runner))
    f = module.function()
    values = [(a, 0) for a in f.args] + [(n, 0) for n in f.ops() if f.data(n)["types"]]
    return {f.value_name(v): dict(value_attrs(f, v)) for v in values}


@pytest.mark.parametrize("options", ["", "method=percentile percentile=99.0 bins=256",
                                     "method=entropy bins=512", "method=mse bins=256"])
def test_calibrate_ranges_are_bit_identical_for_1_3_7_batches_in_any_order(tmp_path, options):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((21, 4)) * [1, 3, 0.5, 8]).astype(np.float32)
    x[5, 3] = 40.0  # an outlier the clipping methods act on
    expect = calibrated(tmp_path, 21, x, options)
    assert expect["%0"][RANGE] != (0.0, 0.0)
    for batches in (3, 7):
        stack = x.reshape(batches, 21 // batches, 4)
        for order in ([*range(batches)][::-1], list(np.random.default_rng(batches).permutation(
                batches))):
            got = calibrated(tmp_path, 21 // batches, stack[order], options)
            assert got == expect, (batches, order)


def test_calibrate_records_ranges_channel_maxima_and_argument_ranges(tmp_path):
    x = np.array([[1.0, -2.0, 0.5, 4.0], [3.0, 0.0, -1.0, 2.0]], np.float32)
    attrs = calibrated(tmp_path, 2, x)
    assert attrs["%x"][RANGE] == (-2.0, 4.0)
    w = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5], [-2.0, 1.0, 0.75], [0.125, 3.0, -1.25]])
    y = x.astype(np.float64) @ w
    assert attrs["%0"][RANGE] == (float(np.float32(y.min())), float(np.float32(y.max())))
    assert attrs["%1"][RANGE][0] == 0.0
    assert "mp.channel_absmax" in attrs["%x"] and "mp.channel_absmax" not in attrs["%1"]
    assert "%w" not in attrs or RANGE not in attrs["%w"]  # weights are read by quantize


def test_calibrated_module_prints_and_parses_back(tmp_path):
    path = tmp_path / "c.npz"
    np.savez(path, x=np.arange(8, dtype=np.float32).reshape(2, 4))
    module = parse(MODEL.format(b=2))
    PassManager(parse_pipeline(f"calibrate{{data={path} method=mse bins=64}}")).run(
        module, PassContext(runner=reference_runner))
    text = print_module(module)
    again = parse(text)
    assert print_module(again) == text
    f = again.function()
    assert range_of(f, (f.args[0], 0)) == (0.0, 7.0)
    assert channel_absmax_of(f, (f.args[0], 0)).tolist() == [4.0, 5.0, 6.0, 7.0]


def test_calibrate_clipping_keeps_the_observed_extremes(tmp_path):
    x = np.random.default_rng(5).standard_normal((64, 4)).astype(np.float32)
    x[0, 0] = 100.0
    attrs = calibrated(tmp_path, 64, x, "method=percentile percentile=99.0 bins=1024")
    _lo, hi = attrs["%x"][RANGE]
    assert hi < 10.0 and attrs["%x"]["mp.observed"][1] == 100.0
    assert attrs["%x"]["mp.calib"] == "percentile"


@pytest.mark.parametrize("options, message", [
    ("", "calibrate needs data=CALIB.npz"),
    ("data=DATA method=kl", "unknown method 'kl'"),
    ("data=DATA bins=1000", "bins must be a power of two"),
    ("data=DATA group=-1", "group must be 0 (automatic) or more, got -1"),
    # (3, 4) would be three samples, padded (issue 33); (3, 5) fits no reading.
    ("data=WRONG", "expected one batch [2, 4], a stack [N, 2, 4] or samples [N, 4]"),
    ("data=MISSING", "does not exist"),
])
def test_calibrate_reports_bad_options_and_data(tmp_path, cli, options, message):
    (tmp_path / "m.ir").write_text(MODEL.format(b=2))
    np.savez(tmp_path / "d.npz", x=np.ones((2, 4), np.float32))
    np.savez(tmp_path / "w.npz", x=np.ones((3, 5), np.float32))
    options = (options.replace("DATA", str(tmp_path / "d.npz"))
               .replace("WRONG", str(tmp_path / "w.npz"))
               .replace("MISSING", str(tmp_path / "none.npz")))
    r = cli("opt", tmp_path / "m.ir", f"--pass=calibrate{{{options}}}")
    assert r.rc == 1 and message in r.err, r.err


def test_calibrate_rejects_nan_data_and_names_the_op_that_overflows(tmp_path, cli):
    """An infinity in the data is taken as it is (issue 32: attention masks); NaN data, and
    an op that makes inf from finite operands (the reference overflowing), are errors."""
    (tmp_path / "m.ir").write_text(MODEL.format(b=2).replace("mp.tanh", "mp.exp"))
    data = np.ones((2, 4), np.float32)
    data[1, 1] = np.nan
    np.savez(tmp_path / "d.npz", x=data)
    r = cli("opt", tmp_path / "m.ir", f"--pass=calibrate{{data={tmp_path / 'd.npz'}}}")
    assert r.rc == 1 and "argument %x: 1 values are NaN" in r.err, r.err
    np.savez(tmp_path / "d.npz", x=np.full((2, 4), 50.0, np.float32))  # exp(>88) overflows f32
    r = cli("opt", tmp_path / "m.ir", f"--pass=calibrate{{data={tmp_path / 'd.npz'}}}")
    assert r.rc == 1 and "m.ir:7:3" in r.err and "from finite operands" in r.err, r.err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_on_a_terminal_and_stays_quiet_elsewhere():
    tty = _Terminal()
    bar = Progress(4, "calibrate", stream=tty, delay=0.0)
    for _ in range(4):
        bar.update()
    bar.close()
    assert "calibrate [" in tty.getvalue() and "4/4" in tty.getvalue()
    assert tty.getvalue().endswith("\n")
    pipe = io.StringIO()
    quiet = Progress(4, "calibrate", stream=pipe, delay=0.0)
    quiet.update(4)
    quiet.close()
    assert pipe.getvalue() == ""


def test_estimate_range_of_a_one_sided_tensor_stays_one_sided():
    s = stats_of([np.abs(np.random.default_rng(6).standard_normal((1000, 1)))], bins=512)
    for method in ("minmax", "percentile", "entropy", "mse"):
        lo, hi = estimate_range(s, method)
        assert lo >= 0.0 and 0 < hi <= s.max and math.isfinite(hi), method


MLP = Path(__file__).resolve().parent.parent / "ir_examples" / "mlp.ir"


def calibrated_mlp(tmp_path: Path, samples: np.ndarray, batch: int) -> tuple[str, dict]:
    """The digits MLP (its batch size set to `batch`) after calibrate, smooth-quant and
    quantize on `samples` in batches of `batch`: the printed IR and each value's attributes."""
    path = tmp_path / f"mlp_{batch}_{abs(hash(samples.tobytes()))}.npz"
    np.savez(path, x=samples.reshape(-1, batch, samples.shape[-1]))
    module = parse(MLP.read_text().replace("tensor<32x", f"tensor<{batch}x"), str(MLP))
    module.path = str(MLP)
    PassManager(parse_pipeline(f"calibrate{{data={path}}},smooth-quant,quantize")).run(
        module, PassContext(runner=reference_runner))
    f = module.function()
    values = [(a, 0) for a in f.args] + [(n, 0) for n in f.ops() if f.data(n)["types"]]
    return print_module(module), {f.value_name(v): dict(value_attrs(f, v)) for v in values}


@pytest.mark.determinism
def test_calibrated_mlp_is_byte_identical_for_any_grouping_and_order_of_192_samples(tmp_path):
    # The fp32 reference that calibration observes sums each matmul in mplower's fixed order,
    # so a sample's values do not depend on the batch it is in or where it sits there.
    rng = np.random.default_rng(6)
    x = rng.uniform(0, 16, (192, 64)).astype(np.float32)
    text, attrs = calibrated_mlp(tmp_path, x, 32)
    assert "mp.channel_absmax" in text
    for order in (rng.permutation(192), np.arange(192)[::-1]):
        assert calibrated_mlp(tmp_path, x[order], 32)[0] == text
    for batch in (1, 64, 192):
        assert calibrated_mlp(tmp_path, x[rng.permutation(192)], batch)[1] == attrs, batch


def test_minmax_calibration_counts_no_magnitude_histogram_and_records_what_a_full_one_gives(
        tmp_path):
    from mplower.passes.calibrate import calibrate_function

    rng = np.random.default_rng(12)
    x = (rng.standard_normal((6, 4)) * [1, 3, 0.5, 8]).astype(np.float32)
    module = parse(MODEL.format(b=2))
    batches = [[b] for b in x.reshape(3, 2, 4)]
    lean = calibrate_function(module, None, batches, reference_runner, None, 256,
                              histogram=False)
    full = calibrate_function(module, None, batches, reference_runner, None, 256)
    assert all(s.pos.sum() == s.neg.sum() == 0 for s in lean.values())
    for v, s in full.items():
        t = lean[v]
        assert (t.min, t.max, t.count, t.tiny()) == (s.min, s.max, s.count, s.tiny())
        assert np.array_equal(t.exponents, s.exponents)
    assert calibrated(tmp_path, 2, x.reshape(3, 2, 4)) == calibrated(
        tmp_path, 6, x, "method=minmax bins=4096")


CNN = """module @cnn attributes {{mp.weights = "cnn.npz"}} {{
  func.func @main(%x: tensor<2x3x8x8xf32>) -> tensor<2x5xf32> {{
    %w = mp.constant {{name = "w"}} : () -> tensor<4x3x3x3xf32>
    %bias = mp.constant {{name = "bias"}} : () -> tensor<4xf32>
    %0 = mp.conv2d %x, %w, %bias {{strides = [1, 1], padding = [1, 1, 1, 1], dilations = [1, 1], groups = 1}} : (tensor<2x3x8x8xf32>, tensor<4x3x3x3xf32>, tensor<4xf32>) -> tensor<2x4x8x8xf32>
    %1 = mp.relu %0 : (tensor<2x4x8x8xf32>) -> tensor<2x4x8x8xf32>
    %2 = mp.max_pool2d %1 {{kernel = [2, 2], strides = [2, 2], padding = [0, 0, 0, 0]}} : (tensor<2x4x8x8xf32>) -> tensor<2x4x4x4xf32>
    %3 = mp.global_avg_pool %2 : (tensor<2x4x4x4xf32>) -> tensor<2x4x1x1xf32>
    %4 = mp.reshape %3 : (tensor<2x4x1x1xf32>) -> tensor<2x4xf32>
    %fc = mp.constant {{name = "fc"}} : () -> tensor<4x5xf32>
    %5 = mp.matmul %4, %fc : (tensor<2x4xf32>, tensor<4x5xf32>) -> tensor<2x5xf32>
    %6 = mp.relu %5 : (tensor<2x5xf32>) -> tensor<2x5xf32>
    %7 = mp.softmax %6 {{axis = {axis}}} : (tensor<2x5xf32>) -> tensor<2x5xf32>
    return %7 : tensor<2x5xf32>
  }}
}}
"""


def calibrated_cnn(tmp_path: Path, options: str, axis: int = 1) -> tuple[str, list]:
    """A conv, relu, pool and dense network calibrated on 10 batches of 2 images after
    assign-precision{policy=int8}: the printed module and the batch sizes the reference ran."""
    rng = np.random.default_rng(14)
    np.savez(tmp_path / "cnn.npz", w=rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
             bias=rng.standard_normal(4).astype(np.float32),
             fc=rng.standard_normal((4, 5)).astype(np.float32))
    np.savez(tmp_path / "data.npz", x=rng.standard_normal((10, 2, 3, 8, 8)).astype(np.float32))
    path = tmp_path / "cnn.ir"
    path.write_text(CNN.format(axis=axis))
    module = parse(path.read_text(), str(path))
    module.path = str(path)
    sizes = []

    def runner(m, func, weights):
        sizes.append(m.function(func).type_of((m.function(func).args[0], 0)).shape[0])
        return reference_runner(m, func, weights)

    PassManager(parse_pipeline(f"assign-precision{{policy=int8}},calibrate{{data="
                               f"{tmp_path / 'data.npz'} {options}}}")).run(
        module, PassContext(runner=runner))
    return print_module(module), sizes


@pytest.mark.parametrize("method", ["minmax", "percentile"])
def test_calibration_in_groups_of_batches_records_what_one_batch_at_a_time_does(
        tmp_path, method):
    one, sizes = calibrated_cnn(tmp_path, f"method={method} group=1")
    assert sizes == [2]
    assert "mp.channel_absmax" in one and "mp.calib" in one
    # 10 batches of 2: groups 3, 3, 3 and a last one of 1; 8 and a last 2; all at once.
    for group, ran in ((3, [6, 2]), (8, [16, 4]), (10, [20])):
        text, sizes = calibrated_cnn(tmp_path, f"method={method} group={group}")
        assert sizes == ran
        assert text == one, group


def test_calibration_runs_batch_by_batch_where_an_op_mixes_the_rows_of_a_batch(tmp_path):
    from mplower.passes.calibrate import grouped_module

    one, sizes = calibrated_cnn(tmp_path, "group=1", axis=0)
    assert grouped_module(parse((tmp_path / "cnn.ir").read_text(), str(tmp_path / "cnn.ir")),
                          None, 4) is None
    text, sizes = calibrated_cnn(tmp_path, "group=4", axis=0)
    assert sizes == [2] and text == one


def test_automatic_group_stacks_as_many_batches_as_keep_the_largest_value_within_32_mib():
    from mplower.passes.calibrate import auto_group

    # The largest value of MODEL is %x: batch x 4 float32s, 16 bytes a row.
    assert auto_group(parse(MODEL.format(b=2)).function()) == (32 << 20) // 32
    assert auto_group(parse(MODEL.format(b=1 << 20)).function()) == 2  # 16 MiB
    assert auto_group(parse(MODEL.format(b=1 << 21)).function()) == 1  # 32 MiB
    assert auto_group(parse(MODEL.format(b=(1 << 21) + 1)).function()) == 1  # over: still 1


def test_automatic_group_takes_one_size_for_every_group_where_a_divisor_allows():
    from mplower.passes.calibrate import auto_group

    # Up to ten batches of 3 MiB fit; 256 batches go in 32 eights (not 25 tens and a six),
    # 250 in tens, 257 (prime) in tens and a seven; fewer than a group in one group.
    f = parse(MODEL.format(b=3 << 16)).function()
    assert auto_group(f) == 10
    assert [auto_group(f, n) for n in (256, 250, 257, 7, 10, 12, 0)] == [8, 10, 10, 10, 10, 6, 10]


def test_reference_runner_hands_over_each_value_as_computed_and_keeps_none():
    import weakref

    module = parse(MODEL.format(b=2))
    f = module.function()
    x = np.array([[1.0, -2.0, 3.0, 0.5], [-1.0, 0.0, 2.0, 4.0]], np.float32)
    run = reference_runner(module)
    whole = run([x])
    seen: dict = {}
    assert run([x], lambda v, y: seen.setdefault(v, weakref.ref(y))) == {}
    assert list(seen) == list(whole)  # every value once, in program order
    results = [(n, 0) for n in f.ops() if f.op(n) not in ("mp.constant", "func.return")
               and f.data(n)["types"]]
    assert len(results) == 3 and all(seen[v]() is None for v in results)  # all released


def test_float64_and_integer_tensors_are_counted_as_their_float32_values_are():
    # float32 values, some subnormal, and -0.0: exactly the same numbers in float64.
    rng = np.random.default_rng(15)
    x = (rng.standard_normal((4, 6)) * 3).astype(np.float32)
    x[0, :3] = [-0.0, 1e-45, -2e-40]
    ints = rng.integers(-300, 300, (4, 6))
    for wide, narrow in ((x.astype(np.float64), x), (ints, ints.astype(np.float32))):
        assert same_stats(stats_of([wide[:2], wide[2:]]), stats_of([narrow[:2], narrow[2:]]))


def test_reference_runs_the_ops_on_constants_alone_once_and_keeps_their_values():
    text = MODEL.format(b=2).replace(
        "  %0 = mp.matmul %x, %w : (tensor<2x4xf32>, tensor<4x3xf32>)",
        "  %wt = mp.transpose %w {perm = [1, 0]} : (tensor<4x3xf32>) -> tensor<3x4xf32>\n"
        "  %w2 = mp.transpose %wt {perm = [1, 0]} : (tensor<3x4xf32>) -> tensor<4x3xf32>\n"
        "  %0 = mp.matmul %x, %w2 : (tensor<2x4xf32>, tensor<4x3xf32>)")
    module = parse(text)
    f = module.function()
    w2 = next((n, 0) for n in f.ops() if f.value_name((n, 0)) == "%w2")
    x = np.array([[1.0, -2.0, 3.0, 0.5], [-1.0, 0.0, 2.0, 4.0]], np.float32)
    run = reference_runner(module)
    first, second = run([x]), run([2 * x])
    assert second[w2] is first[w2]  # computed on the first call only
    assert np.array_equal(first[w2], np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5],
                                                [-2.0, 1.0, 0.75], [0.125, 3.0, -1.25]]))
    out = next(v for v in first if f.value_name(v) == "%2")
    assert np.array_equal(second[out], np.tanh(np.maximum(2 * x @ first[w2], 0)))


def test_minmax_statistics_in_one_pass_match_numpy_on_a_tensor_counted_in_parts():
    from mplower.numerics.histogram import SERIAL_BELOW

    rng = np.random.default_rng(16)
    x = (rng.standard_normal(3 * SERIAL_BELOW + 7) * 4).astype(np.float32)
    x[:6] = [-0.0, 1e-45, 3e-39, -2e-40, 0.0, -7e-39]
    x[-1] = -40.0  # the minimum in the last part
    lean = TensorStats(256, histogram=False)
    lean.add(x)
    nz = np.abs(x[x != 0]).astype(np.float64)
    assert (lean.min, lean.max) == (-40.0, float(x.max()))
    assert np.array_equal(lean.exponents, np.bincount(np.frexp(nz)[1] + 160, minlength=300))
    assert lean.side_exponents[1].sum() == np.count_nonzero(x < 0)
    x[SERIAL_BELOW] = np.nan
    x[5] = np.inf
    x[6] = -np.inf
    stats = TensorStats(256, histogram=False)
    stats.add(x)  # over the finite values; the others counted apart (issue 32)
    finite = TensorStats(256, histogram=False)
    finite.add(x[np.isfinite(x)])
    assert stats.nonfinite.tolist() == [1, 1, 1] and not finite.has_nonfinite
    assert (stats.min, stats.max, stats.count) == (finite.min, finite.max, finite.count)
    assert np.array_equal(stats.side_exponents, finite.side_exponents)


@pytest.mark.parametrize("shape,axis", [((2, 5, 7, 3), 1), ((3, 300, 40, 40), 1),
                                        ((64, 9), -1), ((4, 6), 0)])
def test_channel_extremes_come_from_the_summary_pass_and_equal_numpys(shape, axis) -> None:
    from mplower.numerics.histogram import channel_summary, tensor_summary

    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * 8).astype(np.float32)
    flat = x.reshape(-1)
    flat[::7] = 0.0
    flat[1::11] = -0.0
    flat[2::13] = np.float32(2e-42)  # subnormal: frexp's second pass
    expect_exps, got_exps = np.zeros((2, 300), np.int64), np.zeros((2, 300), np.int64)
    lo, hi, bad = tensor_summary(x, expect_exps, -160)
    got = channel_summary(x, axis, got_exps, -160)
    assert got[:3] == (lo, hi, bad) and bad == 0
    assert np.array_equal(got_exps, expect_exps)
    a = axis % x.ndim
    other = tuple(i for i in range(x.ndim) if i != a)
    assert got[3].dtype == got[4].dtype == np.float64
    assert np.array_equal(got[3], x.min(axis=other).astype(np.float64))
    assert np.array_equal(got[4], x.max(axis=other).astype(np.float64))
    x.reshape(-1)[-1] = np.nan
    assert channel_summary(x, axis, got_exps, -160)[2] == 1
