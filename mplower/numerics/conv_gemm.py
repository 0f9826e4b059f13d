"""The implicit-GEMM convolution: mplower's float matrix product with b the im2col of an image.

`conv_product` is the product of mplower.numerics.gemm (the same register tiles,
mplower.numerics.gemm_kernel, the same k order, the same bits as the product of the
materialized im2col), with b packed panel by panel straight from the padded image
(mplower.numerics.conv prepares it). Its tiles start from +0 and apply the epilogue to the
registers as they store them (`_stored_kernel`), rows past the last full tile in blocks of 4,
2 and 1. numba's cache of these kernels is stamped with every file they inline from
(mplower.numerics.jitcache), so they may live apart from the tile functions they inline.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from mplower.numerics import gemm, jitcache  # noqa: F401  (jitcache: before the first kernel)
from mplower.numerics.gemm import _epilogue_table, amax_of_bits
from mplower.numerics.gemm_kernel import (
    _VECTORS,
    TILE_ROWS,
    _finish_tile,
    _panel_columns,
    _stored1,
    _stored2,
    _stored4,
    _stored8,
    address,
    prefetch_read,
)
from mplower.numerics.quant import _quantize_one
from mplower.numerics.rounding import (
    MX_ROUNDING_FORMATS,
    _param_array,
    _param_tuple,
    plain_bf16,
    plain_f16,
    rounded_bits,
)
from mplower.numerics.workers import borrowed, claim, run_units

# Work units to aim for when a convolution has few pixel panels (batch 1, late layers): its
# output channels are then split into blocks too, so that two threads still share the work.
_UNITS = 32
# How far ahead (in panels) the rows of an in-place panel are prefetched: 8 images of a 1x1
# 128->16 conv at 55x55 on one thread took 1.13 ms without, 0.83 / 0.83 / 0.81 ms at 2 / 4 /
# 8 panels (min of 36 runs each, interleaved).
_PREFETCH_PANELS = 4
# Consecutive pixel panels per work unit, each row tile running over all of them, so that each
# output row is written in runs of up to 8 panels (1 KiB) instead of one (128 bytes), while the
# packed panels of a span fit in _SPAN_BYTES (a quarter of this Zen 5 core's L2; a span of
# ResNet-50's 3x3 256-channel panels, 295 KB each, is one panel, as before). 1, 2, 4 and 8
# measured in docs/benchmarks.md.
_SPAN, _SPAN_BYTES = 8, 1 << 18
# A 1x1 conv of this many output channels or more packs its panels too: each packed panel then
# serves that many rows from contiguous memory (in place, a panel's K rows lie a plane apart).
# SqueezeNet's final 1000x512 conv at batch 8 took 5.95 against 6.71 ms, ResNet-50's 512->1024
# 23.7 against 25.9; 16 to 256 channels were as fast or faster in place (docs/benchmarks.md).
_PACK_1X1_ROWS = 512
# So does one of _PACK_1X1_DEEP input channels or more whose input (_PACK_1X1_BYTES or more)
# is beyond this VM's caches: a panel's K rows then lie on K pages, more than the first-level
# TLB holds, each row read from memory, while `_convert_span` reads each plane's run for a
# span of panels once. Batch 8, two threads, medians of 25 interleaved calls: SqueezeNet's
# 128->16 at 55x55 2.77 against 4.33 ms, ResNet-50's 256->64 at 56x56 11.7 against 13.0,
# 512->128 at 28x28 8.8 against 10.4; smaller inputs were level or slower (512->256 at 14x14,
# 3.2 MB: 6.5 against 5.5; 128->16 at batch 1: 0.37 against 0.31).
_PACK_1X1_DEEP, _PACK_1X1_BYTES = 128, 8 << 20


@njit(cache=True, nogil=True)
def _tap_offsets(x, shape):
    """For each row (c, ky, kx) of the im2col, c * KH * KW + ky * KW + kx, where its pixels
    start in the planes of one image and group of x (`_pack_panel`), computed once per
    convolution instead of per panel (the column phase is a division)."""
    cg, kh, kw, sw, dh, dw = shape[0], shape[1], shape[2], shape[4], shape[5], shape[6]
    plane, wq = x.shape[2] * x.shape[3], x.shape[3]
    taps = np.empty(cg * kh * kw, np.int64)
    row = 0
    for c in range(cg):
        for ky in range(kh):
            for kx in range(kw):
                taps[row] = (c * sw + kx * dw % sw) * plane + ky * dh * wq + kx * dw // sw
                row += 1
    return taps


@njit(cache=True, nogil=True)
def _pack_panel(x, panel, at, stride, image, channel0, shape, taps, q0, width, starts,
                offsets, lengths):
    """Output pixels q0 .. q0 + width - 1 (row-major, within Ho*Wo) of the im2col of image
    `image`, input channels channel0 .. channel0 + Cg - 1, into panel[at:] as (K, width) rows
    `stride` apart, row (c, ky, kx) at c * KH * KW + ky * KW + kx, starting at `taps`
    (`_tap_offsets`) in the image's planes. shape = (Cg, KH, KW, sh, sw, dh, dw, Ho, Wo); x is
    the padded input with its columns split into sw phases, (N, C * sw, Hp, Wp / sw), plane
    c * sw + p holding columns p, p + sw, ... of channel c, so that the pixels of a kernel tap
    along an output row are contiguous whatever the stride. A panel's pixels lie in runs along
    output rows; each run of a tap is copied as one loop."""
    sh, wo = shape[3], shape[8]
    wq = x.shape[3]
    flat = x.reshape(-1)
    runs, j = 0, 0
    while j < width:
        oy, ox = (q0 + j) // wo, (q0 + j) % wo
        starts[runs], offsets[runs] = j, oy * sh * wq + ox
        lengths[runs] = min(width - j, wo - ox)
        j += lengths[runs]
        runs += 1
    base = (image * x.shape[1] + channel0 * shape[4]) * x.shape[2] * wq
    for row in range(taps.size):
        src, dst = base + taps[row], at + row * stride
        for r in range(runs):
            # Unsigned indices, as in _epilogue_in_place.
            d, o = np.uint64(dst + starts[r]), np.uint64(src + offsets[r])
            for t in range(np.uint64(lengths[r])):
                panel[d + t] = flat[o + t]


@njit(cache=True, nogil=True, inline="always")
def _convert_span(flat, src, plane, panel, at, kk, cols, count):
    """`count` consecutive full panels of a 1x1 stride-1 conv whose pixels start at flat[src]
    (its K rows a plane apart) into panel[at + j * K * cols:] as (K, cols) each, converted to
    the panel's type: each plane's run of count * cols pixels read once, in order, instead of
    a panel's cols pixels from each of K planes in turn (K strided streams, a page each, per
    panel). A single panel is a span of one."""
    for k in range(kk):
        s = np.uint64(src + k * plane)
        for j in range(count):
            d, o = np.uint64(at + j * kk * cols + k * cols), np.uint64(j * cols)
            for t in range(np.uint64(cols)):
                panel[d + t] = flat[s + o + t]


@njit(cache=True, nogil=True, inline="always")
def _zero_columns(panel, at, stride, rows, first, cols):
    """Columns first .. cols - 1 of `rows` panel rows (stride apart) from panel[at] on: +0."""
    for row in range(rows):
        for t in range(at + row * stride + first, at + row * stride + cols):
            panel[t] = 0


@njit(cache=True, nogil=True)
def _conv_units(x, flat, w, c, shape, groups, cols, span, rows_per_unit, chunk, scale, bias,
                relu, post_s, post_h, channel0, rounding, rbits, rpa, parts, merged, qp, qout,
                counter, units):
    """The work units of the conv's result, channels channel0 .. channel0 + O/G - 1 of c
    (N * G, C, Ho*Wo) (all of c unless the result is written into a concatenation, see
    conv_product's `into`), claimed from `counter`: unit u is image-group
    u // (spans * blocks) (batch index n * G + g), then a span of `span` consecutive pixel
    panels, then a block of rows_per_unit output channels, so that consecutive units share
    their panels and a thread that claims them in a row packs them once. Each row tile runs
    over the span's panels in turn: its rows are written `span` panels long, a few long
    streams instead of many short ones. With `parts` (one per unit), parts[u] is the largest
    |result| of unit u as a float32 bit pattern with the sign cleared (rbits: c's bits).

    `merged` (one group, sums stored once): the panels run over the pixels of all images in
    turn, so that an image's last panel is filled with the next image's first pixels instead
    of lanes that compute nothing (a 7x7 output fills 49 of 64 lanes alone); a panel that
    spans images is packed, and its tiles are summed in `tile` and copied to each image.
    With `qout` (not empty: c's shape, flattened), each tile is quantized into it instead (qp
    = scale, zero point, lowest, highest): in its registers as it is stored
    (`_store_quantized`, c left untouched), or, where it is summed in chunks or spans images,
    from c while in L1 (`_quantize_run`). Returns the number of units done."""
    # Views without reference counts (workers.borrowed), the caller holding the arrays: the
    # inlined per-tile functions would otherwise count references to them on every call.
    x, flat, w, c, scale, bias = (borrowed(x), borrowed(flat), borrowed(w), borrowed(c),
                                  borrowed(scale), borrowed(bias))
    rbits, rpa, parts, qp, qout = (borrowed(rbits), borrowed(rpa), borrowed(parts),
                                   borrowed(qp), borrowed(qout))
    m, pixels, kk, c_rows = w.shape[1], c.shape[2], w.shape[2], c.shape[1]
    images = c.shape[0]  # the images, where `merged`
    total = images * pixels if merged else pixels
    panels = (total + cols - 1) // cols
    spans = (panels + span - 1) // span
    blocks = (m + rows_per_unit - 1) // rows_per_unit
    panel = np.empty(span * kk * cols, w.dtype)
    tile, total64 = np.empty(TILE_ROWS * cols, w.dtype), np.empty(TILE_ROWS * cols, np.float64)
    starts, offsets, lengths = (np.empty(cols, np.int64), np.empty(cols, np.int64),
                                np.empty(cols, np.int64))
    sources, ldps = np.empty(span, np.int64), np.empty(span, np.int64)
    # Per panel of the span: its first image (batch index), pixel and pixel count there, and
    # whether it runs on into the following images.
    firsts, q0s, widths = (np.empty(span, np.int64), np.empty(span, np.int64),
                           np.empty(span, np.int64))
    spanning = np.zeros(span, np.bool_)
    rp = _param_tuple(rpa)
    # A 1x1 stride-1 conv's im2col is its input: full panels are read there in place (packing
    # them, a strided gather over K planes, cost more than it saved), from `flat` (x
    # flattened), which is empty where x has another type than w (8-bit integers), the conv
    # has _PACK_1X1_ROWS output channels or more, or a deep input beyond the caches
    # (_PACK_1X1_DEEP): those panels are copied (converted), a span of full panels of one
    # image a plane at a time, any other full one on its own (`_convert_span`).
    one_by_one = shape[1] == shape[2] == shape[3] == shape[4] == 1
    in_place = one_by_one and flat.size > 0
    cf, plane = c.reshape(-1), x.shape[2] * x.shape[3]
    xf = x.reshape(-1)
    taps = _tap_offsets(x, shape)
    direct = chunk >= kk and c.itemsize == w.itemsize
    # bf16's or f16's rounding and the amax in the tile's registers as it is stored
    # (`_post_epilogue`, float32 only), else over the stored tile while it is in L1
    # (`_finish_run`, `late`): the same bits. Any other rounding comes before the amax, so
    # both are then late.
    fast = c.itemsize == 4 and (not rounding or plain_bf16(rp) or plain_f16(rp))
    post = 0
    if fast:
        post = (2 if parts.size else 0) | (0 if not rounding else 1 if plain_bf16(rp) else 4)
    late = (rounding or parts.size > 0) and not fast
    # A tile stored once into c with `qout` is quantized in its registers instead (bit 3).
    stored_post = post | 8 if qout.size else post
    # The per-tile kernels take addresses (`address`); these arrays live until the return.
    w_at, c_at, tile_at, s_at, h_at = (address(w), address(c), address(tile), address(post_s),
                                       address(post_h))
    flat_at, panel_at, q_at, qp_at = address(flat), address(panel), address(qout), address(qp)
    packed, done = -1, 0
    while True:
        u = claim(counter)
        if u >= units:
            return done
        q, block = u // blocks, u % blocks
        if merged:
            batch, p0 = 0, q * span
        else:
            batch, p0 = q // spans, (q % spans) * span
        largest = np.uint32(0)
        g = batch % groups
        count = min(span, panels - p0)
        if q != packed:
            for j in range(count):
                start = (p0 + j) * cols
                firsts[j], q0s[j] = batch + start // pixels, start % pixels
                widths[j] = min(cols, pixels - q0s[j])
                spanning[j] = merged and widths[j] < cols and firsts[j] + 1 < images
            # Full panels of one image, copied (converted): its pixels are contiguous in each
            # of the K planes, copied a plane at a time for the whole span (`_convert_span`).
            spanned = one_by_one and not in_place and firsts[count - 1] == firsts[0] \
                and widths[count - 1] == cols
            if spanned:
                _convert_span(xf, (firsts[0] * kk) * plane + q0s[0], plane, panel, 0, kk,
                              cols, count)
                for j in range(count):
                    sources[j], ldps[j] = -1 - j * kk * cols, cols
            for j in range(0 if spanned else count):
                if in_place and widths[j] == cols:
                    sources[j], ldps[j] = (firsts[j] * kk) * plane + q0s[j], plane
                    # An in-place panel's K rows lie a plane apart, too many streams for the
                    # hardware prefetchers: ask for the rows of the panel _PREFETCH_PANELS
                    # ahead.
                    for k in range(kk):
                        for f in range(0, cols, cols // _VECTORS):
                            prefetch_read(flat, sources[j] + _PREFETCH_PANELS * cols
                                           + k * plane + f)
                    continue
                sources[j], ldps[j] = -1 - j * kk * cols, cols
                at, image, q1, filled = j * kk * cols, firsts[j], q0s[j], 0
                if one_by_one and widths[j] == cols:
                    _convert_span(xf, (firsts[j] * kk) * plane + q0s[j], plane, panel, at,
                                  kk, cols, 1)
                    continue
                while True:  # the pixels of this image, then of the next ones if merged
                    width = min(cols - filled, pixels - q1)
                    _pack_panel(x, panel, at + filled, cols, image // groups, g * shape[0],
                                shape, taps, q1, width, starts, offsets, lengths)
                    filled += width
                    image, q1 = image + 1, 0
                    if not spanning[j] or filled == cols or image >= images:
                        break
                if filled < cols:
                    _zero_columns(panel, at, cols, kk, filled, cols)
            packed = q
        for i0 in range(block * rows_per_unit, min(m, (block + 1) * rows_per_unit),
                        TILE_ROWS):
            rows = min(TILE_ROWS, m - i0)
            for j in range(count):
                if not direct:
                    # A packed panel's offset in `panel` is stored as -1 - offset.
                    source, offset = (flat, sources[j]) if sources[j] >= 0 else \
                        (panel, -1 - sources[j])
                    _finish_tile(w, (g * m + i0) * kk, source, offset, ldps[j], c, cf,
                                 firsts[j], i0, q0s[j], cols, chunk, scale, bias, relu, tile,
                                 total64)
                    if qout.size:
                        _quantize_run(cf, qout, (firsts[j] * m + i0) * pixels + q0s[j], rows,
                                      widths[j], pixels, qp)
                    continue
                source, offset = (flat_at, sources[j]) if sources[j] >= 0 else \
                    (panel_at, -1 - sources[j])
                if not spanning[j]:
                    at = (firsts[j] * c_rows + channel0 + i0) * pixels + q0s[j]
                    largest = max(largest, _stored_tile(
                        w.dtype, w_at, (g * m + i0) * kk, kk, source, offset, ldps[j], c_at,
                        at, pixels, s_at, h_at, g * m + i0, relu, rows, widths[j], stored_post,
                        q_at, qp_at))
                    if late:
                        largest = _finish_run(rbits, at, rows, widths[j], pixels, rounding, rp,
                                              parts.size > 0, largest)
                    continue
                # Summed in `tile`, then each image's columns copied to it.
                _stored_tile(w.dtype, w_at, (g * m + i0) * kk, kk, source, offset, ldps[j],
                             tile_at, 0, cols, s_at, h_at, g * m + i0, relu, rows, cols, 0, q_at,
                             qp_at)
                image, q1, filled = firsts[j], q0s[j], 0
                while filled < cols and image < images:
                    width = min(cols - filled, pixels - q1)
                    at = (image * c_rows + channel0 + i0) * pixels + q1
                    for r in range(rows):
                        for t in range(width):
                            cf[at + r * pixels + t] = tile[r * cols + filled + t]
                    if rounding or parts.size:
                        largest = _finish_run(rbits, at, rows, width, pixels, rounding, rp,
                                              parts.size > 0, largest)
                    if qout.size:
                        _quantize_run(cf, qout, at, rows, width, pixels, qp)
                    filled += width
                    image, q1 = image + 1, 0
        if parts.size:
            parts[u] = largest
        done += 1


@njit(cache=True, nogil=True, inline="always")
def _quantize_run(cf, qout, at, rows, width, ldc, qp):
    """The `width` columns of `rows` rows (ldc apart) of cf from `at` on, just stored and
    still in L1, quantized into qout at the same places: quant._quantize_one with scale
    qp[0], zero point qp[1] and range qp[2] .. qp[3], the integer quantize's bits."""
    s, z, lo, hi = qp[0], qp[1], qp[2], qp[3]
    for r in range(rows):
        row = np.uint64(at + r * ldc)
        for t in range(np.uint64(width)):
            qout[row + t] = _quantize_one(cf[row + t], s, z, lo, hi)[0]


@njit(cache=True, nogil=True, inline="always")
def _finish_run(rbits, at, rows, width, ldc, rounding, rp, measure, largest):
    """The `width` columns of `rows` rows (ldc apart) stored at rbits[at:] (a float32
    result's bits), still in L1: rounded as round_to rounds them if `rounding`, and, if
    `measure`, `largest` raised to their largest magnitude as a bit pattern (as rounding.amax
    takes it, after the rounding). Returns `largest`."""
    if rounding:
        for r in range(rows):
            # Unsigned indices, as in _epilogue_in_place.
            row = np.uint64(at + r * ldc)
            for t in range(np.uint64(width)):
                rbits[row + t] = rounded_bits(rbits[row + t], rp)
    if measure:
        for r in range(rows):
            row = np.uint64(at + r * ldc)
            for t in range(np.uint64(width)):
                largest = max(largest, np.uint32(rbits[row + t] & np.uint32(0x7FFFFFFF)))
    return largest


@njit(cache=True, nogil=True, inline="always")
def _stored_tile(dtype, a, a_offset, kk, source, offset, ldp, c, c_offset, ldc, s, h, e_offset,
                 relu, rows, width, post, q, qp):
    """`rows` (1 .. TILE_ROWS) rows and the first `width` columns of a tile summed from +0
    straight into c through the fused epilogue (`_stored_kernel`, with `post`, q and qp): a
    full tile at once, fewer rows in blocks of 4, 2 and 1. a, source, c, s and h are
    addresses (`address`) of arrays of `dtype`. Returns the largest amax bits of the blocks
    (0 unless `post` measures)."""
    if rows == TILE_ROWS:
        return _stored8(dtype, a, a_offset, kk, source, offset, ldp, c, c_offset, ldc, kk, s,
                        h, e_offset, relu, width, post, q, qp)
    r, largest = 0, np.uint32(0)
    if rows >= 4:
        largest = max(largest, _stored4(dtype, a, a_offset, kk, source, offset, ldp, c,
                                        c_offset, ldc, kk, s, h, e_offset, relu, width, post,
                                        q, qp))
        r = 4
    if rows - r >= 2:
        largest = max(largest, _stored2(dtype, a, a_offset + r * kk, kk, source, offset, ldp, c,
                                        c_offset + r * ldc, ldc, kk, s, h, e_offset + r, relu,
                                        width, post, q, qp))
        r += 2
    if rows > r:
        largest = max(largest, _stored1(dtype, a, a_offset + r * kk, kk, source, offset, ldp, c,
                                        c_offset + r * ldc, ldc, kk, s, h, e_offset + r, relu,
                                        width, post, q, qp))
    return largest


def conv_product(x: np.ndarray, wmat: np.ndarray, shape: tuple[int, ...], groups: int,
                 out: np.dtype, chunk: int, scale: np.ndarray | None, bias: np.ndarray | None,
                 relu: bool, into: tuple[np.ndarray, int] | None = None,
                 rounding: str | None = None, amax: list | None = None,
                 quantize: tuple[np.ndarray, np.dtype] | None = None) -> np.ndarray:
    """The convolution of the padded x with the weights `wmat` (G, O/G, K) as c (N * G, O/G,
    Ho*Wo) in `out`: the product of the weights and the im2col of each image and group
    (mplower.numerics.conv), without materializing the im2col. shape = (Cg, KH, KW, sh, sw,
    dh, dw, Ho, Wo); x is (N, C * sw, Hp, Wp / sw), its columns split into sw phases as
    `_pack_panel` reads them (a 1x1 conv has stride 1), in wmat's type or in an 8-bit integer
    type, which the panels convert as they are packed; chunk, scale, bias and relu as in
    `_product`.

    `into` = (y, c0): write the result into channels c0 .. c0 + O - 1 of y (N, C, Ho*Wo)
    instead, a float result of one group (a concatenation along channels, without the copy);
    returns y. `rounding` (a format of rounding.round_to, not an MX one) rounds each float32
    result after its epilogue, as round_to would (the same kernel), while its tile is in
    cache; only where each sum is stored once (float32 sums over all of K). `amax` (a list)
    gets rounding.amax of the result, taken from each tile as it is stored (after the
    rounding), where each sum is stored once; elsewhere it is left empty. `quantize` =
    (qp, dtype), a float32 result and no `into`: returns the result quantized to `dtype` (an
    8-bit integer type) with qp = (scale, zero point, lowest, highest) as float32, each tile
    as it is stored (`_quantize_run`), instead of the result."""
    n, m, kk = x.shape[0], wmat.shape[1], wmat.shape[2]
    if quantize is not None and (into is not None or out != np.float32
                                 or np.dtype(quantize[1]).itemsize != 1):
        raise ValueError("conv_product: quantize takes a float32 result, not `into`, to an "
                         "8-bit integer type")
    if into is None:
        c, channel0 = np.empty((n * groups, m, shape[7] * shape[8]), out), 0
    else:
        c, channel0 = into
        if groups != 1 or c.dtype != out or out != wmat.dtype or chunk < kk \
                or not c.flags.c_contiguous or c.shape[0] != n \
                or c.shape[2] != shape[7] * shape[8] or not 0 <= channel0 <= c.shape[1] - m:
            raise ValueError("conv_product: `into` takes a float result of one group, "
                             "within the channels of a contiguous (N, C, Ho*Wo) array")
    cols = _panel_columns(wmat.dtype)
    # One run of panels over the pixels of all images where an image leaves lanes idle
    # (`_conv_units`' `merged`: one group, float sums over all of K stored once).
    merged = groups == 1 and n > 1 and c.shape[2] % cols != 0 and chunk >= kk \
        and out == wmat.dtype
    runs = 1 if merged else n * groups
    panels = -(-c.shape[2] * (n if merged else 1) // cols)
    # Spans of up to _SPAN panels, while that leaves _UNITS units or more.
    span = max(1, min(_SPAN, _SPAN_BYTES // max(1, kk * cols * wmat.itemsize),
                      runs * panels // _UNITS))
    spans = runs * -(-panels // span)
    tiles = (m + TILE_ROWS - 1) // TILE_ROWS
    split = min(tiles, -(-_UNITS // spans))
    rows_per_unit = TILE_ROWS * -(-tiles // split)
    blocks = -(-m // rows_per_unit)
    scale = _epilogue_table(scale, np.float32, m)
    bias = _epilogue_table(bias, wmat.dtype if scale.size == 0 else np.float32, m)
    # The fused epilogue's per-channel factors (`_fused_epilogue`) in the tile's type, exact:
    # it runs only where c has that type.
    post_s = (np.ones(groups * m, wmat.dtype) if scale.size == 0
              else scale.astype(wmat.dtype).ravel())
    post_h = (np.full(groups * m, -0.0, wmat.dtype) if bias.size == 0
              else bias.astype(wmat.dtype).ravel())
    if rounding is not None and (out != np.float32 or wmat.dtype != np.float32 or chunk < kk
                                 or rounding in MX_ROUNDING_FORMATS):
        raise ValueError("conv_product: rounding applies to float32 sums over all of K, to "
                         "a format of _round_one")
    tiled_amax = amax is not None and out == np.float32 and wmat.dtype == np.float32 \
        and chunk >= kk and into is None
    parts = np.zeros(spans * blocks if tiled_amax else 0, np.uint32)
    in_place = x.dtype == wmat.dtype and m < _PACK_1X1_ROWS \
        and not (kk >= _PACK_1X1_DEEP and x.nbytes >= _PACK_1X1_BYTES)
    flat = x.reshape(-1) if in_place else np.empty(0, wmat.dtype)
    args = (x, flat, wmat, c, tuple(int(v) for v in shape), groups, cols, span, rows_per_unit,
            chunk, scale, bias, relu, post_s, post_h, channel0, rounding is not None,
            c.reshape(-1).view(np.uint32) if rounding is not None or tiled_amax else _NO_BITS,
            _param_array(rounding or "bf16", False), parts, merged)
    # One compiled signature for both 8-bit types: int8 values written to uint8 wrap to
    # their two's-complement bits.
    q = None if quantize is None else np.empty(c.shape, np.uint8)
    args += (_NO_QP, _NO_Q) if q is None else (quantize[0], q.reshape(-1))
    # The products' one threshold (gemm.SERIAL_BELOW), read where it is set.
    if n * groups * m * c.shape[2] * max(kk, 1) < gemm.SERIAL_BELOW:
        _conv_units(*args, np.zeros(1, np.int64), spans * blocks)
    else:
        run_units(_conv_units, spans * blocks, *args)
    if tiled_amax:
        amax[:] = [amax_of_bits(parts.max() if parts.size else np.uint32(0))]
    return c if q is None else q.view(quantize[1])


_NO_BITS = np.zeros(0, np.uint32)
_NO_QP, _NO_Q = np.zeros(4, np.float32), np.empty(0, np.uint8)
