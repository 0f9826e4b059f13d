"""The generated docs match the registries: docs/passes.md and the generated tables of docs/ir.md."""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower import docgen
from mplower.cli.main import main as cli_main
from mplower.ir import expected
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.opdef import OPS
from mplower.ir.parser import parse
from mplower.ir.verifier import verify
from mplower.lowering.calibration import range_of
from mplower.pass_manager import PASSES, Pass, load_passes

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
STALE = f"is stale; run `{docgen.REGENERATE}` and commit the result"


def test_passes_md_is_current() -> None:
    current = (DOCS / "passes.md").read_text(encoding="utf-8")
    assert current == docgen.passes_markdown(), f"docs/passes.md {STALE}"


@pytest.mark.parametrize("section", sorted(docgen.IR_SECTIONS))
def test_ir_md_generated_section_is_current(section: str) -> None:
    text = (DOCS / "ir.md").read_text(encoding="utf-8")
    assert docgen.begin_marker(section) in text and docgen.end_marker(section) in text, (
        f"docs/ir.md lacks the {section} markers")
    expected = docgen.replace_section(text, section, docgen.IR_SECTIONS[section]())
    assert text == expected, f"the generated {section} section of docs/ir.md {STALE}"


def test_every_op_appears_in_ir_md() -> None:
    text = (DOCS / "ir.md").read_text(encoding="utf-8")
    missing = [name for name in OPS if f"`{name}`" not in text]
    assert not missing, f"ops missing from docs/ir.md: {missing}; run `{docgen.REGENERATE}`"


def test_every_builtin_pass_has_a_section_in_passes_md() -> None:
    text = (DOCS / "passes.md").read_text(encoding="utf-8")
    builtin = [n for n, cls in load_passes().items() if cls.__module__.startswith("mplower.")]
    missing = [n for n in builtin if f"\n## {n}\n" not in text]
    assert builtin and not missing, (
        f"passes missing from docs/passes.md: {missing}; run `{docgen.REGENERATE}`")


def test_passes_markdown_documents_options_statistics_and_an_example() -> None:
    text = docgen.passes_markdown()
    section = text.split("\n## canonicalize\n", 1)[1].split("\n## ", 1)[0]
    assert "| `max_fold_elements` | `int` | `1024` |" in section
    assert "| `ops-folded` | elementwise ops folded into constants |" in section
    assert "mplower opt ir_examples/mlp.ir --pass=canonicalize\n" in section


def test_passes_markdown_leaves_out_third_party_passes(monkeypatch) -> None:
    load_passes()

    @dataclasses.dataclass
    class Plugin(Pass):
        """A pass from another package."""

        name: ClassVar[str] = "zz-plugin"

    Plugin.__module__ = "some_plugin.passes"
    before = docgen.passes_markdown()
    monkeypatch.setitem(PASSES, Plugin.name, Plugin)
    assert docgen.passes_markdown() == before
    assert "zz-plugin" not in before


def test_cli_passes_markdown_prints_the_generated_page(capsys) -> None:
    assert cli_main(["passes", "--format", "markdown"]) == 0
    assert capsys.readouterr().out == docgen.passes_markdown()


