"""Elementwise chains of a network as one compiled pass over memory.

`add` and `relu` alone are numpy's np.add and np.maximum(x, 0) of float arrays on the worker
threads (the fp32 reference that calibration runs spends a tenth of its time in them on
ResNet-50); each output is the same float operation, so the same bits as numpy's.

`add_relu` is np.maximum(a + b, 0) of two float arrays of one shape (a residual connection and
its relu): each output is the float add, rounded once, then the relu's select (a value <= 0,
-0.0 included, becomes +0.0; NaN stays), the operations the two ops compute on their own, so
the bits are the same as running them one after the other, without the intermediate array and
its second pass. With `rounding` (a bf16/f16 plan's residual), each output is then rounded by
round_to's own kernel (rounding._round_one) as it is stored: the bits of round_to after the
two ops. Each output depends only on its own inputs, so the parallel blocks (workers.py) give
the same bits for any thread count.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from mplower.numerics.gemm import amax_of_bits
from mplower.numerics.quant import _quantize_one, store_table
from mplower.numerics.rounding import (
    MX_ROUNDING_FORMATS,
    ROUNDING_FORMATS,
    _param_array,
    _param_tuple,
    rounded_bits,
)
from mplower.numerics.workers import run_blocks

# Below this many elements one thread does the whole loop (about 0.1 ms of streaming; see
# gemm.SERIAL_BELOW for why small work stays off the worker threads).
SERIAL_BELOW = 1 << 18
_CHUNK = 1 << 16  # elements per parallel chunk (a few per thread at SERIAL_BELOW)


@njit(cache=True, nogil=True)
def _add_relu_serial(a, b, y, bits, rounding, rpa, largest, qp, qout):
    """The loop over one block; returns max(largest, the block's largest |y| bit pattern)
    where `largest` is given as an unsigned int (bits: y's float32 bit patterns). With
    `qout` (not empty), y quantized into it too (quant._quantize_one with qp = scale, zero
    point, lowest, highest)."""
    zero, rp = y.dtype.type(0), _param_tuple(rpa)
    for i in range(y.size):
        v = a[i] + b[i]
        v = zero if v <= zero else v  # noqa: FURB136 - max(0, NaN) would be 0
        if rounding:
            bits[i] = rounded_bits(np.float32(v).view(np.uint32), rp)
        else:
            y[i] = v
    # The amax in a loop of its own over the block, still in cache: taken in the loop above
    # it stopped that loop vectorizing (bf16 add_relu of 853k values: 0.16 -> 0.91 ms).
    if largest >= 0:
        for i in range(bits.size):
            largest = max(largest, np.int64(bits[i] & np.uint32(0x7FFFFFFF)))
    # The quantize too in a loop of its own over the block, in cache.
    if qout.size:
        s, z, lo, hi = qp[0], qp[1], qp[2], qp[3]
        for i in range(qout.size):
            qout[i] = _quantize_one(y[i], s, z, lo, hi)[0]
    return largest


@njit(cache=True, nogil=True)
def _add_relu_chunks(a, b, y, bits, rounding, rpa, qp, qout, parts, c0, c1):
    """Chunks c0 .. c1 - 1 of _CHUNK elements; parts[c] gets chunk c's largest |y| bits."""
    for c in range(c0, c1):
        lo, hi = c * _CHUNK, min(y.size, (c + 1) * _CHUNK)
        m = _add_relu_serial(a[lo:hi], b[lo:hi], y[lo:hi], bits[lo:hi] if bits.size else bits,
                             rounding, rpa, 0 if parts.size else -1, qp,
                             qout[lo:hi] if qout.size else qout)
        if parts.size:
            parts[c] = m


def add_relu(a: np.ndarray, b: np.ndarray, rounding: str | None = None,
             amax: list | None = None, quantize: tuple | None = None) -> np.ndarray:
    """np.maximum(a + b, 0) for float arrays of the same shape and dtype, in one pass; then
    rounded to `rounding` (a round_to format other than the MX ones; float32 operands) as
    round_to rounds. `amax` (a list) is set to [rounding.amax of a float32 result], taken
    in the same pass. `quantize` = (scale, zero point, format, found), a float32 result, per
    tensor, to an 8-bit integer format: `found` (a list) is set to [quant.quantize's integers
    of the result] (its storage dtype), from the same pass."""
    if a.shape != b.shape or a.dtype != b.dtype or a.dtype.kind != "f":
        raise ValueError(f"add_relu: operands must be float arrays of one shape and dtype, "
                         f"got {a.dtype}{a.shape} and {b.dtype}{b.shape}")
    if rounding is not None and (a.dtype != np.float32 or rounding in MX_ROUNDING_FORMATS):
        raise ValueError("add_relu: rounding applies to float32 operands, in a format of "
                         "round_to other than the MX ones")
    fa, fb = np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1)
    y = np.empty(fa.size, a.dtype)
    counted = amax is not None and a.dtype == np.float32
    bits = y.view(np.uint32) if rounding is not None or counted else np.zeros(0, np.uint32)
    args = (fa, fb, y, bits, rounding is not None, _param_array(rounding or "bf16", False))
    qp, qout = _NO_QP, _NO_Q
    if quantize is not None:
        scale, zp, fmt, found = quantize
        table = store_table(scale, zp, fmt)
        if table is None or a.dtype != np.float32:
            raise ValueError("add_relu: quantize takes a float32 result, per tensor, to an "
                             "8-bit integer format")
        qp, storage = table
        qout = np.empty(fa.size, np.uint8)  # int8 values written here wrap to their bits
    if y.size < SERIAL_BELOW:
        largest = _add_relu_serial(*args, 0 if counted else -1, qp, qout)
    else:
        chunks = -(-y.size // _CHUNK)
        parts = np.zeros(chunks if counted else 0, np.int64)
        run_blocks(_add_relu_chunks, chunks, *args, qp, qout, parts)
        largest = int(parts.max()) if counted else -1
    if counted:
        amax[:] = [amax_of_bits(np.uint32(largest))]
    if quantize is not None:
        found[:] = [qout.view(storage).reshape(a.shape)]
    return y.reshape(a.shape)


_NO_QP, _NO_Q = np.zeros(4, np.float32), np.empty(0, np.uint8)


def _rounding_steps(formats: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Each format's round_to parameters (one row each) and whether it rounds at all ("f32"
    does not: its row is a placeholder)."""
    return (np.stack([_param_array("bf16" if f == "f32" else f, False) for f in formats]),
            np.array([f != "f32" for f in formats]))


@njit(cache=True, nogil=True)
def _column_rows(bits, columns, vectors, params, rounds, r0, r1):
    """Rows r0 .. r1 - 1 of the (rows, columns) float32 bit patterns `bits`, in place: rounded
    by params[0] if rounds[0], then for each s, plus vectors[s] (a float32 add along the row)
    and rounded by params[s + 1] if rounds[s + 1]. A row at a time, one step after another,
    while it is in L1."""
    for r in range(r0, r1):
        row = bits[r * columns:(r + 1) * columns]
        if rounds[0]:
            p = _param_tuple(params[0])
            for j in range(columns):
                row[j] = rounded_bits(row[j], p)
        for s in range(vectors.shape[0]):
            vector = vectors[s]
            if rounds[s + 1]:
                p = _param_tuple(params[s + 1])
                for j in range(columns):
                    v = np.float32(np.uint32(row[j]).view(np.float32) + vector[j])
                    row[j] = rounded_bits(v.view(np.uint32), p)
            else:
                for j in range(columns):
                    v = np.float32(np.uint32(row[j]).view(np.float32) + vector[j])
                    row[j] = v.view(np.uint32)


def round_add_columns(y: np.ndarray, first: str, adds: list[tuple[np.ndarray, str]]) -> None:
    """In place over float32 y (..., N) (C-contiguous): y rounded to `first`, then for each
    (vector, fmt) of `adds` y + vector (N float32 values, added along the last axis as numpy
    broadcasts them) rounded to fmt; "f32" rounds nothing, the other formats are round_to's
    (not the MX ones), with its bits. So a matmul's result rounded to its format, then the
    adds of bias vectors that follow it, each rounded to its format, take one pass over memory
    instead of two per op, and no new arrays."""
    formats = [first] + [f for _, f in adds]
    if y.dtype != np.float32 or not y.flags.c_contiguous or y.ndim < 1 \
            or any(f in MX_ROUNDING_FORMATS for f in formats) \
            or any(v.shape != (y.shape[-1],) or v.dtype != np.float32 for v, _ in adds):
        raise ValueError("round_add_columns: a C-contiguous float32 array, float32 vectors "
                         "along its last axis, round_to formats other than the MX ones")
    columns = y.shape[-1]
    if not y.size:
        return
    bits = y.reshape(-1).view(np.uint32)
    vectors = np.ascontiguousarray(np.array([v for v, _ in adds], np.float32).reshape(
        len(adds), columns))
    params, rounds = _rounding_steps(formats)
    rows = bits.size // columns
    if bits.size < SERIAL_BELOW:
        _column_rows(bits, columns, vectors, params, rounds, 0, rows)
    else:
        run_blocks(_column_rows, rows, bits, columns, vectors, params, rounds)


_BINARY = {"add": 0, "sub": 1, "mul": 2}


@njit(cache=True, nogil=True)
def _binary_rows(a, a_full, b, b_full, out, bits, columns, code, params, rounds, r0, r1):
    """Rows r0 .. r1 - 1 of out (a (rows, columns) float32 result): a[i] + b[i], a[i] - b[i]
    or a[i] * b[i] (code 0, 1, 2), where an operand that is not `full` is a vector along the
    row (b[j]), as a float32 operation; then the row, still in L1, rounded in place by
    params[0] if rounds[0] and by params[1] if rounds[1] (bits: out's float32 bits, a view
    taken by the caller)."""
    for r in range(r0, r1):
        lo, hi = r * columns, (r + 1) * columns
        o = out[lo:hi]
        x = a[lo:hi] if a_full else a
        y = b[lo:hi] if b_full else b
        if code == 0:
            for j in range(columns):
                o[j] = x[j] + y[j]
        elif code == 1:
            for j in range(columns):
                o[j] = x[j] - y[j]
        else:
            for j in range(columns):
                o[j] = x[j] * y[j]
        ob = bits[lo:hi]
        for s in range(2):
            if rounds[s]:
                p = _param_tuple(params[s])
                for j in range(columns):
                    ob[j] = rounded_bits(ob[j], p)


def binary_rounded(op: str, a: np.ndarray, b: np.ndarray, formats: tuple[str, ...]
                   ) -> np.ndarray:
    """np.add, np.subtract or np.multiply (`op`: "add", "sub", "mul") of float32 a and b,
    rounded to each of `formats` (at most two; round_to's, not the MX ones; "f32" rounds
    nothing) in turn, in one pass: the bits of the numpy op, then of round_to per format. One
    operand has the result's shape; the other that shape too, or is a vector along the last
    axis (N values), or a single value."""
    full = a if a.ndim >= b.ndim and a.size >= b.size else b
    shape, columns = full.shape, full.shape[-1] if full.ndim else 1

    def operand(v: np.ndarray) -> tuple[np.ndarray, bool]:
        if v.shape == shape:
            return np.ascontiguousarray(v).reshape(-1), True
        if v.size == 1 or v.ndim and v.shape[-1] == columns and v.size == columns \
                and np.broadcast_shapes(v.shape, shape) == shape:
            return np.ascontiguousarray(np.broadcast_to(v.reshape(-1), (columns,))), False
        raise ValueError(f"binary_rounded: {v.shape} is neither {shape} nor a vector along "
                         f"its last axis")

    if op not in _BINARY or a.dtype != np.float32 or b.dtype != np.float32 \
            or len(formats) > 2 \
            or any(f not in ROUNDING_FORMATS or f in MX_ROUNDING_FORMATS for f in formats):
        raise ValueError("binary_rounded: add, sub or mul of float32 arrays (one C-contiguous),"
                         " rounded to at most two round_to formats other than the MX ones")
    (fa, a_full), (fb, b_full) = operand(a), operand(b)
    y = np.empty(shape, np.float32)
    flat = y.reshape(-1)
    params, rounds = _rounding_steps(list(formats) + ["f32"] * (2 - len(formats)))
    rows = flat.size // columns if columns else 0
    args = (fa, a_full, fb, b_full, flat, flat.view(np.uint32), columns, _BINARY[op], params,
            rounds)
    if flat.size < SERIAL_BELOW:
        _binary_rows(*args, 0, rows)
    else:
        run_blocks(_binary_rows, rows, *args)
    return y


@njit(cache=True, nogil=True)
def _plain_serial(a, b, y, add, relu):
    """y = a + b (`add`) or a, then relu'd (`relu`): the selects of add_relu."""
    zero = y.dtype.type(0)
    for i in range(y.size):
        v = a[i] + b[i] if add else a[i]
        y[i] = (zero if v <= zero else v) if relu else v  # noqa: FURB136 - NaN stays


@njit(cache=True, nogil=True)
def _plain_chunks(a, b, y, add, relu, c0, c1):
    for c in range(c0, c1):
        lo, hi = c * _CHUNK, min(y.size, (c + 1) * _CHUNK)
        _plain_serial(a[lo:hi], b[lo:hi] if add else b, y[lo:hi], add, relu)


def _plain(a: np.ndarray, b: np.ndarray | None, relu: bool) -> np.ndarray:
    fa = np.ascontiguousarray(a).reshape(-1)
    fb = fa[:0] if b is None else np.ascontiguousarray(b).reshape(-1)
    y = np.empty(fa.size, a.dtype)
    args = (fa, fb, y, b is not None, relu)
    if y.size < SERIAL_BELOW:
        _plain_serial(*args)
    else:
        run_blocks(_plain_chunks, -(-y.size // _CHUNK), *args)
    return y.reshape(a.shape)


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """np.add(a, b) for float arrays of one shape and dtype (float32 or float64)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.dtype not in (np.float32, np.float64):
        raise ValueError(f"add: operands must be float32 or float64 arrays of one shape and "
                         f"dtype, got {a.dtype}{a.shape} and {b.dtype}{b.shape}")
    return _plain(a, b, False)


def relu(x: np.ndarray) -> np.ndarray:
    """np.maximum(x, 0) of a float32 or float64 array: -0.0 becomes +0.0, NaN stays."""
    if x.dtype not in (np.float32, np.float64):
        raise ValueError(f"relu: a float32 or float64 array, got {x.dtype}")
    return _plain(x, None, True)
