"""Fused ops: what the `fuse` pass (passes/fuse.py) makes of a chain of mp ops that a kernel
runs in one pass over memory, declared like every other op so that the fused program prints,
parses, verifies and runs.

Each op's reference is the composition of the references of the ops it replaces, in their
order, so the fp32 reference still checks the fused program; its result type is the last op's.
The backend runs each on the kernel that computes the same bits as the separate ops
(mplower.backend.kernels); the pass fuses only where it does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mplower.dialect.mp.common import (
    _ELEMENTWISE,
    _NUMERIC,
    _VECTOR,
    _binary_infer,
    _broadcast,
    _declared,
    _def,
    _elementwise_size,
)
from mplower.dialect.mp.linalg import _matmul_flops, _matmul_shape
from mplower.ir.opdef import OPS, AttrSpec, OpError, attr_array
from mplower.ir.types import TensorType, tensor
from mplower.numerics.formats import FORMATS, MX_ROUNDING_FORMATS, ROUNDING_FORMATS

# The float formats whose values run as float32 and round with round_to's kernel: what a fused
# float matmul's steps round to.
PLAIN_FLOATS = tuple(f for f in ROUNDING_FORMATS if f not in MX_ROUNDING_FORMATS)
# The fused ops' kernels and the backend's share these bounds (the fuse pass fuses only within
# them; the backend chooses its kernels by them).
# An integer sum stays exact in a float accumulator while every partial sum is below 2^(p+1)
# for a p-bit mantissa: f32 BLAS takes i8 x i8 up to K = 2^24 / 2^14 = 1024, f64 up to 2^39.
F32_EXACT = 2.0 ** 24
# A float result rounded to one of these may take its relu before the rounding: rounding is
# monotonic, keeps the sign and maps 0 to +0, and a format with infinities keeps NaN a NaN and a
# negative overflow negative, so round(max(y, 0)) and max(round(y), 0) are the same bits. Not
# so without infinities: f8E4M3FN rounds -inf and negative overflow to NaN, which a relu after
# keeps, and the MX element types turn a NaN into a zero of the other sign.
RELU_BEFORE_ROUNDING = tuple(f for f in ROUNDING_FORMATS if f != "f32" and FORMATS[f].has_inf)


def apply_reference(op: str, xs: list[np.ndarray], attrs: dict | None = None,
           rt: Sequence[TensorType] | None = None) -> np.ndarray:
    return OPS[op].reference(xs, attrs or {}, rt)[0]


# ---- add + relu ---------------------------------------------------------------------------------


def _add_relu_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    return [apply_reference("mp.relu", [apply_reference("mp.add", xs)])]


_def("add_relu",
     operands=("a", "b"),
     attrs={},
     infer=_binary_infer(_NUMERIC, "a numeric"),
     reference=_add_relu_reference,
     flops=lambda ins, a: 2 * _elementwise_size(ins),
     precisions=_VECTOR,
     doc="Fused `mp.add` then `mp.relu`: max(a + b, 0), rounded once to the result type (the "
         "`fuse` pass makes it where that is the separate ops' bits).",
     traits=_ELEMENTWISE)


# ---- matmul + its epilogue ------------------------------------------------------------------


def along_last_axis(t: TensorType, shape: tuple[int, ...]) -> bool:
    """Whether a value of type `t` broadcasts to `shape` along its last axis only (one value
    per column, or one for all)."""
    return t.rank <= len(shape) and all(d == 1 for d in t.shape[:-1]) \
        and (t.rank == 0 or t.shape[-1] in (1, shape[-1] if shape else 1)) \
        and _broadcast(t.shape, shape) == shape


def _fused_matmul_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    shape = _matmul_shape(ins[0], ins[1])
    if not shape:
        raise OpError("mp.fused_matmul's result has columns: its operands are not both 1-D")
    out = _declared("mp.fused_matmul", declared).elem
    formats = a.get("formats", ())
    if "scale" not in a and any(e not in PLAIN_FLOATS for e in (ins[0].elem, ins[1].elem, out,
                                                                 *formats)):
        raise OpError(f"mp.fused_matmul's operands, result and 'formats' are among "
                      f"{', '.join(PLAIN_FLOATS)} (or it has a 'scale')")
    if formats and len(formats) != len(ins) - 2:
        raise OpError(f"mp.fused_matmul's 'formats' has one entry per addend (the product's "
                      f"and each add's but the last), got {len(formats)} for {len(ins) - 2}")
    if "scale" in a:
        if formats or out != "f32":
            raise OpError("mp.fused_matmul with a 'scale' computes in f32: its result is f32 "
                          "and it takes no 'formats'")
        if any(t.elem not in ("i8", "ui8") for t in ins[:2]):
            raise OpError("mp.fused_matmul with a 'scale' (a dequantized integer product) "
                          "takes 8-bit integer operands")
        if attr_array(a["scale"]).size not in (1, shape[-1] if shape else 1):
            raise OpError("mp.fused_matmul's 'scale' has one value or one per column")
    for i, t in enumerate(ins[2:], start=2):
        if t.elem not in PLAIN_FLOATS or not along_last_axis(t, shape):
            raise OpError(f"mp.fused_matmul's addend {t} is not a float vector along the "
                          "last axis", operand=i)
    return [tensor(shape, out)]


def _fused_matmul_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    y = apply_reference("mp.matmul", xs[:2])
    if "scale" in a and y.dtype.kind in "iu":
        y = apply_reference("mp.dequantize", [y], {"scale": a["scale"], "zero_point": 0, "axis": -1},
                   [tensor(y.shape, "f32")])
    for addend in xs[2:]:
        y = apply_reference("mp.add", [y, addend])
    return [y]


_def("fused_matmul",
     operands=("a", "b", "addends*"),
     attrs={"scale": AttrSpec("number"), "formats": AttrSpec("types")},
     infer=_fused_matmul_infer,
     reference=_fused_matmul_reference,
     flops=lambda ins, a: _matmul_flops(ins, a) + (len(ins) - 2 + ("scale" in a))
     * np.prod(_matmul_shape(ins[0], ins[1]), dtype=np.int64),
     precisions=_VECTOR,
     doc="Fused `mp.matmul`, with a `scale` the `mp.dequantize` of its exact integer sums "
         "(one scale per column or one for all, zero point 0), then an `mp.add` of each "
         "addend (a vector along the last axis). The product and each add but the last are rounded "
         "to their entry of `formats` (none: the result type), the last add to the result type.")
