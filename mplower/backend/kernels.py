"""The kernels the executor's op table maps ops to, and the helpers they share.

A kernel takes its operands (numpy arrays of values: formats narrower than f32 held as the
float32 values they represent, integers as integers) and returns its result with what its
rounding counted (overflow, underflow, NaN; None where nothing was counted). Every kernel
computes the bits its op's reference semantics give in the op's formats; the fused ops of the
`fuse` pass (mplower.dialect.fused) run on kernels that make one pass over memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np

from mplower.backend.scaled import ScaleStats, limited_accum_matmul, scaled_quant_kernel
from mplower.dialect.fused import F32_EXACT, RELU_BEFORE_ROUNDING
from mplower.dialect.mp import CONTRACTIONS, VALUE_PRESERVING
from mplower.dialect.plan import ACCUM_BITS, PROMOTE_EVERY
from mplower.ir.opdef import OPS, OpDef, attr_array, attr_int, attr_type, check_attrs
from mplower.ir.types import TensorType, value_dtype
from mplower.numerics.elementwise import add_relu, round_add_columns
from mplower.numerics.formats import FORMATS
from mplower.numerics.gemm import PackedMatrix, matmul
from mplower.numerics.quant import dequantize, quantize, quantizer
from mplower.numerics.rounding import (
    ROUNDING_FORMATS,
    Counts,
    decode,
    matmul_f16_accum,
    round_to,
)
from mplower.numerics.windows import conv_windows, pad_hw

NO_COUNTS = Counts()
# What an op runs on when it returns a result together with what rounding it did (None: the
# result passed through unrounded; `run` counts its NaNs, `run_lowered` does not need to).
Kernel = Callable[[list[np.ndarray]], tuple[np.ndarray, Counts | None]]


def f32(x: np.ndarray) -> np.ndarray:
    return x if x.dtype == np.float32 else x.astype(np.float32)


def finish(y: np.ndarray, elem: str, saturate: bool = False) -> tuple[np.ndarray, Counts | None]:
    """A computed result in the values of `elem`: rounded (with counts) or converted."""
    if elem in ROUNDING_FORMATS and elem != "f32":
        # np.ascontiguousarray makes a 0-d array 1-d: the rounded scalar gets its shape back.
        rounded, counts = round_to(np.ascontiguousarray(f32(y)), elem, saturate)
        return rounded.reshape(np.shape(y)), counts
    if FORMATS[elem].is_float:
        with np.errstate(over="ignore"):  # float64 beyond float32's range is inf, as IEEE
            return y.astype(value_dtype(elem), copy=False), None
    return y.astype(value_dtype(elem), copy=False), NO_COUNTS


def nan_counts(y: np.ndarray) -> Counts:
    return Counts(nan=int(np.count_nonzero(np.isnan(y)))) if y.dtype.kind == "f" else NO_COUNTS


def wide_type(t: TensorType) -> TensorType:
    return t.with_elem("f32") if FORMATS[t.elem].is_float and t.elem != "f64" else t


def magnitude(elem: str) -> float:
    """The largest |value| of an integer format (128 for i8)."""
    f = FORMATS[elem]
    return max(abs(f.min_value), f.max_finite)


def fused_matmul_kernel(opdef: OpDef, attrs: dict, in_types: list[TensorType],
                         out_t: TensorType) -> Kernel:
    """mp.fused_matmul: an 8-bit integer product's exact sums times the column scale, or a
    float product rounded to the result's format, then each addend (a vector along the last
    axis) added and rounded, in one pass over the result in place: the bits of the separate
    ops' kernels (the fuse pass makes the op only where they are). Integer sums that float32
    does not hold exactly run the op's reference."""
    a_t, b_t = in_types[:2]
    elem, addends = out_t.elem, len(in_types) - 2
    if "scale" in attrs and all(t.elem in ("i8", "ui8") for t in (a_t, b_t)) \
            and magnitude(a_t.elem) * magnitude(b_t.elem) * a_t.shape[-1] <= F32_EXACT \
            and elem == "f32" and all(t.elem == "f32" for t in in_types[2:]):
        scale = np.ascontiguousarray(np.broadcast_to(
            attr_array(attrs["scale"]).astype(np.float32).reshape(-1), (out_t.shape[-1],)))
        return dequantized_matmul_kernel(scale, addends)
    if "scale" not in attrs:  # the product's format, then each add's (the last: the result's)
        formats = [*(attrs.get("formats") or [elem] * addends), elem]
        return rounded_matmul_kernel(formats[0], formats[1:])
    return generic_kernel(opdef, attrs, [out_t], 0, False)  # sums beyond float32's exact


