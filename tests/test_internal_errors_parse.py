"""Inputs that used to end in `internal error` or in an unlocated (`<unknown>`) diagnostic.

Each case is a small file the user could write: plan annotations that are not types, integer
literals past Python's decimal limit, file attributes naming a loop of symbolic links or a name
longer than the OS allows, files with no function or several, U+2028 in the text, policy and
target sheets that are not UTF-8 or spell a key in a form the key scan did not follow,
calibration data with no batch, an unknown `--func`. Every one must exit 1 (2 for a usage
error) with a diagnostic located where the problem was written, never a traceback.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from mplower.ir.diagnostics import Location
from mplower.ir.parser import parse

RELU = """func.func @main(%x: tensor<4xf32>) -> tensor<4xf32> {
  %0 = mp.relu %x ATTRS: (tensor<4xf32>) -> tensor<4xf32>
  return %0 : tensor<4xf32>
}
"""

# A module whose one function reads a weight, so that `run` opens mp.weights.
WITH_ATTR = """module attributes {ATTR = "NAME"} {
  func.func @main(%x: tensor<4xf32>) -> tensor<4xf32> {
    %w = mp.constant {name = "w"} : () -> tensor<4xf32>
    %0 = mp.add %x, %w : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
"""
ATTR_COL = len("module attributes {") + 1  # where the attribute's name starts


def _clean(r) -> None:
    assert "Traceback" not in r.err and "internal error" not in r.err, r.err
    assert "<unknown>" not in r.err, r.err


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ---- plan annotations holding a value that is not a type ----------------------------------

@pytest.mark.parametrize("attr, value, shown", [
    ("mp.precision", '"bogus"', '"bogus"'),
    ("mp.precision", "7", "7"),
    ("mp.accum", "[1, 2]", "[1, 2]"),
    ("mp.accum", "true", "true"),
])
def test_plan_annotation_that_is_not_a_type_is_a_verifier_error_at_the_op(
        cli, tmp_path, attr, value, shown):
    path = _write(tmp_path, "m.ir", RELU.replace("ATTRS", f"{{{attr} = {value}}} "))
    r = cli("opt", path)
    _clean(r)
    assert r.rc == 1
    assert r.err.startswith(f"{path}:2:3: error: 'mp.relu' attribute '{attr}' must be an "
                            f"element type such as {'bf16' if attr == 'mp.precision' else 'f32'}"
                            f", got {shown}\n"), r.err
    assert r.err.splitlines()[2] == "  ^"


def test_plan_annotation_written_as_a_string_of_a_type_still_runs(cli, tmp_path):
    path = _write(tmp_path, "m.ir", RELU.replace("ATTRS", '{mp.precision = "bf16"} '))
    r = cli("opt", path, "--pass=insert-casts")
    assert r.rc == 0, r.err
    assert "mp.cast %x : (tensor<4xf32>) -> tensor<4xbf16>" in r.out


# ---- integer literals past 4300 decimal digits --------------------------------------------

BIG_HEX = "0x" + "F" * 4400


@pytest.mark.parametrize("attrs", [
    f"{{v = {BIG_HEX} : i64}} ",  # the fast one-line path
    f"{{v = [{BIG_HEX} : i64]}} ",  # the general path (an array)
], ids=["simple", "array"])
def test_typed_hex_integer_past_the_decimal_limit_is_located_at_the_literal(
        cli, tmp_path, attrs):
    text = RELU.replace("ATTRS", attrs)
    col = text.splitlines()[1].index("0x") + 1
    path = _write(tmp_path, "m.ir", text)
    r = cli("opt", path)
    _clean(r)
    assert r.rc == 1
    assert r.err.startswith(f"{path}:2:{col}: error: integer value 0xFFFFFFFFFFFFFFFFFFFFFFFFF"
                            f"FFFFFFFFFF... does not fit i64 (range [-9223372036854775808, "
                            f"18446744073709551615])\n"), r.err[:300]


def test_untyped_hex_integer_past_int64_on_an_op_attribute_is_an_error_at_the_op(cli, tmp_path):
    text = RELU.replace("mp.relu %x ATTRS", f"mp.softmax %x {{axis = {BIG_HEX}}} ")
    path = _write(tmp_path, "m.ir", text)
    r = cli("opt", path)
    _clean(r)
    assert r.rc == 1
    assert r.err.startswith(f"{path}:2:3: error: 'mp.softmax' attribute 'axis': integer "
                            f"0xfffffffffffffffffffffffffffffffffff... does not fit a 64-bit "
                            f"attribute"), r.err[:300]


def test_untyped_hex_integer_past_the_decimal_limit_on_a_module_still_round_trips(cli, tmp_path):
    # Not an op attribute, so no width applies: printed back in hexadecimal.
    text = f'module attributes {{x.big = {BIG_HEX}}} {{\n{RELU.replace("ATTRS", "")}}}\n'
    r = cli("opt", _write(tmp_path, "m.ir", text))
    assert r.rc == 0, r.err[:300]
    assert f"x.big = {BIG_HEX.lower()}" in r.out


# ---- file attributes naming a symbolic link loop or an over-long name ---------------------

def _loop(folder: Path, name: str) -> None:
    os.symlink(f"{name}.2", folder / name)
    os.symlink(name, folder / f"{name}.2")


@pytest.mark.parametrize("attr, command", [
    ("mp.weights", ("run", "--random-inputs")),
    ("mp.policy", ("run", "--random-inputs")),
    ("mp.target", ("report",)),
])
@pytest.mark.parametrize("problem", ["loop", "long"])
def test_file_attribute_that_cannot_be_opened_is_located_at_the_attribute(
        cli, tmp_path, attr, command, problem):
    if problem == "loop":
        name, why = "w.toml", "it is a loop of symbolic links"
        _loop(tmp_path, name)
    else:
        name, why = "a" * 300 + ".toml", "file name too long"
    text = WITH_ATTR.replace("ATTR", attr).replace("NAME", name)
    if attr != "mp.weights":  # give the constant its weights, so the attribute is what fails
        text = text.replace(f'{attr} = "', f'mp.weights = "w.npz", {attr} = "')
        np.savez(tmp_path / "w.npz", w=np.zeros(4, np.float32))
    path = _write(tmp_path, "m.ir", text)
    r = cli(command[0], path, *command[1:])
    _clean(r)
    assert r.rc == 1
    col = text.index(attr) + 1
    shown = name if len(name) <= 60 else name[:57] + "..."
    assert r.err.startswith(f"{path}:1:{col}: error: {attr} '{shown}' cannot be opened: "
                            f"{why}\n"), r.err
    assert r.err.splitlines()[2] == " " * (col - 1) + "^"


@pytest.mark.parametrize("problem", ["loop", "long"])
def test_sheet_named_on_the_command_line_that_cannot_be_opened_is_a_diagnostic(
        cli, tmp_path, problem):
    if problem == "loop":
        _loop(tmp_path, "t.toml")
        spec, head = str(tmp_path / "t.toml"), str(tmp_path / "t.toml")
        why = "a loop of symbolic links"
    else:
        spec, why = "b" * 300 + ".toml", "file name too long"
        head = spec[:197] + "..."
    path = _write(tmp_path, "m.ir", RELU.replace("ATTRS", ""))
    r = cli("report", path, "--target", spec)
    _clean(r)
    assert r.rc == 1
    assert r.err == f"{head}: error: cannot open target file: {why}\n"


def test_module_attribute_locations_are_kept_by_the_parser():
    m = parse('module attributes {x.a = 1,\n    mp.weights = "w.npz"} {\n}\n', "f.ir")
    assert m.attr_loc("mp.weights") == Location("f.ir", 2, 5)
    assert m.attr_loc("x.a") == Location("f.ir", 1, 20)
    assert m.attr_loc("mp.target") == m.loc == Location("f.ir", 1, 1)


# ---- which function: none, several, an unknown --func ------------------------------------

PLAIN = RELU.replace("ATTRS", "")
TWO = PLAIN.replace("@main", "@a") + PLAIN.replace("@main", "@b")


@pytest.mark.parametrize("text", ["", "// only a comment\n// and another\n", "\u2028",
                                  "\n\n  // indented\n"])
@pytest.mark.parametrize("command", [("run", "--random-inputs"), ("export", "-o", "m.onnx"),
                                     ("report",), ("bench",)])
def test_file_with_no_function_is_an_error_at_its_first_line(cli, tmp_path, text, command):
    path = _write(tmp_path, "m.ir", text)
    r = cli(command[0], path, *[str(tmp_path / a) if a.endswith(".onnx") else a
                                for a in command[1:]])
    _clean(r)
    assert r.rc == 1
    if text == "\u2028":  # not whitespace in MLIR: a located lexer error at it
        assert r.err.startswith(f"{path}:1:1: error: unexpected character '\\u2028'\n")
    else:
        assert r.err.startswith(f"{path}:1:1: error: {path} holds no function (expected a "
                                f"func.func)\n"), r.err


@pytest.mark.parametrize("command", [("run", "--random-inputs"), ("export", "-o", "m.onnx"),
                                     ("report",), ("tune", "--target", "generic", "--data",
                                                   "d.npz", "-o", "out")])
def test_several_functions_and_no_main_names_the_file_and_lists_them(cli, tmp_path, command):
    path = _write(tmp_path, "m.ir", TWO)
    np.savez(tmp_path / "d.npz", x=np.ones((1, 4), np.float32))
    r = cli(command[0], path, *[str(tmp_path / a) if a in ("m.onnx", "d.npz", "out") else a
                                for a in command[1:]])
    _clean(r)
    assert r.rc == 1
    assert r.err.startswith(f"{path}:1:1: error: {path} has several functions and none is "
                            f"@main (it has: @a, @b); pick one with --func\n"), r.err
    assert "None" not in r.err


@pytest.mark.parametrize("command", [
    ("run", "--random-inputs"), ("export", "-o", "m.onnx"), ("report",),
    ("train", "--data", "d.npz", "--loss", "mse", "--labels", "x", "-o", "o.ir"),
    ("tune", "--target", "generic", "--data", "d.npz", "-o", "out")])
def test_unknown_func_is_a_usage_error_naming_the_functions(cli, tmp_path, command):
    path = _write(tmp_path, "m.ir", TWO)
    np.savez(tmp_path / "d.npz", x=np.ones((1, 4), np.float32))
    r = cli(command[0], path, "--func", "nope",
            *[str(tmp_path / a) if a in ("m.onnx", "d.npz", "out", "o.ir") else a
              for a in command[1:]])
    _clean(r)
    assert r.rc == 2
    assert r.err.endswith(f"mplower: error: --func: {path} has no function @nope (it has: "
                          f"@a, @b)\n"), r.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.npz", "m.ir"]


def test_unknown_func_suggests_the_close_one(cli, tmp_path):
    path = _write(tmp_path, "m.ir", PLAIN)
    r = cli("run", path, "--random-inputs", "--func", "mian")
    assert r.rc == 2
    assert r.err.endswith(f"--func: {path} has no function @mian; did you mean 'main'? (it "
                          f"has: @main)\n")


# ---- U+2028: only LF ends a line ------------------------------------------------------------

def test_u2028_in_a_comment_does_not_shift_lines_or_break_the_shown_line(cli, tmp_path):
    text = "// a\u2028b\n" + RELU.replace("%x ATTRS", "%y ") + "// \u2028 tail\n"
    path = _write(tmp_path, "m.ir", text)
    r = cli("opt", path)
    _clean(r)
    assert r.rc == 1
    # An editor (and the lexer) count LF only: the bad value is on line 3.
    assert r.err == (f"{path}:3:16: error: use of undefined value '%y'\n"
                     f"  %0 = mp.relu %y : (tensor<4xf32>) -> tensor<4xf32>\n"
                     f"               ^\n")


def test_u2028_on_the_shown_line_is_shown_as_a_space(cli, tmp_path):
    text = "func.func @main() -> () {\n  // x\u2028y\n  %0 = \u2028\n}\n"
    path = _write(tmp_path, "m.ir", text)
    r = cli("opt", path)
    _clean(r)
    assert r.rc == 1
    assert r.err.startswith(f"{path}:3:8: error: unexpected character '\\u2028'\n"
                            f"  %0 =  \n"
                            f"       ^\n"), r.err


# ---- TOML sheets ---------------------------------------------------------------------------

def test_sheet_that_is_not_utf8_names_the_line_and_byte(cli, tmp_path):
    sheet = tmp_path / "p.toml"
    sheet.write_bytes(b'[policy]\ncompute = "bf16"\n# caf\xe9\n')
    path = _write(tmp_path, "m.ir", RELU.replace("ATTRS", ""))
    r = cli("opt", path, f"--pass=assign-precision{{policy={sheet}}}")
    _clean(r)
    assert r.rc == 1
    assert r.err.startswith(f"{sheet}:3:6: error: invalid UTF-8 byte 0xe9 at byte 31; a sheet "
                            f"is UTF-8 text\n# caf\ufffd\n     ^\n"), r.err


def test_unknown_key_written_with_escapes_is_located_and_matched(cli, tmp_path):
    sheet = _write(tmp_path, "p.toml", '[policy]\ncompute = "bf16"\n"\\u0061low" = []\n')
    path = _write(tmp_path, "m.ir", RELU.replace("ATTRS", ""))
    r = cli("opt", path, f"--pass=assign-precision{{policy={sheet}}}")
    _clean(r)
    assert r.rc == 1
    assert r.err.startswith(f"{sheet}:3:1: error: unknown key 'alow' in [policy]; did you mean "
                            f"'allow'?\n"), r.err


def test_unknown_table_is_located_with_a_suggestion(cli, tmp_path):
    sheet = _write(tmp_path, "p.toml", '[policy]\ncompute = "bf16"\n\n[guardrail]\nx = 1\n')
    path = _write(tmp_path, "m.ir", RELU.replace("ATTRS", ""))
    r = cli("opt", path, f"--pass=assign-precision{{policy={sheet}}}")
    assert r.rc == 1
    assert r.err.startswith(f"{sheet}:4:2: error: unknown key 'guardrail'; did you mean "
                            f"'guardrails'?\n[guardrail]\n ^\n"), r.err


def test_toml_error_at_end_of_document_counts_lines_as_toml_does(cli, tmp_path):
    # str.splitlines would see three lines here (U+2028 in the comment); TOML sees two.
    sheet = _write(tmp_path, "p.toml", "# a\u2028b\nallow = [1,\n")
    path = _write(tmp_path, "m.ir", RELU.replace("ATTRS", ""))
    r = cli("opt", path, f"--pass=assign-precision{{policy={sheet}}}")
    _clean(r)
    assert r.rc == 1
    assert r.err.startswith(f"{sheet}:2:12: error: invalid TOML: "), r.err


# ---- tune with no calibration batch --------------------------------------------------------

def test_tune_with_zero_calibration_batches_names_the_data_file(cli, tmp_path):
    path = _write(tmp_path, "m.ir", RELU.replace("ATTRS", ""))
    data = tmp_path / "calib.npz"
    np.savez(data, x=np.zeros((0, 4), np.float32))
    r = cli("tune", path, "--target", "generic", "--data", data, "-o", tmp_path / "out")
    _clean(r)
    assert r.rc == 1
    assert r.err == (f"{data}: error: calibration data {data} holds no batch (a stack of zero: "
                     f"'x' [0, 4]); give at least one\n")
    assert not (tmp_path / "out").exists()


def test_toml_integer_past_the_decimal_limit_is_located(cli, tmp_path):
    sheet = _write(tmp_path, "p.toml", "[policy]\ncompute = \"bf16\"\n\n[guardrails]\n"
                                       f"max_overflow = {'9' * 5000}\n")
    path = _write(tmp_path, "m.ir", PLAIN)
    r = cli("opt", path, f"--pass=assign-precision{{policy={sheet}}}")
    _clean(r)
    assert r.rc == 1
    assert r.err.startswith(f"{sheet}:5:16: error: invalid TOML: integer literal has 5000 "
                            f"digits; at most 4300 are supported\n"), r.err[:300]


def test_toml_hex_integer_past_the_decimal_limit_out_of_bounds_is_shown_in_hex(cli, tmp_path):
    sheet = _write(tmp_path, "p.toml", "[policy]\ncompute = \"bf16\"\n\n[guardrails]\n"
                                       f"max_overflow = 0x{'F' * 4000}\n")
    path = _write(tmp_path, "m.ir", PLAIN)
    r = cli("opt", path, f"--pass=assign-precision{{policy={sheet}}}")
    _clean(r)
    assert r.rc == 1
    first = r.err.splitlines()[0]
    assert first.startswith(f"{sheet}:5:1: error: 'guardrails.max_overflow' must be between "), first
    assert first.endswith(", not 0xfffffffffffffffffffffffffffffffffff..."), first


@pytest.mark.parametrize("value, message", [
    ('"missing.npz"', "weights file '{folder}/missing.npz' does not exist"),
    ("3", "module attribute mp.weights must be a string path"),
])
def test_weights_file_problem_is_located_at_the_mp_weights_attribute(cli, tmp_path, value,
                                                                     message):
    text = WITH_ATTR.replace('ATTR = "NAME"', f"x.a = 1, mp.weights = {value}")
    path = _write(tmp_path, "m.ir", text)
    r = cli("run", path, "--random-inputs")
    _clean(r)
    assert r.rc == 1
    col = text.index("mp.weights") + 1
    assert r.err.startswith(f"{path}:1:{col}: error: "
                            f"{message.format(folder=tmp_path)}\n"), r.err


def test_mp_target_that_is_not_a_string_is_located_at_the_attribute(cli, tmp_path):
    text = WITH_ATTR.replace('ATTR = "NAME"', 'mp.weights = "w.npz", mp.target = 3')
    path = _write(tmp_path, "m.ir", text)
    r = cli("report", path)
    _clean(r)
    assert r.rc == 1
    col = text.index("mp.target") + 1
    assert r.err.startswith(f"{path}:1:{col}: error: module attribute mp.target must be a "
                            f"string\n"), r.err
