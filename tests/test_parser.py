"""The parser: types, every attribute kind, op forms, SSA names, file structure, both lexer paths.

Values are checked on the parsed Module (types, attribute values, edges), not only on printed
text. The lexer reads a one-line op with scalar attributes as one SIMPLE_OP token and decodes it
itself; everything else goes through the grammar. The two must agree on every input, so the op
lines below are parsed both ways and compared, and the fast path is checked to be taken.
"""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest
from conftest import EXAMPLES, func_ir, general_path, parse_general, roundtrip
from hypothesis import given, settings
from hypothesis import strategies as st

import mplower.ir.parser as parser_module
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import ARG, RETURN
from mplower.ir.parser import _IRLexer, parse, split_source
from mplower.ir.printer import print_module
from mplower.ir.types import (
    ELEMENT_TYPES,
    ENCODINGS,
    UNIT,
    DenseAttr,
    SymbolRef,
    TypeAttr,
    TypedFloat,
    TypedInt,
    tensor,
)


def _error(text: str, general: bool = False) -> tuple[int, int, str]:
    with pytest.raises(DiagnosticError) as e:
        parse_general(text, "t.ir") if general else parse(text, "t.ir")
    d = e.value.diagnostics[0]
    return d.loc.line, d.loc.col, d.message


def _single_op(text: str):
    f = parse(text).function()
    (node,) = [n for n in f.ops() if f.op(n) != RETURN]
    return f, node


# ---- types ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, shape, elem, encoding", [
    ("tensor<f32>", (), "f32", None),
    ("tensor<2x3xbf16>", (2, 3), "bf16", None),
    ("tensor<0x4xf16>", (0, 4), "f16", None),
    ("tensor<1x1x1x1x7xi8>", (1, 1, 1, 1, 7), "i8", None),
    ('tensor<128x64xbf16, "2:4">', (128, 64), "bf16", "2:4"),
    ('tensor<128x64xf32, "csr">', (128, 64), "f32", "csr"),
    ('tensor<4x4xf8E4M3FN,"csr">', (4, 4), "f8E4M3FN", "csr"),
])
def test_tensor_type_parses_shape_element_and_encoding(text, shape, elem, encoding):
    f = parse(func_ir(f"return %x : {text}", args=f"%x: {text}", result=text)).function()
    t = f.types(f.args[0])[0]
    assert (t.shape, t.elem, t.encoding) == (shape, elem, encoding)
    assert t is tensor(shape, elem, encoding)  # interned


@pytest.mark.parametrize("elem", ELEMENT_TYPES)
def test_every_element_type_is_accepted_and_prints_back(elem):
    t = f"tensor<3x{elem}>"
    text = func_ir(f"return %x : {t}", args=f"%x: {t}", result=t)
    f = parse(text).function()
    assert f.result_types == [tensor((3,), elem)]
    assert f"%x: {t}" in roundtrip(text)


def test_encoding_prints_with_a_space_after_the_comma():
    t = 'tensor<8x8xbf16,"2:4">'
    out = roundtrip(func_ir(f"return %x : {t}", args=f"%x: {t}", result=t))
    assert '%x: tensor<8x8xbf16, "2:4">' in out


@pytest.mark.parametrize("t, col, message", [
    ("tensor<2x3xf33>", 18, "unknown element type 'f33'; did you mean 'f32'?"),
    ("tensor<2x?xf32>", 18, "dynamic dimensions are not supported"),
    ("tensor<-2x3xf32>", 18, "negative dimension -2 in tensor<-2x3xf32>"),
    ("tensor<2x3>", 18, "missing element type in tensor<2x3>"),
    ("tensor<2xax3xf32>", 18, "malformed dimension 'a'"),
    ('tensor<2x3xf32, "2:8">', 18, f'unknown tensor encoding "2:8" (known: {", ".join(ENCODINGS)})'),
    ("tensor<2x3xf32, csr>", 18, "tensor encoding must be a string, got 'csr'"),
    ("f32", 14, "expected a tensor type, got 'f32'"),  # at the argument: the type is a word
    ("bfloat16", 18, "unknown type 'bfloat16'; did you mean 'bf16'?"),
])
def test_bad_argument_type_is_located_at_the_type(t, col, message):
    line, c, msg = _error(f"func.func @f(%x: {t}) {{\n  return\n}}\n")
    assert (line, c) == (1, col)
    assert message in msg


# ---- attributes ----------------------------------------------------------------------------

SCALAR_ATTRS = [  # (text, value); all of these fit the SIMPLE_OP fast path
    ("3", 3),
    ("-7", -7),
    ("+5", 5),
    ("0x10", 16),
    ("-0x10", -16),
    ("3 : i64", TypedInt(3, "i64")),
    ("-1 : i8", TypedInt(-1, "i8")),
    ("7 : index", TypedInt(7, "index")),
    ("0.5", 0.5),
    ("-2.25", -2.25),
    ("1.", 1.0),
    ("1.0e-05", 1e-05),
    ("2E3", 2000.0),
    ("0.5 : f32", TypedFloat(0.5, "f32")),
    ("1.5e3 : bf16", TypedFloat(1500.0, "bf16")),
    ("0x3C00 : f16", TypedFloat(1.0, "f16")),
    ("0x0001 : f16", TypedFloat(2.0 ** -24, "f16")),
    ("0x3F80 : bf16", TypedFloat(1.0, "bf16")),
    ("0x3FF0000000000000 : f64", TypedFloat(1.0, "f64")),
    ("0x7F800000 : f32", TypedFloat(math.inf, "f32")),
    ("0xFF800000 : f32", TypedFloat(-math.inf, "f32")),
    ("0x38 : f8E4M3FN", TypedFloat(1.0, "f8E4M3FN")),
    ("0x7E : f8E4M3FN", TypedFloat(448.0, "f8E4M3FN")),
    ("0x3C : f8E5M2", TypedFloat(1.0, "f8E5M2")),
    ("0x7C : f8E5M2", TypedFloat(math.inf, "f8E5M2")),
    ('"plain"', "plain"),
    ('""', ""),
    (r'"q\"b\\s\nn\tt\01x\7Fz"', 'q"b\\s\nn\tt\x01x\x7fz'),
    ('"ünïcödé ✓"', "ünïcödé ✓"),
    ("true", True),
    ("false", False),
    ("bf16", TypeAttr("bf16")),
    ("i8", TypeAttr("i8")),
    ("@callee", SymbolRef("callee")),
    ("@x.y$z", SymbolRef("x.y$z")),
]

