"""Scaled and block-scaled quantization to the narrow floats: what a scale recipe computes.

A scaled narrow float holds x as q * s: q in an element format (fp8, fp6, fp4), s a scale that
brings the values into the element's range. Where the scale comes from is the recipe:

- per tensor, s from an amax (the tensor's own: "current"; calibrate's: "static"; an amax
  history: "delayed", `DelayedScaling`), as Transformer Engine computes it: the encode factor
  sf = fmt_max / amax / 2^margin multiplies x before rounding (f32), q * (1 / sf) decodes;
- per block of `block` elements (`quantize_blocked`), with one scale per block in
  - f32, s = amax_block / fmt_max (DeepSeek-V3's 1x128 / 128x128 fine-grained fp8, Transformer
    Engine's Float8BlockScaling), quantized as x / s like ONNX QuantizeLinear;
  - E8M0, the OCP Microscaling Formats (MX) v1.0 rule (section 6.3): the shared exponent is
    floor(log2(amax_block)) - emax_elem, emax_elem the exponent of the element format's largest
    normal, clamped to E8M0's [-127, 127] (an amax of 0 takes -127), NaN when the amax is not
    finite; elements are x / 2^shared_exp rounded to nearest-even, saturating to ±max normal;
  - E4M3 per 16 elements plus one f32 tensor scale: NVIDIA's NVFP4 recipe ("Pretraining Large
    Language Models with NVFP4", NVIDIA, arXiv:2509.25149, 2025, section 2 and appendix B):
    s_enc = 6 * 448 / amax_tensor, s_dec = 1 / s_enc; per block s_b = e4m3(amax_block / 6 *
    s_enc) (saturating); elements fp4(x * (1 / (s_b * s_dec))); decode q * s_b * s_dec. A block
    whose scale rounds to 0 quantizes to 0 (its values count as flushed).

Every rounding goes through mplower.numerics.rounding (bit-exact against ml_dtypes), so the
counts come from the same pass: `overflow` = values that saturated, `underflow` = non-zero
values flushed to zero, `nan` as there. Blocks run along the trailing axes given by `block`
(same rank as x; 1 means "no blocking on this axis"); a ragged edge block is a smaller block.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from mplower.numerics.formats import FORMATS
from mplower.numerics.rounding import Counts, decode, round_to

E8M0 = "f8E8M0FNU"
NVFP4_ELEM, NVFP4_BLOCK_SCALE = "f4E2M1FN", "f8E4M3FN"


@dataclass(frozen=True)
class Scaled:
    """A tensor quantized with scales, and what it cost.

    `values` are the decoded values q * s (float32), `codes` the element values q (float32
    holding values of the element format), `scales` one decode factor per block (float32; for
    NVFP4 the E4M3 block scales, with `tensor_scale` the f32 second level), `amax` the amax the
    scales came from (per block, or per tensor), `counts` what rounding did, `scale_bytes_per_element`
    the bytes of scales stored per element (1/32 for MX: one E8M0 byte per 32 elements;
    1/16 + 4/n for NVFP4: one E4M3 byte per 16 and one f32 per tensor).
    """

    values: np.ndarray
    codes: np.ndarray
    scales: np.ndarray
    amax: np.ndarray
    counts: Counts
    scale_bytes_per_element: float
    tensor_scale: float | None = None


def emax(elem: str) -> int:
    """The exponent of the largest normal value of an element format (MX v1.0, table 1)."""
    return math.floor(math.log2(FORMATS[elem].max_finite))


def _grid(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-d // b) for d, b in zip(shape, block))


def _check_block(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    block = tuple(int(b) for b in block)
    if len(block) != len(shape) or any(b < 1 for b in block):
        raise ValueError(f"block {list(block)} must give a positive size for each of the "
                         f"{len(shape)} axes of a tensor of shape {list(shape)}")
    return block


def block_amax(x: np.ndarray, block: tuple[int, ...]) -> np.ndarray:
    """max |x| over each block (NaN if the block holds a NaN), shape ceil(x.shape / block)."""
    block = _check_block(x.shape, block)
    grid = _grid(x.shape, block)
    # Zero padding up to whole blocks leaves every block's amax as it is.
    padded = np.zeros([g * b for g, b in zip(grid, block)], np.float32)
    padded[tuple(slice(0, d) for d in x.shape)] = np.abs(x)
    split = padded.reshape([v for g, b in zip(grid, block) for v in (g, b)])
    return split.max(axis=tuple(range(1, 2 * len(block), 2)))


def expand(s: np.ndarray, block: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
    """One value per block repeated over the block's elements, cut to `shape`."""
    for axis, b in enumerate(block):
        s = np.repeat(s, b, axis=axis)
    return np.ascontiguousarray(s[tuple(slice(0, d) for d in shape)])


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def mx_scale_codes(amax: np.ndarray, elem: str) -> np.ndarray:
    """E8M0 codes of the MX shared scales for blocks of amax `amax` (module docstring)."""
    amax = _f32(amax)
    finite = np.isfinite(amax)
    # frexp is exact: amax = m * 2^e with m in [0.5, 1), so floor(log2(amax)) = e - 1.
    _, e = np.frexp(np.where(finite & (amax > 0), amax, np.float32(1)))
    shared = np.where(amax > 0, e.astype(np.int64) - 1 - emax(elem), -127)
    codes = np.clip(shared, -127, 127) + 127
    return np.where(finite, codes, 255).astype(np.uint8)


