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
from functools import cache
from typing import Any

import numpy as np

from mplower.numerics.formats import FORMATS

ELEMENT_TYPES = tuple(FORMATS)
# Scalar types that may annotate attributes (`3 : i64`) but are not tensor element types.
ATTRIBUTE_SCALAR_TYPES = frozenset(ELEMENT_TYPES) | {"i16", "i64", "ui16", "ui32", "ui64", "index"}
ENCODINGS = ("2:4", "1:2", "csr")


@dataclass(frozen=True, slots=True)
class TensorType:
    shape: tuple[int, ...]
    elem: str
    encoding: str | None = None

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

    def __str__(self) -> str:
        return f"{self.value} : {self.type}"


@dataclass(frozen=True, slots=True)
class TypedFloat:
    """A float attribute written with its type: `0.5 : f32`."""

    value: float
    type: str

    def __str__(self) -> str:
        return f"{format_float(self.value, elem=self.type)} : {self.type}"


@dataclass(frozen=True, slots=True)
class TypeAttr:
    """A type used as an attribute value, e.g. `mp.precision = bf16`."""

    type: str | TensorType

    def __str__(self) -> str:
        return str(self.type)


_BARE_SYMBOL = re.compile(r"[A-Za-z_$.][A-Za-z0-9_$.\-]*")  # others print quoted: @"a b"


@dataclass(frozen=True, slots=True)
class SymbolRef:
    """`@name`."""

    name: str

    def __str__(self) -> str:
        if _BARE_SYMBOL.fullmatch(self.name):
            return f"@{self.name}"
        return f'@"{self.name}"'


@dataclass(frozen=True, eq=False)
class DenseAttr:
    """`dense<...> : tensor<...>`: the values as a numpy array in the type's logical shape.

    The array's dtype is `value_dtype(type.elem)`: float64 for f64, float32 for every narrower
    float (their values are exactly representable in f32), int64 for integers, bool for i1.
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
    NaN and infinities have no decimal spelling; they print as the bit pattern of `elem`.
    """
    if not math.isfinite(x):
        return float_bits_text(x, elem)
    s = str(np.float32(x)) if single else repr(float(x))
    if "e" in s or "E" in s:
        mant, exp = s.split("e")
        if "." not in mant:
            mant += ".0"
        return f"{mant}e{exp}"
    return s if "." in s else s + ".0"


def float_bits_text(x: float, elem: str) -> str:
    """NaN or an infinity as MLIR writes it: the bit pattern at the width of `elem` (`0x7E00`
    for an f16 NaN). A format without infinities (f8E4M3FN) turns them into NaN, as a
    conversion to it does."""
    fmt = FORMATS.get(elem)
    if fmt is None or not fmt.is_float:
        fmt = FORMATS["f32"]
    e, m = fmt.exp_bits, fmt.man_bits
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
    if not 0 <= bits < 1 << (1 + e + m):
        raise ValueError(f"hexadecimal float constant out of range for {elem}")
    sign = -1.0 if bits >> (e + m) else 1.0
    exp, man = (bits >> m) & ((1 << e) - 1), bits & ((1 << m) - 1)
    if exp == (1 << e) - 1 and (fmt.has_inf or man == (1 << m) - 1):
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
        return str(v)
    if isinstance(v, float):
        # An untyped float is an f64 in MLIR, so NaN and inf carry that type to read back.
        return format_float(v) if math.isfinite(v) else f"{float_bits_text(v, 'f64')} : f64"
    if isinstance(v, str):
        return quote(v)
    if isinstance(v, tuple):
        return "[" + ", ".join(attr_to_str(e) for e in v) + "]"
    if isinstance(v, DenseAttr):
        return dense_to_str(v)
    if isinstance(v, dict):
        return attr_dict_to_str(v)
    return str(v)


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


def value_dtype(elem: str) -> np.dtype:
    """The numpy dtype that holds the values (not the bits) of an element type."""
    if elem == "f64":
        return np.dtype(np.float64)
    if elem == "i1":
        return np.dtype(np.bool_)
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
