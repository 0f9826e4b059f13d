"""Rounding kernels against ml_dtypes / numpy float16, bit for bit, and their counts."""

import math
import warnings
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mplower.numerics.formats import FORMATS
from mplower.numerics.rounding import (
    Counts,
    decode,
    encode,
    encode_counted,
    matmul_f16_accum,
    round_to,
)

REFERENCE = {
    "bf16": ml_dtypes.bfloat16,
    "f16": np.float16,
    "f8E4M3FN": ml_dtypes.float8_e4m3fn,
    "f8E5M2": ml_dtypes.float8_e5m2,
}
FMTS = sorted(REFERENCE)


def f32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def from_bits(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def cast(x: np.ndarray, t) -> np.ndarray:
    with warnings.catch_warnings():  # overflow / invalid-cast warnings are the point here
        warnings.simplefilter("ignore")
        return x.astype(t)


def reference_round(x: np.ndarray, fmt: str) -> np.ndarray:
    return cast(cast(x, REFERENCE[fmt]), np.float32)


def assert_same_floats(got: np.ndarray, want: np.ndarray) -> None:
    """NaN where the reference has NaN, and identical bits everywhere else."""
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    got_nan, want_nan = np.isnan(got), np.isnan(want)
    assert np.array_equal(got_nan, want_nan), \
        f"NaN mismatch at {np.flatnonzero(got_nan != want_nan)[:5]}"
    keep = ~want_nan
    bad = np.flatnonzero(got[keep].view(np.uint32) != want[keep].view(np.uint32))
    assert bad.size == 0, f"{bad.size} mismatches, e.g. input index {np.flatnonzero(keep)[bad[:5]]}"


def assert_same_codes(got: np.ndarray, want: np.ndarray, fmt: str) -> None:
    assert got.dtype == want.dtype
    t = REFERENCE[fmt]
    assert_same_floats(cast(got.view(t), np.float32), cast(want.view(t), np.float32))
    non_nan = ~np.isnan(cast(want.view(t), np.float32))
    assert np.array_equal(got[non_nan], want[non_nan])


def expected_counts(x: np.ndarray, y: np.ndarray) -> Counts:
    """Counts derived from the input and a reference result, independently of the kernel."""
    x_nan, y_nan = np.isnan(x), np.isnan(y)
    overflow = ~x_nan & ((np.isinf(y) & ~np.isinf(x)) | y_nan)
    underflow = ~x_nan & (x != 0) & (y == 0)
    return Counts(int(overflow.sum()), int(underflow.sum()), int(y_nan.sum()))


@pytest.fixture(scope="module")
def random_bits() -> np.ndarray:
    """2^24 float32 bit patterns, uniform over all 2^32 (every exponent, NaNs, subnormals)."""
    rng = np.random.default_rng(20240521)
    return rng.integers(0, 1 << 32, size=1 << 24, dtype=np.uint64).astype(np.uint32).view(
        np.float32)


@pytest.mark.parametrize("fmt", FMTS)
def test_round_to_matches_reference_on_random_bit_patterns(random_bits, fmt):
    got, counts = round_to(random_bits, fmt)
    want = reference_round(random_bits, fmt)
    assert_same_floats(got, want)
    assert counts == expected_counts(random_bits, want)


@pytest.mark.parametrize("fmt", FMTS)
def test_rounded_bits_of_the_fused_kernels_match_reference(random_bits, fmt):
    """rounded_bits, which conv tiles, depthwise sums and residual adds round with as they
    store (bf16 on its own shorter path), against ml_dtypes / numpy float16."""
    from numba import njit

    from mplower.numerics.rounding import _params, rounded_bits

    @njit
    def apply(bits, p):
        out = np.empty_like(bits)
        for i in range(bits.size):
            out[i] = rounded_bits(bits[i], p)
        return out

    x = np.concatenate([random_bits, special_values(fmt)])
    got = apply(x.view(np.uint32), _params(fmt, False)).view(np.float32)
    assert_same_floats(got, reference_round(x, fmt))
    if fmt == "bf16":  # its NaN: the canonical quiet NaN with the input's sign
        nan = np.isnan(x)
        signs = x[nan].view(np.uint32) & np.uint32(0x80000000)
        assert np.array_equal(got[nan].view(np.uint32), signs | np.uint32(0x7FC00000))


@pytest.mark.parametrize("fmt", FMTS)
def test_encode_matches_reference_on_random_bit_patterns(random_bits, fmt):
    x = random_bits[: 1 << 22]
    want = cast(x, REFERENCE[fmt]).view(np.uint16 if FORMATS[fmt].bits == 16 else np.uint8)
    assert_same_codes(encode(x, fmt), want, fmt)


@pytest.mark.parametrize("fmt", FMTS)
def test_decode_matches_reference_on_every_code(fmt):
    codes = np.arange(1 << FORMATS[fmt].bits).astype(f"uint{FORMATS[fmt].bits}")
    assert_same_floats(decode(codes, fmt), cast(codes.view(REFERENCE[fmt]), np.float32))


def special_values(fmt: str) -> np.ndarray:
    """Signed specials, format boundaries and ties, each with its f32 neighbours."""
    f = FORMATS[fmt]
    top_ulp = f.max_finite * f.eps / (2 - f.eps)  # spacing of the top binade
    base = [0.0, np.inf, 1.0, f.max_finite, f.min_normal, f.min_subnormal,
            f.max_finite + top_ulp / 2,  # round-to-max / round-to-overflow boundary
            f.min_subnormal / 2, 1.5 * f.min_subnormal, 2.5 * f.min_subnormal,  # ties
            f.min_normal - f.min_subnormal / 2,  # tie between largest subnormal and min normal
            1 + f.eps / 2, 1 + 1.5 * f.eps,  # ties at 1.0: down to even, up to even
            2.0 ** -126, 2.0 ** -149, 2.0 ** -127 + 2.0 ** -149,  # f32 min normal, subnormals
            np.finfo(np.float32).max]
    x = f32(base)
    with np.errstate(over="ignore"):  # the neighbour above f32 max is inf, which we want
        x = np.concatenate([x, np.nextafter(x, np.float32(np.inf)),
                            np.nextafter(x, np.float32(0))])
    x = np.concatenate([x, -x, from_bits([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF])])
    return x


@pytest.mark.parametrize("fmt", FMTS)
def test_round_to_matches_reference_on_special_values(fmt):
    x = special_values(fmt)
    got, counts = round_to(x, fmt)
    want = reference_round(x, fmt)
    assert_same_floats(got, want)
    assert counts == expected_counts(x, want)


@pytest.mark.parametrize(("fmt", "x", "want"), [
    ("f8E4M3FN", 464.0, 448.0),  # tie between 448 and the would-be 480 goes to even 448
    ("f8E4M3FN", float(np.nextafter(np.float32(464), np.float32(1e9))), np.nan),
    ("f8E4M3FN", np.inf, np.nan),
    ("f8E5M2", 61440.0, np.inf),  # tie between 57344 (odd) and 65536 goes up, to inf
    ("f8E5M2", float(np.nextafter(np.float32(61440), np.float32(0))), 57344.0),
    ("f16", 65520.0, np.inf),
    ("f16", float(np.nextafter(np.float32(65520), np.float32(0))), 65504.0),
    ("f16", 2.0 ** -25, 0.0),  # half the smallest subnormal ties to zero
    ("f16", 3 * 2.0 ** -25, 2.0 ** -23),  # 1.5 subnormals ties to the even 2
    ("bf16", 1 + 2.0 ** -8, 1.0),
    ("bf16", 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -6),
    ("bf16", 2.0 ** -134, 0.0),  # f32 subnormal at half bf16's smallest subnormal
    ("bf16", 3 * 2.0 ** -134, 2.0 ** -132),
])
def test_round_to_known_values(fmt, x, want):
    got = round_to(f32([x]), fmt)[0][0]
    assert (np.isnan(got) and np.isnan(want)) or got == np.float32(want)


@pytest.mark.parametrize(("fmt", "want"), [
    ("f16", Counts(overflow=2, underflow=3, nan=1)),
    ("f8E5M2", Counts(overflow=2, underflow=3, nan=1)),
    ("f8E4M3FN", Counts(overflow=4, underflow=3, nan=5)),  # ±1e5 and ±inf all become NaN
    ("bf16", Counts(overflow=0, underflow=1, nan=1)),  # 1e5 and 1e-10 are in bf16's range
])
def test_round_to_counts_on_constructed_input(fmt, want):
    half_sub = np.float32(FORMATS[fmt].min_subnormal / 2)  # ties to 0; one ulp more does not
    x = f32([1e5, -1e5, np.inf, -np.inf, np.nan, 1e-10, -1e-10, 0.0, -0.0, 1.0, half_sub,
             np.nextafter(half_sub, np.float32(1))])
    assert round_to(x, fmt)[1] == want


@pytest.mark.parametrize("fmt", FMTS + ["tf32"])
def test_saturate_clamps_overflow_and_inf_to_max_and_keeps_nan(fmt):
    top = FORMATS[fmt].max_finite
    big = np.finfo(np.float32).max  # beyond every format's max + half an ulp
    x = f32([np.inf, -np.inf, big, -big, np.nan, top, -top, 1.0])
    got, counts = round_to(x, fmt, saturate=True)
    want = f32([top, -top, top, -top, np.nan, top, -top, 1.0])
    assert_same_floats(got, want)
    assert counts == Counts(overflow=4, underflow=0, nan=1)


@pytest.mark.parametrize("fmt", ["f8E4M3FN", "f8E5M2"])
def test_saturating_encode_matches_onnx_saturate_cast(random_bits, fmt):
    # ONNX Cast(saturate=1) for float8: clip to ±max, then round (onnx.numpy_helper).
    x = random_bits[: 1 << 20]
    t = REFERENCE[fmt]
    top = float(ml_dtypes.finfo(t).max)
    want = cast(np.clip(x, -top, top), t).view(np.uint8)
    got, counts = encode_counted(x, fmt, saturate=True)
    assert_same_codes(got, want, fmt)
    assert counts.overflow == int((~np.isnan(x) & (np.abs(x) > top)
                                   & (np.abs(cast(x, t).astype(np.float32)) != top)).sum())


def tf32_reference(x: np.ndarray) -> np.ndarray:
    """TF32 rounding through float64: scale the value so its 11-bit significand is an integer
    part, round half to even with np.round, scale back."""
    with np.errstate(invalid="ignore"):  # signalling NaNs stay NaN, which is all we need
        x64 = x.astype(np.float64)
    finite = np.isfinite(x64) & (x64 != 0)
    _, e = np.frexp(np.where(finite, x64, 1.0))  # |x| = m * 2^e with m in [0.5, 1)
    quantum = np.ldexp(1.0, np.maximum(e - 11, -136))  # 2^-136: TF32's smallest subnormal
    r = np.where(finite, np.round(x64 / quantum) * quantum, x64)
    r = np.where(np.abs(r) > FORMATS["tf32"].max_finite, np.copysign(np.inf, r), r)
    return cast(r, np.float32)  # exact: r has 11 significant bits and f32's exponent range


def test_tf32_matches_float64_reference(random_bits):
    x = np.concatenate([random_bits[: 1 << 22], special_values("tf32")])
    got, counts = round_to(x, "tf32")
    want = tf32_reference(x)
    assert_same_floats(got, want)
    assert counts == expected_counts(x, want)


@pytest.mark.parametrize(("fmt", "nan_in", "nan_out"), [
    ("f16", 0x7F800001, 0x7F802000),  # numpy: payload bits that survive, else the lowest one
    ("f16", 0xFFBFFFFF, 0xFFBFE000),
    ("bf16", 0x7F800001, 0x7FC00000),  # ml_dtypes: canonical quiet NaN with the sign kept
    ("bf16", 0xFFBFFFFF, 0xFFC00000),
    ("tf32", 0xFF800001, 0xFFC00000),
    ("f8E4M3FN", 0xFF800000, 0xFFC00000),  # -inf has no e4m3fn encoding: -NaN
    ("f8E5M2", 0x7FBFFFFF, 0x7FC00000),
])
def test_nan_bit_patterns_follow_the_documented_rule(fmt, nan_in, nan_out):
    got = round_to(from_bits([nan_in]), fmt)[0]
    assert int(got.view(np.uint32)[0]) == nan_out


def test_round_to_f32_is_identity_counting_nans():
    x = from_bits([0x7FC00001, 0x00000001, 0x7F7FFFFF, 0xFF800000])
    got, counts = round_to(x, "f32")
    assert np.array_equal(got.view(np.uint32), x.view(np.uint32))
    assert counts == Counts(nan=1)


def test_round_to_keeps_shape_and_reads_strided_input():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4) * np.float32(1.01)
    got, _ = round_to(x[:, ::2, 1:], "bf16")
    assert got.shape == (2, 2, 3)
    assert_same_floats(got, reference_round(np.ascontiguousarray(x[:, ::2, 1:]), "bf16"))


