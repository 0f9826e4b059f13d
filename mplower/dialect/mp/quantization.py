"""Conversions: cast, quantize, dequantize, fake_quant (and LSQ), scaled_quant."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from mplower.dialect.mp.common import (
    _ANY,
    _CONVERSION,
    _FLOATS,
    _PICKS,
    _QUANT_TYPES,
    _QUANTIZED,
    _VECTOR,
    _axis,
    _binary_infer,
    _declared,
    _def,
    _elem_of,
    _fl,
    _no_flops,
    _per_element,
)
from mplower.ir.opdef import AttrSpec, GradBuilder, OpError, Value, show_value
from mplower.ir.types import TensorType, tensor, value_dtype
from mplower.numerics.formats import FORMATS

# ---------------------------------------------------------------------------------------------
# Conversions


def _cast_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    # Rounding keeps zeros zero, so a cast of a sparse-encoded weight keeps its encoding (the
    # plan casts a weight to its compute format after lower-sparse encoded it).
    return [tensor(ins[0].shape, _declared("mp.cast", declared).elem, ins[0].encoding)]


def _round_to_format(x: np.ndarray, elem: str) -> np.ndarray:
    """float32 values rounded to nearest-even in a narrower float format, held in float32.

    The rounding lives in mplower.numerics.rounding (tested bit-exact against ml_dtypes and
    numpy's float16 over every float32 input); the import is local so that ops.py stays
    importable without numba's compile step.
    """
    from mplower.numerics.rounding import round_to

    return round_to(np.ascontiguousarray(x, dtype=np.float32), elem)[0]


def _convert(x: np.ndarray, elem: str, saturate: bool) -> np.ndarray:
    """ONNX Cast semantics for values `x` to element type `elem`, as `value_dtype(elem)`."""
    fmt = FORMATS[elem]
    if elem == "i1":
        return x != 0
    if fmt.is_int:
        # ONNX truncates toward zero and leaves out-of-range values undefined; mplower
        # saturates them and maps NaN to 0 so that the reference is deterministic.
        return _saturate_int(x, elem)
    if elem == "f64":
        return x.astype(np.float64)
    x32 = x.astype(np.float32)
    if elem == "f32":
        return x32
    if saturate and elem.startswith("f8"):
        # ONNX saturate=1: finite values beyond the range go to +-max; E5M2 keeps its infinities.
        clipped = np.clip(x32, fmt.min_value, fmt.max_finite)
        x32 = np.where(np.isinf(x32), x32, clipped) if fmt.has_inf else clipped
    return _round_to_format(x32, elem)


def _saturate_int(x: np.ndarray, elem: str) -> np.ndarray:
    """Values `x` (any numeric dtype) truncated toward zero and clamped to the integer type
    `elem`, NaN as 0, as `value_dtype(elem)`. The bounds of the 64-bit types are not floats
    and not all of them fit one numpy integer dtype, so each source kind is clamped apart."""
    lo, hi = FORMATS[elem].int_range
    dtype = value_dtype(elem)
    if x.dtype.kind == "f":
        x = np.trunc(np.nan_to_num(x.astype(np.float64), nan=0.0, posinf=np.inf, neginf=-np.inf))
        # float(hi) of a 64-bit type rounds up past hi: such values saturate explicitly.
        over = x >= float(hi)
        y = np.clip(np.where(over, 0.0, x), float(lo), float(hi)).astype(dtype)
        y[over] = hi
        return y
    if x.dtype == np.uint64:  # never below any type's lowest value
        return np.minimum(x, np.uint64(hi)).astype(dtype)
    x = x.astype(np.int64, copy=False)
    return np.clip(x, lo, min(hi, (1 << 63) - 1)).astype(dtype)  # ui64's hi is past int64


def _cast_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    return [_convert(xs[0], _declared("mp.cast", rt or ()).elem, a["saturate"])]


def _cast_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
              needs: Sequence[bool]) -> list[Value | None]:
    tx = g.type_of(xs[0])
    if not FORMATS[tx.elem].is_float:
        return [None]
    return [g.emit("mp.cast", [dy], result=g.type_of(dy).with_elem(tx.elem))]

_def("cast",
     vjp=_cast_vjp,
     operands=("x",),
     attrs={"saturate": AttrSpec("bool", default=True)},
     infer=_cast_infer,
     reference=_cast_reference,
     flops=_no_flops,
     precisions=_ANY,
     doc="Convert to the result's element type: round to nearest even, truncate to integers, "
         "saturate fp8 unless saturate = false (ONNX Cast); an encoded operand keeps its "
         "encoding.",
     traits=_CONVERSION,
     encoded_operands=frozenset({0}))

_QUANT_ATTRS = {"scale": AttrSpec("number", required=True),
                "zero_point": AttrSpec("number", default=0),
                "axis": AttrSpec("int", default=1),  # ONNX's default quantization axis
                # > 0: one scale per block of this many elements along axis (ONNX opset 21)
                "block_size": AttrSpec("int", default=0, min=0)}


def _check_quant(x: TensorType, a: dict, qelem: str) -> None:
    scale, zp = a["scale"], a["zero_point"]
    if not np.all(scale > 0):
        raise OpError(f"attribute 'scale' must be positive, got {show_value(scale)}")
    fmt = FORMATS[qelem]
    if fmt.is_float and np.any(zp != 0):
        raise OpError(f"attribute 'zero_point' must be 0 for {qelem} (ONNX), "
                      f"got {show_value(zp)}")
    if np.any(zp != np.round(zp)) or np.any(zp < fmt.min_value) or np.any(zp > fmt.max_finite):
        raise OpError(f"attribute 'zero_point' must hold integers in the range of {qelem} "
                      f"[{int(fmt.min_value)}, {int(fmt.max_finite)}], got {show_value(zp)}")
    if a.get("block_size"):  # the gradient and LSQ ops have no blocks
        from mplower.numerics.quant import blocked_scale_shape

        axis = _axis(a["axis"], x.rank)
        want = blocked_scale_shape(x.shape, axis, a["block_size"])
        for name, v in (("scale", scale), ("zero_point", zp)):
            if v.size > 1 and v.shape != want:
                raise OpError(f"blocked attribute '{name}' (block_size {a['block_size']} on "
                              f"axis {axis} of {x}) must have shape {'x'.join(map(str, want))}"
                              f", got {'x'.join(map(str, v.shape)) or 'a scalar'}", operand=0)
    elif scale.size > 1 or zp.size > 1:
        axis = _axis(a["axis"], x.rank)
        for name, v in (("scale", scale), ("zero_point", zp)):
            if v.size > 1 and v.shape != (x.shape[axis],):
                raise OpError(f"per-axis attribute '{name}' must have {x.shape[axis]} entries "
                              f"(dimension {axis} of {x}), got {v.size}", operand=0)


def _along(v: np.ndarray, shape: tuple[int, ...], a: dict) -> np.ndarray:
    """A per-axis or blocked parameter shaped to broadcast against an operand of `shape`."""
    if v.size == 1:
        return v.reshape(())
    axis = a["axis"] % len(shape)
    if a.get("block_size"):  # one entry per block: repeat it over the block's elements
        v = np.repeat(v, a["block_size"], axis=axis)
        return v[tuple(slice(0, d) for d in shape)]
    bshape = [1] * len(shape)
    bshape[axis] = v.size
    return v.reshape(bshape)


def _quantize_values(x: np.ndarray, a: dict, qelem: str) -> np.ndarray:
    """ONNX QuantizeLinear: saturate(round_half_even(x / scale) + zero_point), as float64;
    to a float format, the f32 quotient rounded to it, saturating."""
    scale = _along(a["scale"], x.shape, a).astype(x.dtype)  # divide in x's precision
    if FORMATS[qelem].is_float:
        return _convert(x / scale, qelem, saturate=True).astype(np.float64)
    zp = _along(a["zero_point"], x.shape, a)
    q = np.rint(x / scale).astype(np.float64) + zp
    q = np.where(np.isnan(q), zp, q)  # NaN has no integer code; it quantizes to zero
    fmt = FORMATS[qelem]
    return np.clip(q, fmt.min_value, fmt.max_finite)


def _dequantize_values(q: np.ndarray, a: dict, dtype: np.dtype) -> np.ndarray:
    """ONNX DequantizeLinear: (q - zero_point) * scale, computed in the result's precision."""
    scale = _along(a["scale"], q.shape, a).astype(dtype)
    zp = _along(a["zero_point"], q.shape, a).astype(dtype)
    return (q.astype(dtype) - zp) * scale


def _quantize_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x = ins[0]
    _elem_of(ins, _FLOATS, "a float")
    qelem = _declared("mp.quantize", declared).elem
    if qelem not in _QUANTIZED:
        raise OpError(f"mp.quantize result element type must be one of "
                      f"{', '.join(_QUANTIZED)}, got {qelem}")
    _check_quant(x, a, qelem)
    return [tensor(x.shape, qelem)]


def _quantize_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    qelem = _declared("mp.quantize", rt or ()).elem
    return [_quantize_values(_fl(xs[0]), a, qelem).astype(value_dtype(qelem))]


def _dequantize_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x = ins[0]
    _elem_of(ins, frozenset(_QUANTIZED), f"a quantized type ({', '.join(_QUANTIZED)})")
    out = _declared("mp.dequantize", declared).elem
    if out not in _FLOATS:
        raise OpError(f"mp.dequantize result element type must be a float type, got {out}")
    _check_quant(x, a, x.elem)
    return [tensor(x.shape, out)]


def _dequantize_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    out = _declared("mp.dequantize", rt or ()).elem
    return [_dequantize_values(xs[0], a, value_dtype(out))]


def _fake_quant_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    elem = _elem_of(ins, _FLOATS, "a float")
    _check_quant(ins[0], a, a["dtype"])
    return [tensor(ins[0].shape, elem)]


def _fake_quant_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x = _fl(xs[0])
    return [_dequantize_values(_quantize_values(x, a, a["dtype"]), a, x.dtype)]


def _fake_quant_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
                    needs: Sequence[bool]) -> list[Value | None]:
    return [g.emit("mp.fake_quant_grad", [dy, xs[0]],
                   {k: a[k] for k in ("scale", "zero_point", "axis", "dtype")})]