def column_vectors(addends: list[np.ndarray], columns: int) -> list[np.ndarray]:
    """Each addend (a float vector along the last axis) as a float32 vector of `columns`."""
    return [np.ascontiguousarray(np.broadcast_to(f32(v).reshape(-1), (columns,)))
            for v in addends]


def rounded_matmul_kernel(elem: str, formats: list[str]) -> Kernel:
    """A float matmul's result rounded to `elem`, then each addend added and rounded to its
    entry of `formats`: the bits of the matmul's kernel and of the adds' (float32 adds, then
    round_to), in one pass over the result, in place."""
    def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        y = matmul(f32(xs[0]), working_weight(xs[1], np.float32))
        round_add_columns(y, elem, list(zip(column_vectors(xs[2:], y.shape[-1]), formats,
                                            strict=True)))
        return y, None  # fused: no counts
    run.weight_dtype = np.dtype(np.float32)  # type: ignore[attr-defined]
    return run


def dequantized_matmul_kernel(scale: np.ndarray, addends: int) -> Kernel:
    """An 8-bit integer matmul's exact sums in float32 (products of 8-bit values, |sum| below
    2^24: the GEMM's float32 sums are the integers, so float32(int32(y)) * s is y * s), times
    `scale` and plus each addend, each a float32 operation in place."""
    def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        y = matmul(xs[0].astype(np.float32), working_weight(xs[1], np.float32))
        np.multiply(y, scale, out=y)
        for vector in column_vectors(xs[2:], y.shape[-1]):
            np.add(y, vector, out=y)
        return y, None  # fused: no counts
    run.weight_dtype = np.dtype(np.float32)  # type: ignore[attr-defined]
    return run


def add_relu_rounding(in_types: list[TensorType], out_t: TensorType) -> tuple | None:
    """(the rounded format or None,) where mp.add_relu runs on add_relu's one-pass kernel:
    operands of the result's shape, each f32 or in its format, a format that takes its relu
    before the rounding (mplower.numerics.elementwise.add_relu); else None."""
    elem = out_t.elem
    if (elem != "f32" and elem not in RELU_BEFORE_ROUNDING) \
            or any(t != out_t.with_elem(t.elem) or t.elem not in ("f32", elem) for t in in_types):
        return None
    return (None if elem == "f32" else elem,)


def add_relu_kernel(rounded: str | None, box: Any = None,
                     quantize: tuple | None = None) -> Kernel:
    """mp.add of two operands of the result's shape, then mp.relu, in one pass; a rounded
    result takes its relu before the rounding (see RELU_BEFORE_ROUNDING: the same bits).
    With a `box` (lowered._amax_shared), box.amax is set to the result's amax, from the same
    pass; with `quantize` (scale, zero point, format; lowered._quantize_shared) box.q to the
    result's integers."""
    def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        found = None if box is None or quantize is not None else []
        q: list = []
        y = add_relu(f32(xs[0]), f32(xs[1]), rounded, amax=found,
                     quantize=None if quantize is None else (*quantize, q))
        if found is not None:
            box.amax = found[0]
        if quantize is not None:
            box.q = q[0]
        return y, None  # run_lowered keeps no counts
    return run


# ---- kernels -------------------------------------------------------------------------------


