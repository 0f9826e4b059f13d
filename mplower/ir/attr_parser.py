"""Types and attributes as the IR parser reads them: the grammar callbacks that check and build
them (`AttributeBuilder`, mixed into the parser's builder, mplower.ir.parser).

Each callback takes the tokens of its grammar rule and returns the IR value (TensorType,
TypedInt, DenseAttr, ...), or raises a DiagnosticError located at the offending token: an
unknown type or encoding, a literal its type cannot hold, a ragged or wrongly sized dense
literal, nesting deeper than MAX_ATTRIBUTE_DEPTH. Arrays and dictionaries carry their depth
while parsing (`_Array`, `_Dict`) and become plain tuples and dicts once it is checked.
"""

from __future__ import annotations

import math
import re
import sys
from typing import Any

import numpy as np
from lark import Token

from mplower.ir.diagnostics import DiagnosticError, Location, did_you_mean
from mplower.ir.types import (
    ATTRIBUTE_SCALAR_TYPES,
    ELEMENT_TYPES,
    ENCODINGS,
    MAX_ELEMENTS,
    UNIT,
    DenseAttr,
    SymbolRef,
    TensorType,
    TypeAttr,
    TypedFloat,
    TypedInt,
    float_bits_text,
    float_fits,
    float_from_bits,
    shape_problem,
    tensor,
    value_dtype,
)
from mplower.numerics.formats import FORMATS

MAX_ATTRIBUTE_DEPTH = 64  # nesting of arrays/dicts; deeper input is rejected, not recursed into

_MAX_DIM_DIGITS = len(str(MAX_ELEMENTS))

# Widths of the integer types an attribute may name; `index` is 64 bits, as in MLIR.
_INT_BITS = {name: int(name.lstrip("ui")) for name in ATTRIBUTE_SCALAR_TYPES
             if name.lstrip("u").startswith("i") and name.lstrip("ui").isdigit()} | {"index": 64}


class _Array(tuple):
    """An array attribute while parsing, remembering its nesting depth."""

    depth = 1


