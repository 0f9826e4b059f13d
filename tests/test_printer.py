"""The printer: exact MLIR spellings of values, names, ops and modules, in custom and generic form.

The last tests hand the generic form to upstream MLIR (`iree-opt --allow-unregistered-dialect`),
which is the contract the generic form exists for; they are skipped where iree-opt is missing.
"""

from __future__ import annotations

import math
import shutil
import subprocess

import numpy as np
import pytest
from conftest import EXAMPLES, func_ir, roundtrip

from mplower.ir.graph import Function, Module
from mplower.ir.parser import parse
from mplower.ir.printer import print_function, print_module
from mplower.ir.types import (
    UNIT,
    DenseAttr,
    SymbolRef,
    TypeAttr,
    TypedFloat,
    TypedInt,
    attr_to_str,
    float_bits_text,
    float_from_bits,
    format_float,
    quote,
    tensor,
)
from mplower.numerics.formats import FLOAT_FORMATS, FORMATS

F23 = tensor((2, 3), "f32")


@pytest.mark.parametrize("value, text", [
    (0.5, "0.5"),
    (1.0, "1.0"),
    (-0.0, "-0.0"),
    (1e-05, "1.0e-05"),
    (1.5e300, "1.5e+300"),
    (0.1, "0.1"),
    (123456789.0, "123456789.0"),
    (math.nan, "0x7FF8000000000000 : f64"),
    (math.inf, "0x7FF0000000000000 : f64"),
    (-math.inf, "0xFFF0000000000000 : f64"),
])
def test_untyped_float_prints_shortest_text_that_reads_back(value, text):
    assert attr_to_str(value) == text


@pytest.mark.parametrize("value, text", [
    (3, "3"), (-7, "-7"), (True, "true"), (False, "false"),
    ("a\"b\\c\nd\te\x01\x7f✓", '"a\\"b\\\\c\\nd\\te\\01\\7F✓"'),
    ((), "[]"), ((1, (2.5, "x"), ()), '[1, [2.5, "x"], []]'),
    ({"a": 1, "b c": UNIT, "d": {}}, '{a = 1, "b c", d = {}}'),
    (TypedInt(3, "i64"), "3 : i64"),
    (TypedFloat(0.5, "f32"), "0.5 : f32"),
    (TypedFloat(math.nan, "f16"), "0x7E00 : f16"),
    (TypedFloat(-math.inf, "bf16"), "0xFF80 : bf16"),
    (TypedFloat(math.inf, "f8E4M3FN"), "0x7F : f8E4M3FN"),  # no inf in that format: NaN
    (TypeAttr("bf16"), "bf16"), (TypeAttr(tensor((4,), "i8")), "tensor<4xi8>"),
    (SymbolRef("main"), "@main"),
    (SymbolRef("$x.y-1"), "@$x.y-1"),
    (SymbolRef("a b"), '@"a b"'),
    (SymbolRef("1st"), '@"1st"'),
])
def test_attribute_spelling(value, text):
    assert attr_to_str(value) == text


@pytest.mark.parametrize("elem", [f for f in FLOAT_FORMATS if FORMATS[f].has_nan])
def test_non_finite_bit_patterns_read_back_at_their_width(elem):
    nan = float_bits_text(math.nan, elem)
    assert math.isnan(float_from_bits(int(nan, 16), elem))
    for inf in (math.inf, -math.inf):
        value = float_from_bits(int(float_bits_text(inf, elem), 16), elem)
        if elem in ("f8E4M3FN", "f8E8M0FNU"):
            assert math.isnan(value)
        else:
            assert value == inf


