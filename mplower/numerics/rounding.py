"""Bit-exact rounding of float32 data to the narrow float formats, with overflow accounting.

The backend emulates a bf16/f16/tf32/fp8 tensor by rounding float32 values to the format and
keeping the results in float32 containers, so that fp32 BLAS can consume them (products of such
values are exact in fp32). `round_to` does that rounding and, in the same pass over memory,
counts what the format did to the data: values that overflowed, non-zero values that underflowed
to zero, and NaNs in the result. `encode` / `decode` convert between float32 and the packed bit
patterns (uint16 for bf16/f16, uint8 for fp8). All three agree bit for bit with ml_dtypes and
numpy's float16 on every float32 input (benchmarks/rounding.py --sweep checks all 2^32).
Numba has no float16 on the CPU, so every kernel works on the float32 bit pattern with integer
arithmetic; one step borrows the FPU: rounding into a target's subnormal range adds a power of
two M whose ulp is the target's smallest subnormal, which rounds to nearest-even exactly once.

Rounding is to nearest, ties to even. What happens beyond the range (`saturate=False`) is what
ml_dtypes and numpy do: f16, bf16, tf32 and f8E5M2 overflow to ±inf, f8E4M3FN (no inf) to NaN,
and ±inf becomes NaN in f8E4M3FN. With `saturate=True` every non-NaN result is finite: values
beyond the range, ±inf included, clamp to ±max finite. For the fp8 formats this is ONNX Cast's
saturate semantics; the same rule is applied to f16, bf16 and tf32 so that saturation means
"no infinities" whatever the format. NaN stays NaN. The NaN bit patterns follow the references:
numpy float16 keeps the top 10 payload bits (setting the lowest one if they are all zero);
bf16, tf32 and both fp8 formats produce the canonical quiet NaN, keeping the sign.

The MX element types f6E2M3FN, f6E3M2FN and f4E2M1FN have neither inf nor NaN (OCP MX v1.0,
5.3): beyond the range a value always clamps to ±max finite (ml_dtypes does the same), and a NaN
becomes a zero of the opposite sign (ml_dtypes' choice; the spec leaves it to the
implementation). The scale type f8E8M0FNU (MX 5.4.1) is an unsigned power of two, 2^-127 ..
2^127, with 0xFF as NaN and no zero: as in ml_dtypes, a value rounds to the nearer power of two
with ties upward (the implicit leading one is the "kept" bit), zero, negative values (-0
included), NaN and +inf become NaN, and positive values below 2^-127 become 2^-127 (between
2^-127 and 2^-126 the nearer one, ties upward, as ml_dtypes 0.7 does; 0.6 rounded all of them
up to 2^-126). With `saturate=True`, E8M0 clamps values beyond 2^127 and
+inf to 2^127. These four run on their own kernel (`_round_one_mx`) so that the one of the
other formats keeps its tight loop.

Counts: `overflow` is the number of non-NaN inputs that the format could not hold and changed:
finite values that became ±inf/NaN or were clamped, and ±inf that became NaN (f8E4M3FN) or was
clamped (saturate). ±inf stored as ±inf is not an overflow. `underflow` is the number of non-zero
inputs (f32 subnormals included) whose result is ±0. `nan` is the number of NaNs in the result,
except for the formats without NaN, where it is the number of NaN inputs (each one lost to a
zero), so that a NaN never disappears from the counts.

`matmul_f16_accum` emulates an fp16 accumulator: see its docstring for the summation order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from mplower.numerics.formats import FORMATS, MX_ROUNDING_FORMATS, ROUNDING_FORMATS
from mplower.numerics.workers import run_blocks

# ROUNDING_FORMATS (numerics.formats): what round_to handles; f32 is accepted as the identity so
# callers need no special case. The MX formats (see the module docstring) run on `_round_one_mx`.
ENCODING_FORMATS = ("bf16", "f16", "f8E4M3FN", "f8E5M2") + MX_ROUNDING_FORMATS

# Elements per parallel chunk: big enough to amortise scheduling, small enough to balance.
_CHUNK = 1 << 16
# Arrays smaller than this are rounded by one thread (about 0.1-0.3 ns a value here): handing
# a worker its share costs tens of microseconds on this 2-core VM, as much as a pass of a few
# hundred thousand values, so a smaller array is faster on one (ShuffleNet b8's activations,
# 0.1-0.9M values: its fp8 scaled_quants 9.7-11.4 -> 7.1 ms, its int8 plan 54.4 -> 50.8 ms
# against the 256K this was, docs/benchmarks.md). Larger ones go to
# mplower.numerics.workers, whose blocks never wait for a descheduled thread (a prange region
# waited 10-15 ms for one when other processes held the cores of a shared 2-core VM,
# benchmarks/backend.py).
SERIAL_BELOW = 1 << 20

_F32_INF = 0x7F800000
_F32_QNAN = 0x00400000  # quiet bit of the f32 mantissa
_U32 = np.uint32


@dataclass(frozen=True)
class Counts:
    """What a rounding or quantization did to the data (see the module docstring)."""

    overflow: int = 0
    underflow: int = 0
    nan: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.overflow + other.overflow, self.underflow + other.underflow,
                      self.nan + other.nan)


def _f32_bits(v: float) -> int:
    return int(np.array(v, dtype=np.float32).view(np.uint32))


@functools.cache
def _params(fmt: str, saturate: bool) -> tuple:
    """The constants that specialise the generic kernel to one format, as a tuple of uint32.

    They travel as a tuple, not an array, so that numba keeps them in registers for the whole
    loop instead of reloading them from memory that might alias the output.
    """
    f = FORMATS[fmt]
    m = f.man_bits
    shift = 23 - m  # f32 mantissa bits the format drops
    bias = (1 << (f.exp_bits - 1)) - 1
    max_bits = _f32_bits(f.max_finite)
    # Formats with f32's exponent range (bf16, tf32) need no subnormal step: rounding the f32
    # bit pattern of an f32 subnormal already lands on their subnormal grid.
    has_own_subnormals = f.min_normal > 2.0 ** -126
    sub_thr = _f32_bits(f.min_normal) if has_own_subnormals else 0
    # M's ulp is the format's smallest subnormal, so |x| + M rounds |x| onto that grid.
    m_bits = _f32_bits(f.min_subnormal * 2.0 ** 23) if has_own_subnormals else 0
    exp_ones_enc = ((1 << f.exp_bits) - 1) << m
    if saturate:
        ovf_abs, ovf_enc = max_bits, (max_bits >> shift) - ((127 - bias) << m)
    elif f.has_inf:
        ovf_abs, ovf_enc = _F32_INF, exp_ones_enc
    else:  # f8E4M3FN: the all-ones pattern is its only NaN
        ovf_abs, ovf_enc = _F32_INF | _F32_QNAN, exp_ones_enc | ((1 << m) - 1)
    if fmt == "f16":  # numpy keeps the top payload bits, forcing a non-zero mantissa
        nan_keep, nan_fill, nan_fill_enc = 0x007FE000, 1 << shift, 1
    elif f.has_inf:  # canonical quiet NaN
        nan_keep, nan_fill, nan_fill_enc = 0, _F32_QNAN, 1 << (m - 1)
    else:  # f8E4M3FN's single NaN, S.1111.111
        nan_keep, nan_fill, nan_fill_enc = 0, _F32_QNAN, (1 << m) - 1
    sign_shift = 32 - f.bits if fmt in ENCODING_FORMATS else 0
    return tuple(np.uint32(v) for v in (
        shift, (1 << (shift - 1)) - 1, (1 << shift) - 1, max_bits, sub_thr, m_bits,
        (127 - bias) << m, ovf_abs, ovf_enc, nan_keep, nan_fill, exp_ones_enc, nan_fill_enc,
        sign_shift,
    ))


@njit(cache=True)
def _round_one(u, p):
    """Round one f32 bit pattern; returns (result f32 bits, encoding, overflow?, underflow?).

    Written as selects rather than branches so that the loops calling it vectorise; every
    intermediate is cut back to uint32 because numba widens uint32 arithmetic to 64 bits.
    """
    (shift, half, low, max_bits, sub_thr, m_bits, rebias, ovf_abs, ovf_enc,
     nan_keep, nan_fill, nan_base_enc, nan_fill_enc, sign_shift) = p
    sign = _U32(u & _U32(0x80000000))
    a = _U32(u ^ sign)
    # Nearest-even on the bit pattern: add half an ulp minus one plus the kept lsb, truncate.
    # A carry out of the mantissa bumps the exponent, which is exactly what rounding up does.
    r = _U32(_U32(a + half + _U32((a >> shift) & _U32(1))) & _U32(~low))
    enc = _U32(_U32(r >> shift) - rebias)
    # Below the format's smallest normal: round on the FPU against M (see module docstring).
    big = _U32(m_bits).view(np.float32)
    s = np.float32(_U32(a).view(np.float32) + big)
    is_sub = a < sub_thr
    r = np.float32(s - big).view(np.uint32) if is_sub else r
    enc = _U32(s.view(np.uint32) - m_bits) if is_sub else enc
    is_nan = a > _U32(_F32_INF)
    over = r > max_bits and not is_nan
    r = ovf_abs if over else r
    enc = ovf_enc if over else enc
    over = over and a != ovf_abs  # inf kept as inf is representable, not an overflow
    payload = _U32(a & nan_keep)
    nan_r = _U32(_U32(_F32_INF) | payload)
    nan_r = _U32(nan_r | nan_fill) if payload == _U32(0) else nan_r
    nan_e = _U32(nan_base_enc | _U32(payload >> shift))
    nan_e = _U32(nan_e | nan_fill_enc) if payload == _U32(0) else nan_e
    r = nan_r if is_nan else r
    enc = nan_e if is_nan else enc
    under = a != _U32(0) and r == _U32(0)
    return _U32(sign | r), _U32(_U32(sign >> sign_shift) | enc), over, under


@njit(cache=True, inline="always")
def plain_bf16(p):
    """Whether rounding parameters p (`_params`) are non-saturating bf16's: 16 dropped bits,
    no subnormal step, ±inf on overflow, which `rounded_bits` rounds on a short path."""
    return p[0] == _U32(16) and p[4] == _U32(0) and p[7] == _U32(_F32_INF)


@njit(cache=True, inline="always")
def plain_f16(p):
    """Whether rounding parameters p (`_params`) are non-saturating f16's (13 dropped bits,
    ±inf on overflow, numpy's NaN payload), which the conv tiles round with the CPU's float16
    conversion, or its twin where the compile target has none (gemm_kernel._half_round_trip)."""
    return p[0] == _U32(13) and p[7] == _U32(_F32_INF) and p[9] == _U32(0x007FE000)


@njit(cache=True, inline="always")
def rounded_bits(u, p):
    """`_round_one`(u, p)'s result bits alone, for the kernels that round their outputs as
    they store them (a conv's tiles, a residual add). Non-saturating bf16 (p[0] = 16 dropped
    bits, no subnormal step, ±inf on overflow) takes a shorter path: its rounding is
    nearest-even on the bit pattern with nothing else to do but keep NaN a NaN (a carry out
    of the mantissa already gives inf on overflow), a third of the operations, the same
    bits for every float32 (all 2^32 compared with `_round_one`'s when this was written;
    tests/test_rounding.py compares it with ml_dtypes). The format is the same for a whole
    loop, so the compiler hoists the test out of it."""
    if plain_bf16(p):
        a = _U32(u & _U32(0x7FFFFFFF))
        r = _U32(_U32(u + _U32(0x7FFF) + _U32((u >> _U32(16)) & _U32(1))) & _U32(0xFFFF0000))
        # bf16's canonical quiet NaN, with the sign (the sign bit of u survives the add:
        # below the NaNs no carry reaches it).
        return _U32(_U32(u & _U32(0x80000000)) | _U32(0x7FC00000)) if a > _U32(_F32_INF) else r
    return _round_one(u, p)[0]


@njit(cache=True)
def _round_span(s, d, p, codes):
    """Round the f32 bits `s` into `d` (results, or with `codes` encodings); return counts."""
    # uint32 counters (a span is far below 2^32) keep the vector lanes 32 bits wide.
    over = _U32(0)
    under = _U32(0)
    nan = _U32(0)
    for i in range(s.size):
        r, e, o, un = _round_one(s[i], p)
        d[i] = e if codes else r
        over = _U32(over + o)
        under = _U32(under + un)
        nan = _U32(nan + (_U32(r & _U32(0x7FFFFFFF)) > _U32(_F32_INF)))
    return over, under, nan


@njit(cache=True, nogil=True)
def _round_blocks(src, dst, pa, codes, counts, c0, c1):
    """Chunks c0..c1-1 of src (f32 bits) rounded into dst, each chunk's counts in its row."""
    for c in range(c0, c1):
        # Per-chunk slices: indices from 0 let numba drop its negative-index wraparound, which
        # would otherwise turn the vector loads into gathers.
        lo = c * _CHUNK
        counts[c, 0], counts[c, 1], counts[c, 2] = _round_serial(
            src[lo:lo + _CHUNK], dst[lo:lo + _CHUNK], pa, codes)


