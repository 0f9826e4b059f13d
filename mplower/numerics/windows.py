"""Sliding windows over NCHW arrays: the view that convolution and pooling compute on.

Shared by the reference semantics of mp.conv2d and the pools (mplower.dialect.mp) and by the
executor's lowered conv, so that both read the same windows of the same padded input; and
`split_plane` with `tap_offsets`, the padded plane that the compiled window kernels
(mplower.numerics.pool, mplower.numerics.depthwise) read in unit-stride loops whatever the
window's strides.
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
    """Where the taps are in `split_columns`' result for `planes` planes split into (Hq, Wq) =
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
    Wo) output read (`pad_rows`, `split_columns`)."""
    (ho, wo), (kh, kw), (sh, sw), (dh, dw) = out, kernel, strides, dilations
    return ho + (kh - 1) * dh // sh, wo + (kw - 1) * dw // sw


@njit(cache=True, nogil=True)
def pad_rows(plane, rows, hq, slot, pt, pl):
    """Copy plane (H, W) into slot g = `slot` of rows (SH, G * Hq, Wq * SW) as the plane
    padded by pt rows on top and pl columns on the left, its rows split by phase of the row
    stride SH: padded row i * SH + r of the plane is rows[r, g * Hq + i] (rows from Hq * SH
    and columns from Wq * SW on are dropped). Elements that are not the plane's (the
    padding) are left as they are, so a buffer filled once keeps its padding."""
    h, w = plane.shape
    sh, wr = rows.shape[0], rows.shape[2]
    width = min(w, wr - pl)
    for iy in range(min(h, hq * sh - pt)):  # in memory order, for the prefetcher
        i = iy + pt
        # An element loop over bounded row views: numba's slice assignment costs several
        # times the copy itself.
        src, dst = plane[iy, :width], rows[i % sh, slot * hq + i // sh, pl:pl + width]
        for j in range(width):
            dst[j] = src[j]


@njit(cache=True, nogil=True)
def split_columns(rows, cols):
    """rows (SH, G * Hq, Wq * SW) flattened with its columns split by phase of the column
    stride SW = cols.shape[0]: element (r, i, j * SW + s) is element (s * SH + r) * G * Hq *
    Wq + i * Wq + j of the result. `rows` itself where SW is 1, else `cols` (SW, SH * G * Hq *
    Wq) filled in one long pass (loops over one row are too short to run as vector code)."""
    flat = rows.reshape(-1)
    sw, n = cols.shape
    if sw == 1:
        return flat
    if sw == 2:
        even, odd = cols[0], cols[1]
        for k in range(n):
            even[k] = flat[2 * k]
            odd[k] = flat[2 * k + 1]
    else:
        for s in range(sw):
            phase = cols[s]
            for k in range(n):
                phase[k] = flat[sw * k + s]
    return cols.reshape(-1)