class AttributeBuilder:
    """The callbacks of the grammar's type and attribute rules. The parser's builder sets
    `file` (for locations) and finds a bad element of a dense literal in its source again
    (`_element_token`)."""

    file: str
    type_cache: dict[str, TensorType]

    def error(self, tok: Token, message: str) -> DiagnosticError:
        return DiagnosticError.at(Location(self.file, tok.line, tok.column), message)

    # ---- types ---------------------------------------------------------------------------
    def type(self, tok: Token) -> TensorType | str:
        if tok.type == "TENSOR_TYPE":
            t = self.type_cache.get(tok.value)
            if t is None:
                t = self.type_cache[tok.value] = self._tensor_type(tok)
            return t
        if tok.value not in ATTRIBUTE_SCALAR_TYPES:
            raise self.error(tok, f"unknown type '{tok.value}'{did_you_mean(tok.value, ELEMENT_TYPES)}")
        return tok.value

    def _tensor_type(self, tok: Token) -> TensorType:
        body = tok.value[len("tensor<"):-1]
        encoding = None
        if "," in body:
            body, enc = body.split(",", 1)
            enc = enc.strip()
            if not (len(enc) >= 2 and enc[0] == enc[-1] == '"'):
                raise self.error(tok, f"tensor encoding must be a string, got '{enc}'")
            encoding = enc[1:-1]
            if encoding not in ENCODINGS:
                raise self.error(tok, f"unknown tensor encoding \"{encoding}\" "
                                      f"(known: {', '.join(ENCODINGS)})")
        parts = body.strip().split("x")
        elem = parts[-1]
        # An element type can itself contain an 'x' only in names we do not have; digits first.
        dims: list[int] = []
        for p in parts[:-1]:
            if p.isdigit():
                # Checked before int(), which refuses more than 4300 digits.
                dims.append(int(p) if len(p) <= _MAX_DIM_DIGITS else MAX_ELEMENTS + 1)
            elif p in ("?", ""):
                raise self.error(tok, "dynamic dimensions are not supported; give a static size")
            elif p.lstrip("-").isdigit():
                raise self.error(tok, f"negative dimension {p} in {tok.value}")
            else:
                raise self.error(tok, f"malformed dimension '{p}' in {tok.value}")
        if elem not in ELEMENT_TYPES:
            if elem.lstrip("-").isdigit():
                raise self.error(tok, f"missing element type in {tok.value}")
            raise self.error(tok, f"unknown element type '{elem}'{did_you_mean(elem, ELEMENT_TYPES)}")
        problem = shape_problem(tuple(dims))
        if problem is not None:
            raise self.error(tok, f"{_short(tok.value)} {problem}")
        return tensor(tuple(dims), elem, encoding)

    def types(self, *ts: Any) -> list:
        return list(ts)

    def single_result(self, t: Any) -> list:
        return [t]

    def result_list(self, ts: list | None = None) -> list:
        return ts or []

    # ---- attributes ----------------------------------------------------------------------
    def int_attr(self, tok: Token) -> int:
        return _HexInt(tok.value, 0) if "x" in tok.value else self._decimal(tok)

    def _decimal(self, tok: Token) -> int:
        """The decimal integer literal `tok`; Python converts at most sys.int_max_str_digits
        digits (4300 by default: the conversion is quadratic), hexadecimal has no limit."""
        text = tok.value
        limit = sys.get_int_max_str_digits()
        digits = len(text) - (text[0] in "+-")
        if limit and digits > limit:
            raise self.error(tok, f"integer literal has {digits} digits; at most {limit} are "
                                  f"supported (write larger values in hexadecimal)")
        return int(text)

    def typed_int_attr(self, tok: Token, t: Any) -> TypedInt | TypedFloat:
        if isinstance(t, str) and t in FORMATS and FORMATS[t].is_float:
            # MLIR writes NaN and inf as a bit pattern of the type's width: 0x7FC00000 : f32.
            if "x" not in tok.value:
                raise self.error(tok, "unexpected decimal integer literal for a floating point "
                                      f"value; add a trailing dot: '{tok.value}.0 : {t}'")
            return TypedFloat(self._float_bits(tok, t), t)
        if not isinstance(t, str):
            raise self.error(tok, "an integer attribute's type must be a scalar type")
        value = int(self.int_attr(tok))
        bits = _INT_BITS.get(t)
        # MLIR's rule for a signless iN: the value must fit N bits, read signed or unsigned.
        if bits is not None:
            lo = 0 if t.startswith("ui") else -(1 << (bits - 1))
            hi = (1 << bits) - 1
            if not lo <= value <= hi:
                # The literal as written: a hex one past 4300 decimal digits has no decimal form.
                raise self.error(tok, f"integer value {_short(tok.value)} does not fit {t} "
                                      f"(range [{lo}, {hi}])")
        return TypedInt(value, t)

    def float_attr(self, tok: Token) -> float:
        return self._float(tok, "f64")  # an untyped float is an f64, as in MLIR

    def typed_float_attr(self, tok: Token, t: Any) -> TypedFloat:
        if not isinstance(t, str):
            raise self.error(tok, "a float attribute's type must be a scalar type")
        fmt = FORMATS.get(t)
        return TypedFloat(self._float(tok, t) if fmt is not None and fmt.is_float
                          else float(tok.value), t)

    def _float(self, tok: Token, elem: str) -> float:
        """The decimal float literal `tok`, refused where it is written if the float type
        `elem` cannot hold it (MLIR would round it to an infinity)."""
        value = float(tok.value)
        if math.isinf(value) or not float_fits(value, elem):
            raise self.error(tok, _out_of_range(tok.value, elem))
        return value

    def string_attr(self, tok: Token) -> str:
        return _unquote(tok, self)

    def true_attr(self, _tok: Token) -> bool:
        return True

    def false_attr(self, _tok: Token) -> bool:
        return False

    def symbol_attr(self, tok: Token) -> SymbolRef:
        name = tok.value[1:]
        return SymbolRef(name[1:-1] if name.startswith('"') else name)

    def type_attr(self, t: Any) -> TypeAttr:
        return TypeAttr(t)

    def attr_values(self, *vals: Any) -> list:
        return list(vals)

    def array(self, lsqb: Token, vals: list | None) -> _Array:
        arr = _Array(vals or ())
        depth = 1 + max((getattr(v, "depth", 0) for v in arr), default=0)
        if depth > MAX_ATTRIBUTE_DEPTH:
            raise self.error(lsqb, f"attribute nesting is deeper than {MAX_ATTRIBUTE_DEPTH} levels")
        arr.depth = depth
        return arr

    def attr_entry(self, key: Token, value: Any = None) -> tuple[Token, Any]:
        return key, (UNIT if value is None else value)

    def attr_entries(self, *entries: tuple[Token, Any]) -> list:
        return list(entries)

    def attr_dict(self, lbrace: Token, entries: list | None) -> dict:
        out: dict[str, Any] = {}
        keys: dict[str, Token] = {}
        depth = 1
        for key, value in entries or ():
            name = _unquote(key, self) if key.type == "STRING" else key.value
            if name in out:
                raise self.error(key, f"duplicate attribute '{name}'")
            out[name] = _freeze(value)
            keys[name] = key
            depth = max(depth, 1 + getattr(value, "depth", 0))
        if depth > MAX_ATTRIBUTE_DEPTH:
            raise self.error(lbrace, f"attribute nesting is deeper than {MAX_ATTRIBUTE_DEPTH} levels")
        return _Dict(out, depth, keys)

    def dense_attr(self, tok: Token, body: Any, t: Any) -> DenseAttr:
        if not isinstance(t, TensorType):
            raise self.error(tok, "dense attribute needs a tensor type: dense<...> : tensor<...>")
        dtype = value_dtype(t.elem)
        if body is None:
            if t.size != 0:
                raise self.error(tok, f"empty dense literal for {t} with {t.size} elements")
            return DenseAttr(np.zeros(t.shape, dtype), t)
        if isinstance(body, Token):
            return DenseAttr(np.full(t.shape, self._scalar(body, t, tok, 0), dtype), t)
        flat: list = []
        shape = self._dense_shape(body, flat, tok)
        if len(flat) != t.size:
            raise self.error(tok, f"dense literal has {len(flat)} elements but {t} has {t.size}")
        if shape != t.shape and len(shape) != 1:
            raise self.error(tok, f"dense literal of shape {list(shape)} does not match {t}")
        values = [self._scalar(v, t, tok, i) for i, v in enumerate(flat)]
        return DenseAttr(np.array(values, dtype).reshape(t.shape), t)

    def _dense_shape(self, body: Any, flat: list, tok: Token) -> tuple[int, ...]:
        if not isinstance(body, tuple):
            flat.append(body)
            return ()
        inner = {self._dense_shape(v, flat, tok) for v in body}
        if len(inner) > 1:
            raise self.error(tok, "ragged dense literal: nested lists of different lengths")
        return (len(body),) + (inner.pop() if inner else ())

    def _scalar(self, v: Any, t: TensorType, tok: Token, index: int) -> Any:
        """Element `index` of the dense literal at `tok`, checked against the element type."""
        fmt = FORMATS[t.elem]
        if isinstance(v, Token):  # a splat: the body is this one token
            text = v.value
            if text in ("true", "false"):
                return text == "true"
            if v.type == "INT" and "x" in text and fmt.is_float:
                return self._float_bits(v, t.elem)
            v = self.float_attr(v) if v.type == "FLOAT" else self.int_attr(v)
        elif type(v) is _HexInt and fmt.is_float:
            try:
                return float_from_bits(v, t.elem)
            except ValueError:
                self._float_bits(self._element_token(tok, index), t.elem, v)  # raises
        if isinstance(v, bool):
            return v
        if not isinstance(v, int | float):
            raise self.error(tok, f"bad element in dense literal of {t}: only numbers are "
                                  f"allowed")
        if fmt.is_int:
            lo, hi = fmt.int_range
            if isinstance(v, int) and lo <= v <= hi:
                return v
            etok = self._element_token(tok, index)
            if isinstance(v, float):  # MLIR: "expected integer elements"
                raise self.error(etok, f"expected an integer element for {t}, got "
                                       f"{_short(etok.value)}")
            raise self.error(etok, f"integer value {_short(etok.value)} is out of range for "
                                   f"{t.elem} (range [{lo}, {hi}])")
        if float_fits(v, t.elem):
            return v
        etok = self._element_token(tok, index)
        raise self.error(etok, _out_of_range(etok.value, t.elem))

    def _float_bits(self, tok: Token, elem: str, bits: int | None = None) -> float:
        if bits is None:
            bits = int(tok.value, 0)
        try:
            return float_from_bits(bits, elem)
        except ValueError as e:
            raise self.error(tok, f"{e} ({'-' if bits < 0 else ''}0x{abs(bits):X})") from None