def quantize_blocked(x: np.ndarray, elem: str, block: tuple[int, ...],
                     scale_format: str = "f32") -> Scaled:
    """Quantize float32 `x` to `elem` with one scale per block (module docstring).

    `scale_format` is "f32" (fine-grained fp8), "e8m0" (MX) or "nvfp4" (E4M3 block scales and
    an f32 tensor scale; `elem` must then be f4E2M1FN).
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    block = _check_block(x.shape, block)
    amax = block_amax(x, block)
    top = np.float32(FORMATS[elem].max_finite)
    n_blocks, size = amax.size, max(1, x.size)
    if scale_format == "e8m0":
        scale = decode(mx_scale_codes(amax, elem), E8M0)
        codes, counts = round_to(x / expand(scale, block, x.shape), elem, saturate=True)
        values = codes * expand(scale, block, x.shape)
        return Scaled(values, codes, scale, amax, counts, n_blocks / size)
    if scale_format == "f32":
        # A block of zeros keeps scale 1 (any scale would do; 1 avoids 0/0).
        scale = np.where(amax > 0, amax / top, np.float32(1)).astype(np.float32)
        full = expand(scale, block, x.shape)
        codes, counts = round_to(x / full, elem, saturate=True)
        return Scaled(codes * full, codes, scale, amax, counts, 4 * n_blocks / size)
    if scale_format == "nvfp4":
        if elem != NVFP4_ELEM:
            raise ValueError(f"NVFP4 scaling quantizes to {NVFP4_ELEM}, not {elem}")
        tensor_amax = np.float32(np.max(np.abs(x))) if x.size else np.float32(0)
        bs_top = np.float32(FORMATS[NVFP4_BLOCK_SCALE].max_finite)
        s_enc = np.float32(top * bs_top) / tensor_amax if tensor_amax > 0 else np.float32(1)
        s_dec = np.float32(1) / np.float32(s_enc)
        s_b, _ = round_to((amax / top * np.float32(s_enc)).astype(np.float32),
                          NVFP4_BLOCK_SCALE, saturate=True)
        with np.errstate(divide="ignore"):
            enc_b = np.where(s_b > 0, np.float32(1) / (s_b * s_dec), np.float32(0))
        codes, counts = round_to((x * expand(enc_b.astype(np.float32), block, x.shape)
                                  ).astype(np.float32), elem, saturate=True)
        # A block whose scale underflowed to 0 flushes its non-zero values (x * 0 = 0, which the
        # rounding does not see as a flush).
        lost = int(np.count_nonzero((expand(s_b, block, x.shape) == 0) & (x != 0)))
        counts = counts + Counts(underflow=lost)
        values = (codes * expand(s_b, block, x.shape)) * s_dec
        return Scaled(values.astype(np.float32), codes, s_b, amax, counts,
                      (n_blocks + 4) / size, tensor_scale=float(s_dec))
    raise ValueError(f"unknown scale format '{scale_format}'; use f32, e8m0 or nvfp4")


_F32_ZERO, _F32_INF = np.float32(0), np.float32(np.inf)


@functools.cache
def _factor_constants(elem: str, margin: int) -> tuple[np.float32, np.float32]:
    """encode_factor's float32 operands: the format's largest finite and 2^margin (an fp8
    plan's every scaled_quant computes its factor; numpy scalars are made once)."""
    return np.float32(FORMATS[elem].max_finite), np.float32(2.0 ** margin)


def encode_factor(amax: float, elem: str, margin: int = 0, previous: float = 1.0,
                  pow2: bool = False) -> float:
    """Transformer Engine's scale: fmt_max / amax / 2^margin (float32), or `previous` where
    amax is 0 or not finite (TE's `_default_sf_compute`). With `pow2` it is rounded down to a
    power of two: a value that is a normal number before and after scaling then keeps the
    significand the plain cast gives it (only its exponent moves), and decoding is exact."""
    a = np.float32(amax)
    if not (_F32_ZERO < a < _F32_INF):  # 0, negative, infinite or NaN
        return float(np.float32(previous))
    top, shrink = _factor_constants(elem, margin)
    sf = (top / a) / shrink  # float32 operands: each quotient rounded to float32
    if pow2 and np.isfinite(sf) and sf > 0:
        sf = np.float32(np.ldexp(np.float32(1), np.frexp(sf)[1] - 1))  # 2^floor(log2 sf)
    return float(sf)


def quantize_per_tensor(x: np.ndarray, elem: str, sf: float) -> Scaled:
    """q = elem(x * sf) (saturating), decoded as q * (1 / sf): TE's fp8 cast with a scale."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    codes, counts = round_to((x * np.float32(sf)).astype(np.float32), elem, saturate=True)
    inv = np.float32(1) / np.float32(sf)
    amax = np.float32(np.max(np.abs(x))) if x.size else np.float32(0)
    return Scaled((codes * inv).astype(np.float32), codes, np.array([inv], np.float32),
                  np.array([amax], np.float32), counts, 4 / max(1, x.size))


@dataclass
class DelayedScaling:
    """Transformer Engine's DelayedScaling state for one tensor.

    Step t quantizes with the current `scale` (1.0 at first); `update(amax_t)` records the
    step's amax in history[0], takes max(history) ("max") or history[0] ("most_recent"),
    rolls the history by one (TE's `_update_amax_history`: roll(-1), then history[0] = 0) and
    sets the scale for step t+1 with `encode_factor`. The window is the last `length` steps.
    """

    elem: str
    length: int = 1024
    amax_compute: str = "max"
    margin: int = 0
    scale: float = 1.0
    pow2: bool = False
    history: np.ndarray = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.amax_compute not in ("max", "most_recent"):
            raise ValueError(f"amax_compute must be 'max' or 'most_recent', "
                             f"got '{self.amax_compute}'")
        if self.length < 1:
            raise ValueError(f"the amax history length must be at least 1, got {self.length}")
        if self.history is None:
            self.history = np.zeros(self.length, np.float32)

    def update(self, amax: float) -> float:
        """Record this step's amax; return the scale for the next step."""
        self.history[0] = np.float32(amax)
        a = self.history.max() if self.amax_compute == "max" else self.history[0]
        self.history = np.roll(self.history, -1)
        self.history[0] = 0
        self.scale = encode_factor(float(a), self.elem, self.margin, self.scale, self.pow2)
        return self.scale
