"""Types and attribute values of the mplower IR.

A tensor type is an interned, immutable `TensorType(shape, elem, encoding)`; element types are
spelled as in MLIR (`f32`, `bf16`, `f8E4M3FN`, ...) and are exactly the keys of
`mplower.numerics.formats.FORMATS`. Attribute values are plain Python values where the spelling
is unambiguous (int, float, str, bool, tuple for arrays) and small frozen classes where MLIR
carries more than the value (a typed integer or float, an element type, dense elements, a
symbol reference). Everything here is hashable so that CSE can compare attribute dicts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from functools import cache
from typing import Any

import numpy as np

from mplower.numerics.formats import FORMATS

ELEMENT_TYPES = tuple(FORMATS)
# Scalar types that may annotate attributes (`3 : i64`) but are not tensor element types.
ATTRIBUTE_SCALAR_TYPES = frozenset(ELEMENT_TYPES) | {"i16", "i64", "ui16", "ui32", "ui64", "index"}
ENCODINGS = ("2:4", "1:2", "csr")
MAX_RANK = 64  # numpy's limit on an array's dimensions
# Elements of one tensor: its values at 8 bytes each (f64, int64 hold them) must be addressable
# by a numpy array, whose size in bytes is a signed 64-bit integer.
MAX_ELEMENTS = (2 ** 63 - 1) // 8


def shape_problem(shape: tuple[int, ...]) -> str | None:
    """Why a static shape cannot be a tensor's, or None: too many dimensions or elements."""
    if len(shape) > MAX_RANK:
        return f"has {len(shape)} dimensions; at most {MAX_RANK} are supported"
    size = 1
    for d in shape:
        size *= d
        # A zero dimension would hide a huge one from the product, and numpy refuses both.
        if d > MAX_ELEMENTS or size > MAX_ELEMENTS:
            return (f"has more than {MAX_ELEMENTS} (2^60 - 1) elements, the most whose values "
                    f"(8 bytes each) a 64-bit machine can address")
    return None


@dataclass(frozen=True, slots=True)
class TensorType:
    shape: tuple[int, ...]
    elem: str
    encoding: str | None = None

    def __deepcopy__(self, memo: dict) -> TensorType:  # immutable: a module's copy shares it
        return self

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return (self.size * FORMATS[self.elem].bits + 7) // 8

    def with_elem(self, elem: str) -> TensorType:
        return tensor(self.shape, elem, self.encoding)

    def with_encoding(self, encoding: str | None) -> TensorType:
        return tensor(self.shape, self.elem, encoding)

    def __str__(self) -> str:
        dims = "".join(f"{d}x" for d in self.shape)
        enc = f', "{self.encoding}"' if self.encoding is not None else ""
        return f"tensor<{dims}{self.elem}{enc}>"


@cache
def tensor(shape: tuple[int, ...], elem: str, encoding: str | None = None) -> TensorType:
    """The interned tensor type; use this rather than the constructor in hot paths."""
    return TensorType(tuple(shape), elem, encoding)


@dataclass(frozen=True, slots=True)
class TypedInt:
    """An integer attribute written with its type: `3 : i64`."""

    value: int
    type: str

    def __deepcopy__(self, memo: dict) -> TypedInt:  # immutable: a module's copy shares it
        return self

    def __str__(self) -> str:
        return f"{int_text(self.value)} : {self.type}"


@dataclass(frozen=True, slots=True)
class TypedFloat:
    """A float attribute written with its type: `0.5 : f32`."""

    value: float
    type: str

    def __deepcopy__(self, memo: dict) -> TypedFloat:  # immutable: a module's copy shares it
        return self

    def __str__(self) -> str:
        return f"{format_float(self.value, elem=self.type)} : {self.type}"


@dataclass(frozen=True, slots=True)
class TypeAttr:
    """A type used as an attribute value, e.g. `mp.precision = bf16`."""

    type: str | TensorType

    def __deepcopy__(self, memo: dict) -> TypeAttr:  # immutable: a module's copy shares it
        return self

    def __str__(self) -> str:
        return str(self.type)


_BARE_SYMBOL = re.compile(r"[A-Za-z_$.][A-Za-z0-9_$.\-]*")  # others print quoted: @"a b"


@dataclass(frozen=True, slots=True)
class SymbolRef:
    """`@name`."""

    name: str

    def __deepcopy__(self, memo: dict) -> SymbolRef:  # immutable: a module's copy shares it
        return self

    def __str__(self) -> str:
        if _BARE_SYMBOL.fullmatch(self.name):
            return f"@{self.name}"
        return f'@"{self.name}"'