class _Dict(dict):
    """A dictionary attribute while parsing, remembering its nesting depth."""

    def __init__(self, items: dict, depth: int, keys_at: dict[str, Token]):
        super().__init__(items)
        self.depth = depth
        self.keys_at = keys_at  # where each key was written


def _short(text: str) -> str:
    """`text`, cut to 40 characters for a message."""
    return text if len(text) <= 40 else text[:37] + "..."


def _out_of_range(text: str, elem: str) -> str:
    fmt = FORMATS[elem]
    msg = f"{_short(text)} is out of range for {elem} (largest finite value {fmt.max_finite:.8g})"
    if fmt.has_inf:
        msg += f"; an infinity is written {float_bits_text(math.inf, elem)} : {elem}"
    return msg



class _HexInt(int):
    """An integer written in hex, while parsing: in a dense literal of a float type it is the
    element's bit pattern (`dense<[0x7FC00000, 1.0]> : tensor<2xf32>`), elsewhere an int."""


def _freeze(v: Any) -> Any:
    """Parsed arrays become plain tuples and dicts plain dicts once nesting is checked."""
    if isinstance(v, _Array):
        if v.depth > 1:
            return tuple(_freeze(e) for e in v)
        return tuple(int(e) if type(e) is _HexInt else e for e in v)
    if isinstance(v, _Dict):
        return dict(v)
    if type(v) is _HexInt:
        return int(v)
    return v



_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\"}


def _unquote(tok: Token, b: AttributeBuilder) -> str:
    s = tok.value[1:-1]
    if "\\" not in s:
        return s
    out, i = [], 0
    while i < len(s):
        c = s[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        nxt = s[i + 1]
        if nxt in _ESCAPES:
            out.append(_ESCAPES[nxt])
            i += 2
        elif re.fullmatch(r"[0-9a-fA-F]{2}", s[i + 1:i + 3]):
            out.append(chr(int(s[i + 1:i + 3], 16)))
            i += 3
        else:
            raise b.error(tok, f"unknown escape '\\{nxt}' in string")
    return "".join(out)
