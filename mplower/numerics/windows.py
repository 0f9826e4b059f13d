"""Sliding windows over NCHW arrays: the view that convolution and pooling compute on.

Shared by the reference semantics of mp.conv2d and the pools (mplower.dialect.mp) and by the
executor's lowered conv, so that both read the same windows of the same padded input; and
the layout the compiled window kernels (mplower.numerics.pool, mplower.numerics.depthwise)
compute on: stacks of padded planes split by stride phase (`split_plane`, `split_stack`),
where every tap of every window is a unit-stride run (`tap_offsets`), and `keep`, which
takes the outputs back out.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit


def conv_windows(x: np.ndarray, kernel: tuple[int, int], strides: tuple[int, int],
                 dilations: tuple[int, int] = (1, 1)) -> np.ndarray:
    """A (N, C, Hout, Wout, KH, KW) strided view of the windows of an already padded NCHW x."""
    (kh, kw), (sh, sw), (dh, dw) = kernel, strides, dilations
    view = np.lib.stride_tricks.sliding_window_view(
        x, (dh * (kh - 1) + 1, dw * (kw - 1) + 1), axis=(2, 3))
    return view[:, :, ::sh, ::sw, ::dh, ::dw]


def pad_hw(x: np.ndarray, padding: tuple[int, ...], fill: Any = 0) -> np.ndarray:
    """NCHW x padded by (top, left, bottom, right) rows and columns of `fill`."""
    pt, pl, pb, pr = padding
    return np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)), constant_values=fill)


def tap_offsets(kernel: tuple[int, int], strides: tuple[int, int], dilations: tuple[int, int],
                shape: tuple[int, int], planes: int = 1) -> np.ndarray:
    """Where the taps are in `split_stack`'s result for `planes` planes split into (Hq, Wq) =
    shape per phase: tap (ky, kx) of the window of output (oy, ox) of plane g is element
    (g * Hq + oy) * Wq + ox + offsets[ky * KW + kx], so that the outputs of the planes are
    one unit-stride run over q = (g * Hq + oy) * Wq + ox for every tap (those at ox >= Wo or
    oy >= Ho computed and dropped)."""
    (kh, kw), (sh, sw), (dh, dw), (hq, wq) = kernel, strides, dilations, shape
    ky, kx = np.divmod(np.arange(kh * kw), kw)
    qy, ry = np.divmod(ky * dh, sh)
    qx, rx = np.divmod(kx * dw, sw)
    return (((rx * sh + ry) * planes * hq + qy) * wq + qx).astype(np.int64)


def split_shape(out: tuple[int, int], kernel: tuple[int, int], strides: tuple[int, int],
                dilations: tuple[int, int] = (1, 1)) -> tuple[int, int]:
    """(Hq, Wq): the rows and columns of each phase of a plane that the windows of an (Ho,
    Wo) output read (`split_plane`, `split_stack`)."""
    (ho, wo), (kh, kw), (sh, sw), (dh, dw) = out, kernel, strides, dilations
    return ho + (kh - 1) * dh // sh, wo + (kw - 1) * dw // sw


@njit(cache=True, nogil=True, inline="always")
def split_plane(plane, rows, cols, hq, slot, pt, pl):
    """Copy plane (H, W) into slot g = `slot` of a stack of planes padded by pt rows on top
    and pl columns on the left, split by phase of the strides SH and SW: padded row i * SH +
    r of the plane is rows[r, g * Hq + i] of rows (SH, G * Hq, Wq * SW) (rows from Hq * SH and
    columns from Wq * SW on are dropped); where SW is 2, its columns are split at once, into
    cols (2, SH * G * Hq * Wq) as `split_stack` describes. Elements that are not the plane's
    (the padding) are left as they are, so buffers filled once keep their padding."""
    h, w = plane.shape
    sh, wr = rows.shape[0], rows.shape[2]
    width = min(w, wr - pl)
    src_flat, dst_flat = plane.reshape(-1), rows.reshape(-1)
    if cols.shape[0] == 2:
        dst_flat, wr = cols.reshape(-1), wr // 2
    phase = rows.shape[1] * wr  # the distance between row phases
    # Input column 2k goes to column phase pl % 2, 2k + 1 to the other one, at column
    # pl // 2 + k and (pl + 1) // 2 + k.
    even, odd, pairs = pl % 2 * cols.shape[1], (1 - pl % 2) * cols.shape[1], width // 2
    for iy in range(min(h, hq * sh - pt)):  # in memory order, for the prefetcher
        i = iy + pt
        start = i % sh * phase + (slot * hq + i // sh) * wr
        # Equal bounded views: the loops run several times faster than with numba's slice
        # assignment, an unbounded view or an index that may be negative.
        if cols.shape[0] != 2:
            src, dst = src_flat[iy * w:iy * w + width], dst_flat[start + pl:start + pl + width]
            for j in range(width):
                dst[j] = src[j]
            continue
        src = src_flat[iy * w:iy * w + 2 * pairs]
        first = dst_flat[even + start + pl // 2:even + start + pl // 2 + pairs]
        second = dst_flat[odd + start + (pl + 1) // 2:odd + start + (pl + 1) // 2 + pairs]
        for k in range(pairs):
            first[k] = src[2 * k]
            second[k] = src[2 * k + 1]
        if width % 2:
            dst_flat[even + start + pl // 2 + pairs] = src_flat[iy * w + width - 1]


@njit(cache=True, nogil=True)
def split_stack(rows, cols):
    """The stack of planes filled by `split_plane`, flattened, its columns split by phase of
    the column stride SW = cols.shape[0]: element (r, i, j * SW + s) of rows (SH, G * Hq, Wq *
    SW) is element (s * SH + r) * G * Hq * Wq + i * Wq + j of the result. `rows` itself
    where SW is 1; `cols` (SW, SH * G * Hq * Wq), which split_plane filled where SW is 2, or
    filled here in one long pass per phase."""
    sw, n = cols.shape
    if sw == 1:
        return rows.reshape(-1)
    if sw > 2:
        flat = rows.reshape(-1)
        for s in range(sw):
            phase = cols[s]
            for k in range(n):
                phase[k] = flat[sw * k + s]
    return cols.reshape(-1)


@njit(cache=True, nogil=True, inline="always")
def keep(sums, slot, hq, wq, out):
    """out (Ho, Wo) = the outputs of plane g = `slot` of a stack computed over q = (g * Hq +
    oy) * Wq + ox (tap_offsets): sums[q] for oy < Ho, ox < Wo."""
    ho, wo = out.shape
    flat = out.reshape(-1)
    for oy in range(ho):
        # Equal bounded views on both sides: the loop runs several times faster than with
        # an unbounded one or an index that may be negative.
        start = (slot * hq + oy) * wq
        dst, src = flat[oy * wo:oy * wo + wo], sums[start:start + wo]
        for ox in range(wo):
            dst[ox] = src[ox]
