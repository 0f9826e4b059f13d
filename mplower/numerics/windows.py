"""Sliding windows over NCHW arrays: the view that convolution and pooling compute on.

Shared by the reference semantics of mp.conv2d and the pools (mplower.dialect.mp) and by the
executor's lowered conv, so that both read the same windows of the same padded input.
"""

from __future__ import annotations

from typing import Any

import numpy as np


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
