"""Each op category and format list is written in one place; everything else derives from it.

The categories (contractions, conversions, value-preserving ops, ...) are computed from the
traits each op declares in mplower/dialect/mp/; these tests read the source tree and fail where
a category is spelled out again, so that adding an op cannot leave a stale copy behind.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from mplower.dialect import mp
from mplower.ir.opdef import OPS, Trait, ops_with
from mplower.numerics import formats

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "mplower").rglob("*.py"), *(ROOT / "passes").rglob("*.py")])
HOME = ROOT / "mplower" / "dialect" / "mp" / "__init__.py"
PAIR = re.compile(r"""["']mp\.(matmul|conv2d)["']\s*,\s*["']mp\.(?!\1)(matmul|conv2d)["']""")
CATEGORIES = {name: getattr(mp, name) for name in (
    "CONTRACTIONS", "CONVERSIONS", "DATA_MOVEMENT", "ACCUMULATING", "COMPUTE_HEAVY", "QUANTIZABLE",
    "TYPE_CARRYING", "VALUE_PRESERVING", "WEIGHTED")}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _op_name_literals(tree: ast.AST) -> list[tuple[int, frozenset[str]]]:
    """(line, names) of every tuple/list/set literal of two or more registered op names."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2:
            names = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if len(names) == len(node.elts) and all(n in OPS for n in names):
                out.append((node.lineno, frozenset(names)))
    return out


def test_matmul_conv2d_pair_is_spelled_only_in_the_dialect() -> None:
    found = [f"{_rel(p)}:{text[:m.start()].count(chr(10)) + 1}"
             for p in SOURCES if p.parent != HOME.parent
             for text in [p.read_text()] for m in PAIR.finditer(text)]
    assert found == []


def test_the_pair_pattern_finds_every_spelling() -> None:
    # The grep above must not pass by missing a spelling.
    for text in ('("mp.matmul", "mp.conv2d")', "{'mp.conv2d', 'mp.matmul'}",
                 '["mp.matmul",\n     "mp.conv2d"]', 'frozenset({"mp.conv2d", "mp.matmul"})'):
        assert PAIR.search(text), text
    assert not PAIR.search('("mp.matmul", "mp.matmul")')


def test_no_module_spells_out_an_op_category() -> None:
    """No literal set of op names outside the dialect equals a category derived from traits."""
    categories = {v: k for k, v in CATEGORIES.items()} | {frozenset(mp.WEIGHTED): "WEIGHTED"}
    found = [f"{_rel(p)}:{line} spells {categories[names]}"
             for p in SOURCES if p.parent != HOME.parent
             for line, names in _op_name_literals(ast.parse(p.read_text()))
             if names in categories]
    assert found == []


def test_category_and_format_names_are_assigned_only_in_their_home() -> None:
    formats_py = ROOT / "mplower" / "numerics" / "formats.py"
    home = {name: HOME for name in CATEGORIES} | {
        "QUANTIZED_OPS": HOME, "WEIGHT_OPERAND": HOME, "COMPUTE_FORMATS": formats_py, "NARROW_FLOATS": formats_py,
        "QUANT_INTS": formats_py, "QUANT_STORAGE": formats_py, "_NARROW": None,
        "_QUANT_TYPES": HOME, "QUANT_FORMATS": ROOT / "mplower" / "numerics" / "quant.py",
        "DEQUANT_FORMATS": ROOT / "mplower" / "numerics" / "quant.py"}
    found = []
    for p in SOURCES:
        for node in ast.parse(p.read_text()).body:  # module level: Trait's members are not sets
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            found += [f"{_rel(p)}:{node.lineno} {t.id}" for t in targets
                      if isinstance(t, ast.Name) and t.id in home and home[t.id] != p
                      and not (home[t.id] == HOME and p.parent == HOME.parent)]
    assert found == []


def test_op_categories_are_the_traits_they_were_written_as() -> None:
    # The sets as the modules spelled them before they were derived; a changed trait shows here.
    assert mp.CONTRACTIONS == {"mp.matmul", "mp.conv2d"}
    assert mp.COMPUTE_HEAVY == {"mp.matmul", "mp.conv2d"}
    assert mp.QUANTIZABLE == {"mp.matmul", "mp.conv2d"}
    assert mp.WEIGHTED == ("mp.matmul", "mp.conv2d")
    assert {OPS[n].weight_operand for n in mp.WEIGHTED} == {mp.WEIGHT_OPERAND} == {1}
    assert mp.ACCUMULATING == {"mp.matmul", "mp.conv2d", "mp.reduce_sum", "mp.reduce_mean",
                               "mp.cumsum", "mp.scatter_elements_add", "mp.scatter_nd_add",
                               "mp.scatter_elements", "mp.scatter_nd"}
    # Comparisons and predicates carry their i1 result: the precision passes never lower them.
    assert mp.TYPE_CARRYING == {"mp.constant", "mp.cast", "mp.quantize", "mp.dequantize",
                                "mp.fake_quant", "mp.scaled_quant", "mp.sparse_encode", "mp.equal",
                                "mp.less", "mp.less_equal", "mp.greater", "mp.greater_equal",
                                "mp.isnan", "mp.isinf", "mp.dynamic_quantize",
                                "mp.dynamic_quantize_scale", "mp.dynamic_quantize_zero_point"}
    assert mp.CONVERSIONS == {"mp.cast", "mp.quantize", "mp.dequantize", "mp.fake_quant",
                              "mp.scaled_quant"}
    assert mp.DATA_MOVEMENT == {"mp.reshape", "mp.transpose", "mp.concat", "mp.slice",
                                "mp.flatten", "mp.sparse_encode", "mp.gather",
                                "mp.gather_elements", "mp.gather_nd", "mp.expand", "mp.trilu",
                                "mp.split"}
    # max_pool2d picks operand values too, but a window of padding alone yields -inf, which
    # f8E4M3FN cannot hold: its results are rounded, so it is not value-preserving.
    assert mp.VALUE_PRESERVING == {"mp.reshape", "mp.transpose", "mp.slice", "mp.concat",
                                   "mp.flatten", "mp.maximum", "mp.minimum", "mp.relu",
                                   "mp.neg", "mp.reduce_max", "mp.gather",
                                   "mp.gather_elements", "mp.gather_nd", "mp.expand",
                                   "mp.trilu", "mp.where", "mp.split",
                                   "mp.relu_grad", "mp.fake_quant_grad", "mp.reduce_min",
                                   "mp.topk", "mp.abs", "mp.clip",
                                   "mp.thresholded_relu"}
    assert "mp.max_pool2d" not in mp.VALUE_PRESERVING
    assert ops_with(Trait.PURE) == set(OPS)


def test_format_lists_derive_from_the_formats_table() -> None:
    from mplower.lowering.target import COMPUTE_FORMATS
    from mplower.numerics.quant import DEQUANT_FORMATS, QUANT_FORMATS
    from mplower.onnx import exporter

    assert formats.QUANT_INTS == ("i8", "ui8", "i4")
    assert formats.QUANT_STORAGE == ("i8", "ui8", "i4", "i32")
    assert QUANT_FORMATS == ("i8", "ui8", "i4", "f8E4M3FN", "f8E5M2", "f4E2M1FN")
    assert DEQUANT_FORMATS == ("i8", "ui8", "i4", "i32", "f8E4M3FN", "f8E5M2", "f4E2M1FN")
    assert COMPUTE_FORMATS is formats.COMPUTE_FORMATS
    assert OPS["mp.matmul"].precisions == set(formats.COMPUTE_FORMATS)
    assert exporter.NARROW_FLOATS is formats.NARROW_FLOATS
    assert formats.NARROW_FLOATS == {"tf32", "f16", "bf16", "f8E4M3FN", "f8E5M2", "f6E2M3FN",
                                     "f6E3M2FN", "f4E2M1FN", "f8E8M0FNU"}


def _imports(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
            mods.update(f"{node.module}.{a.name}" for a in node.names)
    return mods


def test_the_ir_layer_never_imports_a_dialect() -> None:
    found = {_rel(p): sorted(m for m in _imports(p) if m.startswith("mplower.dialect"))
             for p in (ROOT / "mplower" / "ir").glob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}


def test_no_module_imports_private_names_of_the_dialect() -> None:
    private = re.compile(r"from mplower\.dialect\.\w+ import[^\n]*\b_\w+")
    found = [_rel(p) for p in [*SOURCES, *(ROOT / "benchmarks").rglob("*.py")]
             if private.search(p.read_text())]
    assert found == []


def test_verifying_with_no_dialect_registered_names_the_missing_dialect(tmp_path: Path) -> None:
    """Parse and verify from the IR layer alone: the op is reported, not silently accepted."""
    (tmp_path / "m.ir").write_text(
        "func.func @f(%x: tensor<2xf32>) -> tensor<2xf32> {\n"
        "  %y = mp.relu %x : (tensor<2xf32>) -> tensor<2xf32>\n"
        "  return %y : tensor<2xf32>\n}\n")
    code = (
        "import sys\n"
        "from mplower.ir.diagnostics import DiagnosticError\n"
        "from mplower.ir.parser import parse\n"
        "from mplower.ir.verifier import verify\n"
        "m = parse(open(sys.argv[1]).read(), 'm.ir')\n"
        "try:\n"
        "    verify(m)\n"
        "except DiagnosticError as e:\n"
        "    print([d.message for d in e.diagnostics])\n"
        "print(sorted(k for k in sys.modules if k.startswith('mplower.dialect')))\n"
        "import mplower.dialect\n"
        "verify(m)\n"
        "print('verified')\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.ir")],
                       capture_output=True, text=True, check=True)
    assert r.stdout.splitlines() == [
        ("[\"unknown operation 'mp.relu': no op of dialect 'mp' is registered "
         "(import mplower.dialect)\"]"),
        "[]",
        "verified",
    ]


def _attribute_name_literals(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string literal that is exactly an `mp.` name but no op's."""
    name = re.compile(r"mp\.[a-z_0-9]+")
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and name.fullmatch(node.value) and node.value not in OPS]


