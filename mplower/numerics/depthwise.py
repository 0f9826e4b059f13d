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

Each tap is one contiguous loop over the flattened padded planes of a channel in several
images (at every position, not only every stride-th: long contiguous loops vectorize), then
the outputs are picked. Channels are independent, handed to threads in blocks
(mplower.numerics.workers), and every output is the same sequence of operations wherever
its plane sits in a stack, so a result depends neither on the thread count nor on its batch.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from mplower.numerics.gemm import F32_EXACT, int_magnitude
from mplower.numerics.workers import run_blocks

# Below this many multiply-adds (about 1 ms on one core) one thread computes every plane.
_SERIAL_BELOW = 1 << 22
# Padded input elements stacked per tap loop (_planes): one 7x7 plane is too short a loop,
# a stack much larger than this leaves the L1/L2 cache.
_STACK = 4096


@njit(cache=True, nogil=True)
def _planes(x, w, scale, bias, y, multiplier, kh, kw, sh, sw, dh, dw, pt, pl, hp, wp, relu,
            group, o0, o1):
    """Output channels o0 .. o1 - 1 of y (N, O, Ho, Wo): channel o reads input channel
    o // multiplier of x (N, C, H, W) and weights w[o] (KH * KW). The padded planes of a
    channel in `group` images at a time are stacked, so that each tap is one loop over all of
    them; the positions between planes are computed and not used."""
    n, h, wd = x.shape[0], x.shape[2], x.shape[3]
    ho, wo = y.shape[2], y.shape[3]
    zero = y.dtype.type(0)
    plane, span = hp * wp, (wo - 1) * sw + 1
    stack = np.zeros((group, hp, wp), y.dtype)  # the padding stays zero
    src = stack.reshape(-1)
    acc = np.empty((group - 1) * plane + (ho - 1) * sh * wp + span, y.dtype)
    for o in range(o0, o1):
        # An absent bias adds -0.0, which changes no value (as the GEMM's epilogue).
        shift = bias[o] if bias.size else y.dtype.type(-0.0)
        factor = scale[o] if scale.size else y.dtype.type(1)
        for i0 in range(0, n, group):
            images = min(group, n - i0)
            for i in range(images):
                stack[i, pt:pt + h, pl:pl + wd] = x[i0 + i, o // multiplier]
            size = acc.size - (group - images) * plane
            acc[:size] = zero
            for ky in range(kh):
                for kx in range(kw):
                    weight = w[o, ky * kw + kx]
                    tap = src[ky * dh * wp + kx * dw:ky * dh * wp + kx * dw + size]
                    for j in range(size):
                        acc[j] += tap[j] * weight
            for i in range(images):
                for oy in range(ho):
                    start = i * plane + oy * sh * wp
                    row, out = acc[start:start + span:sw], y[i0 + i, o, oy]
                    for ox in range(wo):
                        v = row[ox] * factor + shift if scale.size else row[ox] + shift
                        out[ox] = zero if relu and v <= 0 else v


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


def depthwise_conv2d(x: np.ndarray, w: np.ndarray, strides: tuple[int, int],
                     padding: tuple[int, int, int, int], dilations: tuple[int, int], *,
                     scale: np.ndarray | None = None, bias: np.ndarray | None = None,
                     relu: bool = False) -> np.ndarray:
    """conv2d (mplower.numerics.conv) of x (N, C, H, W) with w (O, 1, KH, KW), groups C,
    zero-padded by (top, left, bottom, right), where `is_depthwise`: float32, or float64 if
    an operand is, exact int64 for integer operands (float32 with an epilogue), with the GEMM
    convolution's bits, its `scale` (integer operands), `bias` and `relu` epilogue included."""
    integer = x.dtype.kind in "iub"
    if integer or np.result_type(x, w) != np.float64:
        dtype = np.dtype(np.float32)
    else:
        dtype = np.dtype(np.float64)
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
    args = (np.ascontiguousarray(x, dtype), weights, factor, shift, y, o // c, kh, kw, sh, sw,
            dh, dw, pt, pl, hp, wp, relu, min(n, max(1, _STACK // (hp * wp))))
    if 0 < y.size * kh * kw < _SERIAL_BELOW:
        _planes(*args, 0, o)
    elif y.size:
        run_blocks(_planes, o, *args)
    epilogue = scale is not None or bias is not None or relu
    return y.astype(np.int64) if integer and not epilogue else y
