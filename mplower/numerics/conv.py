"""2-D convolution (NCHW input, OIHW weight) as one implicit GEMM per image and group, in NCHW.

Each image and group is the product  y (O/g, Ho*Wo) = w (O/g, Cg*KH*KW) @ cols (Cg*KH*KW,
Ho*Wo), where row (c, ky, kx) of `cols` (the im2col) holds the input pixels that meet weight
(c, ky, kx), and the result is already NCHW. Every output is the GEMM's fixed-order sum over
(input channel of its group, kernel row, kernel column) in that order (mplower.numerics.gemm),
so a pixel's result depends neither on its image, its neighbours nor the machine.

The im2col is never built: a work unit (image and group, a span of consecutive panels of
output pixels as wide as the register tile, a block of output channels) packs its panels of
`cols` straight from the padded input into a small buffer of its thread (L2-resident, reused
by every row tile of the unit) and runs the GEMM's tiles on them
(mplower.numerics.conv_gemm.conv_product): the same k order, the same bits as the product of
the materialized im2col, without writing and reading back K times the input. Threads claim units
with an atomic counter (mplower.numerics.workers.run_units). With one group the panels run
over the pixels of all the images in turn, so that an image's last panel is filled with the
next image's first pixels rather than with lanes that compute nothing (a 7x7 output filled 49
of 64; ResNet-50's 7x7 1x1 convs took 19% less at batch 8, docs/benchmarks.md). Depthwise
convolutions have their own direct kernel (mplower.numerics.depthwise); other groups of fewer
output channels than a register tile take the materialized im2col through `matmul`, which
streams such narrow products.

Integer operands are summed exactly: values whose products stay within float32's integers
(8-bit quantized values) are packed as float32, and the tiles split K into chunks so that no
partial sum leaves them (as `integer_matmul`); the result is np.matmul's int64 product at
float32 GEMM speed. A constant weight's chunks are as long as its own values allow
(IntegerWeights.chunk: the bound is the sum of |w| over a run times the largest input, not the
run's length times the largest product), which leaves most 8-bit convs one chunk, K. The
8-bit input stays 8-bit (padded as such) until the panels convert it as they pack it, and a
constant weight's float32 copy is made once (IntegerWeights): an int8 conv then costs what the
float32 conv costs (ResNet-50's convs at batch 1 had taken 9-15% longer, Inception v1's at
batch 8 13%; docs/benchmarks.md).

The ops that follow a conv in a network (a bias, the dequantize of an integer conv, a relu)
can run as the GEMM stores each output (`scale`, `bias`, `relu`), with the bits the separate
ops give, and without their passes over memory.
"""

from __future__ import annotations

import numpy as np

from mplower.numerics.conv_gemm import conv_product
from mplower.numerics.depthwise import depthwise_conv2d, is_depthwise
from mplower.numerics.gemm import F32_EXACT, TILE_ROWS, int_magnitude, integer_matmul, matmul
from mplower.numerics.quant import quantize as quant_quantize
from mplower.numerics.quant import store_table
from mplower.numerics.rounding import MX_ROUNDING_FORMATS, round_to
from mplower.numerics.rounding import amax as rounding_amax
from mplower.numerics.windows import conv_windows