def test_round_to_rejects_float64_and_unknown_formats():
    with pytest.raises(TypeError, match="float32"):
        round_to(np.zeros(3), "bf16")
    with pytest.raises(ValueError, match="handles"):
        round_to(f32([1.0]), "f8E4M3FNUZ")
    with pytest.raises(TypeError, match="uint8"):
        decode(np.zeros(3, np.uint16), "f8E5M2")


float32_arrays = hnp.arrays(np.float32, st.integers(0, 40),
                            elements=st.floats(width=32, allow_nan=True, allow_infinity=True))


@settings(max_examples=60, deadline=None)
@given(x=float32_arrays, fmt=st.sampled_from(FMTS + ["tf32"]), saturate=st.booleans())
def test_round_to_is_idempotent(x, fmt, saturate):
    once, _ = round_to(x, fmt, saturate)
    twice, counts = round_to(once, fmt, saturate)
    assert np.array_equal(once.view(np.uint32), twice.view(np.uint32))
    assert counts.overflow == 0 and counts.underflow == 0


@settings(max_examples=60, deadline=None)
@given(x=float32_arrays, fmt=st.sampled_from(FMTS), saturate=st.booleans())
def test_decode_of_encode_is_round_to(x, fmt, saturate):
    bits, counts = encode_counted(x, fmt, saturate)
    rounded, round_counts = round_to(x, fmt, saturate)
    assert np.array_equal(decode(bits, fmt).view(np.uint32), rounded.view(np.uint32))
    assert counts == round_counts


