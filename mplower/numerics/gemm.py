"""The one float matrix product of mplower, with a summation order that is mplower's own.

BLAS libraries pick their blocking, and with it the order in which an output's products are
summed, by CPU kernel (OPENBLAS_CORETYPE), thread count and matrix shape, and vectorize along
K so that a row's result depends on where it sits in its batch. With products that round (f32
operands, the fp32 reference) each of those changes the last bit. `matmul` fixes the order:

    c[i, j] = 0;  for k = 0, 1, ..., K-1:  c[i, j] = fl(c[i, j] + fl(a[i, k] * b[k, j]))

in the result's precision (float32, or float64 when an operand is float64), a rounded product
and a rounded sum per step, never a fused multiply-add. The kernel is a register-tiled GEMM in
the BLIS manner: b is packed into column panels (read in place where packing does not pay),
and each tile of TILE_ROWS rows by one panel keeps its accumulators in vector registers
(mplower.numerics.gemm_kernel's `_micro`, which may neither contract nor reorder) over K or,
packed, over a slice of K, then stores them in c, where the next slice continues
the same sums: sliced or not, each sum runs over k = 0 .. K-1 in order. Rows past the last
full tile run one at a time, and a product of fewer than TILE_ROWS rows streams b row by row
instead (`_rows`, batch-1 inference). A tile belongs to one thread (threads claim blocks of tiles,
mplower.numerics.workers.run_units), SIMD lanes are different output columns, and K is never
split between threads or sums, so every output element is the same function of its own row
of `a` and column of `b` whatever the thread count, the BLAS library, the CPU's vector width,
the tile a row lands in or the batch around it. tests/test_gemm.py checks every path bit for
bit against that loop written in numpy.

`conv_product`, the same product with b the im2col of an image, is in
mplower.numerics.conv_gemm. Integer operands stay on np.matmul: numpy multiplies integers
without BLAS, exactly. `integer_matmul` gives the same exact products at float32 GEMM speed
where the operands are small (8-bit quantized values), by splitting K so that no partial sum
leaves float32's integers.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from mplower.numerics import jitcache  # noqa: F401  (before the first jitted function)
from mplower.numerics.gemm_kernel import (
    TILE_ROWS,
    _epilogue_in_place,
    _finish_tile,
    _micro,
    _panel_columns,
    _store,
)
from mplower.numerics.workers import borrowed, claim, run_blocks, run_units

# Below this many multiply-adds (about 0.1 ms on one core) one thread does the whole product:
# handing units to a worker (run_units) costs tens of microseconds. 2^25 (the threshold from
# before units were claimed inside compiled code) kept ShuffleNet's grouped 1x1 convs at batch
# 8 on one thread; 2^21 was no better and ShuffleNet b8 10% slower (docs/benchmarks.md).
SERIAL_BELOW = 1 << 23


@njit(cache=True, nogil=True)
def _pack(b, panels, q, cols, base):
    """Column panel q of the contiguous stack b (B, K, N), counted batch-major, into
    panels[base:] as (K, cols) contiguous, zero past N. Each row of the panel is one
    contiguous copy (unsigned indices, as in _epilogue_in_place, so that it vectorizes)."""
    kk, n = b.shape[1], b.shape[2]
    per = (n + cols - 1) // cols
    batch, j0 = q // per, (q % per) * cols
    width = np.uint64(min(cols, n - j0))
    flat = b.reshape(-1)
    for k in range(kk):
        src, dst = np.uint64((batch * kk + k) * n + j0), np.uint64(base + k * cols)
        for j in range(width):
            panels[dst + j] = flat[src + j]
        for j in range(width, np.uint64(cols)):
            panels[dst + j] = 0


@njit(cache=True, inline="always")
def _tile(a, b, c, cf, ia, ib, t, cols, chunk, scale, bias, relu, tile, total):
    """Output tile t of c (B, M, N) of a product whose b is not packed (`_repays_packing`):
    batch, then column panel, then row block, accumulated over all of K in
    _micro's order and stored through the epilogue (`_store`). Full panels are read from b in
    place, the last partial one is packed. With `chunk` < K (integer operands, see
    `integer_matmul`) each chunk of K is summed on its own, exactly, and the chunks add up in
    float64, exactly. cf is c.reshape(-1), made once per product rather than per tile (a
    reshape is a call into numba's runtime)."""
    m, kk, n = a.shape[1], a.shape[2], c.shape[2]
    rows_t = (m + TILE_ROWS - 1) // TILE_ROWS
    per = (n + cols - 1) // cols
    batch, rest = t // (rows_t * per), t % (rows_t * per)
    p, i0 = rest // rows_t, (rest % rows_t) * TILE_ROWS
    j0 = p * cols
    a_offset = (ia[batch] * m + i0) * kk
    if j0 + cols <= n:
        _finish_tile(a, a_offset, b, ib[batch] * kk * n + j0, n, c, cf, batch, i0, j0, cols,
                     chunk, scale, bias, relu, tile, total)
        return
    source = np.zeros(kk * cols, b.dtype)
    _pack(b, source, ib[batch] * per + p, cols, 0)
    _finish_tile(a, a_offset, source, 0, cols, c, cf, batch, i0, j0, cols, chunk, scale,
                 bias, relu, tile, total)


_TILES_PER_UNIT = 4


@njit(cache=True, nogil=True)
def _tile_units(a, b, c, ia, ib, cols, chunk, scale, bias, relu, counter, units):
    """A product whose b is not packed (`_repays_packing`): the tiles of c in `_tile`'s order,
    _TILES_PER_UNIT to a unit, for the units claimed from `counter` (workers.run_units);
    returns the number of units done."""
    # Views without reference counts (workers.borrowed), the caller holding the arrays.
    a, b, c = borrowed(a), borrowed(b), borrowed(c)
    ia, ib, scale, bias = borrowed(ia), borrowed(ib), borrowed(scale), borrowed(bias)
    tile, total = np.empty(TILE_ROWS * cols, a.dtype), np.empty(TILE_ROWS * cols, np.float64)
    cf = c.reshape(-1)
    tiles = c.shape[0] * ((c.shape[1] + TILE_ROWS - 1) // TILE_ROWS) \
        * ((c.shape[2] + cols - 1) // cols)
    done = 0
    while True:
        u = claim(counter)
        if u >= units:
            return done
        for t in range(u * _TILES_PER_UNIT, min(tiles, (u + 1) * _TILES_PER_UNIT)):
            _tile(a, b, c, cf, ia, ib, t, cols, chunk, scale, bias, relu, tile, total)
        done += 1


def _gemm_in_place(a, b, c, ia, ib, cols, chunk, scale, bias, relu, serial):
    tiles = c.shape[0] * -(-c.shape[1] // TILE_ROWS) * -(-c.shape[2] // cols)
    args = (a, b, c, ia, ib, cols, chunk, scale, bias, relu)
    if serial:
        _tile_units(*args, np.zeros(1, np.int64), -(-tiles // _TILES_PER_UNIT))
    else:
        run_units(_tile_units, -(-tiles // _TILES_PER_UNIT), *args)


@njit(cache=True, nogil=True)
def _pack_blocks(b, panels, cols, q0, q1):
    for q in range(q0, q1):
        _pack(b, panels, q, cols, q * b.shape[1] * cols)


# The cache blocking of a packed product (the BLIS loop order), in units of _BLOCK_ROWS rows
# by _BLOCK_PANELS panels: K is swept in slices of _DEPTH, over which a slice of a panel
# (_DEPTH x cols, 32 KB of float32) stays in L1 while the unit's row tiles pass over it, and
# the unit's slice of a (_BLOCK_ROWS x _DEPTH, 256 KB) stays in L2 while its panels pass. A
# full tile's sums continue in c from one slice to the next (stored and reloaded as they are,
# exactly), so every sum keeps the module docstring's order. The sizes change the speed only.
_DEPTH, _BLOCK_ROWS, _BLOCK_PANELS = 256, 256, 8
# Units to aim for, so that two threads share a small product (or one with few blocks) and a
# late thread's share is picked up by the other: blocks are halved (rows first) until there
# are this many, down to one tile.
_MIN_UNITS = 16


def _blocks(c: np.ndarray, cols: int) -> tuple[int, int, int]:
    """(rows, panels) of a unit of `_block_units` for c (B, M, N), and the number of units:
    _BLOCK_ROWS by _BLOCK_PANELS, each halved (the one there are fewer blocks of first) while
    there are fewer than _MIN_UNITS units."""
    rows, panels = _BLOCK_ROWS, _BLOCK_PANELS
    m, per = c.shape[1], -(-c.shape[2] // cols)
    while c.shape[0] * -(-m // rows) * -(-per // panels) < _MIN_UNITS:
        if rows > TILE_ROWS and (panels == 1 or -(-m // rows) <= -(-per // panels)):
            rows //= 2
        elif panels > 1:
            panels //= 2
        else:
            break
    return rows, panels, c.shape[0] * -(-m // rows) * -(-per // panels)


@njit(cache=True, nogil=True)
def _block_units(a, panels, c, ia, ib, cols, block_rows, block_panels, chunk, scale, bias,
                 relu, counter, units):
    """The blocks of c (B, M, N) claimed from `counter` (workers.run_units): unit u is matrix
    u // (column blocks * row blocks), then a block of `block_panels` panels, then a block of
    `block_rows` rows (a multiple of TILE_ROWS); b is packed in `panels` (`_pack`). Full
    tiles of a float product run sliced over K (see _DEPTH); the rest (the last rows and
    panel, integer chunks) as `_finish_tile` does for any tile. Returns the number of units
    done."""
    # Views without reference counts (workers.borrowed), the caller holding the arrays.
    a, panels, c = borrowed(a), borrowed(panels), borrowed(c)
    ia, ib, scale, bias = borrowed(ia), borrowed(ib), borrowed(scale), borrowed(bias)
    m, kk, n = a.shape[1], a.shape[2], c.shape[2]
    per = (n + cols - 1) // cols
    row_blocks = (m + block_rows - 1) // block_rows
    col_blocks = (per + block_panels - 1) // block_panels
    tile, total = np.empty(TILE_ROWS * cols, a.dtype), np.empty(TILE_ROWS * cols, np.float64)
    cf = c.reshape(-1)
    sliced = chunk >= kk > 0 and c.itemsize == a.itemsize
    epilogue = scale.size or bias.size or relu
    done = 0
    while True:
        u = claim(counter)
        if u >= units:
            return done
        batch, rest = u // (row_blocks * col_blocks), u % (row_blocks * col_blocks)
        jb, rb = rest // row_blocks, rest % row_blocks
        i_start, i_end = rb * block_rows, min(m, (rb + 1) * block_rows)
        p_start, p_end = jb * block_panels, min(per, (jb + 1) * block_panels)
        # Rows in full tiles, panels full of columns: the sliced tiles when `sliced`.
        i_full = i_start + (i_end - i_start) // TILE_ROWS * TILE_ROWS if sliced else i_start
        p_full = min(p_end, n // cols) if sliced else p_start
        a_base, q_base = ia[batch] * m * kk, ib[batch] * per
        for k0 in range(0, kk if sliced else 0, _DEPTH):
            depth = min(_DEPTH, kk - k0)
            last = k0 + depth == kk
            for p in range(p_start, p_full):
                offset = ((q_base + p) * kk + k0) * cols
                for i0 in range(i_start, i_full, TILE_ROWS):
                    _micro(a, a_base + i0 * kk + k0, kk, panels, offset, cols, c,
                           (batch * m + i0) * n + p * cols, n, depth, 1 if k0 == 0 else 0)
                    if last and epilogue:
                        _epilogue_in_place(cf, m, n, batch, i0, p * cols, cols, scale, bias,
                                           relu)
        for p in range(p_start, p_end):
            for i0 in range(i_start, i_end, TILE_ROWS):
                if p < p_full and i0 < i_full:
                    continue
                _finish_tile(a, a_base + i0 * kk, panels, (q_base + p) * kk * cols, cols, c,
                             cf, batch, i0, p * cols, cols, chunk, scale, bias, relu, tile,
                             total)
        done += 1


# Packing b is a pass over it (two where it leaves the cache), repaid where each panel is read
# by many rows, or b is narrow (fewer than _WIDE panels): on one thread 64 x 576 @ 576 x 25088
# (a conv's im2col shape) ran at half speed packed, 256 x 1024 @ 1024 x 1568 at two thirds,
# 1024 x 768 @ 768 x 3072 30% faster. A weight packed once (PackedMatrix) is always read packed.
_PACK_ROWS, _WIDE = 512, 8


def _repays_packing(rows: int, n: int, cols: int) -> bool:
    """Whether a product whose b (N columns) is read by `rows` rows packs b on each call."""
    return rows >= _PACK_ROWS or -(-n // cols) < _WIDE


def _gemm_packed(a, b, c, ia, ib, cols, chunk, scale, bias, relu, serial, panels=None):
    """A product of more than 2 * TILE_ROWS rows whose b is packed (`_repays_packing`), which
    also keeps the rows of a panel clear of the cache aliasing of a power-of-two stride (b's
    rows read in place 12 KB apart: a quarter of BERT's GEMM speed lost)."""
    packed = panels is not None  # b's panels as `PackedMatrix` made them
    if not packed:
        panels = _pack_all(b, cols, serial)
    rows, per_unit, units = _blocks(c, cols)
    args = (a, panels, c, ia, ib, cols, rows, per_unit, chunk, scale, bias, relu)
    if serial:
        _block_units(*args, np.zeros(1, np.int64), units)
    else:
        run_units(_block_units, units, *args)


def _pack_all(b: np.ndarray, cols: int, serial: bool) -> np.ndarray:
    """Every column panel of the stack b (B, K, N), batch-major, each (K, cols) (`_pack`)."""
    count = b.shape[0] * -(-b.shape[2] // cols)
    panels = np.empty(count * b.shape[1] * cols, b.dtype)
    if serial:
        _pack_blocks(b, panels, cols, 0, count)
    else:
        run_blocks(_pack_blocks, count, b, panels, cols)
    return panels


class PackedMatrix:
    """A matrix b (K, N) in the form the product reads it, made once for the many products
    with one weight (the executor packs its constant weights): `matmul(a, packed)` gives
    a @ b with the same bits, without converting and packing b on every call. `dtype` is the
    precision the products run in (float32 or float64); an integer b must be exact in it."""

    def __init__(self, b: np.ndarray, dtype: np.dtype) -> None:
        if np.ndim(b) != 2:
            raise ValueError(f"PackedMatrix: b must be 2-D, not {np.shape(b)}")
        self.dtype = np.dtype(dtype)
        self.stack = np.ascontiguousarray(np.asarray(b).reshape((1,) + np.shape(b)), self.dtype)
        self.shape = self.stack.shape[1:]
        self.panels = _pack_all(self.stack, _panel_columns(self.dtype),
                                self.stack.size < SERIAL_BELOW)


# Fewer rows than a register tile: each row streams b once, row by row, its outputs in chunks
# of _CHUNK columns (in L1) accumulated in memory. Same order: k outer, one product and one sum
# per step, lanes along the columns.
_CHUNK = 512


@njit(cache=True)
def _rows(a, b, c, ia, ib, t, chunk, scale, bias, relu):
    """Chunk t of c (B, M, N) (batch, then row, then column chunk), swept over k, K split
    into exact chunks for integer operands as in `_tile`, stored through the epilogue."""
    m, kk, n = a.shape[1], a.shape[2], c.shape[2]
    chunks = (n + _CHUNK - 1) // _CHUNK
    batch, rest = t // (m * chunks), t % (m * chunks)
    i, j0 = rest // chunks, (rest % chunks) * _CHUNK
    j1 = min(j0 + _CHUNK, n)
    x = a[ia[batch], i]
    w = b[ib[batch]]
    y = np.zeros(j1 - j0, a.dtype)
    if chunk >= kk:
        _row_sweep(x, w, y, j0, 0, kk)
        _store(y, c.reshape(-1), m, n, batch, i, 1, j0, j1 - j0, scale, bias, relu)
    else:
        total = np.zeros(j1 - j0, np.float64)
        for k0 in range(0, kk, chunk):
            y[:] = 0
            _row_sweep(x, w, y, j0, k0, min(kk, k0 + chunk))
            total += y
        _store(total, c.reshape(-1), m, n, batch, i, 1, j0, j1 - j0, scale, bias, relu)


@njit(cache=True)
def _row_sweep(x, w, y, j0, k0, k1):
    for k in range(k0, k1):
        xk = x[k]
        row = w[k, j0:j0 + y.size]
        for j in range(y.size):
            y[j] += xk * row[j]


@njit(cache=True)
def _rows_serial(a, b, c, ia, ib, chunk, scale, bias, relu):
    for t in range(c.shape[0] * c.shape[1] * ((c.shape[2] + _CHUNK - 1) // _CHUNK)):
        _rows(a, b, c, ia, ib, t, chunk, scale, bias, relu)


@njit(cache=True, nogil=True)
def _rows_blocks(a, b, c, ia, ib, chunk, scale, bias, relu, t0, t1):
    for t in range(t0, t1):
        _rows(a, b, c, ia, ib, t, chunk, scale, bias, relu)


def _rows_parallel(a, b, c, ia, ib, chunk, scale, bias, relu):
    run_blocks(_rows_blocks, c.shape[0] * c.shape[1] * ((c.shape[2] + _CHUNK - 1) // _CHUNK),
               a, b, c, ia, ib, chunk, scale, bias, relu)


def _batches(x: np.ndarray, batch: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray,
                                                                              np.ndarray]:
    """x as a contiguous (B, rows, cols) stack of its own matrices, and for each of the
    `batch` products (flattened) the index of its matrix: broadcasting without copies."""
    own = x.shape[:-2]
    stack = np.ascontiguousarray(x.reshape((int(np.prod(own)),) + x.shape[-2:]), dtype)
    index = np.arange(stack.shape[0], dtype=np.int64).reshape(own)
    return stack, np.ascontiguousarray(np.broadcast_to(index, batch).reshape(-1))


_NONE = np.zeros((0, 0), np.float32)


def _epilogue_table(v: np.ndarray | None, dtype: np.dtype, rows: int) -> np.ndarray:
    """A per-output-row vector (length G * rows, G groups of `rows` rows) as the (G, rows)
    table `_store` reads, or an empty one."""
    if v is None:
        return _NONE.astype(dtype)
    return np.ascontiguousarray(np.asarray(v, dtype).reshape(-1, rows))


def _product(a: np.ndarray, b: np.ndarray, work: np.dtype, out: np.dtype, chunk: int | None,
             scale: np.ndarray | None, bias: np.ndarray | None, relu: bool) -> np.ndarray:
    """The shared body of `matmul` and `integer_matmul`: c = epilogue(a @ b) in `out`."""
    packed = b if isinstance(b, PackedMatrix) else None
    if packed is not None and packed.dtype != work:
        raise ValueError(f"matmul: b is packed for {packed.dtype}, the product runs in {work}")
    if a.ndim == 0 or len(b.shape) == 0:
        raise ValueError("matmul: operands must have at least one dimension")
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = packed.stack[0] if packed is not None else b[:, None] if b.ndim == 1 else b
    if a2.shape[-1] != b2.shape[-2]:
        raise ValueError(f"matmul: contraction mismatch: {a.shape} @ {b.shape}")
    batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    (m, k), n = a2.shape[-2:], b2.shape[-1]
    sa, ia = _batches(a2, batch, work)
    sb, ib = _batches(b2, batch, work) if packed is None else (
        packed.stack, np.zeros(int(np.prod(batch)), np.int64))
    epilogue = scale is not None or bias is not None or relu
    c = np.empty((ia.size, m, n), out) if k or epilogue else np.zeros((ia.size, m, n), out)
    if c.size:
        # An epilogue over an empty contraction still has its rows of zeros to finish.
        chunk = k if chunk is None else chunk
        tables = (max(chunk, 1), _epilogue_table(scale, np.float32, m),
                  _epilogue_table(bias, work if scale is None else np.float32, m), relu)
        serial = c.size * max(k, 1) < SERIAL_BELOW
        if m < TILE_ROWS:
            (_rows_serial if serial else _rows_parallel)(sa, sb, c, ia, ib, *tables)
        elif m <= 2 * TILE_ROWS or packed is None and not _repays_packing(
                m * ia.size // sb.shape[0], n, _panel_columns(work)):
            _gemm_in_place(sa, sb, c, ia, ib, _panel_columns(work), *tables, serial)
        else:
            _gemm_packed(sa, sb, c, ia, ib, _panel_columns(work), *tables, serial,
                         None if packed is None else packed.panels)
    y = c.reshape(batch + (m, n))
    if a.ndim == 1:
        y = y[..., 0, :]
    if len(b.shape) == 1:
        y = y[..., 0]
    return y


def matmul(a: np.ndarray, b: np.ndarray, *, bias: np.ndarray | None = None,
           relu: bool = False) -> np.ndarray:
    """np.matmul(a, b) (batch broadcasting, 1-D operands) in the fixed order of the module
    docstring for float operands (float32, or float64 if either is); integers as np.matmul.

    `bias` (one value per row of the result, or per row of every matrix of the batch, in
    batch-major order) and `relu` are applied as each output is stored, the float operations
    `y + bias` and np.maximum(y, 0) would do: the same bits without another pass over memory."""
    if isinstance(b, PackedMatrix):
        a = np.asarray(a)
        return _product(a, b, np.result_type(a, b.dtype), b.dtype, None, None, bias, relu)
    a, b = np.asarray(a), np.asarray(b)
    dtype = np.result_type(a, b)
    if dtype.kind != "f":
        y = np.matmul(a, b)
        if bias is not None:
            y = y + np.asarray(bias).reshape(-1, 1)
        return np.maximum(y, 0) if relu else y
    dtype = np.dtype(np.float64 if dtype == np.float64 else np.float32)
    return _product(a, b, dtype, dtype, None, None, bias, relu)


def amax_of_bits(largest: np.uint32) -> float:
    """The amax (rounding.amax) whose largest |x| bit pattern is `largest`: NaN above +inf."""
    return float("nan") if largest > _F32_INF_BITS else float(np.uint32(largest).view(np.float32))


_F32_INF_BITS = 0x7F800000

# Every integer of magnitude up to 2**24 is a float32, so is every sum and product of such
# integers that stays within it: in that range float32 arithmetic is integer arithmetic.
F32_EXACT = 1 << 24


def int_magnitude(x: np.ndarray) -> int:
    """A bound on |x| for an integer-valued array, as a Python int: its type's for 8-bit
    integers (128 for i8: no pass over the data, and the K chunks it gives are within 2% of
    the data's), else max |x| (no int8 wrap-around)."""
    bound = _BYTE_BOUNDS.get(x.dtype)
    if bound is not None:
        return bound
    return max(abs(int(x.min())), abs(int(x.max()))) if x.size else 0


# int_magnitude's bound of each 8-bit type: a lookup, not an np.iinfo per call (a conv of a
# static int8 plan asked for it four times, 64 calls per ShuffleNet inference).
_BYTE_BOUNDS = {np.dtype(t): max(-int(np.iinfo(t).min), int(np.iinfo(t).max))
                for t in (np.int8, np.uint8)}


def integer_matmul(a: np.ndarray, b: np.ndarray, bound: int | None = None, *,
                   scale: np.ndarray | None = None, bias: np.ndarray | None = None,
                   relu: bool = False) -> np.ndarray:
    """np.matmul of integer-valued operands (integer arrays, or float32 arrays holding
    integers), exactly, as int64. `bound` bounds |a| * |b| where the caller knows it.

    With |a| <= A and |b| <= B every partial sum of `chunk` = 2**24 // (A * B) products is an
    integer below 2**24, so the float32 GEMM computes each K chunk exactly, whatever its
    summation order; inside each register tile the chunks add up in float64, exactly (far below
    2**53). That is np.matmul's result bit for bit, at float32 speed. Larger operands fall back
    to np.matmul in int64.

    With `scale` and/or `bias` (one float32 per row, as `matmul`'s bias) and `relu` the result
    is float32: float32(y) * scale + bias, then relu, each step rounded as DequantizeLinear
    (of the int32 sum, zero point 0), Add and Relu round it, applied as each sum is stored."""
    a, b = np.asarray(a), np.asarray(b)
    k = a.shape[-1]
    if bound is None:
        bound = int_magnitude(a) * int_magnitude(b)
    epilogue = scale is not None or bias is not None or relu
    if bound > F32_EXACT or max(a.ndim, b.ndim) < 2:
        if epilogue:
            raise ValueError("integer_matmul: an epilogue needs operands within float32's "
                             "integers")
        return np.matmul(a.astype(np.int64), b.astype(np.int64))
    f32 = np.dtype(np.float32)
    return _product(a, b, f32, f32 if epilogue else np.dtype(np.int64),
                    F32_EXACT // bound if bound else k, scale, bias, relu)
