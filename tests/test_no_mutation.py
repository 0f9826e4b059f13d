"""Running, exporting or reporting a module never changes it; the backend runs no passes.

Before, Program and export_module ran insert-casts on the module they were given when it carried
a plan that was only annotations, so the caller's module changed under it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from mplower.passes.insert_casts import materialize

from mplower.backend.executor import Program
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.parser import parse
from mplower.ir.printer import print_module
from mplower.lowering.target import load_target
from mplower.onnx.exporter import export_module
from mplower.pass_manager import PassContext, PassManager, parse_pipeline
from mplower.report.bisect import evaluate
from mplower.report.run import build_report
from mplower.report.sheet import precision_sheet

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "ir_examples").glob("*.ir"))
ANNOTATED = "assign-precision{policy=bf16}"
LOWERED = "assign-precision{policy=bf16},insert-casts,canonicalize"
# The first op each annotated-only example plans in bf16, where the executor points.
FIRST_PLANNED = {"cnn": 12, "mlp": 10, "transformer": 23}


def _module(path: Path, pipeline: str):
    module = parse(path.read_text(), str(path))
    module.path = str(path)
    PassManager(parse_pipeline(pipeline)).run(module, PassContext())
    return module


def _inputs(path: Path) -> list[np.ndarray]:
    with np.load(path.with_name(f"{path.stem}_inputs.npz")) as data:
        return [data["x"]]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_running_exporting_and_reporting_a_lowered_module_leaves_it_unchanged(path) -> None:
    module = _module(path, LOWERED)
    before = print_module(module)
    result = Program(module).run(_inputs(path))
    build_report(result, {"max_rel_l2": 0.5})
    evaluate(module, _inputs(path), {"max_rel_l2": 0.5})
    export_module(module)
    precision_sheet(module, load_target("generic"), measure=False)
    assert print_module(module) == before


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_an_annotated_only_plan_is_refused_by_the_backend_and_left_unchanged(path) -> None:
    module = _module(path, ANNOTATED)
    before = print_module(module)
    for run in (lambda: Program(module), lambda: export_module(module)):
        with pytest.raises(DiagnosticError) as e:
            run()
        (d,) = e.value.diagnostics
        assert d.message.endswith("(mp.precision = bf16): run insert-casts first "
                                  "(mplower opt --pass=insert-casts)")
        assert (d.loc.file, d.loc.line) == (str(path), FIRST_PLANNED[path.stem])
    precision_sheet(module, load_target("generic"), measure=False)  # reads the annotations
    assert print_module(module) == before


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_materialize_is_insert_casts_and_runs_only_on_an_annotated_only_plan(path) -> None:
    module = _module(path, ANNOTATED)
    assert materialize(module) is True
    assert print_module(module) == print_module(_module(path, f"{ANNOTATED},insert-casts"))
    assert materialize(module) is False  # now lowered: nothing to do


def test_run_command_materializes_its_own_copy_and_reports_the_plan(cli, tmp_path) -> None:
    src = EXAMPLES[1]
    assert src.stem == "mlp"
    annotated = tmp_path / "mlp.ir"
    annotated.write_text(print_module(_module(src, ANNOTATED)))
    for name in ("mlp.npz", "mlp_inputs.npz"):
        (tmp_path / name).write_bytes((src.parent / name).read_bytes())
    text = annotated.read_text()
    lowered = tmp_path / "lowered.ir"
    lowered.write_text(print_module(_module(src, LOWERED.removesuffix(",canonicalize"))))
    a = cli("run", annotated, "--format", "json", "--inputs", tmp_path / "mlp_inputs.npz")
    b = cli("run", lowered, "--format", "json", "--inputs", tmp_path / "mlp_inputs.npz")
    assert a.rc == b.rc == 0, a.err + b.err
    assert a.out == b.out
    assert annotated.read_text() == text


def test_no_pass_imports_the_backend() -> None:
    # Before: passes/calibrate.py imported mplower.backend.executor to run the model.
    found = []
    for path in sorted((ROOT / "passes").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {n}" for n in names if n.startswith("mplower.backend")]
    assert found == []


def test_calibrate_without_a_runner_says_what_its_caller_must_give(tmp_path) -> None:
    path = EXAMPLES[1]
    module = parse(path.read_text(), str(path))
    data = ROOT / "ir_examples" / "mlp_inputs.npz"
    with pytest.raises(DiagnosticError) as e:
        PassManager(parse_pipeline(f"calibrate{{data={data}}}")).run(module, PassContext())
    assert e.value.diagnostics[0].message == (
        "calibrate runs the model: its caller must give PassContext a runner "
        "(mplower.backend.executor.reference_runner; the mplower CLI does)")
