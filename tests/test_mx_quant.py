"""Block-scaled quantization (MX, NVFP4, fine-grained fp8) and the scale recipes, against
transcriptions of the specifications written here (ml_dtypes does the element rounding)."""

import math
import warnings

import ml_dtypes
import numpy as np
import pytest

from mplower.numerics.mx import (
    DelayedScaling,
    block_amax,
    encode_factor,
    quantize_blocked,
    quantize_per_tensor,
)
from mplower.numerics.rounding import Counts

ML = {"f8E4M3FN": ml_dtypes.float8_e4m3fn, "f8E5M2": ml_dtypes.float8_e5m2,
      "f6E2M3FN": ml_dtypes.float6_e2m3fn, "f6E3M2FN": ml_dtypes.float6_e3m2fn,
      "f4E2M1FN": ml_dtypes.float4_e2m1fn}
# OCP MX v1.0, table 1: emax of each element format.
EMAX_ELEM = {"f8E4M3FN": 8, "f8E5M2": 15, "f6E2M3FN": 2, "f6E3M2FN": 4, "f4E2M1FN": 2}


def to_elem(v: float, elem: str) -> float:
    """Round to nearest even in the element format, clamping to ±max normal (MX 6.3)."""
    top = float(ml_dtypes.finfo(ML[elem]).max)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(np.float64(min(max(v, -top), top)).astype(ML[elem]).astype(np.float64))


def mx_spec(x: np.ndarray, elem: str, k: int = 32) -> tuple[np.ndarray, list[int]]:
    """OCP MX v1.0 section 6.3, one block of k along the last axis at a time."""
    out = np.zeros(x.shape, np.float64)
    scales = []
    for row in range(x.shape[0]):
        for start in range(0, x.shape[1], k):
            v = [float(t) for t in x[row, start:start + k]]
            amax = max(abs(t) for t in v)
            if any(not math.isfinite(t) for t in v):
                scales.append(255)
                out[row, start:start + k] = np.nan
                continue
            shared = math.frexp(amax)[1] - 1 - EMAX_ELEM[elem] if amax > 0 else -127
            shared = min(max(shared, -127), 127)
            scales.append(shared + 127)
            for i, t in enumerate(v):
                out[row, start + i] = to_elem(t / 2.0 ** shared, elem) * 2.0 ** shared
    return out.astype(np.float32), scales


def test_mx_block_amax_pads_ragged_blocks():
    x = np.arange(-5, 5, dtype=np.float32).reshape(2, 5)
    assert block_amax(x, (1, 2)).tolist() == [[5, 3, 1], [1, 3, 4]]
    assert block_amax(x, (2, 4)).tolist() == [[5, 4]]


@pytest.mark.parametrize("elem", sorted(ML))
def test_mx_quantize_dequantize_equals_the_spec_transcription_bit_for_bit(elem):
    rng = np.random.default_rng(7)
    # Blocks of very different magnitudes (2^-140 .. 2^100), a zero block, an f32-subnormal
    # block, a block with an inf and one with a NaN.
    x = (rng.standard_normal((6, 96)) * np.exp2(rng.integers(-140, 100, (6, 1)))
         ).astype(np.float32)
    x[1, :32] = 0
    x[2, 32:64] = np.float32(3e-41) * rng.standard_normal(32).astype(np.float32)
    x[3, 5] = np.inf
    x[4, 70] = np.nan
    want, want_scales = mx_spec(x, elem)
    got = quantize_blocked(x, elem, (1, 32), "e8m0")
    assert got.scales.size == 18 and got.scale_bytes_per_element == 1 / 32
    scale_codes = got.scales.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8).reshape(-1)
    assert scale_codes.tolist() == want_scales
    assert np.array_equal(np.isnan(got.values), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.array_equal(got.values[ok].view(np.uint32), want[ok].view(np.uint32))


def test_mx_counts_saturated_and_flushed_values():
    # amax 7.5 -> shared exponent floor(log2 7.5) - 2 = 0: 7.5 saturates to 6, 0.2 flushes.
    x = np.array([[7.5, 0.2, 1.0, -3.0]], np.float32)
    got = quantize_blocked(x, "f4E2M1FN", (1, 4), "e8m0")
    assert got.values.tolist() == [[6.0, 0.0, 1.0, -3.0]]
    assert got.counts == Counts(overflow=1, underflow=1, nan=0)


def nvfp4_spec(x: np.ndarray) -> np.ndarray:
    """NVFP4 as arXiv:2509.25149 (NVIDIA) defines it, blocks of 16 along the last axis."""
    f32 = np.float32
    amax = f32(np.max(np.abs(x)))
    s_enc = f32(f32(6 * 448) / amax)
    s_dec = f32(f32(1) / s_enc)
    out = np.zeros_like(x)
    for r in range(x.shape[0]):
        for c in range(0, x.shape[1], 16):
            v = x[r, c:c + 16]
            sb = f32(to_elem(float(f32(f32(np.max(np.abs(v))) / f32(6)) * s_enc), "f8E4M3FN"))
            enc = f32(1) / f32(sb * s_dec) if sb > 0 else f32(0)
            q = np.array([to_elem(float(f32(t * enc)), "f4E2M1FN") for t in v], np.float32)
            out[r, c:c + 16] = (q * sb) * s_dec
    return out


def test_nvfp4_equals_nvidias_two_level_recipe():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 64)) * np.exp2(rng.integers(-6, 6, (4, 4)).repeat(16, 1))
         ).astype(np.float32)
    got = quantize_blocked(x, "f4E2M1FN", (1, 16), "nvfp4")
    want = nvfp4_spec(x)
    assert np.array_equal(got.values.view(np.uint32), want.view(np.uint32))
    assert got.scale_bytes_per_element == (16 + 4) / 256
    assert got.tensor_scale == float(np.float32(1) / np.float32(np.float32(2688) /
                                                                 np.max(np.abs(x))))


