"""Malformed inputs through `mplower opt`: one located diagnostic each, exit 1, no traceback.

Every case pins the exact line and column, a fragment of the message, the source line (or the
window of a long line) and a caret under that column, and that the `-o` file written before the
run is untouched with no temporary file left beside it. A few cases also run the installed
console script to prove that no Python traceback reaches the user.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import func_ir

from mplower.ir.diagnostics import Diagnostic, DiagnosticError, Location, SourceText
from mplower.ir.graph import Function, Module
from mplower.ir.types import tensor
from mplower.ir.verifier import verify

T = "tensor<2x3xf32>"
OP = f"({T}) -> {T}"
RET = f"return %0 : {T}"


@dataclass(frozen=True)
class Case:
    id: str
    source: str | bytes
    line: int
    at: str | None  # the text the caret points at on that line (its first occurrence); None: EOF
    message: str
    nth: int = 1  # which occurrence of `at` on the line

    @property
    def data(self) -> bytes:
        return self.source if isinstance(self.source, bytes) else self.source.encode()

    def column(self) -> int:
        line = self.data.split(b"\n")[self.line - 1].decode("utf-8", "replace")
        if self.at is None:  # end of input: one past the last character
            return len(line.rstrip()) + 1
        i = -1
        for _ in range(self.nth):
            i = line.index(self.at, i + 1)
        return i + 1


DEEP = 20_000
BIG = 12_000_000
LONG_NUMBER = "1." + "0" * 2990 + "1"
N_LONG = BIG // (len(LONG_NUMBER) + 2)
BIG_STRING = "s" * BIG

CASES = [
    Case("truncated-file", func_ir(f"%0 = mp.relu %x : {OP}").rsplit("}", 1)[0], 2, None,
         "unexpected end of file"),
    Case("truncated-mid-type", f"func.func @f(%x: {T}) -> {T} {{\n  %0 = mp.relu %x : ({T}) ->",
         2, None, "unexpected end of file; expected '(', a tensor type, an identifier"),
    Case("unknown-op", func_ir(f"%0 = mp.rleu %x : {OP}\n{RET}"), 2, "%0",
         "unknown operation 'mp.rleu'; did you mean 'mp.relu'?"),
    Case("unknown-op-generic", func_ir(f'%0 = "mp.sigmod"(%x) : {OP}\n{RET}'), 2, "%0",
         "unknown operation 'mp.sigmod'; did you mean 'mp.sigmoid'?"),
    Case("undefined-value", func_ir(f"%0 = mp.relu %y : {OP}\n{RET}"), 2, "%y",
         "use of undefined value '%y'"),
    Case("undefined-value-in-return", func_ir(f"return %nope : {T}"), 2, "%nope",
         "use of undefined value '%nope'"),
    Case("redefined-value", func_ir(f"%0 = mp.relu %x : {OP}\n%0 = mp.neg %x : {OP}\n{RET}"),
         3, "%0", "redefinition of value '%0'"),
    Case("redefined-argument", func_ir(f"%x = mp.relu %x : {OP}\nreturn %x : {T}"), 2, "%x",
         "redefinition of value '%x'"),
    Case("use-before-definition",
         func_ir(f"%0 = mp.relu %1 : {OP}\n%1 = mp.neg %x : {OP}\n{RET}"), 2, "%1",
         "use of value '%1' before its definition"),
    Case("wrong-operand-count", func_ir(f"%0 = mp.relu %x, %x : ({T}, {T}) -> {T}\n{RET}"),
         2, "%0", "'mp.relu' expects 1 operands, got 2"),
    Case("operands-and-types-disagree", func_ir(f"%0 = mp.relu %x, %x : {OP}\n{RET}"),
         2, "mp.relu", "'mp.relu' has 2 operands but its type lists 1"),
    Case("broadcast-mismatch",
         func_ir("%0 = mp.add %a, %b : (tensor<4x8xf32>, tensor<3xf32>) -> tensor<4x8xf32>\n"
                 "return %0 : tensor<4x8xf32>", args="%a: tensor<4x8xf32>, %b: tensor<3xf32>",
                 result="tensor<4x8xf32>"),
         2, "%0", "operands are not broadcast-compatible: tensor<4x8xf32> and tensor<3xf32>"),
    Case("matmul-shape-mismatch",
         func_ir("%0 = mp.matmul %a, %b : (tensor<4x8xf32>, tensor<7x2xf32>) -> tensor<4x2xf32>\n"
                 "return %0 : tensor<4x2xf32>", args="%a: tensor<4x8xf32>, %b: tensor<7x2xf32>",
                 result="tensor<4x2xf32>"),
         2, "%0", "matmul contraction mismatch: 8 vs 7"),
    Case("wrong-result-shape", func_ir(f"%0 = mp.relu %x : ({T}) -> tensor<3x2xf32>\n"
                                       f"return %x : {T}"),
         2, "%0", "'mp.relu' result type tensor<3x2xf32> does not match the inferred type "
                  "tensor<2x3xf32>"),
    Case("return-type-mismatch", func_ir(f"%0 = mp.relu %x : {OP}\nreturn %x, %0 : {T}, {T}"),
         3, "return", "return type mismatch: function @f returns tensor<2x3xf32> but return "
                      "gives tensor<2x3xf32>, tensor<2x3xf32>"),
    Case("bad-element-type", func_ir(f"%0 = mp.relu %x : ({T}) -> tensor<2x3xf33>\n{RET}"),
         2, "tensor<2x3xf33>", "unknown element type 'f33'; did you mean 'f32'?"),
    Case("negative-dimension", func_ir(f"%0 = mp.relu %x : ({T}) -> tensor<-2x3xf32>\n{RET}"),
         2, "tensor<-2", "negative dimension -2 in tensor<-2x3xf32>"),
    Case("dynamic-dimension", func_ir(f"return %x : {T}", args="%x: tensor<?x3xf32>"),
         1, "tensor<?", "dynamic dimensions are not supported; give a static size"),
    Case("bad-dense-length",
         func_ir("%0 = mp.constant {value = dense<[1.0, 2.0]> : tensor<3xf32>} : () -> "
                 f"tensor<3xf32>\nreturn %x : {T}"),
         2, "dense", "dense literal has 2 elements but tensor<3xf32> has 3"),
    Case("ragged-dense",
         func_ir("%0 = mp.constant {value = dense<[[1.0, 2.0], [3.0]]> : tensor<2x2xf32>} : () -> "
                 f"tensor<2x2xf32>\nreturn %x : {T}"),
         2, "dense", "ragged dense literal: nested lists of different lengths"),
    Case("bad-perm", func_ir(f"%0 = mp.transpose %x {{perm = [0, 0]}} : {OP}\n{RET}"),
         2, "%0", "attribute 'perm' must be a permutation of [0, 1], got [0, 0]"),
    Case("axis-out-of-range", func_ir(f"%0 = mp.softmax %x {{axis = 2}} : {OP}\n{RET}"),
         2, "%0", "attribute 'axis' = 2 is out of range [-2, 2)"),
    Case("unterminated-string", func_ir(f'%0 = mp.relu %x {{x.s = "abc}} : {OP}\n{RET}'),
         2, '"', "unterminated string"),
    Case("stray-dollar", func_ir(f"%0 = mp.relu $x : {OP}\n{RET}"), 2, "$",
         "unexpected character '$'"),
    Case("stray-control-character", func_ir(f"%0 = mp.relu %x \x01: {OP}\n{RET}"), 2, "\x01",
         "unexpected character '\\x01'"),
    Case("invalid-utf8-in-comment",
         func_ir(f"// caf\u00e9 XX\n%0 = mp.relu %x : {OP}\n{RET}").encode().replace(
             b"XX", b"\xff\xfe"),
         2, "\ufffd", "invalid UTF-8 byte 0xff"),
    Case("invalid-utf8-in-op",
         func_ir(f'%0 = mp.relu %x {{x.s = "aXb"}} : {OP}\n{RET}').encode().replace(b"X", b"\xc3"),
         2, "\ufffd", "invalid UTF-8 byte 0xc3"),
    Case("duplicate-function", func_ir(f"return %x : {T}") + func_ir(f"return %x : {T}"),
         4, "func.func", "redefinition of function @f"),
    Case("duplicate-attribute", func_ir(f"%0 = mp.softmax %x {{axis = 1, axis = 0}} : {OP}\n{RET}"),
         2, "axis", "duplicate attribute 'axis'", nth=2),
    Case("duplicate-attribute-general-path",
         func_ir(f"%0 = mp.softmax %x {{x.a = [1], axis = 1, axis = 0}} : {OP}\n{RET}"),
         2, "axis", "duplicate attribute 'axis'", nth=2),
    Case("deeply-nested-array",
         func_ir(f"%0 = mp.relu %x {{x.a = {'[' * DEEP}{']' * DEEP}}} : {OP}\n{RET}"),
         2, "[" * 65 + "]", "attribute nesting is deeper than 64 levels"),  # level 65
    Case("deeply-nested-dictionary",
         func_ir(f"%0 = mp.relu %x {{x.a = {'{a = ' * DEEP}1{'}' * DEEP}}} : {OP}\n{RET}"),
         2, "{a = " * 65 + "1", "attribute nesting is deeper than 64 levels"),
    Case("12mb-line-garbage-after-a-long-string",
         func_ir(f'%0 = mp.relu %x {{x.s = "{BIG_STRING}"}} : {OP} $\n{RET}'), 2, "$",
         "unexpected character '$'"),
    Case("12mb-line-of-garbage", func_ir("$" * BIG + f"\n{RET}"), 2, "$",
         "unexpected character '$'"),
    Case("12mb-dense-literal-with-wrong-count",
         func_ir(f"%0 = mp.constant {{value = dense<[{', '.join([LONG_NUMBER] * N_LONG)}]> : "
                 f"tensor<{N_LONG + 1}xf32>}} : () -> tensor<{N_LONG + 1}xf32>\n"
                 f"return %0 : tensor<{N_LONG + 1}xf32>",
                 result=f"tensor<{N_LONG + 1}xf32>"),
         2, "dense", f"dense literal has {N_LONG} elements but tensor<{N_LONG + 1}xf32> has "
                     f"{N_LONG + 1}"),
    Case("missing-return", func_ir(f"%0 = mp.relu %x : {OP}"), 3, "}",
         "function @f does not end with a return"),
    Case("op-after-return", func_ir(f"return %x : {T}\n%0 = mp.relu %x : {OP}"), 3, "mp.relu",
         "operation after the function's return"),
    Case("unknown-attribute", func_ir(f"%0 = mp.softmax %x {{axsi = 1}} : {OP}\n{RET}"),
         2, "%0", "unknown attribute 'axsi' for mp.softmax; did you mean 'axis'?"),
    Case("attribute-on-op-without-attributes",
         func_ir(f"%0 = mp.relu %x {{alpha = 0.1}} : {OP}\n{RET}"),
         2, "%0", "mp.relu takes no attribute 'alpha'"),
    Case("operand-type-mismatch",
         func_ir(f"%0 = mp.relu %x : (tensor<3x2xf32>) -> tensor<3x2xf32>\nreturn %x : {T}"),
         2, "%x", "operand #0 '%x' has type tensor<2x3xf32> but the op expects tensor<3x2xf32>"),
    Case("hash-in-result-name", func_ir(f"%r#1 = mp.relu %x : {OP}\nreturn %x : {T}"),
         2, "%r#1", "'%r#1' names one result of an op and cannot be defined"),
    Case("hash-on-single-result", func_ir(f"%0 = mp.relu %x : {OP}\n"
                                          f"%1 = mp.neg %0#0 : {OP}\nreturn %1 : {T}"),
         3, "%0#0", "'%0' has a single result; use it without '#'"),
    Case("decimal-integer-as-float", func_ir(f"%0 = mp.relu %x {{x.f = 3 : f32}} : {OP}\n{RET}"),
         2, "3 :", "unexpected decimal integer literal for a floating point value"),
    Case("hex-float-too-wide",
         func_ir(f"%0 = mp.relu %x {{x.f = 0x7FC00000 : bf16}} : {OP}\n{RET}"),
         2, "0x7F", "hexadecimal float constant out of range for bf16"),
    Case("unknown-escape", func_ir(f'%0 = mp.relu %x {{x.s = "a\\qb"}} : {OP}\n{RET}'),
         2, '"a', "unknown escape '\\q' in string"),
    Case("missing-attribute", func_ir(f"%0 = mp.concat %x : {OP}\n{RET}"),
         2, "%0", "mp.concat needs attribute 'axis'"),
    Case("module-and-bare-function", "module {\n}\n" + func_ir(f"return %x : {T}"),
         3, "func.func", "a file holds either one module or bare functions"),
    Case("syntax-error-names-what-was-expected", func_ir(f"%0 = mp.relu %x : {T}\n{RET}"),
         2, "tensor<2x3xf32>", "unexpected 'tensor<2x3xf32>'; expected '('"),
    Case("non-tensor-argument", func_ir("return", args="%x: f32", result=""), 1, "%x",
         "expected a tensor type, got 'f32'"),
    Case("dense-i8-element-out-of-range",
         func_ir("%0 = mp.constant {value = dense<[1, 300]> : tensor<2xi8>} : () -> "
                 f"tensor<2xi8>\nreturn %x : {T}"),
         2, "300", "integer value 300 is out of range for i8 (range [-128, 127])"),
    Case("dense-element-past-int64",
         func_ir("%0 = mp.constant {value = dense<[1, 99999999999999999999]> : tensor<2xi32>} : "
                 f"() -> tensor<2xi32>\nreturn %x : {T}"),
         2, "999", "integer value 99999999999999999999 is out of range for i32"),
    Case("f32-literal-out-of-range", func_ir(f"%0 = mp.relu %x {{x.f = 3.5e38 : f32}} : {OP}\n{RET}"),
         2, "3.5e38", "3.5e38 is out of range for f32 (largest finite value 3.4028235e+38); an "
                      "infinity is written 0x7F800000 : f32"),
    Case("integer-longer-than-4300-digits",
         func_ir(f"%0 = mp.relu %x {{x.i = {'9' * 5000}}} : {OP}\n{RET}"),
         2, "9", "integer literal has 5000 digits; at most 4300 are supported"),
    Case("result-count-longer-than-4300-digits",
         func_ir(f'%0:{"9" * 5000} = "x.op"(%x) : {OP}\n{RET}'),
         2, "%0", "result count 9999999999999999999999999999999999999... is too large"),
    Case("tensor-of-65-dimensions",
         func_ir(f"return %x : {T}", args=f"%y: tensor<{'1x' * 65}f32>, %x: {T}"),
         1, "tensor<", "has 65 dimensions; at most 64 are supported"),
]


def _check_rendered(err: str, path: Path, case: Case) -> None:
    col = case.column()
    assert "Traceback" not in err
    first, shown, caret, *rest = err.split("\n")
    assert first.startswith(f"{path}:{case.line}:{col}: error: "), first[:300]
    assert case.message in first, first[:300]
    assert rest == [""]  # one diagnostic, newline-terminated
    source = case.data.split(b"\n")[case.line - 1].decode("utf-8", "replace").replace("\t", " ")
    if len(source) <= 120:
        assert shown == source
    else:  # a window around the column, not the whole line
        assert len(shown) <= 126 and shown.strip(".") in source
    assert caret == " " * (len(caret) - 1) + "^"
    if case.at is None:
        assert len(caret) == len(shown.rstrip()) + 1
    else:
        assert shown[len(caret) - 1] == source[col - 1]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_malformed_input_is_one_located_diagnostic(case, cli, tmp_path):
    src, out = tmp_path / "in.ir", tmp_path / "out.ir"
    src.write_bytes(case.data)
    out.write_bytes(b"KEEP ME")
    r = cli("opt", src, "-o", out)
    assert r.rc == 1
    assert r.out == ""
    _check_rendered(r.err, src, case)
    assert len(r.err) < 2048
    assert out.read_bytes() == b"KEEP ME"
    assert sorted(os.listdir(tmp_path)) == ["in.ir", "out.ir"]


def test_there_are_at_least_25_distinct_cases():
    assert len({c.id for c in CASES}) == len(CASES) >= 25
    assert len({c.message for c in CASES}) >= 25


@pytest.mark.parametrize("case", [c for c in CASES if c.id in (
    "unknown-op", "invalid-utf8-in-comment", "deeply-nested-array", "missing-return")],
    ids=lambda c: c.id)
def test_console_script_prints_no_traceback(case, tmp_path):
    src, out = tmp_path / "in.ir", tmp_path / "out.ir"
    src.write_bytes(case.data)
    out.write_bytes(b"KEEP ME")
    mplower = Path(sys.executable).with_name("mplower")
    proc = subprocess.run([str(mplower), "opt", str(src), "-o", str(out)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1
    assert proc.stdout == ""
    _check_rendered(proc.stderr, src, case)
    assert out.read_bytes() == b"KEEP ME"
    assert sorted(os.listdir(tmp_path)) == ["in.ir", "out.ir"]


def test_empty_file_is_an_empty_module(cli, tmp_path):
    src = tmp_path / "empty.ir"
    src.write_bytes(b"")
    r = cli("opt", src)
    assert (r.rc, r.out, r.err) == (0, "module {\n}\n", "")


def test_missing_input_file_is_a_diagnostic(cli, tmp_path):
    r = cli("opt", tmp_path / "nope.ir")
    assert r.rc == 1
    assert r.err == f"{tmp_path / 'nope.ir'}: error: cannot read input: No such file or directory\n"


def test_every_error_of_a_module_is_reported_in_order(cli, tmp_path):
    src = tmp_path / "two.ir"
    src.write_text(func_ir(f"%0 = mp.softmax %x {{axis = 5}} : {OP}\n"
                           f"%1 = mp.relu %0 : ({T}) -> tensor<3x2xf32>\n{RET}"))
    r = cli("opt", src)
    assert r.rc == 1
    heads = [line for line in r.err.split("\n") if ": error: " in line]
    assert [h.split(": error: ")[0] for h in heads] == [f"{src}:2:3", f"{src}:3:3"]


def test_tabs_in_the_source_line_keep_the_caret_aligned(cli, tmp_path):
    src = tmp_path / "tabs.ir"
    src.write_text(f"func.func @f(%x: {T}) -> {T} {{\n\t%0 = mp.relu\t%y : {OP}\n\t{RET}\n}}\n")
    r = cli("opt", src)
    first, shown, caret, _ = r.err.split("\n")
    assert first.startswith(f"{src}:2:15: error: use of undefined value '%y'")
    assert shown[len(caret) - 1:].startswith("%y")


def test_render_without_a_source_is_one_line():
    d = Diagnostic(Location("f.ir", 3, 4), "bad")
    assert d.render() == "f.ir:3:4: error: bad"
    assert Diagnostic(Location("f.ir", 0, 0), "bad").render("text") == "f.ir: error: bad"


def test_render_notes_follow_their_diagnostic():
    d = Diagnostic(Location("f.ir", 1, 3), "bad",
                   notes=[Diagnostic(Location("f.ir", 2, 1), "here", "note")])
    assert d.render("abcd\nxy") == "f.ir:1:3: error: bad\nabcd\n  ^\nf.ir:2:1: note: here\nxy\n^"


# ---- many errors ------------------------------------------------------------------------------

def _errors_file(tmp_path: Path, n: int) -> Path:
    """A function whose n ops each have a wrong result type: n verifier errors, in order."""
    src = tmp_path / "many.ir"
    src.write_text(func_ir("".join(f"%{i} = mp.relu %x : ({T}) -> tensor<3x2xf32>\n"
                                   for i in range(n)) + f"return %x : {T}"))
    return src


def _heads(err: str) -> list[str]:
    return [line.split(": error: ")[0] for line in err.split("\n") if ": error: " in line]


def test_opt_shows_the_first_20_errors_and_counts_the_rest(cli, tmp_path):
    src = _errors_file(tmp_path, 25)
    r = cli("opt", src)
    assert r.rc == 1
    assert _heads(r.err) == [f"{src}:{i + 2}:3" for i in range(20)]
    assert r.err.endswith("\nmplower: 5 more errors not shown; --error-limit=0 shows all\n")


def test_error_limit_zero_shows_every_error_and_n_shows_n(cli, tmp_path):
    src = _errors_file(tmp_path, 25)
    r = cli("opt", src, "--error-limit=0")
    assert _heads(r.err) == [f"{src}:{i + 2}:3" for i in range(25)]
    assert "not shown" not in r.err
    r = cli("opt", src, "--error-limit", "1")
    assert _heads(r.err) == [f"{src}:2:3"]
    assert r.err.endswith("\nmplower: 24 more errors not shown; --error-limit=0 shows all\n")


def test_error_limit_counts_across_split_input_chunks(cli, tmp_path):
    src = tmp_path / "split.ir"
    chunk = func_ir(f"%0 = mp.relu %y : {OP}\n{RET}")
    src.write_text("// -----\n".join([chunk] * 30))
    r = cli("opt", src, "--split-input-file")
    assert r.rc == 1
    assert _heads(r.err) == [f"{src}:{2 + 5 * i}:16" for i in range(20)]
    assert r.err.endswith("\nmplower: 10 more errors not shown; --error-limit=0 shows all\n")


def test_negative_error_limit_is_a_usage_error(cli, tmp_path):
    r = cli("opt", _errors_file(tmp_path, 1), "--error-limit=-1")
    assert r.rc == 2
    assert "--error-limit must be a count of errors, or 0 for no limit" in r.err


def test_other_commands_show_the_default_number_of_errors(cli, tmp_path):
    src = _errors_file(tmp_path, 25)
    for args in (["run", src, "--random-inputs"], ["report", src]):
        r = cli(*args)
        assert r.rc == 1, args
        assert _heads(r.err) == [f"{src}:{i + 2}:3" for i in range(20)], args
        assert r.err.endswith("\nmplower: 5 more errors not shown\n"), args


def test_the_last_of_many_errors_shows_its_own_source_line(cli, tmp_path):
    src = _errors_file(tmp_path, 3000)
    r = cli("opt", src, "--error-limit=0")
    lines = r.err.split("\n")
    assert lines[-4] == f"{src}:3001:3: error: 'mp.relu' result type tensor<3x2xf32> does not " \
                        "match the inferred type tensor<2x3xf32>"
    assert lines[-3] == f"  %2999 = mp.relu %x : ({T}) -> tensor<3x2xf32>"
    assert lines[-2] == "  ^"


def test_source_text_lines_end_at_lf_crlf_and_cr():
    text = SourceText("a\r\nb\rc\nd")
    assert [text.line(i) for i in range(6)] == [None, "a", "b", "c", "d", None]
    assert SourceText("").line(1) == ""


def test_cr_only_file_reports_the_line_an_editor_shows(cli, tmp_path):
    src = tmp_path / "mac.ir"
    src.write_bytes(("// old Mac line endings\n" + func_ir(f"%0 = mp.relu %y : {OP}\n{RET}"))
                    .replace("\n", "\r").encode())
    r = cli("opt", src)
    assert r.rc == 1
    assert r.err == (f"{src}:3:16: error: use of undefined value '%y'\n"
                     f"  %0 = mp.relu %y : {OP}\n" + " " * 15 + "^\n")


def test_missing_colon_at_the_end_of_a_line_points_past_the_previous_token(cli, tmp_path):
    src = tmp_path / "colon.ir"
    src.write_text(func_ir(f'%0 = "mp.relu"(%x)\n{RET}'))
    r = cli("opt", src)
    assert r.rc == 1
    assert r.err == (f"{src}:2:21: error: expected ':', '{{'; found 'return' on line 3\n"
                     f'  %0 = "mp.relu"(%x)\n' + " " * 20 + "^\n")


# ---- the same refusal from every command ------------------------------------------------------

HUGE = "tensor<1180591620717411303424xf32>"


@pytest.mark.parametrize("command", [["opt"], ["report"], ["run", "--random-inputs"],
                                     ["export", "--format", "onnx", "-o", "OUT"]])
def test_tensor_with_too_many_elements_is_refused_at_its_type_by_every_command(
        command, cli, tmp_path):
    src = tmp_path / "huge.ir"
    src.write_text(f"func.func @f(%x: {HUGE}) -> {HUGE} {{\n  return %x : {HUGE}\n}}\n")
    out = tmp_path / "out.onnx"
    args = [str(out) if a == "OUT" else a for a in command]
    r = cli(args[0], src, *args[1:])
    assert r.rc == 1
    assert r.err.startswith(f"{src}:1:18: error: {HUGE} has more than 1152921504606846975 "
                            "(2^60 - 1) elements")
    assert "internal error" not in r.err
    assert not out.exists()


@pytest.mark.parametrize("command", [["run", "--random-inputs"],
                                     ["export", "--format", "onnx", "-o", "OUT"]])
def test_nul_byte_in_mp_weights_is_a_located_error(command, cli, tmp_path):
    src = tmp_path / "nul.ir"
    src.write_text('module attributes {mp.weights = "w\\00.npz"} {\n'
                   '  func.func @f() -> tensor<2xf32> {\n'
                   '    %0 = mp.constant {name = "w"} : () -> tensor<2xf32>\n'
                   '    return %0 : tensor<2xf32>\n  }\n}\n')
    out = tmp_path / "out.onnx"
    args = [str(out) if a == "OUT" else a for a in command]
    r = cli(args[0], src, *args[1:])
    assert r.rc == 1
    assert r.err.startswith(f"{src}:1:20: error: mp.weights 'w\\x00.npz' contains a NUL byte, "
                            "which no file path can\n")


def test_verifier_refuses_a_tensor_type_built_too_large_through_the_api():
    f = Function("f", Location("m.ir", 1, 1))
    x = f.add_arg("x", tensor((2 ** 40, 2 ** 30), "f32"), Location("m.ir", 1, 14))
    f.append_op("return", [(x, 0)], {}, [], loc=Location("m.ir", 2, 3))
    f.result_types = [tensor((2 ** 40, 2 ** 30), "f32")]
    with pytest.raises(DiagnosticError) as e:
        verify(Module(functions={"f": f}))
    [d] = e.value.diagnostics
    assert str(d.loc) == "m.ir:1:14"
    assert d.message == ("tensor<1099511627776x1073741824xf32> has more than 1152921504606846975 "
                         "(2^60 - 1) elements, the most whose values (8 bytes each) a 64-bit "
                         "machine can address")


def test_run_refuses_an_i8_constant_it_would_have_computed_as_int64(cli, tmp_path):
    # Before, `run` returned an "i8" result [90 335] of dtype int64 for this module.
    src = tmp_path / "i8.ir"
    src.write_text(func_ir("%c = mp.constant {value = dense<[1, 300]> : tensor<2xi8>} : () -> "
                           "tensor<2xi8>\n%0 = mp.add %x, %c : (tensor<2xi8>, tensor<2xi8>) -> "
                           "tensor<2xi8>\nreturn %0 : tensor<2xi8>",
                           args="%x: tensor<2xi8>", result="tensor<2xi8>"))
    r = cli("run", src, "--random-inputs")
    assert r.rc == 1
    assert r.err.startswith(f"{src}:2:39: error: integer value 300 is out of range for i8 "
                            "(range [-128, 127])\n")
