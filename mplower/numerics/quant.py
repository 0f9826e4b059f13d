"""Linear quantization, exactly as ONNX QuantizeLinear / DequantizeLinear define it.

`quantize` computes q = saturate(round(x / scale) + zero_point): the division in float32, round
half to even, saturation to the integer range of the target format from FORMATS (i8, ui8, i4;
i4 values are stored in int8). Scale and zero point are per tensor (scalars), per axis (1-D,
of length x.shape[axis]) or, with `block_size` B > 0, per block of B consecutive elements along
`axis` (ONNX opset 21 blocked quantization: x's rank, x's shape but ceil(D / B) along axis,
`blocked_scale_shape`). The f8 and f4 formats are accepted as ONNX accepts them: zero point 0,
the float32 quotient rounded once by the rounding kernel, saturating unless `saturate=False`,
and returned as uint8 bit patterns. `dequantize` computes (q - zero_point) * scale in float32;
for i32 (biases) ONNX requires a zero zero point, and so do we.

Both run as one numba pass over memory, which for `quantize` also counts what quantization did
(as the `Counts` of the rounding kernels): `overflow` is the number of values clamped to the
integer range (±inf included); `underflow` the number of non-zero values whose quotient rounds
to 0, i.e. that dequantize to exactly 0; `nan` the number of NaN quotients (NaN inputs, 0/0),
which ONNX leaves undefined for integer outputs and which quantize to the zero point here. For
the f8 formats the counts are those of `round_to`. Results agree bit for bit with onnx.reference
wherever the reference is defined; it casts the rounded quotient to int32 before clamping, so
for quotients beyond ±2^31 it wraps where the ONNX spec (and this module) saturates.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
from numba import njit

from mplower.numerics.formats import (
    FORMATS,
    QUANT_FLOATS,
    QUANT_INTS,
    QUANT_STORAGE,
    QUANT_WIDE,
)
from mplower.numerics.rounding import SERIAL_BELOW, Counts, decode, encode_counted
from mplower.numerics.workers import run_blocks

# The numerics quantize to fp8 too (the ONNX frontend's float8 QDQ); mp.quantize itself holds
# integers only (QUANT_STORAGE).
QUANT_FORMATS = QUANT_INTS + QUANT_FLOATS
DEQUANT_FORMATS = QUANT_STORAGE + QUANT_FLOATS


_CHUNK = 1 << 16
# Channel runs shorter than this (per-axis on a trailing axis) switch channel every few
# elements; for them the scales are laid out per element of one period instead, so that the
# inner loop reads them as a vector.
_SHORT_RUN = 64
_U32 = np.uint32


@njit(cache=True, error_model="numpy")
def _quantize_one(x, s, z, lo, hi):
    r = np.rint(x / s)  # float32 division, then half to even, as ONNX
    q = r + z  # exact below 2^24; anything larger saturates either way
    is_nan = np.isnan(q)
    clamped = q < lo or q > hi
    q = max(min(q, hi), lo)
    return np.int32(z if is_nan else q), clamped, r == 0 and x != 0, is_nan


def store_table(scale, zero_point, fmt: str) -> tuple[np.ndarray, np.dtype] | None:
    """For a per-tensor quantize to an 8-bit integer format, done by a kernel as it stores
    each value (`_quantize_one` on float32): (scale, zero point, lowest, highest) as float32,
    and the format's storage dtype; None for anything else."""
    f = FORMATS.get(fmt)
    if f is None or not f.is_int or f.bits != 8 or np.size(scale) != 1 \
            or np.size(zero_point) != 1:
        return None
    # Made once per (scale, zero point, format), by bit pattern (-0.0 is not 0.0): a static
    # int8 plan's kernels ask for it on every call. The array is shared: read it only.
    key = np.array([np.asarray(scale).reshape(()), np.asarray(zero_point).reshape(())],
                   np.float32).view(np.uint32)
    return _store_table(int(key[0]), int(key[1]), fmt)


@functools.lru_cache(maxsize=4096)
def _store_table(scale_bits: int, zero_point_bits: int, fmt: str) -> tuple[np.ndarray, np.dtype]:
    f = FORMATS[fmt]
    table = np.array([scale_bits, zero_point_bits], np.uint32).view(np.float32)
    return np.array([table[0], table[1], f.min_value, f.max_finite], np.float32), f.storage