def _fake_quant_grad_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    """The straight-through estimator clipped to the quantization range (PyTorch's
    fake_quantize backward): dy where round(x / scale) + zero_point is in range, else 0."""
    dy, x = _fl(xs[0]), _fl(xs[1])
    per_axis = {"axis": a["axis"], "block_size": 0}  # fake_quant has no blocks
    scale = _along(a["scale"], x.shape, per_axis).astype(x.dtype)
    q = np.rint(x / scale).astype(np.float64) + _along(a["zero_point"], x.shape, per_axis)
    fmt = FORMATS[a["dtype"]]
    return [np.where((q >= fmt.min_value) & (q <= fmt.max_finite), dy, dy.dtype.type(0))]


def _fake_quant_grad_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    (out,) = _binary_infer(_FLOATS, "a float")(ins, a, declared)
    if out.shape != ins[1].shape:
        raise OpError(f"operand #0 must have the shape of x, got {ins[0]}", operand=0)
    _check_quant(ins[1], a, a["dtype"])
    return [out]

# Quantize: 2 operations per element (scale, shift; rounding and saturation are the
# conversion); dequantize: 2 (shift, scale); fake_quant: both. Cast is pure conversion: 0,
# its cost is the bytes it moves.
_def("quantize",
     operands=("x",),
     attrs=_QUANT_ATTRS,
     infer=_quantize_infer,
     reference=_quantize_reference,
     flops=_per_element(2),
     precisions=_ANY,
     doc="Float to integer: saturate(round_half_even(x / scale) + zero_point), per tensor, "
         "per `axis`, or per block of `block_size` along `axis` (scale of x's shape with "
         "ceil(D / block_size) on axis); to f8/f4: the quotient rounded, saturating, zero "
         "point 0 (ONNX QuantizeLinear, opset 21+ blocks).",
     traits=_CONVERSION)