@pytest.mark.parametrize("elem", ["f6E2M3FN", "f6E3M2FN", "f4E2M1FN", "f8E8M0FNU"])
def test_mx_bit_patterns_read_as_ml_dtypes_reads_them(elem):
    import ml_dtypes

    ref = {"f6E2M3FN": ml_dtypes.float6_e2m3fn, "f6E3M2FN": ml_dtypes.float6_e3m2fn,
           "f4E2M1FN": ml_dtypes.float4_e2m1fn, "f8E8M0FNU": ml_dtypes.float8_e8m0fnu}[elem]
    for code in range(1 << (8 if elem == "f8E8M0FNU" else FORMATS[elem].bits)):
        want = float(np.array(code, np.uint8).view(ref).astype(np.float64))
        got = float_from_bits(code, elem)
        assert (math.isnan(got) and math.isnan(want)) or got == want, (elem, code)
    # What a conversion does to the values these formats cannot hold (ml_dtypes):
    for x in (math.nan, math.inf, -math.inf):
        want = float(np.array(x, np.float32).astype(ref).astype(np.float64))
        got = float_from_bits(int(float_bits_text(x, elem), 16), elem)
        assert (math.isnan(got) and math.isnan(want)) or got == want, (elem, x)


def test_float_from_bits_agrees_with_numpy_for_f16_and_f32():
    for bits in (0x0000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0x8001, 0xC000):
        assert float_from_bits(bits, "f16") == float(np.array(bits, np.uint16).view(np.float16))
    for bits in (0x00000001, 0x00800000, 0x3F800000, 0x7F7FFFFF, 0xBF000000):
        assert float_from_bits(bits, "f32") == float(np.array(bits, np.uint32).view(np.float32))


@pytest.mark.parametrize("x, single, text", [
    (0.1, True, "0.1"),  # the float32 nearest 0.1 prints as 0.1 in an f32 literal
    (float(np.float32(0.1)), False, "0.10000000149011612"),
    (1e-40, True, "1.0e-40"),
])
def test_format_float_single_precision(x, single, text):
    assert format_float(x, single) == text