@dataclass(frozen=True, eq=False)
class DenseAttr:
    """`dense<...> : tensor<...>`: the values as a numpy array in the type's logical shape.

    The array's dtype is `value_dtype(type.elem)`: float64 for f64, float32 for every narrower
    float (their values are exactly representable in f32), int64 for integers (uint64 for
    ui64), bool for i1.
    Equality and hashing are by type and bytes, so two identical constants CSE together.
    """

    array: np.ndarray
    type: TensorType

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, DenseAttr) and self.type == other.type
                and self.array.tobytes() == other.array.tobytes())

    def __hash__(self) -> int:
        return hash((self.type, self.array.tobytes()))

    @property
    def is_splat(self) -> bool:
        a = self.array
        return a.size > 0 and bool(np.all(a.reshape(-1) == a.reshape(-1)[0]))


class _Unit:
    """MLIR's unit attribute: `{flag}` (present, no value)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNIT"


UNIT = _Unit()


def format_float(x: float, single: bool = False, elem: str = "f32") -> str:
    """Shortest text that reads back as the same float, always with a '.' or exponent (MLIR).

    `single`: shortest text for the float32 value (what dense f32/bf16/... literals hold).
    NaN and infinities have no decimal spelling; they print as the bit pattern of `elem`, and
    so does a value beyond `elem`'s range (built through the API), which the type holds as an
    infinity and the parser refuses as a decimal.
    """
    if not math.isfinite(x):
        return float_bits_text(x, elem)
    fmt = FORMATS.get(elem)
    if fmt is not None and fmt.is_float and not float_fits(x, elem):
        return float_bits_text(math.copysign(math.inf, x), elem)
    s = str(np.float32(x)) if single else repr(float(x))
    if "e" in s or "E" in s:
        mant, exp = s.split("e")
        if "." not in mant:
            mant += ".0"
        return f"{mant}e{exp}"
    return s if "." in s else s + ".0"


def float_bits_text(x: float, elem: str) -> str:
    """NaN or an infinity as MLIR writes it: the bit pattern at the width of `elem` (`0x7E00`
    for an f16 NaN). A format without infinities (f8E4M3FN, f8E8M0FNU) turns them into NaN,
    one without NaN either (the MX elements f6E2M3FN, f6E3M2FN, f4E2M1FN) into ±max and NaN
    into -0, as a conversion to it does (ml_dtypes; mplower.numerics.rounding)."""
    fmt = FORMATS.get(elem)
    if fmt is None or not fmt.is_float:
        fmt = FORMATS["f32"]
    e, m = fmt.exp_bits, fmt.man_bits
    width = (e + m + 4) // 4
    if fmt.min_value > 0:  # E8M0: unsigned, 0xFF is its NaN
        return f"0x{(1 << e) - 1:0{width}X}"
    if not fmt.has_nan:
        top = (1 << (e + m)) - 1  # the largest finite, all exponent and mantissa bits set
        bits = (1 << (e + m)) if math.isnan(x) else top | ((1 << (e + m)) if x < 0 else 0)
        return f"0x{bits:0{width}X}"
    bits = ((1 << e) - 1) << m
    if math.isnan(x) or not fmt.has_inf:
        bits |= (1 << (m - 1)) if fmt.has_inf else (1 << m) - 1
    elif x < 0:
        bits |= 1 << (e + m)
    return f"0x{bits:0{(e + m + 4) // 4}X}"


def float_from_bits(bits: int, elem: str) -> float:
    """The value of a bit pattern of the float type `elem` (MLIR's `0x7FC00000 : f32`).

    Raises ValueError when the pattern is negative or wider than the type.
    """
    fmt = FORMATS[elem]
    e, m = fmt.exp_bits, fmt.man_bits
    unsigned = fmt.min_value > 0  # E8M0: 2^(bits - 127), 0xFF is NaN
    if not 0 <= bits < 1 << (e + m + (not unsigned)):
        raise ValueError(f"hexadecimal float constant out of range for {elem}")
    if unsigned:
        return math.nan if bits == (1 << e) - 1 else math.ldexp(1.0, bits - ((1 << (e - 1)) - 1))
    sign = -1.0 if bits >> (e + m) else 1.0
    exp, man = (bits >> m) & ((1 << e) - 1), bits & ((1 << m) - 1)
    if fmt.has_nan and exp == (1 << e) - 1 and (fmt.has_inf or man == (1 << m) - 1):
        return sign * math.inf if fmt.has_inf and man == 0 else math.nan
    bias = (1 << (e - 1)) - 1
    if exp == 0:
        return sign * math.ldexp(man, 1 - bias - m)
    return sign * math.ldexp((1 << m) | man, exp - bias - m)


def attr_to_str(v: Any) -> str:
    """MLIR spelling of an attribute value."""
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, int):
        return int_text(v)
    if isinstance(v, float):
        # An untyped float is an f64 in MLIR, so NaN and inf carry that type to read back.
        if math.isfinite(v):
            return format_float(v, elem="f64")
        return f"{float_bits_text(v, 'f64')} : f64"
    if isinstance(v, str):
        return quote(v)
    if isinstance(v, tuple):
        return "[" + ", ".join(attr_to_str(e) for e in v) + "]"
    if isinstance(v, DenseAttr):
        return dense_to_str(v)
    if isinstance(v, dict):
        return attr_dict_to_str(v)
    return str(v)


def int_text(v: int) -> str:
    """Decimal, or hexadecimal for an integer longer than Python converts to decimal (4300
    digits by default): the parser refuses such a decimal literal, and hex has no limit."""
    try:
        return str(v)
    except ValueError:
        return hex(v)


def attr_dict_to_str(d: dict) -> str:
    return "{" + ", ".join(attr_name(k) if v is UNIT else f"{attr_name(k)} = {attr_to_str(v)}"
                           for k, v in d.items()) + "}"


_BARE_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.$")


def attr_name(name: str) -> str:
    if name and (name[0].isalpha() or name[0] == "_") and set(name) <= _BARE_NAME_CHARS:
        return name
    return quote(name)


def quote(s: str) -> str:
    out = []
    for ch in s:
        o = ord(ch)
        if ch == '"' or ch == "\\":
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif o < 0x20 or o == 0x7F:
            out.append(f"\\{o:02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _elem_to_str(x: Any, is_float: bool, single: bool, elem: str) -> str:
    if isinstance(x, (bool, np.bool_)):
        return "true" if x else "false"
    return format_float(float(x), single, elem) if is_float else str(int(x))


@cache
def _overflow_bound(elem: str) -> tuple[Fraction, bool]:
    """(b, tie): a value of magnitude above b, or equal to b when `tie`, rounds to nearest
    even past the largest finite value of the float type `elem`. Exact (f64's bound is not
    a double), compared only with values already past the largest finite one."""
    fmt = FORMATS[elem]
    top = Fraction(fmt.max_finite)
    ulp = Fraction(2) ** (math.frexp(fmt.max_finite)[1] - 1 - fmt.man_bits)
    # Half-way between the largest value and the next step up goes to the even one of the two.
    return top + ulp / 2, (top / ulp) % 2 == 1


def float_fits(x: float, elem: str) -> bool:
    """Whether the finite value `x` (a float, or an integer of any size) keeps a finite value
    in the float type `elem`.

    A value is held in its `value_dtype` first (f32 for every type narrower than f64) and then
    rounded to `elem` by whoever computes with it; neither step may go past the largest finite
    value, which would make it an infinity (or NaN in f8E4M3FN). MLIR rounds such a literal to
    inf silently; mplower refuses it, and infinities are written as bit patterns.
    """
    a = abs(x)
    if a <= FORMATS[elem].max_finite:
        return True
    if elem != "f64":
        bound, tie = _overflow_bound("f32")
        if a > bound or (tie and a == bound):
            return False
        a = float(np.float32(a))
    bound, tie = _overflow_bound(elem)
    return a < bound or (a == bound and not tie)


def value_dtype(elem: str) -> np.dtype:
    """The numpy dtype that holds the values (not the bits) of an element type."""
    if elem == "f64":
        return np.dtype(np.float64)
    if elem == "i1":
        return np.dtype(np.bool_)
    if elem == "ui64":  # the one integer type whose values int64 cannot hold
        return np.dtype(np.uint64)
    return np.dtype(np.float32 if FORMATS[elem].is_float else np.int64)


def dense_to_str(attr: DenseAttr) -> str:
    is_float = FORMATS[attr.type.elem].is_float
    single = attr.type.elem != "f64"
    vals = attr.array
    if attr.is_splat:
        body = _elem_to_str(vals.reshape(-1)[0], is_float, single, attr.type.elem)
    elif vals.size == 0:
        body = ""
    else:
        body = _nested(vals, is_float, single, attr.type.elem)
    return f"dense<{body}> : {attr.type}"


def _nested(vals: np.ndarray, is_float: bool, single: bool, elem: str) -> str:
    if vals.ndim == 0:
        return _elem_to_str(vals.item(), is_float, single, elem)
    if vals.ndim == 1:
        return "[" + ", ".join(_elem_to_str(x, is_float, single, elem)
                               for x in vals.tolist()) + "]"
    return "[" + ", ".join(_nested(v, is_float, single, elem) for v in vals) + "]"