@njit(cache=True, error_model="numpy")
def _fake_one(x, s, z, lo, hi):
    """`_quantize_one`, returning (q - z) * s in float32 (as _dequantize_span computes it from
    the stored q) instead of q."""
    q, o, u, n = _quantize_one(x, s, z, lo, hi)
    return np.float32(np.int32(q - np.int32(z))) * s, o, u, n


@njit(cache=True, error_model="numpy")
def _quantize_span(xs, qs, ss, zs, lo, hi, fake):
    """Quantize one span that shares its scales: a scalar (size 1) or one per element. With
    `fake`, qs (float32) gets `_fake_one`'s dequantized values instead of q."""
    over = _U32(0)
    under = _U32(0)
    nan = _U32(0)
    one = ss.size == 1
    for j in range(xs.size):
        s, z = (ss[0], zs[0]) if one else (ss[j], zs[j])
        if fake:
            qs[j], o, u, n = _fake_one(xs[j], s, z, lo, hi)
        else:
            qs[j], o, u, n = _quantize_one(xs[j], s, z, lo, hi)
        over, under, nan = _U32(over + o), _U32(under + u), _U32(nan + n)
    return over, under, nan


@njit(cache=True, error_model="numpy")
def _dequantize_span(qs, ys, ss, zs):
    # The difference is exact in int32 (8-bit values, or i32 with a zero zero point); ONNX
    # then rounds it to float32 (a no-op except for large i32 values) and multiplies in float32.
    if ss.size == 1:
        s = ss[0]
        z = np.int32(zs[0])
        for j in range(qs.size):
            ys[j] = np.float32(np.int32(np.int32(qs[j]) - z)) * s
    else:
        for j in range(qs.size):
            ys[j] = np.float32(np.int32(np.int32(qs[j]) - np.int32(zs[j]))) * ss[j]