@pytest.mark.parametrize("array, t, text", [
    ([1.0, 1.0], tensor((2,), "f32"), "dense<1.0> : tensor<2xf32>"),
    ([[1, 2], [3, 4]], tensor((2, 2), "i32"), "dense<[[1, 2], [3, 4]]> : tensor<2x2xi32>"),
    ([True, False], tensor((2,), "i1"), "dense<[true, false]> : tensor<2xi1>"),
    ([], tensor((0,), "f32"), "dense<> : tensor<0xf32>"),
    (0.25, tensor((), "f64"), "dense<0.25> : tensor<f64>"),
    ([math.nan, 1.5], tensor((2,), "f16"), "dense<[0x7E00, 1.5]> : tensor<2xf16>"),
    ([math.inf, math.inf], tensor((2,), "f64"), "dense<0x7FF0000000000000> : tensor<2xf64>"),
])
def test_dense_spelling_nested_splat_and_non_finite(array, t, text):
    from mplower.ir.types import value_dtype

    attr = DenseAttr(np.array(array, value_dtype(t.elem)).reshape(t.shape), t)
    assert attr_to_str(attr) == text
    f = parse(func_ir(f"%0 = mp.relu %x {{x.d = {text}}} : (tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                      "return %0 : tensor<2x3xf32>")).function()
    assert f.attrs_of(f.ops()[0])["x.d"] == attr


@pytest.mark.parametrize("value, text", [
    (TypedFloat(1e300, "f32"), "0x7F800000 : f32"),
    (TypedFloat(-70000.0, "f16"), "0xFC00 : f16"),
    (TypedFloat(500.0, "f8E4M3FN"), "0x7F : f8E4M3FN"),  # no infinity: NaN, as a cast gives
    (TypedFloat(65519.0, "f16"), "65519.0 : f16"),  # rounds back to 65504: in range
    (DenseAttr(np.array([1.0, 3.4e38], np.float32), tensor((2,), "bf16")),
     "dense<[1.0, 0x7F80]> : tensor<2xbf16>"),
])
def test_api_built_float_past_its_type_prints_as_what_the_type_holds(value, text):
    # The parser refuses such a decimal; the type holds an infinity, and that is what prints.
    assert attr_to_str(value) == text
    f = parse(func_ir(f"%0 = mp.relu %x {{x.v = {text}}} : (tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                      "return %0 : tensor<2x3xf32>")).function()
    assert attr_to_str(f.attrs_of(f.ops()[0])["x.v"]) == text


def test_integer_past_the_decimal_limit_prints_in_hexadecimal():
    big = 3 ** 10000  # 4772 decimal digits: str() refuses it
    assert attr_to_str(big) == hex(big)
    assert attr_to_str(-big) == "-" + hex(big)
    assert attr_to_str((1, 10 ** 4299)) == f"[1, {10 ** 4299}]"


@pytest.mark.parametrize("name, text", [
    ("a", "a"), ("mp.precision", "mp.precision"), ("_x$1", "_x$1"),
    ("a b", '"a b"'), ("1st", '"1st"'), ("", '""'), ("q\"", '"q\\""'),
])
def test_attribute_names_are_quoted_only_when_needed(name, text):
    assert attr_to_str({name: 1}) == f"{{{text} = 1}}"


def test_quote_escapes_controls_as_two_hex_digits():
    assert quote("\x00\x1f\x7f\u00e9") == '"\\00\\1F\\7F\u00e9"'


def _mlp() -> Module:
    f = Function("main")
    x = f.add_arg("x", F23)
    w = f.append_op("mp.constant", [], {"name": "w"}, [tensor((3, 4), "f32")], "w")
    mm = f.append_op("mp.matmul", [(x, 0), (w, 0)], {}, [tensor((2, 4), "f32")], "0")
    r = f.append_op("mp.relu", [(mm, 0)], {"mp.precision": TypeAttr("bf16")},
                    [tensor((2, 4), "f32")], "1")
    f.append_op("return", [(r, 0), (x, 0)], {}, [])
    f.result_types = [tensor((2, 4), "f32"), F23]
    return Module(name="m", attrs={"mp.weights": "m.npz"}, functions={"main": f})


MLP_CUSTOM = """\
module @m attributes {mp.weights = "m.npz"} {
  func.func @main(%x: tensor<2x3xf32>) -> (tensor<2x4xf32>, tensor<2x3xf32>) {
    %w = mp.constant {name = "w"} : () -> tensor<3x4xf32>
    %0 = mp.matmul %x, %w : (tensor<2x3xf32>, tensor<3x4xf32>) -> tensor<2x4xf32>
    %1 = mp.relu %0 {mp.precision = bf16} : (tensor<2x4xf32>) -> tensor<2x4xf32>
    return %1, %x : tensor<2x4xf32>, tensor<2x3xf32>
  }
}
"""

MLP_GENERIC = """\
module @m attributes {mp.weights = "m.npz"} {
  func.func @main(%x: tensor<2x3xf32>) -> (tensor<2x4xf32>, tensor<2x3xf32>) {
    %w = "mp.constant"() {name = "w"} : () -> tensor<3x4xf32>
    %0 = "mp.matmul"(%x, %w) : (tensor<2x3xf32>, tensor<3x4xf32>) -> tensor<2x4xf32>
    %1 = "mp.relu"(%0) {mp.precision = bf16} : (tensor<2x4xf32>) -> tensor<2x4xf32>
    "func.return"(%1, %x) : (tensor<2x4xf32>, tensor<2x3xf32>) -> ()
  }
}
"""


def test_module_built_with_the_api_prints_custom_form_exactly():
    assert print_module(_mlp()) == MLP_CUSTOM


def test_module_built_with_the_api_prints_generic_form_exactly():
    assert print_module(_mlp(), generic=True) == MLP_GENERIC


def test_printed_api_module_parses_back_to_the_same_text():
    assert roundtrip(MLP_CUSTOM) == MLP_CUSTOM
    assert print_module(parse(MLP_GENERIC), generic=True) == MLP_GENERIC


def test_function_without_results_and_with_attributes():
    f = Function("g")
    f.attrs = {"x.tag": "t"}
    f.append_op("return", [], {}, [])
    assert print_function(f) == '  func.func @g() attributes {x.tag = "t"} {\n    return\n  }'
    assert print_function(f, generic=True).split("\n")[1] == '    "func.return"() : () -> ()'


def test_multi_result_op_prints_count_and_hash_uses():
    f = Function("f")
    x = f.add_arg("x", F23)
    s = f.append_op("x.split", [(x, 0)], {}, [F23, F23], "r")
    a = f.append_op("mp.add", [(s, 1), (s, 0)], {}, [F23], "a")
    f.append_op("return", [(a, 0)], {}, [])
    f.result_types = [F23]
    lines = print_function(f).split("\n")
    assert lines[1] == "    %r:2 = x.split %x : (tensor<2x3xf32>) -> (tensor<2x3xf32>, tensor<2x3xf32>)"
    assert lines[2].startswith("    %a = mp.add %r#1, %r#0 :")


def test_symbol_names_are_quoted_when_not_bare():
    m = Module(name="a b", functions={"f-1": Function("f-1")})
    m.functions["f-1"].append_op("return", [], {}, [])
    out = print_module(m)
    assert out.startswith('module @"a b" {\n  func.func @"f-1"() {')
    assert roundtrip(out) == out


def test_empty_module_prints_module_braces():
    assert print_module(Module()) == "module {\n}\n"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_printing_twice_gives_identical_text(path):
    m = parse(path.read_text())
    assert print_module(m) == print_module(m)
    assert print_module(m, generic=True) == print_module(m, generic=True)


# ---- upstream MLIR accepts the generic form --------------------------------------------------

IREE_OPT = shutil.which("iree-opt")
needs_iree = pytest.mark.skipif(IREE_OPT is None, reason="iree-opt is not on PATH")


def _iree_accepts(text: str) -> subprocess.CompletedProcess:
    return subprocess.run([IREE_OPT, "--allow-unregistered-dialect", "-"], input=text,
                          capture_output=True, text=True, timeout=120, check=False)


def _chain(n: int) -> str:
    body = []
    prev = "%x"
    for i in range(n):
        op = "mp.add" if i % 2 == 0 else "mp.mul"
        body.append(f"%{i} = {op} {prev}, %y : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x8xf32>")
        prev = f"%{i}"
    body.append(f"return {prev} : tensor<4x8xf32>")
    return func_ir("\n".join(body), args="%x: tensor<4x8xf32>, %y: tensor<8xf32>",
                   result="tensor<4x8xf32>", name="main")


@needs_iree
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_upstream_mlir_accepts_generic_form_of_example(path):
    proc = _iree_accepts(print_module(parse(path.read_text()), generic=True))
    assert proc.returncode == 0, proc.stderr
    assert '"mp.' in proc.stdout


@needs_iree
def test_upstream_mlir_accepts_generic_form_of_an_add_mul_chain():
    proc = _iree_accepts(print_module(parse(_chain(200)), generic=True))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count('"mp.add"') == 100 and proc.stdout.count('"mp.mul"') == 100


@needs_iree
def test_upstream_mlir_accepts_every_attribute_kind_in_generic_form():
    attrs = ('{x.i = 3, x.ti = -1 : i8, x.f = 0.5, x.tf = 1.5 : bf16, x.nan = 0x7E00 : f16, '
             'x.inf = 0x7FF0000000000000 : f64, x.s = "q\\"\\n\\01", x.b = true, x.u, '
             'x.t = bf16, x.tt = tensor<2xf32>, x.a = [1, [2.5, "z"]], x.sym = @main, '
             'x.d = dense<[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]> : tensor<2x3xf32>, '
             'x.dn = dense<[0x7E00, 1.0]> : tensor<2xf16>, x.dict = {k = 1}, '
             'dense, "a b" = 1}')
    text = func_ir(f"%0 = mp.relu %x {attrs} : (tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                   "return %0 : tensor<2x3xf32>",
                   args='%x: tensor<2x3xf32>, %s: tensor<4x4xbf16, "2:4">')
    proc = _iree_accepts(print_module(parse(text), generic=True))
    assert proc.returncode == 0, proc.stderr