GENERAL_ATTRS = [  # (text, value); these need the grammar
    ("[]", ()),
    ("[1, 2, 3]", (1, 2, 3)),
    ('[1, [2.5, "a", [true]], []]', (1, (2.5, "a", (True,)), ())),
    ("[0x10, [0x20]]", (16, (32,))),
    ("[1 : i32, 0x7E00 : f16]", (TypedInt(1, "i32"), TypedFloat(math.nan, "f16"))),
    ("{}", {}),
    ('{a = 1, b = [true], "c d" = {e}}', {"a": 1, "b": (True,), "c d": {"e": UNIT}}),
    ("tensor<4xf32>", TypeAttr(tensor((4,), "f32"))),
    ('@"quoted name"', SymbolRef("quoted name")),
    ("1 : tensor<2xf32>", None),  # an error; see test_typed_number_needs_a_scalar_type
]


def _same(a, b) -> bool:
    """Equality that treats NaN as equal to NaN and keeps -0.0 apart from 0.0."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) ==
                                                     math.copysign(1, b))
    if isinstance(a, TypedFloat) and isinstance(b, TypedFloat):
        return a.type == b.type and _same(a.value, b.value)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


T2 = "(tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>"
VALUE_COL = len("  %0 = mp.relu %x {x.v = ") + 1  # where _attr_line's value starts


def _attr_line(value_text: str) -> str:
    return (f"%0 = mp.relu %x {{x.v = {value_text}}} : (tensor<2x3xf32>) -> tensor<2x3xf32>\n"
            "return %0 : tensor<2x3xf32>")


@pytest.mark.parametrize("text, value", SCALAR_ATTRS + GENERAL_ATTRS[:-1],
                         ids=[t for t, _ in SCALAR_ATTRS + GENERAL_ATTRS[:-1]])
@pytest.mark.parametrize("path", ["fast", "general"])
def test_attribute_value_parses_to_its_python_value(text, value, path):
    src = func_ir(_attr_line(text))
    m = parse(src) if path == "fast" else parse_general(src)
    f = m.function()
    got = f.attrs_of(f.ops()[0])["x.v"]
    assert _same(got, value), (got, value)
    assert type(got) is type(value)  # a hex int is a plain int once parsed


@pytest.mark.parametrize("text", [t for t, _ in SCALAR_ATTRS])
def test_scalar_attribute_line_takes_the_simple_op_fast_path(text):
    line = _attr_line(text).split("\n")[0]
    tokens = list(_IRLexer(None).lex(line))
    assert [t.type for t in tokens] == ["SIMPLE_OP"]


@pytest.mark.parametrize("text", [t for t, _ in GENERAL_ATTRS[:-1]])
def test_structured_attribute_line_goes_through_the_grammar(text):
    line = _attr_line(text).split("\n")[0]
    tokens = list(_IRLexer(None).lex(line))
    assert tokens[0].type == "VALUE_ID" and "SIMPLE_OP" not in {t.type for t in tokens}


@pytest.mark.parametrize("text, value", [
    ("0x7FC00000 : f32", "f32"), ("0x7E00 : f16", "f16"), ("0x7FC0 : bf16", "bf16"),
    ("0x7FF8000000000000 : f64", "f64"), ("0x7F : f8E4M3FN", "f8E4M3FN"),
    ("0xFF : f8E4M3FN", "f8E4M3FN"), ("0x7E : f8E5M2", "f8E5M2"),
])
def test_nan_bit_pattern_is_read_at_the_width_of_its_type(text, value):
    f, node = _single_op(func_ir(_attr_line(text)))
    got = f.attrs_of(node)["x.v"]
    assert isinstance(got, TypedFloat) and got.type == value and math.isnan(got.value)


@pytest.mark.parametrize("text, offset, message", [
    ("0x7FC00000 : f16", 0, "hexadecimal float constant out of range for f16 (0x7FC00000)"),
    ("0x100 : f8E5M2", 0, "hexadecimal float constant out of range for f8E5M2 (0x100)"),
    ("-0x10 : f32", 0, "hexadecimal float constant out of range for f32 (-0x10)"),
    ("3 : f32", 0, ("unexpected decimal integer literal for a floating point value; add a "
                    "trailing dot: '3.0 : f32'")),
    ("1 : f33", 4, "unknown type 'f33'; did you mean 'f32'?"),
    ('"bad \\q escape"', 0, "unknown escape '\\q' in string"),
    ("nonsense", 0, "unknown type 'nonsense'"),
])
@pytest.mark.parametrize("path", ["fast", "general"])
def test_bad_scalar_attribute_is_located_at_the_value(text, offset, message, path):
    assert _error(func_ir(_attr_line(text)), general=path == "general") == (
        2, VALUE_COL + offset, message)


def test_typed_number_needs_a_scalar_type():
    line, col, msg = _error(func_ir(_attr_line("1 : tensor<2xf32>")))
    assert (line, col) == (2, VALUE_COL)
    assert msg == "an integer attribute's type must be a scalar type"


@pytest.mark.parametrize("path", ["fast", "general"])
def test_hex_integers_are_plain_ints_everywhere(path):
    src = func_ir(_attr_line("[0x10 : i32, 0x11, {k = 0x12}]" if path == "general" else
                             "0x10 : i32"))
    f = (parse(src) if path == "fast" else parse_general(src)).function()
    v = f.attrs_of(f.ops()[0])["x.v"]
    ints = [v.value] if path == "fast" else [v[0].value, v[1], v[2]["k"]]
    assert ints == list(range(16, 16 + len(ints)))
    assert all(type(i) is int for i in ints)


def test_unit_attribute_is_the_unit_singleton():
    f, node = _single_op(func_ir(
        "%0 = mp.relu %x {x.flag, x.other = 1} : (tensor<2x3xf32>) -> tensor<2x3xf32>\n"
        "return %0 : tensor<2x3xf32>"))
    assert f.attrs_of(node) == {"x.flag": UNIT, "x.other": 1}
    assert f.attrs_of(node)["x.flag"] is UNIT


@pytest.mark.parametrize("text, shape, values, dtype", [
    ("dense<1.5> : tensor<2x2xf32>", (2, 2), [[1.5, 1.5], [1.5, 1.5]], np.float32),
    ("dense<[[1.0, 2.0], [3.0, 4.0]]> : tensor<2x2xf32>", (2, 2), [[1, 2], [3, 4]], np.float32),
    ("dense<[1, 2, 3, 4]> : tensor<2x2xi8>", (2, 2), [[1, 2], [3, 4]], np.int64),
    ("dense<[1, -2]> : tensor<2xi32>", (2,), [1, -2], np.int64),
    ("dense<[true, false]> : tensor<2xi1>", (2,), [True, False], np.bool_),
    ("dense<0.1> : tensor<f64>", (), 0.1, np.float64),
    ("dense<> : tensor<0xf32>", (0,), [], np.float32),
    ("dense<[1, 2]> : tensor<2xf32>", (2,), [1.0, 2.0], np.float32),
    ("dense<[0x3C00, 0xC000]> : tensor<2xf16>", (2,), [1.0, -2.0], np.float32),
    ("dense<0x3F800000> : tensor<3xf32>", (3,), [1.0, 1.0, 1.0], np.float32),
])
def test_dense_attribute_holds_values_in_the_logical_shape(text, shape, values, dtype):
    f, node = _single_op(func_ir(_attr_line(text)))
    d = f.attrs_of(node)["x.v"]
    assert isinstance(d, DenseAttr)
    assert d.array.shape == shape and d.array.dtype == dtype
    np.testing.assert_array_equal(d.array, np.array(values, dtype).reshape(shape))


def test_dense_hex_elements_are_bit_patterns_inside_a_list():
    f, node = _single_op(func_ir(_attr_line(
        "dense<[0x7FC00000, 1.0, 0xFF800000]> : tensor<3xf32>")))
    a = f.attrs_of(node)["x.v"].array
    assert math.isnan(a[0]) and a[1] == 1.0 and a[2] == -math.inf


@pytest.mark.parametrize("text, message", [
    ("dense<[1.0, 2.0]> : tensor<3xf32>", "dense literal has 2 elements but tensor<3xf32> has 3"),
    ("dense<[[1.0, 2.0], [3.0]]> : tensor<2x2xf32>", "ragged dense literal"),
    ("dense<[[1.0, 2.0, 3.0]]> : tensor<3x1xf32>",
     "dense literal of shape [1, 3] does not match tensor<3x1xf32>"),
    ("dense<> : tensor<2xf32>", "empty dense literal for tensor<2xf32> with 2 elements"),
    ('dense<["a"]> : tensor<1xf32>', "bad element in dense literal of tensor<1xf32>"),
    ("dense<1.0> : f32", "dense attribute needs a tensor type"),
])
def test_bad_dense_literal_is_located_at_dense(text, message):
    line, col, msg = _error(func_ir(_attr_line(text)))
    assert (line, col) == (2, VALUE_COL)
    assert message in msg


# (dense literal, the bad element's text, message): each is refused at the element itself.
BAD_DENSE_ELEMENTS = [
    ("dense<[1, 300]> : tensor<2xi8>", "300",
     "integer value 300 is out of range for i8 (range [-128, 127])"),
    ("dense<[[0, 1], [-129, 0]]> : tensor<2x2xi8>", "-129",
     "integer value -129 is out of range for i8 (range [-128, 127])"),
    ("dense<[255, 256]> : tensor<2xui8>", "256",
     "integer value 256 is out of range for ui8 (range [0, 255])"),
    ("dense<[7, 8]> : tensor<2xi4>", "8", "integer value 8 is out of range for i4 (range [-8, 7])"),
    ("dense<[1, 2]> : tensor<2xi1>", "2", "integer value 2 is out of range for i1 (range [0, 1])"),
    ("dense<[1, 99999999999999999999999]> : tensor<2xi32>", "99999999999999999999999",
     "integer value 99999999999999999999999 is out of range for i32"),
    ("dense<-9223372036854775809> : tensor<2xi32>", "-9223372036854775809",
     "integer value -9223372036854775809 is out of range for i32"),
    ("dense<[1, 2.5]> : tensor<2xi32>", "2.5", ("expected an integer element for tensor<2xi32>, "
                                              "got 2.5")),
    ("dense<[1, 1e400]> : tensor<2xi32>", "1e400", "1e400 is out of range for f64"),
    ("dense<[1.0, 3.5e38]> : tensor<2xf32>", "3.5e38",
     ("3.5e38 is out of range for f32 (largest finite value 3.4028235e+38); an infinity is "
     "written 0x7F800000 : f32")),
    ("dense<[1.0, 65520.0]> : tensor<2xf16>", "65520.0", "65520.0 is out of range for f16"),
    ("dense<[1.0, 500.0]> : tensor<2xf8E4M3FN>", "500.0",
     "500.0 is out of range for f8E4M3FN (largest finite value 448)"),
    ("dense<[1, 100000]> : tensor<2xf16>", "100000", "100000 is out of range for f16"),
    ("dense<[0x7FC00000]> : tensor<1xf16>", "0x7FC00000",
     "hexadecimal float constant out of range for f16"),
]


@pytest.mark.parametrize("text, bad, message", BAD_DENSE_ELEMENTS,
                         ids=[t for t, _, _ in BAD_DENSE_ELEMENTS])
def test_dense_element_out_of_range_is_a_located_error_at_the_element(text, bad, message):
    col = VALUE_COL + text.index(bad, len("dense<"))
    for general in (False, True):
        line, c, msg = _error(func_ir(_attr_line(text)), general)
        assert (line, c) == (2, col)
        assert msg.startswith(message), msg


def test_dense_element_on_a_later_line_is_located_on_its_line():
    text = func_ir("%0 = mp.relu %x {x.v = dense<[1,\n   2, 300]> : tensor<3xi8>} : "
                   "(tensor<2x3xf32>) -> tensor<2x3xf32>\nreturn %0 : tensor<2x3xf32>")
    assert _error(text) == (3, 9, "integer value 300 is out of range for i8 (range [-128, 127])")


@pytest.mark.parametrize("value, message", [
    ("3.5e38 : f32", ("3.5e38 is out of range for f32 (largest finite value 3.4028235e+38); an "
                     "infinity is written 0x7F800000 : f32")),
    ("-70000.0 : f16", ("-70000.0 is out of range for f16 (largest finite value 65504); an "
                       "infinity is written 0x7C00 : f16")),
    ("3.3962e38 : bf16", "3.3962e38 is out of range for bf16"),
    ("464.5 : f8E4M3FN", "464.5 is out of range for f8E4M3FN (largest finite value 448)"),
    ("1e400", ("1e400 is out of range for f64 (largest finite value 1.7976931e+308); an "
              "infinity is written 0x7FF0000000000000 : f64")),
    ("-1.0e309 : f64", "-1.0e309 is out of range for f64"),
])
def test_float_attribute_out_of_range_is_a_located_error(value, message):
    for general in (False, True):  # the scalar alone takes the fast path; in a list, the grammar
        text = value if not general else f"[{value}]"
        line, col, msg = _error(func_ir(_attr_line(text)))
        assert (line, col) == (2, VALUE_COL + general)
        assert msg.startswith(message), msg


def test_float_attribute_at_the_edge_of_its_range_keeps_its_value():
    # Up to half a step past the largest value rounds back to it (ties to even: f16's 65520
    # goes to inf, f8E4M3FN's 464 to 448); numpy and ml_dtypes agree.
    for value, elem in [("65519.99", "f16"), ("464.0", "f8E4M3FN"), ("3.4028235e38", "f32")]:
        f, node = _single_op(func_ir(_attr_line(f"{value} : {elem}")))
        assert f.attrs_of(node)["x.v"] == TypedFloat(float(value), elem)
        dtype = {"f16": np.float16, "f32": np.float32,
                 "f8E4M3FN": ml_dtypes.float8_e4m3fn}[elem]
        assert np.isfinite(float(np.float32(value).astype(dtype)))


@pytest.mark.parametrize("where", ["attr", "list", "typed"])
def test_integer_longer_than_4300_digits_is_a_located_error(where):
    digits = "7" * 4400
    value = {"attr": digits, "list": f"[{digits}]", "typed": f"{digits} : i64"}[where]
    line, col, msg = _error(func_ir(_attr_line(value)))
    assert (line, col) == (2, VALUE_COL + (where == "list"))
    assert msg == ("integer literal has 4400 digits; at most 4300 are supported (write larger "
                   "values in hexadecimal)")


def test_integer_past_the_decimal_limit_round_trips_in_hexadecimal():
    big = 7 ** 6000  # 5071 decimal digits
    f, node = _single_op(func_ir(_attr_line(hex(big))))
    assert f.attrs_of(node)["x.v"] == big
    printed = roundtrip(func_ir(_attr_line(hex(big))))
    assert f"x.v = {hex(big)}" in printed
    assert roundtrip(printed) == printed


@pytest.mark.parametrize("count, message", [
    ("9" * 4400, ("result count 9999999999999999999999999999999999999... is too large "
                 "(at most 4294967295)")),
    ("4294967296", "result count 4294967296 is too large (at most 4294967295)"),
])
def test_huge_result_count_is_a_located_error(count, message):
    for op in ('"x.split"(%x)', "x.split %x"):  # fast and general path
        text = func_ir(f"%r:{count} = {op} : (tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                       "return %x : tensor<2x3xf32>")
        assert _error(text) == (2, 3, message)
        assert _error(text, general=True) == (2, 3, message)


@pytest.mark.parametrize("t, message", [
    ("tensor<" + "1x" * 65 + "f32>", "has 65 dimensions; at most 64 are supported"),
    ("tensor<1180591620717411303424xf32>",
     "has more than 1152921504606846975 (2^60 - 1) elements"),
    ("tensor<" + "9" * 5000 + "xf32>", "has more than 1152921504606846975 (2^60 - 1) elements"),
    ("tensor<1073741824x1073741824xi8>", "has more than 1152921504606846975 (2^60 - 1) elements"),
    ("tensor<0x1180591620717411303424xf32>",
     "has more than 1152921504606846975 (2^60 - 1) elements"),
])
def test_tensor_type_too_large_is_a_located_error(t, message):
    text = func_ir("return %x : tensor<2x3xf32>", args=f"%y: {t}, %x: tensor<2x3xf32>")
    line, col, msg = _error(text)
    assert (line, col) == (1, len("func.func @f(%y: ") + 1)
    assert message in msg


def test_largest_tensor_type_parses():
    t = "tensor<1152921504606846975xi8>"
    m = parse(func_ir("return %x : tensor<2x3xf32>", args=f"%y: {t}, %x: tensor<2x3xf32>"))
    assert m.function().graph.nodes[m.function().args[0]]["types"][0].size == 2 ** 60 - 1


def test_attribute_nesting_deeper_than_the_limit_is_a_located_error():
    # The attribute dictionary is a level too: 63 arrays inside it are the most.
    parse(func_ir(_attr_line("[" * 63 + "]" * 63)))
    assert _error(func_ir(_attr_line("[" * 64 + "]" * 64))) == (
        2, VALUE_COL - len("{x.v = "), "attribute nesting is deeper than 64 levels")
    assert _error(func_ir(_attr_line("[" * 65 + "]" * 65))) == (  # the outermost bracket
        2, VALUE_COL, "attribute nesting is deeper than 64 levels")


@pytest.mark.parametrize("path", ["fast", "general"])
def test_duplicate_attribute_is_located_at_the_second_key(path):
    extra = ", x.z = [1]" if path == "general" else ""
    text = func_ir("%0 = mp.softmax %x {axis = 1, axis = 0" + extra + "} : "
                   "(tensor<2x3xf32>) -> tensor<2x3xf32>\nreturn %0 : tensor<2x3xf32>")
    assert _error(text) == (2, 33, "duplicate attribute 'axis'")


def test_quoted_and_keyword_attribute_names_are_names():
    f, node = _single_op(func_ir(
        '%0 = mp.relu %x {"a b" = 1, dense, true = 2, return, "x\\22q" = 3} : '
        "(tensor<2x3xf32>) -> tensor<2x3xf32>\nreturn %0 : tensor<2x3xf32>"))
    assert f.attrs_of(node) == {"a b": 1, "dense": UNIT, "true": 2, "return": UNIT, 'x"q': 3}


# ---- op forms ------------------------------------------------------------------------------

OP_LINES = [
    "%0 = mp.relu %x : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    '%0 = "mp.relu"(%x) : (tensor<2x3xf32>) -> tensor<2x3xf32>',
    "%0 = mp.add %x, %x : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>",
    '%0 = "mp.add"( %x , %x ) : ( tensor<2x3xf32> , tensor<2x3xf32> ) -> tensor<2x3xf32>',
    "%0 = mp.softmax %x {axis = -1 : i64} : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    ('%0 = mp.gelu %x {approximate = "tanh", mp.reason = "a\\"b"} : '
     "(tensor<2x3xf32>) -> tensor<2x3xf32>"),
    ("%0 = mp.relu %x {mp.precision = bf16, mp.flag, x.s = @sym, x.f = 1.5e-3 : f32} : "
     "(tensor<2x3xf32>) -> tensor<2x3xf32>"),
    "%0 = mp.relu %x {dense, true = false, attributes = 1} : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    "%0 = mp.constant {name = \"w\"} : () -> tensor<2x3xf32>",
    '%0 = "mp.constant"() {name = "w"} : () -> tensor<2x3xf32>',
    "%0 = mp.relu %x : (tensor<2x3xf32>) -> tensor<2x3xf32>  // trailing comment",
    "%0 = mp.relu %x\n    : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    "%0=mp.relu %x:(tensor<2x3xf32>)->tensor<2x3xf32>",
    "%0 = mp.reduce_sum %x {axes = [1], keepdims = false} : (tensor<2x3xf32>) -> tensor<2xf32>",
    ("%0 = mp.constant {value = dense<[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]> : tensor<2x3xf32>} : "
     "() -> tensor<2x3xf32>"),
]


@pytest.mark.parametrize("line", OP_LINES)
def test_fast_and_general_paths_build_equal_modules(line):
    text = func_ir(line + "\nreturn %x : tensor<2x3xf32>")
    fast, general = parse(text), parse_general(text)
    assert print_module(fast) == print_module(general)
    ff, gf = fast.function(), general.function()
    (a,), (b,) = ff.ops()[:-1], gf.ops()[:-1]
    assert ff.data(a)["attrs"] == gf.data(b)["attrs"]
    assert ff.data(a)["loc"] == gf.data(b)["loc"]


BAD_OP_LINES = [
    "%0 = mp.relu %y : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    "%0 = mp.relu %x, %x : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    "%0:2 = mp.relu %x : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    "%0:0 = mp.relu %x : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    "%x = mp.relu %x : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    "%0 = mp.relu %x : (tensor<3x2xf32>) -> tensor<2x3xf32>",
    "%0 = mp.relu %x : (tensor<2x3xf32>) -> f32",
    "%0 = mp.relu %x : (tensor<2x3xf33>) -> tensor<2x3xf32>",
    "%0 = mp.relu %x#0 : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    "%0 = mp.relu %x {a = dense} : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    "%0 = mp.relu %x {a = return} : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    "%0 = mp.relu %x {a = 1 : true} : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    "%0 = true %x : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    "%0 = dense %x : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    "%0 = mp.relu %x {a = 1, a = 2} : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    '%0 = mp.relu %x {"a\\q" = 1} : (tensor<2x3xf32>) -> tensor<2x3xf32>',
    '%0 = "mp.re\\lu"(%x) : (tensor<2x3xf32>) -> tensor<2x3xf32>',
    "%0 = mp.relu %x {a = 3 : f32} : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    "%0 = mp.relu %x {a = 0x7FC00000 : bf16} : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    "%r#1 = mp.relu %x : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    # two errors on one line: both paths report the same one first
    '%0 = mp.relu %x {a, a = "\\q"} : (tensor<2x3xf32>) -> tensor<2x3xf32>',
    '%0 = mp.relu %x {"\\q", b = f33} : (tensor<2x3xf32>) -> tensor<2x3xf32>',
    '%0 = "a\\qb"(%x) {a = f33} : (tensor<2x3xf32>) -> tensor<2x3xf32>',
    '%0 = "a\\qb"(%x) : (tensor<2x3xf33>) -> tensor<2x3xf32>',
]


@pytest.mark.parametrize("line", BAD_OP_LINES)
def test_fast_and_general_paths_report_the_same_error(line):
    text = func_ir(line + "\nreturn %x : tensor<2x3xf32>")
    assert _error(text) == _error(text, general=True)


_KEYS = ["a", "x.y", '"q k"', '"a\\22"', '"a\\q"', "dense", "true", "return", "module",
         "attributes", "func.func", "_$", '""', "a-b", "1a"]
_VALUES = ["1", "-0x1F", "0X1", "1.", "1.5e-3", ".5", "1e", "1 : i8", "1 : f32", "0x3C00 : f16",
           "0x7FC00000 : f16", "1.5 : bf16", "1.5 : i8", '"a\\"b"', '"\\q"', '""', "true",
           "dense", "return", "bf16", "f33", "@s", '@"q q"', "@a-b", "foo", "[1]", "{}",
           "tensor<2xf32>", "1 : tensor<2xf32>", "1 : true", "1.0e999", "%x"]
_NAMES = ["mp.relu", '"mp.relu"', '"a\\qb"', '"a\\"b"', "true", "dense", "return", "mp.x-y",
          '"func.return"', "1mp"]
_RESULTS = ["%0", "%r:1", "%r:2", "%r:0", "%r#1", "%a.b", "%-", "%"]
_OPERANDS = ["%x", "%x, %x", "", "%y", "%x#0", "%x,"]
_FUNCTYPES = ["(tensor<2xf32>) -> tensor<2xf32>", "() -> tensor<2xf32>",
              "(tensor<2xf32>, tensor<2xf32>) -> (tensor<2xf32>, tensor<2xf32>)",
              "(tensor<2xf32>) -> ()", "(tensor<2xf33>) -> tensor<2xf32>",
              "(tensor<2xf32>) -> f32", '(tensor<2xf32>) -> tensor<2xf32, "csr">']


@st.composite
def _op_lines(draw) -> str:
    name = draw(st.sampled_from(_NAMES))
    operands = draw(st.sampled_from(_OPERANDS))
    if name.startswith('"'):
        operands = f"({operands})"
    elif operands:
        operands = " " + operands
    entries = draw(st.lists(st.tuples(st.sampled_from(_KEYS), st.none() | st.sampled_from(
        _VALUES)), max_size=3))
    attrs = ""
    if entries or draw(st.booleans()):
        attrs = " {" + ", ".join(k if v is None else f"{k} = {v}" for k, v in entries) + "}"
    sp = draw(st.sampled_from([" ", "", "\t", "\n    ", " // c\n"]))
    return (f"{draw(st.sampled_from(_RESULTS))}{sp}={sp}{name}{operands}{attrs} :{sp}"
            f"{draw(st.sampled_from(_FUNCTYPES))}")


def _outcome(text: str, general: bool):
    try:
        return print_module(parse_general(text) if general else parse(text))
    except DiagnosticError as e:
        d = e.diagnostics[0]
        return d.loc.line, d.loc.col, d.message


@settings(max_examples=300, deadline=None)
@given(_op_lines())
def test_fast_and_general_paths_agree_on_random_op_lines(line):
    # Found: keyword attribute names, keyword op names and values, and the order of errors
    # (a bad value after a repeated name) all used to differ between the two paths.
    text = func_ir(line + "\nreturn %x : tensor<2xf32>", args="%x: tensor<2xf32>",
                   result="tensor<2xf32>")
    assert _outcome(text, general=False) == _outcome(text, general=True)


def test_keyword_attribute_names_agree_on_both_paths():
    # A keyword key used to be accepted by the fast path only: `{dense}` parsed, `{dense, y = [1]}`
    # was a syntax error.
    for attrs in ("{dense}", "{dense, x.y = [1]}", "{true = 1, module, func.func}"):
        text = func_ir(f"%0 = mp.relu %x {attrs} : (tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                       "return %0 : tensor<2x3xf32>")
        assert print_module(parse(text)) == print_module(parse_general(text))
        assert roundtrip(roundtrip(text)) == roundtrip(text)


def test_custom_and_generic_forms_build_the_same_module():
    custom = func_ir("%0 = mp.add %x, %x {x.k = [1, 2]} : "
                     "(tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                     "%1 = mp.relu %0 : (tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                     "return %1 : tensor<2x3xf32>")
    generic = func_ir('%0 = "mp.add"(%x, %x) {x.k = [1, 2]} : '
                      "(tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                      '%1 = "mp.relu"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>\n'
                      '"func.return"(%1) : (tensor<2x3xf32>) -> ()')
    assert roundtrip(custom) == roundtrip(generic)


def test_operands_become_edges_with_positions_and_result_indices():
    f = parse(func_ir("%0 = mp.sub %x, %y : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                      "return %0 : tensor<2x3xf32>",
                      args="%x: tensor<2x3xf32>, %y: tensor<2x3xf32>")).function()
    x, y = f.args
    sub, ret = f.ops()
    assert f.operands(sub) == [(x, 0), (y, 0)]
    assert f.operands(ret) == [(sub, 0)]
    assert f.op(x) == ARG and f.attrs_of(y) == {"index": 1}
    assert f.uses((x, 0)) == [(sub, 0)]


def test_multi_result_definition_and_hash_uses():
    text = func_ir('%r:2 = "x.split"(%x) : (tensor<2x3xf32>) -> (tensor<2x3xf32>, tensor<2x3xf32>)\n'
                   "%s = mp.add %r#1, %r#0 : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                   "return %s, %r#1 : tensor<2x3xf32>, tensor<2x3xf32>",
                   result="(tensor<2x3xf32>, tensor<2x3xf32>)")
    for m in (parse(text), parse_general(text)):
        f = m.function()
        split, add, ret = f.ops()
        assert len(f.types(split)) == 2
        assert f.operands(add) == [(split, 1), (split, 0)]
        assert f.operands(ret) == [(add, 0), (split, 1)]
        assert f.value_name((split, 1)) == "%r#1"
    out = roundtrip(text)
    assert '%r:2 = "x.split"(%x)' not in out  # an unknown op prints in custom form too
    assert "%r:2 = x.split %x : (tensor<2x3xf32>) -> (tensor<2x3xf32>, tensor<2x3xf32>)" in out
    assert "%s = mp.add %r#1, %r#0" in out
    assert "return %s, %r#1 : tensor<2x3xf32>, tensor<2x3xf32>" in out


@pytest.mark.parametrize("use, col, message", [
    ("%r#2", 16, "use of undefined value '%r#2': '%r' has 2 results, '%r#0' to '%r#1'"),
    ("%r", 16, "use of undefined value '%r': '%r' has 2 results, '%r#0' to '%r#1'"),
    ("%t#0", 16, "use of value '%t#0' before its definition"),
])
def test_bad_multi_result_use_is_located_at_the_use(use, col, message):
    text = func_ir('%r:2 = "x.split"(%x) : (tensor<2x3xf32>) -> (tensor<2x3xf32>, tensor<2x3xf32>)\n'
                   f"%s = mp.relu {use} : (tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                   "%t = mp.relu %x : (tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                   "return %s : tensor<2x3xf32>")
    assert _error(text) == (3, col, message)


def test_result_count_must_match_the_type():
    text = func_ir('%r:3 = "x.split"(%x) : (tensor<2x3xf32>) -> (tensor<2x3xf32>, tensor<2x3xf32>)\n'
                   "return %x : tensor<2x3xf32>")
    assert _error(text) == (2, 3, "'%r:3' defines 3 results but the op's type has 2")


def test_return_and_func_return_are_the_same_terminator():
    a = func_ir("return %x : tensor<2x3xf32>")
    b = func_ir("func.return %x : tensor<2x3xf32>")
    assert roundtrip(a) == roundtrip(b)
    assert "    return %x : tensor<2x3xf32>\n" in roundtrip(b)
    f = parse(b).function()
    assert f.op(f.return_node) == RETURN


def test_function_without_results_returns_nothing():
    f = parse("func.func @f(%x: tensor<2xf32>) {\n  return\n}\n").function()
    assert f.result_types == [] and f.operands(f.return_node) == []
    assert roundtrip("func.func @f(%x: tensor<2xf32>) {\n  return\n}\n") == (
        "module {\n  func.func @f(%x: tensor<2xf32>) {\n    return\n  }\n}\n")


def test_value_names_follow_mlir():
    text = func_ir("%x.1 = mp.relu %x : (tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                   "%fc1_out = mp.relu %x.1 : (tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                   "%a-b$ = mp.relu %fc1_out : (tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                   "%0 = mp.relu %a-b$ : (tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                   "return %0 : tensor<2x3xf32>")
    f = parse(text).function()
    assert [f.data(n)["name"] for n in f.ops()[:-1]] == ["x.1", "fc1_out", "a-b$", "0"]
    assert roundtrip(text).count("%a-b$") == 2


# ---- file structure ------------------------------------------------------------------------

def test_bare_functions_make_an_unnamed_module():
    text = func_ir("return %x : tensor<2x3xf32>", name="a") + func_ir(
        "return %x : tensor<2x3xf32>", name="b")
    m = parse(text)
    assert m.name is None and m.attrs == {}
    assert list(m.functions) == ["a", "b"]
    with pytest.raises(KeyError):
        m.function()  # several functions and none is main
    assert m.function("b").name == "b"


def test_module_name_and_attributes_are_kept():
    text = ('module @mlp attributes {mp.weights = "mlp.npz", x.n = 3} {\n'
            + func_ir("return %x : tensor<2x3xf32>", name="main") + "}\n")
    m = parse(text)
    assert m.name == "mlp" and m.attrs == {"mp.weights": "mlp.npz", "x.n": 3}
    assert m.function().name == "main"
    assert roundtrip(text).startswith('module @mlp attributes {mp.weights = "mlp.npz", x.n = 3} {\n')


def test_function_attributes_and_quoted_symbols_round_trip():
    text = ('module @"my module" {\n  func.func @"my func"(%x: tensor<2xf32>) -> tensor<2xf32> '
            'attributes {x.tag = "t", x.u} {\n    return %x : tensor<2xf32>\n  }\n}\n')
    m = parse(text)
    assert m.name == "my module"
    f = m.function()
    assert f.name == "my func" and f.attrs == {"x.tag": "t", "x.u": UNIT}
    assert roundtrip(text) == text


def test_module_and_bare_function_in_one_file_is_an_error():
    text = "module {\n}\n" + func_ir("return %x : tensor<2x3xf32>")
    assert _error(text) == (3, 1, "a file holds either one module or bare functions")


def test_two_modules_in_one_file_is_an_error_at_the_second():
    assert _error("module {\n}\nmodule @b {\n}\n") == (
        3, 1, "a file holds either one module or bare functions")


def test_cr_only_line_endings_are_line_breaks():
    text = ("// a model saved with old Mac line endings\n" + func_ir(
        "%0 = mp.relu %x : (tensor<2x3xf32>) -> tensor<2x3xf32>\nreturn %0 : tensor<2x3xf32>"))
    assert roundtrip(text.replace("\n", "\r")) == roundtrip(text)
    assert len(parse(text.replace("\n", "\r")).function().ops()) == 2
    bad = text.replace("relu %x", "relu %y").replace("\n", "\r")
    assert _error(bad) == (3, 16, "use of undefined value '%y'")


def test_missing_token_at_the_end_of_a_line_is_reported_after_the_previous_token():
    text = func_ir('%0 = "mp.relu"(%x)  // a comment: "here"\n\nreturn %0 : tensor<2x3xf32>')
    assert _error(text) == (2, 21, "expected ':', '{'; found 'return' on line 4")
    # On the same line the unexpected token itself is the place.
    text = func_ir('%0 = "mp.relu"(%x) return\nreturn %0 : tensor<2x3xf32>')
    assert _error(text) == (2, 22, "unexpected 'return'; expected ':', '{'")


def test_end_of_file_is_reported_after_the_last_token_not_a_trailing_comment():
    text = 'func.func @f(%x: tensor<2x3xf32>) -> tensor<2x3xf32> {\n  return %x\n// end\n'
    line, col, msg = _error(text)
    assert (line, col) == (2, 12)
    assert msg.startswith("unexpected end of file")


def test_crlf_line_endings_parse_like_lf():
    text = func_ir("%0 = mp.relu %x {x.a = 1} : (tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                   "return %0 : tensor<2x3xf32>")
    assert roundtrip(text.replace("\n", "\r\n")) == roundtrip(text)
    bad = text.replace("relu %x", "relu %y").replace("\n", "\r\n")
    assert _error(bad) == (2, 16, "use of undefined value '%y'")


def test_duplicate_function_is_located_at_its_second_definition():
    text = func_ir("return %x : tensor<2x3xf32>") * 2
    assert _error(text) == (4, 1, "redefinition of function @f")


@pytest.mark.parametrize("text", ["", "   \n\n\t\n", "// only a comment\n", "// a\n// b c\n//"])
def test_empty_input_is_an_empty_module(text):
    m = parse(text)
    assert m.functions == {} and m.name is None
    assert print_module(m) == "module {\n}\n"


def test_comments_are_skipped_everywhere():
    text = ("// %0 = mp.relu %x : not an op }\n"
            "func.func @f(%x: tensor<2xf32>) -> tensor<2xf32> { // { unbalanced\n"
            "  // return %x : tensor<2xf32>\n"
            "  %0 = mp.relu %x : (tensor<2xf32>) -> tensor<2xf32> // \"unterminated\n"
            "  %1 = mp.relu %0 {x.a = [1, // inside an attribute\n"
            "    2]} : (tensor<2xf32>) -> tensor<2xf32>\n"
            "  return %1 : tensor<2xf32> // $ stray\n"
            "}\n"
            "// trailing comment at the end of the file")
    f = parse(text).function()
    assert [f.op(n) for n in f.ops()] == ["mp.relu", "mp.relu", RETURN]
    assert f.attrs_of(f.ops()[1]) == {"x.a": (1, 2)}


def test_error_after_a_comment_names_the_bad_character_not_comment_text():
    text = "func.func @f() {\n  // a comment with words\n  $\n}\n"
    assert _error(text) == (3, 3, "unexpected character '$'")


def test_long_string_attribute_parses_on_both_paths():
    # The string pattern used to keep regex backtracking state per character: a 12 MB string
    # took 7 GB and half a minute.
    s = "ab\\\"" * 500_000
    text = func_ir(_attr_line(f'"{s}"'))
    for m in (parse(text), parse_general(text)):
        f = m.function()
        assert f.attrs_of(f.ops()[0])["x.v"] == 'ab"' * 500_000


def test_fast_path_patterns_never_give_whitespace_back():
    # A `\s*` that can give back spaces to another `\s*` after it makes a failed match of a
    # line with n spaces cost O(n^2): 128k spaces before an attribute dictionary took 19 s.
    # (No timing here: benchmarks/frontend.py --error-paths measures it.)
    for name in ("_SIMPLE_OP", "_TYPES", "_VALS", "_FUNCTYPE", "_SIMPLE_ATTRS"):
        pattern = getattr(parser_module, name)
        assert re.findall(r"\\s[*+](?!\+)", pattern) == [], name
    assert re.findall(r"\\s[*+](?!\+)", parser_module._ENTRY_RE.pattern) == []


@pytest.mark.parametrize("where", ["before-attributes", "between-operands", "in-attributes",
                                   "before-type"])
def test_long_runs_of_spaces_parse_the_same_on_both_paths(where):
    sp = " " * 128_000
    line = {"before-attributes": f"%0 = mp.add %x, %x{sp}{{x.a = [1]}} : {T2}",
            "between-operands": f"%0 = mp.add %x,{sp}%x {{x.a = 1}} : {T2}",
            "in-attributes": f"%0 = mp.add %x, %x {{x.a = 1{sp}, x.b = [2]}} : {T2}",
            "before-type": f"%0 = mp.add %x, %x {{x.a = 1}}{sp}: {T2}"}[where]
    text = func_ir(f"{line}\nreturn %0 : tensor<2x3xf32>")
    printed = print_module(parse(text))
    assert printed == print_module(parse_general(text))
    assert "%0 = mp.add %x, %x {x.a = " in printed


def test_split_source_keeps_line_offsets():
    text = "a\n// -----\nb\nc\n// ----- trailing\nd\n"
    chunks = split_source(text)
    assert [c for c, _ in chunks] == ["a\n", "\nb\nc\n", "\nd\n"]
    assert [o for _, o in chunks] == [0, 1, 4]
    for chunk, offset in chunks:  # chunk line k is file line k + offset
        for k, line in enumerate(chunk.split("\n"), start=1):
            if line:
                assert text.split("\n")[k + offset - 1] == line


def test_error_in_a_later_chunk_reports_the_file_line():
    good = func_ir("return %x : tensor<2x3xf32>")
    bad = func_ir("%0 = mp.relu %y : (tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                  "return %0 : tensor<2x3xf32>")
    text = good + "// -----\n" + good + "// -----\n" + bad
    chunks = split_source(text)
    parse(chunks[0][0], "t.ir", chunks[0][1])
    with pytest.raises(DiagnosticError) as e:
        parse(chunks[2][0], "t.ir", line_offset=chunks[2][1])
    loc = e.value.diagnostics[0].loc
    assert (loc.line, loc.col) == (10, 16)
    assert text.split("\n")[loc.line - 1].strip().startswith("%0 = mp.relu %y")


# ---- round trips ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_print_is_a_fixed_point(path):
    printed = roundtrip(path.read_text())
    assert roundtrip(printed) == printed
    assert print_module(parse(printed)) == print_module(parse(printed))  # deterministic


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_generic_form_reparses_to_the_same_custom_print(path):
    m = parse(path.read_text())
    generic = print_module(m, generic=True)
    assert '"mp.' in generic and '"func.return"' in generic
    assert print_module(parse(generic)) == print_module(m)
    assert print_module(parse(generic), generic=True) == generic


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_parses_the_same_on_the_general_path(path):
    text = path.read_text()
    assert print_module(parse_general(text)) == print_module(parse(text))


def test_unknown_discardable_attributes_survive_parse_print_and_passes():
    from mplower.pass_manager import PassManager, parse_pipeline

    attrs = ('{foo.bar = {deep = [1, "two", @three]}, mp.reason = "kept\\0A", '
             "vendor.flag, vendor.t = tensor<2xbf16>, vendor.n = 0x7FC00000 : f32}")
    text = func_ir(f"%0 = mp.relu %x {attrs} : (tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                   "return %0 : tensor<2x3xf32>")
    m = parse(text)
    PassManager(parse_pipeline("canonicalize,cse,dce")).run(m)
    out = print_module(m)
    assert f"%0 = mp.relu %x {attrs.replace('0A', 'n')}" in out


def test_general_path_switch_is_restored():
    import mplower.ir.parser as p

    before = p._MASTER
    with general_path():
        assert p._MASTER is not before
    assert p._MASTER is before
