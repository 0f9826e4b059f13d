"""2-D convolution (NCHW input, OIHW weight) as im2col on mplower's GEMM.

Every output is the GEMM's fixed-order sum over (input channel of its group, kernel row,
kernel column) in that order (mplower.numerics.gemm), so a pixel's result depends neither on
its image, its neighbours nor the machine. Integer operands are summed exactly: 8-bit values
go through im2col as float32 (every such integer is one) and `integer_matmul` keeps each
partial sum within float32's integers, so the result is np.matmul's int64 product at float32
GEMM speed instead of an int64 im2col and numpy's BLAS-less integer matmul.
"""

from __future__ import annotations

import numpy as np

from mplower.numerics.gemm import F32_EXACT, int_magnitude, integer_matmul, matmul


def conv2d(x: np.ndarray, w: np.ndarray, strides: tuple[int, int],
           dilations: tuple[int, int], groups: int) -> np.ndarray:
    """The convolution of an already padded x (N, C, H, W) with w (O, C / groups, KH, KW):
    float32 (float64 if x is) for float operands, exact int64 for integer operands."""
    integer = x.dtype.kind in "iub"
    if integer and int_magnitude(x) * int_magnitude(w) <= F32_EXACT:
        # Exact in float32 through im2col; integer_matmul checks the sums' range itself.
        x, w = x.astype(np.float32), w.astype(np.float32)
    elif integer:
        x, w = x.astype(np.int64), w.astype(np.int64)
    n, g = x.shape[0], groups
    o, cg, kh, kw = w.shape
    (sh, sw), (dh, dw) = strides, dilations
    view = np.lib.stride_tricks.sliding_window_view(
        x, (dh * (kh - 1) + 1, dw * (kw - 1) + 1), axis=(2, 3))
    win = view[:, :, ::sh, ::sw, ::dh, ::dw]
    ho, wo = win.shape[2:4]
    # im2col: one row per output pixel and group, one batched product for all groups.
    cols = (win.reshape(n, g, cg, ho, wo, kh, kw).transpose(0, 1, 3, 4, 2, 5, 6)
            .reshape(n, g, ho * wo, cg * kh * kw))
    wmat = w.reshape(g, o // g, cg * kh * kw).transpose(0, 2, 1)
    y = integer_matmul(cols, wmat) if integer else matmul(cols, wmat)
    return y.transpose(0, 1, 3, 2).reshape(n, o, ho, wo)
