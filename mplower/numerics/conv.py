"""2-D convolution (NCHW input, OIHW weight) as one GEMM per image and group, in NCHW.

Each image and group is the product  y (O/g, Ho*Wo) = w (O/g, Cg*KH*KW) @ cols (Cg*KH*KW,
Ho*Wo), where row (c, ky, kx) of `cols` holds the input pixels that meet weight (c, ky, kx):
the rows are contiguous strips of the input (the input itself for a 1x1, stride-1 conv), and
the result is already NCHW. Every output is the GEMM's fixed-order sum over (input channel of
its group, kernel row, kernel column) in that order (mplower.numerics.gemm), so a pixel's
result depends neither on its image, its neighbours nor the machine. Grouped and depthwise
convs are the same batched product (a depthwise conv is a one-row product per channel, which
the GEMM streams): no loop over groups.

Integer operands are summed exactly: values whose products stay within float32's integers
(8-bit quantized values) go through im2col as float32, and `integer_matmul` splits K so that
no partial sum leaves them; the result is np.matmul's int64 product at float32 GEMM speed.

The ops that follow a conv in a network (a bias, the dequantize of an integer conv, a relu)
can run as the GEMM stores each output (`scale`, `bias`, `relu`), with the bits the separate
ops give, and without their passes over memory.
"""

from __future__ import annotations

import numpy as np

from mplower.numerics.depthwise import depthwise_conv2d, is_depthwise
from mplower.numerics.gemm import F32_EXACT, int_magnitude, integer_matmul, matmul
from mplower.numerics.windows import conv_windows


def _padded(x: np.ndarray, padding: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """x zero-padded by (top, left, bottom, right), converted to `dtype` in the same copy."""
    pt, pl, pb, pr = padding
    if not any(padding):
        return x.astype(dtype, copy=False)
    out = np.zeros(x.shape[:2] + (x.shape[2] + pt + pb, x.shape[3] + pl + pr), dtype)
    out[:, :, pt:pt + x.shape[2], pl:pl + x.shape[3]] = x
    return out


def conv2d(x: np.ndarray, w: np.ndarray, strides: tuple[int, int],
           padding: tuple[int, int, int, int], dilations: tuple[int, int],
           groups: int, *, scale: np.ndarray | None = None, bias: np.ndarray | None = None,
           relu: bool = False) -> np.ndarray:
    """The convolution of x (N, C, H, W), zero-padded by (top, left, bottom, right), with w
    (O, C / groups, KH, KW): float32 (float64 if an operand is) for float operands, exact
    int64 for integer operands.

    Epilogue, per output channel (float32 or float64 vectors of length O): `bias` added and
    `relu` applied as y + bias and np.maximum(y, 0) would; for integer operands a `scale` or
    `bias` makes the result float32(y) * scale + bias (DequantizeLinear of the int32 result
    with zero point 0, then Add), which needs 8-bit operands (int_magnitude)."""
    if is_depthwise(x, w, groups):  # the same sums, without im2col (numerics.depthwise)
        return depthwise_conv2d(x, w, strides, padding, dilations, scale=scale, bias=bias,
                                relu=relu)
    integer = x.dtype.kind in "iub"
    bound = int_magnitude(x) * int_magnitude(w) if integer else 0
    if integer and bound <= F32_EXACT:
        work = np.dtype(np.float32)
    elif integer:
        work = np.dtype(np.int64)
    else:
        work = np.result_type(x, w)
    x, w = _padded(x, padding, work), w.astype(work, copy=False)
    n, g = x.shape[0], groups
    o, cg, kh, kw = w.shape
    (sh, sw), (dh, dw) = strides, dilations
    ho = (x.shape[2] - dh * (kh - 1) - 1) // sh + 1
    wo = (x.shape[3] - dw * (kw - 1) - 1) // sw + 1
    if kh == kw == 1 and sh == sw == 1:
        cols = x.reshape(n, g, cg, ho * wo)  # a view: the input is its own im2col
    else:
        view = conv_windows(x, (kh, kw), strides, dilations)
        cols = view.transpose(0, 1, 4, 5, 2, 3).reshape(n, g, cg * kh * kw, ho * wo)
    wmat = w.reshape(g, o // g, cg * kh * kw)
    if integer:
        y = integer_matmul(wmat, cols, bound, scale=scale, bias=bias, relu=relu)
    else:
        y = matmul(wmat, cols, bias=bias, relu=relu)
    return y.reshape(n, o, ho, wo)