@njit(cache=True, inline="always")
def _param_tuple(pa):
    """`_params` back from the uint32 array it is passed as (cheaper for numba's dispatcher to
    type than a tuple)."""
    return (pa[0], pa[1], pa[2], pa[3], pa[4], pa[5], pa[6], pa[7], pa[8], pa[9], pa[10],
            pa[11], pa[12], pa[13])


@njit(cache=True, nogil=True)
def _round_serial(src, dst, pa, codes):
    """`_round_span` over a whole array in this thread."""
    p = _param_tuple(pa)
    return _round_span(src, dst, p, codes)


@njit(cache=True)
def _round_one_mx(u, p):
    """`_round_one` for the MX element formats and E8M0 (module docstring); also returns
    whether the result counts as a NaN (a NaN input for the formats without NaN)."""
    (shift, half, low, max_bits, sub_thr, m_bits, rebias, max_enc, sign_shift, e8m0,
     ovf_abs, ovf_enc) = p
    sign = _U32(u & _U32(0x80000000))
    a = _U32(u ^ sign)
    is_nan = a > _U32(_F32_INF)
    if e8m0:
        # Ties upward: ml_dtypes' nearest-even keeps the implicit one, which is always odd.
        r = _U32(_U32(a + half) & _U32(~low))
        # Below 2^-126 (float32 subnormals) the two candidates are 2^-127 and 2^-126: the
        # nearer one, ties (1.5 * 2^-127) upward as above; everything below 2^-127 is 2^-127.
        r = (_U32(0x00800000) if a >= _U32(0x00600000) else _U32(0x00400000)) \
            if a < _U32(0x00800000) else r
        bad = is_nan or sign != _U32(0) or a == _U32(0)
        over = r > max_bits and not bad
        r = ovf_abs if over else r
        enc = _U32(r >> shift)
        enc = ovf_enc if over else enc
        nan = bad or r > max_bits
        r = _U32(_F32_INF | _F32_QNAN) if nan else r
        enc = _U32(0xFF) if nan else enc
        return r, enc, over, False, nan
    r = _U32(_U32(a + half + _U32((a >> shift) & _U32(1))) & _U32(~low))
    enc = _U32(_U32(r >> shift) - rebias)
    big = _U32(m_bits).view(np.float32)
    s = np.float32(_U32(a).view(np.float32) + big)
    is_sub = a < sub_thr
    r = np.float32(s - big).view(np.uint32) if is_sub else r
    enc = _U32(s.view(np.uint32) - m_bits) if is_sub else enc
    over = r > max_bits and not is_nan  # ±inf included: there is no inf to keep
    r = max_bits if over else r
    enc = max_enc if over else enc
    r = _U32(0) if is_nan else r
    enc = _U32(0) if is_nan else enc
    sign = _U32(sign ^ _U32(0x80000000)) if is_nan else sign
    under = a != _U32(0) and r == _U32(0) and not is_nan
    return _U32(sign | r), _U32(_U32(sign >> sign_shift) | enc), over, under, is_nan