# A one-operand elementwise op with only scalar attributes runs on pieces of this many values:
# its reference computes in float64 with a temporary per step (hard_swish: six times its
# result at once, on the whole tensor), and the result of each value depends on that value
# alone, so the pieces give the same bits in a fraction of the memory.
PIECE = 1 << 16
_SCALAR_ATTRS = frozenset({"alpha", "beta", "gamma", "lambd", "bias", "approximate"})


def in_pieces(op: str) -> bool:
    """Whether `op` may run piece by piece (PIECE)."""
    opdef = OPS.get(op)
    return opdef is not None and opdef.elementwise and opdef.max_operands == 1 \
        and set(opdef.attrs) <= _SCALAR_ATTRS


def _by_pieces(fn: Callable[[np.ndarray, TensorType], tuple[np.ndarray, Counts | None]],
               x: np.ndarray, t: TensorType) -> tuple[np.ndarray, Counts | None]:
    """fn(piece, its type) over the flattened `x` piece by piece, the results and counts put
    together (see PIECE)."""
    flat = x.reshape(-1)
    out, counts = None, None
    for s in range(0, flat.size, PIECE):
        piece = flat[s:s + PIECE]
        y, c = fn(piece, replace(t, shape=piece.shape))
        if out is None:
            out = np.empty(flat.size, y.dtype)
        out[s:s + PIECE] = y
        counts = c if counts is None else counts + c if c is not None else counts
    return out.reshape(x.shape), counts


def reference_kernel(reference: Callable, attrs: dict, op: str, out_types: list[TensorType],
               k: int) -> Callable:
    """The op's result `k` in the fp32 reference: its numpy semantics on f32 values, results
    kept wide."""
    out_t = out_types[k]
    wide = [wide_type(t) for t in out_types]
    as_f32 = [t.with_elem("f32") for t in out_types]

    def run(xs: list[np.ndarray]) -> np.ndarray | None:
        xs = [f32(x) if x.dtype.kind == "f" and x.dtype != np.float64 else x for x in xs]
        rt = wide
        if op == "mp.fused_matmul" and "scale" in attrs \
                and len({x.dtype.kind == "f" for x in xs[:2]}) == 2:
            return None  # as its matmul's: an integer operand that never was a float
        if op in CONTRACTIONS and not FORMATS[out_t.elem].is_float:
            kinds = {x.dtype.kind == "f" for x in xs[:2]}
            if kinds == {True, False}:
                # An integer operand that never was a float (an i8 constant or argument fed
                # straight to the matmul): its scale is unknown, so there is no fp32 value.
                return None
            if kinds == {True}:
                rt = as_f32  # an integer plan whose quantize was removed: the reference is float
        if pieces and xs[0].size > PIECE and xs[0].shape == out_t.shape:
            return _by_pieces(lambda x, t: (reference([x], attrs, [t])[0], None), xs[0],
                              rt[0])[0]
        return reference(xs, attrs, rt)[k]
    pieces = in_pieces(op)
    return run


def generic_kernel(opdef: OpDef, attrs: dict, out_types: list[TensorType], k: int,
                    exact: bool) -> Kernel:
    """The op's numpy reference in f32 (integers as they are) for result `k`, rounded to
    its type unless it is `exact`: a value-preserving op on operands already in that type.
    Its attributes are checked here, once (steps run under np.errstate: _run_steps, _execute)."""
    rt = [wide_type(t) for t in out_types]
    elem = out_types[k].elem
    reference = opdef.reference
    if opdef.reference_checked is not None:
        reference, attrs = opdef.reference_checked, check_attrs(opdef, attrs)

    def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        xs = [f32(x) if x.dtype.kind == "f" and x.dtype != np.float64 else x for x in xs]
        if pieces and xs[0].size > PIECE and xs[0].shape == out_types[0].shape:
            return _by_pieces(lambda x, t: one(reference([x], attrs, [t])[0]), xs[0], rt[0])
        return one(reference(xs, attrs, rt)[k])

    def one(y: np.ndarray) -> tuple[np.ndarray, Counts | None]:
        return (y, None) if exact else finish(y, elem)
    pieces = in_pieces(opdef.name)
    return run