def test_annotation_names_are_declared_only_in_the_plan() -> None:
    """`mp.policy`, `mp.target`, `mp.keep_io_types`, ... are constants of dialect/plan.py;
    every other module imports them, so a reader cannot misspell what a writer wrote."""
    home = ROOT / "mplower" / "dialect" / "plan.py"
    found = [f"{_rel(p)}:{line} {text}" for p in SOURCES if p != home
             for line, text in _attribute_name_literals(p)]
    assert found == []
    declared = {text for _, text in _attribute_name_literals(home)}
    assert {"mp.policy", "mp.target", "mp.keep_io_types", "mp.precision", "mp.weights",
            "mp.scaling"} <= declared


def test_legalize_records_the_f16_accumulator_fallback_the_backend_needs(tmp_path: Path) -> None:
    """An f16 accumulator on f32 operands, which a target sheet may offer, is more than the
    backend emulates exactly: legalize falls back and records it, once, in the plan."""
    from mplower.dialect.plan import Plan, Requested
    from mplower.ir.parser import parse
    from mplower.pass_manager import PassManager, parse_pipeline

    target = tmp_path / "t.toml"
    target.write_text('[target]\nbandwidth = 1e9\n\n[formats.f32]\ndense = 1e9\n'
                      'accum = ["f32", "f16"]\n\n[default]\ndense = ["f32"]\n')
    module = parse(
        "func.func @f(%a: tensor<2x3xf32>, %b: tensor<3x2xf32>) -> tensor<2x2xf32> {\n"
        "  %y = mp.matmul %a, %b {mp.precision = f32, mp.accum = f16}"
        " : (tensor<2x3xf32>, tensor<3x2xf32>) -> tensor<2x2xf32>\n"
        "  return %y : tensor<2x2xf32>\n}\n", str(tmp_path / "m.ir"))
    PassManager(parse_pipeline(f"legalize{{target={target}}}")).run(module)
    f = module.function(None)
    (mm,) = [n for n in f.ops() if f.op(n) == "mp.matmul"]
    plan = Plan.at(f, mm)
    assert (plan.precision, plan.accum, plan.fallback) == ("f32", "f32", ("no-f16-accum",))
    assert plan.requested == Requested("f32", "f16")


