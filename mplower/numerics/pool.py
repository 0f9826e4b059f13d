"""Max pooling as a running np.maximum over the kernel's shifted strided views.

The window reduction `sliding_window_view(...).max(axis=(-2, -1))` walks two tiny strided
axes per output and took ~50 ms for one 3x3 pool of SqueezeNet; one np.maximum per kernel
offset streams whole planes. Max is exact, and the fold visits window elements in the same
row-major order as numpy's reduction, so ties between -0.0 and 0.0 come out the same; a window
with NaNs gives NaN, whose sign (unspecified by IEEE 754) may be another of the window's NaNs'.
tests/test_runtime_kernels.py pins it against the window reduction.
"""

from __future__ import annotations

import numpy as np


def max_pool2d(x: np.ndarray, kernel: tuple[int, int], strides: tuple[int, int]) -> np.ndarray:
    """Max over each (kernel) window of an already padded NCHW x, windows `strides` apart."""
    (kh, kw), (sh, sw) = kernel, strides
    ho = (x.shape[2] - kh) // sh + 1
    wo = (x.shape[3] - kw) // sw + 1
    y = None
    for i in range(kh):
        for j in range(kw):
            view = x[:, :, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw]
            y = view.copy() if y is None else np.maximum(y, view, out=y)
    return y