_def("dequantize",
     operands=("x",),
     attrs=_QUANT_ATTRS,
     infer=_dequantize_infer,
     reference=_dequantize_reference,
     flops=_per_element(2),
     precisions=_ANY,
     doc="Integer or f8/f4 to float: (x - zero_point) * scale, per tensor, per `axis` or "
         "per block of `block_size` along `axis` (ONNX DequantizeLinear).",
     traits=_CONVERSION)
_def("fake_quant",
     vjp=_fake_quant_vjp,
     operands=("x",),
     attrs={**_QUANT_ATTRS, "dtype": AttrSpec("type", required=True, choices=_QUANT_TYPES)},
     infer=_fake_quant_infer,
     reference=_fake_quant_reference,
     flops=_per_element(4),
     precisions=_VECTOR,
     doc="Quantize to `dtype` and dequantize back, in x's float type (QDQ pair).",
     traits=_CONVERSION)

_def("fake_quant_grad",
     operands=("dy", "x"),
     attrs={**_QUANT_ATTRS, "dtype": AttrSpec("type", required=True, choices=_QUANT_TYPES)},
     infer=_fake_quant_grad_infer,
     reference=_fake_quant_grad_reference,
     flops=_per_element(3),
     precisions=_VECTOR,
     doc="The gradient of fake_quant (straight-through, clipped): dy where x quantizes "
         "inside the range of `dtype`, else 0.",
     traits=_PICKS)


