"""Max and average pooling of NCHW planes, compiled, each in one fixed order.

Planes are pooled by a GIL-free compiled kernel, stacks of them handed to threads as work
units (mplower.numerics.workers.run_units), each plane's outputs the same sequence of
operations wherever it sits, so a result depends neither on the thread count nor on the
batch. The planes of a unit are padded and split by stride phase into a scratch stack that
stays in the cache (mplower.numerics.windows.split_plane), so that each tap of every output
is one unit-stride run over the stack: a 3x3 window's taps are folded in a register per
output (one output per SIMD lane), other windows take one pass over the outputs per tap,
and a strided window no longer computes every position and picks. The float32 3x3
stride-2 pools, max and average (the stem and reduction pools of the CNNs in
benchmarks/runtime.py), skip the split, whose per-row cost dominated them: each input row is
combined across the three columns of every window, sixteen outputs per step with the even
and odd columns taken apart in registers (`_fold3s2`, `_sum3s2`), then each output across its
three rows (`_pool3s2_units`). SqueezeNet b8's three max pools took 4.41 ms against 7.00 ms
with the split, ShuffleNet b8's three average pools 1.90 against 2.99 ms (interleaved in one
process, docs/benchmarks.md).

Max pooling is the fold np.maximum(acc, v) over each window in row-major order (the padding
value is -inf, or the integer type's minimum, which never wins a window that also holds
input): a tie between -0.0 and 0.0 takes the later element, a NaN accumulator stays (the
window's first NaN is the result), a NaN element replaces a number. These are the bits of
the running np.maximum over the kernel's shifted views, pinned by
tests/test_window_kernels.py.

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
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from mplower.numerics.windows import keep, split_plane, split_shape, split_stack, tap_offsets
from mplower.numerics.workers import borrowed, claim, run_blocks, run_units

# Below this many window elements (a few tenths of a ms on one core) one thread pools every
# plane: a parallel section costs tens of microseconds on an idle machine, a time slice on a
# busy one.
_SERIAL_BELOW = 1 << 22
# The same for the row-folding 3x3 stride-2 pools, in outputs.
_POOL3S2_SERIAL_BELOW = 1 << 16
# numpy's pairwise summation: runs shorter than this are summed in order, longer ones in
# _UNROLL interleaved partial sums, runs longer than _BLOCK split in halves (loops_utils.h).
_UNROLL, _BLOCK = 8, 128
# Padded input elements stacked per tap loop: the planes of a work unit, split together, so
# that each tap is one long loop over all of them (a loop over one small plane is too short
# to run as vector code); a stack much larger than this leaves the L1/L2 cache.
_STACK = 4096


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
def _max2(out, a, b):
    """out[i] = np.maximum(a[i], b[i]): a NaN in a stays, a NaN in b replaces a number, a tie
    (-0.0 and 0.0) takes b. `a` may be `out` itself."""
    for i in range(out.size):
        x, y = a[i], b[i]
        out[i] = x if (x > y) | np.isnan(x) else y


@njit(cache=True, nogil=True)
def _max9(out, flat, taps):
    """out[q] = the np.maximum fold of the nine taps flat[q + taps[t]] in order, each
    output's fold held in a register (one output per SIMD lane)."""
    t0, t1, t2 = flat[taps[0]:], flat[taps[1]:], flat[taps[2]:]
    t3, t4, t5 = flat[taps[3]:], flat[taps[4]:], flat[taps[5]:]
    t6, t7, t8 = flat[taps[6]:], flat[taps[7]:], flat[taps[8]:]
    for q in range(out.size):
        m, v = t0[q], t1[q]
        m = m if (m > v) | np.isnan(m) else v
        v = t2[q]
        m = m if (m > v) | np.isnan(m) else v
        v = t3[q]
        m = m if (m > v) | np.isnan(m) else v
        v = t4[q]
        m = m if (m > v) | np.isnan(m) else v
        v = t5[q]
        m = m if (m > v) | np.isnan(m) else v
        v = t6[q]
        m = m if (m > v) | np.isnan(m) else v
        v = t7[q]
        m = m if (m > v) | np.isnan(m) else v
        v = t8[q]
        out[q] = m if (m > v) | np.isnan(m) else v


