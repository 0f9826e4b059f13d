"""The MX element types (f6E2M3FN, f6E3M2FN, f4E2M1FN) and the E8M0 scale type: rounding,
encoding and decoding against ml_dtypes bit for bit, and their counts (benchmarks/rounding.py
--sweep checks all 2^32 inputs; these are samples of it)."""

import warnings

import ml_dtypes
import numpy as np
import pytest

from mplower.numerics.formats import FORMATS
from mplower.numerics.rounding import Counts, decode, encode, encode_counted, round_to

REFERENCE = {
    "f6E2M3FN": ml_dtypes.float6_e2m3fn,
    "f6E3M2FN": ml_dtypes.float6_e3m2fn,
    "f4E2M1FN": ml_dtypes.float4_e2m1fn,
    "f8E8M0FNU": ml_dtypes.float8_e8m0fnu,
}
ELEMENTS = ["f6E2M3FN", "f6E3M2FN", "f4E2M1FN"]


def cast(x: np.ndarray, t) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return x.astype(t)


def bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def expected_counts(x: np.ndarray, want: np.ndarray, fmt: str) -> Counts:
    """The counts the module docstring defines, from the input and ml_dtypes' result."""
    x_nan, w_nan = np.isnan(x), np.isnan(want)
    underflow = int((~x_nan & (x != 0) & (want == 0)).sum())
    info = ml_dtypes.finfo(REFERENCE[fmt])
    with np.errstate(invalid="ignore"):
        if fmt == "f8E8M0FNU":  # positive values too large for 2^127 come out NaN
            return Counts(int(((x > 0) & w_nan).sum()), underflow, int(w_nan.sum()))
        # beyond the midpoint between max and the next power of two (ties round away from max)
        edge = (float(info.max) + 2.0 ** info.maxexp) / 2
        over = int((~x_nan & (np.abs(x.astype(np.float64)) >= edge)).sum())
    return Counts(over, underflow, int(x_nan.sum()))


@pytest.fixture(scope="module")
def sample() -> np.ndarray:
    """2^22 uniform bit patterns plus every pattern within 2^12 of each E8M0 and element edge."""
    rng = np.random.default_rng(14)
    random = rng.integers(0, 1 << 32, size=1 << 22, dtype=np.uint64).astype(np.uint32)
    edges = [0, 0x00400000, 0x00600000, 0x00800000, 0x7F000000, 0x7F400000, 0x7F800000,
             0x7FC00000, 0x3F400000, 0x3FC00000]
    for f in ELEMENTS:
        info = ml_dtypes.finfo(REFERENCE[f])
        edges += [int(bits(v)) for v in (info.max, (float(info.max) + 2.0 ** info.maxexp) / 2,
                                         info.smallest_subnormal / 2, info.smallest_normal)]
    near = (np.array(edges, np.int64)[:, None] + np.arange(-4096, 4096)).reshape(-1)
    near = near[(near >= 0) & (near < 1 << 31)].astype(np.uint32)
    return np.concatenate([random, near, near | np.uint32(0x80000000)]).view(np.float32)


@pytest.mark.parametrize("fmt", sorted(REFERENCE))
def test_round_to_mx_format_equals_ml_dtypes_bit_for_bit_with_counts(sample, fmt):
    got, counts = round_to(sample, fmt)
    want = cast(cast(sample, REFERENCE[fmt]), np.float32)
    assert np.array_equal(bits(got), bits(want))  # NaN patterns included
    assert counts == expected_counts(sample, want, fmt)


@pytest.mark.parametrize("fmt", sorted(REFERENCE))
def test_encode_and_decode_mx_format_equal_ml_dtypes(sample, fmt):
    want = cast(sample, REFERENCE[fmt]).view(np.uint8)
    got, counts = encode_counted(sample, fmt)
    assert np.array_equal(got, want)
    assert counts == round_to(sample, fmt)[1]
    codes = np.arange(1 << 8 if fmt == "f8E8M0FNU" else 1 << FORMATS[fmt].bits, dtype=np.uint8)
    assert np.array_equal(bits(decode(codes, fmt)),
                          bits(cast(codes.view(REFERENCE[fmt]), np.float32)))


def test_round_to_mx_uses_the_parallel_path_identically(sample):
    x = np.tile(sample[: 1 << 18], 3)  # above SERIAL_BELOW: the blocked path
    for fmt in REFERENCE:
        got, counts = round_to(x, fmt)
        one, c1 = round_to(x[: 1 << 18], fmt)
        assert np.array_equal(bits(got), bits(np.tile(one, 3)))
        assert counts == Counts(3 * c1.overflow, 3 * c1.underflow, 3 * c1.nan)


@pytest.mark.parametrize(("fmt", "x", "want"), [
    ("f4E2M1FN", 6.9, 6.0),  # rounds to the would-be 8, clamps to max (no inf)
    ("f4E2M1FN", 5.0, 4.0),  # tie between 4 (even mantissa) and 6
    ("f4E2M1FN", 0.25, 0.0),  # half the smallest subnormal ties to zero
    ("f4E2M1FN", np.inf, 6.0),
    ("f6E3M2FN", 30.0, 28.0),
    ("f6E2M3FN", -1e9, -7.5),
    ("f8E8M0FNU", 3.0, 4.0),  # ties round up
    ("f8E8M0FNU", 0.75, 1.0),
    ("f8E8M0FNU", 2.0 ** -130, 2.0 ** -127),  # no zero, no subnormals
    ("f8E8M0FNU", 1.5 * 2.0 ** -127, 2.0 ** -126),
])
def test_round_to_mx_known_values(fmt, x, want):
    assert round_to(np.array([x], np.float32), fmt)[0][0] == np.float32(want)


@pytest.mark.parametrize("fmt", ELEMENTS)
def test_nan_becomes_a_zero_of_the_opposite_sign_and_is_counted(fmt):
    got, counts = round_to(np.array([np.nan, -np.nan, 1.0], np.float32), fmt)
    assert bits(got).tolist() == [0x80000000, 0, 0x3F800000]
    assert counts == Counts(nan=2)


def test_e8m0_zero_negative_and_inf_are_nan_and_saturate_clamps_only_the_top():
    x = np.array([0.0, -0.0, -2.0, np.inf, 2.0 ** 127 * 1.5, 1.0], np.float32)
    got, counts = round_to(x, "f8E8M0FNU")
    assert np.isnan(got[:5]).all() and got[5] == 1.0
    assert counts == Counts(overflow=2, underflow=0, nan=5)
    got, counts = round_to(x, "f8E8M0FNU", saturate=True)
    assert np.isnan(got[:3]).all() and got[3:].tolist() == [2.0 ** 127, 2.0 ** 127, 1.0]
    assert counts == Counts(overflow=2, underflow=0, nan=3)
    assert encode(x, "f8E8M0FNU", saturate=True).tolist() == [255, 255, 255, 254, 254, 127]
