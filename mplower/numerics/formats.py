"""The number formats mplower reasons about: one table, used by the IR, the passes and the backend.

Every fact about a format (its width, exponent and mantissa split, range, epsilon, whether it
has inf/NaN, the numpy dtype that stores it) lives here and nowhere else. Float figures follow
IEEE 754 for f64/f32/f16, the bfloat16 and TF32 definitions, and the OCP 8-bit floating point
specification (OFP8, 2023) for f8E4M3FN and f8E5M2, and the OCP Microscaling Formats (MX) v1.0
specification (2023, section 5) for the element types f6E2M3FN, f6E3M2FN, f4E2M1FN and the scale
type f8E8M0FNU; they are checked against ml_dtypes' finfo in tests/test_formats.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Format:
    name: str  # the IR element type spelling, e.g. "bf16"
    kind: str  # "float" or "int"
    bits: int  # width of one value in its packed form
    storage: np.dtype  # numpy dtype that holds one value in mplower's arrays
    exp_bits: int = 0
    man_bits: int = 0  # explicit mantissa (fraction) bits
    has_inf: bool = False
    has_nan: bool = False
    max_finite: float = 0.0  # largest finite value (ints: largest integer)
    min_value: float = 0.0  # most negative value (ints) / -max_finite (floats)
    min_normal: float = 0.0
    min_subnormal: float = 0.0
    eps: float = 0.0  # distance from 1.0 to the next larger value

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_int(self) -> bool:
        return self.kind == "int"

    @property
    def int_range(self) -> tuple[int, int]:
        """(lowest, highest) integer exactly: `max_finite` is a float, which for the 64-bit
        formats rounds 2^63 - 1 up to 2^63."""
        signed = self.min_value < 0
        return ((-(1 << (self.bits - 1)), (1 << (self.bits - 1)) - 1) if signed
                else (0, (1 << self.bits) - 1))


def _float(name, bits, storage, exp_bits, man_bits, *, has_inf=True, max_finite=None) -> Format:
    bias = (1 << (exp_bits - 1)) - 1
    if max_finite is None:  # IEEE-style: the top exponent is reserved for inf/NaN
        max_finite = (2.0 - 2.0 ** -man_bits) * 2.0 ** bias
    min_normal = 2.0 ** (1 - bias)
    return Format(
        name=name, kind="float", bits=bits, storage=np.dtype(storage),
        exp_bits=exp_bits, man_bits=man_bits, has_inf=has_inf, has_nan=True,
        max_finite=max_finite, min_value=-max_finite, min_normal=min_normal,
        min_subnormal=min_normal * 2.0 ** -man_bits, eps=2.0 ** -man_bits,
    )


def _mx_element(name, bits, exp_bits, man_bits) -> Format:
    """An MX element type (OCP MX v1.0, 5.3): no inf, no NaN, every exponent code is finite."""
    bias = (1 << (exp_bits - 1)) - 1
    max_finite = (2.0 - 2.0 ** -man_bits) * 2.0 ** ((1 << exp_bits) - 1 - bias)
    return dataclasses.replace(_float(name, bits, np.uint8, exp_bits, man_bits, has_inf=False,
                                      max_finite=max_finite), has_nan=False)


# E8M0 (OCP MX v1.0, 5.4.1): an unsigned biased exponent, 2^-127 .. 2^127, no zero, 0xFF = NaN.
# Its smallest value is positive, so min_value is that value, not -max_finite.
_E8M0 = Format(name="f8E8M0FNU", kind="float", bits=8, storage=np.dtype(np.uint8), exp_bits=8,
               man_bits=0, has_nan=True, max_finite=2.0 ** 127, min_value=2.0 ** -127,
               min_normal=2.0 ** -127, min_subnormal=2.0 ** -127, eps=1.0)


def _int(name, bits, storage, signed=True) -> Format:
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    return Format(name=name, kind="int", bits=bits, storage=np.dtype(storage),
                  max_finite=float(hi), min_value=float(lo), eps=1.0)


FORMATS: dict[str, Format] = {f.name: f for f in (
    _float("f64", 64, np.float64, 11, 52),
    _float("f32", 32, np.float32, 8, 23),
    # TF32 keeps f32's range with a 10-bit mantissa; it is stored in f32 containers.
    _float("tf32", 19, np.float32, 8, 10),
    _float("f16", 16, np.float16, 5, 10),
    _float("bf16", 16, np.uint16, 8, 7),
    # E4M3FN gives up inf and all but one NaN encoding to reach 448 (OFP8 spec, table 1).
    _float("f8E4M3FN", 8, np.uint8, 4, 3, has_inf=False, max_finite=448.0),
    _float("f8E5M2", 8, np.uint8, 5, 2),
    _mx_element("f6E2M3FN", 6, 2, 3),
    _mx_element("f6E3M2FN", 6, 3, 2),
    _mx_element("f4E2M1FN", 4, 2, 1),
    _E8M0,
    _int("i32", 32, np.int32),
    _int("i8", 8, np.int8),
    _int("ui8", 8, np.uint8, signed=False),
    _int("i4", 4, np.int8),
    _int("i1", 1, np.bool_, signed=False),
    # Index types: what ONNX exporters give token ids, positions, masks and shapes (INT64,
    # and the INT16/UINT16/UINT32/UINT64 of ONNX's tests). They index and move data; the
    # precision passes never compute in them.
    _int("i64", 64, np.int64),
    _int("i16", 16, np.int16),
    _int("ui16", 16, np.uint16, signed=False),
    _int("ui32", 32, np.uint32, signed=False),
    _int("ui64", 64, np.uint64, signed=False),
)}

FLOAT_FORMATS = tuple(n for n, f in FORMATS.items() if f.is_float)
FLOATS = frozenset(FLOAT_FORMATS)  # for membership tests on hot paths
# Floats narrower than f32: a value in one of these has been lowered.
NARROW_FLOATS = frozenset(n for n in FLOAT_FORMATS if FORMATS[n].bits < 32)
INT_FORMATS = tuple(n for n, f in FORMATS.items() if f.is_int)
INDEX_FORMATS = ("i64", "i16", "ui16", "ui32", "ui64")
# The 8-bit floats that hold data (E8M0 holds only scales).
FP8_FORMATS = tuple(n for n in FLOAT_FORMATS if FORMATS[n].bits == 8 and FORMATS[n].man_bits)
# Element types of the OCP MX formats (MXFP8, MXFP6, MXFP4) and of NVFP4, and their scale type.
MX_ELEMENT_FORMATS = ("f8E4M3FN", "f8E5M2", "f6E2M3FN", "f6E3M2FN", "f4E2M1FN")
FP4_FORMATS = tuple(n for n in FLOAT_FORMATS if FORMATS[n].bits == 4)
# Floats a value is quantized to with a scale (ONNX QuantizeLinear's FLOAT8 and FLOAT4E2M1).
QUANT_FLOATS = FP8_FORMATS + FP4_FORMATS
# Formats an op computes in on a target (tensor-core inputs): every float narrower than f64,
# and i8. The order is the order docs and diagnostics list them in.
COMPUTE_FORMATS = ("f32", "tf32", "bf16", "f16", "f8E4M3FN", "f8E5M2", "f6E2M3FN", "f6E3M2FN",
                   "f4E2M1FN", "i8")
# Integer formats a value is quantized to (ONNX QuantizeLinear's integer targets): the ints
# between the i1 mask and the i32 accumulator, index types aside.
QUANT_INTS = tuple(n for n in INT_FORMATS
                   if 1 < FORMATS[n].bits < 32 and n not in INDEX_FORMATS)
# Integer formats that hold quantized values: those, and the i32 accumulator of an integer
# matmul or conv, which is dequantized too (ONNX DequantizeLinear reads INT32).
QUANT_STORAGE = QUANT_INTS + ("i32",)
# The 16-bit codes of models quantized elsewhere (ONNX INT16/UINT16 QDQ): mp.quantize and
# mp.dequantize hold them, so such models import, run and export; no sheet or pass picks them.
QUANT_WIDE = ("i16", "ui16")


def width_rank(name: str) -> tuple[int, int]:
    """Sort key from narrow to wide: (range bits, precision bits) of a float format."""
    f = FORMATS[name]
    return (f.exp_bits, f.man_bits) if f.is_float else (0, f.bits)


def represents(wide: str, narrow: str) -> bool:
    """Whether every value of format `narrow` is exactly a value of format `wide`.

    This is what makes a cast round trip narrow -> wide -> narrow the identity (bf16 -> f32 ->
    bf16), while wide -> narrow -> wide (f32 -> bf16 -> f32) loses bits.
    """
    if wide == narrow:
        return True
    w, n = FORMATS[wide], FORMATS[narrow]
    if w.is_float and n.is_float:
        # Same or wider exponent range and mantissa; NaN/inf must have somewhere to go.
        wider_range = w.exp_bits > n.exp_bits or (
            w.exp_bits == n.exp_bits and w.max_finite >= n.max_finite)
        return (wider_range and w.man_bits >= n.man_bits and w.min_subnormal <= n.min_subnormal
                and (w.has_inf or not n.has_inf))
    if w.is_int and n.is_int:
        return w.min_value <= n.min_value and w.max_finite >= n.max_finite
    if w.is_float and n.is_int:  # integers up to 2**(man_bits+1) are exact in a float
        return (w.man_bits + 1 >= n.bits - (1 if n.min_value < 0 else 0)
                and w.max_finite >= n.max_finite)
    return False


# rounding.matmul_f16_accum adds each product to an f16 value in float64. Near an f16 tie that
# sum must be exact: the product's bits reach 11 + (its significant bits) below the accumulator's
# leading bit, within f64's 53 for operands of up to 15 significant bits (f16, bf16, tf32, fp8:
# products of up to 30 bits), not for f32 operands (48-bit products).
F16_ACCUM_MAX_BITS = 15


def f16_accum_emulated(elem: str) -> bool:
    """Whether `rounding.matmul_f16_accum` accumulates products of `elem` operands exactly as an
    f16 accumulator would (what legalize checks before it keeps `mp.accum = f16`)."""
    f = FORMATS[elem]
    return f.is_float and f.man_bits + 1 <= F16_ACCUM_MAX_BITS


# The formats rounding.round_to rounds float32 values to (the MX element types with their block
# scales); the dialect reads them without loading numba.
MX_ROUNDING_FORMATS = ("f6E2M3FN", "f6E3M2FN", "f4E2M1FN", "f8E8M0FNU")
ROUNDING_FORMATS = ("f32", "tf32", "bf16", "f16", "f8E4M3FN", "f8E5M2") + MX_ROUNDING_FORMATS