@njit(cache=True, nogil=True)
def _max_taps(out, flat, taps):
    """`_max9` for any number of taps: each tap one pass over the folds in `out`."""
    n = out.size
    if taps.size == 9:
        _max9(out, flat, taps)
        return
    out[:] = flat[taps[0]:taps[0] + n]
    for t in range(1, taps.size):
        _max2(out, out, flat[taps[t]:taps[t] + n])


@njit(cache=True, nogil=True)
def _avg9(out, flat, taps, counts):
    """out[q] = the nine taps flat[q + taps[t]] summed as three rows of three, each row and
    then the rows in order from +0, over counts[q]; each sum held in a register."""
    zero = out.dtype.type(0)
    t0, t1, t2 = flat[taps[0]:], flat[taps[1]:], flat[taps[2]:]
    t3, t4, t5 = flat[taps[3]:], flat[taps[4]:], flat[taps[5]:]
    t6, t7, t8 = flat[taps[6]:], flat[taps[7]:], flat[taps[8]:]
    for q in range(out.size):
        row = zero
        row += t0[q]
        row += t1[q]
        row += t2[q]
        total = zero
        total += row
        row = zero
        row += t3[q]
        row += t4[q]
        row += t5[q]
        total += row
        row = zero
        row += t6[q]
        row += t7[q]
        row += t8[q]
        out[q] = total + row
    # Divided in a pass of its own: with the counts, the loop above reads one array too many
    # for the compiler to vectorize it.
    for q in range(out.size):
        out[q] = out[q] / counts[q]


@njit(cache=True, nogil=True)
def _avg_taps(out, flat, taps, kw, counts, row):
    """`_avg9` for windows of any number of rows of kw (< _UNROLL) taps, one pass over
    `out` (the sums) or `row` (a row's sums) per tap."""
    n, zero = out.size, out.dtype.type(0)
    if taps.size == 9 and kw == 3:
        _avg9(out, flat, taps, counts)
        return
    row = row[:n]
    out[:] = zero
    for t in range(taps.size):
        if t % kw == 0:
            row[:] = zero
        tap = flat[taps[t]:taps[t] + n]
        for q in range(n):
            row[q] += tap[q]
        if t % kw == kw - 1:
            for q in range(n):
                out[q] += row[q]
    for q in range(n):
        out[q] = out[q] / counts[q]


@njit(cache=True, nogil=True)
def _pool_units(x, y, taps, strides, split, pt, pl, fill, kw, counts, group, counter, units):
    """Pooling of planes claimed `group` at a time from `counter` (workers.run_units) until
    `units` (module docstring): max pooling where `counts` is empty, else average pooling
    over counts (the flattened split layout's). The planes of a unit are split together
    (windows.split_plane, split_stack; `split` = (Hq, Wq)), the taps at `taps`
    (windows.tap_offsets). Returns the number of units done."""
    # Views without reference counts (workers.borrowed), the caller holding the arrays.
    x, y, taps, counts = borrowed(x), borrowed(y), borrowed(taps), borrowed(counts)
    p_count, ho, wo = y.shape
    (sh, sw), (hq, wq) = strides, split
    rows = np.full((sh, group * hq, wq * sw), fill, x.dtype)  # the padding stays
    cols = np.full((sw, sh * group * hq * wq), fill, x.dtype)
    sums, row = np.empty(group * hq * wq, x.dtype), np.empty(group * hq * wq, x.dtype)
    done = 0
    u = claim(counter)
    while u < units:
        p0 = u * group
        planes = min(group, p_count - p0)
        for g in range(planes):
            split_plane(x[p0 + g], rows, cols, hq, g, pt, pl)
        flat = split_stack(rows, cols)
        out = sums[:((planes - 1) * hq + ho - 1) * wq + wo]
        if counts.size:
            _avg_taps(out, flat, taps, kw, counts, row)
        else:
            _max_taps(out, flat, taps)
        for g in range(planes):
            keep(sums, g, hq, wq, y[p0 + g])
        done += 1
        u = claim(counter)
    return done


