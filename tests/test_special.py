"""The float32 erf kernel (Ziv's rounding test over a vectorized approximation) against
Python's math.erf, bit for bit. benchmarks/erf_exhaustive.py checks all 2^32 inputs; these
tests check the edges of the approximation, its fix-up path and thread-count independence."""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest

from mplower.numerics import special
from mplower.numerics.special import SERIAL_BELOW, erf


def math_erf32(x: np.ndarray) -> np.ndarray:
    return np.array([math.erf(float(v)) for v in x.reshape(-1)], np.float64).astype(np.float32)


def around(values, ulps: int = 4) -> np.ndarray:
    """Each value rounded to float32 and its neighbours up to `ulps` away, both signs."""
    bits = np.asarray(values, np.float32).view(np.int32)[:, None] + np.arange(-ulps, ulps + 1)
    x = bits.astype(np.int32).reshape(-1).view(np.float32)
    return np.concatenate([x, -x])


def edges() -> np.ndarray:
    """Where the kernel switches formulas: the split between the two polynomials, the clamp,
    where float32 erf reaches 1, where exp's reduction changes k (x^2 = (k + 1/2) ln 2), plus
    zeros, subnormals, the largest float, infinities and NaNs with payloads and signs."""
    switches = [special._SPLIT, special._CLAMP, 3.8325, 3.9, 4.0]
    reductions = np.sqrt((np.arange(0, 53) + 0.5) * math.log(2))
    specials = np.array([0, 1, 0x7FFFFF, 0x800000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000,
                         0x7F800001, 0x7FBFFFFF, 0x7FC12345], np.uint32).view(np.float32)
    return np.concatenate([around(switches), around(reductions), specials, -specials])


def test_float32_erf_is_math_erf_bit_for_bit_on_random_patterns_and_formula_edges() -> None:
    rng = np.random.default_rng(12)
    patterns = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    # Random bit patterns are mostly tiny or huge; these cover the polynomials' range densely.
    moderate = (rng.standard_normal(100_000) * 2).astype(np.float32)
    x = np.concatenate([patterns.view(np.float32), moderate, edges()])
    got = erf(x)
    assert got.dtype == np.float32
    assert got.view(np.uint32).tolist() == math_erf32(x).view(np.uint32).tolist()


def test_float32_erf_fix_up_gives_math_erf_bits_for_flagged_elements() -> None:
    x = (np.random.default_rng(7).standard_normal(50_000) * 2).astype(np.float32)
    expect = math_erf32(x).view(np.uint32).tolist()
    y = np.empty_like(x)
    # A bound of 2^-28 sends one element in 4 to 16 to the fix-up (its rounding interval is
    # 2^-27 wide against float32's relative spacing of 2^-24 to 2^-23): bits must not change.
    flagged = special._erf32_serial(x, y, 2.0**-28)
    assert 2_000 < flagged < 20_000
    assert y.view(np.uint32).tolist() == expect
    # With the kernel's own bound, the consecutive float32 in [0.5, 0.625) still need it a
    # few dozen times (about 2^-15 of them).
    x = np.arange(0x3F000000, 0x3F200000, dtype=np.uint32).view(np.float32)
    y = np.empty_like(x)
    assert special._erf32_serial(x, y, special._ERROR_BOUND) > 10
    assert y.view(np.uint32).tolist() == math_erf32(x).view(np.uint32).tolist()


@pytest.mark.determinism
def test_float32_erf_bits_do_not_depend_on_thread_count_with_nans_and_fix_ups() -> None:
    rng = np.random.default_rng(4)
    x = np.concatenate([rng.integers(0, 2**32, SERIAL_BELOW, dtype=np.uint64).astype(
        np.uint32).view(np.float32), (rng.standard_normal(3 * SERIAL_BELOW) * 2).astype(
        np.float32), edges()])
    threads = numba.get_num_threads()
    try:
        results = set()
        for n in range(1, min(2, numba.config.NUMBA_NUM_THREADS) + 1):
            numba.set_num_threads(n)
            results.add(erf(x).tobytes())
    finally:
        numba.set_num_threads(threads)
    assert results == {math_erf32(x).tobytes()}
