"""`mplower opt` and `mplower passes`: exit codes, pipelines, instrumentation, files and stdin;
the command table and the start every module command shares (mplower.cli.common).

Most runs are in-process through `mplower.cli.main.main`; stdin, `python -m mplower` and the console
script run as subprocesses.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
from conftest import EXAMPLES, func_ir

from mplower.ir.graph import Module
from mplower.ir.parser import parse
from mplower.ir.printer import print_module
from mplower.pass_manager import PASSES, Pass, PassContext, load_passes

T = "tensor<4xf32>"
# canonicalize: folds %c (1), erases %a, %b, %dead (3), merges %e into %d (1).
# dce: erases %dead (1). cse: merges %e into %d (1).
CRAFTED = func_ir(f"""\
%a = mp.constant {{value = dense<[1.0, 2.0, 3.0, 4.0]> : {T}}} : () -> {T}
%b = mp.constant {{value = dense<2.0> : {T}}} : () -> {T}
%c = mp.mul %a, %b : ({T}, {T}) -> {T}
%d = mp.exp %x : ({T}) -> {T}
%e = mp.exp %x : ({T}) -> {T}
%dead = mp.relu %x : ({T}) -> {T}
%s = mp.add %d, %e : ({T}, {T}) -> {T}
%t = mp.add %s, %c : ({T}, {T}) -> {T}
return %t : {T}""", args=f"%x: {T}", result=T)

CANONICAL = f"""\
module {{
  func.func @f(%x: {T}) -> {T} {{
    %c_1 = mp.constant {{value = dense<[2.0, 4.0, 6.0, 8.0]> : {T}}} : () -> {T}
    %d = mp.exp %x : ({T}) -> {T}
    %s = mp.add %d, %d : ({T}, {T}) -> {T}
    %t = mp.add %s, %c_1 : ({T}, {T}) -> {T}
    return %t : {T}
  }}
}}
"""

MPLOWER = Path(sys.executable).with_name("mplower")


@pytest.fixture
def crafted(tmp_path: Path) -> Path:
    p = tmp_path / "in.ir"
    p.write_text(CRAFTED)
    return p


# ---- usage errors: exit 2 ------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["-p", "canonicalise"], "unknown pass 'canonicalise'; did you mean 'canonicalize'?"),
    (["--pass-pipeline=dce,canonicalizer"],
     "unknown pass 'canonicalizer'; did you mean 'canonicalize'?"),
    (["--pass=canonicalize{max_iteratons=2}"],
     ("pass 'canonicalize' has no option 'max_iteratons'; did you mean 'max_iterations'? "
      "(options: max_fold_elements, max_iterations)")),
    (["--pass=canonicalize{max_iterations=two}"],
     "option 'max_iterations' of pass 'canonicalize' expects int, got 'two'"),
    (["--pass=canonicalize{max_iterations=2"],
     "unterminated { in pipeline 'canonicalize{max_iterations=2'"),
    (["--pass=dce}"], "unbalanced '}' in pipeline 'dce}'"),
    (["--print-ir-afer-all"],
     "unrecognized arguments: --print-ir-afer-all; did you mean '--print-ir-after-all'?"),
    (["--timng"], "unrecognized arguments: --timng; did you mean '--timing'?"),
    (["--print-ir-after=canonicalze"],
     "--print-ir-after: unknown pass 'canonicalze'; did you mean 'canonicalize'?"),
])
def test_usage_error_exits_2_with_a_suggestion(args, message, cli, crafted):
    r = cli("opt", crafted, *args)
    assert r.rc == 2
    assert r.out == ""
    assert r.err.startswith("usage: mplower")
    assert r.err.rstrip("\n").endswith(message)


def test_missing_input_argument_is_a_usage_error(cli):
    r = cli("opt")
    assert r.rc == 2
    assert "the following arguments are required: input" in r.err


def test_missing_command_is_a_usage_error(cli):
    r = cli()
    assert r.rc == 2 and "usage: mplower" in r.err


def test_usage_error_leaves_the_output_file_alone(cli, crafted, tmp_path):
    out = tmp_path / "out.ir"
    out.write_text("KEEP ME")
    assert cli("opt", crafted, "-p", "nope", "-o", out).rc == 2
    assert out.read_text() == "KEEP ME"


# ---- input and output ----------------------------------------------------------------------

def test_stdin_dash_reads_the_module_from_standard_input(crafted):
    proc = subprocess.run([str(MPLOWER), "opt", "-", "-p", "canonicalize"], input=CRAFTED,
                          capture_output=True, text=True, timeout=120, check=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, CANONICAL, "")


def test_stdin_diagnostics_are_located_in_stdin():
    proc = subprocess.run([str(MPLOWER), "opt", "-"], input="func.func @f() {\n  $\n}\n",
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1
    assert proc.stderr == "<stdin>:2:3: error: unexpected character '$'\n  $\n  ^\n"


def test_output_file_equals_stdout(cli, crafted, tmp_path):
    out = tmp_path / "out.ir"
    to_stdout = cli("opt", crafted, "-p", "canonicalize")
    to_file = cli("opt", crafted, "-p", "canonicalize", "-o", out)
    assert to_stdout.rc == to_file.rc == 0
    assert to_file.out == "" and to_stdout.out == CANONICAL
    assert out.read_text() == CANONICAL
    assert sorted(os.listdir(tmp_path)) == ["in.ir", "out.ir"]


def test_output_replaces_an_existing_file_and_keeps_its_mode(cli, crafted, tmp_path):
    out = tmp_path / "out.ir"
    out.write_text("old contents that are longer than the new ones " * 100)
    out.chmod(0o640)
    assert cli("opt", crafted, "-o", out).rc == 0
    assert out.read_text() == print_module(parse(CRAFTED))
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["in.ir", "out.ir"]


@pytest.mark.parametrize("target", ["missing-dir/out.ir", "."])
def test_unwritable_output_is_a_diagnostic(target, cli, crafted, tmp_path):
    out = tmp_path / target
    r = cli("opt", crafted, "-o", out)
    assert r.rc == 1
    assert r.err.startswith(f"{out}: error: cannot write output: ")
    assert "Traceback" not in r.err and "internal error" not in r.err
    assert sorted(os.listdir(tmp_path)) == ["in.ir"]


def test_failed_rename_keeps_the_old_output_and_no_temporary(cli, crafted, tmp_path,
                                                             monkeypatch):
    out = tmp_path / "out.ir"
    out.write_text("KEEP ME")

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    r = cli("opt", crafted, "-o", out)
    assert r.rc == 1
    assert r.err == f"{out}: error: cannot write output: Permission denied\n"
    assert out.read_text() == "KEEP ME"
    assert sorted(os.listdir(tmp_path)) == ["in.ir", "out.ir"]


def test_generic_output_is_accepted_back(cli, crafted, tmp_path):
    generic = cli("opt", crafted, "--print-op-generic")
    assert generic.rc == 0 and '"mp.exp"(%x)' in generic.out and '"func.return"' in generic.out
    again = tmp_path / "generic.ir"
    again.write_text(generic.out)
    assert cli("opt", again).out == cli("opt", crafted).out
    assert cli("opt", again, "--print-op-generic").out == generic.out


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_passes_through_opt_unchanged_by_a_second_run(path, cli, tmp_path):
    first = cli("opt", path)
    assert first.rc == 0
    again = tmp_path / path.name
    again.write_text(first.out)
    assert cli("opt", again).out == first.out


# ---- pipelines and instrumentation ---------------------------------------------------------

def _dump_headers(err: str) -> list[str]:
    return re.findall(r"^// -----// IR Dump (.*) //----- //$", err, re.MULTILINE)


def test_pass_flags_run_in_command_line_order(cli, crafted):
    r = cli("opt", crafted, "--pass=dce", "-p", "cse", "--pass-pipeline=canonicalize,dce",
            "--pass", "cse", "--print-ir-after-all")
    assert r.rc == 0
    assert _dump_headers(r.err) == ["After dce", "After cse", "After canonicalize", "After dce",
                                    "After cse"]
    assert r.out == CANONICAL


def test_print_ir_after_named_pass_dumps_to_stderr_only(cli, crafted):
    r = cli("opt", crafted, "-p", "dce", "-p", "canonicalize", "--print-ir-after=canonicalize")
    assert _dump_headers(r.err) == ["After canonicalize"]
    assert r.err == "// -----// IR Dump After canonicalize //----- //\n" + CANONICAL
    assert r.out == CANONICAL


def test_print_ir_before_shows_the_module_the_pass_receives(cli, crafted):
    r = cli("opt", crafted, "-p", "cse", "-p", "dce", "--print-ir-before=dce")
    assert _dump_headers(r.err) == ["Before dce"]
    dumped = r.err.split("\n", 1)[1]
    assert "%e = mp.exp" not in dumped and "%dead = mp.relu" in dumped  # after cse, before dce
    assert "%dead" not in r.out


def test_ir_dump_header_shows_non_default_options(cli, crafted):
    r = cli("opt", crafted, "--pass=canonicalize{max_iterations=3}", "--print-ir-after-all",
            "--print-op-generic")
    assert _dump_headers(r.err) == ["After canonicalize{max_iterations=3}"]
    assert '"mp.exp"' in r.err


def test_print_ir_before_all(cli, crafted):
    r = cli("opt", crafted, "-p", "cse", "-p", "dce", "--print-ir-before-all")
    assert _dump_headers(r.err) == ["Before cse", "Before dce"]


@pytest.fixture
def breaking_pass(monkeypatch):
    """A pass that gives every relu a wrong result type, registered for one test."""
    load_passes()

    @dataclasses.dataclass
    class BreakRelu(Pass):
        """Make relu results the wrong shape."""

        name: ClassVar[str] = "test-break-relu"

        def run(self, module: Module, ctx: PassContext) -> None:
            for f in module.functions.values():
                for n in f.walk("mp.relu"):
                    f.set_result_type(n, 0, f.types(n)[0].with_elem("f16"))

    monkeypatch.setitem(PASSES, BreakRelu.name, BreakRelu)
    return BreakRelu


def test_verify_each_catches_a_pass_that_breaks_the_ir(cli, crafted, breaking_pass, tmp_path):
    out = tmp_path / "out.ir"
    out.write_text("KEEP ME")
    r = cli("opt", crafted, "-p", "test-break-relu", "-o", out)
    assert r.rc == 1
    # The pass broke the module, not the user's input: an internal error of that pass.
    assert f"{crafted}:7:3: error: internal error in pass 'test-break-relu' (a bug in mplower, " \
           "not in the input; please report it): the module it produced fails verification: " \
           "'mp.relu' result type tensor<4xf16> does not match the inferred type " \
           "tensor<4xf32>" in r.err
    assert out.read_text() == "KEEP ME"


def test_no_verify_each_lets_the_broken_ir_through(cli, crafted, breaking_pass):
    r = cli("opt", crafted, "-p", "test-break-relu", "--no-verify-each")
    assert r.rc == 0
    assert "%dead = mp.relu %x : (tensor<4xf32>) -> tensor<4xf16>" in r.out


def test_timing_reports_parser_passes_output_and_total(cli, crafted):
    r = cli("opt", crafted, "-p", "canonicalize", "-p", "cse", "--timing")
    assert r.rc == 0 and r.out == CANONICAL
    rows = re.findall(r"^\s+(\d+\.\d{4}) \(\s*(\d+\.\d)%\)\s+(.+)$", r.err, re.MULTILINE)
    names = [name for _, _, name in rows]
    for want in ("Parser", "canonicalize", "cse", "Output", "Total"):
        assert want in names
    assert names[-1] == "Total" and rows[-1][1] == "100.0"
    assert names.index("Parser") < names.index("canonicalize") < names.index("cse") < \
        names.index("Output")
    assert "Execution time report" in r.err
    total = float(rows[-1][0])
    assert abs(sum(float(t) for t, _, n in rows[:-1]) - total) < 1e-3 + 1e-4 * len(rows)


def _stats(err: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in err.split("\n"):
        if m := re.fullmatch(r"'(.+)'", line):
            current = out.setdefault(m.group(1), {})
        elif m := re.match(r"\s+\(S\)\s+(\d+) (\S+)", line):
            current[m.group(2)] = int(m.group(1))
    return out


def test_statistics_count_what_each_pass_did(cli, crafted):
    r = cli("opt", crafted, "-p", "canonicalize", "--statistics")
    assert "Pass statistics report" in r.err
    assert _stats(r.err) == {"canonicalize": {
        "ops-folded": 1, "ops-erased": 3, "cse-eliminated": 1, "noop-removed": 0,
        "transposes-merged": 0, "casts-removed": 0}}
    r = cli("opt", crafted, "-p", "dce", "-p", "cse", "--statistics")
    assert _stats(r.err) == {"dce": {"ops-erased": 1}, "cse": {"ops-eliminated": 1}}


def test_statistics_add_up_over_split_chunks(cli, tmp_path):
    src = tmp_path / "split.ir"
    src.write_text(CRAFTED + "// -----\n" + CRAFTED)
    r = cli("opt", src, "--split-input-file", "-p", "dce", "--statistics")
    assert _stats(r.err) == {"dce": {"ops-erased": 2}}


def test_split_input_file_joins_outputs_with_the_marker(cli, tmp_path):
    a = func_ir(f"return %x : {T}", args=f"%x: {T}", result=T, name="a")
    b = func_ir(f"return %x : {T}", args=f"%x: {T}", result=T, name="b")
    src = tmp_path / "split.ir"
    src.write_text(a + "\n// -----\n" + b)
    r = cli("opt", src, "--split-input-file")
    assert r.rc == 0
    assert r.out == print_module(parse(a)) + "// -----\n" + print_module(parse(b))
    assert cli("opt", src).rc == 0  # without the flag it is one module of two functions
    assert "@a" in cli("opt", src).out and "@b" in cli("opt", src).out


def test_split_input_file_fails_if_any_chunk_fails(cli, tmp_path):
    good = func_ir(f"return %x : {T}", args=f"%x: {T}", result=T)
    src, out = tmp_path / "split.ir", tmp_path / "out.ir"
    src.write_text(good + "// -----\n" + good.replace("return %x", "return %y"))
    out.write_text("KEEP ME")
    r = cli("opt", src, "--split-input-file", "-o", out)
    assert r.rc == 1
    assert r.err.startswith(f"{src}:6:10: error: use of undefined value '%y'")
    assert out.read_text() == "KEEP ME"


VERIFY_OK = f"""\
func.func @f(%x: {T}) -> {T} {{
  // expected-error @+1 {{{{unknown operation 'mp.rleu'}}}}
  %0 = mp.rleu %x : ({T}) -> {T}
  return %0 : {T}
}}