def test_check_names_the_stale_file_and_write_fixes_it(tmp_path, capsys) -> None:
    for name in ("passes.md", "ir.md"):
        shutil.copy(DOCS / name, tmp_path / name)
    ir = tmp_path / "ir.md"
    ir.write_text(docgen.replace_section(ir.read_text(encoding="utf-8"), "OPS", "old table\n"),
                  encoding="utf-8")
    assert docgen.main(["--check", "--docs", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{ir} is stale" in err and docgen.REGENERATE in err
    assert "passes.md" not in err
    assert docgen.main(["--write", "--docs", str(tmp_path)]) == 0
    assert docgen.main(["--check", "--docs", str(tmp_path)]) == 0
    assert ir.read_text(encoding="utf-8") == (DOCS / "ir.md").read_text(encoding="utf-8")


def test_check_reports_missing_markers(tmp_path, capsys) -> None:
    shutil.copy(DOCS / "passes.md", tmp_path / "passes.md")
    (tmp_path / "ir.md").write_text("# IR\n", encoding="utf-8")
    assert docgen.main(["--check", "--docs", str(tmp_path)]) == 1
    assert "missing '<!-- BEGIN GENERATED" in capsys.readouterr().err
    assert docgen.main(["--write", "--docs", str(tmp_path)]) == 1
    assert (tmp_path / "ir.md").read_text(encoding="utf-8") == "# IR\n"


def test_op_table_escapes_pipes_inside_cells() -> None:
    row = next(line for line in docgen.ops_markdown().splitlines()
               if line.startswith("| `mp.gelu` |"))
    assert '`approximate: "none" \\| "tanh" = "none"`' in row
    assert row.replace("\\|", "").count("|") == 7  # six cells


def _ir_blocks() -> list:
    """Every ```mlir block of docs/*.md that is a whole file (it starts a module or function)."""
    blocks = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        for i, block in enumerate(re.findall(r"```mlir\n(.*?)```", text, re.DOTALL)):
            if re.search(r"^\s*(module|func\.func)\b", block, re.MULTILINE):
                blocks.append(pytest.param(block, id=f"{page.name}-{i}"))
    return blocks


@pytest.mark.parametrize("block", _ir_blocks())
def test_ir_examples_in_the_docs_parse_and_verify(block: str) -> None:
    expectations = expected.collect(block, "doc")
    emitted = []
    try:
        verify(parse(block, "doc"))
    except DiagnosticError as e:
        emitted = e.diagnostics
    problems = expected.check(expectations, emitted)
    assert not problems, "\n".join(d.render(block) for d in problems)


def _passes_md_commands() -> list:
    """Every `mplower ...` line of the ```sh blocks of docs/passes.md, as argument lists."""
    text = (DOCS / "passes.md").read_text(encoding="utf-8")
    return [pytest.param(shlex.split(line)[1:], id=line.split("--pass=", 1)[-1][:60])
            for block in re.findall(r"```sh\n(.*?)```", text, re.DOTALL)
            for line in block.splitlines() if line.startswith("mplower ")]


@pytest.fixture
def repository_copy(tmp_path, monkeypatch) -> Path:
    """A copy of the example models as the working folder, so that `-o` lands in tmp_path."""
    shutil.copytree(ROOT / "ir_examples", tmp_path / "ir_examples",
                    ignore=shutil.ignore_patterns("*.py", "transformer*", "cnn*"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("argv", _passes_md_commands())
def test_every_example_in_passes_md_runs_as_written(argv, repository_copy, cli) -> None:
    r = cli(*argv)
    assert (r.rc, r.err) == (0, ""), f"`mplower {shlex.join(argv)}` failed:\n{r.err}"


def test_calibrate_example_in_passes_md_records_the_ranges_numpy_computes(repository_copy,
                                                                          cli) -> None:
    # Before: the page showed `--pass=calibrate` and `calibrate{data=""}`, both an error.
    argv = next(p.values[0] for p in _passes_md_commands() if "calibrate{" in p.values[0][2])
    assert argv == ["opt", "ir_examples/mlp.ir",
                    "--pass=calibrate{data=ir_examples/mlp_inputs.npz}"]
    r = cli(*argv)
    assert r.rc == 0, r.err
    f = parse(r.out).function()
    x = np.load(ROOT / "ir_examples" / "mlp_inputs.npz")["x"]
    w1 = np.load(ROOT / "ir_examples" / "mlp.npz")["fc1.weight"]
    assert range_of(f, (f.args[0], 0)) == (float(x.min()), float(x.max()))
    first_matmul = next(f.walk("mp.matmul"))
    y = x.astype(np.float64) @ w1.astype(np.float64)
    np.testing.assert_allclose(range_of(f, (first_matmul, 0)), (y.min(), y.max()), rtol=1e-6)
