"""The pattern-rewrite API (mplower.ir.rewrite) and the `fuse` pass built on it: the fused
program prints, parses and runs, with the bits of the unfused one and of numpy."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import mplower.dialect  # noqa: F401
from mplower.backend.executor import Program
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.opdef import Trait
from mplower.ir.parser import parse
from mplower.ir.printer import print_module
from mplower.ir.rewrite import Pattern, apply_patterns, only_user
from mplower.ir.verifier import verify
from mplower.pass_manager import PassContext, PassManager, parse_pipeline

_CHAIN = """func.func @main(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
  %a = mp.neg %x : (tensor<4x8xf32>) -> tensor<4x8xf32>
  %b = mp.neg %a : (tensor<4x8xf32>) -> tensor<4x8xf32>
  %c = mp.relu %b : (tensor<4x8xf32>) -> tensor<4x8xf32>
  return %c : tensor<4x8xf32>
}
"""


def _drop_double_negation(f, n):
    (src,) = f.operands(n)
    return f.operands(src[0])[0] if f.op(src[0]) == "mp.neg" else None


def _forward(f, n, to):
    f.replace_all_uses((n, 0), to)
    f.erase(n)


def test_apply_patterns_rewrites_to_a_fixed_point_and_counts_each_application() -> None:
    module = parse(_CHAIN, "m.ir")
    f = module.function()
    counts: Counter = Counter()
    pattern = Pattern("double-neg", _drop_double_negation, _forward, ops=frozenset({"mp.neg"}))
    assert apply_patterns(f, [pattern], lambda k, n: counts.update({k: n})) == 1
    assert counts == {"double-neg": 1}
    assert [f.op(n) for n in f.ops()] == ["mp.neg", "mp.relu", "return"]  # %a is dead, kept
    assert apply_patterns(f, [pattern]) == 0  # nothing left to match


def test_a_pattern_matches_by_trait_and_sees_only_those_ops() -> None:
    module = parse(_CHAIN, "m.ir")
    f = module.function()
    seen: list[str] = []
    pattern = Pattern("look", lambda f, n: seen.append(f.op(n)), _forward,
                      trait=Trait.VALUE_PRESERVING)
    assert apply_patterns(f, [pattern]) == 0
    assert seen == ["mp.neg", "mp.neg", "mp.relu"]
    pattern = Pattern("look", lambda f, n: seen.append(f.op(n)), _forward,
                      ops=frozenset({"mp.relu"}), trait=Trait.CONTRACTION)
    seen.clear()
    apply_patterns(f, [pattern])
    assert seen == []


def test_only_user_refuses_a_value_the_function_returns_or_two_ops_read() -> None:
    module = parse(_CHAIN.replace("return %c", "return %b"), "m.ir")
    f = module.function()
    a, b = f.ops()[:2]
    assert only_user(f, (a, 0), "mp.neg") == b
    assert only_user(f, (a, 0), "mp.relu") is None
    assert only_user(f, (b, 0)) is None  # the relu and the return read it


_MLP = """func.func @main(%x: tensor<8x16xf32>, %s: tensor<8x32xf32>) -> tensor<8x32xELEM> {
  %w = mp.constant {value = dense<WEIGHTS> : tensor<16x32xf32>} : () -> tensor<16x32xf32>
  %b = mp.constant {value = dense<BIAS> : tensor<32xf32>} : () -> tensor<32xf32>
  %xc = mp.cast %x : (tensor<8x16xf32>) -> tensor<8x16xELEM>
  %wc = mp.cast %w : (tensor<16x32xf32>) -> tensor<16x32xELEM>
  %bc = mp.cast %b : (tensor<32xf32>) -> tensor<32xELEM>
  %sc = mp.cast %s : (tensor<8x32xf32>) -> tensor<8x32xELEM>
  %y = mp.matmul %xc, %wc {mp.precision = ELEM, mp.accum = f32} : (tensor<8x16xELEM>, tensor<16x32xELEM>) -> tensor<8x32xELEM>
  %yb = mp.add %y, %bc : (tensor<8x32xELEM>, tensor<32xELEM>) -> tensor<8x32xELEM>
  %r = mp.add %yb, %sc : (tensor<8x32xELEM>, tensor<8x32xELEM>) -> tensor<8x32xELEM>
  %o = mp.relu %r : (tensor<8x32xELEM>) -> tensor<8x32xELEM>
  return %o : tensor<8x32xELEM>
}
"""


def _mlp(elem: str) -> tuple[str, list[np.ndarray], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((16, 32)) * 2).astype(np.float32)
    b = rng.standard_normal(32).astype(np.float32)
    text = _MLP.replace("ELEM", elem).replace("WEIGHTS", str(w.tolist())).replace(
        "BIAS", str(b.tolist()))
    x = (rng.standard_normal((8, 16)) * 30).astype(np.float32)
    s = (rng.standard_normal((8, 32)) * 30).astype(np.float32)
    x[0, :3] = [np.nan, np.inf, -np.inf]
    return text, [x, s], w, b


def _fuse(text: str) -> tuple[str, Counter]:
    module = parse(text, "m.ir")
    pm = PassManager(parse_pipeline("fuse"))
    pm.run(module, PassContext())
    return print_module(module), pm.statistics["fuse"]


@pytest.mark.parametrize("elem", ["f32", "bf16", "f16"])
def test_fuse_prints_fused_ops_that_parse_and_run_with_the_unfused_bits(elem) -> None:
    text, inputs, w, b = _mlp(elem)
    fused, stats = _fuse(text)
    assert stats["matmul-bias"] == 1 and stats["add-relu"] == 1
    assert "mp.fused_matmul %xc, %wc, %bc" in fused and "%o = mp.add_relu %yb, %sc" in fused
    assert "mp.matmul" not in fused and "mp.relu" not in fused
    again = parse(fused, "fused.ir")
    verify(again)
    assert print_module(again) == fused  # round-trips
    plain, packed = Program(parse(text, "m.ir")), Program(again)
    expect = plain.run(inputs, reference=False).outputs[0]
    for program in (plain, packed):
        assert program.run_lowered(program.prepare_inputs(inputs))[0].tobytes() \
            == expect.tobytes()
    assert packed.run(inputs, reference=False).outputs[0].tobytes() == expect.tobytes()
    # numpy and ml_dtypes, op by op: the product in mplower's fixed order (rows of x times w
    # summed in order k = 0..15 in float32), each result rounded to the plan's format.
    t = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}[elem]

    def rounded(v):
        with np.errstate(over="ignore", invalid="ignore"):
            return v.astype(t).astype(np.float32)
    from conftest import sequential_matmul

    xs, ss = rounded(inputs[0]), rounded(inputs[1])
    with np.errstate(invalid="ignore", over="ignore"):
        y = rounded(sequential_matmul(xs, rounded(w)))
        y = rounded(y + rounded(b))
        want = np.maximum(rounded(y + ss), np.float32(0))
    assert expect.tobytes() == want.tobytes()


def test_fused_ops_are_checked_against_the_fp32_reference_of_the_unfused_ops() -> None:
    text, inputs, _, _ = _mlp("bf16")
    fused = parse(_fuse(text)[0], "fused.ir")
    ours, theirs = Program(fused).run(inputs), Program(parse(text, "m.ir")).run(inputs)
    assert ours.reference[0].tobytes() == theirs.reference[0].tobytes()
    rows = {r.step.name: r for r in ours.ops}
    plain = {r.step.name: r for r in theirs.ops}
    assert rows["%yb"].step.op == "mp.fused_matmul" and rows["%o"].step.op == "mp.add_relu"
    assert rows["%o"].rel_l2 == plain["%o"].rel_l2 and 0 < rows["%yb"].rel_l2 < 1e-2


def test_an_unfused_plan_runs_its_ops_as_they_are() -> None:
    """run_lowered fuses nothing that the pipeline did not: the residual add and its relu of
    an unfused plan are two steps."""
    text, inputs, _, _ = _mlp("f32")
    program = Program(parse(text, "m.ir"))
    program.run_lowered(program.prepare_inputs(inputs))
    assert [s.op for s in program._live][-2:] == ["mp.add", "mp.relu"]


def test_add_relu_stays_apart_where_the_relu_after_rounding_differs() -> None:
    """f8E4M3FN has no infinity: it rounds a negative overflow to NaN, which a relu after the
    rounding keeps, so the add and the relu are not fused."""
    text = """func.func @main(%x: tensor<4xf8E4M3FN>, %y: tensor<4xf8E4M3FN>) -> tensor<4xf8E4M3FN> {
  %a = mp.add %x, %y : (tensor<4xf8E4M3FN>, tensor<4xf8E4M3FN>) -> tensor<4xf8E4M3FN>
  %r = mp.relu %a : (tensor<4xf8E4M3FN>) -> tensor<4xf8E4M3FN>
  return %r : tensor<4xf8E4M3FN>
}
"""
    fused, stats = _fuse(text)
    assert stats["add-relu"] == 0 and "mp.add_relu" not in fused


_INT8 = """func.func @main(%x: tensor<3x32xi8>) -> tensor<3x6xf32> {
  %w = mp.constant {value = dense<WEIGHT> : tensor<32x6xi8>} : () -> tensor<32x6xi8>
  %acc = mp.matmul %x, %w : (tensor<3x32xi8>, tensor<32x6xi8>) -> tensor<3x6xi32>
  %y = mp.dequantize %acc {scale = dense<SCALE> : tensor<6xf32>, zero_point = 0 : i32, axis = 1} : (tensor<3x6xi32>) -> tensor<3x6xf32>
  %b = mp.constant {value = dense<BIAS> : tensor<6xf32>} : () -> tensor<6xf32>
  %r = mp.add %y, %b : (tensor<3x6xf32>, tensor<6xf32>) -> tensor<3x6xf32>
  return %r : tensor<3x6xf32>
}
"""


def test_an_int8_matmul_its_dequantize_and_bias_fuse_with_onnxs_bits() -> None:
    rng = np.random.default_rng(4)
    w = rng.integers(-128, 128, (32, 6)).astype(np.int8)
    scale = (rng.random(6) * 1e-2).astype(np.float32)
    bias = rng.standard_normal(6).astype(np.float32)
    text = _INT8.replace("WEIGHT", str(w.tolist())).replace("SCALE", str(scale.tolist())) \
        .replace("BIAS", str(bias.tolist()))
    fused, stats = _fuse(text)
    assert stats["matmul-dequantize"] == 1
    assert "%r = mp.fused_matmul %x, %w, %b {scale = dense<" in fused
    x = rng.integers(-128, 128, (3, 32)).astype(np.int8)
    program = Program(parse(fused, "fused.ir"))
    got = program.run_lowered(program.prepare_inputs([x]))[0]
    # ONNX MatMulInteger then DequantizeLinear then Add, in numpy.
    acc = x.astype(np.int64) @ w.astype(np.int64)
    expect = acc.astype(np.int32).astype(np.float32) * scale + bias
    assert got.tobytes() == expect.tobytes()
    assert program.run([x]).outputs[0].tobytes() == expect.tobytes()


def test_an_int8_matmul_and_its_dequantize_alone_fuse_with_no_addend() -> None:
    # A fused matmul's addends may be none: fuse once left a module that failed verification.
    rng = np.random.default_rng(5)
    w = rng.integers(-128, 128, (16, 4)).astype(np.int8)
    text = f"""func.func @main(%x: tensor<8x16xi8>) -> tensor<8x4xf32> {{
  %w = mp.constant {{value = dense<{w.tolist()}> : tensor<16x4xi8>}} : () -> tensor<16x4xi8>
  %acc = mp.matmul %x, %w : (tensor<8x16xi8>, tensor<16x4xi8>) -> tensor<8x4xi32>
  %y = mp.dequantize %acc {{scale = 0.01}} : (tensor<8x4xi32>) -> tensor<8x4xf32>
  return %y : tensor<8x4xf32>
}}"""
    fused, stats = _fuse(text)
    assert stats["matmul-dequantize"] == 1
    assert "%y = mp.fused_matmul %x, %w {scale = 0.01" in fused
    x = rng.integers(-128, 128, (8, 16)).astype(np.int8)
    got = Program(parse(fused, "fused.ir")).run([x]).outputs[0]
    acc = (x.astype(np.int64) @ w.astype(np.int64)).astype(np.int32)
    assert got.tobytes() == (acc.astype(np.float32) * np.float32(0.01)).tobytes()


def test_a_fused_matmul_whose_addend_is_not_along_the_columns_is_an_error() -> None:
    text = """func.func @main(%x: tensor<3x4xf32>, %w: tensor<4x6xf32>, %b: tensor<3x1xf32>) -> tensor<3x6xf32> {
  %y = mp.fused_matmul %x, %w, %b : (tensor<3x4xf32>, tensor<4x6xf32>, tensor<3x1xf32>) -> tensor<3x6xf32>
  return %y : tensor<3x6xf32>
}
"""
    with pytest.raises(DiagnosticError, match="not a float vector along the last axis"):
        verify(parse(text, "m.ir"))


def test_opt_prints_the_fused_program_after_fuse(tmp_path) -> None:
    text, _, _, _ = _mlp("bf16")
    src = tmp_path / "m.ir"
    src.write_text(text)
    done = subprocess.run([sys.executable, "-m", "mplower", "opt", str(src),
                           "--pass-pipeline=canonicalize,fuse", "--print-ir-after=fuse",
                           "-o", str(tmp_path / "out.ir")],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "IR Dump After fuse" in done.stderr and "mp.add_relu" in done.stderr
    assert (tmp_path / "out.ir").read_text().count("mp.fused_matmul") == 1


def test_no_backend_module_imports_a_pass() -> None:
    """The backend runs modules as they are: it neither runs nor imports a pass (the check
    that a plan is materialized lives in mplower.dialect.plan)."""
    import ast
    from pathlib import Path

    import mplower.backend

    found = []
    for path in sorted(Path(mplower.backend.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}: {n}" for n in names if n.startswith("mplower.passes")]
    assert found == []


@pytest.mark.parametrize("pipeline", [
    "canonicalize",
    "assign-precision{policy=bf16},insert-casts",
    "assign-precision{policy=fp8},insert-casts",
    "assign-precision{policy=int8},calibrate{data=CALIB},quantize",
])
def test_what_bench_runs_is_the_printed_fused_program_with_the_unfused_bits(pipeline,
                                                                           tmp_path) -> None:
    """The example CNN lowered, then fused and printed to a file: run_lowered (what `mplower
    bench` times) runs exactly the ops of that file, no others, with the bits of `run` and of
    the unfused plan's run_lowered, which runs its own ops unfused."""
    from mplower.backend.executor import reference_runner

    examples = Path(__file__).resolve().parent.parent / "ir_examples"
    x = np.load(examples / "cnn_inputs.npz")["x"]
    np.savez(tmp_path / "calib.npz", x=np.stack([x, x * 0.5, -x]))
    pipeline = pipeline.replace("CALIB", str(tmp_path / "calib.npz"))
    lowered = parse((examples / "cnn.ir").read_text(), str(examples / "cnn.ir"))
    PassManager(parse_pipeline(pipeline)).run(lowered, PassContext(runner=reference_runner))
    text = print_module(lowered)
    fused = parse(text, str(examples / "cnn.ir"))
    pm = PassManager(parse_pipeline("fuse"))
    pm.run(fused, PassContext())
    printed = print_module(fused)
    assert sum(pm.statistics["fuse"].values()) > 0
    program = Program(parse(printed, str(examples / "cnn.ir")))
    unfused = Program(parse(text, str(examples / "cnn.ir")))
    got = program.run_lowered(program.prepare_inputs([x]))[0]
    f = program.function
    ran = [(s.node, s.op) for s in program._live]
    assert all(f.op(node) == op for node, op in ran)  # each step is the printed op it runs
    assert {op for _, op in ran} & {"mp.fused_conv2d", "mp.fused_matmul", "mp.add_relu",
                                    "mp.fake_quant"}
    # Every op of the file that does not fold into a constant runs, once, in its order.
    runtime = [(s.node, s.op) for s in program._runtime
               if s.node in {node for node, _ in ran}]
    assert ran == runtime
    expect = unfused.run_lowered(unfused.prepare_inputs([x]))[0]
    assert got.tobytes() == expect.tobytes()
    assert got.tobytes() == program.run([x], reference=False).outputs[0].tobytes()
    assert got.tobytes() == unfused.run([x], reference=False).outputs[0].tobytes()
    assert [s.op for s in unfused._live if s.op.startswith("mp.fused")] == []
