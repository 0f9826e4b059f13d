"""Depthwise 2-D convolution (groups = input channels, one weight plane per output channel)
as a direct compiled kernel, with the bits of the GEMM convolution (mplower.numerics.conv).

A depthwise conv is a product with K = KH * KW (9 for 3x3) per output channel, far too short
for a GEMM to pay: im2col copies every input nine times, and the GEMM streams one-row matrices.
Here each output plane is computed from its input plane alone, in the GEMM's order,

    acc = +0;  for ky, kx in row-major order:  acc = fl(acc + fl(x[...] * w[o, ky, kx]))

then the epilogue (`acc + bias`, then relu as np.maximum(y, 0)) as the GEMM stores it, so the
results are the GEMM convolution's bit for bit (products and sums rounded once each, never
fused: numba emits no fast-math flags). Padding is a zero-bordered copy of the input plane,
as the GEMM path's padded input: a zero times a weight is the same product there and here.

Integer operands (8-bit quantized values) run the same kernel on their float32 values, as the
GEMM path does: every product and partial sum of K such products is an integer below 2**24,
so float32 sums them exactly, and the result is the exact int64 sum, or with an epilogue
float32(sum) * scale + bias, then relu, as `integer_matmul` stores it.

The planes of a channel in several images are stacked, padded and split by stride phase
(mplower.numerics.windows.split_plane), so that each tap of every output of the stack is one
unit-stride run: a 3x3 window's nine products are summed in a register per output (one
output per SIMD lane), without the every-position work and picking of a strided window, and
other windows take one pass over the sums per tap. Work units (a channel and a stack of
images) are claimed by threads in compiled code (mplower.numerics.workers.run_units), and
every output is the same sequence of operations wherever its plane sits in a stack, so a
result depends neither on the thread count nor on its batch.

A stride-1 conv whose output keeps the input's size (ShuffleNet's and MobileNet's 3x3 with
one pixel of padding) takes a cheaper layout (`_same_units`): its planes are stacked with
their padding rows but without padding columns, so a plane goes in and its outputs come out
as one contiguous run each instead of a short run per row. A tap whose column falls outside
the plane reads the neighbouring row's element there and adds +0 instead of its product
(`_plane9_masked`): the padding's product 0 * w is +-0, and adding +-0 or +0 to a sum that
started at +0 gives the same bits (such a sum is never -0: x + y is -0 only where both are).
With a weight that is not finite 0 * w is NaN, so those convs keep the padded layout.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit

from mplower.numerics import jitcache  # noqa: F401  (before the first jitted function)
from mplower.numerics.formats import FORMATS
from mplower.numerics.gemm import F32_EXACT, amax_of_bits, int_magnitude
from mplower.numerics.gemm_kernel import prefetch_read
from mplower.numerics.quant import _fake_one
from mplower.numerics.rounding import (
    MX_ROUNDING_FORMATS,
    _param_array,
    _param_tuple,
    rounded_bits,
)
from mplower.numerics.windows import keep, split_plane, split_shape, split_stack, tap_offsets
from mplower.numerics.workers import borrowed, claim, run_units

# Below this many multiply-adds (a few tenths of a ms on one core) one thread computes every
# plane: handing units to a worker costs tens of microseconds, a time slice on a busy machine.
_SERIAL_BELOW = 1 << 22
# Padded input elements stacked per work unit (_units): a loop over one 7x7 plane is too
# short to run as vector code, a stack much larger than this leaves the L1/L2 cache.
_STACK = 4096


@njit(cache=True, nogil=True, inline="always")
def _prefetch_planes(flat, plane, channels, c, i0, images):
    """Ask for the planes (`plane` elements each) of channel c of images i0.. of x (N, C, H,
    W) flattened, which the next work unit reads: a unit's planes lie a whole image apart,
    runs too short for the hardware prefetchers (ShuffleNet b8's depthwise convs ran 1.4x
    faster with this, caches flushed between convs)."""
    for g in range(images):
        start = ((i0 + g) * channels + c) * plane
        for k in range(start, start + plane, 64 // flat.itemsize):  # a hint per 64-byte line
            prefetch_read(flat, k)


@njit(cache=True, nogil=True, inline="always")
def _round_sums(bits, n, rp):
    """The first n sums (their float32 bit patterns) rounded as round_to rounds them."""
    for q in range(n):
        bits[q] = rounded_bits(bits[q], rp)


@njit(cache=True, nogil=True, inline="always")
def _fake_quantize(out, s, z, lo, hi):
    """out = quant.fake_quantizer's values of out, in place (quant._fake_one: one array, so
    the loop vectorizes; quant._quantize_span over out as both operands would see them
    overlap and not)."""
    for q in range(out.size):
        out[q] = _fake_one(out[q], s, z, lo, hi)[0]


@njit(cache=True, nogil=True, inline="always")
def _kept_amax(bits, slot, hq, wq, ho, wo, largest):
    """max(largest, the largest |output| bit pattern of plane g = `slot` of a stack's sums
    (their bits), over the outputs that `keep` keeps)."""
    mask = np.uint32(0x7FFFFFFF)
    for oy in range(ho):
        # Unsigned indices: no view per row, no check for a negative index.
        row = np.uint64((slot * hq + oy) * wq)
        for ox in range(np.uint64(wo)):
            largest = max(largest, np.uint32(bits[row + ox] & mask))
    return largest


@njit(cache=True, nogil=True)
def _plane9(out, flat, taps, w, factor, shift, scaled, relu):
    """out[q] = the epilogue of the nine taps flat[q + taps[t]] * w[t] summed in order from
    +0, each sum held in a register (one output per SIMD lane)."""
    n, zero = out.size, out.dtype.type(0)
    t0, t1, t2 = flat[taps[0]:], flat[taps[1]:], flat[taps[2]:]
    t3, t4, t5 = flat[taps[3]:], flat[taps[4]:], flat[taps[5]:]
    t6, t7, t8 = flat[taps[6]:], flat[taps[7]:], flat[taps[8]:]
    w0, w1, w2, w3, w4, w5, w6, w7, w8 = w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8]
    for q in range(n):
        acc = zero
        acc += t0[q] * w0
        acc += t1[q] * w1
        acc += t2[q] * w2
        acc += t3[q] * w3
        acc += t4[q] * w4
        acc += t5[q] * w5
        acc += t6[q] * w6
        acc += t7[q] * w7
        acc += t8[q] * w8
        v = acc * factor + shift if scaled else acc + shift
        out[q] = zero if relu and v <= zero else v


@njit(cache=True, nogil=True)
def _plane(out, flat, taps, w, factor, shift, scaled, relu):
    """`_plane9` for any number of taps: each tap one pass over the sums in `out`."""
    n, zero = out.size, out.dtype.type(0)
    out[:] = zero
    for t in range(taps.size):
        tap, weight = flat[taps[t]:], w[t]
        for q in range(n):
            out[q] += tap[q] * weight
    for q in range(n):
        v = out[q] * factor + shift if scaled else out[q] + shift
        out[q] = zero if relu and v <= zero else v


@njit(cache=True, nogil=True)
def _plane9_masked(out, flat, taps, w, masks, factor, shift, scaled, relu):
    """`_plane9` where tap t adds +0 instead of its product at the q where masks[t % 3, q]
    is 0 (its column is outside the plane)."""
    n, zero = out.size, out.dtype.type(0)
    t0, t1, t2 = flat[taps[0]:], flat[taps[1]:], flat[taps[2]:]
    t3, t4, t5 = flat[taps[3]:], flat[taps[4]:], flat[taps[5]:]
    t6, t7, t8 = flat[taps[6]:], flat[taps[7]:], flat[taps[8]:]
    m0, m1, m2 = masks[0, :n], masks[1, :n], masks[2, :n]
    w0, w1, w2, w3, w4, w5, w6, w7, w8 = w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8]
    for q in range(n):
        a, b, c = m0[q] != 0, m1[q] != 0, m2[q] != 0
        acc = zero
        acc += t0[q] * w0 if a else zero
        acc += t1[q] * w1 if b else zero
        acc += t2[q] * w2 if c else zero
        acc += t3[q] * w3 if a else zero
        acc += t4[q] * w4 if b else zero
        acc += t5[q] * w5 if c else zero
        acc += t6[q] * w6 if a else zero
        acc += t7[q] * w7 if b else zero
        acc += t8[q] * w8 if c else zero
        v = acc * factor + shift if scaled else acc + shift
        out[q] = zero if relu and v <= zero else v


@njit(cache=True, nogil=True)
def _plane_masked(out, flat, taps, w, masks, factor, shift, scaled, relu):
    """`_plane9_masked` for any number of taps (KW = masks.shape[0] per row of taps): each
    tap one pass over the sums in `out`."""
    n, zero, kw = out.size, out.dtype.type(0), masks.shape[0]
    out[:] = zero
    for t in range(taps.size):
        tap, weight, mask = flat[taps[t]:], w[t], masks[t % kw, :n]
        for q in range(n):
            out[q] += tap[q] * weight if mask[q] != 0 else zero
    for q in range(n):
        v = out[q] * factor + shift if scaled else out[q] + shift
        out[q] = zero if relu and v <= zero else v


@njit(cache=True, nogil=True)
def _same_units(x, w, scale, bias, y, multiplier, channels, taps, masks, pt, pl, hq, relu,
                rounding, rpa, parts, fq, group, counter, units):
    """`_units` for a stride-1, dilation-1 conv with y's planes the size of x's (H, W): the
    planes of a unit stacked at rows g * Hq + pt of width W (Hq = H + KH - 1; the rows
    between them are zeros) after pl elements, so that output q = (g * Hq + oy) * W + ox
    reads tap (ky, kx) at q + taps[ky * KW + kx], where masks[kx, q] says whether its column
    is inside the plane. With `rounding`, the outputs are rounded (rounding._round_one with
    the parameters `rpa`) after the epilogue, while they are in cache; with `parts` (one per
    unit), parts[u] is the largest |output| of unit u as a float32 bit pattern with the sign
    cleared."""
    # Views without reference counts (workers.borrowed), the caller holding the arrays.
    x, w, scale, bias, y = borrowed(x), borrowed(w), borrowed(scale), borrowed(bias), borrowed(y)
    channels, taps, masks, rpa = borrowed(channels), borrowed(taps), borrowed(masks), borrowed(rpa)
    parts, fq = borrowed(parts), borrowed(fq)
    n, c, h, wd = x.shape
    o_count, plane = y.shape[1], h * wd
    xf, yf = x.reshape(-1), y.reshape(-1)
    groups = (n + group - 1) // group
    flat = np.zeros(group * hq * wd + masks.shape[0] - 1, y.dtype)  # padding rows stay zero
    sums = np.empty(group * hq * wd, y.dtype)
    bits, rp = sums.view(np.uint32), _param_tuple(rpa)
    done = 0
    u = claim(counter)
    while u < units:
        o, i0 = u // groups, u % groups * group
        images = min(group, n - i0)
        if o + 1 < o_count:
            _prefetch_planes(xf, plane, c, channels[(o + 1) // multiplier], i0, images)
        for g in range(images):
            # Equal bounded 1-D views: no 2-D view of a plane to make, loops that vectorize.
            at = ((i0 + g) * c + channels[o // multiplier]) * plane
            start = pl + (g * hq + pt) * wd
            src, dst = xf[at:at + plane], flat[start:start + plane]
            for j in range(plane):
                dst[j] = src[j]
        shift = bias[o] if bias.size else y.dtype.type(-0.0)
        factor = scale[o] if scale.size else y.dtype.type(1)
        out = sums[:((images - 1) * hq + h) * wd]
        if taps.size == 9:
            _plane9_masked(out, flat, taps, w[o], masks, factor, shift, scale.size > 0, relu)
        else:
            _plane_masked(out, flat, taps, w[o], masks, factor, shift, scale.size > 0, relu)
        if rounding:
            _round_sums(bits, out.size, rp)
        if fq.shape[1]:
            _fake_quantize(out, fq[0, o], fq[1, o], fq[2, 0], fq[3, 0])
        largest = np.uint32(0)
        for g in range(images):
            at = ((i0 + g) * o_count + o) * plane
            src, dst = sums[g * hq * wd:g * hq * wd + plane], yf[at:at + plane]
            for j in range(plane):
                dst[j] = src[j]
            if parts.size:  # a plane's outputs are one run of the sums here
                run = bits[g * hq * wd:g * hq * wd + plane]
                for j in range(plane):
                    largest = max(largest, np.uint32(run[j] & np.uint32(0x7FFFFFFF)))
        if parts.size:
            parts[u] = largest
        done += 1
        u = claim(counter)
    return done


@njit(cache=True, nogil=True)
def _units(x, w, scale, bias, y, multiplier, channels, taps, strides, split, pt, pl, relu,
           rounding, rpa, parts, fq, group, counter, units):
    """Work units claimed from `counter` (workers.run_units) until `units`: unit u is output
    channel u // g of images (u % g) * group .. + group - 1 of y (N, O, Ho, Wo), g the number
    of such image groups; channel o reads input channel o // multiplier, which is channel
    channels[o // multiplier] of x (N, C, H, W),
    the planes of a unit split together (windows.split_plane, split_stack; `split` = (Hq,
    Wq)), and weights w[o] (KH * KW) at `taps` (windows.tap_offsets). Returns the number of
    units done."""
    # Views without reference counts (workers.borrowed), the caller holding the arrays.
    x, w, scale, bias, y = borrowed(x), borrowed(w), borrowed(scale), borrowed(bias), borrowed(y)
    channels, taps, rpa, parts = borrowed(channels), borrowed(taps), borrowed(rpa), borrowed(parts)
    fq = borrowed(fq)
    n = x.shape[0]
    ho, wo = y.shape[2], y.shape[3]
    (sh, sw), (hq, wq) = strides, split
    xf, plane = x.reshape(-1), x.shape[2] * x.shape[3]
    groups = (n + group - 1) // group
    rows = np.zeros((sh, group * hq, wq * sw), y.dtype)  # the padding stays zero
    cols = np.zeros((sw, sh * group * hq * wq), y.dtype)
    sums = np.empty(group * hq * wq, y.dtype)
    bits, rp = sums.view(np.uint32), _param_tuple(rpa)
    done = 0
    u = claim(counter)
    while u < units:
        o, i0 = u // groups, u % groups * group
        images = min(group, n - i0)
        if o + 1 < y.shape[1]:
            _prefetch_planes(xf, plane, x.shape[1], channels[(o + 1) // multiplier], i0,
                             images)
        for g in range(images):
            split_plane(x[i0 + g, channels[o // multiplier]], rows, cols, hq, g, pt, pl)
        flat = split_stack(rows, cols)
        # An absent bias adds -0.0, which changes no value (as the GEMM's epilogue).
        shift = bias[o] if bias.size else y.dtype.type(-0.0)
        factor = scale[o] if scale.size else y.dtype.type(1)
        out = sums[:((images - 1) * hq + ho - 1) * wq + wo]
        if taps.size == 9:
            _plane9(out, flat, taps, w[o], factor, shift, scale.size > 0, relu)
        else:
            _plane(out, flat, taps, w[o], factor, shift, scale.size > 0, relu)
        if rounding:
            _round_sums(bits, out.size, rp)
        if fq.shape[1]:
            _fake_quantize(out, fq[0, o], fq[1, o], fq[2, 0], fq[3, 0])
        for g in range(images):
            keep(sums, g, hq, wq, y[i0 + g, o])
        if parts.size:
            largest = np.uint32(0)
            for g in range(images):
                largest = _kept_amax(bits, g, hq, wq, ho, wo, largest)
            parts[u] = largest
        done += 1
        u = claim(counter)
    return done


def is_depthwise(x: np.ndarray, w: np.ndarray, groups: int) -> bool:
    """Whether conv2d(x, w, groups=groups) is a depthwise conv this kernel computes: one
    input channel per group (any number of output channels per group), float operands or
    integers whose sums float32 holds exactly."""
    if groups != x.shape[1] or w.shape[1] != 1:
        return False
    if x.dtype.kind == "f" and w.dtype.kind == "f":
        return True
    taps = w.shape[2] * w.shape[3]
    return (x.dtype.kind in "iub" and w.dtype.kind in "iub"
            and int_magnitude(x) * int_magnitude(w) * taps <= F32_EXACT)


@functools.lru_cache(maxsize=256)
def _same_tables(group: int, hp: int, wd: int, kh: int, kw: int,
                 pl: int) -> tuple[np.ndarray, np.ndarray]:
    """`_same_units`' tap offsets and column masks for a stack of `group` planes of hp rows
    (padding included) and wd columns: a network calls each geometry once per inference, and
    building them took 25-60 us, as long as a batch-1 depthwise conv itself. Read only."""
    # Output q of a stack reads column q % W + kx - pl for tap column kx.
    column = np.arange(group * hp * wd) % wd
    masks = np.stack([(column + kx - pl >= 0) & (column + kx - pl < wd)
                      for kx in range(kw)]).astype(np.uint8)
    taps = (np.arange(kh * kw) // kw * wd + np.arange(kh * kw) % kw).astype(np.int64)
    masks.flags.writeable = taps.flags.writeable = False
    return taps, masks


@functools.lru_cache(maxsize=256)
def _split_tables(out: tuple[int, int], kernel: tuple[int, int], strides: tuple[int, int],
                  dilations: tuple[int, int], group: int) -> tuple[tuple[int, int], np.ndarray]:
    """`_units`' phase shape and tap offsets, once per geometry (as `_same_tables`)."""
    split = split_shape(out, kernel, strides, dilations)
    taps = tap_offsets(kernel, strides, dilations, split, group)
    taps.flags.writeable = False
    return split, taps


def depthwise_conv2d(x: np.ndarray, w: np.ndarray, strides: tuple[int, int],
                     padding: tuple[int, int, int, int], dilations: tuple[int, int], *,
                     scale: np.ndarray | None = None, bias: np.ndarray | None = None,
                     relu: bool = False, channels: np.ndarray | None = None,
                     rounding: str | None = None, amax: list | None = None,
                     requantize: tuple | None = None) -> np.ndarray:
    """conv2d (mplower.numerics.conv) of x (N, C, H, W) with w (O, 1, KH, KW), groups C,
    zero-padded by (top, left, bottom, right), where `is_depthwise`: float32, or float64 if
    an operand is, exact int64 for integer operands (float32 with an epilogue), with the GEMM
    convolution's bits, its `scale` (integer operands), `bias` and `relu` epilogue included.

    `channels` (C indices) convolves x[:, channels] instead of x, without the copy: the
    executor folds a channel shuffle into the depthwise conv that reads it. `rounding` (a
    round_to format, not an MX one) rounds a float32 result after its epilogue, as round_to
    would, while each unit's outputs are in cache. `amax` (a list) is set to [the amax of
    a float32 result] (rounding.amax), taken from each unit's outputs as it stores them.
    `requantize` = (scales, zero points, dtype), one scale and zero point per output channel
    (float32, int), an integer format of quant: a float32 result is quantized and dequantized
    as it is stored (quant.fake_quantizer's bits, on axis 1), instead of rounded."""
    integer = x.dtype.kind in "iub"
    if integer or np.result_type(x, w) != np.float64:
        dtype = np.dtype(np.float32)
    else:
        dtype = np.dtype(np.float64)
    if rounding is not None and (dtype != np.float32 or rounding in MX_ROUNDING_FORMATS):
        raise ValueError("depthwise_conv2d: rounding applies to a float32 result, in a format "
                         "of round_to other than the MX ones")
    rounds = (rounding is not None, _param_array(rounding or "bf16", False))
    fq = np.zeros((4, 0), np.float32)
    if requantize is not None:
        scales, zps, fmt = requantize
        f = FORMATS[fmt]
        if rounding is not None or dtype != np.float32 or f.is_float \
                or np.shape(scales) != (w.shape[0],) or np.shape(zps) != (w.shape[0],):
            raise ValueError("depthwise_conv2d: requantize takes one scale and zero point per "
                             "output channel of a float32 result, in an integer format")
        fq = np.empty((4, w.shape[0]), np.float32)  # rows filled in place: no np.stack
        fq[0], fq[1], fq[2], fq[3] = scales, zps, f.min_value, f.max_finite
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = strides, dilations, padding
    hp, wp = h + pt + pb, wd + pl + pr
    ho = (hp - dh * (kh - 1) - 1) // sh + 1
    wo = (wp - dw * (kw - 1) - 1) // sw + 1
    y = np.empty((n, o, ho, wo), dtype)
    weights = np.ascontiguousarray(w, dtype).reshape(o, kh * kw)
    factor = np.empty(0, dtype) if scale is None else np.ascontiguousarray(scale, dtype).reshape(o)
    shift = np.empty(0, dtype) if bias is None else np.ascontiguousarray(bias, dtype).reshape(o)
    group = min(n, max(1, _STACK // (hp * wp)))
    units = o * -(-n // group)
    parts = np.zeros(units if amax is not None and dtype == np.float32 else 0, np.uint32)
    channels = np.arange(c) if channels is None else np.asarray(channels, np.int64)
    if channels.shape != (c,) or c and not 0 <= channels.min() <= channels.max() < c:
        raise ValueError(f"depthwise_conv2d: channels must be {c} indices below {c}")
    # Integer operands stay as they are: the kernels convert each element as they copy its plane
    # (exactly: 8-bit values), instead of a pass over x before.
    operand = np.ascontiguousarray(x) if integer else np.ascontiguousarray(x, dtype)
    if (sh, sw, dh, dw) == (1, 1, 1, 1) and (ho, wo) == (h, wd) and wd > 0 \
            and np.isfinite(weights).all():
        kernel = _same_units
        taps, masks = _same_tables(group, hp, wd, kh, kw, pl)
        args = (operand, weights, factor, shift, y, o // c, channels,
                taps, masks, pt, pl, hp, relu, *rounds, parts, fq, group)
    else:
        kernel = _units
        split, taps = _split_tables((ho, wo), (kh, kw), tuple(strides), tuple(dilations), group)
        args = (operand, weights, factor, shift, y, o // c, channels,
                taps, (int(sh), int(sw)), split, pt, pl, relu, *rounds, parts, fq, group)
    if 0 < y.size * kh * kw < _SERIAL_BELOW:
        kernel(*args, np.zeros(1, np.int64), units)
    elif y.size:
        run_units(kernel, units, *args)
    if amax is not None and dtype == np.float32:
        amax[:] = [amax_of_bits(parts.max() if parts.size else np.uint32(0))]
    epilogue = scale is not None or bias is not None or relu
    return y.astype(np.int64) if integer and not epilogue else y
