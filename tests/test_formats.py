"""The FORMATS table against the libraries that define the same formats (ml_dtypes, numpy)."""

import ml_dtypes
import numpy as np
import pytest

from mplower.numerics.formats import FLOAT_FORMATS, FORMATS, INT_FORMATS

FLOAT_REFERENCES = {
    "f64": np.float64,
    "f32": np.float32,
    "f16": np.float16,
    "bf16": ml_dtypes.bfloat16,
    "f8E4M3FN": ml_dtypes.float8_e4m3fn,
    "f8E5M2": ml_dtypes.float8_e5m2,
    "f6E2M3FN": ml_dtypes.float6_e2m3fn,
    "f6E3M2FN": ml_dtypes.float6_e3m2fn,
    "f4E2M1FN": ml_dtypes.float4_e2m1fn,
    "f8E8M0FNU": ml_dtypes.float8_e8m0fnu,
}
INT_REFERENCES = {
    "i32": np.int32,
    "i8": np.int8,
    "ui8": np.uint8,
    "i4": ml_dtypes.int4,
    "i64": np.int64,
    "i16": np.int16,
    "ui16": np.uint16,
    "ui32": np.uint32,
    "ui64": np.uint64,
}


def test_every_float_format_has_a_reference_or_is_tf32():
    assert set(FLOAT_FORMATS) == set(FLOAT_REFERENCES) | {"tf32"}


def test_every_int_format_has_a_reference_or_is_i1():
    assert set(INT_FORMATS) == set(INT_REFERENCES) | {"i1"}


@pytest.mark.parametrize("name", sorted(FLOAT_REFERENCES))
def test_float_format_matches_finfo(name):
    f = FORMATS[name]
    info = ml_dtypes.finfo(FLOAT_REFERENCES[name])
    assert f.bits == info.bits
    assert (f.exp_bits, f.man_bits) == (info.nexp, info.nmant)
    assert f.max_finite == float(info.max)
    assert f.min_value == float(info.min)
    assert f.min_normal == float(info.smallest_normal)
    assert f.min_subnormal == float(info.smallest_subnormal)
    assert f.eps == float(info.eps)


@pytest.mark.parametrize("name", sorted(FLOAT_REFERENCES))
def test_float_format_inf_and_nan_match_the_reference_type(name):
    t = FLOAT_REFERENCES[name]
    specials = np.array([np.inf, np.nan], dtype=np.float64).astype(t)
    assert FORMATS[name].has_inf == bool(np.isinf(specials[0]))
    assert FORMATS[name].has_nan == bool(np.isnan(specials[1]))


def test_tf32_is_f32_range_with_a_10_bit_mantissa():
    # No library ships TF32; these are NVIDIA's definition (A100 whitepaper): 1+8+10 bits.
    f = FORMATS["tf32"]
    assert (f.bits, f.exp_bits, f.man_bits, f.storage) == (19, 8, 10, np.dtype(np.float32))
    assert f.max_finite == (2 - 2.0 ** -10) * 2.0 ** 127
    assert f.min_normal == 2.0 ** -126
    assert f.min_subnormal == 2.0 ** -136
    assert f.eps == 2.0 ** -10
    assert f.has_inf and f.has_nan


@pytest.mark.parametrize("name", sorted(INT_REFERENCES))
def test_int_format_matches_iinfo(name):
    f = FORMATS[name]
    info = ml_dtypes.iinfo(INT_REFERENCES[name])
    assert f.bits == info.bits
    assert (f.min_value, f.max_finite) == (float(info.min), float(info.max))
    assert f.int_range == (int(info.min), int(info.max))  # exact where the floats round
    assert np.iinfo(f.storage).min <= info.min and info.max <= np.iinfo(f.storage).max


def test_i1_is_a_one_bit_boolean():
    f = FORMATS["i1"]
    assert (f.bits, f.min_value, f.max_finite, f.storage) == (1, 0.0, 1.0, np.dtype(np.bool_))


@pytest.mark.parametrize("name", ["bf16", "f8E4M3FN", "f8E5M2"])
def test_packed_float_storage_holds_the_bit_pattern(name):
    assert FORMATS[name].storage == np.dtype(f"uint{FORMATS[name].bits}")
