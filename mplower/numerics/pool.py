"""Max and average pooling of NCHW planes, compiled, each in one fixed order.

Each (image, channel) plane is pooled on its own by a GIL-free compiled kernel, planes handed
to threads in blocks (mplower.numerics.workers), so a result depends neither on the thread
count nor on the batch. Padding is applied per plane, into a scratch copy that stays in the
cache, instead of a padded copy of the whole tensor. Both kernels run rows first, then
columns, each pass one long contiguous loop over the flattened padded plane (at every row and
column, not only every stride-th: such loops vectorize, short or strided ones do not), and
then pick the outputs.

Max pooling is the fold np.maximum(acc, v) over each window in row-major order, starting from
the padding value (-inf, or the integer type's minimum, which never wins a window that also
holds input): a tie between -0.0 and 0.0 takes the later element, a NaN accumulator stays (the
window's first NaN is the result), a NaN element replaces a number. That fold is associative
(its result is the first NaN, else the last maximum, in row-major order), so folding each
row's maxima in row order gives the same bits: today's, pinned by tests/test_window_kernels.py
against the running np.maximum over the kernel's shifted views that this replaces.

Average pooling sums each window in numpy's order, written out, which depends on shapes only:
from +0.0, the window's rows (`kernel[1]` elements each, zero padding included) are added in
order, each row summed on its own with numpy's pairwise summation (`_pairwise`: in order from
+0.0 below 8 elements, otherwise eight interleaved partial sums); where the output is one
column wide, numpy's reduction sees the window as one run and so does this kernel
(`_avg_windows`). The sum is then divided by the number of input elements under the window
(padding not counted, ONNX count_include_pad=0). These are the bits of the numpy window
reduction this replaces, for every shape tested (tests/test_window_kernels.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from mplower.numerics.workers import run_blocks

# Below this many window elements (about 1 ms on one core) one thread pools every plane: a
# parallel section costs tens of microseconds on an idle machine, a time slice on a busy one.
_SERIAL_BELOW = 1 << 22
# numpy's pairwise summation: runs shorter than this are summed in order, longer ones in
# _UNROLL interleaved partial sums, runs longer than _BLOCK split in halves (loops_utils.h).
_UNROLL, _BLOCK = 8, 128


@njit(cache=True, nogil=True)
def _block(a, start, n):
    """numpy's sum of a run of at most _BLOCK elements a[start:start + n]."""
    if n < _UNROLL:
        res = a.dtype.type(0)
        for i in range(start, start + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[start], a[start + 1], a[start + 2], a[start + 3]
    r4, r5, r6, r7 = a[start + 4], a[start + 5], a[start + 6], a[start + 7]
    i = _UNROLL
    while i < n - n % _UNROLL:
        b = start + i
        r0 += a[b]
        r1 += a[b + 1]
        r2 += a[b + 2]
        r3 += a[b + 3]
        r4 += a[b + 4]
        r5 += a[b + 5]
        r6 += a[b + 6]
        r7 += a[b + 7]
        i += _UNROLL
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    for k in range(start + i, start + n):
        res += a[k]
    return res


@njit(cache=True, nogil=True)
def _pairwise(a, start, n):
    """numpy's pairwise sum of a[start:start + n] (1-D), in a's precision: a run longer than
    _BLOCK is the sum of its halves (the first a multiple of _UNROLL long). Evaluated with an
    explicit stack, left half first, because numba's cache mishandles recursive functions."""
    if n <= _BLOCK:
        return _block(a, start, n)
    frames = np.empty((128, 3), np.int64)  # (start, length, halves done); depth ~log2(n)
    sums = np.empty(64, a.dtype)
    frames[0, 0], frames[0, 1], frames[0, 2] = start, n, 0
    depth, held = 1, 0
    while depth:
        s, m, stage = frames[depth - 1, 0], frames[depth - 1, 1], frames[depth - 1, 2]
        if m <= _BLOCK:
            sums[held] = _block(a, s, m)
            held += 1
            depth -= 1
        elif stage == 2:
            sums[held - 2] = sums[held - 2] + sums[held - 1]
            held -= 1
            depth -= 1
        else:
            half = m // 2
            half -= half % _UNROLL
            frames[depth - 1, 2] = stage + 1
            frames[depth, 0] = s if stage == 0 else s + half
            frames[depth, 1] = half if stage == 0 else m - half
            frames[depth, 2] = 0
            depth += 1
    return sums[0]


@njit(cache=True, nogil=True)
def _padded_plane(x, p, pt, pl, fill, buf):
    """Plane p of x (P, H, W) padded by pt rows on top and pl columns on the left and with
    `fill` up to buf's shape (Hp, Wp), flattened: buf's copy, or x's own plane where there is
    no padding."""
    h, w = x.shape[1], x.shape[2]
    if buf.shape[0] == h and buf.shape[1] == w:
        return x[p].reshape(-1)
    buf[:, :] = fill
    buf[pt:pt + h, pl:pl + w] = x[p]
    return buf.reshape(-1)


@njit(cache=True, nogil=True)
def _max2(out, a, b):
    """out[i] = np.maximum(a[i], b[i]): a NaN in a stays, a NaN in b replaces a number, a tie
    (-0.0 and 0.0) takes b. `a` may be `out` itself."""
    for i in range(out.size):
        x, y = a[i], b[i]
        out[i] = x if (x > y) | np.isnan(x) else y


@njit(cache=True, nogil=True)
def _max3(out, a, b, c):
    """out[i] = np.maximum(np.maximum(a[i], b[i]), c[i]) in one pass over memory."""
    for i in range(out.size):
        x, y, z = a[i], b[i], c[i]
        x = x if (x > y) | np.isnan(x) else y
        out[i] = x if (x > z) | np.isnan(x) else z


@njit(cache=True, nogil=True)
def _fold_max(out, values, step, taps):
    """out = the np.maximum fold of the taps values[t * step:][:out.size], t = 0 .. taps - 1,
    in that order, three (the first) or two taps per pass over memory. Slices, not
    values[offset + i]: an index that may be negative defeats vectorization."""
    n = out.size
    if taps == 1:
        out[:] = values[:n]
        return
    if taps == 2:
        _max2(out, values[:n], values[step:step + n])
        return
    _max3(out, values[:n], values[step:step + n], values[2 * step:2 * step + n])
    t = 3
    while t < taps:
        if taps - t >= 2:
            b, c = t * step, (t + 1) * step
            _max3(out, out, values[b:b + n], values[c:c + n])
            t += 2
        else:
            _max2(out, out, values[t * step:t * step + n])
            t += 1


@njit(cache=True, nogil=True)
def _add(acc, values, offset, n):
    """acc[i] += values[offset + i] for i < n."""
    vs = values[offset:offset + n]
    for i in range(n):
        acc[i] += vs[i]


@njit(cache=True, nogil=True)
def _max_planes(x, y, kh, kw, sh, sw, pt, pl, hp, wp, lowest, p0, p1):
    """Max pooling of planes p0 .. p1 - 1 (module docstring). The fold is associative (its result is
    the window's first NaN, else its last maximum), so folding each row's maxima in row
    order gives the row-major fold's bits."""
    ho, wo = y.shape[1], y.shape[2]
    buf = np.empty((hp, wp), x.dtype)
    n, span = hp * wp - kw + 1, (wo - 1) * sw + 1
    rows, cols = np.empty(n, x.dtype), np.empty((ho - 1) * sh * wp + span, x.dtype)
    for p in range(p0, p1):
        src = _padded_plane(x, p, pt, pl, lowest, buf)
        _fold_max(rows, src, 1, kw)
        _fold_max(cols, rows, wp, kh)
        for oy in range(ho):
            y[p, oy] = cols[oy * sh * wp:oy * sh * wp + span:sw]


@njit(cache=True, nogil=True)
def _avg_planes(x, y, counts, kh, kw, sh, sw, pt, pl, hp, wp, p0, p1):
    """Average pooling of planes p0 .. p1 - 1 (module docstring): each window row summed in order
    from +0, then the rows in order from +0; `_avg_windows` where numpy sums otherwise."""
    ho, wo = y.shape[1], y.shape[2]
    if wo == 1 or kw >= _UNROLL:
        _avg_windows(x, y, counts, kh, kw, sh, sw, pt, pl, p0, p1)
        return
    zero = x.dtype.type(0)
    buf = np.empty((hp, wp), x.dtype)
    n, span = hp * wp - kw + 1, (wo - 1) * sw + 1
    rows, cols = np.empty(n, x.dtype), np.empty((ho - 1) * sh * wp + span, x.dtype)
    for p in range(p0, p1):
        src = _padded_plane(x, p, pt, pl, zero, buf)
        rows[:] = zero
        for kx in range(kw):
            _add(rows, src, kx, n)
        cols[:] = zero
        for ky in range(kh):
            _add(cols, rows, ky * wp, cols.size)
        for oy in range(ho):
            sums, share = cols[oy * sh * wp:oy * sh * wp + span:sw], counts[oy]
            for ox in range(wo):
                y[p, oy, ox] = sums[ox] / share[ox]


@njit(cache=True, nogil=True)
def _avg_windows(x, y, counts, kh, kw, sh, sw, pt, pl, p0, p1):
    """One window at a time, its elements (zero padding included) gathered into a run:
    numpy's pairwise sum of the whole window where the output is one column wide (numpy's
    reduction then sees one run), else of each row, the rows added in order from +0."""
    h, w, ho, wo = x.shape[1], x.shape[2], y.shape[1], y.shape[2]
    zero = x.dtype.type(0)
    run = np.empty(kh * kw, x.dtype)
    for p in range(p0, p1):
        for oy in range(ho):
            for ox in range(wo):
                for ky in range(kh):
                    iy = oy * sh + ky - pt
                    for kx in range(kw):
                        ix = ox * sw + kx - pl
                        inside = 0 <= iy < h and 0 <= ix < w
                        run[ky * kw + kx] = x[p, iy, ix] if inside else zero
                total = zero
                if wo == 1:
                    total += _pairwise(run, 0, kh * kw)
                else:
                    for ky in range(kh):
                        total += _pairwise(run, ky * kw, kw)
                y[p, oy, ox] = total / counts[oy, ox]


def _run(kernel, planes: int, work: int, *args) -> None:
    if work < _SERIAL_BELOW:
        kernel(*args, 0, planes)
    else:
        run_blocks(kernel, planes, *args)


def _geometry(x: np.ndarray, kernel: tuple[int, int], strides: tuple[int, int],
              padding: tuple[int, ...]) -> tuple[int, int, int, int, np.ndarray]:
    """(Ho, Wo, padded height, padded width, x as contiguous (N * C, H, W) planes)."""
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = kernel, strides, padding
    n, c, h, w = x.shape
    ho = (h + pt + pb - kh) // sh + 1
    wo = (w + pl + pr - kw) // sw + 1
    return ho, wo, h + pt + pb, w + pl + pr, np.ascontiguousarray(x).reshape(n * c, h, w)


def max_pool2d(x: np.ndarray, kernel: tuple[int, int], strides: tuple[int, int],
               padding: tuple[int, int, int, int]) -> np.ndarray:
    """Max over each window of NCHW x (float or integer), padded by (top, left, bottom,
    right) with values that never win (-inf, or the integer type's minimum)."""
    ho, wo, hp, wp, planes = _geometry(x, kernel, strides, padding)
    lowest = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
    y = np.empty(x.shape[:2] + (ho, wo), x.dtype)
    _run(_max_planes, planes.shape[0], y.size * kernel[0] * kernel[1], planes,
         y.reshape(-1, ho, wo), *kernel, *strides, *padding[:2], hp, wp,
         x.dtype.type(lowest))
    return y


def avg_pool2d(x: np.ndarray, kernel: tuple[int, int], strides: tuple[int, int],
               padding: tuple[int, int, int, int]) -> np.ndarray:
    """Mean of each window of float NCHW x, zero-padded by (top, left, bottom, right), over
    the input elements under it (count_include_pad=0), in the module docstring's order."""
    (kh, kw), (sh, sw), (pt, pl) = kernel, strides, padding[:2]
    ho, wo, hp, wp, planes = _geometry(x, kernel, strides, padding)
    h, w = x.shape[2:]
    inside_h = np.minimum(np.arange(ho) * sh - pt + kh, h) - np.maximum(np.arange(ho) * sh - pt, 0)
    inside_w = np.minimum(np.arange(wo) * sw - pl + kw, w) - np.maximum(np.arange(wo) * sw - pl, 0)
    counts = np.multiply.outer(inside_h, inside_w).astype(x.dtype)
    y = np.empty(x.shape[:2] + (ho, wo), x.dtype)
    _run(_avg_planes, planes.shape[0], y.size * kh * kw, planes, y.reshape(-1, ho, wo), counts,
         kh, kw, sh, sw, pt, pl, hp, wp)
    return y