@njit(cache=True, nogil=True)
def _round_serial_mx(src, dst, pa, codes):
    p = (pa[0], pa[1], pa[2], pa[3], pa[4], pa[5], pa[6], pa[7], pa[8], pa[9] != 0, pa[10],
         pa[11])
    over = _U32(0)
    under = _U32(0)
    nan = _U32(0)
    for i in range(src.size):
        r, e, o, un, n = _round_one_mx(src[i], p)
        dst[i] = e if codes else r
        over = _U32(over + o)
        under = _U32(under + un)
        nan = _U32(nan + n)
    return over, under, nan


@njit(cache=True, nogil=True)
def _round_blocks_mx(src, dst, pa, codes, counts, c0, c1):
    for c in range(c0, c1):
        lo = c * _CHUNK
        counts[c, 0], counts[c, 1], counts[c, 2] = _round_serial_mx(
            src[lo:lo + _CHUNK], dst[lo:lo + _CHUNK], pa, codes)


@functools.cache
def _params_mx(fmt: str, saturate: bool) -> tuple:
    f = FORMATS[fmt]
    m = f.man_bits
    shift = 23 - m
    bias = (1 << (f.exp_bits - 1)) - 1
    max_bits = _f32_bits(f.max_finite)
    max_enc = (max_bits >> shift) - ((127 - bias) << m)
    if fmt == "f8E8M0FNU":
        half, ovf_abs, ovf_enc = 1 << 22, (max_bits if saturate else _F32_INF), 0xFE
        return tuple(np.uint32(v) for v in (
            shift, half, (1 << shift) - 1, max_bits, 0, 0, 0, 0xFE, 0, 1, ovf_abs, ovf_enc))
    return tuple(np.uint32(v) for v in (
        shift, (1 << (shift - 1)) - 1, (1 << shift) - 1, max_bits, _f32_bits(f.min_normal),
        _f32_bits(f.min_subnormal * 2.0 ** 23), (127 - bias) << m, max_enc, 32 - f.bits, 0,
        0, 0))