def _padded(x: np.ndarray, padding: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """x zero-padded by (top, left, bottom, right), converted to `dtype` in the same copy."""
    pt, pl, pb, pr = padding
    if not any(padding):
        return x.astype(dtype, copy=False)
    out = np.zeros(x.shape[:2] + (x.shape[2] + pt + pb, x.shape[3] + pl + pr), dtype)
    out[:, :, pt:pt + x.shape[2], pl:pl + x.shape[3]] = x
    return out


def _padded_phases(x: np.ndarray, padding: tuple[int, ...], sw: int,
                   dtype: np.dtype) -> np.ndarray:
    """x (N, C, H, W) zero-padded by (top, left, bottom, right) to (Hp, Wp) and split into
    column phases, (N, C * sw, Hp, ceil(Wp / sw)): plane c * sw + p holds padded columns p,
    p + sw, ... of channel c (zero past Wp), so that a conv of column stride sw reads each
    kernel tap's pixels along an output row contiguously. One strided copy per phase, in
    `dtype` (padding first and splitting after cost two more passes over the input)."""
    pt, pl, pb, pr = padding
    n, c, h, w = x.shape
    hp, wq = h + pt + pb, -(-(w + pl + pr) // sw)
    out = np.zeros((n, c, sw, hp, wq), dtype)
    for p in range(sw):
        first = (p - pl) % sw  # the first column of x that lands in phase p
        j0, count = (first + pl) // sw, len(range(first, w, sw))
        out[:, :, p, pt:pt + h, j0:j0 + count] = x[:, :, :, first::sw]
    return out.reshape(n, c * sw, hp, wq)


class IntegerWeights:
    """A constant integer weight (O, C / groups, KH, KW) of the convolutions that read it many
    times (the executor's lowered plans), with what conv2d derives from it made once: the
    bound on its magnitude, its float32 copy where that bound is within float32's integers
    (the implicit GEMM reads it; it converted the weight on every call: 4 MB for ResNet-50's
    2048x512 1x1 conv), and the K chunks its sums need (`chunk`). conv2d(x, IntegerWeights(w))
    is conv2d(x, w), the same bits."""

    def __init__(self, w: np.ndarray) -> None:
        w = np.asarray(w)
        if w.ndim != 4 or w.dtype.kind not in "iu":
            raise ValueError(f"IntegerWeights: an integer (O, C, KH, KW) weight, not "
                             f"{w.dtype} {w.shape}")
        self.values, self.bound = w, int_magnitude(w)
        self.float32 = w.astype(np.float32) if self.bound <= F32_EXACT else None
        self._chunks: dict[int, int] = {}

    def chunk(self, x_bound: int) -> int:
        """The longest run of K (a filter's (c, ky, kx), in that order) that a float32 sum
        of products with inputs of magnitude at most x_bound keeps exact, for every filter and
        wherever the run starts: x_bound times the largest sum of |w| over any run of that
        length is at most 2^24, so every partial sum is an integer float32 holds. At least
        F32_EXACT // (x_bound * bound), the chunk the types alone allow (514 for uint8 times
        int8), and K where a whole filter fits (most 1x1 convs of 8-bit networks)."""
        if x_bound not in self._chunks:
            k = self.values[0].size if self.values.shape[0] else 0
            floor = F32_EXACT // max(1, x_bound * self.bound)
            if k <= floor or not x_bound:
                self._chunks[x_bound] = max(k, 1)
            else:
                runs = np.zeros((self.values.shape[0], k + 1), np.int64)
                np.cumsum(np.abs(self.values.reshape(-1, k).astype(np.int64)), axis=1,
                          out=runs[:, 1:])

                def fits(c: int) -> bool:
                    return int((runs[:, c:] - runs[:, :-c]).max()) * x_bound <= F32_EXACT
                lo, hi = floor, k  # fits(lo); find the largest c that fits
                if fits(hi):
                    lo = hi
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
                self._chunks[x_bound] = lo
        return self._chunks[x_bound]


def conv2d(x: np.ndarray, w: np.ndarray | IntegerWeights, strides: tuple[int, int],
           padding: tuple[int, int, int, int], dilations: tuple[int, int],
           groups: int, *, scale: np.ndarray | None = None, bias: np.ndarray | None = None,
           relu: bool = False, channels: np.ndarray | None = None,
           into: tuple[np.ndarray, int] | None = None,
           rounding: str | None = None, amax: list | None = None,
           requantize: tuple | None = None, quantize: tuple | None = None) -> np.ndarray:
    """The convolution of x (N, C, H, W), zero-padded by (top, left, bottom, right), with w
    (O, C / groups, KH, KW): float32 (float64 if an operand is) for float operands, exact
    int64 for integer operands.

    Epilogue, per output channel (float32 or float64 vectors of length O): `bias` added and
    `relu` applied as y + bias and np.maximum(y, 0) would; for integer operands a `scale` or
    `bias` makes the result float32(y) * scale + bias (DequantizeLinear of the int32 result
    with zero point 0, then Add), which needs 8-bit operands (int_magnitude). `channels`
    reads x's channels in that order (a depthwise conv only: depthwise_conv2d). `into` = (y,
    c0) writes a float32 result into channels c0 .. c0 + O - 1 of y (N, C, Ho, Wo) instead (a
    concatenation without the copy), where the implicit-GEMM path computes it (one group, at
    least TILE_ROWS output channels, float operands), and returns y; elsewhere the result is
    computed as usual and copied there. `rounding` (a round_to format) rounds a float32 result
    after its epilogue: in the implicit GEMM's tiles, while they are in cache, where each sum
    is stored once, else with round_to; the same kernel, so the same bits (with `into`, this
    conv's channels of the concatenation). `amax` (a list)
    is set to [rounding.amax of the result] (NaN if it holds one), taken as the implicit
    GEMM and the depthwise kernel store their outputs (what a following mp.scaled_quant
    needs, without its own pass), else by rounding.amax after. `requantize` (a depthwise
    conv only) quantizes and dequantizes the result as it is stored (depthwise_conv2d's).
    `quantize` = (scale, zero point, format), a float result, per tensor, to an 8-bit integer
    format: returns quant.quantize's integers of the result instead (its storage dtype),
    quantized by the implicit GEMM as it stores each tile, elsewhere after. `w` may be an
    IntegerWeights, whose float32 copy the implicit GEMM then reads."""
    prepared = w if isinstance(w, IntegerWeights) else None
    w = w.values if prepared is not None else w
    if quantize is not None:
        return _quantized(x, w, strides, padding, dilations, groups, scale, bias, relu,
                          channels, into, rounding, amax, requantize, quantize, prepared)
    found: list | None = None if amax is None else []
    if rounding is not None:
        if x.dtype.kind in "iub" or np.result_type(x, w) == np.float64:
            raise ValueError("conv2d: rounding applies to a float32 result")
        y, rounded = _conv2d(x, w, strides, padding, dilations, groups, scale, bias, relu,
                             channels, into, rounding, found)
        if not rounded and into is None:
            y, found = round_to(np.ascontiguousarray(y), rounding)[0], None if found is None else []
        elif not rounded:  # only this conv's channels of the concatenation
            c0, o = into[1], w.shape[0]
            y[:, c0:c0 + o] = round_to(np.ascontiguousarray(y[:, c0:c0 + o]), rounding)[0]
    else:
        y = _conv2d(x, w, strides, padding, dilations, groups, scale, bias, relu, channels,
                    into, None, found, requantize, prepared=prepared)[0]
    if amax is not None:
        if into is not None:  # the whole concatenation is the result
            found = []
        amax[:] = found or [rounding_amax(np.ascontiguousarray(y, np.float32))]
    return y


def _quantized(x, w, strides, padding, dilations, groups, scale, bias, relu, channels, into,
               rounding, amax, requantize, quantize, prepared) -> np.ndarray:
    """conv2d with `quantize`."""
    qscale, zp, fmt = quantize
    table = store_table(qscale, zp, fmt)
    if into is not None or rounding is not None or amax is not None or requantize is not None \
            or table is None or x.dtype.kind in "iub" and scale is None and bias is None \
            and not relu or np.result_type(x, w) == np.float64:
        raise ValueError("conv2d: quantize takes a float32 result, per tensor, to an 8-bit "
                         "integer format, without into, rounding, amax or requantize")
    qp = table[0]
    y, done = _conv2d(x, w, strides, padding, dilations, groups, scale, bias, relu, channels,
                      None, None, None, None, table, prepared)
    if done:
        return y
    return quant_quantize(np.ascontiguousarray(y, np.float32), qp[:1],
                          np.asarray(zp).reshape(1), fmt)[0]


def _conv2d(x: np.ndarray, w: np.ndarray, strides: tuple[int, int],
            padding: tuple[int, int, int, int], dilations: tuple[int, int], groups: int,
            scale: np.ndarray | None, bias: np.ndarray | None, relu: bool,
            channels: np.ndarray | None, into: tuple[np.ndarray, int] | None,
            rounding: str | None, amax: list | None = None,
            requantize: tuple | None = None,
            quantize: tuple | None = None,
            prepared: IntegerWeights | None = None) -> tuple[np.ndarray, bool]:
    """conv2d, and whether the result is rounded to `rounding` already (in the tiles); `amax`
    set to [its amax] where the kernel takes it as it stores (else left empty). With
    `quantize` (conv_product's), the bool says whether the result is the quantized one. `prepared`:
    w's IntegerWeights, where the caller has them."""
    if into is not None and x.dtype.kind in "iub" and scale is None and bias is None \
            and not relu:
        raise ValueError("conv2d: an integer result (no epilogue) cannot go `into` float32")
    if into is not None and (groups != 1 or w.shape[0] < TILE_ROWS
                             or into[0].dtype != np.float32
                             or np.result_type(x, w) == np.float64):
        y, c0 = into
        y[:, c0:c0 + w.shape[0]] = conv2d(x, w, strides, padding, dilations, groups,
                                         scale=scale, bias=bias, relu=relu, channels=channels)
        return y, False
    if is_depthwise(x, w, groups):  # the same sums, without im2col (numerics.depthwise)
        rounded = rounding if rounding not in MX_ROUNDING_FORMATS else None
        return depthwise_conv2d(x, w, strides, padding, dilations, scale=scale, bias=bias,
                                relu=relu, channels=channels, rounding=rounded, amax=amax,
                                requantize=requantize), rounded is not None
    if channels is not None or requantize is not None:
        raise ValueError("conv2d: an input channel order and requantize apply to a depthwise "
                         "conv only")
    integer = x.dtype.kind in "iub"
    bound = int_magnitude(x) * (prepared.bound if prepared is not None else int_magnitude(w)) \
        if integer else 0
    if integer and bound <= F32_EXACT:
        work = np.dtype(np.float32)
    elif integer:
        work = np.dtype(np.int64)
    else:  # float16 operands are computed in float32, as `matmul` does
        work = np.dtype(np.float64 if np.result_type(x, w) == np.float64 else np.float32)
    w = prepared.float32 if prepared is not None and work == np.float32 \
        else w.astype(work, copy=False)
    n, g = x.shape[0], groups
    o, cg, kh, kw = w.shape
    (sh, sw), (dh, dw) = strides, dilations
    ho = (x.shape[2] + padding[0] + padding[2] - dh * (kh - 1) - 1) // sh + 1
    wo = (x.shape[3] + padding[1] + padding[3] - dw * (kw - 1) - 1) // sw + 1
    wmat = np.ascontiguousarray(w.reshape(g, o // g, cg * kh * kw))
    if work.kind == "f" and o // g >= TILE_ROWS and n and ho * wo and cg * kh * kw:
        epilogue = scale is not None or bias is not None or relu
        out = np.dtype(np.int64) if integer and not epilogue else work
        chunk = cg * kh * kw if not integer or not bound else \
            prepared.chunk(int_magnitude(x)) if prepared is not None else F32_EXACT // bound
        # 8-bit integers stay 8-bit in the padded copy: the panels convert them as they pack
        # (a quarter of the copy's memory, and no conversion pass).
        stored = x.dtype if integer else work
        if kh == kw == 1 and (sh, sw) != (1, 1):
            # A strided 1x1 conv is a 1x1 stride-1 conv of the pixels it reads: one copy of
            # them, then panels read in place, instead of a strided gather over K planes per
            # panel.
            x, sh, sw = _padded(x, padding, stored)[:, :, ::sh, ::sw], 1, 1
        elif sw > 1:
            x = _padded_phases(x, padding, sw, stored)
        else:
            x = _padded(x, padding, stored)
        # Written in place where each sum is stored once (float32 sums over all of K); an
        # integer product summed in several chunks is copied there.
        exact = out == np.float32 and chunk >= cg * kh * kw
        target = None if into is None or not exact else (
            into[0].reshape(n, into[0].shape[1], -1), into[1])
        rounded = rounding if exact and wmat.dtype == np.float32 \
            and rounding not in MX_ROUNDING_FORMATS else None
        quantized = quantize if out == np.float32 and target is None else None
        y = conv_product(np.ascontiguousarray(x), wmat, (cg, kh, kw, sh, sw, dh, dw, ho, wo),
                         g, out, chunk, scale, bias, relu, target, rounded,
                         amax if rounding is None or rounded is not None else None, quantized)
        if target is not None:
            return into[0], rounded is not None
        y = y.reshape(n, o, ho, wo)
        if quantize is not None:
            return y, quantized is not None
        if into is not None:
            into[0][:, into[1]:into[1] + o] = y
            return into[0], False
        return y, rounded is not None
    x = _padded(x, padding, work)
    if kh == kw == 1 and sh == sw == 1:
        cols = x.reshape(n, g, cg, ho * wo)  # a view: the input is its own im2col
    else:
        view = conv_windows(x, (kh, kw), strides, dilations)
        cols = view.transpose(0, 1, 4, 5, 2, 3).reshape(n, g, cg * kh * kw, ho * wo)
    if integer:
        y = integer_matmul(wmat, cols, bound, scale=scale, bias=bias, relu=relu)
    else:
        y = matmul(wmat, cols, bias=bias, relu=relu)
    if into is not None:
        into[0][:, into[1]:into[1] + o] = y.reshape(n, o, ho, wo)
        return into[0], False
    return y.reshape(n, o, ho, wo), False
