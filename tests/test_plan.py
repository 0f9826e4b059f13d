"""The plan value (mplower.dialect.plan): one home for the mp.* plan annotations, read and written
as one value, with the requested plan stored as structure."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mplower.backend.executor import Program
from mplower.dialect.mp import OpError
from mplower.dialect.plan import PLAN_ATTRS, Plan, Requested
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.parser import parse
from mplower.ir.printer import print_module
from mplower.ir.types import TypeAttr
from mplower.pass_manager import PassContext, PassManager, parse_pipeline

ROOT = Path(__file__).resolve().parent.parent
HOME = ROOT / "mplower" / "dialect" / "plan.py"

THREE_MATMULS = """func.func @main(%x: tensor<8x16xf32>, %w: tensor<16x16xf32>) -> tensor<8x16xf32> {
  %0 = mp.matmul %x, %w : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
  %1 = mp.matmul %0, %w : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
  %2 = mp.matmul %1, %w : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
  return %2 : tensor<8x16xf32>
}
"""


def _op(module, name: str) -> int:
    f = module.function()
    return next(n for n in f.ops() if f.data(n)["types"] and f.value_name((n, 0)) == name)


def test_plan_annotation_names_are_spelled_only_in_dialect_plan() -> None:
    # Before: "mp.precision" & co. were constants in five passes and literals in ten files.
    names = set(PLAN_ATTRS)
    found = []
    for path in sorted([*(ROOT / "mplower").rglob("*.py"), *(ROOT / "passes").rglob("*.py")]):
        if path == HOME:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert found == []


def test_a_plan_written_to_an_op_reads_back_the_same_after_print_and_parse() -> None:
    module = parse(THREE_MATMULS)
    f = module.function()
    n = _op(module, "%1")
    plan = Plan(precision="bf16", accum="f32", kernel="sparse_2_4", reason="why",
                requested=Requested("f8E4M3FN", "f32", "sparse_2_4"),
                fallback=("no-fp8-kernel", "no-sparse-kernel"), sparse_reason="not-profitable")
    plan.write(f, n)
    text = print_module(module)
    assert ('mp.requested = {precision = f8E4M3FN, accum = f32, kernel = "sparse_2_4"}'
            in text)
    assert 'mp.fallback = "no-fp8-kernel,no-sparse-kernel"' in text
    again = parse(text)
    attrs = again.function().attrs_of(_op(again, "%1"))
    assert attrs["mp.requested"] == {"precision": TypeAttr("f8E4M3FN"),
                                     "accum": TypeAttr("f32"), "kernel": "sparse_2_4"}
    assert Plan.of(attrs) == plan
    assert print_module(again) == text


def test_writing_a_plan_changes_only_the_annotations_that_differ() -> None:
    module = parse(THREE_MATMULS.replace(
        "%1 = mp.matmul %0, %w :",
        '%1 = mp.matmul %0, %w {mp.precision = "bf16", mp.reason = "r", mp.sparse_reason = "x", '
        'other = 1} :'))
    f = module.function()
    n = _op(module, "%1")
    Plan.at(f, n)._replace(accum="f32", sparse_reason=None).write(f, n)
    # The string spelling of an unchanged precision stays; new annotations follow in order.
    assert list(f.attrs_of(n).items()) == [
        ("mp.precision", "bf16"), ("mp.reason", "r"), ("other", 1),
        ("mp.accum", TypeAttr("f32"))]


def test_legalize_stores_what_was_requested_as_structure() -> None:
    module = parse(THREE_MATMULS)
    PassManager(parse_pipeline("assign-precision{policy=fp8},legalize{target=a100}")).run(
        module, PassContext())
    plan = Plan.at(module.function(), _op(module, "%1"))
    assert plan == Plan(precision="bf16", accum="f32",
                        reason="allow-list; fallback no-fp8-kernel: f8E4M3FN/f32 -> bf16/f32",
                        requested=Requested("f8E4M3FN", "f32"), fallback=("no-fp8-kernel",))
    assert str(plan.requested) == "f8E4M3FN/f32"


def test_requested_plan_in_the_old_text_form_is_a_located_error() -> None:
    module = parse(THREE_MATMULS.replace(
        "%1 = mp.matmul %0, %w :",
        '%1 = mp.matmul %0, %w {mp.requested = "f8E4M3FN/f32"} :'), "m.ir")
    with pytest.raises(DiagnosticError) as e:
        Program(module)
    (d,) = e.value.diagnostics
    assert (d.loc.file, d.loc.line, d.loc.col) == ("m.ir", 3, 3)
    assert d.message == ("'mp.matmul': attribute 'mp.requested' must be a dictionary "
                         "{precision = T, "
                         "accum = T, kernel = \"K\"} (accum and kernel optional), got "
                         "\"f8E4M3FN/f32\"")


def test_a_malformed_precision_is_an_op_error() -> None:
    with pytest.raises(OpError, match="expected an element type"):
        Plan.of({"mp.precision": "x"})
    assert Plan.of({}) == Plan()