// -----

func.func @g(%x: {T}) -> {T} {{
  return %y : {T}  // expected-error {{{{undefined value '%y'}}}}
}}

// -----

func.func @h(%x: {T}) -> {T} {{
  return %x : {T}
}}
"""


def test_verify_diagnostics_succeeds_when_every_expectation_is_met(cli, tmp_path):
    src = tmp_path / "v.ir"
    src.write_text(VERIFY_OK)
    r = cli("opt", src, "--split-input-file", "--verify-diagnostics")
    assert (r.rc, r.out, r.err) == (0, "", "")


def test_verify_diagnostics_reports_an_unexpected_error(cli, tmp_path):
    src = tmp_path / "v.ir"
    src.write_text(VERIFY_OK.replace("return %x : tensor<4xf32>\n}\n", "return %z : "
                                     "tensor<4xf32>\n}\n"))
    r = cli("opt", src, "--split-input-file", "--verify-diagnostics")
    assert r.rc == 1
    assert r.err.startswith(f"{src}:16:10: error: unexpected error: use of undefined value '%z'")


def test_verify_diagnostics_reports_an_expectation_not_produced(cli, tmp_path):
    src = tmp_path / "v.ir"
    src.write_text(VERIFY_OK.replace("mp.rleu %x", "mp.relu %x"))
    r = cli("opt", src, "--split-input-file", "--verify-diagnostics")
    assert r.rc == 1
    assert r.err.startswith(f"{src}:2:3: error: expected error \"unknown operation 'mp.rleu'\" "
                            "on line 3 was not produced")


def test_verify_diagnostics_wrong_line_is_both_unexpected_and_unmet(cli, tmp_path):
    src = tmp_path / "v.ir"
    src.write_text(VERIFY_OK.replace("@+1 {{unknown", "@+2 {{unknown"))
    r = cli("opt", src, "--split-input-file", "--verify-diagnostics")
    assert r.rc == 1
    heads = [line for line in r.err.split("\n") if ": error: " in line]
    assert heads == [
        f"{src}:3:3: error: unexpected error: unknown operation 'mp.rleu'; did you mean 'mp.relu'?",
        (f"{src}:2:3: error: expected error \"unknown operation 'mp.rleu'\" on line 4 was not "
         "produced")]


# ---- other commands ------------------------------------------------------------------------

def test_passes_lists_core_passes_with_their_options(cli):
    r = cli("passes")
    assert r.rc == 0
    lines = r.out.split("\n")
    names = [line.split("  -  ")[0] for line in lines if line and not line.startswith(" ")]
    assert {"canonicalize", "cse", "dce"} <= set(names)
    assert names == sorted(names)
    i = lines.index(next(line for line in lines if line.startswith("canonicalize  -  ")))
    assert lines[i + 1].strip().startswith("max_fold_elements: int = 1024")
    assert lines[i + 2].strip().startswith("max_iterations: int = 10")
    assert next(line for line in lines if line.startswith("dce  -  ")) == (
        "dce  -  Erase pure operations whose results have no uses.")


def test_python_dash_m_mplower_help():
    proc = subprocess.run([sys.executable, "-m", "mplower", "--help"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0
    assert proc.stdout.startswith("usage: mplower")
    assert "opt" in proc.stdout and "passes" in proc.stdout


def test_opt_help_lists_the_instrumentation_flags(cli):
    r = cli("opt", "--help")
    assert r.rc == 0
    for flag in ("--pass-pipeline", "--print-ir-after-all", "--no-verify-each", "--timing",
                 "--statistics", "--split-input-file", "--verify-diagnostics",
                 "--print-op-generic"):
        assert flag in r.out


# ---- every command: one start (mplower.cli.common) and one command table ------------------------

STDIN_COMMANDS = {  # a command that reads a module, and the flags it needs besides the input
    "opt": ("-p", "canonicalize"),
    "report": ("--format", "json"),
    "run": ("--format", "json"),
    "bench": ("-n", "1", "--warmup", "0", "--format", "json"),
    "export": ("-o", "{out}"),
}


def _with_stdin(monkeypatch, text: str) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))


@pytest.mark.parametrize("command", sorted(STDIN_COMMANDS))
def test_every_module_command_reads_dash_as_stdin_like_the_file(cli, crafted, tmp_path,
                                                                 monkeypatch, command):
    import json

    def run(source: object, out: Path) -> tuple[int, object, bytes]:
        res = cli(command, source, *(a.format(out=out) for a in STDIN_COMMANDS[command]))
        err = res.err
        if command == "bench":  # one sample: bench says what its p99 rests on
            assert "warning: p99 rests on 1 samples" in err
            err = ""
        assert err == "", err
        shown: object = res.out
        if command == "bench":  # measured times differ from run to run; the rest may not
            shown = {k: v for k, v in json.loads(res.out).items() if k not in (
                "latency_ms", "inferences_per_s", "samples_per_s", "tokens_per_s")}
        return res.rc, shown, out.read_bytes() if out.exists() else b""

    monkeypatch.chdir(tmp_path)
    from_file = run(crafted, tmp_path / "file.onnx")
    _with_stdin(monkeypatch, CRAFTED)
    from_stdin = run("-", tmp_path / "stdin.onnx")
    assert from_file[0] == 0
    assert from_stdin == from_file
    if command == "export":
        assert len(from_stdin[2]) > 0


@pytest.mark.parametrize("command", sorted(STDIN_COMMANDS))
def test_every_module_command_locates_stdin_diagnostics_in_stdin(cli, tmp_path, monkeypatch,
                                                                  command):
    monkeypatch.chdir(tmp_path)
    _with_stdin(monkeypatch, "func.func @f() {\n  $\n}\n")
    res = cli(command, "-", *(a.format(out=tmp_path / "o.onnx") for a in STDIN_COMMANDS[command]))
    assert (res.rc, res.out) == (1, "")
    assert res.err == "<stdin>:2:3: error: unexpected character '$'\n  $\n  ^\n"
    assert not (tmp_path / "o.onnx").exists()


def test_command_table_is_the_list_of_subcommands(cli):
    import argparse

    from mplower.cli.main import COMMANDS, build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(COMMANDS) == [
        "opt", "passes", "report", "run", "bench", "import", "quantize-ckpt", "export", "perplexity",
        "target", "train", "tune"]
    for name, (_, handler) in COMMANDS.items():
        assert sub.choices[name].get_default("handler") is handler
        assert sub.choices[name].prog == f"mplower {name}"


def test_command_modules_never_import_the_cli_entry_point():
    """Shared things come from mplower.cli.common; importing mplower.cli.main back from a
    command module would be a cycle (main imports every command module)."""
    import ast

    cli_dir = Path(__file__).resolve().parent.parent / "mplower" / "cli"
    back = []
    for path in sorted(cli_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "mplower.cli.main" for n in names) and path.name != "main.py":
                back.append(f"{path.name}:{node.lineno}")
    assert back == []


def test_importing_the_cli_loads_no_numeric_or_parsing_library():
    code = ("import sys, mplower.cli.main; print(sorted({m.split('.')[0] for m in sys.modules}"
            " & {'numpy', 'numba', 'networkx', 'onnx', 'lark'}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert proc.stdout == "[]\n"