@functools.cache
def _param_array(fmt: str, saturate: bool) -> np.ndarray:
    params = _params_mx if fmt in MX_ROUNDING_FORMATS else _params
    return np.array(params(fmt, saturate), dtype=np.uint32)


def _run(x: np.ndarray, out: np.ndarray, fmt: str, saturate: bool, codes: bool) -> Counts:
    # Views are taken here, outside the parallel kernel (numba can drop writes made through an
    # array view created inside a prange body).
    src, dst = x.reshape(-1).view(np.uint32), out.reshape(-1)
    if fmt in MX_ROUNDING_FORMATS:
        return _counted(_round_serial_mx, _round_blocks_mx, src, dst,
                        _param_array(fmt, saturate), codes)
    return _counted(_round_serial, _round_blocks, src, dst, _param_array(fmt, saturate), codes)


def _counted(serial, blocks, src: np.ndarray, *args) -> Counts:
    """serial(src, *args) on one thread for small arrays, else blocks(src, *args, counts) over
    chunks of src on the worker threads; the (overflow, underflow, nan) totals."""
    if src.size < SERIAL_BELOW:
        over, under, nan = serial(src, *args)
        return Counts(int(over), int(under), int(nan))
    counts = np.zeros(((src.size + _CHUNK - 1) // _CHUNK, 3), dtype=np.int64)
    run_blocks(blocks, counts.shape[0], src, *args, counts)
    total = counts.sum(axis=0)
    return Counts(int(total[0]), int(total[1]), int(total[2]))


# ---- a per-tensor scale and the rounding in one pass (mp.scaled_quant) ---------------------
# quantize_per_tensor's values are fl(round(fl(x * sf)) * inv): three numpy passes and two
# temporaries. The same float32 operations, one element at a time, give the same bits in one
# pass over memory, parallel over the same chunks as round_to.


@njit(cache=True, nogil=True)
def _scaled_serial(src, dst, pa, sf, inv):
    p = _param_tuple(pa)
    over = _U32(0)
    under = _U32(0)
    nan = _U32(0)
    for i in range(src.size):
        r, _, o, un = _round_one(np.float32(src[i] * sf).view(np.uint32), p)
        dst[i] = np.float32(_U32(r).view(np.float32) * inv)
        over = _U32(over + o)
        under = _U32(under + un)
        nan = _U32(nan + (_U32(r & _U32(0x7FFFFFFF)) > _U32(_F32_INF)))
    return over, under, nan


@njit(cache=True, nogil=True)
def _scaled_blocks(src, dst, pa, sf, inv, counts, c0, c1):
    for c in range(c0, c1):
        lo = c * _CHUNK
        counts[c, 0], counts[c, 1], counts[c, 2] = _scaled_serial(
            src[lo:lo + _CHUNK], dst[lo:lo + _CHUNK], pa, sf, inv)


_SCALE_ROUND_FORMATS = tuple(f for f in ENCODING_FORMATS if f not in MX_ROUNDING_FORMATS)


def scale_round(x: np.ndarray, fmt: str, sf: float, amax: float | None = None,
                overwrite: bool = False, counted: bool = True) -> tuple[np.ndarray, Counts | None]:
    """float32(round(float32(x * sf), fmt, saturating) * float32(1 / sf)) and the rounding's
    counts, in one pass: the values of mplower.numerics.mx.quantize_per_tensor, bit for bit,
    for the formats other than the MX element types (which it leaves to that function).

    `amax`, where the caller has it, must be max|x| exactly (as `amax` gives it): when it
    shows every scaled value finite, the rounding runs on `_scaled_finite_serial`, which has
    no NaN or infinity to handle and gives the same bits and counts about 2.5 times as fast.
    There, with `overwrite`, the values are written over x itself (which the caller must not
    need): the result stays in the cache lines the operand was read from, with no new array
    to fill. There too, without `counted` (a caller that keeps no counts: run_lowered), the
    counts are not taken and None comes back in their place: the same values, the kernel
    about 40% faster (the two count reductions in its loop cost that much)."""
    _check_format(fmt, _SCALE_ROUND_FORMATS, "scale_round")
    x = _f32_input(x, "scale_round")
    sf32 = np.float32(sf)
    inv = np.float32(1) / sf32
    # max|x * sf| is fl(amax * sf) (rounding is monotonic): every scaled value is finite
    # where that is.
    finite = None if amax is None or not sf32 > 0 else _finite_params(fmt)
    # The product of two float32 values is exact in float64, and rounds to a finite float32
    # below 2^128 - 2^103 (half an ulp past the largest): NaN and infinity fail the test too.
    if finite is not None and not float(np.float32(amax)) * float(sf32) < _F32_ROUNDS_TO_INF:
        finite = None
    if finite is not None and not counted:
        flat = x.reshape(-1)
        out = x if overwrite else np.empty_like(x)
        # One operand where it is written over: see below.
        args = (flat, finite, sf32, inv) if overwrite else (flat, out.reshape(-1), finite,
                                                           sf32, inv)
        kernel = _scaled_over_plain if overwrite else _scaled_plain
        chunks = (flat.size + _CHUNK - 1) // _CHUNK
        if flat.size < SERIAL_BELOW:
            kernel(*args, 0, chunks)
        else:
            run_blocks(kernel, chunks, *args)
        return out, None
    if finite is not None:
        if overwrite:  # one operand: a second that aliases it would fail numba's overlap
            # check and run the scalar loop
            return x, _counted(_scaled_over_serial, _scaled_over_blocks, x.reshape(-1),
                               finite, sf32, inv)
        out = np.empty_like(x)
        return out, _counted(_scaled_finite_serial, _scaled_finite_blocks, x.reshape(-1),
                             out.reshape(-1), finite, sf32, inv)
    out = np.empty_like(x)
    return out, _counted(_scaled_serial, _scaled_blocks, x.reshape(-1), out.reshape(-1),
                         _param_array(fmt, True), sf32, inv)


# ---- the same on data known to be finite once scaled ----------------------------------------
# Without NaN or infinity to keep, nearest-even needs no bit arithmetic: for |y| with leading
# bit 2^E (E at least the format's smallest normal exponent), C = 2^(E + 23 - m) has an ulp of
# exactly the format's spacing 2^(E - m) there, and |y| < 2^(E + 1) <= C keeps |y| + C within
# [C, 2C), so fl(fl(|y| + C) - C) is |y| rounded to nearest-even on the format's grid: normal
# and subnormal alike, in two FPU additions. E is capped at the first power of two above the
# format's largest finite (everything that high saturates whatever C it gets), which keeps C
# finite; the formats whose cap would not (bf16: C up to 2^143) use `_scaled_serial`.


_F32_ROUNDS_TO_INF = 2.0 ** 128 - 2.0 ** 103


@functools.cache
def _finite_params(fmt: str) -> np.ndarray | None:
    """(smallest normal's exponent bits, cap's exponent bits, 23 - m in the exponent field,
    largest finite's bits) as uint32, or None where C would not be finite."""
    f = FORMATS[fmt]
    emin = _f32_bits(f.min_normal) & _F32_INF
    cap = (_f32_bits(f.max_finite) & _F32_INF) + (1 << 23)  # 2^(E_max + 1)
    shift = (23 - f.man_bits) << 23
    if cap + shift >= _F32_INF:
        return None
    return np.array([emin, cap, shift, _f32_bits(f.max_finite)], np.uint32)


@njit(cache=True, inline="always")
def _scaled_finite_one(x, emin, cap, shift, max_bits, sf, inv):
    """One element of `_scaled_finite_serial`: (value, overflowed, underflowed)."""
    u = np.float32(x * sf).view(np.uint32)
    sign = _U32(u & _U32(0x80000000))
    a = _U32(u ^ sign)
    e = min(max(_U32(a & _U32(_F32_INF)), emin), cap)
    c = _U32(e + shift).view(np.float32)
    r = np.float32(np.float32(_U32(a).view(np.float32) + c) - c).view(np.uint32)
    over = r > max_bits
    r = max_bits if over else r
    under = a != _U32(0) and r == _U32(0)
    return np.float32(_U32(sign | r).view(np.float32) * inv), over, under


@njit(cache=True, nogil=True)
def _scaled_finite_serial(src, dst, pf, sf, inv):
    emin, cap, shift, max_bits = pf[0], pf[1], pf[2], pf[3]
    over = _U32(0)
    under = _U32(0)
    for i in range(src.size):
        dst[i], o, un = _scaled_finite_one(src[i], emin, cap, shift, max_bits, sf, inv)
        over = _U32(over + o)
        under = _U32(under + un)
    return over, under, _U32(0)


@njit(cache=True, nogil=True)
def _scaled_over_serial(data, pf, sf, inv):
    """`_scaled_finite_serial` writing over its operand."""
    emin, cap, shift, max_bits = pf[0], pf[1], pf[2], pf[3]
    over = _U32(0)
    under = _U32(0)
    for i in range(data.size):
        data[i], o, un = _scaled_finite_one(data[i], emin, cap, shift, max_bits, sf, inv)
        over = _U32(over + o)
        under = _U32(under + un)
    return over, under, _U32(0)


@njit(cache=True, nogil=True)
def _scaled_over_blocks(data, pf, sf, inv, counts, c0, c1):
    for c in range(c0, c1):
        lo = c * _CHUNK
        counts[c, 0], counts[c, 1], counts[c, 2] = _scaled_over_serial(
            data[lo:lo + _CHUNK], pf, sf, inv)


@njit(cache=True, nogil=True)
def _scaled_over_plain(data, pf, sf, inv, c0, c1):
    """`_scaled_over_serial`'s values, without its counts, over chunks c0 .. c1 - 1."""
    emin, cap, shift, max_bits = pf[0], pf[1], pf[2], pf[3]
    part = data[c0 * _CHUNK:min(data.size, c1 * _CHUNK)]
    for i in range(part.size):
        part[i] = _scaled_finite_one(part[i], emin, cap, shift, max_bits, sf, inv)[0]


@njit(cache=True, nogil=True)
def _scaled_plain(src, dst, pf, sf, inv, c0, c1):
    """`_scaled_finite_serial`'s values, without its counts, over chunks c0 .. c1 - 1."""
    emin, cap, shift, max_bits = pf[0], pf[1], pf[2], pf[3]
    lo, hi = c0 * _CHUNK, min(src.size, c1 * _CHUNK)
    s, d = src[lo:hi], dst[lo:hi]
    for i in range(s.size):
        d[i] = _scaled_finite_one(s[i], emin, cap, shift, max_bits, sf, inv)[0]


@njit(cache=True, nogil=True)
def _scaled_finite_blocks(src, dst, pf, sf, inv, counts, c0, c1):
    for c in range(c0, c1):
        lo = c * _CHUNK
        counts[c, 0], counts[c, 1], counts[c, 2] = _scaled_finite_serial(
            src[lo:lo + _CHUNK], dst[lo:lo + _CHUNK], pf, sf, inv)


@njit(cache=True, nogil=True)
def _amax_serial(bits):
    # On |x|'s bit patterns (sign cleared) unsigned order is float order, and every NaN lies
    # above +inf: an integer max, which vectorizes where a float max with NaNs does not.
    m = _U32(0)
    for i in range(bits.size):
        a = _U32(bits[i] & _U32(0x7FFFFFFF))
        m = max(m, a)
    return m


@njit(cache=True, nogil=True)
def _amax_blocks(bits, out, c0, c1):
    for c in range(c0, c1):
        lo = c * _CHUNK
        out[c] = _amax_serial(bits[lo:lo + _CHUNK])


def amax(x: np.ndarray) -> float:
    """float(np.max(np.abs(x))) of float32 data (NaN if any value is NaN, 0 if x is empty),
    in one pass without the temporary |x| (max is exact, so any order gives these bits)."""
    bits = _f32_input(x, "amax").reshape(-1).view(np.uint32)
    if bits.size < SERIAL_BELOW:
        m = _amax_serial(bits)
    else:
        parts = np.zeros((bits.size + _CHUNK - 1) // _CHUNK, np.uint32)
        run_blocks(_amax_blocks, parts.size, bits, parts)
        m = parts.max()
    return float("nan") if m > _F32_INF else float(np.uint32(m).view(np.float32))


@njit(cache=True, parallel=True)
def _gather_kernel(src, dst, table):
    for c in prange((src.size + _CHUNK - 1) // _CHUNK):
        s = src[c * _CHUNK:(c + 1) * _CHUNK]
        d = dst[c * _CHUNK:(c + 1) * _CHUNK]
        for i in range(s.size):
            d[i] = table[s[i]]


def _f32_input(x: np.ndarray, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"{what} expects float32 data, got {x.dtype}; cast with "
                        f".astype(np.float32) first (that is a rounding step of its own)")
    return np.asarray(x, order="C")  # (ascontiguousarray would turn 0-d into 1-d)


def _check_format(fmt: str, allowed: tuple[str, ...], what: str) -> None:
    if fmt not in allowed:
        raise ValueError(f"{what} does not handle format '{fmt}'; "
                         f"it handles {', '.join(allowed)}")


def round_to(x: np.ndarray, fmt: str, saturate: bool = False) -> tuple[np.ndarray, Counts]:
    """Round float32 `x` to format `fmt`; return the results as float32 and what happened.

    Equal bit for bit to `x.astype(T).astype(np.float32)` for the ml_dtypes/numpy type T of
    `fmt` (NaN payloads included) when `saturate` is false.
    """
    _check_format(fmt, ROUNDING_FORMATS, "round_to")
    x = _f32_input(x, "round_to")
    if fmt == "f32":
        return x.copy(), Counts(nan=int(np.count_nonzero(np.isnan(x))))
    out = np.empty_like(x)
    return out, _run(x, out.view(np.uint32), fmt, saturate, codes=False)


def encode_counted(x: np.ndarray, fmt: str,
                   saturate: bool = False) -> tuple[np.ndarray, Counts]:
    """`encode` plus the counts of `round_to`, from the same pass."""
    _check_format(fmt, ENCODING_FORMATS, "encode")
    x = _f32_input(x, "encode")
    out = np.empty(x.shape, dtype=np.uint16 if FORMATS[fmt].bits == 16 else np.uint8)
    return out, _run(x, out, fmt, saturate, codes=True)


def encode(x: np.ndarray, fmt: str, saturate: bool = False) -> np.ndarray:
    """Packed bit patterns of float32 `x` in `fmt`: uint16 for bf16/f16, uint8 for the rest (the
    6- and 4-bit formats in the low bits, as ml_dtypes stores them).

    Same rounding as `round_to`; equal to `x.astype(T).view(uint)` for the reference type T.
    """
    return encode_counted(x, fmt, saturate)[0]


def _decode_table(fmt: str) -> np.ndarray:
    """f32 bit pattern of every code of `fmt`, built with integer arithmetic once per format."""
    f = FORMATS[fmt]
    m = f.man_bits
    bias = (1 << (f.exp_bits - 1)) - 1
    codes = np.arange(1 << f.bits, dtype=np.int64)
    if fmt == "f8E8M0FNU":  # unsigned: code c is 2^(c - 127), and 0xFF is NaN
        return np.where(codes == 0xFF, _F32_INF | _F32_QNAN, codes << 23 | (codes == 0) << 22
                        ).astype(np.uint32)
    sign = (codes >> (f.bits - 1)) << 31
    e = (codes >> m) & ((1 << f.exp_bits) - 1)
    man = codes & ((1 << m) - 1)
    normal = (e + 127 - bias) << 23 | man << (23 - m)
    # A subnormal man * 2^(1-bias-m) has its leading one at bit position floor(log2(man)).
    lead = np.floor(np.log2(np.maximum(man, 1))).astype(np.int64)
    subnormal = np.where(man == 0, 0,
                         (lead + 127 - bias - m + 1) << 23 | ((man << (23 - lead)) & 0x7FFFFF))
    bits = np.where(e == 0, subnormal, normal)
    top = e == (1 << f.exp_bits) - 1
    if fmt == "f16":  # numpy keeps inf and the NaN payload
        bits = np.where(top, _F32_INF | man << (23 - m), bits)
    elif f.has_inf:  # ml_dtypes: inf, or the canonical quiet NaN
        bits = np.where(top, np.where(man == 0, _F32_INF, _F32_INF | _F32_QNAN), bits)
    elif f.has_nan:  # f8E4M3FN: only S.1111.111 is NaN, the rest of the top binade is finite
        bits = np.where(top & (man == (1 << m) - 1), _F32_INF | _F32_QNAN, bits)
    return (bits | sign).astype(np.uint32)


_DECODE_TABLES: dict[str, np.ndarray] = {}


def decode(bits: np.ndarray, fmt: str) -> np.ndarray:
    """float32 values of packed `bits` in `fmt` (uint16 for bf16/f16, uint8 for fp8)."""
    _check_format(fmt, ENCODING_FORMATS, "decode")
    want = np.uint16 if FORMATS[fmt].bits == 16 else np.uint8
    bits = np.asarray(bits, order="C")
    if bits.dtype != want:
        raise TypeError(f"decode('{fmt}') expects {np.dtype(want)} bit patterns, "
                        f"got {bits.dtype}")
    if fmt == "bf16":  # bf16 is the top half of an f32
        return (bits.astype(np.uint32) << 16).view(np.float32)
    table = _DECODE_TABLES.get(fmt)
    if table is None:
        table = _DECODE_TABLES[fmt] = _decode_table(fmt)
    out = np.empty(bits.shape, dtype=np.float32)
    _gather_kernel(bits.reshape(-1), out.reshape(-1).view(np.uint32), table)
    return out


@njit(cache=True)
def _round_f64_to_f16(t):
    """Nearest-even f16 value of a float64, as a float64 (the f16 of numpy's f64 -> f16 cast)."""
    a = abs(t)
    if not a < 65520.0:  # 65520 is the tie above 65504 that rounds to the would-be 65536
        return t if np.isnan(t) else np.copysign(np.inf, t)
    if a < 2.0 ** -14:
        # ulp of 2^28 is 2^-24, the smallest f16 subnormal: the addition rounds onto that grid
        r = (a + 2.0 ** 28) - 2.0 ** 28
    else:
        u = np.float64(a).view(np.uint64)
        u = (u + np.uint64((1 << 41) - 1) + ((u >> np.uint64(42)) & np.uint64(1))) \
            & ~np.uint64((1 << 42) - 1)
        r = np.uint64(u).view(np.float64)
    return np.copysign(r, t)


@njit(cache=True, parallel=True)
def _matmul_f16_accum_kernel(a, b, out):
    m, k = a.shape
    n = b.shape[1]
    for i in prange(m):
        acc = np.zeros(n, dtype=np.float64)
        for kk in range(k):
            aik = np.float64(a[i, kk])
            for j in range(n):
                acc[j] = _round_f64_to_f16(acc[j] + aik * np.float64(b[kk, j]))
        for j in range(n):
            out[i, j] = np.float32(acc[j])


def matmul_f16_accum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`a @ b` with an fp16 accumulator; `a` (M, K) and `b` (K, N) hold f16-representable f32.

    For each output c[i, j]: acc = +0; for k = 0, 1, ..., K-1: acc = f16(acc + a[i, k] * b[k, j]),
    where the product is exact (f16 x f16 fits an f32 significand) and the sum is rounded to f16
    once, to nearest-even, overflowing to ±inf. The sum is formed in float64; that can round
    when the exponents are far apart, but never onto an f16 tie the exact sum was not on, so the
    f16 result equals that of the exact sum (in float32 it would not: see the tests). Returns
    float32, where every f16 value is exact. That the inputs are f16 values is not checked:
    round them with `round_to(x, "f16")` first.
    """
    a = _f32_input(a, "matmul_f16_accum")
    b = _f32_input(b, "matmul_f16_accum")
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul_f16_accum needs (M, K) @ (K, N); got {a.shape} @ {b.shape}")
    out = np.empty((a.shape[0], b.shape[1]), dtype=np.float32)
    _matmul_f16_accum_kernel(a, b, out)
    return out