# Learned step size quantization (LSQ, Esser et al., ICLR 2020, arXiv:1902.08153): fake_quant
# whose scale is an operand, so that training learns it with the weights (prepare-qat).


def _lsq_attrs(a: dict, scale: np.ndarray) -> dict:
    """fake_quant's attributes with the scale operand's values (kept positive) as `scale`."""
    return {**a, "scale": np.maximum(np.abs(scale.astype(np.float64)).reshape(-1),
                                     np.finfo(np.float32).tiny)}


def _lsq_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x, scale = ins
    elem = _elem_of(ins, _FLOATS, "a float")
    if scale.rank > 1 or (scale.size > 1 and scale.shape != (x.shape[_axis(a["axis"], x.rank)],)):
        raise OpError(f"the scale must be a scalar or hold one entry per index of axis "
                      f"{a['axis']} of {x}, got {scale}", operand=1)
    _check_quant(x, {**a, "scale": np.ones(1)}, a["dtype"])
    return [tensor(x.shape, elem)]


def _lsq_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    x = _fl(xs[0])
    b = _lsq_attrs(a, xs[1])
    return [_dequantize_values(_quantize_values(x, b, a["dtype"]), b, x.dtype)]


def _lsq_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
             needs: Sequence[bool]) -> list[Value | None]:
    attrs = {k: a[k] for k in ("zero_point", "axis", "dtype")}
    return [g.emit("mp.lsq_grad", [dy, *xs], {**attrs, "wrt": wrt}) if need else None
            for wrt, need in zip(("x", "scale"), needs)]


def _lsq_grad_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    dy, x, scale = ins
    _lsq_infer((x, scale), a, ())
    if dy.shape != x.shape:
        raise OpError(f"operand #0 must have the shape of x, got {dy}", operand=0)
    return [tensor((x if a["wrt"] == "x" else scale).shape, _elem_of(ins, _FLOATS, "a float"))]


def _lsq_grad_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    """LSQ's gradients: x's is the clipped straight-through estimator; the scale's is
    dy ((q - z) - x / s) inside the range and dy (q - z) where q saturates, summed over the
    elements that share the scale and multiplied by LSQ's gradient scale 1 / sqrt(N qmax)."""
    dy, x = _fl(xs[0]), _fl(xs[1])
    b = _lsq_attrs(a, xs[2])
    per_axis = {"axis": a["axis"], "block_size": 0}  # LSQ scales are per tensor or per axis
    s = _along(b["scale"], x.shape, per_axis).astype(x.dtype)
    zp = _along(a["zero_point"], x.shape, per_axis)
    v = x / s
    q = np.rint(v).astype(np.float64) + zp
    fmt = FORMATS[a["dtype"]]
    inside = (q >= fmt.min_value) & (q <= fmt.max_finite)
    if a["wrt"] == "x":
        return [np.where(inside, dy, dy.dtype.type(0))]
    step = np.clip(q, fmt.min_value, fmt.max_finite) - zp - np.where(inside, v, 0)
    per = dy.astype(np.float64) * step
    if xs[2].size > 1:
        axis = a["axis"] % x.ndim
        total = per.sum(axis=tuple(i for i in range(x.ndim) if i != axis))
    else:
        total = per.sum().reshape(xs[2].shape)
    shared = x.size // max(xs[2].size, 1)
    return [(total / math.sqrt(shared * fmt.max_finite)).astype(dy.dtype)]


_LSQ_ATTRS = {"zero_point": _QUANT_ATTRS["zero_point"], "axis": _QUANT_ATTRS["axis"],
              "dtype": AttrSpec("type", required=True, choices=_QUANT_TYPES)}

_def("fake_quant_lsq",
     vjp=_lsq_vjp,
     operands=("x", "scale"),
     attrs=_LSQ_ATTRS,
     infer=_lsq_infer,
     reference=_lsq_reference,
     flops=_per_element(4),
     precisions=_VECTOR,
     doc="fake_quant with a learnable scale operand (LSQ): quantize x to `dtype` with "
         "|scale| per tensor or per `axis` and dequantize back.")
_def("lsq_grad",
     operands=("dy", "x", "scale"),
     attrs={**_LSQ_ATTRS, "wrt": AttrSpec("str", required=True, choices=("x", "scale"))},
     infer=_lsq_grad_infer,
     reference=_lsq_grad_reference,
     flops=_per_element(5),
     precisions=_VECTOR,
     doc="The gradient of fake_quant_lsq with respect to x (clipped straight-through) or its "
         "scale (LSQ's, with its 1 / sqrt(N qmax) gradient scale).")


