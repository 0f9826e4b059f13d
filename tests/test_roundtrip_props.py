"""Property tests on generated programs: round trips, both builders agree, passes are idempotent.

The strategy draws a random DAG of mp ops with consistent shapes (elementwise ops with numpy
broadcasting, matmul, transpose, reshape, reductions, softmax, concat, small inline constants)
and random discardable attributes of every kind. Result shapes are computed here with numpy, not
with the op definitions, so that verification checks the ops' shape rules too. Each program is
written as text (custom or generic form per op) and built through the Function API; attribute
texts are spelled here, independently of the printer, next to the value they must parse to.
Literals a type cannot hold (integers longer than Python converts, floats past a type's range,
dense elements outside their element type) must be refused where they are written, on both
parse paths. `HYPOTHESIS_PROFILE=deep` runs every property at 5,000 examples (conftest.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from conftest import examples, func_ir, parse_general
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import Function, Module
from mplower.ir.parser import parse
from mplower.ir.printer import print_module
from mplower.ir.types import (
    UNIT,
    DenseAttr,
    SymbolRef,
    TensorType,
    TypeAttr,
    TypedFloat,
    TypedInt,
    tensor,
)
from mplower.ir.verifier import verify
from mplower.pass_manager import PassManager, parse_pipeline

SETTINGS = settings(max_examples=examples(120), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass
class Op:
    name: str
    op: str
    operands: list[str]
    type: TensorType
    attrs: list[tuple[str, str, Any]] = field(default_factory=list)  # (key, text, value)
    generic: bool = False


@dataclass
class Program:
    args: list[tuple[str, TensorType]]
    ops: list[Op]
    results: list[str]
    module: tuple[str | None, list[tuple[str, str, Any]]] | None  # name, attrs; None: bare

    def types(self) -> dict[str, TensorType]:
        return dict(self.args) | {o.name: o.type for o in self.ops}


# ---- attribute texts and values ------------------------------------------------------------

def _escape(s: str, hex_chars: set[int]) -> str:
    out = []
    for i, ch in enumerate(s):
        if ch == '"' or ch == "\\":
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F or (i in hex_chars and ord(ch) < 0x80):
            out.append(f"\\{ord(ch):02X}" if i % 2 else f"\\{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


@st.composite
def strings(draw) -> tuple[str, str]:
    s = draw(st.text(st.characters(exclude_categories=("Cs",)), max_size=10))
    hexed = draw(st.sets(st.integers(0, max(len(s) - 1, 0)), max_size=3))
    return _escape(s, hexed), s


def _float_text(x: float) -> str:
    return repr(x)  # repr of a finite float always reads back as the same float


NON_FINITE = [  # (bits text, type, value), spelled at the type's width as MLIR does
    ("0x7FC00000", "f32", math.nan), ("0x7F800000", "f32", math.inf),
    ("0xFF800000", "f32", -math.inf), ("0x7E00", "f16", math.nan), ("0x7C00", "f16", math.inf),
    ("0x7FC0", "bf16", math.nan), ("0xFF80", "bf16", -math.inf),
    ("0x7FF8000000000000", "f64", math.nan), ("0x7FF0000000000000", "f64", math.inf),
    ("0x7F", "f8E4M3FN", math.nan), ("0x7C", "f8E5M2", math.inf),
]
FLOAT_TYPES = ("f64", "f32", "tf32", "f16", "bf16", "f8E4M3FN", "f8E5M2")
# Each float type's numpy (ml_dtypes) dtype, the reference for what it can hold; TF32 has none:
# it is f32's exponent with 10 fraction bits, so its largest value is (2 - 2^-10) * 2^127.
FLOAT_DTYPES = {"f64": np.float64, "f32": np.float32, "f16": np.float16,
                "bf16": ml_dtypes.bfloat16, "f8E4M3FN": ml_dtypes.float8_e4m3fn,
                "f8E5M2": ml_dtypes.float8_e5m2}
FLOAT_MAX = {t: float(ml_dtypes.finfo(d).max) for t, d in FLOAT_DTYPES.items()} | {
    "tf32": (2 - 2 ** -10) * 2.0 ** 127}
finite = st.floats(allow_nan=False, allow_infinity=False)
INT_DIGITS = 4300  # Python's default limit on decimal int conversions (sys.int_max_str_digits)

scalar_attrs = st.one_of(
    st.integers(-2 ** 40, 2 ** 40).map(lambda i: (str(i), i)),
    st.integers(-2 ** 200, 2 ** 200).map(lambda i: (str(i), i)),  # past 2^64: no fixed width
    st.integers(0, 2 ** 31).map(lambda i: (hex(i), i)),
    # Past the decimal limit an integer is written (and printed) in hexadecimal.
    st.tuples(st.integers(10 ** INT_DIGITS, 2 ** 14400), st.booleans()).map(
        lambda p: (hex(-p[0]) if p[1] else hex(p[0]), -p[0] if p[1] else p[0])),
    st.tuples(st.integers(-128, 127), st.sampled_from(("i8", "i32", "i64", "index"))).map(
        lambda p: (f"{p[0]} : {p[1]}", TypedInt(*p))),
    finite.map(lambda x: (_float_text(x), x)),
    st.sampled_from(FLOAT_TYPES).flatmap(lambda t: st.floats(-FLOAT_MAX[t], FLOAT_MAX[t]).map(
        lambda x: (f"{_float_text(x)} : {t}", TypedFloat(x, t)))),
    st.sampled_from(NON_FINITE).map(lambda p: (f"{p[0]} : {p[1]}", TypedFloat(p[2], p[1]))),
    strings(),
    st.sampled_from([("true", True), ("false", False)]),
    st.sampled_from(["bf16", "f32", "i8", "f8E4M3FN", "index"]).map(lambda t: (t, TypeAttr(t))),
    st.sampled_from(["tensor<2x3xf32>", 'tensor<4x4xbf16, "2:4">']).map(
        lambda t: (t, TypeAttr(tensor((2, 3), "f32") if "2x3" in t
                               else tensor((4, 4), "bf16", "2:4")))),
    st.from_regex(r"[a-z_][a-z0-9_.$]{0,6}", fullmatch=True).map(lambda s: (f"@{s}", SymbolRef(s))),
    st.from_regex(r"[ a-z0-9_.$@#-]{0,6}", fullmatch=True).map(
        lambda s: (f'@"{s}"', SymbolRef(s))),
)


def _arrays(children):
    return st.lists(children, max_size=4).map(
        lambda items: ("[" + ", ".join(t for t, _ in items) + "]", tuple(v for _, v in items)))


@st.composite
def _dicts(draw, children):
    keys = draw(st.lists(st.from_regex(r"[a-z][a-z0-9_]{0,4}", fullmatch=True), max_size=3,
                         unique=True))
    parts, value = [], {}
    for k in keys:
        if draw(st.booleans()):
            parts.append(k)
            value[k] = UNIT
        else:
            t, v = draw(children)
            parts.append(f"{k} = {t}")
            value[k] = v
    return "{" + ", ".join(parts) + "}", value


attr_values = st.recursive(scalar_attrs, lambda c: st.one_of(_arrays(c), _dicts(c)),
                           max_leaves=6)


@st.composite
def discardable_attrs(draw) -> list[tuple[str, str, Any]]:
    keys = draw(st.lists(st.from_regex(r"(mp|x|vendor)\.[a-z][a-z0-9_]{0,5}", fullmatch=True),
                         max_size=3, unique=True))
    out = []
    for k in keys:
        if draw(st.integers(0, 5)) == 0:
            out.append((k, k, UNIT))
        else:
            text, value = draw(attr_values)
            out.append((k, f"{k} = {text}", value))
    return out


# ---- programs ------------------------------------------------------------------------------

dims = st.integers(1, 4)
shapes = st.lists(dims, min_size=0, max_size=3).map(tuple)


def _dense(draw, shape: tuple[int, ...], elem: str) -> tuple[str, DenseAttr]:
    size = math.prod(shape)
    t = tensor(shape, elem)
    vals = st.floats(-100, 100, width=32)
    if size > 8 or draw(st.booleans()):
        v = draw(vals)
        array = np.full(shape, v, np.float32)
        return f"dense<{_float_text(float(v))}> : {t}", DenseAttr(array, t)
    flat = draw(st.lists(vals, min_size=size, max_size=size))
    array = np.array(flat, np.float32).reshape(shape)

    def nested(a: np.ndarray) -> str:
        if a.ndim == 0:
            return _float_text(float(a))
        return "[" + ", ".join(nested(x) for x in a) + "]"

    return f"dense<{nested(array)}> : {t}", DenseAttr(array, t)


UNARY = ("mp.relu", "mp.neg", "mp.exp", "mp.tanh", "mp.sigmoid", "mp.sqrt", "mp.log",
         "mp.rsqrt")
BINARY = ("mp.add", "mp.sub", "mp.mul", "mp.div", "mp.maximum", "mp.minimum")
KINDS = ("unary", "binary", "binary", "constant", "matmul", "transpose", "reshape", "reduce",
         "softmax", "concat")


@st.composite
def programs(draw) -> Program:
    elem = draw(st.sampled_from(("f32", "f32", "f16", "bf16")))
    args = [(f"a{i}", tensor(draw(shapes), elem)) for i in range(draw(st.integers(1, 3)))]
    ops: list[Op] = []
    values = dict(args)
    counter = iter(range(10 ** 6))

    def fresh() -> str:
        i = next(counter)
        return str(i) if i % 3 else f"v{i}.x"

    def const(shape: tuple[int, ...]) -> str:
        text, value = _dense(draw, shape, elem)
        name = fresh()
        ops.append(Op(name, "mp.constant", [], tensor(shape, elem),
                      [("value", f"value = {text}", value)]))
        values[name] = tensor(shape, elem)
        return name

    def pick(pred=lambda t: True) -> str | None:
        names = [n for n, t in values.items() if pred(t)]
        return draw(st.sampled_from(names)) if names else None

    for _ in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(KINDS))
        x = pick()
        xs = values[x].shape
        attrs: list[tuple[str, str, Any]] = []
        if kind == "unary":
            op, operands, out = draw(st.sampled_from(UNARY)), [x], xs
        elif kind == "binary":
            if draw(st.booleans()):
                other = [d if draw(st.integers(0, 2)) else 1 for d in xs]
                other = tuple(other[draw(st.integers(0, len(other))):])
                y = const(other)
            else:
                y = pick(lambda t, xs=xs: _broadcasts(t.shape, xs)) or x
            operands = [x, y] if draw(st.booleans()) else [y, x]
            op = draw(st.sampled_from(BINARY))
            out = np.broadcast_shapes(values[operands[0]].shape, values[operands[1]].shape)
        elif kind == "constant":
            const(draw(shapes))
            continue
        elif kind == "matmul":
            if len(xs) < 2:
                continue
            b = const((xs[-1], draw(dims)))
            op, operands = "mp.matmul", [x, b]
            out = np.matmul(np.zeros(xs), np.zeros(values[b].shape)).shape
        elif kind == "transpose":
            perm = tuple(draw(st.permutations(range(len(xs)))))
            op, operands, out = "mp.transpose", [x], tuple(xs[p] for p in perm)
            attrs.append(("perm", f"perm = [{', '.join(map(str, perm))}]", perm))
        elif kind == "reshape":
            size = math.prod(xs)
            out = draw(st.sampled_from([(size,), tuple(reversed(xs)), (1, *xs), xs]))
            op, operands = "mp.reshape", [x]
        elif kind == "reduce":
            if not xs:
                continue
            axes = draw(st.lists(st.integers(0, len(xs) - 1), min_size=1, unique=True))
            spelled = [a - len(xs) if draw(st.booleans()) else a for a in axes]
            keep = draw(st.booleans())
            op = draw(st.sampled_from(("mp.reduce_sum", "mp.reduce_mean", "mp.reduce_max")))
            operands = [x]
            out = np.sum(np.zeros(xs), axis=tuple(axes), keepdims=keep).shape
            attrs.append(("axes", f"axes = [{', '.join(map(str, spelled))}]", tuple(spelled)))
            attrs.append(("keepdims", f"keepdims = {'true' if keep else 'false'}", keep))
        elif kind == "softmax":
            if not xs:
                continue
            axis = draw(st.integers(-len(xs), len(xs) - 1))
            op, operands, out = "mp.softmax", [x], xs
            attrs.append(("axis", f"axis = {axis}", axis))
        else:  # concat
            if not xs:
                continue
            axis = draw(st.integers(0, len(xs) - 1))
            other = list(xs)
            other[axis] = draw(dims)
            y = const(tuple(other)) if draw(st.booleans()) else x
            op, operands = "mp.concat", [x, y]
            out = np.concatenate([np.zeros(xs), np.zeros(values[y].shape)], axis=axis).shape
            attrs.append(("axis", f"axis = {axis}", axis))
        attrs += draw(discardable_attrs())
        name = fresh()
        t = tensor(tuple(out), elem)
        ops.append(Op(name, op, operands, t, attrs, generic=draw(st.booleans())))
        values[name] = t
    last = ops[-1].name if ops else args[0][0]
    results = [last] + ([args[0][0]] if draw(st.booleans()) else [])
    module = None
    if draw(st.booleans()):
        module = (draw(st.one_of(st.none(), st.from_regex(r"[a-z]{1,5}", fullmatch=True))),
                  draw(discardable_attrs()))
    return Program(args, ops, results, module)


def _broadcasts(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    try:
        np.broadcast_shapes(a, b)
    except ValueError:
        return False
    return True


def to_text(p: Program) -> str:
    types = p.types()
    lines = []
    for o in p.ops:
        ins = ", ".join(str(types[n]) for n in o.operands)
        attrs = " {" + ", ".join(t for _, t, _ in o.attrs) + "}" if o.attrs else ""
        operands = ", ".join(f"%{n}" for n in o.operands)
        if o.generic:
            lines.append(f'%{o.name} = "{o.op}"({operands}){attrs} : ({ins}) -> {o.type}')
        else:
            sep = " " if operands else ""
            lines.append(f"%{o.name} = {o.op}{sep}{operands}{attrs} : ({ins}) -> {o.type}")
    rtypes = [str(types[n]) for n in p.results]
    lines.append(f"return {', '.join('%' + n for n in p.results)} : {', '.join(rtypes)}")
    args = ", ".join(f"%{n}: {t}" for n, t in p.args)
    result = rtypes[0] if len(rtypes) == 1 else f"({', '.join(rtypes)})"
    func = f"func.func @main({args}) -> {result} {{\n" + "".join(
        f"  {line}\n" for line in lines) + "}\n"
    if p.module is None:
        return func
    name, attrs = p.module
    head = "module" + (f" @{name}" if name else "")
    if attrs:
        head += " attributes {" + ", ".join(t for _, t, _ in attrs) + "}"
    return f"{head} {{\n{func}}}\n"


def to_module(p: Program) -> Module:
    f = Function("main")
    nodes: dict[str, int] = {}
    for n, t in p.args:
        nodes[n] = f.add_arg(n, t)
    for o in p.ops:
        nodes[o.name] = f.append_op(o.op, [(nodes[n], 0) for n in o.operands],
                                    {k: v for k, _, v in o.attrs}, [o.type], o.name)
    f.append_op("return", [(nodes[n], 0) for n in p.results], {}, [])
    types = p.types()
    f.result_types = [types[n] for n in p.results]
    m = Module(functions={"main": f})
    if p.module is not None:
        m.name, m.attrs = p.module[0], {k: v for k, _, v in p.module[1]}
    return m


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, TypedFloat) and isinstance(b, TypedFloat):
        return a.type == b.type and _same(a.value, b.value)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _run(m: Module, pipeline: str) -> str:
    PassManager(parse_pipeline(pipeline)).run(m)  # verifies after each pass
    return print_module(m)


# ---- properties ----------------------------------------------------------------------------

@SETTINGS
@given(programs())
def test_generated_module_verifies_and_its_print_is_a_fixed_point(p):
    m = parse(to_text(p))
    verify(m)
    printed = print_module(m)
    assert print_module(parse(printed)) == printed
    assert print_module(m) == printed  # printing twice is identical


@SETTINGS
@given(programs())
def test_text_api_and_general_path_build_the_same_module(p):
    text = to_text(p)
    expected = print_module(to_module(p))
    assert print_module(parse(text)) == expected
    assert print_module(parse_general(text)) == expected


@SETTINGS
@given(programs())
def test_attributes_parse_to_the_values_they_spell(p):
    m = parse(to_text(p))
    f = m.function()
    for o, n in zip(p.ops, f.ops()):
        assert f.data(n)["name"] == o.name and f.op(n) == o.op
        got = f.attrs_of(n)
        assert list(got) == [k for k, _, _ in o.attrs]
        for k, _, v in o.attrs:
            assert _same(got[k], v), (k, got[k], v)
    if p.module is not None:
        assert m.name == p.module[0]
        assert _same(m.attrs, {k: v for k, _, v in p.module[1]})


@SETTINGS
@given(programs())
def test_generic_form_reparses_to_the_same_custom_print(p):
    m = parse(to_text(p))
    generic = print_module(m, generic=True)
    assert print_module(parse(generic)) == print_module(m)
    assert print_module(parse(generic), generic=True) == generic


@settings(SETTINGS, max_examples=examples(80))
@given(programs())
def test_canonicalize_output_verifies_and_is_idempotent(p):
    m = parse(to_text(p))
    once = _run(m, "canonicalize")
    assert _run(m, "canonicalize") == once
    again = parse(once)
    verify(again)
    assert print_module(again) == once
    assert _run(again, "canonicalize") == once


@settings(SETTINGS, max_examples=examples(80))
@given(programs(), st.sampled_from(["dce", "cse", "cse,dce"]))
def test_dce_and_cse_are_idempotent(p, pipeline):
    m = parse(to_text(p))
    once = _run(m, pipeline)
    assert _run(m, pipeline) == once
    assert _run(parse(once), pipeline) == once
    dead_free = {f.data(n)["name"] for f in m.functions.values() for n in f.ops()}
    if "dce" in pipeline:  # every op left is used by something
        f = m.function()
        assert all(f.has_uses(n) for n in f.ops()[:-1]), dead_free


# ---- literals a type cannot hold -------------------------------------------------------------

INT_TYPES = {"i8": np.int8, "ui8": np.uint8, "i32": np.int32, "i4": ml_dtypes.int4}


def _int_range(elem: str) -> tuple[int, int]:
    if elem == "i1":
        return 0, 1
    info = (ml_dtypes.iinfo if elem == "i4" else np.iinfo)(INT_TYPES[elem])
    return int(info.min), int(info.max)


def _too_big(t: str):
    """Finite values the float type `t` cannot hold: past its largest value by more than the
    rounding margin (half a step at the top is at most 1/14 of the largest value, f8E5M2's)."""
    return st.floats(1.25 * FLOAT_MAX[t], FLOAT_MAX["f64"]).flatmap(
        lambda x: st.sampled_from([x, -x]))


@st.composite
def bad_literals(draw) -> tuple[str, int, str]:
    """(attribute text, offset of the bad literal in it, start of the expected message)."""
    kind = draw(st.sampled_from(("long-int", "typed-float", "dense-int", "dense-float")))
    if kind == "long-int":
        digits = draw(st.integers(INT_DIGITS + 1, INT_DIGITS + 200))
        sign = draw(st.sampled_from(["", "-"]))
        text = sign + "1" + "0" * (digits - 1)
        before = draw(st.sampled_from(["", "[", "[1, "]))  # an array goes the general path
        return (before + text + ("]" if before else ""), len(before),
                f"integer literal has {digits} digits; at most {INT_DIGITS} are supported")
    if kind == "typed-float":
        t = draw(st.sampled_from(FLOAT_TYPES[1:]))  # any finite double is an f64
        x = draw(_too_big(t))
        if t in FLOAT_DTYPES:  # the reference agrees that the type cannot hold it
            with np.errstate(over="ignore"):
                assert not np.isfinite(float(np.array(x).astype(np.float32).astype(
                    FLOAT_DTYPES[t])))
        return f"{_float_text(x)} : {t}", 0, f"{_float_text(x)} is out of range for {t}"
    n = draw(st.integers(1, 6))
    at = draw(st.integers(0, n - 1))
    if kind == "dense-int":
        elem = draw(st.sampled_from(["i8", "ui8", "i32", "i4", "i1"]))
        lo, hi = _int_range(elem)
        vals = [str(v) for v in draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))]
        bad = draw(st.one_of(st.integers(hi + 1, 2 ** 70), st.integers(-2 ** 70, lo - 1)))
        vals[at] = str(bad)
        msg = f"integer value {bad} is out of range for {elem} (range [{lo}, {hi}])"
    else:
        elem = draw(st.sampled_from(["f32", "f16", "bf16", "f8E4M3FN", "f8E5M2"]))
        vals = [_float_text(v) for v in draw(st.lists(
            st.floats(-FLOAT_MAX[elem], FLOAT_MAX[elem]), min_size=n, max_size=n))]
        vals[at] = _float_text(draw(_too_big(elem)))
        msg = f"{vals[at]} is out of range for {elem}"
    head = "dense<["
    offset = len(head) + sum(len(v) + 2 for v in vals[:at])
    return f"{head}{', '.join(vals)}]> : tensor<{n}x{elem}>", offset, msg


@settings(SETTINGS, max_examples=examples(120))
@given(bad_literals(), st.booleans())
def test_a_literal_its_type_cannot_hold_is_refused_where_it_is_written(bad, general):
    text, offset, message = bad
    prefix = "%0 = mp.relu %x {x.v = "
    src = func_ir(f"{prefix}{text}}} : (tensor<2x3xf32>) -> tensor<2x3xf32>\n"
                  "return %0 : tensor<2x3xf32>")
    with pytest.raises(DiagnosticError) as e:
        parse_general(src) if general else parse(src)
    d = e.value.diagnostics[0]
    assert (d.loc.line, d.loc.col) == (2, len("  " + prefix) + offset + 1)
    assert d.message.startswith(message), d.message