# --- fp16 accumulation -------------------------------------------------------------------

def f16_values(rng: np.random.Generator, shape, spread: float) -> np.ndarray:
    """Random f16-representable values over several binades."""
    x = rng.standard_normal(shape) * np.exp2(rng.uniform(-spread, spread, shape))
    return x.astype(np.float16).astype(np.float32)


def f16_accum_loop(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """numpy float16 accumulator: exact product (float64), sum rounded to f16 each step."""
    out = np.zeros((a.shape[0], b.shape[1]), dtype=np.float16)
    for i in range(a.shape[0]):
        for j in range(b.shape[1]):
            acc = np.float16(0)
            for k in range(a.shape[1]):
                acc = cast(np.float64(acc) + np.float64(a[i, k]) * np.float64(b[k, j]),
                           np.float16)
            out[i, j] = acc
    return out.astype(np.float32)


def test_matmul_f16_accum_matches_numpy_float16_loop():
    rng = np.random.default_rng(7)
    a, b = f16_values(rng, (5, 37), 6), f16_values(rng, (37, 4), 6)
    got = matmul_f16_accum(a, b)
    assert_same_floats(got, f16_accum_loop(a, b))
    assert not np.array_equal(got, (a @ b).astype(np.float16).astype(np.float32))


def test_matmul_f16_accum_sums_in_k_order_rounding_each_step():
    # 2048 + 1 is a tie between 2048 and 2050 and stays 2048, twice; 1 + 1 + 2048 would be 2050.
    a = f32([[2048.0, 1.0, 1.0], [1.0, 1.0, 2048.0]])
    assert matmul_f16_accum(a, np.ones((3, 1), np.float32)).tolist() == [[2048.0], [2050.0]]


def test_matmul_f16_accum_overflows_to_inf():
    a = f32([[60000.0, 60000.0, -60000.0]])
    assert matmul_f16_accum(a, np.ones((3, 1), np.float32))[0, 0] == np.inf


def exact_f16(v: Fraction) -> float:
    """Nearest-even f16 of an exact rational, chosen among the neighbours of a first guess."""
    if abs(v) >= 65520:  # at or past the tie between 65504 and the would-be 65536
        return math.copysign(math.inf, v)
    guess = cast(np.float64(float(v)), np.float16)
    with np.errstate(over="ignore"):  # a neighbour of ±65504 is ±inf, dropped below
        candidates = [guess, np.nextafter(guess, np.float16(np.inf)),
                      np.nextafter(guess, np.float16(-np.inf))]
    candidates = [c for c in candidates if np.isfinite(c)]
    best = min(candidates, key=lambda c: (abs(Fraction(float(c)) - v),
                                          int(np.array(c).view(np.uint16)) & 1))
    return float(best)


f16_finite = st.integers(0, 0x7BFF).flatmap(
    lambda m: st.sampled_from([m, m | 0x8000])).map(
    lambda bits: float(np.array(bits, np.uint16).view(np.float16)))


@settings(max_examples=300, deadline=None)
@given(s=f16_finite, p=f16_finite, q=f16_finite)
def test_matmul_f16_accum_rounds_the_exact_sum_once(s, p, q):
    # acc after k=0 is s; after k=1 it must be f16(s + p*q) of the exact, unrounded sum.
    got = matmul_f16_accum(f32([[s, p]]), f32([[1.0], [q]]))[0, 0]
    want = exact_f16(Fraction(s) + Fraction(p) * Fraction(q))
    assert got == want or (math.isnan(want) and np.isnan(got))


@pytest.mark.parametrize(("s", "p", "q"), [
    (-7.104873657226562e-05, -59.0, 220.0),
    (-3.0219554901123047e-05, -7.1796875, -3.15234375),
    (7.748603820800781e-07, 1.099609375, -320.0),
])
def test_matmul_f16_accum_does_not_round_the_sum_through_f32(s, p, q):
    # Found by search: for these, f16(f32(s + p*q)) is one f16 ulp off the exact f16(s + p*q).
    exact = exact_f16(Fraction(s) + Fraction(p) * Fraction(q))
    assert cast(np.float32(s) + np.float32(p) * np.float32(q), np.float16) != exact
    assert matmul_f16_accum(f32([[s, p]]), f32([[1.0], [q]]))[0, 0] == exact