_ANNOTATED = (
    "func.func @main(%x: tensor<2x3xf32>) -> tensor<2x3xf32> {\n"
    "  %y = mp.relu %x {mp.precision = bf16} : (tensor<2x3xf32>) -> tensor<2x3xf32>\n"
    "  return %y : tensor<2x3xf32>\n}\n")


def test_run_names_the_insert_casts_step_it_runs_in_its_output(cli, tmp_path: Path) -> None:
    """STYLE rule 8: `run` of a plan that is only annotations runs insert-casts and says so on
    stderr; a materialized module runs as written, silently, with the same report."""
    import json

    path = tmp_path / "m.ir"
    path.write_text(_ANNOTATED)
    res = cli("run", path, "--report", tmp_path / "r.json", "--format", "json")
    assert res.rc == 0, res.err
    assert res.err == (f"{path}: note: run materialized the plan with insert-casts (the module "
                       "has mp.precision annotations but no casts; `mplower opt "
                       "--pass=insert-casts` prints the module that ran)\n")
    report = json.loads((tmp_path / "r.json").read_text())
    assert [o["op"] for o in report["ops"]] == ["mp.cast", "mp.relu", "mp.cast"]

    lowered = tmp_path / "lowered.ir"
    assert cli("opt", path, "--pass=insert-casts", "-o", lowered).rc == 0
    again = cli("run", lowered, "--report", tmp_path / "r2.json", "--format", "json")
    assert again.rc == 0 and again.err == ""
    assert json.loads((tmp_path / "r2.json").read_text()) == report


def test_export_names_the_insert_casts_step_it_runs(cli, tmp_path: Path) -> None:
    path = tmp_path / "m.ir"
    path.write_text(_ANNOTATED)
    res = cli("export", path, "--format", "onnx", "-o", tmp_path / "m.onnx")
    assert res.rc == 0, res.err
    assert res.err.startswith(f"{path}: note: export materialized the plan with insert-casts")


def test_the_exporter_dispatches_through_its_table() -> None:
    """No op-name branch in the exporter's `_emit`: each op is a row of EMITTERS."""
    from mplower.onnx import exporter

    tree = ast.parse((ROOT / "mplower" / "onnx" / "exporter" / "core.py").read_text())
    (emit,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_emit"]
    names = [n.value for n in ast.walk(emit) if isinstance(n, ast.Constant) and n.value in OPS]
    assert names == []
    assert {"mp.trilu", "mp.matmul", "mp.add", "mp.softmax", "mp.log_softmax"} <= set(
        exporter.EMITTERS)
    assert exporter.EMITTERS["mp.softmax"] is exporter.EMITTERS["mp.log_softmax"]