def _fold_ir(builder, a, b):
    """np.maximum's fold step of `_max2` on vectors: a where a > b or a is NaN, else b."""
    keep = builder.or_(builder.fcmp_ordered(">", a, b), builder.fcmp_unordered("uno", a, a))
    return builder.select(keep, a, b)


def _sum_ir(builder, a, b):
    return builder.fadd(a, b)


def _row3s2(combine, from_zero: bool):
    """An intrinsic `row(x, x_offset, h, h_offset, count)`: h[h_offset + i] = the three
    elements x[x_offset + 2i], x[x_offset + 2i + 1], x[x_offset + 2i + 2] combined in that
    order by `combine` (LLVM IR on vectors; starting from +0.0 if `from_zero`), for i <
    count (float32): the row step of a 3-wide, stride-2 window. Sixteen outputs per step, the
    even and odd columns taken apart in registers (a shuffle of two loaded vectors); the last
    partial step loads and stores through lane masks, so it reads no element past
    x[x_offset + 2 * count]."""

    @intrinsic
    def row(typingctx, x, x_offset, h, h_offset, count):
        sig = types.void(x, x_offset, h, h_offset, count)
        return sig, _row3s2_codegen(combine, from_zero)
    return row


def _row3s2_codegen(combine, from_zero: bool):
    lanes = 16
    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    vty, mty = ir.VectorType(f32, lanes), ir.VectorType(ir.IntType(1), lanes)
    evens = ir.Constant(ir.VectorType(i32, lanes), list(range(0, 2 * lanes, 2)))
    odds = ir.Constant(ir.VectorType(i32, lanes), list(range(1, 2 * lanes, 2)))

    def codegen(context, builder, signature, args):
        x_ptr = builder.gep(context.make_array(signature.args[0])(context, builder,
                                                                   args[0]).data, [args[1]])
        h_ptr = builder.gep(context.make_array(signature.args[2])(context, builder,
                                                                   args[2]).data, [args[3]])
        count = args[4]
        module = builder.module
        masked_load = module.declare_intrinsic(
            "llvm.masked.load.v16f32.p0",
            fnty=ir.FunctionType(vty, [vty.as_pointer(), i32, mty, vty]))
        masked_store = module.declare_intrinsic(
            "llvm.masked.store.v16f32.p0",
            fnty=ir.FunctionType(ir.VoidType(), [vty, vty.as_pointer(), i32, mty]))

        def at(base, offset):
            return builder.bitcast(builder.gep(base, [offset]), vty.as_pointer())

        def step(i, load, store):
            src = builder.mul(i, ir.Constant(i64, 2))
            v = [load(at(x_ptr, builder.add(src, ir.Constant(i64, d))), d)
                 for d in (0, lanes, 2, lanes + 2)]
            first = builder.shuffle_vector(v[0], v[1], evens)
            if from_zero:
                first = combine(builder, ir.Constant(vty, None), first)
            second = builder.shuffle_vector(v[0], v[1], odds)
            third = builder.shuffle_vector(v[2], v[3], evens)
            store(combine(builder, combine(builder, first, second), third), at(h_ptr, i))

        full = builder.mul(builder.sdiv(count, ir.Constant(i64, lanes)),
                           ir.Constant(i64, lanes))
        entry = builder.block
        loop = builder.append_basic_block("row_loop")
        tail = builder.append_basic_block("row_tail")
        last = builder.append_basic_block("row_last")
        done = builder.append_basic_block("row_done")
        builder.cbranch(builder.icmp_signed(">", full, ir.Constant(i64, 0)), loop, tail)
        builder.position_at_end(loop)
        i = builder.phi(i64)
        i.add_incoming(ir.Constant(i64, 0), entry)
        step(i, lambda ptr, d: builder.load(ptr, align=4),
             lambda value, ptr: builder.store(value, ptr, align=4))
        following = builder.add(i, ir.Constant(i64, lanes))
        i.add_incoming(following, loop)
        builder.cbranch(builder.icmp_signed("<", following, full), loop, tail)
        builder.position_at_end(tail)
        builder.cbranch(builder.icmp_signed("<", full, count), last, done)
        builder.position_at_end(last)
        # The elements the last outputs read: x_offset + 2 * full + j for j <= 2 * (count -
        # full); lanes past them are neither loaded nor stored.
        rest = builder.sub(count, full)
        reach = builder.add(builder.mul(rest, ir.Constant(i64, 2)), ir.Constant(i64, 1))

        def lane_mask(limit, shift):
            lane = ir.Constant(ir.VectorType(i64, lanes), [shift + j for j in range(lanes)])
            bound = builder.shuffle_vector(
                builder.insert_element(ir.Constant(ir.VectorType(i64, lanes), ir.Undefined),
                                       limit, ir.Constant(i32, 0)),
                ir.Constant(ir.VectorType(i64, lanes), ir.Undefined),
                ir.Constant(ir.VectorType(i32, lanes), [0] * lanes))
            return builder.icmp_signed("<", lane, bound)

        step(full, lambda ptr, d: builder.call(masked_load, [ptr, ir.Constant(i32, 4),
                                                            lane_mask(reach, d),
                                                            ir.Constant(vty, None)]),
             lambda value, ptr: builder.call(masked_store, [value, ptr, ir.Constant(i32, 4),
                                                            lane_mask(rest, 0)]))
        builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()
    return codegen


