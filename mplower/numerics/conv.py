"""2-D convolution (NCHW input, OIHW weight) as one implicit GEMM per image and group, in NCHW.

Each image and group is the product  y (O/g, Ho*Wo) = w (O/g, Cg*KH*KW) @ cols (Cg*KH*KW,
Ho*Wo), where row (c, ky, kx) of `cols` (the im2col) holds the input pixels that meet weight
(c, ky, kx), and the result is already NCHW. Every output is the GEMM's fixed-order sum over
(input channel of its group, kernel row, kernel column) in that order (mplower.numerics.gemm),
so a pixel's result depends neither on its image, its neighbours nor the machine.

The im2col is never built: a work unit (image and group, a panel of output pixels as wide as
the register tile, a block of output channels) packs its panel of `cols` straight from the
padded input into a small buffer of its thread (`_pack_panel`, L2-resident, reused by every
row tile of the unit) and runs the GEMM's tiles on it (`finish_tile`): the same micro kernel,
the same k order, the same bits as the product of the materialized im2col, without writing
and reading back K times the input. Threads claim units with an atomic counter
(mplower.numerics.workers.run_units). Convolutions with fewer output channels per group than
a register tile (depthwise ones, narrow groups) take the materialized im2col through `matmul`,
which streams such one-row products.

Integer operands are summed exactly: values whose products stay within float32's integers
(8-bit quantized values) are packed as float32, and the tiles split K into chunks so that no
partial sum leaves them (as `integer_matmul`); the result is np.matmul's int64 product at
float32 GEMM speed.

The ops that follow a conv in a network (a bias, the dequantize of an integer conv, a relu)
can run as the GEMM stores each output (`scale`, `bias`, `relu`), with the bits the separate
ops give, and without their passes over memory.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from mplower.numerics.gemm import (
    F32_EXACT,
    SERIAL_BELOW,
    TILE_ROWS,
    epilogue_table,
    finish_tile,
    int_magnitude,
    integer_matmul,
    matmul,
    panel_columns,
)
from mplower.numerics.windows import conv_windows
from mplower.numerics.workers import claim, run_units

# Work units to aim for when a conv has few pixel panels (batch 1, late layers): its output
# channels are then split into blocks too, so that two threads still share the work evenly.
_UNITS = 32


def _padded(x: np.ndarray, padding: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """x zero-padded by (top, left, bottom, right), converted to `dtype` in the same copy."""
    pt, pl, pb, pr = padding
    if not any(padding):
        return x.astype(dtype, copy=False)
    out = np.zeros(x.shape[:2] + (x.shape[2] + pt + pb, x.shape[3] + pl + pr), dtype)
    out[:, :, pt:pt + x.shape[2], pl:pl + x.shape[3]] = x
    return out


@njit(cache=True, nogil=True)
def _pack_panel(x, panel, image, channel0, shape, q0, cols, starts, offsets, lengths):
    """Output pixels q0 .. q0 + cols - 1 (row-major, zero past Ho*Wo) of the im2col of image
    `image`, input channels channel0 .. channel0 + Cg - 1, into panel as (K, cols) contiguous,
    row (c, ky, kx) at c * KH * KW + ky * KW + kx. shape = (Cg, KH, KW, sh, sw, dh, dw, Ho,
    Wo) over the padded x. A panel's pixels lie in runs along output rows; each run of a
    kernel tap is a strided strip of one input row, copied as one loop."""
    cg, kh, kw, sh, sw, dh, dw, ho, wo = shape
    hp, wp = x.shape[2], x.shape[3]
    plane = hp * wp
    flat = x.reshape(-1)
    width = min(cols, ho * wo - q0)
    runs, j = 0, 0
    while j < width:
        oy, ox = (q0 + j) // wo, (q0 + j) % wo
        starts[runs], offsets[runs] = j, oy * sh * wp + ox * sw
        lengths[runs] = min(width - j, wo - ox)
        j += lengths[runs]
        runs += 1
    base = (image * x.shape[1] + channel0) * plane
    row = 0
    for c in range(cg):
        for ky in range(kh):
            for kx in range(kw):
                src = base + c * plane + ky * dh * wp + kx * dw
                dst = row * cols
                for r in range(runs):
                    # Unsigned indices: numba's wrap-around of negative ones kept these copies
                    # from vectorizing (3 to 10 times slower).
                    d, o = np.uint64(dst + starts[r]), np.uint64(src + offsets[r])
                    if sw == 1:
                        for t in range(np.uint64(lengths[r])):
                            panel[d + t] = flat[o + t]
                    else:
                        for t in range(np.uint64(lengths[r])):
                            panel[d + t] = flat[o + t * np.uint64(sw)]
                for t in range(width, cols):
                    panel[dst + t] = 0
                row += 1


@njit(cache=True, nogil=True)
def _conv_units(x, w, c, shape, groups, cols, rows_per_unit, chunk, scale, bias, relu,
                counter, units):
    """The work units of c (N * G, O/G, Ho*Wo) claimed from `counter`: unit u is image-group
    u // (panels * blocks) (batch index n * G + g), then pixel panel, then a block of
    rows_per_unit output channels, so that consecutive units share a panel and a thread that
    claims them in a row packs it once. Returns the number of units done."""
    m, pixels, kk = c.shape[1], c.shape[2], w.shape[2]
    panels = (pixels + cols - 1) // cols
    blocks = (m + rows_per_unit - 1) // rows_per_unit
    panel = np.empty(kk * cols, w.dtype)
    tile, total = np.empty(TILE_ROWS * cols, w.dtype), np.empty(TILE_ROWS * cols, np.float64)
    starts, offsets, lengths = (np.empty(cols, np.int64), np.empty(cols, np.int64),
                                np.empty(cols, np.int64))
    # A 1x1 stride-1 conv's im2col is its input: full panels are read there in place (packing
    # them, a strided gather over K planes, cost more than it saved).
    in_place = shape[1] == shape[2] == shape[3] == shape[4] == 1
    flat, plane = x.reshape(-1), x.shape[2] * x.shape[3]
    packed, done = -1, 0
    while True:
        u = claim(counter)
        if u >= units:
            return done
        q, block = u // blocks, u % blocks
        batch, p = q // panels, q % panels
        g = batch % groups
        source, offset, ldp = panel, 0, cols
        if in_place and (p + 1) * cols <= pixels:
            source, offset, ldp = flat, (batch * kk) * plane + p * cols, plane
        elif q != packed:
            _pack_panel(x, panel, batch // groups, g * shape[0], shape, p * cols, cols, starts,
                        offsets, lengths)
            packed = q
        for i0 in range(block * rows_per_unit, min(m, (block + 1) * rows_per_unit),
                        TILE_ROWS):
            finish_tile(w, (g * m + i0) * kk, source, offset, ldp, c, batch, i0, p * cols,
                        cols, chunk, scale, bias, relu, tile, total)
        done += 1


def _implicit_gemm(x: np.ndarray, wmat: np.ndarray, shape: tuple[int, ...], groups: int,
                   out: np.dtype, chunk: int, scale: np.ndarray | None,
                   bias: np.ndarray | None, relu: bool) -> np.ndarray:
    """c (N * G, O/G, Ho*Wo) of the padded x and the (G, O/G, K) weights, as `conv2d`."""
    n, m, kk = x.shape[0], wmat.shape[1], wmat.shape[2]
    c = np.empty((n * groups, m, shape[7] * shape[8]), out)
    cols = panel_columns(wmat.dtype)
    panels = n * groups * ((c.shape[2] + cols - 1) // cols)
    tiles = (m + TILE_ROWS - 1) // TILE_ROWS
    split = min(tiles, -(-_UNITS // panels))
    rows_per_unit = TILE_ROWS * -(-tiles // split)
    blocks = -(-m // rows_per_unit)
    args = (x, wmat, c, tuple(int(v) for v in shape), groups, cols, rows_per_unit, chunk,
            epilogue_table(scale, np.dtype(np.float32), m),
            epilogue_table(bias, wmat.dtype if scale is None else np.dtype(np.float32), m),
            relu)
    if c.size * max(kk, 1) < SERIAL_BELOW:
        _conv_units(*args, np.zeros(1, np.int64), panels * blocks)
    else:
        run_units(_conv_units, panels * blocks, *args)
    return c


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
    wmat = np.ascontiguousarray(w.reshape(g, o // g, cg * kh * kw))
    if work.kind == "f" and o // g >= TILE_ROWS and n and ho * wo and cg * kh * kw:
        epilogue = scale is not None or bias is not None or relu
        out = np.dtype(np.int64) if integer and not epilogue else work
        chunk = F32_EXACT // bound if integer and bound else cg * kh * kw
        y = _implicit_gemm(np.ascontiguousarray(x), wmat, (cg, kh, kw, sh, sw, dh, dw, ho, wo),
                           g, out, chunk, scale, bias, relu)
        return y.reshape(n, o, ho, wo)
    if kh == kw == 1 and sh == sw == 1:
        cols = x.reshape(n, g, cg, ho * wo)  # a view: the input is its own im2col
    else:
        view = conv_windows(x, (kh, kw), strides, dilations)
        cols = view.transpose(0, 1, 4, 5, 2, 3).reshape(n, g, cg * kh * kw, ho * wo)
    if integer:
        y = integer_matmul(wmat, cols, bound, scale=scale, bias=bias, relu=relu)
    else:
        y = matmul(wmat, cols, bias=bias, relu=relu)
    return y.reshape(n, o, ho, wo)
