"""The one float matrix product of mplower, with a summation order that is mplower's own.

BLAS libraries pick their blocking, and with it the order in which an output's products are
summed, by CPU kernel (OPENBLAS_CORETYPE), thread count and matrix shape, and vectorize along
K so that a row's result depends on where it sits in its batch. With products that round (f32
operands, the fp32 reference) each of those changes the last bit. `matmul` fixes the order:

    c[i, j] = 0;  for k = 0, 1, ..., K-1:  c[i, j] = fl(c[i, j] + fl(a[i, k] * b[k, j]))

in the result's precision (float32, or float64 when an operand is float64), a rounded product
and a rounded sum per step, never a fused multiply-add. The kernel is a register-tiled GEMM in
the BLIS manner: b is packed into column panels (read in place for 16 rows or fewer, or 8
panels or more), and each tile of _ROWS rows by one panel keeps its accumulators in vector
registers over the whole of K (`_micro`, LLVM vector IR without fast-math flags, so LLVM may
neither contract nor reorder); rows past the last full tile run one at a time, and a product
of fewer than _ROWS rows streams b row by row instead (`_rows`, batch-1 inference). A tile belongs to one thread
(mplower.numerics.workers hands out blocks of tiles), SIMD lanes are different output
columns, and K is never split, so every output element is the same
function of its own row of `a` and column of `b` whatever the thread count, the BLAS library,
the CPU's vector width, the tile a row lands in or the batch around it. tests/test_gemm.py
checks every path bit for bit against that loop written in numpy.

Integer operands stay on np.matmul: numpy multiplies integers without BLAS, exactly.
`integer_matmul` gives the same exact products at float32 GEMM speed where the operands are
small (8-bit quantized values), by splitting K so that no partial sum leaves float32's integers.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from mplower.numerics.workers import run_blocks

# The register tile: _ROWS output rows x _VECTORS vectors of 64 bytes (16 float32 or 8 float64
# columns), 16 accumulators that stay in registers over the whole of K. The sizes change the
# speed only, never a result.
_ROWS, _VECTORS, _VECTOR_BYTES = 8, 2, 64
# Below this many multiply-adds (about 1 ms on one core) one thread does the whole product:
# entering a parallel region costs tens of microseconds on an idle machine, and a scheduler
# time slice (~12 ms) when other processes hold the cores, as on a shared 2-core VM.
SERIAL_BELOW = 1 << 25


def _micro_kernel(rows: int):
    """An intrinsic `micro(a, a_offset, lda, panel, panel_offset, ldp, tile, depth)` for
    `rows` output rows: tile[r, :] += a[a_offset + r * lda + k] * panel[panel_offset + k * ldp
    + :] for k = 0 .. depth-1 in that order, over a (rows, cols) tile held in registers.

    Written as LLVM vector IR because numba's loops cannot keep an accumulator tile in
    registers: each lane is one output column, and each step is an `fmul` then an `fadd`
    without fast-math flags, so LLVM may neither fuse (FMA) nor reorder them."""

    @intrinsic
    def micro(typingctx, a, a_offset, lda, panel, panel_offset, ldp, tile, depth):
        sig = types.void(a, a_offset, lda, panel, panel_offset, ldp, tile, depth)
        width = 8 if a.dtype == types.float64 else 4
        fty = ir.DoubleType() if width == 8 else ir.FloatType()
        lanes = _VECTOR_BYTES // width
        return sig, _codegen(rows, lanes, ir.VectorType(fty, lanes))
    return micro


def _codegen(rows: int, lanes: int, vty: ir.VectorType):
    cols = lanes * _VECTORS
    i64 = ir.IntType(64)

    def codegen(context, builder, signature, args):
        av, a_off, lda_v, pv, p_off, ldp, tv, kk = args
        a_ptr = builder.gep(context.make_array(signature.args[0])(context, builder, av).data,
                            [a_off])
        p_ptr = builder.gep(context.make_array(signature.args[3])(context, builder, pv).data,
                            [p_off])
        t_ptr = context.make_array(signature.args[6])(context, builder, tv).data

        def vector_at(base, offset):
            return builder.bitcast(builder.gep(base, [offset]), vty.as_pointer())

        def const(v):
            return ir.Constant(i64, v)

        slots = [(r, v) for r in range(rows) for v in range(_VECTORS)]
        init = {rv: builder.load(vector_at(t_ptr, const(rv[0] * cols + rv[1] * lanes)), align=4)
                for rv in slots}
        entry = builder.block
        loop = builder.append_basic_block("gemm_k")
        done = builder.append_basic_block("gemm_done")
        builder.cbranch(builder.icmp_signed(">", kk, const(0)), loop, done)
        builder.position_at_end(loop)
        k = builder.phi(i64)
        acc = {rv: builder.phi(vty) for rv in slots}
        row = builder.mul(k, ldp)
        b = [builder.load(vector_at(p_ptr, builder.add(row, const(v * lanes))), align=4)
             for v in range(_VECTORS)]
        zeros = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
        new = {}
        for r in range(rows):
            x = builder.load(builder.gep(a_ptr, [builder.add(builder.mul(const(r), lda_v), k)]))
            x = builder.insert_element(ir.Constant(vty, ir.Undefined), x,
                                       ir.Constant(ir.IntType(32), 0))
            x = builder.shuffle_vector(x, ir.Constant(vty, ir.Undefined), zeros)
            for v in range(_VECTORS):
                new[r, v] = builder.fadd(acc[r, v], builder.fmul(x, b[v]))
        k_next = builder.add(k, const(1))
        k.add_incoming(const(0), entry)
        k.add_incoming(k_next, loop)
        for rv in slots:
            acc[rv].add_incoming(init[rv], entry)
            acc[rv].add_incoming(new[rv], loop)
        builder.cbranch(builder.icmp_signed("<", k_next, kk), loop, done)
        builder.position_at_end(done)
        final = {}
        for rv in slots:
            final[rv] = builder.phi(vty)
            final[rv].add_incoming(init[rv], entry)
            final[rv].add_incoming(new[rv], loop)
        for (r, v), value in final.items():
            builder.store(value, vector_at(t_ptr, const(r * cols + v * lanes)), align=4)
        return context.get_dummy_value()
    return codegen


_micro = _micro_kernel(_ROWS)
_micro_row = _micro_kernel(1)  # the rows past the last full tile, one at a time


@njit(cache=True)
def _pack(b, panels, q, cols, base):
    """Column panel q of the stack b (B, K, N), counted batch-major, into panels[base:] as
    (K, cols) contiguous, zero past N."""
    kk, n = b.shape[1], b.shape[2]
    per = (n + cols - 1) // cols
    batch, j0 = q // per, (q % per) * cols
    for k in range(kk):
        for j in range(cols):
            panels[base + k * cols + j] = b[batch, k, j0 + j] if j0 + j < n else 0


@njit(cache=True)
def _tile(a, b, panels, c, ia, ib, t, cols):
    """Output tile t of c (B, M, N): batch, then column panel, then row block (consecutive
    tiles share a panel), accumulated over all of K in _micro's order and stored. Without
    `panels` (empty: too few rows to repay packing) full panels are read from b in place."""
    m, kk, n = a.shape[1], a.shape[2], c.shape[2]
    rows_t = (m + _ROWS - 1) // _ROWS
    per = (n + cols - 1) // cols
    batch, rest = t // (rows_t * per), t % (rows_t * per)
    p, i0 = rest // rows_t, (rest % rows_t) * _ROWS
    j0 = p * cols
    if panels.size:
        source, offset, ldp = panels, (ib[batch] * per + p) * kk * cols, cols
    elif j0 + cols <= n:
        source, offset, ldp = b.reshape(-1), ib[batch] * kk * n + j0, n
    else:  # the last, partial panel
        source, offset, ldp = np.zeros(kk * cols, b.dtype), 0, cols
        _pack(b, source, ib[batch] * per + p, cols, 0)
    tile = np.zeros(_ROWS * cols, c.dtype)
    if i0 + _ROWS <= m:
        _micro(a.reshape(-1), (ia[batch] * m + i0) * kk, kk, source, offset, ldp, tile, kk)
    else:
        for r in range(m - i0):
            _micro_row(a.reshape(-1), (ia[batch] * m + i0 + r) * kk, kk, source, offset, ldp,
                       tile[r * cols:], kk)
    for r in range(min(_ROWS, m - i0)):
        for j in range(min(cols, n - j0)):
            c[batch, i0 + r, j0 + j] = tile[r * cols + j]


_WIDE = 8


@njit(cache=True)
def _panels(b, c, cols):
    """Room for b packed into column panels, or an empty array where packing does not pay:
    c has too few rows (each panel would be read by one or two row blocks), or b is wide
    (_WIDE panels or more, as the im2col of a conv: the packed copy leaves the cache, an extra
    pass over memory, while its full panels read in place stream well)."""
    per = (c.shape[2] + cols - 1) // cols
    size = b.shape[0] * per * b.shape[1] * cols if c.shape[1] > 2 * _ROWS and per < _WIDE else 0
    return np.empty(size, b.dtype), b.shape[0] * per if size else 0


@njit(cache=True)
def _gemm_serial(a, b, c, ia, ib, cols):
    panels, count = _panels(b, c, cols)
    for q in range(count):
        _pack(b, panels, q, cols, q * b.shape[1] * cols)
    for t in range(c.shape[0] * ((c.shape[1] + _ROWS - 1) // _ROWS)
                   * ((c.shape[2] + cols - 1) // cols)):
        _tile(a, b, panels, c, ia, ib, t, cols)


@njit(cache=True, nogil=True)
def _pack_blocks(b, panels, cols, q0, q1):
    for q in range(q0, q1):
        _pack(b, panels, q, cols, q * b.shape[1] * cols)


@njit(cache=True, nogil=True)
def _tile_blocks(a, b, panels, c, ia, ib, cols, t0, t1):
    for t in range(t0, t1):
        _tile(a, b, panels, c, ia, ib, t, cols)


def _gemm_parallel(a, b, c, ia, ib, cols):
    panels, count = _panels(b, c, cols)
    run_blocks(_pack_blocks, count, b, panels, cols)
    run_blocks(_tile_blocks, c.shape[0] * ((c.shape[1] + _ROWS - 1) // _ROWS)
               * ((c.shape[2] + cols - 1) // cols), a, b, panels, c, ia, ib, cols)


# Fewer rows than a register tile: each row streams b once, row by row, its outputs in chunks
# of _CHUNK columns (in L1) accumulated in memory. Same order: k outer, one product and one sum
# per step, lanes along the columns.
_CHUNK = 512


@njit(cache=True)
def _rows(a, b, c, ia, ib, t):
    """Chunk t of c (B, M, N) (batch, then row, then column chunk), swept over k."""
    m, kk, n = a.shape[1], a.shape[2], c.shape[2]
    chunks = (n + _CHUNK - 1) // _CHUNK
    batch, rest = t // (m * chunks), t % (m * chunks)
    i, j0 = rest // chunks, (rest % chunks) * _CHUNK
    j1 = min(j0 + _CHUNK, n)
    x = a[ia[batch], i]
    w = b[ib[batch]]
    y = c[batch, i, j0:j1]
    y[:] = 0
    for k in range(kk):
        xk = x[k]
        row = w[k, j0:j1]
        for j in range(j1 - j0):
            y[j] += xk * row[j]


@njit(cache=True)
def _rows_serial(a, b, c, ia, ib):
    for t in range(c.shape[0] * c.shape[1] * ((c.shape[2] + _CHUNK - 1) // _CHUNK)):
        _rows(a, b, c, ia, ib, t)


@njit(cache=True, nogil=True)
def _rows_blocks(a, b, c, ia, ib, t0, t1):
    for t in range(t0, t1):
        _rows(a, b, c, ia, ib, t)


def _rows_parallel(a, b, c, ia, ib):
    run_blocks(_rows_blocks, c.shape[0] * c.shape[1] * ((c.shape[2] + _CHUNK - 1) // _CHUNK),
               a, b, c, ia, ib)


def _batches(x: np.ndarray, batch: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray,
                                                                              np.ndarray]:
    """x as a contiguous (B, rows, cols) stack of its own matrices, and for each of the
    `batch` products (flattened) the index of its matrix: broadcasting without copies."""
    own = x.shape[:-2]
    stack = np.ascontiguousarray(x.reshape((int(np.prod(own)),) + x.shape[-2:]), dtype)
    index = np.arange(stack.shape[0], dtype=np.int64).reshape(own)
    return stack, np.ascontiguousarray(np.broadcast_to(index, batch).reshape(-1))


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """np.matmul(a, b) (batch broadcasting, 1-D operands) in the fixed order of the module
    docstring for float operands (float32, or float64 if either is); integers as np.matmul."""
    a, b = np.asarray(a), np.asarray(b)
    dtype = np.result_type(a, b)
    if dtype.kind != "f":
        return np.matmul(a, b)
    dtype = np.dtype(np.float64 if dtype == np.float64 else np.float32)
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError("matmul: operands must have at least one dimension")
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    if a2.shape[-1] != b2.shape[-2]:
        raise ValueError(f"matmul: contraction mismatch: {a.shape} @ {b.shape}")
    batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    (m, k), n = a2.shape[-2:], b2.shape[-1]
    sa, ia = _batches(a2, batch, dtype)
    sb, ib = _batches(b2, batch, dtype)
    c = np.empty((ia.size, m, n), dtype) if k else np.zeros((ia.size, m, n), dtype)
    if c.size and k:
        serial = c.size * k < SERIAL_BELOW
        if m < _ROWS:
            (_rows_serial if serial else _rows_parallel)(sa, sb, c, ia, ib)
        else:
            (_gemm_serial if serial else _gemm_parallel)(
                sa, sb, c, ia, ib, _VECTORS * _VECTOR_BYTES // dtype.itemsize)
    y = c.reshape(batch + (m, n))
    if a.ndim == 1:
        y = y[..., 0, :]
    if b.ndim == 1:
        y = y[..., 0]
    return y


# Every integer of magnitude up to 2**24 is a float32, so is every sum and product of such
# integers that stays within it: in that range float32 arithmetic is integer arithmetic.
F32_EXACT = 1 << 24


def int_magnitude(x: np.ndarray) -> int:
    """A bound on |x| for an integer-valued array, as a Python int: its type's for 8-bit
    integers (128 for i8: no pass over the data, and the K chunks it gives are within 2% of
    the data's), else max |x| (no int8 wrap-around)."""
    if x.dtype.kind in "iu" and x.dtype.itemsize == 1:
        info = np.iinfo(x.dtype)
        return max(-int(info.min), int(info.max))
    return max(abs(int(x.min())), abs(int(x.max()))) if x.size else 0


def integer_matmul(a: np.ndarray, b: np.ndarray, bound: int | None = None) -> np.ndarray:
    """np.matmul of integer-valued operands (integer arrays, or float32 arrays holding
    integers), exactly, as int64. `bound` bounds |a| * |b| where the caller knows it.

    With |a| <= A and |b| <= B every partial sum of `chunk` = 2**24 // (A * B) products is an
    integer below 2**24, so the float32 GEMM computes each K chunk exactly, whatever its
    summation order; the chunks are summed in int64. That is np.matmul's result bit for bit, at
    float32 speed (i8 x i8: chunks of 1024). Larger operands fall back to np.matmul in int64."""
    a, b = np.asarray(a), np.asarray(b)
    k = a.shape[-1]
    if bound is None:
        bound = int_magnitude(a) * int_magnitude(b)
    if bound > F32_EXACT or max(a.ndim, b.ndim) < 2:
        return np.matmul(a.astype(np.int64), b.astype(np.int64))
    chunk = F32_EXACT // bound if bound else k
    if chunk >= k:
        return matmul(a.astype(np.float32, copy=False),
                      b.astype(np.float32, copy=False)).astype(np.int64)
    # The chunks' exact sums add up exactly in float64 too (far below 2**53).
    y = None
    for k0 in range(0, k, chunk):
        part = matmul(a[..., k0:k0 + chunk].astype(np.float32, copy=False),
                      b[..., k0:k0 + chunk, :].astype(np.float32, copy=False))
        y = part.astype(np.float64) if y is None else np.add(y, part, out=y)
    return y.astype(np.int64)