def cast_kernel(out_t: TensorType, attrs: dict, reference: Callable) -> Kernel:
    elem = out_t.elem
    if not FORMATS[elem].is_float:
        return lambda xs: (reference([xs[0]], attrs, [out_t])[0], NO_COUNTS)
    saturate = bool(attrs["saturate"]) and elem.startswith("f8")  # ONNX Cast: fp8 only
    return lambda xs: finish(xs[0], elem, saturate)


def quant_kernel(op: str, attrs: dict, in_t: TensorType, out_t: TensorType) -> Kernel:
    scale = attr_array(attrs["scale"]).astype(np.float32)
    zp = attr_array(attrs["zero_point"])
    axis = attrs["axis"] if scale.size > 1 else None
    block = attrs["block_size"]
    if op == "mp.quantize":
        elem = out_t.elem
        # The checks and scale tables once, not per call (in_t's shape is every call's).
        quantized = quantizer(in_t.shape, scale, zp, elem, axis, block_size=block)

        def run_q(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
            q, counts = quantized(f32(xs[0]))
            return (decode(q, elem) if FORMATS[elem].is_float else q), counts  # f8/f4: values
        return run_q
    if op == "mp.dequantize":
        # f8/f4 operands arrive as their float32 values, integers as int64.
        fl = FORMATS[in_t.elem].is_float
        storage, dtype, out = FORMATS[in_t.elem].storage, in_t.elem if fl else None, out_t.elem
        return lambda xs: finish(dequantize(xs[0] if fl else xs[0].astype(storage, copy=False), scale, zp,
                                             axis, dtype, block_size=block), out)
    qelem, out = attr_type(attrs["dtype"]), out_t.elem

    def fake(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        q, counts = quantize(f32(xs[0]), scale, zp, qelem, axis, block_size=block)
        y, rounded = finish(dequantize(q, scale, zp, axis, block_size=block), out)
        return y, counts + rounded if rounded is not None else counts
    return fake


def matmul_kernel(accum: str | None, sparse: Callable | None, in_types: list[TensorType],
                  out_t: TensorType) -> Kernel:
    """mp.matmul with the accumulator it executes in and the sparse kernel it runs (None: dense)."""
    elem = out_t.elem
    a_t, b_t = in_types
    if FORMATS[a_t.elem].is_int and FORMATS[b_t.elem].is_int:
        # Exact: every partial sum of integer products is an integer below the bound, which a
        # float sum represents exactly in any order. It runs on mplower's GEMM all the same:
        # no BLAS anywhere means no BLAS thread pool spinning against numba's on the same cores.
        bound = magnitude(a_t.elem) * magnitude(b_t.elem) * a_t.shape[-1]
        work = np.float32 if bound <= F32_EXACT else np.float64
        fmt = FORMATS[elem]  # i32 (storage int32: half of int64's bytes), or an 8-bit result

        def run_int(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
            y = matmul(xs[0].astype(work), working_weight(xs[1], work))
            if elem == "i32":
                return y.astype(fmt.storage), NO_COUNTS
            # A narrower result saturates, as the clamp of a requantization would.
            over = int(np.count_nonzero((y < fmt.min_value) | (y > fmt.max_finite)))
            return np.clip(y, fmt.min_value, fmt.max_finite).astype(fmt.storage), Counts(over)
        run_int.weight_dtype = np.dtype(work)  # type: ignore[attr-defined]
        return run_int
    if accum == "f16":
        def run_f16(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
            y, overflow = matmul_f16(f32(xs[0]), f32(xs[1]))
            y, counts = finish(y, elem)
            return y, Counts(overflow) + (counts or nan_counts(y))
        return run_f16

    if sparse is not None:
        def run_sparse(xs: list[np.ndarray], _kernel=sparse) -> tuple[np.ndarray,
                                                                            Counts | None]:
            return finish(_kernel([f32(xs[0]), f32(xs[1])]), elem)
        return run_sparse

    def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        return finish(matmul(f32(xs[0]), working_weight(xs[1], np.float32)), elem)
    run.weight_dtype = np.dtype(np.float32)  # type: ignore[attr-defined]
    return run


def working_weight(b: np.ndarray | PackedMatrix, dtype: type) -> np.ndarray | PackedMatrix:
    """A matmul's b in the product's working precision: a PackedMatrix (`pack_weights`) as
    it is, it was made in that precision."""
    return b if isinstance(b, PackedMatrix) else b.astype(dtype, copy=False)


def matmul_f16(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int]:
    """np.matmul (batch broadcasting, 1-D operands) with the fp16 accumulator, and how many
    results the accumulator overflowed (inf/NaN from finite operands)."""
    a2 = a if a.ndim > 1 else a[None, :]
    b2 = b if b.ndim > 1 else b[:, None]
    batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    a3 = np.broadcast_to(a2, batch + a2.shape[-2:]).reshape(-1, *a2.shape[-2:])
    b3 = np.broadcast_to(b2, batch + b2.shape[-2:]).reshape(-1, *b2.shape[-2:])
    y = np.stack([matmul_f16_accum(x, w) for x, w in zip(a3, b3)])
    y = y.reshape(batch + y.shape[-2:])
    if a.ndim == 1:
        y = y[..., 0, :]
    if b.ndim == 1:
        y = y[..., 0]
    finite = np.isfinite(a).all() and np.isfinite(b).all()
    return y, int(np.count_nonzero(~np.isfinite(y))) if finite else 0


def conv_f16_kernel(attrs: dict, out_t: TensorType) -> Kernel:
    """conv2d with the fp16 accumulator: im2col, then per image and group the f16-accumulated
    matmul over (input channel, kernel row, kernel column); the bias is the last addition."""
    elem = out_t.elem

    def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        x, w = f32(xs[0]), f32(xs[1])
        n, (o, cg, kh, kw), g = x.shape[0], w.shape, attrs["groups"]
        win = conv_windows(pad_hw(x, attrs["padding"]), (kh, kw), attrs["strides"],
                           attrs["dilations"])
        ho, wo = win.shape[2:4]
        cols = (win.reshape(n, g, cg, ho, wo, kh, kw).transpose(0, 1, 3, 4, 2, 5, 6)
                .reshape(n, g, ho * wo, cg * kh * kw))
        wmat = w.reshape(g, o // g, cg * kh * kw).transpose(0, 2, 1)
        if len(xs) == 3:  # the bias as one more term with weight 1
            ones = np.ones((n, g, ho * wo, 1), np.float32)
            cols = np.concatenate([cols, ones], axis=-1)
            wmat = np.concatenate([wmat, f32(xs[2]).reshape(g, 1, o // g)], axis=1)
        y, overflow = matmul_f16(cols, wmat)
        y = y.transpose(0, 1, 3, 2).reshape(n, o, ho, wo)
        y, counts = finish(y, elem)
        return y, Counts(overflow) + (counts or nan_counts(y))
    return run


# ---- the op table -------------------------------------------------------------------------


@dataclass(frozen=True)
class OpToRun:
    """One result (`k`) of one op, as a kernel is chosen for it: its definition, checked
    attributes (`raw`: as written, with the plan annotations), types and the accumulator and
    sparse kernel its plan executes with."""

    opdef: OpDef
    attrs: dict
    raw: dict
    in_types: list[TensorType]
    out_types: list[TensorType]
    k: int
    accum: str | None
    sparse: Callable | None

    @property
    def out_t(self) -> TensorType:
        return self.out_types[self.k]


@dataclass
class Chosen:
    """An op's kernel; `reference` replaces its fp32 reference where the f32 plan has no such
    op (a cast, a quantize); `scale_stats` is mp.scaled_quant's account, `amax_kernel` the
    kernel built to also leave its result's amax in a box (run_lowered's amax sharing)."""

    run: Kernel
    reference: Callable[[list[np.ndarray]], Any] | None = None
    scale_stats: list[ScaleStats] | None = None
    amax_kernel: Callable[[Any], Kernel] | None = None
    # The same op's kernel without the counts that only `run` reports, where that saves a
    # pass (run_lowered runs it), and a conv's epilogue (mplower.backend.fused.ConvEpilogue),
    # from which run_lowered rebuilds its kernel to write into a concatenation.
    fast: Kernel | None = None
    conv: Any = None


def _cast(o: OpToRun) -> Chosen:
    floats = FORMATS[o.in_types[0].elem].is_float and FORMATS[o.out_t.elem].is_float
    return Chosen(cast_kernel(o.out_t, o.attrs, o.opdef.reference),
                  (lambda xs: xs[0]) if floats else None)  # the f32 plan has no casts


def quantize_chosen(o: OpToRun) -> Chosen:
    return Chosen(quant_kernel(o.opdef.name, o.attrs, o.in_types[0], o.out_t),
                  lambda xs: f32(xs[0]) if xs[0].dtype.kind == "f" else xs[0])


def _dequantize(o: OpToRun) -> Chosen:
    # Removed in the reference, where the value it dequantizes is still a float; an integer
    # that never was one (an i8 constant or argument) is dequantized for real.
    run = quant_kernel(o.opdef.name, o.attrs, o.in_types[0], o.out_t)
    return Chosen(run, lambda xs: xs[0] if xs[0].dtype.kind == "f" else run(xs)[0])


def _scaled_quant(o: OpToRun) -> Chosen:
    run, stats = scaled_quant_kernel(o.attrs, o.out_t)
    return Chosen(run, lambda xs: f32(xs[0]), stats)  # the f32 plan has no scaling


def matmul_chosen(o: OpToRun) -> Chosen:
    if o.raw.get(ACCUM_BITS):
        gemm = limited_accum_matmul(attr_int(o.raw[ACCUM_BITS]),
                                    attr_int(o.raw.get(PROMOTE_EVERY, 128)))
        elem = o.out_t.elem
        return Chosen(lambda xs: finish(gemm(f32(xs[0]), f32(xs[1])), elem))
    return Chosen(matmul_kernel(o.accum, o.sparse, o.in_types, o.out_t))


def conv_f16_chosen(o: OpToRun) -> Chosen | None:
    return Chosen(conv_f16_kernel(o.attrs, o.out_t)) if o.accum == "f16" else None


def _add_relu(o: OpToRun) -> Chosen | None:
    rounded = add_relu_rounding(o.in_types, o.out_t)
    if rounded is None:
        return None
    return Chosen(add_relu_kernel(rounded[0]), amax_kernel=partial(add_relu_kernel, rounded[0]))


def generic_chosen(o: OpToRun) -> Chosen:
    exact = o.opdef.name in VALUE_PRESERVING and all(
        t.elem == o.out_t.elem for t in o.in_types if FORMATS[t.elem].is_float)
    return Chosen(generic_kernel(o.opdef, o.attrs, o.out_types, o.k, exact))


# op -> its kernel (None: the generic one, the op's reference rounded to its result type).
# mp.constant is the executor's: its value comes from the module's weights. The fused conv and
# binary ops, and the ops with an uncounted kernel for run_lowered (matmul, conv2d, add, sub,
# mul, fake_quant), are added by mplower.backend.fused.
KERNELS: dict[str, Callable[[OpToRun], Chosen | None]] = {
    "mp.cast": _cast,
    "mp.quantize": quantize_chosen,
    "mp.dequantize": _dequantize,
    "mp.scaled_quant": _scaled_quant,
    "mp.fused_matmul": lambda o: Chosen(fused_matmul_kernel(o.opdef, o.attrs, o.in_types,
                                                            o.out_t)),
    "mp.add_relu": _add_relu,
}


def choose_kernel(o: OpToRun) -> Chosen:
    """The kernel of `o` from the table, or the generic one."""
    chosen = KERNELS[o.opdef.name](o) if o.opdef.name in KERNELS else None
    return chosen if chosen is not None else generic_chosen(o)