@njit(cache=True, error_model="numpy")
def _span(i, stop, period, per_element, n_scales):
    """End of the span starting at flat index i, and which slice of the scale table it uses."""
    offset = i % period
    end = min(stop, i + period - offset)
    if per_element:
        return end, offset, offset + end - i
    k = (i // period) % n_scales
    return end, k, k + 1


@njit(cache=True, error_model="numpy")
def _quantize_chunk(x, scale, zero_point, period, per_element, lo, hi, out, counts, fake,
                    c):
    i = c * _CHUNK
    stop = min(x.size, i + _CHUNK)
    over = 0
    under = 0
    nan = 0
    while i < stop:
        end, a, b = _span(i, stop, period, per_element, scale.size)
        o, u, n = _quantize_span(x[i:end], out[i:end], scale[a:b], zero_point[a:b], lo, hi,
                                 fake)
        over += o
        under += u
        nan += n
        i = end
    counts[c, 0] = over
    counts[c, 1] = under
    counts[c, 2] = nan


@njit(cache=True, nogil=True, error_model="numpy")
def _quantize_blocks(x, scale, zero_point, period, per_element, lo, hi, out, counts, fake, c0,
                     c1):
    for c in range(c0, c1):
        _quantize_chunk(x, scale, zero_point, period, per_element, lo, hi, out, counts, fake, c)


@njit(cache=True, error_model="numpy")
def _quantize_serial(x, scale, zero_point, period, per_element, lo, hi, out, counts, fake):
    for c in range(counts.shape[0]):
        _quantize_chunk(x, scale, zero_point, period, per_element, lo, hi, out, counts, fake, c)


@njit(cache=True, error_model="numpy")
def _dequantize_chunk(q, scale, zero_point, period, per_element, out, c):
    i = c * _CHUNK
    stop = min(q.size, i + _CHUNK)
    while i < stop:
        end, a, b = _span(i, stop, period, per_element, scale.size)
        _dequantize_span(q[i:end], out[i:end], scale[a:b], zero_point[a:b])
        i = end


@njit(cache=True, nogil=True, error_model="numpy")
def _dequantize_blocks(q, scale, zero_point, period, per_element, out, c0, c1):
    for c in range(c0, c1):
        _dequantize_chunk(q, scale, zero_point, period, per_element, out, c)


@njit(cache=True, error_model="numpy")
def _dequantize_serial(q, scale, zero_point, period, per_element, out):
    for c in range((q.size + _CHUNK - 1) // _CHUNK):
        _dequantize_chunk(q, scale, zero_point, period, per_element, out, c)


def _scale_table(s: np.ndarray, zp: np.ndarray, post: int):
    """(scales, zero points, period, per_element) as the kernels walk them (see _SHORT_RUN)."""
    if post >= _SHORT_RUN or s.size == 1:
        return s, zp, post, False
    return np.repeat(s, post), np.repeat(zp, post), s.size * post, True


def blocked_scale_shape(shape: tuple[int, ...], axis: int, block_size: int) -> tuple[int, ...]:
    """The shape of a blocked scale (ONNX opset 21): x's, with ceil(D / block_size) on axis."""
    axis %= len(shape)
    return tuple(-(-d // block_size) if i == axis else d for i, d in enumerate(shape))


def _unblock(shape: tuple[int, ...], v, axis: int, block_size: int, name: str,
             what: str) -> np.ndarray:
    """A blocked scale or zero point repeated over its blocks: one entry per element."""
    v = np.asarray(v)
    if v.size == 1:
        return v
    want = blocked_scale_shape(shape, axis, block_size)
    if v.shape != want:
        raise ValueError(f"{what}: a blocked {name} for shape {list(shape)} with block_size "
                         f"{block_size} on axis {axis % len(shape)} must have shape "
                         f"{list(want)}, got {list(v.shape)}")
    full = np.repeat(v, block_size, axis=axis % len(shape))
    return np.ascontiguousarray(full[tuple(slice(0, d) for d in shape)])


def _channels(shape: tuple[int, ...], scale, zero_point, axis: int | None,
              what: str) -> tuple[np.ndarray, np.ndarray, int, tuple[int, ...]]:
    """Validate a per-tensor or per-axis scale / zero point against data of `shape`.

    Returns the scales (float32) and zero points (int64) as 1-D arrays of one entry per
    channel, the number of consecutive elements that share a channel ("post": the product of
    the dimensions after `axis`), and the shape that broadcasts a channel vector against the data.
    """
    s = np.asarray(scale)
    if isinstance(scale, (float, int)):  # a Python number: ONNX stores scales as float32
        s = s.astype(np.float32)
    if s.dtype != np.float32:
        raise TypeError(f"{what}: scale must be float32 (as in ONNX), got {s.dtype}")
    broadcast = [1] * len(shape)
    if axis is None and s.size > 1 and s.shape == tuple(shape):
        # One scale per element (an unblocked blocked scale): every element its own channel.
        post, broadcast = 1, list(shape)
    elif axis is None:
        if s.size != 1:
            raise ValueError(f"{what}: a per-tensor scale must be a scalar, got shape "
                             f"{s.shape}; pass axis= for per-axis scales")
        post = max(1, int(np.prod(shape)))
    else:
        if not -len(shape) <= axis < len(shape):
            raise ValueError(f"{what}: axis {axis} is out of range for rank {len(shape)}")
        axis %= len(shape)
        if s.ndim != 1 or s.size != shape[axis]:
            raise ValueError(f"{what}: a per-axis scale must be 1-D of length "
                             f"shape[{axis}] = {shape[axis]}, got shape {s.shape}")
        post = max(1, int(np.prod(shape[axis + 1:])))
        broadcast[axis] = s.size
    s = np.ascontiguousarray(s.reshape(-1))
    zp = np.zeros(1, np.int64) if zero_point is None else \
        np.asarray(zero_point).astype(np.int64).reshape(-1)
    if zp.size == 1 and s.size != 1:
        zp = np.full(s.size, zp[0], dtype=np.int64)
    if zp.size != s.size:
        raise ValueError(f"{what}: zero_point has {zp.size} values but scale has {s.size}")
    return s, zp, post, tuple(broadcast)


def quantize(x: np.ndarray, scale: np.ndarray | float, zero_point: np.ndarray | int | None,
             dtype: str, axis: int | None = None, saturate: bool = True,
             block_size: int = 0) -> tuple[np.ndarray, Counts]:
    """ONNX QuantizeLinear of float32 `x` to `dtype`; returns (q, counts).

    q is stored in FORMATS[dtype].storage (int8 for i8 and i4, uint8 for ui8 and the f8/f4 bit
    patterns). `saturate` only matters for the float formats, as in ONNX: integers always
    saturate.
    """
    if dtype not in QUANT_FORMATS + QUANT_WIDE:
        raise ValueError(f"quantize: unsupported dtype '{dtype}'; "
                         f"supported: {', '.join(QUANT_FORMATS + QUANT_WIDE)}")
    x = np.asarray(x, order="C")
    if x.dtype != np.float32:
        raise TypeError(f"quantize expects float32 data, got {x.dtype}")
    if block_size:
        scale = _unblock(x.shape, scale, axis or 0, block_size, "scale", "quantize")
        zero_point = None if zero_point is None else _unblock(
            x.shape, zero_point, axis or 0, block_size, "zero_point", "quantize")
        axis = None
    s, zp, post, broadcast = _channels(x.shape, scale, zero_point, axis, "quantize")
    f = FORMATS[dtype]
    if f.is_float:
        if np.any(zp != 0):
            raise ValueError(f"quantize: the zero point of {dtype} must be 0 (ONNX)")
        # ONNX divides in float32 and rounds the quotient once, to the f8 format.
        return encode_counted(x / s.reshape(broadcast), dtype, saturate)
    return _quantize_ints(x, _int_table(f, s, zp, post, dtype))


def _int_table(f, s: np.ndarray, zp: np.ndarray, post: int, dtype: str) -> tuple:
    """What the integer quantize kernels read, from `_channels`' scales and zero points."""
    if not np.all((zp >= f.min_value) & (zp <= f.max_finite)):
        raise ValueError(f"quantize: zero_point outside the {dtype} range "
                         f"[{int(f.min_value)}, {int(f.max_finite)}]")
    s, zp, period, per_element = _scale_table(s, zp.astype(np.float32), post)
    return s, zp, period, per_element, np.float32(f.min_value), np.float32(f.max_finite), \
        f.storage


def _quantize_ints(x: np.ndarray, table: tuple,
                   fake: bool = False) -> tuple[np.ndarray, Counts]:
    """The integer quantize of contiguous float32 x with `_int_table`'s table; with `fake`,
    its dequantize with the same scales and zero points (float32), in the same pass."""
    s, zp, period, per_element, lo, hi, storage = table
    out = np.empty(x.shape, dtype=np.float32 if fake else storage)
    counts = np.zeros(((x.size + _CHUNK - 1) // _CHUNK, 3), dtype=np.int64)
    # Small tensors on one thread, as in rounding.py (SERIAL_BELOW says why).
    args = (x.reshape(-1), s, zp, period, per_element, lo, hi, out.reshape(-1), counts, fake)
    if x.size < SERIAL_BELOW:
        _quantize_serial(*args)
    else:
        run_blocks(_quantize_blocks, counts.shape[0], *args)
    total = counts.sum(axis=0)
    return out, Counts(int(total[0]), int(total[1]), int(total[2]))


def _prepared_table(shape: tuple[int, ...], scale: np.ndarray | float,
                    zero_point: np.ndarray | int | None, dtype: str,
                    axis: int | None) -> tuple | None:
    """`_int_table`'s table for the integer quantize of x of `shape`, or None where `quantize`
    would refuse it or it is not an integer format."""
    f = FORMATS.get(dtype)
    if dtype not in QUANT_FORMATS or f.is_float:
        return None
    try:
        s, zp, post, _ = _channels(shape, scale, zero_point, axis, "quantize")
        return _int_table(f, s, zp, post, dtype)
    except (ValueError, TypeError):
        return None


def quantizer(shape: tuple[int, ...], scale: np.ndarray | float,
              zero_point: np.ndarray | int | None, dtype: str, axis: int | None = None,
              block_size: int = 0) -> Callable[[np.ndarray], tuple[np.ndarray, Counts]]:
    """`quantize(x, scale, zero_point, dtype, axis, block_size=block_size)` for the many x of
    one `shape` (an executor's op): the checks and scale tables of an integer format made
    once, the same kernels per call, so the same bits and counts. Anything else (another
    shape, a float or blocked format, a zero point out of range) goes through `quantize`,
    which checks it and raises its errors."""
    def checked(x: np.ndarray) -> tuple[np.ndarray, Counts]:
        return quantize(x, scale, zero_point, dtype, axis, block_size=block_size)
    table = None if block_size else _prepared_table(shape, scale, zero_point, dtype, axis)
    if table is None:
        return checked

    def run(x: np.ndarray) -> tuple[np.ndarray, Counts]:
        if x.dtype != np.float32 or x.shape != shape or not x.flags.c_contiguous:
            return checked(x)
        return _quantize_ints(x, table)
    return run


def fake_quantizer(shape: tuple[int, ...], scale: np.ndarray | float,
                   zero_point: np.ndarray | int | None, dtype: str,
                   axis: int | None = None) -> Callable[[np.ndarray], np.ndarray] | None:
    """dequantize(quantize(x, scale, zero_point, dtype, axis), scale, zero_point, axis) for
    the many float32 x of one `shape`, in one pass that never stores the integers: the same
    float32 bits as the two calls. None where `quantizer` would not make its own kernels
    (a float or blocked format, a zero point out of range, scales that do not fit shape)."""
    table = _prepared_table(shape, scale, zero_point, dtype, axis)
    if table is None:
        return None

    def run(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        if x.shape != shape:
            raise ValueError(f"fake quantize: expected shape {list(shape)}, got {list(x.shape)}")
        return _quantize_ints(x, table, fake=True)[0]
    return run


def dequantize(q: np.ndarray, scale: np.ndarray | float,
               zero_point: np.ndarray | int | None = None, axis: int | None = None,
               dtype: str | None = None, block_size: int = 0) -> np.ndarray:
    """ONNX DequantizeLinear: (q - zero_point) * scale in float32.

    The integer format is read from q's dtype (int8, uint8, int32); pass `dtype` for uint8
    arrays that hold f8/f4 bit patterns ("f8E4M3FN", "f8E5M2", "f4E2M1FN"), or float32 arrays
    that hold their values (as the executor keeps them).
    """
    q = np.asarray(q, order="C")
    if block_size:
        scale = _unblock(q.shape, scale, axis or 0, block_size, "scale", "dequantize")
        zero_point = None if zero_point is None else _unblock(
            q.shape, zero_point, axis or 0, block_size, "zero_point", "dequantize")
        axis = None
    s, zp, post, broadcast = _channels(q.shape, scale, zero_point, axis, "dequantize")
    if dtype is not None and dtype not in DEQUANT_FORMATS + QUANT_WIDE:
        raise ValueError(f"dequantize: unsupported dtype '{dtype}'; "
                         f"supported: {', '.join(DEQUANT_FORMATS + QUANT_WIDE)}")
    values = dtype is not None and FORMATS[dtype].is_float and q.dtype == np.float32
    if dtype is not None and q.dtype != FORMATS[dtype].storage and not values:
        raise TypeError(f"dequantize: {dtype} values are stored as {FORMATS[dtype].storage}, "
                        f"got {q.dtype}")
    if dtype is not None and FORMATS[dtype].is_float:
        if np.any(zp != 0):
            raise ValueError(f"dequantize: the zero point of {dtype} must be 0 (ONNX)")
        return (q if values else decode(q, dtype)) * s.reshape(broadcast)
    if q.dtype not in (np.int8, np.uint8, np.int16, np.uint16, np.int32):
        raise TypeError(f"dequantize expects int8, uint8, int16, uint16 or int32 values, got "
                        f"{q.dtype}")
    if q.dtype == np.int32 and np.any(zp != 0):
        raise ValueError("dequantize: int32 values (biases) need a zero zero_point (ONNX)")
    info = np.iinfo(q.dtype)
    if not np.all((zp >= info.min) & (zp <= info.max)):
        raise ValueError(f"dequantize: zero_point outside the {q.dtype} range")
    out = np.empty(q.shape, dtype=np.float32)
    s, zp, period, per_element = _scale_table(s, zp.astype(np.int32), post)
    args = (q.reshape(-1), s, zp, period, per_element, out.reshape(-1))
    if q.size < SERIAL_BELOW:
        _dequantize_serial(*args)
    else:
        run_blocks(_dequantize_blocks, (q.size + _CHUNK - 1) // _CHUNK, *args)
    return out