# Scaled narrow floats (issue 14): a recipe chooses the scale at run time or from calibration.
SCALE_RECIPES = ("static", "current", "delayed", "block")
SCALE_FORMATS = ("f32", "e8m0", "nvfp4")
# The largest `margin` (scale = fmt_max / amax / 2^margin). Past it a margin means nothing: 2^31
# already exceeds the span of every scaled format from its largest value to its smallest
# subnormal (f8E5M2's 2^31.8), so every value flushes to zero; and the larger the margin, the
# smaller the amax at which the f32 scale underflows and decoding gives NaN (2^128 is inf in
# f32: at 128 every output was NaN). Within 0..31 the scale stays finite and non-zero for any
# amax below fmt_max * 2^96 (1e29 for f4E2M1FN), far beyond data a narrow float can carry.
MAX_MARGIN = 31
_SCALED_TYPES = ("f8E4M3FN", "f8E5M2", "f6E2M3FN", "f6E3M2FN", "f4E2M1FN")


def _scaled_quant_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    x = ins[0]
    _elem_of(ins, _FLOATS, "a float")
    elem = _declared("mp.scaled_quant", declared).elem
    if elem not in _SCALED_TYPES:
        raise OpError(f"mp.scaled_quant result element type must be one of "
                      f"{', '.join(_SCALED_TYPES)}, got {elem}")
    block, recipe, fmt = tuple(a["block"]), a["recipe"], a["scale_format"]
    if (recipe == "block") != bool(block):
        raise OpError("attribute 'block' (one size per axis) goes with recipe = \"block\" and "
                      "only with it")
    if block and len(block) != x.rank:
        raise OpError(f"attribute 'block' = {list(block)} needs one size per axis of {x}",
                      operand=0)
    if fmt != "f32" and recipe != "block":
        raise OpError(f"scale_format = \"{fmt}\" scales blocks: it needs recipe = \"block\"")
    if fmt == "nvfp4" and elem != "f4E2M1FN":
        raise OpError(f"scale_format = \"nvfp4\" quantizes to f4E2M1FN, not {elem}")
    if not 0 <= a["margin"] <= MAX_MARGIN:
        raise OpError(f"attribute 'margin' must be between 0 and {MAX_MARGIN}, not {a['margin']}")
    if recipe == "static" and not a["amax"] > 0:
        raise OpError("recipe = \"static\" needs the calibrated 'amax' (> 0); run calibrate")
    return [tensor(x.shape, elem)]


def _scaled_quant_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    """The scaled values q * s of one step (a delayed recipe's first: scale 1, or the one
    from 'amax' when calibrated); mplower.numerics.mx defines the recipes."""
    from mplower.numerics import mx

    elem = _declared("mp.scaled_quant", rt or ()).elem
    x = np.ascontiguousarray(_fl(xs[0]), dtype=np.float32)
    if a["recipe"] == "block":
        return [mx.quantize_blocked(x, elem, tuple(a["block"]), a["scale_format"]).values]
    amax = float(np.max(np.abs(x))) if a["recipe"] == "current" and x.size else a["amax"]
    sf = mx.encode_factor(amax, elem, a["margin"], pow2=a["pow2"])
    return [mx.quantize_per_tensor(x, elem, sf).values]


_def("scaled_quant",
     operands=("x",),
     attrs={"recipe": AttrSpec("str", default="current", choices=SCALE_RECIPES),
            "scale_format": AttrSpec("str", default="f32", choices=SCALE_FORMATS),
            "block": AttrSpec("ints", default=()),
            "amax": AttrSpec("float", default=0.0, min=0.0),
            "margin": AttrSpec("int", default=0),
            "pow2": AttrSpec("bool", default=False),
            "history": AttrSpec("int", default=1024, min=1),
            "amax_compute": AttrSpec("str", default="max", choices=("max", "most_recent"))},
     infer=_scaled_quant_infer,
     reference=_scaled_quant_reference,
     flops=_per_element(4),
     precisions=_ANY,
     doc="A scaled narrow float: x quantized to the result type with a scale and held as the "
         "scaled values q * s. `recipe`: static (scale from the calibrated `amax`), current "
         "(the tensor's amax), delayed (Transformer Engine's amax history of `history` steps, "
         "`amax_compute`, `margin`), block (one scale per `block`, in `scale_format` f32, "
         "e8m0 (MX) or nvfp4); `pow2` rounds a per-tensor scale down to a power of two.",
     traits=_CONVERSION)