# The row steps of 3x3 stride-2 max and average pooling: the `_max2` fold, and the sum of
# `_avg9`'s rows from +0.0.
_fold3s2 = _row3s2(_fold_ir, False)
_sum3s2 = _row3s2(_sum_ir, True)


@njit(cache=True, nogil=True, inline="always")
def _fold(acc, v):
    """One step of `_max2`'s fold."""
    return acc if (acc > v) | np.isnan(acc) else v


@njit(cache=True, nogil=True, inline="always")
def _pool3s2_units(x, y, pt, pl, average, group, counter, units):
    """3x3 pooling of stride 2 of float32 planes x (P, H, W) into y (P, Ho, Wo), planes
    claimed `group` at a time from `counter` (workers.run_units) until `units`, without
    splitting the planes by phase: each input row is combined across its three columns of
    every window (`_fold3s2`, `_sum3s2`), then each output across its three rows.

    Taps in the padding are skipped, which gives the bits of the padded window:
    - max (padding -inf): the fold of -inf and v is v whatever v is; the row-major fold's
      result is the window's first NaN, else the last of its elements that compare equal to
      its maximum, and so is the fold of the rows' folds.
    - `average` (padding +0.0): `_avg9` sums each row from +0.0, then the rows from +0.0, then
      divides by the count of input elements under the window; a sum from +0.0 is never -0.0
      (+0.0 + -0.0 is +0.0), and s + 0.0 is s for every other s, NaN and infinities included.
      (Which payload a sum of two NaNs keeps is not pinned, here or in `_avg9`: LLVM may swap
      an addition's operands.)
    Returns the number of units done."""
    # Views without reference counts (workers.borrowed), the caller holding the arrays.
    x, y = borrowed(x), borrowed(y)
    planes, h, w = x.shape
    ho, wo = y.shape[1], y.shape[2]
    start = np.float32(0) if average else np.float32(-np.inf)
    # Outputs lo .. hi - 1 of a row have all three columns inside it.
    lo = min(wo, (pl + 1) // 2)
    hi = max(lo, min(wo, (w - 3 + pl) // 2 + 1))
    rows = np.empty(h * wo, np.float32)
    xf, yf = x.reshape(-1), y.reshape(-1)
    done = 0
    while True:
        u = claim(counter)
        if u >= units:
            return done
        for p in range(u * group, min(planes, (u + 1) * group)):
            for iy in range(h):
                base, row = (p * h + iy) * w, iy * wo
                if hi > lo and average:
                    _sum3s2(xf, base + 2 * lo - pl, rows, row + lo, hi - lo)
                elif hi > lo:
                    _fold3s2(xf, base + 2 * lo - pl, rows, row + lo, hi - lo)
                for e in range(wo - (hi - lo)):  # the outputs at the edges
                    ox = e if e < lo else e + hi - lo
                    acc = start
                    for kx in range(3):
                        ix = 2 * ox + kx - pl
                        if 0 <= ix < w:
                            acc = acc + xf[base + ix] if average else _fold(acc, xf[base + ix])
                    rows[row + ox] = acc
            for oy in range(ho):
                out = yf[(p * ho + oy) * wo:(p * ho + oy + 1) * wo]
                top = 2 * oy - pt
                # Two loops, not one with the kind inside: that one took SqueezeNet b8's max
                # pools 5.2 against 4.4 ms (two copies of this kernel: 3.6 against 3.4).
                if 0 <= top and top + 2 < h and not average:
                    r0 = rows[top * wo:top * wo + wo]
                    r1 = rows[(top + 1) * wo:(top + 1) * wo + wo]
                    r2 = rows[(top + 2) * wo:(top + 2) * wo + wo]
                    for ox in range(wo):
                        out[ox] = _fold(_fold(r0[ox], r1[ox]), r2[ox])
                    continue
                if 0 <= top and top + 2 < h:
                    r0 = rows[top * wo:top * wo + wo]
                    r1 = rows[(top + 1) * wo:(top + 1) * wo + wo]
                    r2 = rows[(top + 2) * wo:(top + 2) * wo + wo]
                    for ox in range(wo):
                        out[ox] = ((start + r0[ox]) + r1[ox]) + r2[ox]
                else:
                    out[:] = start
                    for iy in range(max(0, top), min(h, top + 3)):
                        r = rows[iy * wo:iy * wo + wo]
                        for ox in range(wo):
                            out[ox] = out[ox] + r[ox] if average else _fold(out[ox], r[ox])
                if average:
                    count_y = np.float32(min(h, top + 3) - max(0, top))
                    for ox in range(wo):
                        count_x = min(w, 2 * ox - pl + 3) - max(0, 2 * ox - pl)
                        out[ox] = out[ox] / (count_y * np.float32(count_x))
        done += 1


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


def _geometry(x: np.ndarray, kernel: tuple[int, int], strides: tuple[int, int],
              padding: tuple[int, ...]) -> tuple[int, int, np.ndarray]:
    """(Ho, Wo, x as contiguous (N * C, H, W) planes)."""
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = kernel, strides, padding
    n, c, h, w = x.shape
    ho = (h + pt + pb - kh) // sh + 1
    wo = (w + pl + pr - kw) // sw + 1
    return ho, wo, np.ascontiguousarray(x).reshape(n * c, h, w)


def _pool(planes: np.ndarray, y: np.ndarray, kernel: tuple[int, int],
          strides: tuple[int, int], padding: tuple[int, ...], fill: np.generic,
          counts: np.ndarray | None) -> None:
    """y (P, Ho, Wo) = `_pool_units` of planes (P, H, W): max pooling, or average pooling
    over `counts` (Ho, Wo)."""
    p_count, h, w = planes.shape
    ho, wo = y.shape[1:]
    group = min(p_count, max(1, _STACK // ((h + padding[0] + padding[2])
                                           * (w + padding[1] + padding[3]))))
    split = split_shape((ho, wo), kernel, strides)
    taps = tap_offsets(kernel, strides, (1, 1), split, group)
    if counts is None:
        flat_counts = np.empty(0, planes.dtype)
    else:
        # The layout of the stacked planes' outputs; the positions not kept divide by 1.
        flat_counts = np.ones((group,) + split, planes.dtype)
        flat_counts[:, :ho, :wo] = counts
        flat_counts = flat_counts.reshape(-1)
    units = -(-p_count // group)
    args = (planes, y, taps, tuple(int(v) for v in strides), split, *padding[:2], fill,
            kernel[1], flat_counts, group)
    if y.size * kernel[0] * kernel[1] < _SERIAL_BELOW:
        _pool_units(*args, np.zeros(1, np.int64), units)
    else:
        run_units(_pool_units, units, *args)


@njit(cache=True, nogil=True)
def _max3s2_units(x, y, pt, pl, group, counter, units):
    """`_pool3s2_units` of max pooling, compiled with `average` a constant."""
    return _pool3s2_units(x, y, pt, pl, False, group, counter, units)


@njit(cache=True, nogil=True)
def _avg3s2_units(x, y, pt, pl, group, counter, units):
    """`_pool3s2_units` of average pooling, compiled with `average` a constant."""
    return _pool3s2_units(x, y, pt, pl, True, group, counter, units)


def _pool3s2(planes: np.ndarray, y: np.ndarray, padding: tuple[int, ...],
             average: bool) -> None:
    """y (P, Ho, Wo) = `_pool3s2_units` of float32 planes (P, H, W)."""
    group = max(1, _STACK // (planes.shape[1] * planes.shape[2]))
    units = -(-planes.shape[0] // group)
    kernel = _avg3s2_units if average else _max3s2_units
    args = (planes, y, padding[0], padding[1], group)
    if y.size < _POOL3S2_SERIAL_BELOW:
        kernel(*args, np.zeros(1, np.int64), units)
    else:
        run_units(kernel, units, *args)


def max_pool2d(x: np.ndarray, kernel: tuple[int, int], strides: tuple[int, int],
               padding: tuple[int, int, int, int]) -> np.ndarray:
    """Max over each window of NCHW x (float or integer), padded by (top, left, bottom,
    right) with values that never win (-inf, or the integer type's minimum)."""
    ho, wo, planes = _geometry(x, kernel, strides, padding)
    lowest = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
    y = np.empty(x.shape[:2] + (ho, wo), x.dtype)
    if y.size and x.dtype == np.float32 and kernel == (3, 3) and strides == (2, 2):
        _pool3s2(planes, y.reshape(-1, ho, wo), padding, False)
    elif y.size:
        _pool(planes, y.reshape(-1, ho, wo), kernel, strides, padding, x.dtype.type(lowest),
              None)
    return y


def avg_pool2d(x: np.ndarray, kernel: tuple[int, int], strides: tuple[int, int],
               padding: tuple[int, int, int, int]) -> np.ndarray:
    """Mean of each window of float NCHW x, zero-padded by (top, left, bottom, right), over
    the input elements under it (count_include_pad=0), in the module docstring's order."""
    (kh, kw), (sh, sw), (pt, pl) = kernel, strides, padding[:2]
    ho, wo, planes = _geometry(x, kernel, strides, padding)
    h, w = x.shape[2:]
    inside_h = np.minimum(np.arange(ho) * sh - pt + kh, h) - np.maximum(np.arange(ho) * sh - pt, 0)
    inside_w = np.minimum(np.arange(wo) * sw - pl + kw, w) - np.maximum(np.arange(wo) * sw - pl, 0)
    counts = np.multiply.outer(inside_h, inside_w).astype(x.dtype)
    y = np.empty(x.shape[:2] + (ho, wo), x.dtype)
    if not y.size:
        return y
    if x.dtype == np.float32 and kernel == (3, 3) and strides == (2, 2) and wo > 1:
        _pool3s2(planes, y.reshape(-1, ho, wo), padding, True)
    elif wo == 1 or kw >= _UNROLL:
        args = (planes, y.reshape(-1, ho, wo), counts, kh, kw, sh, sw, pt, pl)
        if y.size * kh * kw < _SERIAL_BELOW:
            _avg_windows(*args, 0, planes.shape[0])
        else:
            run_blocks(_avg_windows, planes.shape[0], *args)
    else:
        _pool(planes, y.reshape(-1, ho, wo), kernel, strides, padding, x.dtype.type(0), counts)
    return y