def test_fine_grained_fp8_block_scale_is_amax_over_448_per_128x128_block():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((256, 128)).astype(np.float32)
    w[128:] *= 1000
    got = quantize_blocked(w, "f8E4M3FN", (128, 128), "f32")
    assert got.scales.shape == (2, 1)
    want_scale = (np.abs(w[:128]).max() / np.float32(448)).astype(np.float32)
    assert got.scales[0, 0] == want_scale
    q = np.clip(w[:128] / want_scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(got.values[:128], q.astype(np.float32) * want_scale)
    assert got.counts.overflow == 0


def test_per_tensor_scaling_saturates_nothing_where_the_plain_cast_overflows():
    x = np.array([1e10, -3e9, 1.0], np.float32)
    sf = np.float32(448) / np.float32(1e10)
    got = quantize_per_tensor(x, "f8E4M3FN", float(sf))
    assert got.counts.overflow == 0
    want = (x * sf).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * (np.float32(1) / sf)
    assert np.array_equal(got.values, want)


def test_delayed_scaling_follows_transformer_engines_history_rule():
    # L = 3, max of window, margin 1, E4M3 (448): hand-computed.
    #  step  amax  history after recording  window max  next scale = 448 / max / 2
    #   1     2    [2, 0, 0]                 2          112
    #   2     8    [8, 0, 2]                 8           28
    #   3     4    [4, 2, 8]                 8           28
    #   4     1    [1, 8, 4]                 8           28
    #   5    0.5   [0.5, 4, 1]               4           56   (the 8 of step 2 left the window)
    #   6     0    [0, 1, 0.5]               1          224
    d = DelayedScaling("f8E4M3FN", length=3, amax_compute="max", margin=1)
    used = []
    for amax in [2, 8, 4, 1, 0.5, 0]:
        used.append(d.scale)
        d.update(amax)
    assert used == [1.0, 112.0, 28.0, 28.0, 28.0, 56.0]
    assert d.scale == 224.0
    recent = DelayedScaling("f8E4M3FN", length=3, amax_compute="most_recent", margin=0)
    assert [recent.update(a) for a in [2, 8, 0, np.inf, 4]] == [224.0, 56.0, 56.0, 56.0, 112.0]


def test_power_of_two_scale_keeps_the_plain_casts_rounding_of_values_normal_in_both():
    # With sf = 2^k a value that is a normal fp8 number before and after scaling keeps its
    # significand: the scaled cast rounds it exactly as the plain cast does; only the values
    # the plain cast saturated or that leave the normal range change.
    rng = np.random.default_rng(9)
    x = (rng.standard_normal(4096) * np.exp2(rng.integers(-12, 12, 4096))).astype(np.float32)
    amax = float(np.abs(x).max())
    sf = encode_factor(amax, "f8E4M3FN", pow2=True)
    assert sf == 2.0 ** math.floor(math.log2(448 / amax))
    got = quantize_per_tensor(x, "f8E4M3FN", sf)
    plain = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    both = (np.abs(x) >= 2.0 ** -6) & (np.abs(x) <= 448) & (np.abs(x * sf) >= 2.0 ** -6)
    assert both.sum() > 1000
    assert np.array_equal(got.values[both], plain[both])
    assert got.counts.overflow == 0 and int((np.abs(x) > 464).sum()) > 0
